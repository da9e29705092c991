"""Promotion from NVMe to DRAM on read, and prefetches with deadlines: slots are planned by the
residency (:meth:`Residency.prepare_promotion`), read on the NVMe tier's threads with no lock
held, and reported back when they land (:meth:`Residency.complete_promotion`)."""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kvstore.config import NvmeConfig
from kvstore.daemon.index import NsState
from kvstore.daemon.metrics import Metrics
from kvstore.daemon.residency import Move, Residency
from kvstore.errors import Code, KVError
from kvstore.policy import LoadPolicy
from kvstore.tiers.base import KeyedTier
from kvstore.v1 import kvstore_pb2 as pb

log = logging.getLogger("kvstore.daemon.tiering")
MAX_PREFETCHES = 4096
MAX_SOON = 1024  # promotions queued by Lookups, not yet started
POLL_S = 0.05  # a wait re-checks its caller (is_active) this often


@dataclass(eq=False)
class Prefetch:
    id: int
    session_id: bytes
    st: NsState  # the session's namespace
    keys: list[bytes]
    started: float  # the promoter's clock (seconds)
    deadline: float
    done: threading.Event = field(default_factory=threading.Event)
    missed: bool = False
    failed: str = ""


class _Reads:
    """The pieces of one promotion still being read, and the bytes read so far."""

    def __init__(self, pieces: int, t0: float) -> None:
        self.left, self.nbytes, self.t0 = pieces, 0, t0
        self._lock = threading.Lock()

    def landed(self, nbytes: int) -> int:
        """Count a piece in; the promotion's bytes once it was the last, else 0."""
        with self._lock:
            self.left -= 1
            self.nbytes += nbytes
            return self.nbytes if self.left == 0 else 0


