"""Background demotion from DRAM to NVMe between watermarks: the demoter thread asks the
residency for a batch of least recent leaves (:meth:`Residency.prepare_demotion`), writes them
with no lock held, and reports the outcome (:meth:`Residency.complete_demotion`)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from kvstore.config import DramConfig, NvmeConfig
from kvstore.daemon.index import Block
from kvstore.daemon.metrics import Metrics
from kvstore.daemon.nvme_io import NvmeIo, outcome
from kvstore.daemon.residency import Residency
from kvstore.daemon.seams import DramOnly
from kvstore.policy import LoadPolicy
from kvstore.tiers.base import KeyedTier

log = logging.getLogger("kvstore.daemon.tiering")
BATCH_BYTES = 256 << 20  # at most this much DRAM per demotion batch


class NvmeCopies(DramOnly):
    """The NVMe side of :class:`kvstore.daemon.seams.LowerTiers`: what the residency asks about
    NVMe copies when it evicts or deletes (under its lock). Built before the core; wakes the
    demoter through ``kick`` and never calls back."""

    def __init__(self, nvme: KeyedTier, cfg: NvmeConfig) -> None:
        self.nvme = nvme
        self.cfg = cfg
        self.kick = threading.Event()  # set: the demoter should run a round now

    def holds_copy(self, b: Block) -> bool:
        return self.nvme.enabled

    def admits(self, b: Block) -> bool:
        """NVMe admission: looked up ``admit_after_hits`` times, or the head of children that are
        on NVMe or on their way there (dropping it would strand them there, unreachable)."""
        return b.hits >= self.cfg.admit_after_hits or any(k.on_nvme or k.busy for k in b.kids)

    def must_demote(self, b: Block) -> bool:
        if b.on_nvme or not self.nvme.enabled or not self.admits(b):
            return False
        self.kick.set()
        return True

    def delete_copy(self, b: Block) -> None:
        try:
            self.nvme.delete([b.key])
        except Exception as e:  # noqa: BLE001 - the tier disables itself; DRAM keeps serving
            log.error("NVMe delete failed: %s", e)


class Demoter:
    """The demoter thread. ``made_room`` is called after each batch lands (prefetches waiting
    for DRAM go on)."""

    def __init__(self, res: Residency, copies: NvmeCopies, cfg: NvmeConfig, dram_cfg: DramConfig, *,
                 metrics: Metrics, policy: LoadPolicy, made_room: Callable[[], None]) -> None:
        self.res = res
        self.nvme = copies.nvme
        self.io = NvmeIo(self.nvme, cfg.io_timeout_s, cfg.encodes)
        self.cfg = cfg
        self.dram_cfg = dram_cfg  # the demotion watermarks
        self.metrics = metrics
        self.policy = policy
        self.kick = copies.kick
        self.admits = copies.admits
        self.made_room = made_room
        self.stopping = threading.Event()
        self.draining = False  # demoting: went over the high watermark, not yet under the low one
        self.thread = threading.Thread(target=self._loop, name="demoter", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self, deadline: float) -> None:
        """Stop after the round in progress, waiting until ``deadline`` (``time.monotonic()``)."""
        self.stopping.set()
        self.kick.set()
        if self.thread.ident is not None:  # started (a Demoter driven by run_round never is)
            self.thread.join(max(0.0, deadline - time.monotonic()))

    def _loop(self) -> None:
        while not self.stopping.is_set():
            self.kick.wait(0.05)
            self.kick.clear()
            try:
                self.run_round()
            except Exception:  # noqa: BLE001 - keep the daemon serving from DRAM
                log.exception("demotion round failed")

    def run_round(self) -> int:
        """What the demoter does each time it wakes: if the NVMe tier disabled itself, forget
        the blocks only it held; else demote batches until DRAM is under the low watermark (or
        nothing more can move). Returns the batches run."""
        if not self.nvme.enabled:
            self.res.nvme_lost()
            return 0
        n = 0
        while not self.stopping.is_set() and self._batch():
            n += 1
        return n

    def _batch(self) -> bool:
        """One batch of demotions; False when there was nothing to do."""
        d = self.dram_cfg
        plan = self.res.prepare_demotion(d.demote_high_watermark, d.demote_low_watermark, self.draining,
                                         self.admits, BATCH_BYTES)
        self.draining = plan.draining
        if plan.moves is None:
            log.debug("demotion: nothing to do (draining=%s)", plan.draining)
            return False
        if not plan.moves:
            return True
        t0 = time.perf_counter()
        batch = None
        try:
            batch = self.io.put(self.io.items(plan.moves))
        finally:
            landed = self.res.complete_demotion(plan.moves, *outcome(batch), self.cfg.namespace_quota_bytes)
        self.io.delete(landed.delete)
        self.metrics.demotions.labels(src="dram", dst="nvme").inc(landed.moved)
        self.metrics.evictions.labels(tier="nvme", reason="capacity").inc(landed.nvme_evicted)
        self.made_room()
        if batch is not None and batch.nbytes:
            self.policy.observe("nvme", batch.nbytes, time.perf_counter() - t0)
        log.debug("demoted %d blocks in %.4f s (%s)", len(plan.moves), time.perf_counter() - t0,
                  "ok" if batch is not None and batch.error is None else batch.error if batch else "tier off")
        return True
