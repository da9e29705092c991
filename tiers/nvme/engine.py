"""The NVMe tier's I/O engine: worker threads moving blocks between callers' buffers and the
data files. Blocks of one submission whose slots are adjacent in a file move in one vectored
I/O (up to ``coalesce_bytes``); every chunk is hashed on write (unless the caller recorded its
checksums) and verified on read. A block stored encoded (``job.codec``, :mod:`kvstore.codec`)
is encoded and decoded on these threads too, and moves alone; its checksums are over its raw
bytes, verified after the decode, and a payload that does not decode counts as a checksum failure.

The engine knows nothing of keys or the index: it runs :class:`Job` lists and reports each
job's failure in ``job.error``. Thread-safe; callbacks run on its threads.
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Callable

import numpy as np

from kvstore.codec import CodecError, decode
from kvstore.tiers.nvme.errors import NvmeChecksumError, NvmeError, NvmeIOError
from kvstore.tiers.nvme.files import IOV_MAX, DataFiles, aligned_buffer, chunk_sums, round_up

log = logging.getLogger("kvstore.tiers.nvme")


class Job:
    """One block moving between a caller's buffer (``buf``, ``nbytes`` of raw block) and a slot
    (``offset``, of the allocator's ``slot_bytes``). ``codec`` (a :class:`kvstore.codec.Codec`
    value, 0 = raw) and ``stored`` say how the slot holds it: ``stored`` bytes of payload.
    ``dtype``: what a put may encode the block as (None: stored raw)."""

    __slots__ = ("key", "ns_id", "parent", "chunk_bytes", "buf", "nbytes", "offset", "sums", "error",
                 "dtype", "codec", "stored", "slot_bytes", "lossy")

    def __init__(self, key, ns_id, parent, chunk_bytes, buf, nbytes, offset, sums=None, *, dtype=None,
                 codec=0, stored=0, slot_bytes=0, lossy=""):
        self.key, self.ns_id, self.parent, self.chunk_bytes = key, ns_id, parent, chunk_bytes
        self.buf, self.nbytes, self.offset, self.sums = buf, nbytes, offset, sums
        self.dtype, self.codec, self.stored = dtype, codec, stored or nbytes
        self.slot_bytes = slot_bytes or nbytes
        self.lossy = lossy  # quantized (kvstore.lossy): sums are of the dequantized bytes
        self.error: NvmeError | None = None


class Workers:
    """``n`` threads running submitted callables in FIFO order; each thread owns one aligned
    bounce buffer, passed to the callable. Exceptions escaping a job are the job's bug: they
    are handed to ``on_crash`` so a batch can never hang."""

    _STOP = object()

    def __init__(self, n: int, bounce_bytes: int, name: str,
                 on_crash: Callable[[BaseException], None]) -> None:
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._on_crash = on_crash
        self._threads = [threading.Thread(target=self._run, args=(bounce_bytes,), name=f"{name}-{i}",
                                          daemon=True) for i in range(n)]
        for t in self._threads:
            t.start()

    def submit(self, job: Callable[[np.ndarray], None]) -> None:
        self._q.put(job)

    def _run(self, bounce_bytes: int) -> None:
        bounce = aligned_buffer(bounce_bytes)
        while True:
            job = self._q.get()
            if job is self._STOP:
                return
            try:
                job(bounce)
            except BaseException as e:  # noqa: BLE001 - see class docstring
                self._on_crash(e)

    def close(self, timeout_s: float) -> bool:
        """Let queued jobs finish, then stop; False if a thread outlived ``timeout_s``."""
        for _ in self._threads:
            self._q.put(self._STOP)
        for t in self._threads:
            t.join(timeout_s)
        return not any(t.is_alive() for t in self._threads)


class IoEngine:
    """Runs block reads and writes on ``io_threads`` threads (``io_threads`` I/Os in flight).

    ``check()`` raises the tier's error while the tier is disabled: a job queued before that
    fails with it instead of touching the files. ``on_error(exc, what)`` turns any other failure
    into the :class:`NvmeError` the jobs record (the tier disables itself there for a disabling
    one). ``metrics`` (a :class:`kvstore.daemon.metrics.Metrics`) counts I/O bytes and operations.
    """

    def __init__(self, files: DataFiles, io_threads: int, bounce_bytes: int, coalesce_bytes: int,
                 check: Callable[[], None], on_error: Callable[[BaseException, str], NvmeError],
                 metrics=None) -> None:
        self.files = files
        self.coalesce_bytes = coalesce_bytes
        self._check = check
        self._on_error = on_error
        self._metrics = metrics
        self._lock = threading.Lock()
        self.counts = dict.fromkeys(("reads", "writes", "read_bytes", "written_bytes"), 0)
        self._workers = Workers(io_threads, bounce_bytes, "nvme-io", self._crashed)

    def write(self, jobs: list[Job], done: Callable[[], None]) -> None:
        """Hash (unless ``job.sums`` is given) and write each job's block to its slot; a job that
        fails gets ``error``. ``done()`` runs on an I/O thread once every job has ended (at once,
        there, when ``jobs`` is empty)."""
        self._submit(jobs, self._write_run, done)

    def write_each(self, jobs: list[Job], prepare: Callable[[Job, np.ndarray], np.ndarray | None],
                   done: Callable[[], None]) -> None:
        """For each job on a thread of its own: ``prepare(job, bounce)`` (the tier encodes the
        block into the thread's bounce buffer or a buffer of its own, and gives it a slot) returns
        the whole ALIGN units to write at ``job.offset``, or None for a job that ends unwritten
        (its outcome already known); then the write. ``done()`` as for :meth:`write`."""
        self._submit([[j] for j in jobs], lambda run, bounce: self._write_prepared(run[0], prepare, bounce), done)

    def read(self, jobs: list[Job], done: Callable[[], None]) -> None:
        """Read each job's slot into its buffer and verify every chunk against ``job.sums`` (a
        mismatch sets ``error`` to NvmeChecksumError); ``done()`` as for :meth:`write`."""
        self._submit(jobs, self._read_run, done)

    def close(self, timeout_s: float) -> bool:
        """Let queued I/O finish, then stop the threads; False if one outlived ``timeout_s``."""
        return self._workers.close(timeout_s)

    def _submit(self, jobs: list, run_fn, done: Callable[[], None]) -> None:
        """Run ``jobs`` (a list of Jobs, grouped here into runs, or a list of runs) as
        ``run_fn(run, bounce)`` on the threads; ``done()`` after the last."""
        if not jobs:
            self._workers.submit(lambda bounce: done())
            return
        runs = jobs if isinstance(jobs[0], list) else self._runs(jobs)
        left = [len(runs)]
        mu = threading.Lock()

        def one(bounce: np.ndarray, run: list[Job]) -> None:
            run_fn(run, bounce)
            with mu:
                left[0] -= 1
                last = left[0] == 0
            if last:
                done()

        for run in runs:
            self._workers.submit(lambda bounce, run=run: one(bounce, run))

    def _runs(self, jobs: list[Job]) -> list[list[Job]]:
        """Group jobs whose slots follow each other in one file (and whose buffers can go to
        the file as they are) into runs of up to ``coalesce_bytes``: one vectored I/O each."""
        limit, files = self.coalesce_bytes, self.files
        runs: list[list[Job]] = []
        run_bytes, prev_ok = 0, False
        for j in sorted(jobs, key=lambda j: j.offset) if limit else jobs:
            ok = bool(limit) and not j.codec and files.direct_ok(j.buf[:j.nbytes])
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

    def _write_run(self, run: list[Job], bounce: np.ndarray) -> None:
        nbytes = sum(j.nbytes for j in run)
        try:
            self._check()
            for j in run:
                if j.sums is None:  # else: the caller's recorded checksums, stored as given
                    j.sums = chunk_sums(j.buf, j.nbytes, j.chunk_bytes)
            if len(run) == 1:
                self.files.write(run[0].offset, run[0].buf, bounce)
            else:
                self.files.write_vec(run[0].offset, [j.buf[:j.nbytes] for j in run])
            self._count("write", nbytes, len(run))
        except BaseException as e:  # noqa: BLE001 - every failure must end up in the jobs
            err = self._on_error(e, f"writing {len(run)} block(s), {nbytes} bytes at data offset {run[0].offset}")
            for j in run:
                j.error = err

    def _write_prepared(self, j: Job, prepare, bounce: np.ndarray) -> None:
        try:
            self._check()
            buf = prepare(j, bounce)
            if buf is None:
                return
            self.files.write(j.offset, buf, bounce)  # whole ALIGN units: never staged through bounce
            self._count("write", j.stored, 1)
        except BaseException as e:  # noqa: BLE001 - every failure must end up in the job
            j.error = self._on_error(e, f"writing block {j.key.hex()[:16]}, {j.stored} bytes at data offset {j.offset}")

    def _read_coded(self, j: Job, bounce: np.ndarray) -> None:
        """Read an encoded block's payload (whole ALIGN units, into the bounce buffer when it
        fits) and decode it into the caller's buffer."""
        n = round_up(j.stored)
        tmp = bounce if n <= bounce.nbytes else aligned_buffer(n)
        self.files.read(j.offset, tmp, n, tmp)  # aligned address and length: never staged
        self._count("read", j.stored, 1)
        try:
            decode(tmp[:j.stored], j.buf[:j.nbytes])
        except CodecError as e:
            j.error = NvmeChecksumError(
                f"NVMe block {j.key.hex()[:16]}: its {j.stored}-byte encoded payload at data offset {j.offset} "
                f"does not decode ({e}); block dropped, its destination buffer holds no valid data",
                key=j.key, chunk=-1, offset=j.offset)

    def _read_run(self, run: list[Job], bounce: np.ndarray) -> None:
        nbytes = sum(j.stored for j in run)
        try:
            self._check()
            if run[0].codec:  # alone in its run
                self._read_coded(run[0], bounce)
                if run[0].error is None:
                    self._verify(run[0])
                return
            if len(run) == 1:
                self.files.read(run[0].offset, run[0].buf, run[0].nbytes, bounce)
            else:
                self.files.read_vec(run[0].offset, [j.buf[:j.nbytes] for j in run])
            self._count("read", nbytes, len(run))
            for j in run:
                self._verify(j)
        except BaseException as e:  # noqa: BLE001
            err = self._on_error(e, f"reading {len(run)} block(s), {nbytes} bytes at data offset {run[0].offset}")
            for j in run:
                j.error = err

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

    def _count(self, op: str, nbytes: int, blocks: int) -> None:
        with self._lock:
            self.counts[op + "s"] += blocks
            self.counts["written_bytes" if op == "write" else "read_bytes"] += nbytes
        if self._metrics is not None:
            self._metrics.nvme_bytes.labels(op=op).inc(nbytes)
            self._metrics.nvme_ops.labels(op=op).inc(blocks)

    def _crashed(self, e: BaseException) -> None:
        log.error("NVMe I/O thread: job escaped its handler: %r", e)
        self._on_error(NvmeIOError(f"internal error in an I/O thread: {e!r}"), "in an I/O thread")
