"""Where each block lives: the state the residency owns (:mod:`kvstore.daemon.residency` adds
the movers' prepare/complete pairs on top).

:class:`Placement` holds a block's placement (``Block.tier``, ``offset``, ``on_nvme``, ``busy``,
``hbm_slot``), the tier LRUs, DRAM back-pressure, DRAM eviction, DRAM and HBM slot frees, read
pins, the NVMe copy bookkeeping, recovery linking and the write-out order, with the daemon's one
lock. Methods that the movers call take the lock themselves; the others are called by the core
(which holds it already for its caller). ``tests/test_structure.py`` checks that nothing outside
this module, :mod:`kvstore.daemon.residency` and the block record writes placement.

Eviction is leaves-first LRU: the least recently used unpinned block that has no cached
children in its tier goes first.
"""

from __future__ import annotations

import heapq
import itertools
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import closing, contextmanager
from dataclasses import dataclass

from kvstore.daemon.index import Block, BlockState, Lru, NsState, TierLrus
from kvstore.daemon.seams import BlockEvents, DramOnly, LowerTiers, NoEvents
from kvstore.keys import Namespace
from kvstore.tier_kind import TierKind
from kvstore.tiers.dram import DramTier

DRAM, NVME, HBM = TierKind.DRAM, TierKind.NVME, TierKind.HBM
_TIER_BITS = tuple((t, 1 << t) for t in (HBM, DRAM, NVME))


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
    demand_ns: bytes = b""  # ... in slots of this namespace
    demand_slot_bytes: int = 0  # ... of this size (0: any free bytes)


@dataclass(slots=True)
class QuotaFlag:
    hit: bool = False  # an allocation failed on the namespace quota, not on the tier


class Placement:
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
    def refuse_for_room(self, demand_bytes: int, ns_id: bytes = b"", slot_bytes: int = 0) -> bool:
        """A writer found no DRAM slot: True (and the demoter told how much room is wanted, in
        slots of ``slot_bytes`` for namespace ``ns_id``) if demotion is making room, so the
        refusal is transient."""
        if not (self.pressure.waiting or self.pressure.moving):
            return False
        p = self.pressure
        p.waiting, p.demand_bytes, p.demand_ns, p.demand_slot_bytes = True, demand_bytes, ns_id, slot_bytes
        return True

    def room_bytes(self) -> int:
        """Free DRAM room as the waiting writer can use it: whole slots of its size in its
        namespace's extents and in free extents (free bytes elsewhere are no room for it: an
        extent holds slots of one size), else all free bytes."""
        p, dram = self.pressure, self.dram
        if not p.demand_slot_bytes:
            return dram.capacity_bytes - dram.used_bytes
        return dram.alloc.room(p.demand_ns, p.demand_slot_bytes) * dram.slot_stride(p.demand_slot_bytes)

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

    def resident(self, st: NsState, keys: list[bytes], nvme_enabled: bool, each: bool = False) -> tuple[int, bool]:
        """(leading blocks resident in DRAM, whether more may still arrive: the next one is on
        NVMe, being read or waiting for DRAM room). ``each``: misses are skipped, so more may
        arrive while any key is on NVMe."""
        with self.lock:
            n = 0
            for k in keys:
                b = st.blocks.get(k)
                if b is None or b.state is not BlockState.COMMITTED:
                    if each:
                        continue
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

    # --- read pins (leases, and the daemon's own reads: hashing, sends) ----------------------
    def pin(self, b: Block) -> None:
        """One more reader of ``b``'s slot: off its LRU, so neither evicted, demoted nor deleted
        (a demotion already writing it keeps the DRAM copy) until :meth:`unpin`."""
        if b.ref_cnt == 0:
            self.lru(b.tier, b.ns_id).discard(b)
        b.ref_cnt += 1

    def unpin(self, b: Block) -> None:
        """A reader let go. The last one puts a committed block back on its LRU, frees the slot
        of one deleted or aborted meanwhile (out of the index), and leaves one still being
        written alone: its write lease owns the slot and its Commit files it."""
        b.ref_cnt -= 1
        if b.ref_cnt == 0:
            st = self.namespaces.get(b.ns_id)
            if st is None or st.blocks.get(b.key) is not b:
                self.free_dropped(b)
            elif b.state is BlockState.COMMITTED:
                self.lru(b.tier, b.ns_id).add(b)

