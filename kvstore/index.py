"""Block records and the LRU that orders eviction.

Single-threaded and plain: the daemon's core lock is the only way in.
"""

from __future__ import annotations

import enum
import heapq
from array import array
from contextlib import closing
from dataclasses import dataclass, field
from kvstore.tiers.base import TierKind


class BlockState(enum.Enum):
    RESERVED = 1   # slot handed to a writer; not visible to lookups
    COMMITTED = 2  # readable


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
    # xxh3-64 of each layer chunk, recorded the first time the committed block is hashed: by a
    # transfer (sent, or received and verified), or by the NVMe tier writing it (durable commit,
    # demotion) or reading it back verified (promotion). The bytes never change while the key
    # lives, so transfers and NVMe writes reuse these instead of hashing again; whoever checks
    # them next (the receiving daemon, an NVMe read) catches memory that changed since.
    digests: "array | None" = None

    def has_kids_in(self, tier: TierKind) -> bool:
        return any(k.tier == tier for k in self.kids)

    def keep_digests(self, digests) -> None:
        """Record ``digests`` (one xxh3 per layer chunk, just computed or verified) unless the
        committed block already has some; see ``digests``."""
        if digests is not None and self.digests is None and self.state is BlockState.COMMITTED:
            self.digests = digests


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
