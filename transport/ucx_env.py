"""Loading ucxx with the settings this transport needs, and the progress engine it runs on.

UCX reads its ``UCX_*`` variables when a context is created, and ``import ucxx`` writes some of
its own (CUDA-oriented) defaults unless they are already set, so :func:`prepare` puts ours in
place first. A variable the operator already set always wins.

The engine is the single thread that owns one UCX worker: every ucxx call of a Listener or a
Sender happens there (ucxx's own "thread" progress mode measured 0.3-0.6 GB/s here against 5-9
GB/s for progressing the worker ourselves). Other threads hand it work with :meth:`call_soon`.
In blocking mode an idle engine sleeps inside ucxx's ``progress_worker_event`` (progress, arm,
epoll_wait, all in C++ with the GIL released once), and ``call_soon`` wakes it through an eventfd
added to ucxx's own epoll set; it writes that eventfd only while the engine sleeps. A large
rendezvous wakes the engine many times per chunk, so what one wake costs in Python (GIL hand-offs,
syscalls) is what the transport costs over raw UCX. After a round that did work a blocking engine
keeps polling for ``SPIN_S`` before it sleeps again: in layer-pipelined transfers a layer's first chunk
then finds the engine awake (layer-ready lag p50 1.3-1.5 ms against 1.7-4 ms, and up to 21 ms in
bad runs, when it slept between layers; 32 layers of 8 MiB, compute = transfer). While a transfer
is open (``transfers_open``, kept by the listener and the connector at each tick and as a
transfer begins or ends) a sleep lasts at most ``OPEN_NAP_MS``, so a wake-up UCX does not
deliver (a sender whose shared-memory FIFO was full is not signalled when it drains) costs a
millisecond, not a 20 ms tick; while payloads are in flight the engine sleeps in
:meth:`Engine._wait_in_flight`, which goes back round the loop only once one completes. In polling mode the
engine spins always; in adaptive mode (the default) it spins while a transfer is open and none of
its payloads is in flight (waiting for the peer's next frame or the caller's next layer, where a
wake-up's latency shows: on this 2-core VM a blocking engine let the pipelined overlap fall to
medians of 0.79-0.93, single runs down to 0), waits on UCX's events like raw ucxx while
payloads are in flight (spinning through a bulk transfer cost ~3x raw's CPU per GB per side), and
sleeps when no transfer is open, with no ``SPIN_S`` window (that polling takes a core from the
daemon's RPC threads on 2 cores; docs/transport.md, "UCX" section, says what it measured).
"""

from __future__ import annotations

import collections
import logging
import os
import select
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

from .config import TransferConfig, UcxProgress

log = logging.getLogger("kvstore.transport")

UCX_DEFAULTS = {
    # Endpoint error handling (needed to notice a dead peer) makes UCX drop its shared-memory
    # transports unless they declare error handling themselves; without this it falls back
    # to tcp over loopback between two daemons on one node.
    "UCX_MM_ERROR_HANDLING": "y",
    # ucxx defaults rendezvous staging buffers to CUDA memory; our buffers are the host arena.
    "UCX_RNDV_FRAG_MEM_TYPE": "host",
    # A daemon restarted on the same port must be able to listen again at once.
    "UCX_TCP_CM_REUSEADDR": "y",
    # ucxx sets UCX_MEMTYPE_CACHE, which UCX 1.21 no longer knows and would warn about.
    "UCX_WARN_UNUSED_ENV_VARS": "n",
}

_probe: tuple[bool, str] | None = None
_fused: tuple[object, str] | None = None

# Shared-memory transports, over which UCX's own CPU copies each payload out: there a receive
# that hashes as it copies saves a pass. An endpoint is fused only if these carry its bulk data,
# i.e. its other lanes are at most TCP (UCX's connection and keep-alive lanes between daemons on
# one node). Over RDMA (rc, dc, ud ...), CMA or xpmem the bytes land without a CPU copy, which a
# generic-datatype receive would add, so there payloads are hashed once landed.
SHM_TRANSPORTS = frozenset({"sysv", "posix", "self"})


