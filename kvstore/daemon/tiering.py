"""Tier movement between DRAM and NVMe, as the daemon drives it: the demoter
(:mod:`kvstore.daemon.demoter`), promotion and prefetch (:mod:`kvstore.daemon.promotion`), and
recovery, durable commits and the write-out (:mod:`kvstore.daemon.write_out`), over one
:class:`~kvstore.daemon.residency.Residency`.

A block can live in DRAM, on NVMe, or both (``Block.on_nvme``: an NVMe copy exists, so dropping
the DRAM copy loses nothing). The residency decides and records where a block is; the pieces
here move the bytes on the NVMe tier's threads with no lock held. A block whose slot is being
copied is ``busy``: it can still be read where it is, but it is neither evicted nor deleted
until the copy ends, so a slot is never reused under an I/O.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from kvstore.config import DramConfig, NvmeConfig
from kvstore.daemon.demoter import Demoter, NvmeCopies
from kvstore.daemon.index import Block
from kvstore.daemon.metrics import Metrics
from kvstore.daemon.promotion import Promoter
from kvstore.daemon.residency import Residency
from kvstore.daemon.write_out import NvmeStore
from kvstore.policy import LoadPolicy

__all__ = ["Tiering", "NvmeCopies"]


class Tiering:
    """The daemon's NVMe side: one demoter, one promoter, one store, wired over ``res``.
    ``clock`` (seconds, monotonic) gives prefetch and make-resident deadlines."""

    def __init__(self, res: Residency, copies: NvmeCopies, cfg: NvmeConfig, dram_cfg: DramConfig, *,
                 metrics: Metrics, policy: LoadPolicy, clock: Callable[[], float] = time.monotonic) -> None:
        self.nvme = copies.nvme
        self.cfg = cfg
        self.kick = copies.kick
        self.promoter = Promoter(res, self.nvme, cfg, metrics=metrics, policy=policy, clock=clock)
        self.demoter = Demoter(res, copies, cfg, dram_cfg, metrics=metrics, policy=policy,
                               made_room=self.promoter.drive)
        self.store = NvmeStore(res, self.nvme, cfg, metrics=metrics)
        self.stopping = self.demoter.stopping
        self._writer: threading.Thread | None = None  # write_out started by a drain
        # what the servicer and the transfer sides call
        self.recover = self.store.recover
        self.remember = self.store.remember
        self.write_out = self.store.write_out
        self.run_round = self.demoter.run_round
        self.make_resident = self.promoter.make_resident
        self.promote = self.promoter.promote
        self.promote_soon = self.promoter.promote_soon
        self.prefetch = self.promoter.prefetch
        self.prefetch_status = self.promoter.prefetch_status

    @property
    def draining(self) -> bool:
        """The demoter went over the high watermark and is not yet under the low one."""
        return self.demoter.draining

    def start(self) -> None:
        self.demoter.start()

    def committed(self, blocks: list[Block]) -> None:
        """Blocks were just committed to DRAM: with ``nvme.durable_commit`` write them through
        before the Commit is answered; either way wake the demoter."""
        if self.cfg.durable_commit:
            self.store.persist(blocks)
        self.kick.set()

    def close(self, deadline: float) -> None:
        """Shut down by ``deadline`` (``time.monotonic()``): stop demoting, write what only DRAM
        holds to NVMe (see :meth:`NvmeStore.write_out`), save recency, commit and close the
        tier. Call once nothing writes any more (the RPC server and the transfer listener are
        stopped)."""
        self.promoter.stopping.set()
        self.demoter.stop(deadline)
        if self._writer is not None:  # a drain's write-out: it stops at its next batch
            self._writer.join(max(0.0, deadline - time.monotonic()))
        self.store.write_out(deadline)
        self.store.save_recency()
        self.nvme.close()

    def start_write_out(self) -> None:
        """Drain before a shutdown: write DRAM out in the background while reads go on, until
        done or :meth:`close`; the shutdown then has less to write."""
        if self._writer is None and not self.stopping.is_set():
            self._writer = threading.Thread(target=self.store.write_out, args=(float("inf"), self.stopping),
                                            name="write-out", daemon=True)
            self._writer.start()
