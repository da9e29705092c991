"""The NVMe tier: blocks in preallocated data files, an LMDB index, checksums on every read.

Key-level API (what the daemon drives): :meth:`NvmeTier.put_many`, :meth:`~NvmeTier.get_many`,
:meth:`~NvmeTier.delete`, :meth:`~NvmeTier.contains`, :meth:`~NvmeTier.touch`,
:meth:`~NvmeTier.entries`. Slot-level API: the :class:`~kvstore.tiers.base.Tier` protocol, for
the shared contract suite and callers that keep their own index; slot-level data is not indexed
and does not survive a restart.

Durability order of a put: data written (O_DIRECT) and, in ``SyncMode.DURABLE``, fdatasync'ed;
then the LMDB transaction naming it commits; only then is the put reported OK. A restart
therefore finds only blocks whose bytes were completely written; a torn write has no index
record and its slot is free. Every read verifies the xxh3_64 of each layer chunk: a mismatch
drops the block (index record deleted, slot freed), counts it, and fails that key.

Thread-safety: every public method may be called from any thread. One lock guards the
in-memory state (allocator, key -> slot map, pins); a second serialises index writes. Block
I/O runs on ``io_threads`` worker threads, index commits on one committer thread that groups
finished put batches into one fdatasync + one LMDB transaction.
"""

from __future__ import annotations

import fcntl
import logging
import os
import queue
import threading
import time
from typing import Callable, Iterable, Iterator, Sequence

import lmdb
import numpy as np

from kvstore.keys import check_key
from kvstore.tiers.base import TierKind, TierStats, Transfer
from kvstore.tiers.nvme_index import BlockRecord, NvmeIndex, SlotAllocator
from kvstore.tiers.nvme_io import ALIGN, DataFiles, IoMode, Workers, aligned_buffer, as_u8, chunk_sums
from kvstore.tiers.nvme_types import (
    DISABLING, NvmeBatch, NvmeBusyError, NvmeChecksumError, NvmeConfig, NvmeDisabledError, NvmeEntry,
    NvmeError, NvmeGeometryError, NvmeIOError, Outcome, PutItem, RecoveryReport, SyncMode,
    classify_lmdb_error, classify_os_error)

__all__ = ["NvmeTier", "NvmeConfig", "SyncMode", "IoMode", "Outcome", "PutItem", "NvmeBatch", "NvmeEntry",
           "RecoveryReport", "NvmeError"]

log = logging.getLogger("kvstore.tiers.nvme")
_STOP = object()


class _Job:
    __slots__ = ("key", "ns_id", "parent", "chunk_bytes", "buf", "nbytes", "offset", "sums", "error")

    def __init__(self, key, ns_id, parent, chunk_bytes, buf, nbytes, offset, sums=None):
        self.key, self.ns_id, self.parent, self.chunk_bytes = key, ns_id, parent, chunk_bytes
        self.buf, self.nbytes, self.offset, self.sums = buf, nbytes, offset, sums
        self.error: NvmeError | None = None


