"""The daemon's KV event stream: every block that enters or leaves a tier, published in vLLM's
KV-event format (:mod:`kvstore.kv_events` has the wire) for routers and for peers' cluster
directories.

The core reports changes (:class:`kvstore.daemon.seams.BlockEvents`) under its lock; this module
only appends them to a bounded list there. The ``kv-events`` thread sends what has gathered every
``events.batch_interval_s``, as one numbered batch (more when it is long), and answers replay
and snapshot requests. Nothing on the request path waits for a subscriber: ZMQ's PUB drops for
a subscriber past its high-water mark, and past ``events.max_pending_events`` queued events new
ones are dropped and counted, and a batch number is skipped (an empty batch follows at once), so
that every subscriber sees the gap, finds it missing from the replay buffer too, and resyncs from
a snapshot. An idle publisher sends an empty batch every ``events.heartbeat_s``, so a subscriber
that lost the last batch before a quiet spell finds out within that time.

Snapshots: :class:`CoreState` takes every block's tiers under the core lock and, in the same hold,
cuts the queue, so the snapshot is exactly the state after the batches numbered before it.
Its cost under the lock is one pass over the index taking a (block, tiers) pair each (measured
0.1-0.3 us a block here; docs/cluster.md), paid only when a subscriber lost more than the
replay buffer holds, or joins.
"""

from __future__ import annotations

import gc
import logging
import os
import threading
import time
from collections import deque
from typing import Callable, Protocol

import msgspec

from kvstore import kv_events as ev
from kvstore.config import EventsConfig
from kvstore.daemon.index import Block
from kvstore.keys import Namespace
from kvstore.tier_kind import TierKind

log = logging.getLogger("kvstore.events")
BATCH_EVENTS = 1024  # events per published batch: a long queue goes out as several
# Block.announced (bits 1 << TierKind) -> the media it stands for, for every combination.
_MEDIUMS_OF = {bits: tuple(m for t, m in ev.MEDIUM.items() if bits & (1 << t))
               for bits in range(1 << (max(ev.MEDIUM) + 1))}


class StateSource(Protocol):
    def capture(self, cut: Callable[[], object]) -> tuple[list, object]:
        """(every held block as ``(medium, key, parent, tokens, block_tokens, salt)``, ``cut()``),
        both taken under one hold of the core lock."""


class CoreState:
    """:class:`StateSource` over the daemon's core."""

    def __init__(self, core) -> None:
        self.core = core

    def capture(self, cut):
        core = self.core
        # The pass makes a tuple per block: with the collector on, its generation-0 passes over a
        # heap of millions of blocks made it 10-20x slower (measured), all of it under the lock.
        collecting = gc.isenabled()
        gc.disable()
        try:
            with core.lock:  # only what may change: each block's tiers (key, parent and tokens never do)
                taken = [(st.ns, [(b, b.announced) for b in st.blocks.values() if b.announced])
                         for st in core.namespaces.values()]
                after = cut()
        finally:
            if collecting:
                gc.enable()
        items = []
        for ns, pairs in taken:
            bt, salt = ns.layout.block_tokens, ns.tenant_salt
            for b, bits in pairs:
                for medium in _MEDIUMS_OF[bits]:
                    items.append((medium, b.key, b.parent_key, b.tokens, bt, salt))
        return items, after