def prepare() -> None:
    """Put this transport's UCX defaults into the environment (call before ``import ucxx``)."""
    for k, v in UCX_DEFAULTS.items():
        os.environ.setdefault(k, v)


def load():
    """``(libucxx module, Array class)``; raises ImportError/RuntimeError with the reason."""
    prepare()
    import ucxx._lib.libucxx as ucx_api
    from ucxx._lib.arr import Array
    return ucx_api, Array


def probe() -> tuple[bool, str]:
    """Whether a UCX context and worker can be created here; the reason if not. Cached."""
    global _probe
    if _probe is None:
        try:
            api, _ = load()
            ctx = api.UCXContext(feature_flags=(api.Feature.TAG, api.Feature.STREAM, api.Feature.WAKEUP))
            api.UCXWorker(ctx).init_blocking_progress_mode()
            ver = ".".join(map(str, api.get_ucx_version()))
            _probe = (True, f"UCX {ver}")
        except Exception as exc:  # ImportError, UCXError, missing libucx.so: all mean "no UCX"
            _probe = (False, f"UCX unavailable: {type(exc).__name__}: {exc}")
    return _probe


def fused():
    """``(the _fused module, "")`` if the receive that hashes as it copies is built and loads,
    else ``(None, why)``. Cached."""
    global _fused
    if _fused is None:
        try:
            load()  # ucxx first: one libucp, with our UCX_* settings in place
            from . import _fused as mod
            _fused = (mod, "")
        except ImportError as exc:
            _fused = (None, f"the fused UCX receive is not built ({exc}); scripts/build_fused.sh builds it")
    return _fused


def fused_lanes(module, ep) -> tuple[bool, str]:
    """Whether endpoint ``ep`` moves payloads over shared memory, where UCX copies them out with
    the CPU (so the fused receive saves a pass; see ``SHM_TRANSPORTS``); and its lanes as text,
    for the log."""
    try:
        lanes = {t for t, _ in module.transports(ep.handle)}
    except Exception as exc:  # noqa: BLE001 - an endpoint UCX cannot describe is not fused
        return False, f"unknown ({exc})"
    return bool(lanes & SHM_TRANSPORTS) and lanes <= SHM_TRANSPORTS | {"tcp"}, ", ".join(sorted(lanes)) or "none"


