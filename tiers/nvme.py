"""The NVMe tier: blocks in preallocated data files, an LMDB index, checksums on every read.

Key-level API (what the daemon drives): :meth:`NvmeTier.put_many`, :meth:`~NvmeTier.get_many`,
:meth:`~NvmeTier.delete`, :meth:`~NvmeTier.contains`, :meth:`~NvmeTier.touch`,
:meth:`~NvmeTier.room`, :meth:`~NvmeTier.entries`. The slot-level
:class:`~kvstore.tiers.base.Tier` protocol (:mod:`kvstore.tiers.nvme_slots`) serves the shared
contract suite and callers that keep their own index; its data does not survive a restart.

Durability order of a put: data written (O_DIRECT) and, in ``SyncMode.DURABLE``, fdatasync'ed;
then the LMDB transaction naming it commits; only then is the put reported OK. A restart
therefore finds only blocks whose bytes were completely written; a torn write has no index
record and its slot is free space. Every read verifies the xxh3_64 of each layer chunk: a
mismatch drops the block (index record deleted, slot freed), counts it and fails that key.

Failures: ENOSPC, an unwritable directory, a full LMDB map or any other I/O error disables the
tier (``stats().enabled`` False, ``extra["disabled_reason"]``); later calls raise
NvmeDisabledError and the daemon serves from the tiers above. Blocks already committed stay on
disk for the next start. A checksum mismatch only drops that block.

Thread-safety: every public method may be called from any thread. Block I/O runs on
``io_threads`` worker threads (os.preadv/pwritev and xxh3 release the GIL); blocks of one batch
whose slots are adjacent move in one vectored I/O (``coalesce_bytes``). Index commits run on one
committer thread that groups finished put batches into one fdatasync + one LMDB transaction.
``on_done`` callbacks run on those threads: keep them short (hand off to your loop).
"""

from __future__ import annotations

import fcntl
import logging
import os
import time
from array import array
from typing import Callable, Iterable, Iterator, Sequence

import lmdb

from kvstore.keys import check_key
from kvstore.tiers.base import TierKind, TierStats
from kvstore.tiers.nvme_core import Job
from kvstore.tiers.nvme_index import BlockRecord, NvmeIndex, SlotAllocator, recover
from kvstore.tiers.nvme_io import ALIGN, DataFiles, IoMode, aligned_buffer, as_u8
from kvstore.tiers.nvme_slots import SlotApi
from kvstore.tiers.nvme_types import (
    NvmeBatch, NvmeBusyError, NvmeConfig, NvmeEntry, NvmeError, NvmeGeometryError, Outcome, PutItem,
    RecoveryReport, SyncMode, classify_lmdb_error, classify_os_error)

__all__ = ["NvmeTier", "NvmeConfig", "SyncMode", "IoMode", "Outcome", "PutItem", "NvmeBatch", "NvmeEntry",
           "RecoveryReport", "NvmeError"]

log = logging.getLogger("kvstore.tiers.nvme")