class NvmeTier:
    """See the module docstring. ``clock`` gives access/commit times (Unix seconds)."""

    kind = TierKind.NVME

    def __init__(self, config: NvmeConfig, metrics=None, clock: Callable[[], float] = time.time) -> None:
        self.config = config
        self._metrics = metrics
        self._clock = clock
        self._lock = threading.Lock()         # in-memory state below
        self._index_lock = threading.Lock()   # index writes; taken before _lock, never after
        self._by_key: dict[bytes, int] = {}   # committed key -> slot offset
        self._by_slot: dict[int, bytes] = {}
        self._pending: dict[bytes, int] = {}  # put in flight: key -> slot
        self._pending_slots: set[int] = set()
        self._cancelled: set[bytes] = set()   # deleted while in flight
        self._pins: dict[int, int] = {}       # slot -> reads in flight
        self._free_on_unpin: set[int] = set()
        self._slot_sums: dict[int, tuple[int, int]] = {}  # slot-level writes: slot -> (nbytes, xxh3)
        self._dirty_atime: dict[bytes, float] = {}
        self._disabled: NvmeError | None = None
        self._closed = False
        self._counts = dict.fromkeys(("reads", "writes", "read_bytes", "written_bytes",
                                      "checksum_failures", "dropped"), 0)
        self._local = threading.local()
        self._lock_fd = -1
        self._index: NvmeIndex | None = None
        self._files: DataFiles | None = None
        what = f"opening NVMe tier directory {config.dir!r}"
        try:
            self.recovery = self._open()
        except BaseException as e:
            self._close_handles()
            if isinstance(e, OSError):
                raise classify_os_error(e, what) from e
            if isinstance(e, lmdb.Error):
                raise classify_lmdb_error(e, what, config.map_bytes) from e
            raise
        self._commit_q: queue.SimpleQueue = queue.SimpleQueue()
        self._workers = Workers(config.io_threads, config.bounce_bytes, "nvme-io", self._crashed)
        self._committer = threading.Thread(target=self._commit_loop, name="nvme-commit", daemon=True)
        self._committer.start()

    # --- open and recover ---------------------------------------------------------------------

    def _open(self) -> RecoveryReport:
        cfg = self.config
        os.makedirs(cfg.dir, exist_ok=True)
        self._lock_fd = os.open(os.path.join(cfg.dir, "LOCK"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise NvmeBusyError(f"NVMe tier directory {cfg.dir!r} is in use by another process") from None
        self._index = NvmeIndex(os.path.join(cfg.dir, "index"), cfg.map_bytes, cfg.sync is SyncMode.DURABLE)
        want = {"format": 1, "file_bytes": cfg.file_bytes, "extent_bytes": cfg.extent_bytes, "align": ALIGN}
        have = self._index.geometry(want)
        if have != want:
            raise NvmeGeometryError(f"{cfg.dir!r} was laid out with {have}, the config asks for {want}; "
                                    "use the old file_bytes/extent_bytes or a new directory")
        self._files = DataFiles(cfg.dir, cfg.usable_bytes, cfg.file_bytes, cfg.io_mode, cfg.preallocate)
        self._alloc = SlotAllocator(cfg.usable_bytes, cfg.extent_bytes, ALIGN)
        return self._recover()

    def _recover(self) -> RecoveryReport:
        t0 = time.perf_counter()
        keep: list[tuple[bytes, bytes, int, int, int]] = []  # key, ns, slot_bytes, offset, nbytes
        bad: list[bytes] = []
        for key, raw in self._index.scan():
            try:
                r = BlockRecord.unpack(key, raw)
                n_chunks = -(-r.nbytes // r.chunk_bytes) if r.chunk_bytes else 1
                if len(key) != 32 or not 0 < r.nbytes <= r.slot_bytes or len(r.sums) != n_chunks:
                    raise ValueError("inconsistent sizes")
            except ValueError:
                bad.append(key)
                continue
            keep.append((key, r.ns_id, r.slot_bytes, r.offset, r.nbytes))
        refused = set(self._alloc.restore((ns, sb, off) for _, ns, sb, off, _ in keep))
        nbytes = 0
        for i, (key, _, _, off, n) in enumerate(keep):
            if i in refused:
                bad.append(key)
            else:
                self._by_key[key], self._by_slot[off] = off, key
                nbytes += n
        if bad:
            log.warning("NVMe recovery: dropping %d index records that cannot be trusted", len(bad))
            self._index.delete(bad)
        report = RecoveryReport(len(self._by_key), nbytes, len(bad), time.perf_counter() - t0)
        log.info("NVMe tier %s: %d blocks (%d bytes) recovered, %d dropped, %s I/O, in %.3f s",
                 self.config.dir, report.blocks, report.bytes, report.dropped, self._files.mode.value,
                 report.seconds)
        return report

    # --- key-level API ------------------------------------------------------------------------

    def put_many(self, items: Iterable[PutItem | tuple], on_done: Callable[[NvmeBatch], None] | None = None
                 ) -> NvmeBatch:
        """Store blocks ``(ns_id, key, parent, chunk_bytes, src)``; the batch completes when each
        block is on disk and indexed (or failed). ``on_done(batch)`` runs on a tier thread then.

        Raises ValueError for malformed items (nothing is stored) and NvmeDisabledError when the
        tier is disabled. A full tier is not an error here: those keys end NO_SPACE at once.
        """
        jobs: list[_Job] = []
        for it in items:
            ns_id, key, parent, chunk_bytes, src = it
            key = check_key(key)
            if parent is not None:
                parent = check_key(parent)
            if not isinstance(ns_id, bytes) or not 0 < len(ns_id) < 256:
                raise ValueError("ns_id: must be 1 to 255 bytes")
            a = as_u8(src, False, "src")
            if not a.nbytes or not self._alloc.fits(a.nbytes):
                raise ValueError(f"src: block of {a.nbytes} bytes must be in [1, extent_bytes={self.config.extent_bytes}]")
            if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int) or chunk_bytes < 0:
                raise ValueError(f"chunk_bytes: must be an int >= 0, got {chunk_bytes!r}")
            jobs.append(_Job(key, ns_id, parent, chunk_bytes, a, a.nbytes, -1))
        batch = NvmeBatch("put", [j.key for j in jobs], on_done)
        with self._lock:
            self._check_enabled()
            for j in jobs:
                if j.key in self._by_key or j.key in self._pending:
                    batch.set(j.key, Outcome.PRESENT)
                    continue
                off = self._alloc.allocate(j.ns_id, j.nbytes)
                if off is None:
                    batch.set(j.key, Outcome.NO_SPACE)
                    continue
                j.offset = off
                self._pending[j.key] = off
                self._pending_slots.add(off)
                batch._jobs.append(j)
            batch._left = len(batch._jobs)
        if not batch._jobs:
            batch.close(0)
        for j in batch._jobs:
            self._workers.submit(lambda bounce, j=j: self._write_job(batch, j, bounce))
        return batch

    def get_many(self, keys: Sequence[bytes], dsts: Sequence, on_done: Callable[[NvmeBatch], None] | None = None
                 ) -> NvmeBatch:
        """Read blocks into ``dsts`` (writable contiguous buffers of at least the block's bytes).

        Each block is verified chunk by chunk; ``dsts[i]`` holds valid data only if
        ``results[keys[i]] is Outcome.OK``. A corrupt block (CORRUPT, NvmeChecksumError) is
        dropped from the index and its slot freed before the batch completes. A successful read
        updates the block's access time. Raises ValueError for malformed arguments and
        NvmeDisabledError when the tier is disabled.
        """
        if len(keys) != len(dsts):
            raise ValueError(f"keys and dsts differ in length ({len(keys)} != {len(dsts)})")
        keys = [check_key(k) for k in keys]
        if len(set(keys)) != len(keys):
            raise ValueError("keys: duplicates in one get_many")
        bufs = [as_u8(d, True, "dst") for d in dsts]
        batch = NvmeBatch("get", keys, on_done)
        pinned: list[tuple[bytes, np.ndarray, int]] = []
        with self._lock:
            self._check_enabled()
            for k, b in zip(keys, bufs):
                off = self._by_key.get(k)
                if off is None:
                    batch.set(k, Outcome.MISSING)
                else:
                    self._pins[off] = self._pins.get(off, 0) + 1
                    pinned.append((k, b, off))
        try:
            recs = self._index.get([k for k, _, _ in pinned])
        except lmdb.Error as e:
            self._unpin_all([off for _, _, off in pinned])
            raise self._fail(classify_lmdb_error(e, "reading the index", self.config.map_bytes)) from e
        for (k, b, off), rec in zip(pinned, recs):
            if rec is not None and rec.offset == off and b.nbytes < rec.nbytes:
                self._unpin_all([off for _, _, off in pinned])
                raise ValueError(f"dst: {b.nbytes} bytes, block {k.hex()[:16]} has {rec.nbytes}")
        for (k, b, off), rec in zip(pinned, recs):
            if rec is None or rec.offset != off:  # deleted (and maybe re-put) since we looked
                self._unpin_all([off])
                batch.set(k, Outcome.MISSING)
            else:
                batch._jobs.append(_Job(k, rec.ns_id, rec.parent, rec.chunk_bytes, b, rec.nbytes, off, rec.sums))
        batch._left = len(batch._jobs)
        if not batch._jobs:
            batch.close(0)
        for j in batch._jobs:
            self._workers.submit(lambda bounce, j=j: self._read_job(batch, j, bounce))
        return batch

    def delete(self, keys: Iterable[bytes]) -> int:
        """Remove blocks (one index transaction, then their slots are freed; a slot being read
        is freed when the read ends). A put still in flight for a key ends CANCELLED.
        Returns how many keys were stored or in flight. Raises NvmeError if the index write
        fails (the tier is then disabled and nothing was removed)."""
        keys = [check_key(k) for k in keys]
        with self._index_lock:
            with self._lock:
                self._check_enabled()
                gone = [(k, self._by_key[k]) for k in set(keys) if k in self._by_key]
                inflight = [k for k in set(keys) if k in self._pending]
                self._cancelled.update(inflight)
            if gone:
                self._index_write(self._index.delete, [k for k, _ in gone], what="deleting blocks")
            with self._lock:
                for k, off in gone:
                    self._unindex(k, off)
        return len(gone) + len(inflight)

    def contains(self, keys: Iterable[bytes]) -> list[bool]:
        """Per key: committed here (in-flight puts are not)."""
        with self._lock:
            return [k in self._by_key for k in keys]

    def touch(self, keys: Iterable[bytes], when: float | None = None) -> None:
        """Set access times (Unix seconds, default now) in memory; the committer writes them to
        the index with the next commit or within ``atime_flush_s``."""
        t = self._clock() if when is None else when
        with self._lock:
            for k in keys:
                if k in self._by_key:
                    self._dirty_atime[k] = t

    def room(self, ns_id: bytes, slot_bytes: int) -> int:
        """How many more blocks of ``slot_bytes`` namespace ``ns_id`` can allocate now."""
        with self._lock:
            return self._alloc.room(ns_id, slot_bytes)

    def entries(self) -> Iterator[NvmeEntry]:
        """Every committed block's metadata, in key order, with the latest access times. Meant
        for startup (rebuilding the daemon's index); blocks put or deleted while iterating may
        or may not appear."""
        with self._lock:
            dirty = dict(self._dirty_atime)
        for key, raw in self._index.scan():
            if self._by_key.get(key) is None:
                continue
            r = BlockRecord.unpack(key, raw)
            yield NvmeEntry(key, r.ns_id, r.parent, r.nbytes, r.chunk_bytes, dirty.get(key, r.atime), r.ctime, r.offset)

    def flush(self) -> None:
        """Write pending access times to the index now."""
        with self._index_lock:
            with self._lock:
                dirty, self._dirty_atime = self._dirty_atime, {}
            if dirty:
                self._index_write(self._index.commit, [], dirty, what="writing access times")

    def scrub(self, max_batch_bytes: int = 64 << 20) -> int:
        """Read and verify every committed block, dropping corrupt ones; returns how many were
        dropped. Reads the whole tier: for operators and tests, not for the serving path."""
        with self._lock:
            todo = sorted((off, k, self._alloc.owner(off)[1]) for k, off in self._by_key.items())
        dropped, i = 0, 0
        while i < len(todo):
            keys, views, used = [], [], 0
            buf = aligned_buffer(max(max_batch_bytes, self._alloc.slot_stride(todo[i][2])))
            while i < len(todo) and used + self._alloc.slot_stride(todo[i][2]) <= buf.nbytes:
                _, k, size = todo[i]
                keys.append(k)
                views.append(buf[used:used + size])
                used += self._alloc.slot_stride(size)
                i += 1
            b = self.get_many(keys, views)
            b.wait()
            dropped += sum(1 for k in keys if b.results[k] is Outcome.CORRUPT)
        return dropped

    # --- slot-level Tier protocol -------------------------------------------------------------

    def allocate(self, ns_id: bytes, slot_bytes: int) -> int | None:
        """A free slot (byte offset in the data space) or None when full."""
        with self._lock:
            self._check_enabled()
            return self._alloc.allocate(ns_id, slot_bytes)

    def free(self, ns_id: bytes, slot: int) -> None:
        with self._lock:
            owner = self._alloc.owner(slot)
            if owner is None or owner[0] != ns_id:
                raise ValueError(f"slot {slot} is not a slot of this namespace")
            if slot in self._by_slot or slot in self._pending_slots:
                raise ValueError(f"slot {slot} holds an indexed block; use delete(keys)")
            self._slot_sums.pop(slot, None)
            self._release(slot)

    def write(self, slot: int, src) -> None:
        """Copy ``src`` into ``slot``, synchronously. Not indexed, not durable."""
        a = self._check_slot_write(slot, src)
        self._slot_write(slot, a, self._bounce())

    def write_async(self, slot: int, src) -> Transfer:
        a = self._check_slot_write(slot, src)
        t = Transfer(a.nbytes)
        self._workers.submit(lambda bounce: self._run_into(t, self._slot_write, slot, a, bounce))
        return t

    def read(self, slot: int, dst) -> None:
        """Copy the bytes last written to ``slot`` into ``dst`` and verify them; raises
        NvmeChecksumError (dst then holds no valid data) on a mismatch."""
        a, n, want = self._check_slot_read(slot, dst)
        if n < 0:  # an indexed block
            b = self.get_many([want], [a])
            b.wait()
            if b.error is not None:
                raise b.errors.get(want, b.error)
            return
        self._slot_read(slot, a, n, want, self._bounce())

    def read_async(self, slot: int, dst) -> Transfer:
        a, n, want = self._check_slot_read(slot, dst)
        if n < 0:
            return self.get_many([want], [a])
        t = Transfer(n)
        self._workers.submit(lambda bounce: self._run_into(t, self._slot_read, slot, a, n, want, bounce))
        return t

    def stats(self) -> TierStats:
        with self._lock:
            extra = dict(self._counts, dir=self.config.dir, io_mode=self.io_mode.value,
                         sync=self.config.sync.value, files=len(self._files.fds),
                         io_threads=self.config.io_threads, indexed_blocks=len(self._by_key),
                         pending_writes=len(self._pending), direct_ios=self._files.direct_ios,
                         bounced_ios=self._files.bounced_ios, recovered_blocks=self.recovery.blocks,
                         recovery_dropped=self.recovery.dropped,
                         disabled_reason=str(self._disabled) if self._disabled else "closed" if self._closed else "")
            return TierStats(self.kind, self._alloc.usable_bytes, self._alloc.used_bytes, self._alloc.used_slots,
                             enabled=self.enabled, extra=extra)

    @property
    def io_mode(self) -> IoMode:
        """DIRECT (O_DIRECT) or BUFFERED (the filesystem refused O_DIRECT, or the config said so)."""
        return self._files.mode

    @property
    def enabled(self) -> bool:
        return self._disabled is None and not self._closed

    def close(self) -> None:
        """Finish in-flight batches, write access times, release the directory. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True  # refuse new work; queued jobs and commits still finish
        t = self.config.close_timeout_s
        if not self._workers.close(t):
            log.error("NVMe tier: I/O threads still busy after %.1f s at close", t)
        self._commit_q.put(_STOP)
        self._committer.join(t)
        if self._disabled is None:
            try:
                self.flush()
            except NvmeError as e:
                log.error("NVMe tier: access times not written at close: %s", e)
        self._close_handles()

    def __enter__(self) -> "NvmeTier":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- internals: jobs ----------------------------------------------------------------------

    def _write_job(self, batch: NvmeBatch, j: _Job, bounce: np.ndarray) -> None:
        try:
            if self._disabled is not None:
                raise self._disabled_error()
            j.sums = chunk_sums(j.buf, j.nbytes, j.chunk_bytes)
            self._files.write(j.offset, j.buf, bounce)
            self._count_io("write", j.nbytes)
        except BaseException as e:  # noqa: BLE001 - every failure must end up in the batch
            j.error = self._job_error(e, f"writing a {j.nbytes}-byte block at data offset {j.offset}")
        if batch.job_done():
            self._commit_q.put(batch)

    def _read_job(self, batch: NvmeBatch, j: _Job, bounce: np.ndarray) -> None:
        try:
            if self._disabled is not None:
                raise self._disabled_error()
            self._files.read(j.offset, j.buf, j.nbytes, bounce)
            self._count_io("read", j.nbytes)
            got = chunk_sums(j.buf, j.nbytes, j.chunk_bytes)
            if got != j.sums:
                i = next(i for i, (a, b) in enumerate(zip(got, j.sums)) if a != b)
                c = j.chunk_bytes or j.nbytes
                j.error = NvmeChecksumError(
                    f"NVMe block {j.key.hex()[:16]}: layer chunk {i} of {len(j.sums)} (bytes {i * c}.."
                    f"{min((i + 1) * c, j.nbytes)}) at data offset {j.offset} has xxh3 {got[i]:#018x}, the index "
                    f"says {j.sums[i]:#018x}; block dropped, its destination buffer holds no valid data",
                    key=j.key, chunk=i, offset=j.offset)
        except BaseException as e:  # noqa: BLE001
            j.error = self._job_error(e, f"reading a {j.nbytes}-byte block at data offset {j.offset}")
        if batch.job_done():
            self._finish_read(batch)

    def _finish_read(self, batch: NvmeBatch) -> None:
        corrupt = [j for j in batch._jobs if isinstance(j.error, NvmeChecksumError)]
        if corrupt:
            self._drop([(j.key, j.offset) for j in corrupt])
        now = self._clock()
        nbytes = 0
        with self._lock:
            for j in batch._jobs:
                self._unpin(j.offset)
                if j.error is None:
                    batch.set(j.key, Outcome.OK)
                    nbytes += j.nbytes
                    if self._by_key.get(j.key) == j.offset:
                        self._dirty_atime[j.key] = now
                else:
                    bad = Outcome.CORRUPT if isinstance(j.error, NvmeChecksumError) else Outcome.FAILED
                    batch.set(j.key, bad, j.error)
        batch.close(nbytes)

    def _commit_loop(self) -> None:
        stop = False
        while not stop:
            try:
                first = self._commit_q.get(timeout=self.config.atime_flush_s)
            except queue.Empty:
                first = None
            batches = []
            for b in [first] + self._drain():
                if b is _STOP:
                    stop = True
                elif b is not None:
                    batches.append(b)
            try:
                self._commit(batches)
            except BaseException as e:  # noqa: BLE001 - a bug here must not hang every waiter
                log.exception("NVMe committer failed")
                self._fail(NvmeIOError(f"internal error committing the index: {e!r}"))
                for b in batches:
                    if not b.done():
                        for j in b._jobs:
                            b.set(j.key, Outcome.FAILED, self._disabled_error())
                        b.close(0)

    def _drain(self) -> list:
        out = []
        while True:
            try:
                out.append(self._commit_q.get_nowait())
            except queue.Empty:
                return out

    def _commit(self, batches: list[NvmeBatch]) -> None:
        """Group commit: one fdatasync of the touched files, then one index transaction."""
        good = [j for b in batches for j in b._jobs if j.error is None]
        err: NvmeError | None = None
        if good and self.config.sync is SyncMode.DURABLE:
            try:
                self._files.sync({self._files.file_of(j.offset) for j in good})
            except OSError as e:
                err = self._fail(classify_os_error(e, "flushing the data files"))
        # Under the index lock a delete cannot slip between choosing the records and installing
        # them: a key is either cancelled before this point or deleted after it is indexed.
        with self._index_lock:
            with self._lock:
                live = [j for j in good if j.key not in self._cancelled] if err is None else []
                atimes, self._dirty_atime = self._dirty_atime, {}
            now = self._clock()
            records = [BlockRecord(j.key, j.ns_id, j.parent, j.offset, j.nbytes, j.nbytes, j.chunk_bytes,
                                   j.sums, now, now) for j in live]
            if records or atimes:
                try:
                    self._index.commit(records, atimes)
                except lmdb.Error as e:
                    err = self._fail(classify_lmdb_error(e, "committing blocks", self.config.map_bytes))
                    with self._lock:
                        for k, t in atimes.items():
                            self._dirty_atime.setdefault(k, t)
            with self._lock:
                for b in batches:
                    for j in b._jobs:
                        del self._pending[j.key]
                        self._pending_slots.discard(j.offset)
                        cancelled = j.key in self._cancelled
                        self._cancelled.discard(j.key)
                        if j.error is None and err is None and not cancelled:
                            self._by_key[j.key], self._by_slot[j.offset] = j.offset, j.key
                            b.set(j.key, Outcome.OK)
                            continue
                        self._release(j.offset)
                        if cancelled and j.error is None:
                            b.set(j.key, Outcome.CANCELLED)
                        else:
                            b.set(j.key, Outcome.FAILED, j.error or err)
        for b in batches:
            b.close(sum(j.nbytes for j in b._jobs if b.results[j.key] is Outcome.OK))

    # --- internals: state ---------------------------------------------------------------------

    def _drop(self, pairs: list[tuple[bytes, int]]) -> None:
        """Forget corrupt blocks: index records first, then the slots."""
        with self._index_lock:
            with self._lock:
                live = [(k, off) for k, off in pairs if self._by_key.get(k) == off]
                self._counts["checksum_failures"] += len(pairs)
                self._counts["dropped"] += len(live)
            if self._metrics is not None:
                self._metrics.checksum_failures.labels(source="nvme").inc(len(pairs))
            for k, off in pairs:
                log.warning("NVMe checksum mismatch: block %s at data offset %d dropped", k.hex()[:16], off)
            try:
                self._index_write(self._index.delete, [k for k, _ in live], what="dropping corrupt blocks")
            except NvmeError:
                return  # tier now disabled; the records stay and fail their checksum again
            with self._lock:
                for k, off in live:
                    self._unindex(k, off)

    def _unindex(self, key: bytes, off: int) -> None:
        del self._by_key[key], self._by_slot[off]
        self._dirty_atime.pop(key, None)
        self._release(off)

    def _release(self, off: int) -> None:
        if self._pins.get(off):
            self._free_on_unpin.add(off)
            return
        ns_id, slot_bytes = self._alloc.owner(off)
        self._alloc.free(ns_id, slot_bytes, off)

    def _unpin(self, off: int) -> None:
        n = self._pins[off] - 1
        if n:
            self._pins[off] = n
            return
        del self._pins[off]
        if off in self._free_on_unpin:
            self._free_on_unpin.discard(off)
            self._release(off)

    def _unpin_all(self, offs: list[int]) -> None:
        with self._lock:
            for off in offs:
                self._unpin(off)

    def _index_write(self, fn, *args, what: str) -> None:
        try:
            fn(*args)
        except lmdb.Error as e:
            raise self._fail(classify_lmdb_error(e, what, self.config.map_bytes)) from e

    def _check_enabled(self) -> None:
        if self._closed:
            raise NvmeDisabledError(f"NVMe tier {self.config.dir!r} is closed")
        if self._disabled is not None:
            raise self._disabled_error()

    def _disabled_error(self) -> NvmeDisabledError:
        cause = self._disabled
        err = NvmeDisabledError(f"NVMe tier {self.config.dir!r} is disabled: {cause}")
        err.__cause__ = cause
        return err

    def _fail(self, err: NvmeError) -> NvmeError:
        """Disable the tier for a disabling error (the first reason wins); returns ``err``."""
        if isinstance(err, DISABLING):
            with self._lock:
                if self._disabled is None:
                    self._disabled = err
                    log.error("NVMe tier %s disabled: %s", self.config.dir, err)
        return err

    def _job_error(self, e: BaseException, what: str) -> NvmeError:
        if isinstance(e, NvmeError):
            return e
        if isinstance(e, OSError):
            return self._fail(classify_os_error(e, what))
        log.exception("NVMe tier: internal error %s", what)
        return self._fail(NvmeIOError(f"internal error {what}: {e!r}"))

    def _crashed(self, e: BaseException) -> None:
        log.error("NVMe I/O thread: job escaped its handler: %r", e)
        self._fail(NvmeIOError(f"internal error in an I/O thread: {e!r}"))

    def _count_io(self, op: str, nbytes: int) -> None:
        with self._lock:
            self._counts[op + "s"] += 1
            self._counts["written_bytes" if op == "write" else "read_bytes"] += nbytes
        if self._metrics is not None:
            self._metrics.nvme_bytes.labels(op=op).inc(nbytes)
            self._metrics.nvme_ops.labels(op=op).inc()

    def _bounce(self) -> np.ndarray:
        b = getattr(self._local, "bounce", None)
        if b is None:
            b = self._local.bounce = aligned_buffer(self.config.bounce_bytes)
        return b

    def _close_handles(self) -> None:
        if self._files is not None:
            self._files.close()
        if self._index is not None:
            self._index.close()
            self._index = None
        if self._lock_fd >= 0:
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = -1

    # --- internals: slot-level ----------------------------------------------------------------

    def _check_slot_write(self, slot: int, src) -> np.ndarray:
        a = as_u8(src, False, "src")
        with self._lock:
            self._check_enabled()
            owner = self._alloc.owner(slot)
            if owner is None or not self._alloc.slot_index_ok(owner[1], slot):
                raise ValueError(f"slot {slot} is not an allocated slot")
            if a.nbytes > owner[1] or not a.nbytes:
                raise ValueError(f"src: {a.nbytes} bytes does not fit slot of {owner[1]} bytes")
            if slot in self._by_slot or slot in self._pending_slots:
                raise ValueError(f"slot {slot} holds an indexed block; use put_many")
        return a

    def _slot_write(self, slot: int, a: np.ndarray, bounce: np.ndarray) -> None:
        s = chunk_sums(a, a.nbytes, 0)[0]
        try:
            self._files.write(slot, a, bounce)
        except OSError as e:
            raise self._fail(classify_os_error(e, f"writing slot {slot}")) from e
        self._count_io("write", a.nbytes)
        with self._lock:
            self._slot_sums[slot] = (a.nbytes, s)

    def _check_slot_read(self, slot: int, dst) -> tuple[np.ndarray, int, object]:
        a = as_u8(dst, True, "dst")
        with self._lock:
            self._check_enabled()
            key = self._by_slot.get(slot)
            meta = self._slot_sums.get(slot)
            if key is None and meta is None:
                raise ValueError(f"slot {slot} holds no data written through the slot API since start")
            if key is not None:
                return a, -1, key  # an indexed block: read it by key
            if a.nbytes < meta[0]:
                raise ValueError(f"dst: {a.nbytes} bytes, slot holds {meta[0]}")
            self._pins[slot] = self._pins.get(slot, 0) + 1
        return a, meta[0], meta[1]

    def _slot_read(self, slot: int, a: np.ndarray, n: int, want: int, bounce: np.ndarray) -> None:
        try:
            self._files.read(slot, a, n, bounce)
            self._count_io("read", n)
        except OSError as e:
            raise self._fail(classify_os_error(e, f"reading slot {slot}")) from e
        finally:
            self._unpin_all([slot])
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

