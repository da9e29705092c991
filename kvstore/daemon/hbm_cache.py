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

from kvstore.daemon.core import Core
from kvstore.daemon.seams import DramOnly
from kvstore.daemon.index import Block, BlockState, Lru
from kvstore.daemon.metrics import Metrics
from kvstore.tiers.arena import send_fd
from kvstore.tiers.base import TierKind
from kvstore.tiers.hbm import HbmTier

log = logging.getLogger("kvstore.hbm")


class HbmCopies(DramOnly):
    """The HBM side of :class:`kvstore.daemon.seams.LowerTiers`: the blocks with an HBM copy, which go
    when their DRAM copy goes. Built before the core (under whose lock it is called)."""

    def __init__(self, hbm: HbmTier) -> None:
        self.hbm = hbm
        self.lru = Lru()  # blocks with an HBM copy, by recency

    def dram_freed(self, b: Block, reason: str) -> None:
        """The DRAM copy goes: its HBM copy goes with it."""
        if b.hbm_slot >= 0:
            self.lru.discard(b)
            self.hbm.free(b.ns_id, b.hbm_slot)
            b.hbm_slot = -1


class HbmCache:
    """The thread that copies hot DRAM blocks (``Core.take_hot``) into the HBM pool."""

    def __init__(self, core: Core, copies: HbmCopies, *, metrics: Metrics) -> None:
        self.core = core
        self.copies = copies
        self.hbm = copies.hbm
        self.lru = copies.lru
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
                self._round()
            except Exception:  # noqa: BLE001 - HBM is a cache: DRAM keeps serving
                log.exception("HBM promotion round failed")

    def _round(self) -> None:
        core, hbm = self.core, self.hbm
        with core.lock:
            hot = core.take_hot()
            todo = []
            for b in hot:
                st = core.namespaces.get(b.ns_id)
                if (st is None or st.blocks.get(b.key) is not b or b.state is not BlockState.COMMITTED
                        or b.tier is not TierKind.DRAM or b.hbm_slot >= 0 or b.busy):
                    continue
                slot = hbm.allocate(b.ns_id, st.block_bytes)
                while slot is None:
                    victim = self.lru.pop_victim(lambda v: not v.busy)
                    if victim is None:
                        break
                    hbm.free(victim.ns_id, victim.hbm_slot)
                    victim.hbm_slot = -1
                    core.announce(victim)
                    slot = hbm.allocate(b.ns_id, st.block_bytes)
                if slot is None:
                    break
                b.busy = True  # its DRAM slot is the copy's source
                todo.append((b, slot, core.dram.view(b.offset, st.block_bytes)))
        if not todo:
            return
        t = hbm.promote([(slot, src) for _, slot, src in todo])
        t.wait()
        with core.lock:
            for b, slot, _ in todo:
                b.busy = False
                if t.error is None and core.namespaces[b.ns_id].blocks.get(b.key) is b and b.tier is TierKind.DRAM:
                    b.hbm_slot = slot
                    core.announce(b)
                    self.lru.add(b)
                    self.metrics.promotions.labels(src="dram", dst="hbm").inc()
                else:
                    hbm.free(b.ns_id, slot)

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