class NvmeTier(SlotApi):
    """The NVMe tier on ``config.dir``; opening an existing directory recovers it (see
    :attr:`recovery` and :meth:`entries`). ``metrics`` is a :class:`kvstore.metrics.Metrics`
    (NVMe I/O bytes/ops and checksum failures are counted there); ``clock`` gives access and
    commit times in Unix seconds.

    Raises NvmeDiskFullError, NvmeUnwritableError, NvmeBusyError (another process has the
    directory), NvmeGeometryError or NvmeIOError when the directory cannot be opened.
    """

    kind = TierKind.NVME

    def __init__(self, config: NvmeConfig, metrics=None, clock: Callable[[], float] = time.time) -> None:
        self._init_state(config, metrics, clock)
        self._lock_fd = -1
        self._index = self._files = None  # type: ignore[assignment]
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
        self._start_threads()

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
            raise NvmeGeometryError(f"{cfg.dir!r} holds blocks laid out with {have}, the config asks for {want}; "
                                    "use the old file_bytes/extent_bytes or a new directory")
        self._files = DataFiles(cfg.dir, cfg.usable_bytes, cfg.file_bytes, cfg.io_mode, cfg.preallocate)
        self._alloc = SlotAllocator(cfg.usable_bytes, cfg.extent_bytes, ALIGN)
        t0 = time.perf_counter()
        self._by_key, nbytes, dropped = recover(self._index, self._alloc)
        self._by_slot = {off: k for k, off in self._by_key.items()}
        report = RecoveryReport(len(self._by_key), nbytes, dropped, time.perf_counter() - t0)
        log.log(logging.WARNING if dropped else logging.INFO,
                "NVMe tier %s: %d blocks (%d bytes) recovered, %d untrustworthy index records dropped, "
                "%s I/O, in %.3f s", cfg.dir, report.blocks, report.bytes, dropped, self._files.mode.value,
                report.seconds)
        return report

    # --- key-level API ------------------------------------------------------------------------

    def put_many(self, items: Iterable[PutItem | tuple], on_done: Callable[[NvmeBatch], None] | None = None
                 ) -> NvmeBatch:
        """Store blocks ``(ns_id, key, parent, chunk_bytes, src)`` (see :class:`PutItem`). The
        batch completes when every block is on disk and in the index, or failed; ``on_done(batch)``
        then runs on a tier thread. ``src`` must not change until then.

        Raises ValueError for a malformed item (nothing is stored) and NvmeDisabledError when the
        tier is disabled or closed. A full tier is back-pressure, not an error: those keys are
        NO_SPACE as soon as this returns (see :meth:`room`). ``on_done`` always runs on a tier
        thread, never inside this call, so it may take the caller's locks.
        """
        jobs: list[Job] = []
        for it in items:
            ns_id, key, parent, chunk_bytes, src, sums = PutItem(*it)
            key = check_key(key)
            if parent is not None:
                parent = check_key(parent)
            if not isinstance(ns_id, bytes) or not 0 < len(ns_id) < 256:
                raise ValueError("ns_id: must be 1 to 255 bytes")
            if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int) or chunk_bytes < 0:
                raise ValueError(f"chunk_bytes: must be an int >= 0, got {chunk_bytes!r}")
            a = as_u8(src, False, "src")
            if not a.nbytes or not self._alloc.fits(a.nbytes):
                raise ValueError(f"src: a block of {a.nbytes} bytes; must be 1 to extent_bytes="
                                 f"{self.config.extent_bytes}")
            if sums is not None:
                n = -(-a.nbytes // (chunk_bytes or a.nbytes))
                if len(sums) != n:
                    raise ValueError(f"sums: {len(sums)} checksums for {n} chunks of block {key.hex()[:16]}")
                sums = array("Q", sums)
            jobs.append(Job(key, ns_id, parent, chunk_bytes, a, a.nbytes, -1, sums))
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
            self._submit_runs_locked(batch, self._write_run)
        if not batch._jobs and on_done is None:
            batch.close(0)
        return batch

    def get_many(self, keys: Sequence[bytes], dsts: Sequence, on_done: Callable[[NvmeBatch], None] | None = None
                 ) -> NvmeBatch:
        """Read blocks into ``dsts`` (writable contiguous buffers of at least each block's bytes;
        page-aligned ones, like arena views, avoid a bounce copy).

        Every layer chunk is verified. ``dsts[i]`` holds valid data only if
        ``results[keys[i]] is Outcome.OK``; a CORRUPT block (NvmeChecksumError) has already been
        dropped from the index and its slot freed when the batch completes. A successful read
        counts as an access (see :meth:`touch`). A key that is not here is MISSING (a normal
        miss). Raises ValueError for malformed arguments and NvmeDisabledError when disabled.
        """
        if len(keys) != len(dsts):
            raise ValueError(f"keys and dsts differ in length ({len(keys)} != {len(dsts)})")
        keys = [check_key(k) for k in keys]
        if len(set(keys)) != len(keys):
            raise ValueError("keys: duplicates in one get_many")
        bufs = [as_u8(d, True, "dst") for d in dsts]
        batch = NvmeBatch("get", keys, on_done)
        with self._lock:
            self._check_enabled()
            here = [(k, b, off) for k, b in zip(keys, bufs) if (off := self._by_key.get(k)) is not None]
            try:
                recs = self._index.get([k for k, _, _ in here])  # LMDB reads never wait on writers
            except lmdb.Error as e:
                err = classify_lmdb_error(e, "reading the index", self.config.map_bytes)
                recs = None
            if recs is not None:
                for k, b in zip(keys, bufs):
                    if k not in self._by_key:
                        batch.set(k, Outcome.MISSING)
                for (k, b, off), rec in zip(here, recs):
                    if rec is None or rec.offset != off:  # being deleted right now
                        batch.set(k, Outcome.MISSING)
                    elif b.nbytes < rec.nbytes:
                        raise ValueError(f"dst: {b.nbytes} bytes, block {k.hex()[:16]} has {rec.nbytes}")
                    else:
                        batch._jobs.append(Job(k, rec.ns_id, rec.parent, rec.chunk_bytes, b, rec.nbytes, off, rec.sums))
                for j in batch._jobs:
                    self._pin(j.offset)
                self._submit_runs_locked(batch, self._read_run)
        if recs is None:
            raise self._fail(err)
        if not batch._jobs and on_done is None:
            batch.close(0)
        return batch

    def delete(self, keys: Iterable[bytes]) -> int:
        """Remove blocks: one index transaction, then their slots are freed (a slot being read is
        freed when the read ends). A put still in flight for a key ends CANCELLED. Returns how
        many keys were stored or in flight. Raises NvmeError if the index write fails (the tier
        is then disabled and nothing was removed)."""
        keys = {check_key(k) for k in keys}
        with self._index_lock:
            with self._lock:
                self._check_enabled()
                gone = [(k, self._by_key[k]) for k in keys if k in self._by_key]
                inflight = [k for k in keys if k in self._pending]
                self._cancelled.update(inflight)
            if gone:
                self._index_write(self._index.delete, [k for k, _ in gone], what="deleting blocks")
            with self._lock:
                for k, off in gone:
                    self._unindex(k, off)
        return len(gone) + len(inflight)

    def contains(self, keys: Iterable[bytes]) -> list[bool]:
        """Per key: committed here (a put in flight is not)."""
        with self._lock:
            return [k in self._by_key for k in keys]

    def touch(self, keys: Iterable[bytes], when: float | None = None) -> None:
        """Set access times (Unix seconds, default now) in memory; they reach the index with the
        next commit, within ``atime_flush_s``, or at :meth:`flush` / :meth:`close`."""
        t = self._clock() if when is None else when
        self.set_atimes((k, t) for k in keys)

    def set_atimes(self, pairs: Iterable[tuple[bytes, float]]) -> None:
        """Like :meth:`touch`, with an access time per key (``(key, Unix seconds)`` pairs)."""
        with self._lock:
            for k, t in pairs:
                if k in self._by_key:
                    self._dirty_atime[k] = t

    def room(self, ns_id: bytes, slot_bytes: int) -> int:
        """How many more blocks of ``slot_bytes`` namespace ``ns_id`` could store now."""
        with self._lock:
            return self._alloc.room(ns_id, slot_bytes)

    def entries(self) -> Iterator[NvmeEntry]:
        """Every committed block's metadata in key order, with the latest access times: what the
        daemon rebuilds its index from at startup. Blocks put or deleted while this iterates may
        or may not appear."""
        with self._lock:
            dirty = dict(self._dirty_atime)
        for key, raw in self._index.scan():
            if self._by_key.get(key) is not None:
                r = BlockRecord.unpack(key, raw)
                yield NvmeEntry(key, r.ns_id, r.parent, r.nbytes, r.chunk_bytes, dirty.get(key, r.atime),
                                r.ctime, r.offset)

    def flush(self) -> None:
        """Write pending access times to the index now."""
        with self._index_lock:
            with self._lock:
                dirty, self._dirty_atime = self._dirty_atime, {}
            if dirty:
                self._index_write(self._index.commit, [], dirty, what="writing access times")

    def scrub(self, batch_bytes: int = 64 << 20) -> int:
        """Read and verify every committed block, dropping corrupt ones; returns how many were
        dropped. Reads the whole tier: for operators and tests, not for the serving path."""
        with self._lock:
            todo = sorted((off, k, self._alloc.slot_stride(self._alloc.owner(off)[1]))
                          for k, off in self._by_key.items())
        dropped, i = 0, 0
        while i < len(todo):
            buf = aligned_buffer(max(batch_bytes, todo[i][2]))
            keys, views, used = [], [], 0
            while i < len(todo) and used + todo[i][2] <= buf.nbytes:
                keys.append(todo[i][1])
                views.append(buf[used:used + todo[i][2]])
                used += todo[i][2]
                i += 1
            b = self.get_many(keys, views)
            b.wait()
            dropped += sum(1 for k in keys if b.results[k] is Outcome.CORRUPT)
        return dropped

    # --- state --------------------------------------------------------------------------------

    def stats(self) -> TierStats:
        """Capacity and use in bytes; ``blocks`` counts allocated slots (indexed blocks, puts in
        flight and slot-level allocations). ``extra`` has the I/O mode and counters."""
        with self._lock:
            reason = str(self._disabled) if self._disabled else "closed" if self._closed else ""
            extra = dict(self._counts, dir=self.config.dir, io_mode=self._files.mode.value,
                         sync=self.config.sync.value, files=len(self._files.sizes),
                         io_threads=self.config.io_threads, indexed_blocks=len(self._by_key),
                         pending_writes=len(self._pending), direct_ios=self._files.direct_ios,
                         bounced_ios=self._files.bounced_ios, vectored_ios=self._files.vectored_ios,
                         coalesce_bytes=self.config.coalesce_bytes, recovered_blocks=self.recovery.blocks,
                         recovery_dropped=self.recovery.dropped, disabled_reason=reason)
            return TierStats(self.kind, self._alloc.usable_bytes, self._alloc.used_bytes, self._alloc.used_slots,
                             enabled=not reason, extra=extra)

    @property
    def io_mode(self) -> IoMode:
        """DIRECT (O_DIRECT) or BUFFERED (the filesystem refused O_DIRECT, or the config asked)."""
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
        self._stop_threads(self.config.close_timeout_s)
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

    def _close_handles(self) -> None:
        if self._files is not None:
            self._files.close()
        if self._index is not None:
            self._index.close()
            self._index = None  # type: ignore[assignment]
        if self._lock_fd >= 0:
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = -1