class EventPublisher:
    """ZMQ PUB of the daemon's KV events, with vLLM's replay ROUTER and kvstore's snapshots.
    Thread-safe: the core calls :meth:`stored` and :meth:`removed` under its lock, and the
    ``kv-events`` thread owns the sockets."""

    def __init__(self, cfg: EventsConfig, *, metrics) -> None:
        import zmq  # the [events] extra; only a daemon that publishes needs it

        self.cfg = cfg
        self.metrics = metrics
        self._zmq = zmq
        self._lock = threading.Lock()
        self._pending: list[tuple] = []
        self._lost = 0  # events dropped since the last cut
        self._next = 0  # number of the next batch (the kv-events thread's)
        self._sent_at = time.monotonic()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=cfg.buffer_steps)
        self._topic = cfg.topic.encode()
        self._encode = msgspec.msgpack.Encoder().encode
        self._ctx = zmq.Context()
        self._pub = self._replay = None
        self._source: StateSource | None = None
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="kv-events", daemon=True)
        self.endpoints: tuple[str, str] = ("", "")

    # --- BlockEvents (under the core lock) ---------------------------------------------------
    def stored(self, b: Block, ns: Namespace, tier: TierKind) -> None:
        self._add((ev.MEDIUM[tier], b.key, b.parent_key, b.tokens, ns.layout.block_tokens, ns.tenant_salt))

    def removed(self, b: Block, tier: TierKind) -> None:
        self._add((ev.MEDIUM[tier], b.key))

    def _add(self, item: tuple) -> None:
        with self._lock:
            if len(self._pending) < self.cfg.max_pending_events:
                self._pending.append(item)
                return
            self._lost += 1
        self.metrics.events_dropped.inc()

    def _cut(self) -> tuple[list[tuple], int]:
        with self._lock:
            items, self._pending = self._pending, []
            lost, self._lost = self._lost, 0
            return items, lost

    # --- lifecycle --------------------------------------------------------------------------
    def start(self, source: StateSource) -> tuple[str, str]:
        """Bind the sockets and start the thread; returns the (PUB, ROUTER) endpoints bound
        (a ``tcp://...:0`` gets its port). Raises OSError-like ``zmq.ZMQError`` on a bad or
        taken address."""
        zmq = self._zmq
        self._source = source
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(self.cfg.hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        pub = self._bind(self._pub, self.cfg.publish)
        router = ""
        if self.cfg.replay:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self._replay.setsockopt(zmq.SNDHWM, 0)  # a snapshot is sent whole, however long
            router = self._bind(self._replay, self.cfg.replay)
        self.endpoints = (pub, router)
        self.thread.start()
        log.info("KV events on %s (replay %s, topic %r)", pub, router or "off", self.cfg.topic)
        return self.endpoints

    def _bind(self, sock, url: str) -> str:
        if url.startswith("ipc://"):  # the socket file is private to the daemon's user and group
            old = os.umask(0o007)
            try:
                sock.bind(url)
            finally:
                os.umask(old)
        else:
            sock.bind(url)
        return sock.getsockopt_string(self._zmq.LAST_ENDPOINT)

    def stop(self) -> None:
        """Send what is queued, then close the sockets."""
        self.stopping.set()
        if self.thread.is_alive():
            self.thread.join(5.0)
        for s in (self._pub, self._replay):
            if s is not None:
                s.close(0)
        self._ctx.term()

    # --- the kv-events thread ---------------------------------------------------------------
    def _loop(self) -> None:
        interval_ms = int(self.cfg.batch_interval_s * 1000) or 1
        while not self.stopping.is_set():
            try:
                if self._replay is not None:
                    if self._replay.poll(interval_ms):
                        self._serve_request()
                else:
                    self.stopping.wait(self.cfg.batch_interval_s)
                self._send(*self._cut())
            except Exception:  # noqa: BLE001 - events are best-effort: the cache goes on serving
                log.exception("KV event publisher")
                self.stopping.wait(0.1)
        self._send(*self._cut())

    def _send(self, items: list[tuple], lost: int) -> None:
        for i in range(0, len(items), BATCH_EVENTS):
            self._publish(_events(items[i:i + BATCH_EVENTS]))
        if lost:
            # Their number goes unused: subscribers see the gap at the empty batch sent at once
            # behind it, and the replay buffer lacks it.
            self._next += 1
            self._publish([])
            log.warning("KV events: %d events dropped (events.max_pending_events = %d); subscribers resync",
                        lost, self.cfg.max_pending_events)
        elif not items and time.monotonic() - self._sent_at >= self.cfg.heartbeat_s:
            self._publish([])  # idle: an empty batch, so a subscriber that lost the last one knows

    def _publish(self, events: list) -> None:
        seq = self._next
        self._next += 1
        payload = self._encode(ev.KVEventBatch(ts=time.time(), events=events))
        self._pub.send_multipart((self._topic, ev.seq_bytes(seq), payload), copy=False)
        self._buffer.append((seq, payload))
        self._sent_at = time.monotonic()
        self.metrics.events_published.inc()

    def _serve_request(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            log.warning("KV events: replay request of %d frames ignored (want [\"\", start_seq])", len(frames) - 1)
            return
        client, _, body = frames
        if body == ev.SNAPSHOT_REQUEST:
            self._serve_snapshot(client)
        elif len(body) == 8:
            start = int.from_bytes(body, "big")
            for seq, payload in self._buffer:
                if seq >= start:
                    self._replay.send_multipart((client, b"", self._topic, ev.seq_bytes(seq), payload))
            self.metrics.events_resyncs.labels(kind="replay").inc()
        else:
            log.warning("KV events: replay request of %d bytes ignored (want an 8-byte sequence number)", len(body))
            return
        self._replay.send_multipart((client, b"", b"", ev.END_SEQ, b""))

    def _serve_snapshot(self, client: bytes) -> None:
        """Every held block, numbered with the next batch's number S: the state after batch S - 1."""
        items, (pending, lost) = self._source.capture(self._cut)
        self._send(pending, lost)  # what happened before the capture goes out numbered before S
        tag = ev.seq_bytes(self._next)
        events = [ev.AllBlocksCleared()]
        for medium in (ev.MEDIUM_CPU, ev.MEDIUM_STORAGE, ev.MEDIUM_GPU):
            mine = [it for it in items if it[0] == medium]
            events.extend(ev.stored_events([it[1:] for it in mine], medium))
        for i in range(0, len(events), 64):  # 64 runs a batch: a long chain is one event
            payload = self._encode(ev.KVEventBatch(ts=time.time(), events=events[i:i + 64]))
            self._replay.send_multipart((client, b"", self._topic, tag, payload))
        self.metrics.events_resyncs.labels(kind="snapshot").inc()
        log.info("KV events: snapshot of %d block copies sent before batch %d", len(items), self._next)


def _events(items: list[tuple]) -> list:
    """Queued changes as vLLM events, in order: consecutive stores of one tier share one
    ``BlockStored`` per chain run, consecutive removals of one tier one ``BlockRemoved``."""
    out: list = []
    i, n = 0, len(items)
    while i < n:
        medium, stored = items[i][0], len(items[i]) > 2
        j = i
        while j < n and items[j][0] == medium and (len(items[j]) > 2) == stored:
            j += 1
        if stored:
            out.extend(ev.stored_events([it[1:] for it in items[i:j]], medium))
        else:
            out.append(ev.removed_event([it[1] for it in items[i:j]], medium))
        i = j
    return out
