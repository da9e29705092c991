"""Block records and the LRUs that order eviction: one exact LRU per (tier, namespace), and
:class:`TierLrus`, which picks victims across namespaces.

Single-threaded and plain: the daemon's core lock is the only way in.
"""

from __future__ import annotations

import enum
import heapq
from array import array
from contextlib import closing
from dataclasses import dataclass, field
from typing import Callable, Iterator

from kvstore.keys import Namespace
from kvstore.tier_kind import TierKind


class BlockState(enum.Enum):
    RESERVED = 1   # slot handed to a writer; not visible to lookups
    COMMITTED = 2  # readable


@dataclass(slots=True, eq=False)
class Parts:
    """A block reserved in parts, one writer each (TP ranks writing their KV heads of one
    block): which parts are committed, which write leases still fill the others, and whether a
    part was given up (the block is then out of the index, its slot freed by the last writer)."""

    count: int
    writers: dict[int, int]  # part -> the write lease filling it
    deadline: float  # with no writer left and a part missing, dropped after this (Core.expire)
    done: int = 0  # bit p: part p committed
    failed: bool = False
    kids: list = field(default_factory=list)  # blocks committed meanwhile whose chain parent this is

    @property
    def complete(self) -> bool:
        return self.done == (1 << self.count) - 1

    def holds(self, part: int) -> bool:
        return part in self.writers or bool(self.done >> part & 1)


@dataclass(slots=True, eq=False)
class Block:
    """One block of one namespace in one tier. ``ref_cnt`` counts read pins; a pinned block is
    off the LRU list, so it can be neither evicted nor overwritten."""

    key: bytes
    ns_id: bytes
    tier: TierKind
    offset: int
    state: BlockState = BlockState.RESERVED
    parent: "Block | None" = None
    parent_key: bytes | None = None  # chain parent, linked to ``parent`` at commit
    kids: set = field(default_factory=set)  # committed child Blocks
    ref_cnt: int = 0
    hits: int = 0
    lease_id: int = 0  # write lease while RESERVED
    busy: bool = False  # its slot is under I/O (demotion, promotion): neither evicted nor deleted
    on_nvme: bool = False  # an NVMe copy exists (dropping the DRAM copy loses nothing)
    tick: int = 0  # recency: higher is more recent
    reads: int = 0  # Acquires: what makes a block hot enough for HBM
    hbm_slot: int = -1  # offset of its copy in the HBM pool, -1 = none
    # xxh3-64 of each layer chunk, taken at commit on a daemon with a transport
    # (``Outbound.committed``), else the first time the committed block is hashed: by a transfer
    # (sent, or received and verified), or by the NVMe tier writing it (durable commit, demotion)
    # or reading it back verified (promotion). The bytes never change while the key
    # lives, so transfers and NVMe writes reuse these instead of hashing again; whoever checks
    # them next (the receiving daemon, an NVMe read) catches memory that changed since.
    digests: "array | None" = None
    tokens: bytes | None = None  # its token ids (int32 LE), when the writer sent them: for the KV events
    announced: int = 0  # tiers the KV event stream was last told it is in (bits 1 << TierKind)
    parts: Parts | None = None  # while RESERVED, when written in parts

    def has_kids_in(self, tier: TierKind) -> bool:
        return any(k.tier == tier for k in self.kids)

    def keep_digests(self, digests) -> None:
        """Record ``digests`` (one xxh3 per layer chunk, just computed or verified) unless the
        committed block already has some; see ``digests``."""
        if digests is not None and self.digests is None and self.state is BlockState.COMMITTED:
            self.digests = digests


@dataclass(slots=True, eq=False)
class NsState:
    """One namespace's blocks (key -> Block) and what the daemon knows of its engine."""

    ns: Namespace
    id: bytes
    block_bytes: int
    blocks: dict[bytes, Block] = field(default_factory=dict)
    sessions: int = 0
    prefill_tokens_per_s: float = 0.0
    model_params: float = 0.0
    cost: object = None  # the namespace's prefill cost model (kvstore.policy.PrefillCostModel)


