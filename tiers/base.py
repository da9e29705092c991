"""What the daemon drives on each tier (one :class:`typing.Protocol` per kind of tier), the
shared slot allocator, and the small types every tier uses.

Two kinds of tier, because the daemon drives them differently:

- :class:`SlotTier` (DRAM, HBM): fixed-size slots per namespace, cut from extents by
  :class:`ExtentAllocator`; the caller keeps the index (key -> slot). ``allocate`` signals
  back-pressure by returning ``None``, never by raising. :class:`ArenaTier` (DRAM) exposes its
  slots as views into the shared arena (clients and the daemon copy through them);
  :class:`DevicePoolTier` (HBM) fills its slots by DMA (:meth:`~DevicePoolTier.promote`) and hands
  its pool to workers.
- :class:`KeyedTier` (NVMe): a durable store of blocks by key with its own index; batched puts
  and gets report per key (back-pressure there is a per-key ``NO_SPACE``).

The contract test suite (``tests/tier_contract.py``) runs against every tier through these
protocols. Sizes are bytes, times seconds (access times: Unix seconds).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterable, Iterator, Protocol, Sequence, runtime_checkable

if TYPE_CHECKING:
    import numpy as np

    from kvstore.tiers.arena import Arena
    from kvstore.tiers.nvme import NvmeBatch, NvmeEntry, PutItem

from kvstore.tier_kind import TierKind  # noqa: F401 (the tiers' vocabulary, re-exported)
from kvstore.v1 import kvstore_pb2 as pb


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


class CopyHandle:
    """Handle of one asynchronous copy (an HBM promote or demote; the NVMe tier's batches extend
    it). ``wait(timeout_s)`` returns False on timeout; ``error`` holds the exception when the
    copy failed (its data must not be used). ``nbytes``: bytes it moves."""

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
    def completed(cls, nbytes: int = 0, error: BaseException | None = None) -> "CopyHandle":
        t = cls(nbytes)
        t.finish(error)
        return t


@runtime_checkable
class Tier(Protocol):
    """What every tier answers."""

    kind: TierKind

    def stats(self) -> TierStats:
        """Capacity and use (bytes), blocks held, and whether the tier is enabled."""


@runtime_checkable
class SlotTier(Tier, Protocol):
    """Fixed-size slots per namespace; the caller keeps the index and its own lock (not
    thread-safe). A slot is a byte offset into the tier's memory."""

    @property
    def capacity_bytes(self) -> int:
        """Bytes that slots can be cut from (whole extents)."""

    def fits(self, slot_bytes: int) -> bool:
        """True if a slot of ``slot_bytes`` fits one extent (else ``allocate`` never succeeds)."""

    def slot_stride(self, slot_bytes: int) -> int:
        """Bytes one slot of ``slot_bytes`` takes (rounded up to the alignment)."""

    def allocate(self, ns_id: bytes, slot_bytes: int) -> int | None:
        """A free slot of ``slot_bytes`` for namespace ``ns_id``, or None when full."""

    def free(self, ns_id: bytes, slot: int) -> None:
        """Give ``slot`` back; ValueError if it is not a slot of ``ns_id``."""


@runtime_checkable
class ArenaTier(SlotTier, Protocol):
    """DRAM: slots in the shared-memory arena that clients map too (zero-copy on their side)."""

    arena: Arena
    ns_bytes: dict[bytes, int]  # slot bytes (strides) each namespace holds, for quotas

    @property
    def used_bytes(self) -> int:
        """Bytes of allocated slots (strides)."""

    @property
    def extent_bytes(self) -> int:
        """The allocation unit a namespace takes whole; no slot is larger."""

    def max_slots(self, slot_bytes: int) -> int:
        """Most slots of ``slot_bytes`` the tier can ever hold at once."""

    def view(self, slot: int, nbytes: int) -> np.ndarray:
        """The first ``nbytes`` of ``slot`` as a writable uint8 array over the arena (no copy);
        ValueError past the slot's size."""


@runtime_checkable
class DevicePoolTier(SlotTier, Protocol):
    """HBM: slots in one device pool, filled by DMA from the (registered) arena; workers map
    the pool themselves and copy device-to-device."""

    @property
    def emulated(self) -> bool:
        """True when no GPU backs the pool (figures must not pass for GPU figures)."""

    def register_host(self, arena: Arena) -> bool:
        """Page-lock ``arena`` for DMA; True if memory was pinned (False when emulated)."""

    def promote(self, pairs: Iterable[tuple[int, object]]) -> CopyHandle:
        """Copy each ``(slot, host buffer)`` into the pool, as one asynchronous transfer; the
        buffers must not change until it is done."""

    def ipc_handle(self) -> dict:
        """What a worker needs to map the pool (``kvstore.tiers.hbm.open_pool``)."""

    def close(self) -> None:
        """Finish queued copies and release the pool."""


@runtime_checkable
class KeyedTier(Tier, Protocol):
    """NVMe: a durable block store with its own index. Thread-safe; batches complete on the
    tier's threads (``on_done`` runs there)."""

    @property
    def dir(self) -> str:
        """The tier's directory; the daemon keeps its namespace descriptions beside the blocks."""

    @property
    def enabled(self) -> bool:
        """False once the tier disabled itself (I/O error, disk or index full) or was closed."""

    def put_many(self, items: Iterable[PutItem | tuple],
                 on_done: Callable[[NvmeBatch], None] | None = None) -> NvmeBatch:
        """Store blocks; per-key results in the batch (``NO_SPACE`` when full, known at once)."""

    def get_many(self, keys: Sequence[bytes], dsts: Sequence,
                 on_done: Callable[[NvmeBatch], None] | None = None) -> NvmeBatch:
        """Read and verify blocks into ``dsts``; ``dsts[i]`` is valid only if its key ended OK."""

    def delete(self, keys: Iterable[bytes]) -> int:
        """Remove blocks (and cancel puts in flight); returns how many were here or in flight."""

    def entries(self) -> Iterator[NvmeEntry]:
        """Every stored block's metadata: what the daemon rebuilds its index from at start."""

    def set_atimes(self, pairs: Iterable[tuple[bytes, float]]) -> None:
        """Record ``(key, Unix seconds)`` access times; they reach the index within seconds."""

    def close(self) -> None:
        """Finish batches in flight, write access times, release the directory."""


