"""Where each block lives, and the one writer of it: :class:`Residency`, the state of
:class:`~kvstore.daemon.placement.Placement` plus the movers' moves.

The core (sessions, leases, the write and read protocol) places a block when it reserves it and
otherwise asks the residency; nothing else writes placement (``tests/test_structure.py`` reads
the product code and fails if anything does).

Movers (the demoter, promotion and prefetch, the write-out, the HBM copier, transfers) move
bytes and nothing else. Each move is a prepare/complete pair, in the manner of vLLM's
``OffloadingManager`` (``prepare_store`` / ``complete_store``): ``prepare_*`` picks the blocks,
marks them busy (or read-pins them) and returns :class:`Move` records carrying what the I/O
needs; the mover runs the I/O with no lock held and hands the outcome to ``complete_*``, which
clears ``busy``, the pins and the pressure count in a ``finally``, always, and decides what the
outcome does to each block. ``prepare_*`` returns an empty list, never raises, when there is
nothing to move.

Thread-safety: every ``prepare_*`` and ``complete_*`` takes :attr:`lock` itself. It is the
daemon's one lock (an ``RLock`` the core shares), so the core's callers, who already hold it
for a request's metadata step, may call in. Movers never take it: one call is one hold.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from contextlib import closing
from dataclasses import dataclass, field

from kvstore.daemon.index import Block, BlockState, NsState
from kvstore.daemon.placement import Placement
from kvstore.tier_kind import TierKind
from kvstore.tiers.nvme import IoResult

DRAM, NVME = TierKind.DRAM, TierKind.NVME
_WRITTEN = (IoResult.OK, IoResult.PRESENT)


@dataclass(slots=True, eq=False)
class Move:
    """One block's part of a move: what the I/O needs. ``view`` is the DRAM slot (the source of
    a demotion, copy, HBM copy or send; the destination of a promotion); ``slot`` the slot being
    filled elsewhere (the DRAM offset a promotion lands in, the HBM offset of an HBM copy)."""

    block: Block
    key: bytes
    ns_id: bytes
    parent_key: bytes | None
    chunk_bytes: int  # one layer of the block (the NVMe tier's and the wire's unit)
    view: object
    digests: object  # the block's layer digests (array of xxh3-64) or None
    slot: int = -1
    ns: object = None  # the block's kvstore.keys.Namespace

    def nvme_item(self, encode: bool = False) -> tuple:
        """The tuple ``KeyedTier.put_many`` takes; with ``encode``, naming the block's element
        type, so that a tier with a codec stores it encoded. A namespace that opted into a
        lossy codec has its blocks quantized, whatever ``encode`` says."""
        kv_codec = self.ns.kv_codec if self.ns is not None else ""
        dtype = self.ns.layout.dtype if (encode or kv_codec) and self.ns is not None else None
        return self.ns_id, self.key, self.parent_key, self.chunk_bytes, self.view, self.digests, dtype, kv_codec


@dataclass(slots=True)
class DemotionPlan:
    """What :meth:`Residency.prepare_demotion` decided: ``draining`` (the demoter's state for
    the next round); ``moves`` (blocks to write to NVMe), or None when there was nothing to do
    (idle, or no unpinned leaf). Blocks with an NVMe copy already, or that NVMe does not admit,
    were dropped from DRAM at once and are not among the moves."""

    draining: bool
    moves: list[Move] | None


@dataclass(slots=True)
class Landed:
    """What a completed move leaves for the mover to do (NVMe keys to delete: evicted for room
    or quota, or written for a block deleted meanwhile) and to count (its own metrics)."""

    delete: list[bytes] = field(default_factory=list)
    moved: int = 0  # blocks that changed tier (a demotion: left DRAM; a promotion: reached it)
    nvme_evicted: int = 0  # NVMe copies evicted for room or quota


class Residency(Placement):
    """The owner of where blocks live (:class:`Placement`), with the movers' moves: every
    ``prepare_*`` and ``complete_*`` takes the lock itself, so a mover never holds it."""

    # --- demotion: DRAM -> NVMe, the DRAM copy dropped --------------------------------------
    def _move(self, b: Block, slot: int = -1, view=None) -> Move:
        st = self.namespaces[b.ns_id]
        if view is None:
            view = self.dram.view(b.offset, st.block_bytes)
        return Move(b, b.key, b.ns_id, b.parent_key, st.ns.layout.layer_chunk_bytes, view, b.digests, slot, st.ns)

    def _pick(self, want_bytes: int) -> list[Block]:
        """Least recent DRAM leaves across namespaces, up to ``want_bytes``. A parent whose DRAM
        children are all picked in this round counts as a leaf: the whole run goes to NVMe
        together, so leaves-first order still holds."""
        picked, got = [], 0
        chosen: set[int] = set()

        def ok(b: Block) -> bool:
            return not b.busy and all(k.tier is not DRAM or id(k) in chosen for k in b.kids)

        if want_bytes <= 0:
            return picked
        with closing(self.lrus.victims(DRAM, ok)) as stream:
            for b in stream:
                picked.append(b)
                chosen.add(id(b))
                got += self.dram.slot_stride(self.namespaces[b.ns_id].block_bytes)
                if got >= want_bytes:
                    break
        return picked

    def prepare_demotion(self, high: float, low: float, draining: bool, admits: Callable[[Block], bool],
                         max_bytes: int) -> DemotionPlan:
        """One batch of demotions: starts above the ``high`` watermark (a fraction of DRAM) or
        when a writer waits for room, and goes on (``draining``) until usage is under ``low``
        and the waiting writer's reservation fits. At most ``max_bytes`` of slots."""
        with self.lock:
            dram = self.dram
            used, cap = dram.used_bytes, dram.capacity_bytes
            if used > high * cap or self.pressure.waiting:
                draining = True
            want = max(used - int(low * cap), self.pressure.demand_bytes - self.room_bytes())
            if not draining or want <= 0:
                self.pressure.waiting = False
                return DemotionPlan(False, None)
            victims = self._pick(min(want, max_bytes))
            if not victims:  # nothing more can go: a writer still short of room is refused for good
                self.pressure.waiting = False
                return DemotionPlan(True, None)
            moves = []
            for b in victims:
                if b.on_nvme or not admits(b):
                    self.evict_from_dram(b)  # a copy is there already, or not admitted: just drop
                else:
                    b.busy = True
                    moves.append(self._move(b))
            self.pressure.moving += len(moves)
            return DemotionPlan(True, moves)

    def complete_demotion(self, moves: list[Move], results: dict, sums: dict, nvme_quota_bytes: int) -> Landed:
        """The NVMe write of ``moves`` ended with ``results`` (key -> IoResult; missing = failed)
        and ``sums`` (key -> digests). Written blocks drop their DRAM copy unless a reader pins
        them (then they are in both tiers); failed ones go back on the DRAM LRU."""
        out = Landed()
        with self.lock:
            try:
                no_space = False
                for m in moves:
                    b = m.block
                    b.busy = False
                    b.keep_digests(sums.get(m.key))
                    outcome = results.get(m.key, IoResult.FAILED)
                    live = self.live(b)
                    if outcome in _WRITTEN and live:
                        self._note_nvme_copy(b)
                        if b.ref_cnt == 0:
                            self.evict_from_dram(b)  # kept: becomes an NVMe block
                            out.moved += 1
                    elif outcome in _WRITTEN:
                        out.delete.append(m.key)  # deleted while it was being written
                        self.free_dropped(b)
                    else:
                        no_space |= outcome is IoResult.NO_SPACE
                        if live and b.ref_cnt == 0:
                            self.lru(DRAM, b.ns_id).add(b)
                        elif not live:
                            self.free_dropped(b)
                self._make_nvme_room(moves, out, nvme_quota_bytes, self.evict_nvme(len(moves)) if no_space else [])
            finally:
                self._writes_ended(moves)
        return out

    def _make_nvme_room(self, moves: list[Move], out: Landed, quota_bytes: int, evicted: list[bytes]) -> None:
        """After NVMe writes: the namespaces written to keep their NVMe quota; ``evicted`` (made
        room for a write that found the tier full) and those go to the mover to delete."""
        evicted = evicted + self._over_nvme_quota({m.ns_id for m in moves}, quota_bytes)
        out.delete += evicted
        out.nvme_evicted = len(evicted)

    def _writes_ended(self, moves: list[Move]) -> None:
        for m in moves:
            m.block.busy = False
        self.pressure.moving -= len(moves)
        self._landed()

    # --- copy: DRAM -> NVMe, the DRAM copy kept (durable commit, write-out) ------------------
    def prepare_copy(self, blocks: Iterable[Block]) -> list[Move]:
        """The DRAM-only blocks of ``blocks``, busy until :meth:`complete_copy`."""
        with self.lock:
            todo = [b for b in blocks if b.tier is DRAM and not b.on_nvme and not b.busy]
            for b in todo:
                b.busy = True
            self.pressure.moving += len(todo)
            return [self._move(b) for b in todo]

    def complete_copy(self, moves: list[Move], results: dict, sums: dict, nvme_quota_bytes: int) -> Landed:
        """The copy ended: the blocks it wrote (``results`` OK or PRESENT) have an NVMe copy."""
        out = Landed()
        with self.lock:
            try:
                for m in moves:
                    b = m.block
                    b.busy = False
                    b.keep_digests(sums.get(m.key))
                    if results.get(m.key) in _WRITTEN:
                        if self.live(b):
                            self._note_nvme_copy(b)
                        else:
                            out.delete.append(m.key)  # deleted while it was being written
                            self.free_dropped(b)
                self._make_nvme_room(moves, out, nvme_quota_bytes, [])
            finally:
                self._writes_ended(moves)
        return out

    # --- promotion: NVMe -> DRAM ------------------------------------------------------------
    def prepare_promotion(self, st: NsState, keys: list[bytes], each: bool = False) -> tuple[int, list[Move]]:
        """Slots for the leading NVMe-only blocks of ``keys`` (``each``: for all of them, past
        misses); returns (how many leading blocks are resident or on their way, the reads to
        start). Idempotent: blocks under way are skipped."""
        moves: list[Move] = []
        n = 0
        with self.eviction_pass():
            for k in keys:
                b = st.blocks.get(k)
                if b is None or b.state is not BlockState.COMMITTED:
                    if each:
                        continue
                    break
                n += 1
                if b.tier is NVME and not b.busy:
                    off = self.allocate_slot(st)
                    if off is None:
                        break
                    b.busy = True
                    moves.append(self._move(b, off, self.dram.view(off, st.block_bytes)))
        return n, moves

    def complete_promotion(self, st: NsState, moves: list[Move], results: dict, sums: dict) -> int:
        """The reads of ``moves`` ended: blocks read back whole (``results`` OK, checksums
        verified) are in DRAM; a block lost or corrupt on disk is forgotten, never served.
        Returns how many landed."""
        n = 0
        with self.lock:
            try:
                for m in moves:
                    b = m.block
                    b.busy = False
                    live = st.blocks.get(m.key) is b
                    if results.get(m.key) is IoResult.OK and live:
                        b.tier, b.offset = DRAM, m.slot
                        m.slot = -1
                        self.announce(b)
                        if m.key in sums:  # what DRAM now holds, as verified (a lossy block: dequantized)
                            b.digests = sums[m.key]
                        self.touch(b)
                        self.lru(DRAM, st.id).add(b)
                        n += 1
                    elif live:  # corrupt or lost on disk: never served
                        self.lose_nvme_copy(b)
                        self.forget(b)
            finally:
                for m in moves:
                    m.block.busy = False
                    if m.slot >= 0:
                        self.dram.free(st.id, m.slot)
                        m.slot = -1
                self._landed()
        return n

    def prepare_hbm_copy(self) -> list[Move]:
        """HBM slots for the blocks that became hot since the last call and are still committed
        in DRAM without an HBM copy, evicting the least recently read HBM copies for room; the
        DRAM slots are the copies' sources, busy until :meth:`complete_hbm_copy`."""
        moves: list[Move] = []
        with self.lock:
            hbm = self.hbm
            hot, self._hot = self._hot, []
            for b in hot:
                if not self.live(b) or b.tier is not DRAM or b.hbm_slot >= 0 or b.busy:
                    continue
                st = self.namespaces[b.ns_id]
                slot = hbm.allocate(b.ns_id, st.block_bytes)
                while slot is None:
                    victim = self.hbm_lru.pop_victim(lambda v: not v.busy)
                    if victim is None:
                        break
                    hbm.free(victim.ns_id, victim.hbm_slot)
                    victim.hbm_slot = -1
                    self.announce(victim)
                    slot = hbm.allocate(b.ns_id, st.block_bytes)
                if slot is None:
                    break
                b.busy = True
                moves.append(self._move(b, slot))
        return moves

    def complete_hbm_copy(self, moves: list[Move], ok: bool) -> int:
        """The HBM copies ended (``ok``: without error); returns how many blocks gained one.
        An HBM slot whose copy failed, or whose block left DRAM meanwhile, is freed."""
        n = 0
        with self.lock:
            try:
                for m in moves:
                    b = m.block
                    b.busy = False
                    if ok and self.live(b) and b.tier is DRAM:
                        b.hbm_slot, m.slot = m.slot, -1
                        self.announce(b)
                        self.hbm_lru.add(b)
                        n += 1
            finally:
                for m in moves:
                    m.block.busy = False
                    if m.slot >= 0:
                        self.hbm.free(m.ns_id, m.slot)
                        m.slot = -1
        return n

    def prepare_read(self, blocks: Iterable[Block]) -> list[Move]:
        """Pin the slots of ``blocks`` while a digest or a send reads them outside the lock,
        until :meth:`complete_read`. A pin, not ``busy``: a block under a demotion is busy
        already, and when that write lands the pin keeps its DRAM copy, where ``busy`` (a flag,
        cleared by whichever ends first) let the slot be freed under the send."""
        with self.lock:
            moves = []
            for b in blocks:
                self.pin(b)
                moves.append(Move(b, b.key, b.ns_id, b.parent_key, 0, None, b.digests))
            return moves

    def complete_read(self, moves: list[Move], digests: dict[int, object] | None = None) -> None:
        """The reads ended; ``digests`` (id(block) -> layer digests) are kept where given."""
        with self.lock:
            try:
                for m in moves:
                    d = digests.get(id(m.block)) if digests else None
                    if d is not None:
                        m.block.keep_digests(d)
            finally:
                for m in moves:
                    self.unpin(m.block)
