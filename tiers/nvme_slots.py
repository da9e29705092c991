"""The slot-level :class:`~kvstore.tiers.base.Tier` protocol on the NVMe tier's state.

Slots are byte offsets in the tier's flat data space, cut from extents by the shared
:class:`~kvstore.tiers.base.ExtentAllocator`. Slot-level data is checksummed (one xxh3 per
write, kept in memory) but neither indexed nor durable: it does not survive a restart, and its
slots are free space on the next start. Slots holding indexed blocks (from ``put_many``) are
read through the index and cannot be written or freed here.
"""

from __future__ import annotations

import numpy as np

from kvstore.tiers.base import Transfer
from kvstore.tiers.nvme_core import NvmeCore
from kvstore.tiers.nvme_io import as_u8, chunk_sums
from kvstore.tiers.nvme_types import NvmeChecksumError, NvmeError, NvmeIOError, classify_os_error


class SlotApi(NvmeCore):
    def allocate(self, ns_id: bytes, slot_bytes: int) -> int | None:
        """A free slot of ``slot_bytes`` (its byte offset) or None when the tier is full."""
        with self._lock:
            self._check_enabled()
            return self._alloc.allocate(ns_id, slot_bytes)

    def free(self, ns_id: bytes, slot: int) -> None:
        """Give a slot back; raises ValueError for another namespace's slot or an indexed one."""
        with self._lock:
            owner = self._alloc.owner(slot)
            if owner is None or owner[0] != ns_id:
                raise ValueError(f"slot {slot} is not a slot of this namespace")
            if slot in self._by_slot or slot in self._pending_slots:
                raise ValueError(f"slot {slot} holds an indexed block; use delete(keys)")
            self._slot_sums.pop(slot, None)
            self._release(slot)

    def write(self, slot: int, src) -> None:
        """Copy ``src`` (at most the slot's bytes) into ``slot``, synchronously."""
        a = as_u8(src, False, "src")
        with self._lock:
            self._check_slot_write(slot, a)
        self._slot_write(slot, a, self._bounce())

    def write_async(self, slot: int, src) -> Transfer:
        a = as_u8(src, False, "src")
        t = Transfer(a.nbytes)
        with self._lock:
            self._check_slot_write(slot, a)
            self._workers.submit(lambda bounce: self._run_into(t, self._slot_write, slot, a, bounce))
        return t

    def read(self, slot: int, dst) -> None:
        """Copy what was last written to ``slot`` into ``dst`` and verify it. Raises
        NvmeChecksumError on a mismatch: ``dst`` then holds no valid data."""
        a = as_u8(dst, True, "dst")
        with self._lock:
            key, n, want = self._check_slot_read(slot, a)
        if key is not None:
            b = self.get_many([key], [a])
            b.wait()
            if b.error is not None:
                raise b.errors.get(key, b.error)
            return
        self._slot_read(slot, a, n, want, self._bounce())

    def read_async(self, slot: int, dst) -> Transfer:
        a = as_u8(dst, True, "dst")
        with self._lock:
            key, n, want = self._check_slot_read(slot, a)
            if key is None:
                t = Transfer(n)
                self._workers.submit(lambda bounce: self._run_into(t, self._slot_read, slot, a, n, want, bounce))
                return t
        return self.get_many([key], [a])

    # --- internals ----------------------------------------------------------------------------

    def _check_slot_write(self, slot: int, a: np.ndarray) -> None:
        self._check_enabled()
        owner = self._alloc.owner(slot)
        if owner is None or not self._alloc.slot_index_ok(owner[1], slot):
            raise ValueError(f"slot {slot} is not an allocated slot")
        if not 0 < a.nbytes <= owner[1]:
            raise ValueError(f"src: {a.nbytes} bytes does not fit a slot of {owner[1]} bytes")
        if slot in self._by_slot or slot in self._pending_slots:
            raise ValueError(f"slot {slot} holds an indexed block; use put_many")

    def _slot_write(self, slot: int, a: np.ndarray, bounce: np.ndarray) -> None:
        s = chunk_sums(a, a.nbytes, 0)[0]
        try:
            self._files.write(slot, a, bounce)
        except OSError as e:
            raise self._fail(classify_os_error(e, f"writing slot {slot}")) from e
        self._count_io("write", a.nbytes)
        with self._lock:
            self._slot_sums[slot] = (a.nbytes, s)

    def _check_slot_read(self, slot: int, a: np.ndarray) -> tuple[bytes | None, int, int]:
        """``(key, 0, 0)`` for an indexed block, else ``(None, nbytes, xxh3)`` with the slot pinned."""
        self._check_enabled()
        key = self._by_slot.get(slot)
        if key is not None:
            return key, 0, 0
        meta = self._slot_sums.get(slot)
        if meta is None:
            raise ValueError(f"slot {slot} holds no data written through the slot API since start")
        if a.nbytes < meta[0]:
            raise ValueError(f"dst: {a.nbytes} bytes, the slot holds {meta[0]}")
        self._pin(slot)
        return None, meta[0], meta[1]

    def _slot_read(self, slot: int, a: np.ndarray, n: int, want: int, bounce: np.ndarray) -> None:
        try:
            self._files.read(slot, a, n, bounce)
            self._count_io("read", n)
        except OSError as e:
            raise self._fail(classify_os_error(e, f"reading slot {slot}")) from e
        finally:
            with self._lock:
                self._unpin(slot)
        if chunk_sums(a, n, 0)[0] != want:
            with self._lock:
                self._counts["checksum_failures"] += 1
                self._slot_sums.pop(slot, None)
            if self._metrics is not None:
                self._metrics.checksum_failures.labels(source="nvme").inc()
            raise NvmeChecksumError(f"NVMe slot {slot}: checksum mismatch; the destination holds no valid data",
                                    offset=slot)

    @staticmethod
    def _run_into(t: Transfer, fn, *args) -> None:
        try:
            fn(*args)
        except BaseException as e:  # noqa: BLE001 - handed to the waiter
            t.finish(e if isinstance(e, NvmeError) else NvmeIOError(f"slot transfer failed: {e!r}"))
            return
        t.finish()
