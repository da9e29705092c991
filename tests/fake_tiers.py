"""An in-memory NVMe tier for unit tests of tier movement.

:class:`FakeKeyedTier` keeps :class:`kvstore.tiers.base.KeyedTier` with the semantics the daemon
relies on: per-key :class:`~kvstore.tiers.nvme.IoResult` in an :class:`~kvstore.tiers.nvme.NvmeBatch`,
a full tier answering ``NO_SPACE`` (slots cut by the same :class:`~kvstore.tiers.base.ExtentAllocator`
as the real tier), ``PRESENT`` for a key stored or being stored, xxh3 chunk checksums recorded on
put and verified on get (a mismatch is ``CORRUPT`` and drops the block), ``CANCELLED`` for a key
deleted while its put runs, and ``NvmeDisabledError`` from every call once it disabled itself.
tests/tier_contract.py runs against it.

It starts no thread. A batch without ``on_done`` completes before the call returns. A batch with
``on_done`` completes only when the test calls :meth:`FakeKeyedTier.complete`, on the test's
thread: the real tier runs ``on_done`` on its own threads, never inside the call, and the test
decides when "the disk" finishes. What the test can make happen: :meth:`~FakeKeyedTier.fail_writes`,
:meth:`~FakeKeyedTier.corrupt`, :meth:`~FakeKeyedTier.disable`, a small capacity (``NO_SPACE``), and
:meth:`~FakeKeyedTier.during_next_put`, which runs the test's code while a put is in flight.
"""

from __future__ import annotations

import threading
import time
from array import array
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Sequence

import numpy as np

from kvstore.keys import check_key
from kvstore.tiers.base import ExtentAllocator, TierKind, TierStats
from kvstore.tiers.nvme import (IoResult, NvmeBatch, NvmeChecksumError, NvmeDisabledError, NvmeEntry, NvmeError,
                                NvmeIOError, PutItem)
from kvstore.tiers.nvme.files import as_u8, chunk_sums


@dataclass
class _Stored:
    ns_id: bytes
    parent: bytes | None
    chunk_bytes: int
    data: np.ndarray
    sums: array
    slot: int
    atime: float
    ctime: float


