"""The NVMe tier: blocks by key in preallocated data files, an LMDB index, checksums on every read.

:class:`NvmeTier` keeps :class:`kvstore.tiers.base.KeyedTier`, the API the daemon drives
(:meth:`~NvmeTier.put_many`, :meth:`~NvmeTier.get_many`, :meth:`~NvmeTier.delete`,
:meth:`~NvmeTier.entries`, :meth:`~NvmeTier.set_atimes`), plus :meth:`~NvmeTier.contains`,
:meth:`~NvmeTier.touch`, :meth:`~NvmeTier.room`, :meth:`~NvmeTier.flush` and
:meth:`~NvmeTier.scrub` for tools and tests. It is built from parts it owns: the slot allocator
(:class:`~kvstore.tiers.base.ExtentAllocator`), the data files and the I/O engine that moves
blocks through them (:mod:`.files`, :mod:`.engine`), and the LMDB index (:mod:`.index`).

With a codec on (``NvmeTierConfig.codec``), a put that names its block's element type stores
the block encoded in a slot sized by the payload (:mod:`.coded`): the I/O threads encode, then
the block gets its slot, so such a key's NO_SPACE is known only when its batch completes. Reads
decode on the I/O threads and verify the raw bytes' checksums.

Durability order of a put: data written (O_DIRECT) and, in ``SyncMode.DURABLE``, fdatasync'ed;
then the LMDB transaction naming it commits; only then is the put reported OK. A restart
therefore finds only blocks whose bytes were completely written; a torn write has no index
record and its slot is free space. Every read verifies the xxh3_64 of each layer chunk: a
mismatch drops the block (index record deleted, slot freed), counts it and fails that key.

Failures: ENOSPC, an unwritable directory, a full LMDB map or any other I/O error disables the
tier (``stats().enabled`` False, ``extra["disabled_reason"]``); later calls raise
NvmeDisabledError and the daemon serves from the tiers above. Blocks already committed stay on
disk for the next start. A checksum mismatch only drops that block.

Thread-safety: every public method may be called from any thread. Block I/O runs on the
engine's ``io_threads`` threads; index commits run on one committer thread that groups finished
put batches into one fdatasync + one LMDB transaction. ``on_done`` callbacks run on those
threads: keep them short (hand off to your loop).

The LMDB index is the one record of which blocks are stored where; in memory the tier keeps
only work in flight: puts not yet committed, keys deleted while their put runs, slots pinned by
reads, access times not yet written. Locks: ``_lock`` guards that state and is held only for
dictionary work and LMDB reads (which never wait on writers); ``_index_lock`` serialises index
writes and is always taken before ``_lock``, never after. A slot is freed only under ``_lock``
after the index transaction that forgets its block, so a read that found the block and pinned
the slot under ``_lock`` reads it whole. Neither lock is held during block I/O, and callbacks
(``on_done``) run with no lock held.
"""

from __future__ import annotations

import fcntl
import logging
import os
import queue
import threading
import time
from array import array
from typing import Callable, Iterable, Iterator, Sequence

import lmdb

from kvstore.keys import check_key
from kvstore.tiers.base import ExtentAllocator, TierKind, TierStats
from kvstore.tiers.nvme.batch import IoResult, NvmeBatch, NvmeEntry, PutItem, RecoveryReport
from kvstore.tiers.nvme.coded import BlockCoder, CodecUse
from kvstore.tiers.nvme.config import NvmeTierConfig, SyncMode
from kvstore.tiers.nvme.engine import IoEngine, Job
from kvstore.tiers.nvme.errors import (
    DISABLING, NvmeBusyError, NvmeChecksumError, NvmeDisabledError, NvmeError, NvmeGeometryError, NvmeIOError,
    classify_lmdb_error, classify_os_error)
from kvstore.tiers.nvme.files import ALIGN, PRIVATE_FILE, DataFiles, IoMode, aligned_buffer, as_u8, private_dir
from kvstore.tiers.nvme.index import BlockRecord, NvmeIndex, recover

log = logging.getLogger("kvstore.tiers.nvme")
_STOP = object()


