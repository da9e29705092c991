"""State of the NVMe tier and the work that runs on its threads: block I/O jobs, the group
commit, dropping corrupt blocks, read pins and disabling the tier.

:class:`NvmeCore` is the base of :class:`kvstore.tiers.nvme.NvmeTier`; it is not used alone.

Locks: ``_lock`` guards every in-memory field below and is held only for dictionary work;
``_index_lock`` serialises index writes and is always taken before ``_lock``, never after.
Neither is held during block I/O, and callbacks (``on_done``) run with no lock held.
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Callable

import lmdb
import numpy as np

from kvstore.tiers.nvme_index import BlockRecord, NvmeIndex, SlotAllocator
from kvstore.tiers.nvme_io import IOV_MAX, DataFiles, Workers, aligned_buffer, chunk_sums
from kvstore.tiers.nvme_types import (
    DISABLING, NvmeBatch, NvmeChecksumError, NvmeConfig, NvmeDisabledError, NvmeError, NvmeIOError,
    Outcome, SyncMode, classify_lmdb_error, classify_os_error)

log = logging.getLogger("kvstore.tiers.nvme")
_STOP = object()


class Job:
    """One block moving between a caller's buffer and a slot."""

    __slots__ = ("key", "ns_id", "parent", "chunk_bytes", "buf", "nbytes", "offset", "sums", "error")

    def __init__(self, key, ns_id, parent, chunk_bytes, buf, nbytes, offset, sums=None):
        self.key, self.ns_id, self.parent, self.chunk_bytes = key, ns_id, parent, chunk_bytes
        self.buf, self.nbytes, self.offset, self.sums = buf, nbytes, offset, sums
        self.error: NvmeError | None = None


