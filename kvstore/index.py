"""Block records and the intrusive LRU list that orders eviction.

Single-threaded and plain: the daemon's core lock is the only way in.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Iterator

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
    prev: "Block | None" = field(default=None, repr=False)
    next: "Block | None" = field(default=None, repr=False)

    def has_kids_in(self, tier: TierKind) -> bool:
        return any(k.tier == tier for k in self.kids)


class LruList:
    """Doubly linked list with a sentinel: O(1) ``push`` (most recent end), ``remove`` and
    ``touch``. Iteration runs least recent first."""

    def __init__(self) -> None:
        self._head = Block(key=b"", ns_id=b"", tier=TierKind.DRAM, offset=-1)
        self._head.prev = self._head.next = self._head
        self.size = 0

    def push(self, b: Block) -> None:
        tail = self._head.prev
        b.prev, b.next = tail, self._head
        tail.next = b  # type: ignore[union-attr]
        self._head.prev = b
        self.size += 1

    def remove(self, b: Block) -> None:
        if b.prev is None:
            return
        b.prev.next, b.next.prev = b.next, b.prev  # type: ignore[union-attr]
        b.prev = b.next = None
        self.size -= 1

    def contains(self, b: Block) -> bool:
        return b.prev is not None

    def touch(self, b: Block) -> None:
        if b.prev is not None:
            self.remove(b)
            self.push(b)

    def __iter__(self) -> Iterator[Block]:
        b = self._head.next
        while b is not self._head:
            nxt = b.next  # type: ignore[union-attr]
            yield b  # type: ignore[misc]
            b = nxt

    def __len__(self) -> int:
        return self.size

    def victim(self, tier: TierKind) -> Block | None:
        """The least recently used block with no cached children in ``tier`` (leaves first).

        Lookups touch a matched chain leaf-first so ancestors stay more recent than their
        descendants; the walk therefore stops at the head in the common case."""
        for b in self:
            if not b.busy and not b.has_kids_in(tier):
                return b
        return None
