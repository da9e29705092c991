"""The NVMe tier across restarts: recovery of the index at start, namespace descriptions,
durable commits (write-through before the Commit is answered), the write-out of DRAM-only
blocks at a drain or shutdown, and the recency saved for the next start. Copies are planned by
the residency (:meth:`Residency.prepare_copy`) and reported back when they land
(:meth:`Residency.complete_copy`)."""

from __future__ import annotations

import logging
import threading
import time

from kvstore.config import NvmeConfig
from kvstore.daemon.index import Block, NsState
from kvstore.daemon.metrics import Metrics
from kvstore.daemon.ns_file import NamespaceFile
from kvstore.daemon.nvme_io import NvmeIo, outcome
from kvstore.daemon.residency import Move, Residency
from kvstore.errors import Code, KVError
from kvstore.tiers.base import KeyedTier
from kvstore.tiers.nvme import IoResult

log = logging.getLogger("kvstore.daemon.tiering")
FLUSH_BATCH_BYTES = 64 << 20  # one put (and one index transaction) of the shutdown write-out


class NvmeStore:
    def __init__(self, res: Residency, nvme: KeyedTier, cfg: NvmeConfig, *, metrics: Metrics) -> None:
        self.res = res
        self.metrics = metrics
        self.nvme = nvme
        self.cfg = cfg
        self.io = NvmeIo(nvme, cfg.io_timeout_s, cfg.encodes)
        self.ns_file = NamespaceFile(nvme.dir)

    # --- restart ----------------------------------------------------------------------------
    def recover(self) -> int:
        """Rebuild the index of every block the NVMe tier holds; returns blocks recovered."""
        for ns in self.ns_file.read():
            self.res.ns_state(ns)
        entries = sorted(self.nvme.entries(), key=lambda e: e.atime)
        orphans, lost = self.res.recover(entries, self.res.namespaces.get)
        if orphans:
            log.warning("dropping %d NVMe blocks of namespaces this daemon cannot describe", len(orphans))
            self.nvme.delete(orphans)
        if lost:
            log.warning("reclaiming %d NVMe blocks unreachable by a prefix read (their chain's head is gone)", len(lost))
            self.nvme.delete([b.key for b in lost])
        return len(entries) - len(orphans) - len(lost)

    def remember(self, st: NsState) -> None:
        """Persist a namespace's description so its NVMe blocks are recovered after a restart
        (OSError if the file cannot be written; the next Register tries again)."""
        self.ns_file.remember(st.ns)

    # --- durable commit ---------------------------------------------------------------------
    def persist(self, blocks: list[Block]) -> None:
        """Write committed DRAM blocks through to NVMe before the commit is acknowledged."""
        moves = self.res.prepare_copy(blocks)
        batch = None
        try:
            batch = self.io.submit(self.io.items(moves)) if moves else None
            if batch is not None:
                self.io.wait(batch, len(moves))
        finally:
            self._copied(moves, batch)
        if moves and (batch is None or batch.error is not None):
            raise KVError(Code.UNAVAILABLE, f"commit: blocks are in DRAM but not durable on NVMe: "
                                            f"{batch.error if batch else 'NVMe tier disabled'}")

    def _copied(self, moves: list[Move], batch) -> None:
        landed = self.res.complete_copy(moves, *outcome(batch), self.cfg.namespace_quota_bytes)
        self.io.delete(landed.delete)
        self.metrics.evictions.labels(tier="nvme", reason="capacity").inc(landed.nvme_evicted)

    # --- write-out --------------------------------------------------------------------------
    def write_out(self, deadline: float, cancel: threading.Event | None = None) -> int:
        """Copy DRAM-only blocks to NVMe until ``deadline``, heads of chains before their tails
        and most recent first (:meth:`Residency.dram_only_chains`), in batches of
        ``FLUSH_BATCH_BYTES`` (each committed to the index in one transaction), two in flight, so
        that however far it gets, the next start recovers prefixes (a child whose parent's batch
        had not landed is reclaimed at that start). Stops early once ``cancel`` is set. Returns
        blocks written."""
        if not self.nvme.enabled:
            return 0
        t0 = time.monotonic()
        res = self.res
        order = res.dram_only_chains()
        total, written, failed = len(order), 0, set()
        stride = max(1, FLUSH_BATCH_BYTES // max((res.namespaces[b.ns_id].block_bytes for b in order), default=1))
        flying: list[tuple[list[Move], object]] = []
        i, why = 0, "done"

        def land() -> bool:
            """Wait for the oldest batch in flight; False if it did not end in time."""
            nonlocal written, why
            moves, batch = flying[0]
            if cancel is not None:
                self.io.wait(batch, len(moves))
            elif not batch.wait(max(0.0, deadline - time.monotonic())):
                why = "shutdown grace spent (batches in flight complete while the tier closes)"
                return False
            flying.pop(0)
            self._copied(moves, batch)
            ok = {k for k, r in batch.results.items() if r in (IoResult.OK, IoResult.PRESENT)}
            written += len(ok)
            failed.update(id(m.block) for m in moves if m.key not in ok)
            if any(r is IoResult.NO_SPACE for r in batch.results.values()):
                why = "NVMe tier full"
            return True

        while i < total and why == "done":
            if deadline - time.monotonic() <= 0:
                why = "shutdown grace spent"
                break
            if cancel is not None and cancel.is_set():
                why = "the shutdown takes over"
                break
            chunk = []
            for b in order[i:i + stride]:
                if b.parent is not None and id(b.parent) in failed:
                    failed.add(id(b))  # its parent did not make it: it would be unreachable
                else:
                    chunk.append(b)
            i += stride
            moves = res.prepare_copy(chunk)
            batch = self.io.submit(self.io.items(moves)) if moves else None
            if moves and batch is None:
                why = "NVMe tier disabled"
                self._copied(moves, None)
                break
            if moves:
                flying.append((moves, batch))
            if len(flying) == 2 and not land():
                break
        while flying and land():
            pass
        log.info("%d of %d DRAM-only blocks written to NVMe %s in %.3f s (%s)", written, total,
                 "while draining" if cancel is not None else "at shutdown", time.monotonic() - t0, why)
        return written

    def save_recency(self) -> None:
        """Give every NVMe block an access time in the order of its recency here (lookups and
        reads of its DRAM copy included), so the next start rebuilds the same LRU order rather
        than the order of NVMe writes and reads alone. The times are spaced by 1 us up to now."""
        if not self.nvme.enabled:
            return
        blocks = self.res.nvme_by_recency()
        now, n = time.time(), len(blocks)
        try:
            self.nvme.set_atimes((b.key, now - (n - i) * 1e-6) for i, b in enumerate(blocks))
        except Exception as e:  # noqa: BLE001 - the index keeps write times; nothing is lost
            log.error("NVMe access times not saved: %s", e)
