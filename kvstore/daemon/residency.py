"""Where each block lives, and the one writer of it.

:class:`Residency` owns a block's placement (``Block.tier``, ``offset``, ``on_nvme``, ``busy``,
``hbm_slot``), the tier LRUs, DRAM back-pressure, DRAM eviction, DRAM and HBM slot frees, the
NVMe and HBM copy bookkeeping, recovery linking and the write-out order. The core (sessions,
leases, the write and read protocol) places a block when it reserves it and otherwise asks this
object; nothing else writes placement (``tests/test_structure.py`` reads the product code and
fails if anything does).

Movers (the demoter, promotion and prefetch, the write-out, the HBM copier, transfers) move
bytes and nothing else. Each move is a prepare/complete pair, in the manner of vLLM's
``OffloadingManager`` (``prepare_store`` / ``complete_store``): ``prepare_*`` picks the blocks,
marks them busy and returns :class:`Move` records carrying what the I/O needs; the mover runs
the I/O with no lock held and hands the outcome to ``complete_*``, which clears ``busy`` and the
pressure count in a ``finally``, always, and decides what the outcome does to each block.
``prepare_*`` returns an empty list, never raises, when there is nothing to move.

Thread-safety: every public method takes :attr:`lock` itself. It is the daemon's one lock (an
``RLock`` the core shares), so the core's callers, who already hold it for a request's metadata
step, may call in. Movers never take it: one public call is one hold.

Eviction is leaves-first LRU: the least recently used unpinned block that has no cached
children in its tier goes first.
"""

from __future__ import annotations

import heapq
import itertools
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import closing, contextmanager
from dataclasses import dataclass, field

from kvstore.daemon.index import Block, BlockState, Lru, NsState, TierLrus
from kvstore.daemon.seams import BlockEvents, DramOnly, LowerTiers, NoEvents
from kvstore.keys import Namespace
from kvstore.tier_kind import TierKind
from kvstore.tiers.dram import DramTier
from kvstore.tiers.nvme import IoResult

DRAM, NVME, HBM = TierKind.DRAM, TierKind.NVME, TierKind.HBM
_TIER_BITS = tuple((t, 1 << t) for t in (HBM, DRAM, NVME))
_WRITTEN = (IoResult.OK, IoResult.PRESENT)


def held_tiers(b: Block) -> int:
    """The tiers ``b`` is readable from, as bits ``1 << TierKind``: 0 unless committed (a
    forgotten block is RESERVED again)."""
    if b.state is not BlockState.COMMITTED:
        return 0
    bits = 0
    if b.tier is DRAM and b.offset >= 0:
        bits |= 1 << DRAM
    if b.on_nvme:
        bits |= 1 << NVME
    if b.hbm_slot >= 0:
        bits |= 1 << HBM
    return bits


@dataclass(slots=True)
class DramPressure:
    """Back-pressure between writers and the demoter: the core refuses a reservation as
    transient while these say room is coming. Written only by :class:`Residency`."""

    waiting: bool = False  # a writer was refused for lack of room that demotion would make
    moving: int = 0  # blocks whose DRAM slot is being copied to NVMe right now
    demand_bytes: int = 0  # room the last such refusal needed


@dataclass(slots=True)
class QuotaFlag:
    hit: bool = False  # an allocation failed on the namespace quota, not on the tier


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

    def nvme_item(self) -> tuple:
        """The tuple ``KeyedTier.put_many`` takes."""
        return self.ns_id, self.key, self.parent_key, self.chunk_bytes, self.view, self.digests


@dataclass(slots=True)
class DemotionPlan:
    """What :meth:`Residency.prepare_demotion` decided: ``draining`` (the demoter's state for
    the next round); ``moves`` (blocks to write to NVMe), or None when there was nothing to do
    (idle, or no unpinned leaf); ``evicted`` counts blocks dropped from DRAM at once because an
    NVMe copy already existed or NVMe does not admit them."""

    draining: bool
    moves: list[Move] | None
    evicted: int = 0


@dataclass(slots=True)
class Landed:
    """What a completed move leaves for the mover to do (NVMe keys to delete: evicted for room
    or quota, or written for a block deleted meanwhile) and to count (its own metrics)."""

    delete: list[bytes] = field(default_factory=list)
    moved: int = 0  # blocks that changed tier (a demotion: left DRAM; a promotion: reached it)
    nvme_evicted: int = 0  # NVMe copies evicted for room or quota