class Lru:
    """Exact LRU over one tier of one namespace, ordered by ``Block.tick`` (a recency counter the
    core bumps).

    Touching a block is one attribute store (``b.tick = ...``): a Lookup of 8192 keys touches
    8192 blocks, so touch must cost nothing. Heap entries whose tick went stale are re-filed
    when they reach the top, which keeps pops in exact tick order. Membership lives here, not
    on the block, because a block with an NVMe copy is in the DRAM and the NVMe LRU at once.
    ``add`` is O(log n), ``discard`` O(1), a victim pop O(log n) amortised.
    """

    def __init__(self) -> None:
        self._heap: list[tuple[int, int, Block]] = []
        self._live: dict[int, int] = {}  # id(block) -> seq of its valid heap entry
        self._seq = 0

    def __contains__(self, b: Block) -> bool:
        return id(b) in self._live

    def add(self, b: Block) -> None:
        if id(b) not in self._live:
            self._file(b)

    def _file(self, b: Block) -> None:
        self._seq += 1
        self._live[id(b)] = self._seq
        heapq.heappush(self._heap, (b.tick, self._seq, b))

    def discard(self, b: Block) -> None:
        if self._live.pop(id(b), None) is not None and len(self._heap) > 4 * len(self._live) + 1024:
            self._heap = [e for e in self._heap if self._live.get(id(e[2])) == e[1]]
            heapq.heapify(self._heap)

    def _top(self) -> Block | None:
        """The live least recent block, re-filing stale entries on the way; not removed."""
        h, live = self._heap, self._live
        while h:
            tick, seq, b = h[0]
            if live.get(id(b)) != seq:
                heapq.heappop(h)
            elif tick != b.tick:
                heapq.heappop(h)
                self._file(b)
            else:
                return b
        return None

    def peek_tick(self) -> int | None:
        b = self._top()
        return None if b is None else b.tick

    def pop_victim(self, ok) -> Block | None:
        """Remove and return the least recent block with ``ok(block)`` true (leaves first:
        the caller's ``ok`` refuses blocks with cached children)."""
        with closing(self.victims(ok)) as stream:
            return next(stream, None)

    def victims(self, ok):
        """Yield the least recent block with ``ok(block)`` true, then the next, and so on: a run
        of evictions in one pass over the heap. ``pop_victim`` in a loop re-files every refused
        block on every call, which on a long chain (only its tail is a leaf) costs O(n) per
        eviction. Here a refused block is looked at again only when a yielded victim was its
        child: dropping a leaf is what turns its parent into one. Valid while nothing but the
        caller's handling of the yielded victims changes the tier (one hold of the core lock);
        refused blocks go back on the heap when the generator closes."""
        refused: dict[int, tuple[int, Block]] = {}  # id(block) -> (seq, block): still members
        ready: list[tuple[int, int, Block]] = []  # refused blocks that turned ok
        live = self._live
        try:
            while True:
                b = self._top()
                if ready and (b is None or ready[0][:2] < (b.tick, live[id(b)])):
                    _tick, seq, v = heapq.heappop(ready)
                    if live.get(id(v)) != seq:
                        continue  # discarded meanwhile
                else:
                    if b is None:
                        return
                    heapq.heappop(self._heap)
                    if not ok(b):
                        refused[id(b)] = (live[id(b)], b)
                        continue
                    v = b
                del live[id(v)]
                parent = v.parent
                yield v
                if parent is not None and id(parent) in refused and ok(parent):
                    seq, _ = refused.pop(id(parent))
                    heapq.heappush(ready, (parent.tick, seq, parent))
        finally:
            for seq, b in [*refused.values(), *((seq, b) for _t, seq, b in ready)]:
                if live.get(id(b)) == seq:
                    heapq.heappush(self._heap, (b.tick, seq, b))

    def __len__(self) -> int:
        return len(self._live)


class TierLrus:
    """Every tier's LRUs, one per namespace, and victim choice across them: from one namespace,
    or from the namespace whose least recent block is oldest. Single-threaded (the core lock)."""

    def __init__(self) -> None:
        self._lrus: dict[tuple[TierKind, bytes], Lru] = {}

    def lru(self, tier: TierKind, ns_id: bytes) -> Lru:
        lru = self._lrus.get((tier, ns_id))
        if lru is None:
            lru = self._lrus[(tier, ns_id)] = Lru()
        return lru

    def pop_victim(self, tier: TierKind, ok: Callable[[Block], bool], prefer_ns: bytes | None = None,
                   exclude: bytes | None = None, take: Callable[[bytes], Block | None] | None = None
                   ) -> Block | None:
        """Remove from ``tier``'s LRUs and return the least recent block with ``ok(block)``:
        from ``prefer_ns`` first if given, else from the namespace (other than ``exclude``)
        whose oldest block is oldest. ``take(ns_id)``, if given, does the popping."""
        if prefer_ns is not None:
            victim = self.lru(tier, prefer_ns).pop_victim(ok)
            if victim is not None:
                return victim
        skip = prefer_ns or exclude
        heads = [(lru.peek_tick(), ns_id) for (t, ns_id), lru in self._lrus.items()
                 if t is tier and ns_id != skip and len(lru)]
        for _tick, ns_id in sorted(h for h in heads if h[0] is not None):
            victim = take(ns_id) if take is not None else self.lru(tier, ns_id).pop_victim(ok)
            if victim is not None:
                return victim
        return None

    def victims(self, tier: TierKind, ok: Callable[[Block], bool]) -> Iterator[Block]:
        """Yield ``tier``'s blocks with ``ok(block)`` least recent first across namespaces, in
        one pass (``Lru.victims`` per namespace, merged by recency). Each yielded block is off
        its LRU, as with ``pop_victim``; close the generator (under the same hold of the lock)
        to put back the ones looked at and not taken."""
        streams, heads = {}, []
        try:
            for (t, ns_id), lru in list(self._lrus.items()):
                if t is tier and len(lru):
                    streams[ns_id] = lru.victims(ok)
                    b = next(streams[ns_id], None)
                    if b is not None:
                        heads.append((b.tick, ns_id, b))
            heapq.heapify(heads)
            while heads:
                _tick, ns_id, b = heapq.heappop(heads)
                yield b
                nxt = next(streams[ns_id], None)  # after the caller dealt with b
                if nxt is not None:
                    heapq.heappush(heads, (nxt.tick, ns_id, nxt))
        finally:
            for _tick, ns_id, b in heads:  # fetched, not taken: back on their LRU
                self.lru(tier, ns_id).add(b)
            for g in streams.values():
                g.close()