class NvmeTier:
    """The NVMe tier on ``config.dir``; opening an existing directory recovers it (see
    :attr:`recovery` and :meth:`entries`). ``metrics`` is a :class:`kvstore.daemon.metrics.Metrics`
    (NVMe I/O bytes/ops and checksum failures are counted there); ``clock`` gives access and
    commit times in Unix seconds.

    Raises NvmeDiskFullError, NvmeUnwritableError, NvmeBusyError (another process has the
    directory), NvmeGeometryError or NvmeIOError when the directory cannot be opened.
    """

    kind = TierKind.NVME

    def __init__(self, config: NvmeTierConfig, metrics=None, clock: Callable[[], float] = time.time) -> None:
        self.config = config
        self._metrics = metrics
        self._clock = clock
        self._lock = threading.Lock()
        self._index_lock = threading.Lock()
        self._indexed = 0                     # blocks committed to the index
        self._pending: dict[bytes, int] = {}  # put in flight: key -> slot
        self._cancelled: set[bytes] = set()   # deleted while its put was in flight
        self._pins: dict[int, int] = {}       # slot -> reads in flight
        self._free_on_unpin: set[int] = set()
        self._dirty_atime: dict[bytes, float] = {}
        self._disabled: NvmeError | None = None
        self._closed = False
        self._counts = dict.fromkeys(("checksum_failures", "dropped"), 0)
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
        self._coder = BlockCoder(config.codec)
        self._io = IoEngine(self._files, config.io_threads, config.bounce_bytes, config.coalesce_bytes,
                            check=self._raise_if_disabled, on_error=self._job_error, metrics=metrics)
        self._commit_q: queue.SimpleQueue = queue.SimpleQueue()
        self._committer = threading.Thread(target=self._commit_loop, name="nvme-commit", daemon=True)
        self._committer.start()

    def _open(self) -> RecoveryReport:
        cfg = self.config
        private_dir(cfg.dir)
        self._lock_fd = os.open(os.path.join(cfg.dir, "LOCK"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, PRIVATE_FILE)
        os.fchmod(self._lock_fd, PRIVATE_FILE)
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
        self._alloc = ExtentAllocator(cfg.usable_bytes, cfg.extent_bytes, ALIGN)
        self._use = CodecUse(self._alloc.slot_stride)
        t0 = time.perf_counter()
        kept, dropped = recover(self._index, self._alloc)
        for r in kept:
            self._use.add(r.ns_id, r.nbytes, r.stored, r.slot_bytes)
        self._indexed = len(kept)
        report = RecoveryReport(self._indexed, sum(r.nbytes for r in kept), dropped, time.perf_counter() - t0)
        log.log(logging.WARNING if dropped else logging.INFO,
                "NVMe tier %s: %d blocks (%d bytes) recovered, %d untrustworthy index records dropped, "
                "%s I/O, in %.3f s", cfg.dir, report.blocks, report.bytes, dropped, self._files.mode.value,
                report.seconds)
        return report

    # --- the key-level API ---------------------------------------------------------------------

    def put_many(self, items: Iterable[PutItem | tuple], on_done: Callable[[NvmeBatch], None] | None = None
                 ) -> NvmeBatch:
        """Store blocks ``(ns_id, key, parent, chunk_bytes, src, sums, dtype)`` (see
        :class:`PutItem`). The batch completes when every block is on disk and in the index, or
        failed; ``on_done(batch)`` then runs on a tier thread. ``src`` must not change until then.

        Raises ValueError for a malformed item (nothing is stored) and NvmeDisabledError when the
        tier is disabled or closed. A full tier is back-pressure, not an error: those keys are
        NO_SPACE (see :meth:`room`), as soon as this returns for blocks stored raw, when the batch
        completes for blocks being encoded. ``on_done`` always runs on a tier thread, never
        inside this call, so it may take the caller's locks.
        """
        jobs: list[Job] = []
        for it in items:
            ns_id, key, parent, chunk_bytes, src, sums, dtype, lossy = PutItem(*it)
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
            if lossy:
                self._coder.check_lossy(lossy, dtype, a.nbytes)
            jobs.append(Job(key, ns_id, parent, chunk_bytes, a, a.nbytes, -1, sums, lossy=lossy,
                            dtype=dtype if lossy or self._coder.codec_for(dtype) is not None else None))
        batch = NvmeBatch("put", [j.key for j in jobs], on_done)
        moving: list[Job] = []
        coding: list[Job] = []  # to encode; each gets its slot once its payload's size is known
        with self._lock:
            self._check_enabled()
            try:
                stored = self._index.has([j.key for j in jobs])  # LMDB reads never wait on writers
            except lmdb.Error as e:
                raise self._fail_unlocked(classify_lmdb_error(e, "reading the index", self.config.map_bytes)) from e
            for j, here in zip(jobs, stored):
                if here or j.key in self._pending:
                    # A key deleted while its write runs, put again: the write in flight stores it.
                    self._cancelled.discard(j.key)
                    batch.set(j.key, IoResult.PRESENT)
                    continue
                if j.dtype is not None:
                    self._pending[j.key] = -1  # no slot yet
                    coding.append(j)
                    continue
                off = self._alloc.allocate(j.ns_id, j.nbytes)
                if off is None:
                    batch.set(j.key, IoResult.NO_SPACE)
                    continue
                j.offset = off
                self._pending[j.key] = off
                moving.append(j)
            # Queued under the lock, after the enabled check: before close() stops the threads.
            if coding:
                self._write_coded(batch, moving, coding)
            elif moving:
                self._io.write(moving, lambda: self._commit_q.put((batch, moving)))
            elif on_done is not None:
                self._io.write([], lambda: batch.finish_batch(0))  # on_done on a tier thread
        if not moving and not coding and on_done is None:
            batch.finish_batch(0)
        return batch

    def _write_coded(self, batch: NvmeBatch, moving: list[Job], coding: list[Job]) -> None:
        """Write ``moving`` (slots given) and encode, place and write ``coding``; the placed
        ones then commit with ``moving``. Called under ``_lock``."""
        placed: list[Job] = []
        left = [1 + bool(moving)]

        def place(j: Job, bounce) -> object:
            buf = self._coder.encode(j, bounce)  # None: stored raw after all
            if buf is None:
                buf = j.buf[:j.nbytes]
            with self._lock:
                result = IoResult.CANCELLED if j.key in self._cancelled else None
                # A free slot of a larger class of the namespace before NO_SPACE: no extent is
                # left half used while the tier says it is full.
                got = None if result else self._alloc.allocate_fit(j.ns_id, j.slot_bytes, max(j.slot_bytes, j.nbytes))
                off = None if got is None else got[0]
                if got is not None:
                    j.slot_bytes = got[1]
                if off is None:
                    self._cancelled.discard(j.key)
                    del self._pending[j.key]
                    batch.set(j.key, result or IoResult.NO_SPACE)
                    return None
                j.offset = self._pending[j.key] = off
                placed.append(j)
            return buf

        def part_done() -> None:
            with self._lock:
                left[0] -= 1
                if left[0]:
                    return
                for j in coding:  # failed before it had a slot (the tier disabled meanwhile)
                    if j.offset < 0 and j.key in self._pending and j.key not in batch.results:
                        del self._pending[j.key]
                        self._cancelled.discard(j.key)
                        batch.set(j.key, IoResult.FAILED, j.error or self._disabled_error())
            self._commit_q.put((batch, moving + placed))

        if moving:
            self._io.write(moving, part_done)
        self._io.write_each(coding, place, part_done)

    def get_many(self, keys: Sequence[bytes], dsts: Sequence, on_done: Callable[[NvmeBatch], None] | None = None
                 ) -> NvmeBatch:
        """Read blocks into ``dsts`` (writable contiguous buffers of at least each block's bytes;
        page-aligned ones, like arena views, avoid a bounce copy).

        Every layer chunk is verified. ``dsts[i]`` holds valid data only if
        ``results[keys[i]] is IoResult.OK``; a CORRUPT block (NvmeChecksumError) has already been
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
        jobs: list[Job] = []
        with self._lock:
            self._check_enabled()
            # Read and pinned under the lock: a delete frees a slot only under it, after its
            # index transaction, so a slot read here stays this block's until the read ends.
            try:
                recs = self._index.get(keys)
            except lmdb.Error as e:
                raise self._fail_unlocked(classify_lmdb_error(e, "reading the index", self.config.map_bytes)) from e
            for k, b, rec in zip(keys, bufs, recs):
                if rec is None:
                    batch.set(k, IoResult.MISSING)
                elif b.nbytes < rec.nbytes:
                    raise ValueError(f"dst: {b.nbytes} bytes, block {k.hex()[:16]} has {rec.nbytes}")
                else:
                    jobs.append(Job(k, rec.ns_id, rec.parent, rec.chunk_bytes, b, rec.nbytes, rec.offset, rec.sums,
                                    codec=rec.codec, stored=rec.stored))
            for j in jobs:
                self._pin(j.offset)
            if jobs or on_done is not None:
                self._io.read(jobs, lambda: self._finish_read(batch, jobs))
        if not jobs and on_done is None:
            batch.finish_batch(0)
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
                inflight = [k for k in keys if k in self._pending]
                self._cancelled.update(inflight)
            gone = self._index_write(self._index.delete, keys, what="deleting blocks")
            with self._lock:
                for rec in gone.values():
                    self._unindex(rec)
        return len(gone) + len(inflight)

    def contains(self, keys: Iterable[bytes]) -> list[bool]:
        """Per key: committed here (a put in flight is not)."""
        with self._lock:
            self._check_open()
            return self._index.has(keys)

    def touch(self, keys: Iterable[bytes], when: float | None = None) -> None:
        """Set access times (Unix seconds, default now) in memory; they reach the index with the
        next commit, within ``atime_flush_s``, or at :meth:`flush` / :meth:`close`."""
        t = self._clock() if when is None else when
        self.set_atimes((k, t) for k in keys)

    def set_atimes(self, pairs: Iterable[tuple[bytes, float]]) -> None:
        """Like :meth:`touch`, with an access time per key (``(key, Unix seconds)`` pairs)."""
        pairs = list(pairs)
        with self._lock:  # so that a delete, which drops its keys' access times, cannot interleave
            self._check_open()
            try:
                stored = self._index.has([k for k, _ in pairs])
            except lmdb.Error as e:
                raise self._fail_unlocked(classify_lmdb_error(e, "reading the index", self.config.map_bytes)) from e
            for (k, t), here in zip(pairs, stored):
                if here:
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
            r = BlockRecord.unpack(key, raw)
            yield NvmeEntry(key, r.ns_id, r.parent, r.nbytes, r.chunk_bytes, dirty.get(key, r.atime), r.ctime, r.offset,
                            r.codec, r.stored)

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
        records = (BlockRecord.unpack(k, raw) for k, raw in self._index.scan())
        todo = sorted((r.offset, r.key, self._alloc.slot_stride(max(r.slot_bytes, r.nbytes))) for r in records)
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
            dropped += sum(1 for k in keys if b.results[k] is IoResult.CORRUPT)
        return dropped

    # --- state and lifecycle --------------------------------------------------------------------

    def stats(self) -> TierStats:
        """Capacity and use in bytes; ``blocks`` counts allocated slots (indexed blocks and puts
        in flight). ``extra`` has the I/O mode and counters."""
        with self._lock:
            reason = str(self._disabled) if self._disabled else "closed" if self._closed else ""
            files = self._files
            extra = dict(self._io.counts, **self._counts, dir=self.config.dir, io_mode=files.mode.value,
                         sync=self.config.sync.value, files=len(files.sizes),
                         io_threads=self.config.io_threads, indexed_blocks=self._indexed,
                         pending_writes=len(self._pending), direct_ios=files.direct_ios,
                         bounced_ios=files.bounced_ios, vectored_ios=files.vectored_ios,
                         coalesce_bytes=self.config.coalesce_bytes, recovered_blocks=self.recovery.blocks,
                         recovery_dropped=self.recovery.dropped, disabled_reason=reason,
                         codec=self._coder.setting, namespaces=self._use.report())
            return TierStats(self.kind, self._alloc.usable_bytes, self._alloc.used_bytes, self._alloc.used_slots,
                             enabled=not reason, extra=extra)

    @property
    def dir(self) -> str:
        return self.config.dir

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
        timeout_s = self.config.close_timeout_s
        if not self._io.close(timeout_s):
            log.error("NVMe tier: I/O threads still busy after %.1f s at close", timeout_s)
        self._commit_q.put(_STOP)
        self._committer.join(timeout_s)
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
            self._index = None
        if self._lock_fd >= 0:
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = -1

    # --- completions (I/O threads) ----------------------------------------------------------------

    def _finish_read(self, batch: NvmeBatch, jobs: list[Job]) -> None:
        corrupt = [(j.key, j.offset) for j in jobs if isinstance(j.error, NvmeChecksumError)]
        if corrupt:
            self._drop(corrupt)  # before the caller hears of it: the block is gone when it looks
        now = self._clock()
        nbytes = 0
        with self._lock:
            for j in jobs:
                deleted = j.offset in self._free_on_unpin  # while it was read (the read pins its slot)
                self._unpin(j.offset)
                if j.error is None:
                    batch.set(j.key, IoResult.OK)
                    nbytes += j.nbytes
                    if not deleted:
                        self._dirty_atime[j.key] = now
                else:
                    bad = IoResult.CORRUPT if isinstance(j.error, NvmeChecksumError) else IoResult.FAILED
                    batch.set(j.key, bad, j.error)
        batch.finish_batch(nbytes, {j.key: j.sums for j in jobs if j.error is None})

    # --- group commit (committer thread) ----------------------------------------------------------

    def _commit_loop(self) -> None:
        stop = False
        while not stop:
            try:
                first = self._commit_q.get(timeout=self.config.atime_flush_s)
            except queue.Empty:
                first = None  # a tick: write dirty access times
            done = []
            for item in [first] + self._drain():
                if item is _STOP:
                    stop = True
                elif item is not None:
                    done.append(item)
            try:
                self._commit(done)
            except BaseException as e:  # noqa: BLE001 - a bug here must not hang every waiter
                log.exception("NVMe committer failed")
                self._fail(NvmeIOError(f"internal error committing the index: {e!r}"))
                for batch, jobs in done:
                    if not batch.done():
                        for j in jobs:
                            batch.set(j.key, IoResult.FAILED, self._disabled_error())
                        batch.finish_batch(0)

    def _drain(self) -> list:
        out = []
        while True:
            try:
                out.append(self._commit_q.get_nowait())
            except queue.Empty:
                return out

    def _commit(self, done: list[tuple[NvmeBatch, list[Job]]]) -> None:
        """One fdatasync of the touched files, then one index transaction, for every put batch
        whose data is written; then the keys become visible and the batches complete."""
        good = [j for _, jobs in done for j in jobs if j.error is None]
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
            records = [BlockRecord(j.key, j.ns_id, j.parent, j.offset, j.slot_bytes, j.nbytes, j.chunk_bytes,
                                   j.sums, now, now, j.codec, j.stored) for j in live]
            if records or atimes:
                try:
                    self._index.commit(records, atimes)
                except lmdb.Error as e:
                    err = self._fail(classify_lmdb_error(e, "committing blocks", self.config.map_bytes))
                    with self._lock:
                        for k, t in atimes.items():
                            self._dirty_atime.setdefault(k, t)
            with self._lock:
                for batch, jobs in done:
                    for j in jobs:
                        del self._pending[j.key]
                        cancelled = j.key in self._cancelled
                        self._cancelled.discard(j.key)
                        if j.error is None and err is None and not cancelled:
                            self._indexed += 1
                            self._use.add(j.ns_id, j.nbytes, j.stored, j.slot_bytes)
                            batch.set(j.key, IoResult.OK)
                            continue
                        self._release(j.offset)  # written, maybe, but never indexed: free space
                        if cancelled and j.error is None:
                            batch.set(j.key, IoResult.CANCELLED)
                        else:
                            batch.set(j.key, IoResult.FAILED, j.error or err)
        for batch, jobs in done:
            ok = [j for j in jobs if batch.results[j.key] is IoResult.OK]
            # A quantized block's checksums are of what it reads back as, not of its source.
            batch.finish_batch(sum(j.nbytes for j in ok), {j.key: j.sums for j in ok if not j.lossy})

    # --- in-memory state (under _lock unless said otherwise) --------------------------------------

    def _drop(self, pairs: list[tuple[bytes, int]]) -> None:
        """Forget corrupt blocks ``(key, slot)``: index records first, then the slots. Takes the
        locks itself."""
        with self._index_lock:
            with self._lock:
                self._counts["checksum_failures"] += len(pairs)
            if self._metrics is not None:
                self._metrics.checksum_failures.labels(source="nvme").inc(len(pairs))
            for k, off in pairs:
                log.warning("NVMe checksum mismatch: block %s at data offset %d dropped", k.hex()[:16], off)
            try:
                # Only records that still name the slot read: the key may be stored anew since.
                gone = self._index_write(self._index.delete, [k for k, _ in pairs], dict(pairs),
                                         what="dropping corrupt blocks")
            except NvmeError:
                return  # the tier is disabled now; the records stay and fail their checksum again
            with self._lock:
                self._counts["dropped"] += len(gone)
                for rec in gone.values():
                    self._unindex(rec)

    def _unindex(self, rec: BlockRecord) -> None:
        self._indexed -= 1
        self._use.remove(rec.ns_id, rec.nbytes, rec.stored, rec.slot_bytes)
        self._dirty_atime.pop(rec.key, None)
        self._release(rec.offset)

    def _release(self, off: int) -> None:
        """Free a slot, or mark it to be freed when its last read ends."""
        if self._pins.get(off):
            self._free_on_unpin.add(off)
            return
        ns_id, slot_bytes = self._alloc.owner(off)
        self._alloc.free(ns_id, slot_bytes, off)

    def _pin(self, off: int) -> None:
        self._pins[off] = self._pins.get(off, 0) + 1

    def _unpin(self, off: int) -> None:
        n = self._pins[off] - 1
        if n:
            self._pins[off] = n
            return
        del self._pins[off]
        if off in self._free_on_unpin:
            self._free_on_unpin.discard(off)
            self._release(off)

    # --- errors -----------------------------------------------------------------------------------

    def _index_write(self, fn, *args, what: str):
        try:
            return fn(*args)
        except lmdb.Error as e:
            raise self._fail(classify_lmdb_error(e, what, self.config.map_bytes)) from e

    def _check_enabled(self) -> None:
        self._check_open()
        self._raise_if_disabled()

    def _check_open(self) -> None:
        if self._closed:
            raise NvmeDisabledError(f"NVMe tier {self.config.dir!r} is closed")

    def _raise_if_disabled(self) -> None:
        """Raise NvmeDisabledError if the tier disabled itself (a closed tier still finishes
        the I/O queued before close)."""
        if self._disabled is not None:
            raise self._disabled_error()

    def _disabled_error(self) -> NvmeDisabledError:
        cause = self._disabled
        err = NvmeDisabledError(f"NVMe tier {self.config.dir!r} is disabled: {cause}")
        err.__cause__ = cause
        return err

    def _fail(self, err: NvmeError) -> NvmeError:
        """Disable the tier for a disabling error (the first reason wins); returns ``err``.
        Never called with ``_lock`` held."""
        with self._lock:
            return self._fail_unlocked(err)

    def _fail_unlocked(self, err: NvmeError) -> NvmeError:
        """:meth:`_fail` from a caller holding ``_lock``."""
        if isinstance(err, DISABLING) and self._disabled is None:
            self._disabled = err
            log.error("NVMe tier %s disabled: %s", self.config.dir, err)
        return err

    def _job_error(self, e: BaseException, what: str) -> NvmeError:
        """The tier error an I/O failure becomes (disabling the tier for a disabling one)."""
        if isinstance(e, NvmeError):
            return self._fail(e)
        if isinstance(e, OSError):
            return self._fail(classify_os_error(e, what))
        log.exception("NVMe tier: internal error %s", what)
        return self._fail(NvmeIOError(f"internal error {what}: {e!r}"))
