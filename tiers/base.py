"""The one small protocol every tier implements, and the slot allocator tiers share.

A tier owns fixed-size slots per namespace. ``allocate`` signals back-pressure by returning
``None`` (the caller evicts or demotes and tries again), never by raising. Data moves between a
slot and a caller's buffer (a memoryview, usually into the shared arena); async variants return
a :class:`Transfer` handle with a deadline-aware ``wait``.

Not thread-safe: a tier is driven from one place (the daemon's core lock or one worker thread);
async variants do their I/O on the tier's own threads and touch no shared tier state there.
"""

from __future__ import annotations

import enum
import threading
from dataclasses import dataclass, field
from typing import Protocol

from kvstore.v1 import kvstore_pb2 as pb


class TierKind(enum.IntEnum):
    """A tier; its value is the ``kvstore.v1.Tier`` the wire carries (TIER_UNSPECIFIED has none)."""

    HBM = pb.TIER_HBM
    DRAM = pb.TIER_DRAM
    NVME = pb.TIER_NVME
    REMOTE = pb.TIER_REMOTE


class TierError(RuntimeError):
    """A tier failed an operation (I/O error, corrupt data, disabled tier)."""


@dataclass(slots=True)
class TierStats:
    kind: TierKind
    capacity_bytes: int
    used_bytes: int
    blocks: int
    emulated: bool = False
    enabled: bool = True
    extra: dict = field(default_factory=dict)


class Transfer:
    """Handle of one async slot transfer. ``wait(timeout_s)`` returns False on timeout;
    ``error`` holds the exception when the transfer failed (its data must not be used)."""

    __slots__ = ("_done", "error", "nbytes")

    def __init__(self, nbytes: int = 0) -> None:
        self._done = threading.Event()
        self.error: BaseException | None = None
        self.nbytes = nbytes

    def finish(self, error: BaseException | None = None) -> None:
        self.error = error
        self._done.set()

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout_s: float | None = None) -> bool:
        return self._done.wait(timeout_s)

    def result(self, timeout_s: float | None = None) -> None:
        """Wait and raise the transfer's error, or TimeoutError past ``timeout_s``."""
        if not self._done.wait(timeout_s):
            raise TimeoutError(f"transfer of {self.nbytes} bytes not done after {timeout_s} s")
        if self.error is not None:
            raise self.error

    @classmethod
    def completed(cls, nbytes: int = 0, error: BaseException | None = None) -> "Transfer":
        t = cls(nbytes)
        t.finish(error)
        return t


class Tier(Protocol):
    kind: TierKind

    def allocate(self, ns_id: bytes, slot_bytes: int) -> int | None:
        """A free slot of ``slot_bytes`` for namespace ``ns_id``, or None when full."""

    def free(self, ns_id: bytes, slot: int) -> None: ...

    def write(self, slot: int, src: memoryview) -> None:
        """Copy ``src`` into ``slot`` (synchronously)."""

    def read(self, slot: int, dst: memoryview) -> None:
        """Copy ``slot`` into ``dst`` (synchronously); raises TierError on corrupt data."""

    def write_async(self, slot: int, src: memoryview) -> Transfer: ...

    def read_async(self, slot: int, dst: memoryview) -> Transfer: ...

    def stats(self) -> TierStats: ...


class ExtentAllocator:
    """Carves a flat byte range into extents, and extents into fixed-size slots per namespace.

    A namespace takes whole extents and cuts them into slots of its own block size, so
    namespaces with different layouts share one arena without fragmenting each other. Offsets
    returned are byte offsets into the range. ``allocate`` is O(1) amortised; ``free`` is O(1);
    an extent whose slots are all free goes back to the shared pool.
    """

    def __init__(self, capacity_bytes: int, extent_bytes: int, align_bytes: int = 4096) -> None:
        if extent_bytes <= 0 or capacity_bytes < extent_bytes:
            raise ValueError(f"extent_bytes must be in (0, capacity_bytes={capacity_bytes}], got {extent_bytes}")
        self.capacity_bytes = capacity_bytes
        self.extent_bytes = extent_bytes
        self.align_bytes = align_bytes
        n = capacity_bytes // extent_bytes
        self._free_extents: list[int] = list(range(n - 1, -1, -1))  # pop() yields low offsets first
        self._free_slots: dict[tuple[bytes, int], list[int]] = {}
        self._extent_owner: dict[int, tuple[bytes, int]] = {}  # extent -> (ns, slot_bytes)
        self._extent_used: dict[int, int] = {}
        self.used_bytes = 0

    @property
    def usable_bytes(self) -> int:
        return (self.capacity_bytes // self.extent_bytes) * self.extent_bytes

    def slot_stride(self, slot_bytes: int) -> int:
        a = self.align_bytes
        return (slot_bytes + a - 1) // a * a

    def fits(self, slot_bytes: int) -> bool:
        return self.slot_stride(slot_bytes) <= self.extent_bytes

    def allocate(self, ns_id: bytes, slot_bytes: int) -> int | None:
        stride = self.slot_stride(slot_bytes)
        if stride > self.extent_bytes:
            return None
        pool = self._free_slots.setdefault((ns_id, slot_bytes), [])
        if not pool:
            if not self._free_extents:
                return None
            ext = self._free_extents.pop()
            self._extent_owner[ext] = (ns_id, slot_bytes)
            self._extent_used[ext] = 0
            base = ext * self.extent_bytes
            per = self.extent_bytes // stride
            pool.extend(base + i * stride for i in range(per - 1, -1, -1))
        off = pool.pop()
        self._extent_used[off // self.extent_bytes] += 1
        self.used_bytes += stride
        return off

    def free(self, ns_id: bytes, slot_bytes: int, offset: int) -> None:
        ext = offset // self.extent_bytes
        owner = self._extent_owner.get(ext)
        if owner != (ns_id, slot_bytes):
            raise ValueError(f"slot at {offset} is not a {slot_bytes}-byte slot of this namespace")
        stride = self.slot_stride(slot_bytes)
        self.used_bytes -= stride
        self._extent_used[ext] -= 1
        pool = self._free_slots[owner]
        if self._extent_used[ext] == 0:
            base = ext * self.extent_bytes
            end = base + self.extent_bytes
            # Return the whole extent: drop its slots from the namespace's free list.
            pool[:] = [o for o in pool if not base <= o < end]
            del self._extent_owner[ext], self._extent_used[ext]
            self._free_extents.append(ext)
        else:
            pool.append(offset)

    def free_extents(self) -> int:
        return len(self._free_extents)
