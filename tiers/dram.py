"""DRAM tier: fixed-size slots per namespace carved from the shared-memory arena.

Clients write and read slots directly through their own mapping of the arena (zero copies
through the daemon); the daemon itself copies only when moving blocks between tiers, through
:meth:`DramTier.view`. Keeps :class:`kvstore.tiers.base.ArenaTier`. Not thread-safe: the
daemon's core lock guards it.
"""

from __future__ import annotations

import numpy as np

from kvstore.tiers.arena import Arena
from kvstore.tiers.base import ExtentAllocator, TierKind, TierStats


class DramTier:
    kind = TierKind.DRAM

    def __init__(self, arena: Arena, extent_bytes: int, capacity_bytes: int | None = None) -> None:
        """Slots come from the first ``capacity_bytes`` of the arena (default: all of it)."""
        self.arena = arena
        self.alloc = ExtentAllocator(capacity_bytes or arena.size_bytes, extent_bytes)
        self.ns_bytes: dict[bytes, int] = {}  # slot bytes held per namespace (for quotas)

    @property
    def capacity_bytes(self) -> int:
        return self.alloc.usable_bytes

    @property
    def used_bytes(self) -> int:
        return self.alloc.used_bytes

    @property
    def extent_bytes(self) -> int:
        return self.alloc.extent_bytes

    def slot_stride(self, slot_bytes: int) -> int:
        return self.alloc.slot_stride(slot_bytes)

    def max_slots(self, slot_bytes: int) -> int:
        return self.alloc.max_slots(slot_bytes)

    def fits(self, slot_bytes: int) -> bool:
        return self.alloc.fits(slot_bytes)

    def allocate(self, ns_id: bytes, slot_bytes: int) -> int | None:
        off = self.alloc.allocate(ns_id, slot_bytes)
        if off is not None:
            self.ns_bytes[ns_id] = self.ns_bytes.get(ns_id, 0) + self.alloc.slot_stride(slot_bytes)
        return off

    def free(self, ns_id: bytes, slot: int) -> None:
        owner = self.alloc.owner(slot)
        if owner is None or owner[0] != ns_id:
            raise ValueError(f"slot at {slot} is not allocated to this namespace")
        self.alloc.free(ns_id, owner[1], slot)
        self.ns_bytes[ns_id] -= self.alloc.slot_stride(owner[1])

    def view(self, slot: int, nbytes: int) -> np.ndarray:
        owner = self.alloc.owner(slot)
        if owner is None:
            raise ValueError(f"slot at {slot} is not allocated")
        if nbytes > owner[1]:
            raise ValueError(f"{nbytes} bytes do not fit a {owner[1]}-byte slot (would overwrite its neighbour)")
        return self.arena.view(slot, nbytes)

    def stats(self) -> TierStats:
        return TierStats(TierKind.DRAM, self.capacity_bytes, self.alloc.used_bytes, self.alloc.used_slots)