class Engine:
    """One UCX context + worker + the thread that progresses it. Thread-safe entry points:
    :meth:`call_soon`, :meth:`call`, :meth:`stop`; everything else runs on the engine thread."""

    TICK_S = 0.02  # how often deadlines are checked, seconds
    SPIN_S = 0.002  # after work, keep polling this long before sleeping (blocking mode), seconds
    OPEN_NAP_MS = 1  # the longest sleep while a transfer is open (``transfers_open``)

    def __init__(self, config: TransferConfig, name: str) -> None:
        self.api, self.Array = load()
        api = self.api
        self.config = config
        self.context = api.UCXContext(feature_flags=(api.Feature.TAG, api.Feature.STREAM, api.Feature.WAKEUP))
        self.worker = api.UCXWorker(self.context)
        self.worker.init_blocking_progress_mode()
        self._polling = config.ucx_progress is UcxProgress.POLLING
        self._adaptive = config.ucx_progress is UcxProgress.ADAPTIVE
        self._efd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        # ucxx's epoll set (a dup of its fd: the same set, closed independently) also watches ours
        self._epoll = select.epoll.fromfd(os.dup(self.worker.epoll_file_descriptor))
        self._epoll.register(self._efd, select.EPOLLIN)
        self._sleeping = False  # the engine is (about to be) inside progress_worker_event
        self._kicked = False    # call_soon wrote the eventfd since the engine last drained it
        self._calls: collections.deque = collections.deque()
        self._watches: list = []  # (request, callback) pairs, checked after every progress
        self._lanes: list[collections.deque] = []  # in-order requests: only heads are checked
        self._ready: collections.deque = collections.deque()  # completed, callback not yet run
        self._tickers: list = []  # callables run every TICK_S (deadline checks)
        self._deferred: list = []  # callables run once the pending calls are drained
        self._next_tick = 0.0
        self.transfers_open = False  # kept current (each tick) by the listener / connector
        self._running = True
        self.loops = 0  # engine loop iterations, for profiling
        self.sleeps = 0  # of which went into progress_worker_event (may block), for tests and profiling
        self._rx_ids = int.from_bytes(os.urandom(2), "little") << 8  # receive-tag prefixes of this worker
        n = config.resolved_verify_threads()
        # Hashes arrived payloads off the engine thread (xxh3 releases the GIL); None: inline.
        self.verify_pool = ThreadPoolExecutor(n, thread_name_prefix=f"kvt-verify {name}") if n else None
        # Where the engine thread verifies (no pool), payloads over shared memory are received
        # by the fused receive when it is built: hashed as UCX copies them in (see _fused.c).
        self.fused = fused()[0] if config.ucx_fused_verify and self.verify_pool is None else None
        self._thread = threading.Thread(target=self._run, name=f"kvt-ucx {name}", daemon=True)
        self._thread.start()

    # -- thread-safe ----------------------------------------------------------------------------

    def call_soon(self, fn, *args) -> None:
        self._calls.append((fn, args))
        # The engine sets _sleeping before it checks _calls for the last time, so either it sees
        # this call or we see it asleep. _kicked is set after the write: the engine drains the
        # eventfd only once the write happened (a drain before it would leave it readable).
        if self._sleeping:
            os.eventfd_write(self._efd, 1)
            self._kicked = True

    def call(self, fn, *args, timeout_s: float = 10.0):
        """Run ``fn(*args)`` on the engine thread and return its result (or raise its error)."""
        if threading.current_thread() is self._thread:
            return fn(*args)
        fut: Future = Future()

        def run() -> None:
            try:
                fut.set_result(fn(*args))
            except BaseException as exc:
                fut.set_exception(exc)
        self.call_soon(run)
        return fut.result(timeout=timeout_s)

    def stop(self, timeout_s: float = 5.0) -> None:
        def halt() -> None:
            self._running = False
        if self._thread.is_alive():
            self.call_soon(halt)
            self._thread.join(timeout=timeout_s)
        self._running = False
        if self.verify_pool is not None:
            self.verify_pool.shutdown(wait=True, cancel_futures=True)
        self._epoll.close()
        os.close(self._efd)

    # -- engine thread only ---------------------------------------------------------------------

    def new_rx_id(self) -> int:
        """A fresh 32-bit receive-tag prefix: tags are matched per worker, not per endpoint,
        so every connection of this worker needs its own, never reused."""
        self._rx_ids = (self._rx_ids + 1) & 0xFFFFFFFF or 1
        return self._rx_ids

    def watch(self, request, callback, lane: collections.deque | None = None) -> None:
        """Call ``callback(request)`` on the engine thread once ``request`` completed.

        ``lane``: a deque (from :meth:`new_lane`) of requests that complete in posting order
        (one connection's payloads); only its head is polled. Checking every request after
        every progress call cost ~30% of the sender's engine time at 4 MiB chunks."""
        if request.completed:  # eager sends often complete inside the post call
            self._ready.append((request, callback))
        elif lane is not None:
            lane.append((request, callback))
        else:
            self._watches.append((request, callback))

    def new_lane(self) -> collections.deque:
        lane: collections.deque = collections.deque()
        self._lanes.append(lane)
        return lane

    def drop_lane(self, lane: collections.deque) -> None:
        """Forget an (empty) lane of a closed connection."""
        self._lanes = [x for x in self._lanes if x is not lane]

    def defer(self, fn) -> None:
        """Run ``fn()`` once the calls queued now have all run (to batch what they queued)."""
        self._deferred.append(fn)

    def add_ticker(self, fn) -> None:
        self._tickers.append(fn)

    def progress_until(self, done, timeout_s: float) -> bool:
        """Progress (firing watches) until ``done()`` or ``timeout_s``; for teardown paths that
        must not return before UCX let go of a buffer."""
        end = time.monotonic() + timeout_s
        while not done():
            if time.monotonic() > end:
                return False
            self.worker.progress()
            self._fire()
        return True

    def _fire(self) -> bool:
        # Control messages first: a peer's ERROR frame that arrived in the same progress round as
        # the reset of its endpoint must be read before the payloads fail, so the caller learns
        # the peer's reason (e.g. CHECKSUM_MISMATCH) rather than just PEER_LOST.
        if self._watches and any(w[0].completed for w in self._watches):
            ready, waiting = [], []
            for w in self._watches:
                (ready if w[0].completed else waiting).append(w)
            self._watches = waiting
            self._ready.extend(ready)
        for lane in self._lanes:
            while lane and lane[0][0].completed:
                self._ready.append(lane.popleft())
        if not self._ready:
            return False
        while self._ready:
            req, cb = self._ready.popleft()
            try:
                cb(req)
            except Exception:
                log.exception("UCX completion handler failed")
        return True

    def _hot(self, now: float, spin_until: float) -> bool:
        """Whether an idle round polls again instead of sleeping. Adaptive, with a transfer
        open: only while none of our payloads is in flight, i.e. while the next thing to come
        is a frame of the peer or work from the caller (the next layer of a pipelined transfer),
        whose latency polling saves; while payloads are in flight UCX's own events wake us as
        they progress, as raw ucxx waits. Spinning through a bulk transfer instead cost about
        3x raw's CPU per GB on each side on a 2-core host, and the spinning sender took the
        core the receiver's copy needed. No transfer open: sleep (see the module's docstring).
        Blocking mode: for ``SPIN_S`` after the last busy round."""
        if self._adaptive:
            return self.transfers_open and not any(self._lanes)
        return now < spin_until

    def _wait_in_flight(self, worker) -> None:
        """Progress and wait on UCX's events, as raw ucxx does, until one of our requests
        completes (a lane's head, a watch), a call arrives or the next tick is due. A large
        rendezvous returns from ``progress_worker_event`` once per few fragments it copies (on
        this 2-core VM about 100 times per 4 MiB payload, sending): going round the whole loop
        each time (calls, deferred, ``_fire``, tickers) took a third of the sending engine's
        time, so between completions only these checks run."""
        calls, lanes, watches, end = self._calls, self._lanes, self._watches, self._next_tick
        while True:
            worker.progress_worker_event(self.OPEN_NAP_MS)
            if calls or self._kicked:
                return
            for lane in lanes:
                if lane and lane[0][0].completed:
                    return
            for w in watches:
                if w[0].completed:
                    return
            if time.monotonic() >= end:
                return

    def _run(self) -> None:
        worker, calls = self.worker, self._calls
        tick_ms = int(self.TICK_S * 1000)
        idle = False  # the last round did nothing: the next one may sleep
        spin_until = 0.0  # ... once the spin window after the last busy round has passed
        now = 0.0
        while self._running:
            self.loops += 1
            if idle and not self._polling and not self._hot(now, spin_until):
                self._sleeping = True
                if not calls:
                    self.sleeps += 1
                    if any(self._lanes):  # payloads in flight: wait for them in a loop of its own
                        self._wait_in_flight(worker)
                    else:  # progress; if nothing moved, arm and epoll_wait (worker fd + our eventfd)
                        worker.progress_worker_event(self.OPEN_NAP_MS if self.transfers_open else tick_ms)
                self._sleeping = False
            else:
                worker.progress()
            if self._kicked:
                self._kicked = False
                try:
                    os.eventfd_read(self._efd)
                except BlockingIOError:
                    pass
            busy = bool(calls)
            while calls:
                fn, args = calls.popleft()
                try:
                    fn(*args)
                except Exception:
                    log.exception("UCX engine call failed")
            while self._deferred:
                deferred, self._deferred = self._deferred, []
                for fn in deferred:
                    try:
                        fn()
                    except Exception:
                        log.exception("UCX deferred call failed")
            busy = self._fire() or busy
            now = time.monotonic()
            if busy:
                spin_until = now + self.SPIN_S
            if now >= self._next_tick:
                self._next_tick = now + self.TICK_S
                for fn in list(self._tickers):
                    fn(now)
            idle = not busy
        self._watches.clear()
        self._lanes.clear()
        self._ready.clear()
        self._tickers.clear()