class NvmeCore:
    config: NvmeConfig
    _index: NvmeIndex
    _files: DataFiles
    _alloc: SlotAllocator

    def _init_state(self, config: NvmeConfig, metrics, clock: Callable[[], float]) -> None:
        self.config = config
        self._metrics = metrics
        self._clock = clock
        self._lock = threading.Lock()
        self._index_lock = threading.Lock()
        self._by_key: dict[bytes, int] = {}   # committed key -> slot offset
        self._by_slot: dict[int, bytes] = {}
        self._pending: dict[bytes, int] = {}  # put in flight: key -> slot
        self._pending_slots: set[int] = set()
        self._cancelled: set[bytes] = set()   # deleted while its put was in flight
        self._pins: dict[int, int] = {}       # slot -> reads in flight
        self._free_on_unpin: set[int] = set()
        self._slot_sums: dict[int, tuple[int, int]] = {}  # slot-level writes: slot -> (nbytes, xxh3)
        self._dirty_atime: dict[bytes, float] = {}
        self._disabled: NvmeError | None = None
        self._closed = False
        self._counts = dict.fromkeys(("reads", "writes", "read_bytes", "written_bytes",
                                      "checksum_failures", "dropped"), 0)
        self._local = threading.local()

    def _start_threads(self) -> None:
        self._commit_q: queue.SimpleQueue = queue.SimpleQueue()
        self._workers = Workers(self.config.io_threads, self.config.bounce_bytes, "nvme-io", self._crashed)
        self._committer = threading.Thread(target=self._commit_loop, name="nvme-commit", daemon=True)
        self._committer.start()

    def _stop_threads(self, timeout_s: float) -> None:
        """Let queued jobs and commits finish, then stop the threads."""
        if not self._workers.close(timeout_s):
            log.error("NVMe tier: I/O threads still busy after %.1f s at close", timeout_s)
        self._commit_q.put(_STOP)
        self._committer.join(timeout_s)

    def _submit_runs_locked(self, batch: NvmeBatch, run_fn) -> None:
        """Queue the batch's jobs as runs (see :meth:`_runs`); caller holds ``_lock`` and has
        checked the tier is open, so they are queued before close() queues its stop markers."""
        batch._left = len(batch._jobs)
        for run in self._runs(batch._jobs):
            self._workers.submit(lambda bounce, run=run: run_fn(batch, run, bounce))
        if not batch._jobs and batch._on_done is not None:
            # Nothing to move, but on_done still runs on a tier thread, never inside the call.
            self._workers.submit(lambda bounce: batch.close(0))

    def _runs(self, jobs: list[Job]) -> list[list[Job]]:
        """Group jobs whose slots follow each other in one file (and whose buffers can go to
        the file as they are) into runs of up to ``coalesce_bytes``: one vectored I/O each."""
        limit, files = self.config.coalesce_bytes, self._files
        runs: list[list[Job]] = []
        run_bytes, prev_ok = 0, False
        for j in sorted(jobs, key=lambda j: j.offset) if limit else jobs:
            ok = bool(limit) and files.direct_ok(j.buf[:j.nbytes])
            last = runs[-1][-1] if runs else None
            if (ok and prev_ok and last.offset + last.nbytes == j.offset and run_bytes + j.nbytes <= limit
                    and len(runs[-1]) < IOV_MAX and files.file_of(j.offset) == files.file_of(last.offset)):
                runs[-1].append(j)
                run_bytes += j.nbytes
            else:
                runs.append([j])
                run_bytes = j.nbytes
            prev_ok = ok
        return runs

    # --- jobs (I/O threads) -------------------------------------------------------------------

    def _write_run(self, batch: NvmeBatch, run: list[Job], bounce: np.ndarray) -> None:
        nbytes = sum(j.nbytes for j in run)
        try:
            if self._disabled is not None:
                raise self._disabled_error()
            for j in run:
                if j.sums is None:  # else: the caller's recorded checksums, stored as given
                    j.sums = chunk_sums(j.buf, j.nbytes, j.chunk_bytes)
            if len(run) == 1:
                self._files.write(run[0].offset, run[0].buf, bounce)
            else:
                self._files.write_vec(run[0].offset, [j.buf[:j.nbytes] for j in run])
            self._count_io("write", nbytes, len(run))
        except BaseException as e:  # noqa: BLE001 - every failure must end up in the batch
            err = self._job_error(e, f"writing {len(run)} block(s), {nbytes} bytes at data offset {run[0].offset}")
            for j in run:
                j.error = err
        if batch.job_done(len(run)):
            self._commit_q.put(batch)

    def _read_run(self, batch: NvmeBatch, run: list[Job], bounce: np.ndarray) -> None:
        nbytes = sum(j.nbytes for j in run)
        try:
            if self._disabled is not None:
                raise self._disabled_error()
            if len(run) == 1:
                self._files.read(run[0].offset, run[0].buf, run[0].nbytes, bounce)
            else:
                self._files.read_vec(run[0].offset, [j.buf[:j.nbytes] for j in run])
            self._count_io("read", nbytes, len(run))
            for j in run:
                self._verify(j)
        except BaseException as e:  # noqa: BLE001
            err = self._job_error(e, f"reading {len(run)} block(s), {nbytes} bytes at data offset {run[0].offset}")
            for j in run:
                j.error = err
        if batch.job_done(len(run)):
            self._finish_read(batch)

    @staticmethod
    def _verify(j: Job) -> None:
        got = chunk_sums(j.buf, j.nbytes, j.chunk_bytes)
        if got != j.sums:
            i = next(i for i, (a, b) in enumerate(zip(got, j.sums)) if a != b)
            c = j.chunk_bytes or j.nbytes
            j.error = NvmeChecksumError(
                f"NVMe block {j.key.hex()[:16]}: layer chunk {i} of {len(j.sums)} (bytes {i * c}.."
                f"{min((i + 1) * c, j.nbytes)}) at data offset {j.offset} has xxh3 {got[i]:#018x}, the index "
                f"says {j.sums[i]:#018x}; block dropped, its destination buffer holds no valid data",
                key=j.key, chunk=i, offset=j.offset)

    def _finish_read(self, batch: NvmeBatch) -> None:
        corrupt = [(j.key, j.offset) for j in batch._jobs if isinstance(j.error, NvmeChecksumError)]
        if corrupt:
            self._drop(corrupt)  # before the caller hears of it: the block is gone when it looks
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

    # --- group commit (committer thread) ------------------------------------------------------

    def _commit_loop(self) -> None:
        stop = False
        while not stop:
            try:
                first = self._commit_q.get(timeout=self.config.atime_flush_s)
            except queue.Empty:
                first = None  # a tick: write dirty access times
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
        """One fdatasync of the touched files, then one index transaction, for every put batch
        whose data is written; then the keys become visible and the batches complete."""
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
                        self._release(j.offset)  # written, maybe, but never indexed: free space
                        if cancelled and j.error is None:
                            b.set(j.key, Outcome.CANCELLED)
                        else:
                            b.set(j.key, Outcome.FAILED, j.error or err)
        for b in batches:
            b.close(sum(j.nbytes for j in b._jobs if b.results[j.key] is Outcome.OK))

    # --- state --------------------------------------------------------------------------------

    def _drop(self, pairs: list[tuple[bytes, int]]) -> None:
        """Forget corrupt blocks ``(key, slot)``: index records first, then the slots."""
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
                return  # the tier is disabled now; the records stay and fail their checksum again
            with self._lock:
                for k, off in live:
                    self._unindex(k, off)

    def _unindex(self, key: bytes, off: int) -> None:
        del self._by_key[key], self._by_slot[off]
        self._dirty_atime.pop(key, None)
        self._release(off)

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
        """Disable the tier for a disabling error (the first reason wins); returns ``err``.
        Never called with ``_lock`` held."""
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

    def _count_io(self, op: str, nbytes: int, blocks: int = 1) -> None:
        with self._lock:
            self._counts[op + "s"] += blocks
            self._counts["written_bytes" if op == "write" else "read_bytes"] += nbytes
        if self._metrics is not None:
            self._metrics.nvme_bytes.labels(op=op).inc(nbytes)
            self._metrics.nvme_ops.labels(op=op).inc(blocks)

    def _bounce(self) -> np.ndarray:
        """The calling thread's bounce buffer (for synchronous slot I/O on a caller's thread)."""
        b = getattr(self._local, "bounce", None)
        if b is None:
            b = self._local.bounce = aligned_buffer(self.config.bounce_bytes)
        return b