class ExtentAllocator:
    """Carves a flat byte range into extents, and extents into fixed-size slots per namespace.

    A namespace takes whole extents and cuts them into slots of its own block size, so
    namespaces with different layouts share one arena without fragmenting each other. Offsets
    returned are byte offsets into the range. ``allocate`` is O(1) amortised; ``free`` is O(1);
    an extent whose slots are all free goes back to the shared pool. :meth:`restore` rebuilds
    the free lists of a persistent tier from the slots its index names.
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
        self.used_bytes = 0  # strides of allocated slots
        self.used_slots = 0

    @property
    def usable_bytes(self) -> int:
        return (self.capacity_bytes // self.extent_bytes) * self.extent_bytes

    def slot_stride(self, slot_bytes: int) -> int:
        a = self.align_bytes
        return (slot_bytes + a - 1) // a * a

    def fits(self, slot_bytes: int) -> bool:
        return self.slot_stride(slot_bytes) <= self.extent_bytes

    def max_slots(self, slot_bytes: int) -> int:
        """Most slots of ``slot_bytes`` the range can ever hold at once."""
        return (self.capacity_bytes // self.extent_bytes) * (self.extent_bytes // self.slot_stride(slot_bytes))

    def owner(self, offset: int) -> tuple[bytes, int] | None:
        """``(ns_id, slot_bytes)`` of the extent holding ``offset``, None if the extent is free."""
        return self._extent_owner.get(offset // self.extent_bytes)

    def room(self, ns_id: bytes, slot_bytes: int) -> int:
        """Slots of ``slot_bytes`` that ``ns_id`` could allocate now."""
        stride = self.slot_stride(slot_bytes)
        if stride > self.extent_bytes:
            return 0
        return len(self._free_slots.get((ns_id, slot_bytes), ())) + len(self._free_extents) * (self.extent_bytes // stride)

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
        self.used_slots += 1
        return off

    def allocate_fit(self, ns_id: bytes, slot_bytes: int, limit: int) -> tuple[int, int] | None:
        """A slot of at least ``slot_bytes`` and at most ``limit`` bytes for ``ns_id``:
        ``(offset, its slot size)``. Its own size first (a new extent if need be), else the
        smallest free slot of a larger size the namespace's extents already hold: space left in
        those is used before the range counts as full. None when neither exists."""
        off = self.allocate(ns_id, slot_bytes)
        if off is not None:
            return off, slot_bytes
        sizes = sorted(sb for (ns, sb), pool in self._free_slots.items()
                       if ns == ns_id and pool and slot_bytes < sb <= limit)
        for sb in sizes:
            off = self.allocate(ns_id, sb)
            if off is not None:
                return off, sb
        return None

    def free(self, ns_id: bytes, slot_bytes: int, offset: int) -> None:
        ext = offset // self.extent_bytes
        owner = self._extent_owner.get(ext)
        if owner != (ns_id, slot_bytes):
            raise ValueError(f"slot at {offset} is not a {slot_bytes}-byte slot of this namespace")
        stride = self.slot_stride(slot_bytes)
        self.used_bytes -= stride
        self.used_slots -= 1
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

    def slot_index_ok(self, slot_bytes: int, offset: int) -> bool:
        """True if ``offset`` is the start of a slot of ``slot_bytes`` inside the usable range."""
        stride = self.slot_stride(slot_bytes)
        rel = offset % self.extent_bytes
        return (0 <= offset < self.usable_bytes and stride <= self.extent_bytes
                and rel % stride == 0 and rel + stride <= self.extent_bytes)

    def restore(self, slots: Iterable[tuple[bytes, int, int]]) -> list[int]:
        """Mark ``(ns_id, slot_bytes, offset)`` slots used on a fresh allocator, in one pass.

        Returns the positions (in input order) of the slots refused: out of range, misaligned,
        in an extent another namespace or slot size owns, or already claimed.
        """
        if self.used_slots or self._extent_owner:
            raise RuntimeError("restore() needs a fresh allocator")
        E = self.extent_bytes
        by_ext: dict[int, tuple[tuple[bytes, int], set[int]]] = {}
        refused = []
        for i, (ns_id, slot_bytes, off) in enumerate(slots):
            if not self.slot_index_ok(slot_bytes, off):
                refused.append(i)
                continue
            owner = (ns_id, slot_bytes)
            got = by_ext.setdefault(off // E, (owner, set()))
            if got[0] != owner or off in got[1]:
                refused.append(i)
                continue
            got[1].add(off)
        for ext, (owner, used) in by_ext.items():
            stride = self.slot_stride(owner[1])
            base = ext * E
            self._extent_owner[ext] = owner
            self._extent_used[ext] = len(used)
            pool = self._free_slots.setdefault(owner, [])
            pool.extend(o for o in range(base + (E // stride - 1) * stride, base - 1, -stride) if o not in used)
            self.used_bytes += len(used) * stride
            self.used_slots += len(used)
        self._free_extents = [e for e in self._free_extents if e not in by_ext]
        return refused