class Residency:
    """See the module docstring. ``lower``: what the NVMe side says about copies (held,
    admitted); ``hbm``: the HBM pool whose copies live as long as their DRAM copy, or None;
    ``events``: where blocks entering or leaving a tier are reported; ``ns_quota_bytes``: the DRAM
    quota of one namespace, asked at each allocation (a reloaded config applies at once)."""

    def __init__(self, dram: DramTier, *, lower: LowerTiers | None = None, hbm=None,
                 events: BlockEvents | None = None, metrics=None,
                 ns_quota_bytes: Callable[[], int] = lambda: 0) -> None:
        self.lock = threading.RLock()
        # Notified (under the lock) when moves land: demotions and durable writes free DRAM,
        # promotions land; ``generation`` counts them, so a waiter misses none.
        self.changed = threading.Condition(self.lock)
        self.generation = 0
        self.dram = dram
        self.lower: LowerTiers = lower if lower is not None else DramOnly()
        self.hbm = hbm
        self.hbm_lru = Lru()  # blocks with an HBM copy, by recency
        self.events: BlockEvents = events if events is not None else NoEvents()
        self._quiet = events is None  # no stream: announce() costs nothing on the commit path
        self.metrics = metrics
        self.ns_quota_bytes = ns_quota_bytes  # DRAM bytes one namespace may hold now (0 = no quota)
        self.namespaces: dict[bytes, NsState] = {}
        self.lrus = TierLrus()
        self.pressure = DramPressure()
        self.tick = 0  # recency counter behind every Block.tick
        self._passes: dict[bytes, Iterator[Block]] | None = None  # open DRAM victim streams (eviction_pass)
        self._hot: list[Block] = []  # blocks read hot_after_reads times, for the HBM copier

    # --- the index's namespaces and recency -------------------------------------------------
    def ns_state(self, ns: Namespace) -> NsState:
        """The namespace's state, created on first use (Register, an incoming transfer, NVMe
        recovery)."""
        with self.lock:
            st = self.namespaces.get(ns.root)
            if st is None:
                st = self.namespaces[ns.root] = NsState(ns, ns.root, ns.layout.block_bytes)
            return st

    def lru(self, tier: TierKind, ns_id: bytes) -> Lru:
        return self.lrus.lru(tier, ns_id)

    def touch(self, b: Block) -> None:
        self.tick += 1
        b.tick = self.tick

    def _landed(self) -> None:
        self.generation += 1
        self.changed.notify_all()

    def wait_for_change(self, generation: int, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` seconds for a move to land after ``generation`` was read."""
        with self.lock:
            if self.generation == generation:
                self.changed.wait(timeout_s)

    def announce(self, b: Block) -> None:
        """Tell the event stream which tiers ``b`` is in now. Idempotent: called after every
        change of a block's tiers (commit, eviction, demotion, promotion, an HBM copy, forget)."""
        if self._quiet:
            return
        now = held_tiers(b)
        was = b.announced
        if now == was:
            return
        b.announced = now
        for tier, bit in _TIER_BITS:
            if was & bit and not now & bit:
                self.events.removed(b, tier)
        if now & ~was:
            ns = self.namespaces[b.ns_id].ns
            for tier, bit in _TIER_BITS:
                if now & bit and not was & bit:
                    self.events.stored(b, ns, tier)

    def forget(self, b: Block) -> None:
        """Take ``b`` out of the index and its chain (its slots are the caller's business)."""
        ns = self.namespaces.get(b.ns_id)
        if ns is not None and ns.blocks.get(b.key) is b:
            del ns.blocks[b.key]
        if b.parent is not None:
            b.parent.kids.discard(b)
        for k in b.kids:
            k.parent = None
        b.kids = set()
        b.state = BlockState.RESERVED
        self.announce(b)

    def live(self, b: Block) -> bool:
        """``b`` is still the committed block of its key (not deleted or replaced meanwhile)."""
        st = self.namespaces.get(b.ns_id)
        return st is not None and st.blocks.get(b.key) is b and b.state is BlockState.COMMITTED

    # --- DRAM room --------------------------------------------------------------------------
    def refuse_for_room(self, demand_bytes: int) -> bool:
        """A writer found no DRAM slot: True (and the demoter told how much room is wanted) if
        demotion is making room, so the refusal is transient."""
        if not (self.pressure.waiting or self.pressure.moving):
            return False
        self.pressure.waiting = True
        self.pressure.demand_bytes = demand_bytes
        return True

    def room_found(self) -> None:
        """A writer's reservation fitted: nobody waits for room."""
        self.pressure.demand_bytes = 0
        self.pressure.waiting = False

    def allocate_slot(self, ns: NsState, quota: QuotaFlag | None = None) -> int | None:
        """A DRAM slot for one of ``ns``'s blocks, evicting leaves-first to make room; None when
        nothing more can be evicted (``quota.hit`` set if the namespace quota was the limit)."""
        quota = quota if quota is not None else QuotaFlag()
        with self.lock:
            limit = self.ns_quota_bytes()
            if limit:  # over its quota a namespace makes room among its own blocks only
                stride = self.dram.slot_stride(ns.block_bytes)
                while self.dram.ns_bytes.get(ns.id, 0) + stride > limit:
                    if not self._evict_one(ns, own_only=True):
                        quota.hit = True
                        return None
            off = self.dram.allocate(ns.id, ns.block_bytes)
            while off is None:
                if not self._evict_one(ns):
                    return None
                off = self.dram.allocate(ns.id, ns.block_bytes)
            return off

    def free_scratch(self, ns_id: bytes, offsets: Iterable[int]) -> None:
        """Give back DRAM slots that never held a block (a transfer's scratch slots)."""
        with self.lock:
            for off in offsets:
                self.dram.free(ns_id, off)

    @contextmanager
    def eviction_pass(self):
        """Evictions inside (under one hold of the lock) share one pass over each namespace's
        DRAM LRU (``Lru.victims``): making room for n blocks at the end of an m-block chain costs
        O(m + n log m), where n single pops cost O(n m log m)."""
        with self.lock:
            if self._passes is not None:
                yield
                return
            self._passes = {}
            try:
                yield
            finally:
                streams, self._passes = self._passes, None
                for g in streams.values():
                    g.close()

    @staticmethod
    def _dram_leaf(b: Block) -> bool:
        return not b.busy and not b.has_kids_in(DRAM)

    def _dram_victim(self, ns_id: bytes) -> Block | None:
        """Pop ``ns_id``'s least recent evictable DRAM leaf, from the open pass if there is one."""
        if self._passes is None:
            return self.lru(DRAM, ns_id).pop_victim(self._dram_leaf)
        g = self._passes.get(ns_id)
        if g is None:
            g = self._passes[ns_id] = self.lru(DRAM, ns_id).victims(self._dram_leaf)
        return next(g, None)

    def _evict_one(self, ns: NsState, own_only: bool = False) -> bool:
        """Evict one DRAM block: this namespace's least recent leaf (its slots fit exactly),
        else the least recent leaf of the namespace whose LRU head is oldest, until one of
        that namespace's extents frees up."""
        victim = self._dram_victim(ns.id)
        if victim is None and not own_only:
            victim = self.lrus.pop_victim(DRAM, self._dram_leaf, exclude=ns.id, take=self._dram_victim)
        if victim is None:
            return False
        if self.lower.must_demote(victim):
            # Its data would be lost: put it back and let the writer retry once the
            # background demotion has moved it (back-pressure, not loss).
            self.lru(DRAM, victim.ns_id).add(victim)
            self.pressure.waiting = True
            return False
        self.evict_from_dram(victim)
        return True

    def evict_from_dram(self, b: Block) -> None:
        """Drop ``b``'s DRAM copy for room: it stays as an NVMe block if its NVMe copy is
        usable, else it is forgotten."""
        self._drop_from_dram(b, "capacity")

    def drop_from_dram(self, b: Block) -> None:
        """``b`` is deleted: its DRAM slot goes and the block with it."""
        self._drop_from_dram(b, "delete")

    def _drop_from_dram(self, b: Block, reason: str) -> None:
        kept = reason == "capacity" and b.on_nvme and self.lower.holds_copy(b)
        self.lru(DRAM, b.ns_id).discard(b)
        self._free_slot(b, reason)
        if kept:
            b.tier, b.offset = NVME, -1
            self.lru(NVME, b.ns_id).add(b)
            self.announce(b)
        else:
            self.forget(b)
        if self.metrics:
            self.metrics.evictions.labels(tier="dram", reason=reason).inc()

    def _free_slot(self, b: Block, reason: str) -> None:
        self.lower.dram_freed(b, reason)
        if b.hbm_slot >= 0:  # inclusive: an HBM copy lives only as long as its DRAM copy
            self.hbm_lru.discard(b)
            self.hbm.free(b.ns_id, b.hbm_slot)
            b.hbm_slot = -1
        self.dram.free(b.ns_id, b.offset)

    def free_reserved(self, b: Block) -> None:
        """An uncommitted block's reservation is aborted: its slot goes (unless a reader of the
        incoming slot still pins it: it frees the slot when it lets go)."""
        if b.ref_cnt == 0:
            self._free_slot(b, "abort")
        self.forget(b)

    def free_dropped(self, b: Block) -> None:
        """Free the DRAM slot of a block that was deleted or dropped while pinned or under I/O
        (once its last reader or the I/O let go)."""
        if b.tier is DRAM and b.offset >= 0 and b.ref_cnt == 0:
            self._free_slot(b, "dropped")
            b.offset = -1

    # --- NVMe copies ------------------------------------------------------------------------
    def drop_nvme_copy(self, b: Block) -> None:
        """Delete ``b``'s NVMe copy (the block is being deleted)."""
        if b.on_nvme:
            self.lose_nvme_copy(b)
            self.lower.delete_copy(b)

    def _note_nvme_copy(self, b: Block) -> None:
        """``b`` (in DRAM) now also has an NVMe copy: dropping its DRAM copy loses nothing."""
        b.on_nvme = True
        self.lru(NVME, b.ns_id).add(b)
        self.announce(b)

    def lose_nvme_copy(self, b: Block) -> None:
        """``b``'s NVMe copy is gone (the tier lost it or it failed its checksum); nothing to
        delete there."""
        b.on_nvme = False
        self.lru(NVME, b.ns_id).discard(b)
        self.announce(b)

    def evict_nvme(self, count: int, ns_id: bytes | None = None) -> list[bytes]:
        """Drop ``count`` least recent NVMe leaves (of ``ns_id`` only, if given); returns their
        keys, for the caller to delete from the tier."""
        dropped = []

        def ok(b: Block) -> bool:
            return not b.busy and not any(k.on_nvme for k in b.kids)

        with self.lock:
            stream = self.lru(NVME, ns_id).victims(ok) if ns_id else self.lrus.victims(NVME, ok)
            with closing(stream):
                for b in itertools.islice(stream, count):
                    b.on_nvme = False
                    self.announce(b)
                    dropped.append(b.key)
                    if b.tier is NVME:
                        self.forget(b)
        return dropped

    def _over_nvme_quota(self, ns_ids, quota_bytes: int) -> list[bytes]:
        """A namespace over ``quota_bytes`` on NVMe drops its own least recent NVMe leaves."""
        out: list[bytes] = []
        if quota_bytes:
            for ns_id in ns_ids:
                st = self.namespaces.get(ns_id)
                if st is not None:
                    over = len(self.lru(NVME, ns_id)) - quota_bytes // st.block_bytes
                    if over > 0:
                        out += self.evict_nvme(over, ns_id)
        return out

    def nvme_lost(self) -> None:
        """The NVMe tier disabled itself: forget blocks that only it held (never serve them)."""
        with self.lock:
            for st in self.namespaces.values():
                for b in [b for b in st.blocks.values() if b.on_nvme]:
                    self.lose_nvme_copy(b)
                    if b.tier is NVME and not b.busy:
                        self.forget(b)

    # --- demotion: DRAM -> NVMe, the DRAM copy dropped --------------------------------------
    def _move(self, b: Block, slot: int = -1, view=None) -> Move:
        st = self.namespaces[b.ns_id]
        if view is None:
            view = self.dram.view(b.offset, st.block_bytes)
        return Move(b, b.key, b.ns_id, b.parent_key, st.ns.layout.layer_chunk_bytes, view, b.digests, slot)

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
            want = max(used - int(low * cap), self.pressure.demand_bytes - (cap - used))
            if not draining or want <= 0:
                self.pressure.waiting = False
                return DemotionPlan(False, None)
            victims = self._pick(min(want, max_bytes))
            if not victims:
                return DemotionPlan(True, None)
            moves, evicted = [], 0
            for b in victims:
                if b.on_nvme or not admits(b):
                    self.evict_from_dram(b)  # a copy is there already, or not admitted: just drop
                    evicted += 1
                else:
                    b.busy = True
                    moves.append(self._move(b))
            self.pressure.moving += len(moves)
            return DemotionPlan(True, moves, evicted)

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

    def dram_only_chains(self) -> list[Block]:
        """Committed blocks whose only copy is in DRAM and that a prefix read can reach, heads
        of chains before their tails and otherwise most recent first: the order to write DRAM
        out in at shutdown, so that any prefix of it that lands on NVMe is the most valuable set
        of whole prefixes a restart can serve."""
        with self.lock:
            heap = [(-b.tick, id(b), b) for st in self.namespaces.values() for b in st.blocks.values()
                    if b.parent_key is None and b.state is BlockState.COMMITTED]
            heapq.heapify(heap)
            out = []
            while heap:  # a block enters the heap only once its parent is out: parents go first
                _, _, b = heapq.heappop(heap)
                if b.tier is DRAM and not b.on_nvme and not b.busy:
                    out.append(b)
                for k in b.kids:
                    if k.state is BlockState.COMMITTED:
                        heapq.heappush(heap, (-k.tick, id(k), k))
            return out

    def nvme_by_recency(self) -> list[Block]:
        """Every block with an NVMe copy, least recent first."""
        with self.lock:
            return sorted((b for st in self.namespaces.values() for b in st.blocks.values() if b.on_nvme),
                          key=lambda b: b.tick)

    # --- promotion: NVMe -> DRAM ------------------------------------------------------------
    def prepare_promotion(self, st: NsState, keys: list[bytes]) -> tuple[int, list[Move]]:
        """Slots for the leading NVMe-only blocks of ``keys``; returns (how many leading blocks
        are resident or on their way, the reads to start). Idempotent: blocks under way are
        skipped."""
        moves: list[Move] = []
        n = 0
        with self.eviction_pass():
            for k in keys:
                b = st.blocks.get(k)
                if b is None or b.state is not BlockState.COMMITTED:
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
                        b.keep_digests(sums.get(m.key))
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

    def resident(self, st: NsState, keys: list[bytes], nvme_enabled: bool) -> tuple[int, bool]:
        """(leading blocks resident in DRAM, whether more may still arrive: the next one is on
        NVMe, being read or waiting for DRAM room)."""
        with self.lock:
            n = 0
            for k in keys:
                b = st.blocks.get(k)
                if b is None or b.state is not BlockState.COMMITTED:
                    return n, False
                if b.tier is not DRAM:
                    return n, nvme_enabled
                n += 1
            return n, False

    # --- recovery ---------------------------------------------------------------------------
    def recover(self, entries: list, ns_of: Callable[[bytes], NsState | None]) -> tuple[list[bytes], list[Block]]:
        """Index the committed blocks the NVMe tier holds (``entries``, least recent first, each
        with ``key``, ``ns_id``, ``parent`` and ``nbytes``), link their chains and file them in
        recency order. Returns (keys of entries no known namespace describes, blocks a prefix
        read can never reach, already out of the index): both for the caller to delete."""
        orphans = []
        with self.lock:
            for e in entries:
                st = ns_of(e.ns_id)
                if st is None or e.nbytes != st.block_bytes:
                    orphans.append(e.key)
                    continue
                b = Block(e.key, st.id, NVME, -1, state=BlockState.COMMITTED, parent_key=e.parent, on_nvme=True)
                st.blocks[e.key] = b
                self.touch(b)
                self.announce(b)
            lost = self._link_recovered()
            for e in entries:  # re-filed in recency order now that parents are linked
                st = ns_of(e.ns_id)
                b = st.blocks.get(e.key) if st else None
                if b is not None:
                    self.lru(NVME, e.ns_id).add(b)
        return orphans, lost

    def _link_recovered(self) -> list[Block]:
        for st in self.namespaces.values():
            for b in st.blocks.values():
                p = st.blocks.get(b.parent_key) if b.parent_key else None
                if p is not None:
                    b.parent = p
                    p.kids.add(b)
        reached, todo = set(), [b for st in self.namespaces.values() for b in st.blocks.values() if b.parent_key is None]
        while todo:  # plain walk from the roots: start-up on millions of blocks needs no order
            b = todo.pop()
            reached.add(id(b))
            todo.extend(b.kids)
        lost = [b for st in self.namespaces.values() for b in st.blocks.values() if id(b) not in reached]
        for b in lost:
            self.forget(b)
        return lost

    # --- HBM copies -------------------------------------------------------------------------
    def note_read(self, b: Block, hot_after_reads: int) -> None:
        """``b`` was acquired once more: on its ``hot_after_reads``-th read it is queued for an
        HBM copy."""
        b.reads += 1
        if b.reads == hot_after_reads:
            self._hot.append(b)

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

    # --- read pins (leases, and the daemon's own reads: hashing, sends) ----------------------
    def pin(self, b: Block) -> None:
        """One more reader of ``b``'s slot: off its LRU, so neither evicted, demoted nor deleted
        (a demotion already writing it keeps the DRAM copy) until :meth:`unpin`."""
        if b.ref_cnt == 0:
            self.lru(b.tier, b.ns_id).discard(b)
        b.ref_cnt += 1

    def unpin(self, b: Block) -> None:
        """A reader let go: the last one puts a live block back on its LRU, or frees the slot of
        one deleted or aborted meanwhile."""
        b.ref_cnt -= 1
        if b.ref_cnt == 0:
            if self.live(b):
                self.lru(b.tier, b.ns_id).add(b)
            else:
                self.free_dropped(b)

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