class Promoter:
    """Promotions and prefetches. ``clock`` (seconds, monotonic) gives prefetch and
    make-resident deadlines; waits for a promotion to land are real-time condition waits, each
    bounded by the time left on that clock. Measured I/O durations stay on
    ``time.perf_counter``: they feed the load policy's bandwidth estimate, which must be the
    disk's real speed (a stopped test clock would report zero seconds). Prefetch records are
    guarded by their own lock."""

    def __init__(self, res: Residency, nvme: KeyedTier, cfg: NvmeConfig, *,
                 metrics: Metrics, policy: LoadPolicy, clock: Callable[[], float] = time.monotonic) -> None:
        self.res = res
        self.nvme = nvme
        self.cfg = cfg
        self.metrics = metrics
        self.policy = policy
        self.clock = clock
        self.prefetches: dict[int, Prefetch] = {}
        self._lock = threading.Lock()  # the prefetch records
        self._ids = itertools.count(1)
        self._soon: queue.Queue = queue.Queue(MAX_SOON)
        self._soon_thread: threading.Thread | None = None
        self.stopping = threading.Event()  # set at shutdown: queued promotions are dropped

    def promote_soon(self, st: NsState, keys: list[bytes]) -> None:
        """:meth:`promote` on the promoter's own thread, so a Lookup answers without waiting for
        the reads to be planned and queued (3-8 ms for a 64-block hit after a restart, most of
        it the NVMe index's reads): its caller schedules while they start. Dropped when
        ``MAX_SOON`` wait (the Acquire that follows promotes what is still on NVMe)."""
        with self._lock:
            if self._soon_thread is None:
                self._soon_thread = threading.Thread(target=self._promote_queued, name="promote-soon", daemon=True)
                self._soon_thread.start()
        try:
            self._soon.put_nowait((st, keys))
        except queue.Full:
            log.debug("promotion queue full (%d); the Acquire promotes these %d blocks", MAX_SOON, len(keys))

    def _promote_queued(self) -> None:
        while True:
            st, keys = self._soon.get()
            if self.stopping.is_set():
                continue
            try:
                self.promote(st, keys)
            except Exception:  # noqa: BLE001 - the thread must outlive any one promotion
                log.exception("promotion of %d blocks failed; the Acquire promotes them", len(keys))

    def promote(self, st: NsState, keys: list[bytes], each: bool = False) -> int:
        """Start moving the leading NVMe-only blocks of ``keys`` into DRAM (with ``each``: all of
        them, a miss does not stop it); returns how many leading blocks are resident or on their way.

        The reads go in pieces of ``promote_piece_bytes``, in key order, each landing (resident,
        verified) as soon as its own reads end: an Acquire waiting for the first blocks returns
        while the later ones are still read, so the client's copy of the first overlaps them."""
        n, moves = self.res.prepare_promotion(st, keys, each)
        if not moves:
            return n
        per = max(1, self.cfg.promote_piece_bytes // max(1, moves[0].view.nbytes)) if self.cfg.promote_piece_bytes \
            else len(moves)
        pieces = [moves[i:i + per] for i in range(0, len(moves), per)]
        reads = _Reads(len(pieces), time.perf_counter())
        for i, piece in enumerate(pieces):
            try:
                self.nvme.get_many([m.key for m in piece], [m.view for m in piece],
                                   on_done=lambda batch, piece=piece: self._landed(st, piece, batch, reads))
            except Exception as e:  # noqa: BLE001 - disabled tier: the blocks are gone
                log.error("NVMe read failed: %s", e)
                self.res.complete_promotion(st, [m for p in pieces[i:] for m in p], {}, {})
                self.res.nvme_lost()
                break
        return n

    def _landed(self, st: NsState, moves: list[Move], batch, reads: "_Reads") -> None:
        results, sums = {}, {}
        try:
            results, sums = batch.results, batch.digests()
        finally:  # digests that cannot be had fail the whole batch: nothing unverified is served
            n = self.res.complete_promotion(st, moves, results, sums)
        self.metrics.promotions.labels(src="nvme", dst="dram").inc(n)
        nbytes = reads.landed(batch.nbytes)
        if nbytes:  # the whole promotion's bytes over its time: the pieces were read together
            self.policy.observe("nvme", nbytes, time.perf_counter() - reads.t0)

    def make_resident(self, session, keys: list[bytes], wait_s: float, wanted: Callable[[], bool] = lambda: True,
                      each: bool = False, enough: int = 0) -> None:
        """Promote the leading NVMe blocks of ``keys`` (``each``: every one) and wait until they
        are in DRAM (``enough``: until that many leading ones are, when not 0), or until
        ``wait_s`` seconds have passed on the clock; ``wanted`` (the call's ``is_active``) is
        asked every 50 ms, so a call whose client gave up ends then."""
        deadline = self.clock() + wait_s
        while True:
            gen = self.res.generation
            self.promote(session.ns, keys, each)  # idempotent: blocks under way are skipped
            ready, pending = self.res.resident(session.ns, keys, self.nvme.enabled, each)
            left = deadline - self.clock()
            if not pending or 0 < enough <= ready or left <= 0 or not wanted():
                return
            self.res.wait_for_change(gen, min(left, POLL_S))

    def prefetch(self, session, keys: list[bytes], deadline_s: float) -> int:
        now = self.clock()
        p = Prefetch(next(self._ids), session.id, session.ns, keys, now, now + (deadline_s or self.cfg.prefetch_deadline_s))
        self.promote(session.ns, keys)
        with self._lock:
            self.prefetches[p.id] = p
            while len(self.prefetches) > MAX_PREFETCHES:
                self.prefetches.pop(next(iter(self.prefetches)))
        return p.id

    def prefetch_status(self, session, handle: int, wait_s: float, wanted: Callable[[], bool] = lambda: True):
        """The prefetch's state, after waiting at most ``wait_s`` for it to finish; ``wanted``
        as for :meth:`make_resident`."""
        with self._lock:
            p = self.prefetches.get(handle)
        if p is None or p.session_id != session.id:
            raise KVError(Code.NOT_FOUND, f"prefetch {handle}: unknown handle for this session")
        until = min(self.clock() + wait_s, p.deadline)
        while True:
            gen = self.res.generation
            self.promote(session.ns, p.keys)
            ready, pending = self.res.resident(session.ns, p.keys, self.nvme.enabled)
            now = self.clock()
            if not pending or now >= until or not wanted():
                break
            self.res.wait_for_change(gen, min(until - now, POLL_S))
        total = len(p.keys)
        with self._lock:
            if ready == total:
                if not p.done.is_set():
                    p.done.set()
                    self.metrics.prefetch_latency.observe(now - p.started)
                return pb.PREFETCH_DONE, ready, total, "all blocks resident in DRAM"
            if pending and now < p.deadline:
                return pb.PREFETCH_RUNNING, ready, total, f"{ready} of {total} leading blocks resident"
            if pending and not p.missed:
                p.missed = True
                self.metrics.prefetch_deadline_misses.inc()
        why = "deadline passed" if pending else "a block is missing or failed its checksum"
        return pb.PREFETCH_PARTIAL, ready, total, f"{why}: {ready} of {total} leading blocks usable; recompute the rest"

    def drive(self) -> None:
        """Demotion made room: push prefetches before their deadline on (a prefetch whose
        session ended meanwhile too: it is bounded by its deadline)."""
        now = self.clock()
        with self._lock:
            live = [p for p in self.prefetches.values() if not p.done.is_set() and now < p.deadline]
        for p in live:
            self.promote(p.st, p.keys)