class FakeKeyedTier:
    """In-memory blocks by key in ``capacity_bytes`` cut into ``extent_bytes`` extents.
    ``directory`` is where the daemon keeps its namespace descriptions; ``clock`` gives access
    and write times in Unix seconds. Thread-safe (one lock; none held while test code runs)."""

    kind = TierKind.NVME

    def __init__(self, directory: str, capacity_bytes: int, extent_bytes: int,
                 clock: Callable[[], float] = time.time) -> None:
        self._dir = directory
        self._clock = clock
        self._lock = threading.Lock()
        self._alloc = ExtentAllocator(capacity_bytes, extent_bytes)
        self._blocks: dict[bytes, _Stored] = {}
        self._writing: set[bytes] = set()     # keys of the put in flight
        self._cancelled: set[bytes] = set()   # deleted while their put was in flight
        self._later: list[Callable[[], None]] = []  # completions of batches with on_done
        self._hooks: list[Callable[[list[bytes]], None]] = []
        self._write_failures = 0
        self._write_failure_disables = True
        self._disabled: NvmeError | None = None
        self._closed = False
        self.puts = 0  # put_many calls that wrote something

    # --- what a test makes happen -------------------------------------------------------
    def complete(self, batches: int | None = None) -> int:
        """Finish every batch waiting for "the disk" (those given ``on_done``; at most
        ``batches`` of them), oldest first, on the caller's thread; returns how many finished."""
        n = 0
        while batches is None or n < batches:
            with self._lock:
                if not self._later:
                    return n
                done = self._later.pop(0)
            done()
            n += 1
        return n

    def in_flight(self) -> int:
        """Batches that :meth:`complete` would finish."""
        with self._lock:
            return len(self._later)

    def during_next_put(self, fn: Callable[[list[bytes]], None]) -> None:
        """Run ``fn(keys)`` inside the next put that writes, once its slots are taken and before
        its blocks land: what the rest of the daemon sees while a demotion or a durable commit
        is in flight."""
        with self._lock:
            self._hooks.append(fn)

    def fail_writes(self, count: int = 1, *, disable: bool = True) -> None:
        """The next ``count`` block writes end FAILED with an I/O error; like the real tier on an
        I/O error, the tier then disables itself (unless ``disable`` is False)."""
        with self._lock:
            self._write_failures, self._write_failure_disables = count, disable

    def corrupt(self, key: bytes) -> None:
        """Flip one byte of a stored block: its next read fails its checksum."""
        with self._lock:
            self._blocks[key].data[0] ^= 0xFF

    def disable(self, reason: str = "injected I/O error") -> None:
        """Disable the tier as an I/O error would: every later call raises NvmeDisabledError
        and ``stats().enabled`` is False. Stored blocks stay for :meth:`reopened`."""
        with self._lock:
            self._disabled = self._disabled or NvmeIOError(reason)

    def reopened(self) -> "FakeKeyedTier":
        """A new tier object holding the same committed blocks and access times, as the next
        daemon start finds the directory (puts that never completed are gone)."""
        with self._lock:
            t = FakeKeyedTier(self._dir, self._alloc.capacity_bytes, self._alloc.extent_bytes, self._clock)
            t._blocks = {k: _Stored(**vars(r)) for k, r in self._blocks.items()}
            if t._alloc.restore((r.ns_id, r.data.nbytes, r.slot) for r in t._blocks.values()):
                raise RuntimeError("stored blocks overlap: the fake tier lost track of its slots")
            return t

    # --- KeyedTier ----------------------------------------------------------------------
    @property
    def dir(self) -> str:
        return self._dir

    @property
    def enabled(self) -> bool:
        return self._disabled is None and not self._closed

    def stats(self) -> TierStats:
        with self._lock:
            reason = str(self._disabled) if self._disabled else "closed" if self._closed else ""
            return TierStats(self.kind, self._alloc.usable_bytes, self._alloc.used_bytes, self._alloc.used_slots,
                             enabled=not reason, extra={"dir": self._dir, "disabled_reason": reason})

    def put_many(self, items: Iterable[PutItem | tuple],
                 on_done: Callable[[NvmeBatch], None] | None = None) -> NvmeBatch:
        puts = []
        for it in items:
            item = PutItem(*it)
            src = as_u8(item.src, False, "src")
            if not src.nbytes or not self._alloc.fits(src.nbytes):
                raise ValueError(f"src: a block of {src.nbytes} bytes; must be 1 to extent_bytes")
            puts.append((item, check_key(item.key), src))
        batch = NvmeBatch("put", [k for _, k, _ in puts], on_done)
        writing = []
        with self._lock:
            self._check_enabled()
            for item, key, src in puts:
                if key in self._blocks or key in self._writing:
                    batch.set(key, IoResult.PRESENT)
                    continue
                slot = self._alloc.allocate(item.ns_id, src.nbytes)
                if slot is None:
                    batch.set(key, IoResult.NO_SPACE)
                    continue
                self._writing.add(key)
                writing.append((item, key, src, slot))
            hooks, self._hooks = (self._hooks, []) if writing else ([], self._hooks)
        for fn in hooks:
            fn([key for _, key, _, _ in writing])
        sums, nbytes = {}, 0
        with self._lock:
            self.puts += bool(writing)
            now = self._clock()
            for item, key, src, slot in writing:
                self._writing.discard(key)
                if key in self._cancelled:
                    self._cancelled.discard(key)
                    self._alloc.free(item.ns_id, src.nbytes, slot)
                    batch.set(key, IoResult.CANCELLED)
                elif self._write_failures:
                    self._write_failures -= 1
                    err = NvmeIOError(f"injected I/O error writing block {key.hex()[:16]}")
                    if self._write_failure_disables:
                        self._disabled = self._disabled or err
                    self._alloc.free(item.ns_id, src.nbytes, slot)
                    batch.set(key, IoResult.FAILED, err)
                else:
                    s = (array("Q", item.sums) if item.sums is not None  # as recorded, like the real tier
                         else chunk_sums(src, src.nbytes, item.chunk_bytes))
                    parent = check_key(item.parent) if item.parent is not None else None
                    self._blocks[key] = _Stored(item.ns_id, parent, item.chunk_bytes, src.copy(), s, slot, now, now)
                    batch.set(key, IoResult.OK)
                    sums[key] = s
                    nbytes += src.nbytes
        self._when_done(on_done, lambda: batch.finish_batch(nbytes, sums))
        return batch

    def get_many(self, keys: Sequence[bytes], dsts: Sequence,
                 on_done: Callable[[NvmeBatch], None] | None = None) -> NvmeBatch:
        keys = [check_key(k) for k in keys]
        if len(keys) != len(dsts) or len(set(keys)) != len(keys):
            raise ValueError("get_many: one dst per key, and no key twice")
        bufs = [as_u8(d, True, "dst") for d in dsts]
        batch = NvmeBatch("get", keys, on_done)
        reads = []
        with self._lock:
            self._check_enabled()
            for k, buf in zip(keys, bufs):
                r = self._blocks.get(k)
                if r is None:
                    batch.set(k, IoResult.MISSING)
                elif buf.nbytes < r.data.nbytes:
                    raise ValueError(f"dst: {buf.nbytes} bytes, block {k.hex()[:16]} has {r.data.nbytes}")
                else:
                    reads.append((k, buf, r))  # the record as found: the real tier pins its slot

        def read() -> None:
            sums, nbytes = {}, 0
            with self._lock:
                for k, buf, r in reads:
                    n = r.data.nbytes
                    buf[:n] = r.data
                    got = chunk_sums(buf, n, r.chunk_bytes)
                    if got != r.sums:
                        err = NvmeChecksumError(f"block {k.hex()[:16]}: checksum mismatch", key=k)
                        batch.set(k, IoResult.CORRUPT, err)
                        if self._blocks.get(k) is r:  # dropped, as the real tier does
                            del self._blocks[k]
                            self._alloc.free(r.ns_id, n, r.slot)
                        continue
                    r.atime = self._clock()
                    batch.set(k, IoResult.OK)
                    sums[k] = got
                    nbytes += n
            batch.finish_batch(nbytes, sums)

        self._when_done(on_done, read)
        return batch

    def delete(self, keys: Iterable[bytes]) -> int:
        keys = {check_key(k) for k in keys}
        n = 0
        with self._lock:
            self._check_enabled()
            for k in keys:
                if k in self._writing:
                    self._cancelled.add(k)
                    n += 1
                r = self._blocks.pop(k, None)
                if r is not None:
                    self._alloc.free(r.ns_id, r.data.nbytes, r.slot)
                    n += 1
        return n

    def entries(self) -> Iterator[NvmeEntry]:
        with self._lock:
            out = [NvmeEntry(k, r.ns_id, r.parent, r.data.nbytes, r.chunk_bytes, r.atime, r.ctime, r.slot)
                   for k, r in sorted(self._blocks.items())]
        return iter(out)

    def set_atimes(self, pairs: Iterable[tuple[bytes, float]]) -> None:
        pairs = list(pairs)
        with self._lock:
            self._check_open()
            for k, t in pairs:
                r = self._blocks.get(k)
                if r is not None:
                    r.atime = t

    def close(self) -> None:
        """Finish the batches in flight, then refuse new work. Idempotent."""
        self.complete()
        with self._lock:
            self._closed = True

    # --- helpers ------------------------------------------------------------------------
    def _when_done(self, on_done, finish: Callable[[], None]) -> None:
        """Finish a batch now, or (with ``on_done``) when the test calls :meth:`complete`."""
        if on_done is None:
            finish()
        else:
            with self._lock:
                self._later.append(finish)

    def _check_open(self) -> None:
        if self._closed:
            raise NvmeDisabledError(f"NVMe tier {self._dir!r} is closed")

    def _check_enabled(self) -> None:
        self._check_open()
        if self._disabled is not None:
            err = NvmeDisabledError(f"NVMe tier {self._dir!r} is disabled: {self._disabled}")
            err.__cause__ = self._disabled
            raise err
