"""Block records and the LRU that orders eviction.

Single-threaded and plain: the daemon's core lock is the only way in.
"""

from __future__ import annotations

import enum
import heapq
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
    last_access: float = 0.0
    lease_id: int = 0  # write lease while RESERVED
    busy: bool = False  # being moved between tiers; not evictable, not readable elsewhere
    tick: int = 0  # recency: higher is more recent
    in_lru: bool = False
    lru_seq: int = 0

    def has_kids_in(self, tier: TierKind) -> bool:
        return any(k.tier == tier for k in self.kids)


class Lru:
    """Exact LRU over one tier, ordered by ``Block.tick`` (a recency counter the core bumps).

    Touching a block is one attribute store (``b.tick = ...``): a Lookup of 8192 keys touches
    8192 blocks, so touch must cost nothing. Heap entries whose tick went stale are re-filed
    when they reach the top, which keeps pops in exact tick order. ``add`` and ``discard`` are
    O(log n) / O(1); a victim pop is O(log n) amortised.
    """

    def __init__(self) -> None:
        self._heap: list[tuple[int, int, Block]] = []
        self._seq = 0
        self.size = 0

    def add(self, b: Block) -> None:
        if b.in_lru:
            return
        b.in_lru = True
        self.size += 1
        self._file(b)

    def _file(self, b: Block) -> None:
        self._seq += 1
        b.lru_seq = self._seq
        heapq.heappush(self._heap, (b.tick, self._seq, b))

    def discard(self, b: Block) -> None:
        if b.in_lru:
            b.in_lru = False
            self.size -= 1
            if len(self._heap) > 4 * self.size + 1024:
                self._compact()

    def _compact(self) -> None:
        live = [(b.tick, seq, b) for _, seq, b in self._heap if b.in_lru and b.lru_seq == seq]
        heapq.heapify(live)
        self._heap = live

    def _top(self) -> Block | None:
        """The live least recent block, re-filing stale entries on the way; not removed."""
        h = self._heap
        while h:
            tick, seq, b = h[0]
            if not b.in_lru or b.lru_seq != seq:
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
        skipped = []
        victim = None
        while True:
            b = self._top()
            if b is None:
                break
            heapq.heappop(self._heap)
            if ok(b):
                victim = b
                break
            skipped.append(b)
        for b in skipped:
            self._file(b)
        if victim is not None:
            victim.in_lru = False
            self.size -= 1
        return victim

    def order(self) -> list[Block]:
        """Live blocks, least recent first (for tests and `kvstore ls`)."""
        return sorted((b for _, seq, b in self._heap if b.in_lru and b.lru_seq == seq), key=lambda b: b.tick)

    def __len__(self) -> int:
        return self.size
