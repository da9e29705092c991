"""Keeps the hottest DRAM blocks in the HBM pool as well, for workers to copy device-to-device.

Inclusive: a block has an HBM copy only while its DRAM copy lives, so dropping a block from DRAM
frees its HBM slot and nothing is ever served from HBM alone. A block becomes hot when it has
been read (Acquire) ``hbm.admit_reads`` times; a background thread copies it on the pool's
promote streams, evicting the least recently read HBM copies to make room. Workers map the pool
through the handle the daemon passes over its arena socket and find each block's HBM offset in
AcquireResponse.hbm_offsets.
"""

from __future__ import annotations

import json
import logging
import socket
import threading

from kvstore.daemon.metrics import Metrics
from kvstore.daemon.residency import Residency
from kvstore.tiers.arena import send_fd
from kvstore.tiers.hbm import HbmTier

log = logging.getLogger("kvstore.hbm")


class HbmCache:
    """The thread that copies hot DRAM blocks into the HBM pool; the residency (built with the
    same ``hbm``) plans each copy and records it."""

    def __init__(self, res: Residency, hbm: HbmTier, *, metrics: Metrics) -> None:
        self.res = res
        self.hbm = hbm
        self.metrics = metrics
        self.kick = threading.Event()
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="hbm-promoter", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def close(self) -> None:
        self.stopping.set()
        self.kick.set()
        self.thread.join(5.0)

    def _loop(self) -> None:
        while not self.stopping.is_set():
            self.kick.wait(0.05)
            self.kick.clear()
            try:
                self.run_round()
            except Exception:  # noqa: BLE001 - HBM is a cache: DRAM keeps serving
                log.exception("HBM promotion round failed")

    def run_round(self) -> int:
        """Copy the blocks that became hot since the last round; returns how many gained an HBM
        copy. A copy that fails (or raises) frees its HBM slots and leaves the blocks as they
        were: the residency's ``complete_hbm_copy`` runs whatever happens."""
        moves = self.res.prepare_hbm_copy()
        if not moves:
            return 0
        ok = False
        try:
            t = self.hbm.promote([(m.slot, m.view) for m in moves])
            t.wait()
            ok = t.error is None
        finally:
            n = self.res.complete_hbm_copy(moves, ok)
        self.metrics.promotions.labels(src="dram", dst="hbm").inc(n)
        return n

    def handout(self, conn: socket.socket) -> None:
        """Send the pool's handle (JSON; the emulated pool's memfd rides along by SCM_RIGHTS)."""
        h = self.hbm.ipc_handle()
        fd = h.pop("fd", None)
        body = json.dumps({k: (v.hex() if isinstance(v, bytes) else v) for k, v in h.items()}).encode()
        if fd is None:  # CUDA: the handle is all bytes and ints
            conn.sendall(len(body).to_bytes(8, "little") + body)
        else:
            send_fd(conn, fd, len(body))
            conn.sendall(body)
