"""Reading the peers' KV event streams into the cluster :class:`~kvstore.cluster.directory.Directory`.

:class:`ClusterDirectory` runs one thread (``cluster-directory``) with a SUB and a DEALER
socket per peer, all in one ``zmq.Poller``. Every ``refresh_s`` it asks ``members()`` (etcd
membership, or any callable listing :class:`Member` records) who is in the cluster: a new
member gets a stream, a member gone or back under a new epoch has its entries dropped.

Each :class:`PeerStream` keeps the peer's next batch number and checks every batch against it:

- it starts (and restarts) from a **snapshot** on the replay socket (``kvstore-snapshot``: the
  whole state as batches numbered S, meaning "after batch S - 1"); live batches that arrive
  meanwhile are held back and applied from S on;
- a **gap** (batch n + k after n) holds the batch back and asks the replay socket for
  everything from n + 1 (vLLM's replay request); a replay that does not start at n + 1 (the
  peer's buffer no longer reaches back, or the peer dropped events on purpose) is a gap no
  replay can close: the node's entries are dropped and rebuilt from a snapshot;
- a batch number lower than expected is a restarted publisher: snapshot again;
- an answer that does not end within ``resync_timeout_s`` drops the node's entries (they may be
  stale) and asks again, on a fresh socket.

A peer without a replay socket cannot be resynced: its entries are dropped at each gap and
rebuilt only from what it stores afterwards (docs/cluster.md says to configure ``events.replay``).
Nothing here imports etcd; a lookup never waits for the network.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from enum import Enum
from typing import Callable, Iterable, Protocol, Sequence

from kvstore import kv_events as ev
from kvstore.cluster.directory import BYTES_PER_ENTRY, DEFAULT_LIMIT, Directory, Node, PrefixHit

log = logging.getLogger("kvstore.cluster")
HELD_BACK_MAX = 100_000  # live batches kept while a replay or snapshot is under way


class Member(Protocol):
    """What the directory needs of a membership record."""

    node_id: str
    epoch: int
    events_addr: str  # the peer's events.publish, as peers reach it
    replay_addr: str  # its events.replay ("" = none)


@dataclass
class DirectoryConfig:
    self_id: str = ""  # this daemon's node id: its own stream is not read
    refresh_s: float = 0.5  # how often members() is asked (seconds)
    resync_timeout_s: float = 5.0  # a replay or snapshot not answered in full by then is asked again (seconds)


class SyncState(Enum):
    SNAPSHOT = "snapshot"  # waiting for a snapshot
    REPLAY = "replay"  # waiting for a replay of a gap
    LIVE = "live"  # applying batches as they come


class PeerStream:
    """One peer's stream: its sockets, its next batch number and what is held back."""

    def __init__(self, ctx, zmq, member: Member, node: Node, directory: Directory, lock: threading.Lock,
                 cfg: DirectoryConfig, clock: Callable[[], float]) -> None:
        self.zmq, self.ctx = zmq, ctx
        self.member, self.node, self.dir, self.lock = member, node, directory, lock
        self.cfg, self.clock = cfg, clock
        self.decode = ev.decoder().decode
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt(zmq.RCVHWM, 100_000)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(member.events_addr)
        self.dealer = None
        self.expected: int | None = None  # next batch number to apply; None = take the next one
        self.state = SyncState.LIVE
        self.held: list[tuple[int, bytes]] = []
        self.answer: list[tuple[int, bytes]] = []
        self.asked_at = 0.0
        self.applied = 0  # batches applied
        self.resyncs = {"replay": 0, "snapshot": 0, "dropped": 0}
        self.last_batch_at = 0.0  # this clock's time the last live batch arrived (applied or not)
        self.applied_ts: float | None = None  # the publisher's ``ts`` of the newest batch applied (its wall clock)
        if member.replay_addr:
            self._ask_snapshot()

    def sockets(self) -> list:
        return [s for s in (self.sub, self.dealer) if s is not None]

    def close(self) -> None:
        for s in self.sockets():
            s.close(0)
        self.dealer = None

    # --- requests ---------------------------------------------------------------------------
    def _fresh_dealer(self):
        """A new DEALER for each request: a late answer to an abandoned one never mixes in."""
        if self.dealer is not None:
            self.dealer.close(0)
        self.dealer = self.ctx.socket(self.zmq.DEALER)
        self.dealer.setsockopt(self.zmq.LINGER, 0)
        self.dealer.connect(self.member.replay_addr)
        return self.dealer

    def _ask_snapshot(self) -> None:
        self.state, self.answer, self.asked_at = SyncState.SNAPSHOT, [], self.clock()
        self.resyncs["snapshot"] += 1
        self._fresh_dealer().send_multipart((b"", ev.SNAPSHOT_REQUEST))

    def _resync(self) -> None:
        """Rebuild the node's entries: from a snapshot, or, with no replay socket, from scratch."""
        if self.member.replay_addr:
            self._ask_snapshot()
        else:
            self._drop_entries()
            self.expected = None
            self.state = SyncState.LIVE

    def _ask_replay(self) -> None:
        if not self.member.replay_addr:  # nothing can fill the gap: start again from here
            self._resync()
            self._drain()
            return
        self.state, self.answer, self.asked_at = SyncState.REPLAY, [], self.clock()
        self.resyncs["replay"] += 1
        self._fresh_dealer().send_multipart((b"", ev.seq_bytes(self.expected)))

    def _drop_entries(self) -> None:
        self.resyncs["dropped"] += 1
        with self.lock:
            self.dir.clear(self.node)

    # --- incoming ---------------------------------------------------------------------------
    def on_live(self) -> None:
        """Read what the SUB socket has."""
        zmq = self.zmq
        while True:
            try:
                _, seq, payload = self.sub.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self.take_live(ev.seq_of(seq), payload)

    def take_live(self, n: int, payload: bytes) -> None:
        """Live batch number ``n``: apply it, or hold it back behind a gap or a resync."""
        self.last_batch_at = self.clock()
        if self.state is SyncState.LIVE and self.expected is not None and n < self.expected:
            # PUB never repeats a batch: lower numbers are a restarted publisher's.
            log.info("peer %s: batch %d after %d: its publisher restarted; resyncing", self.member.node_id,
                     n, self.expected - 1)
            self.held = [(n, payload)]
            self._resync()
        else:
            self.held.append((n, payload))
            if len(self.held) > HELD_BACK_MAX:
                del self.held[0]  # a gap the next check finds
        if self.state is SyncState.LIVE:
            self._drain()

    def on_answer(self) -> None:
        """Read what the DEALER socket has: replayed or snapshot batches, then the end marker."""
        zmq = self.zmq
        while self.dealer is not None:
            try:
                frames = self.dealer.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 4:
                log.warning("peer %s: replay answer of %d frames ignored", self.member.node_id, len(frames))
                continue
            seq = ev.seq_of(frames[2])
            if seq >= 0:
                self.answer.append((seq, frames[3]))
                continue
            answer, self.answer = self.answer, []
            if self.state is SyncState.SNAPSHOT:
                self._snapshot_done(answer)
            elif self.state is SyncState.REPLAY:
                self._replay_done(answer)

    def _snapshot_done(self, answer: list[tuple[int, bytes]]) -> None:
        if not answer:  # a publisher without snapshots (vLLM's own): live batches only, from now on
            self._drop_entries()
            self.expected = None
        else:
            batches = [self.decode(p) for _, p in answer]
            with self.lock:
                self.dir.clear(self.node)
                for b in batches:
                    self.dir.apply(self.node, b.events)
            self.expected = answer[0][0]
            self.applied_ts = batches[-1].ts
        self.state = SyncState.LIVE
        self._drain()

    def _replay_done(self, answer: list[tuple[int, bytes]]) -> None:
        if not answer or answer[0][0] != self.expected:
            log.info("peer %s: replay from batch %s starts at %s; resyncing from a snapshot",
                     self.member.node_id, self.expected, answer[0][0] if answer else "nothing")
            self._ask_snapshot()
            return
        self.held.extend(answer)
        self.state = SyncState.LIVE
        self._drain()

    def _drain(self) -> None:
        """Apply held-back batches in order from ``expected``; at a gap, ask for a replay."""
        if not self.held:
            return
        self.held.sort(key=lambda t: t[0])
        if self.expected is None:
            self.expected = self.held[0][0]
        i = 0
        held = self.held
        while i < len(held):
            seq, payload = held[i]
            if seq < self.expected:
                i += 1  # already applied (in the snapshot, or replayed and also received live)
                continue
            if seq > self.expected:
                del held[:i]
                self._ask_replay()
                return
            batch = self.decode(payload)
            with self.lock:
                self.dir.apply(self.node, batch.events)
            self.expected += 1
            self.applied += 1
            self.applied_ts = batch.ts
            i += 1
        held.clear()

    def check_deadline(self) -> None:
        if self.state is not SyncState.LIVE and self.clock() - self.asked_at > self.cfg.resync_timeout_s:
            log.warning("peer %s: no %s answer within %.1f s; its entries are dropped until it answers",
                        self.member.node_id, self.state.value, self.cfg.resync_timeout_s)
            self._drop_entries()
            self._ask_snapshot()


class ClusterDirectory:
    """The directory and the thread that keeps it, behind one lock. ``members`` lists the
    cluster's members (any objects with :class:`Member`'s fields); it is called on the
    directory's thread only and must not block for long. :meth:`refresh` and :meth:`poll` are
    the thread's two steps, public so that a caller may drive them without :meth:`start`."""

    stream_cls = PeerStream  # one peer's stream (a test subclass may lose batches)

    def __init__(self, cfg: DirectoryConfig, members: Callable[[], Iterable[Member]], *,
                 clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time) -> None:
        """``clock`` times deadlines and ages; ``wall`` is compared with the publishers' batch
        timestamps (their ``time.time()``) for each stream's lag."""
        import zmq  # the [events] extra

        self.cfg = cfg
        self.members = members
        self.clock = clock
        self.wall = wall
        self.lock = threading.Lock()
        self.directory = Directory()
        self.streams: dict[str, PeerStream] = {}
        self._zmq = zmq
        self._ctx = zmq.Context()
        self._poller = zmq.Poller()
        self._owner: dict = {}  # socket -> (stream, is_sub)
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="cluster-directory", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.stopping.set()
        if self.thread.is_alive():
            self.thread.join(5.0)
        for s in list(self.streams.values()):
            s.close()
        self._ctx.term()

    # --- lookups (any thread) ---------------------------------------------------------------
    def longest_prefix(self, namespace: bytes | str, chain_hashes: list[bytes], limit: int = DEFAULT_LIMIT, *,
                       head: Sequence[bytes] = ()) -> list[PrefixHit]:
        """:meth:`Directory.longest_prefix` over the peers' announced blocks (never this node's);
        ``head`` (the request's keys before ``chain_hashes``) is not needed here."""
        with self.lock:
            return self.directory.longest_prefix(namespace, chain_hashes, limit)

    def status(self) -> list[dict]:
        """Per peer: epoch, sync state, next batch number, entries, batches applied, resyncs,
        and how far behind it is (for ops): ``lag_s`` is this node's wall clock less the
        publish time of the newest batch applied (heartbeats and snapshots count; None before
        the first), ``held_batches`` the batches received but not applied yet (behind a gap, a
        replay or a snapshot). An idle peer heartbeats every ``events.heartbeat_s``, so a live
        stream's lag stays under about that; the two clocks' skew is in it too."""
        now, wall = self.clock(), self.wall()
        with self.lock:
            return [{"node_id": s.member.node_id, "epoch": s.member.epoch, "state": s.state.value,
                     "next_seq": s.expected, "entries": len(s.node.held), "batches": s.applied,
                     "last_batch_age_s": round(now - s.last_batch_at, 3) if s.last_batch_at else None,
                     "lag_s": round(wall - s.applied_ts, 3) if s.applied_ts is not None else None,
                     "held_batches": len(s.held), **s.resyncs} for s in self.streams.values()]

    def size(self) -> dict:
        """``entries`` ((node, block) pairs), ``blocks`` (distinct keys) and ``approx_bytes``
        (entries at the measured :data:`~kvstore.cluster.directory.BYTES_PER_ENTRY`)."""
        with self.lock:
            entries, blocks = self.directory.entries(), self.directory.blocks()
        return {"entries": entries, "blocks": blocks, "approx_bytes": entries * BYTES_PER_ENTRY, "backend": "replica"}

    # --- the thread -------------------------------------------------------------------------
    def _loop(self) -> None:
        next_refresh = 0.0
        while not self.stopping.is_set():
            try:
                if self.clock() >= next_refresh:
                    self.refresh()
                    next_refresh = self.clock() + self.cfg.refresh_s
                self.poll(100)
            except Exception:  # noqa: BLE001 - the directory is advice: a bad peer must not end it
                log.exception("cluster directory")
                self.stopping.wait(0.5)

    def poll(self, timeout_ms: int) -> None:
        if not self._owner:
            # No peer stream to read (no peer publishes KV events, or none yet): zmq_poll of no
            # sockets returns at once, and this thread would spin, holding the GIL from every
            # RPC of the daemon (a Lookup took 28 ms, a pull 0.25 s in kvstore bench cluster).
            self.stopping.wait(timeout_ms / 1000)
            return
        for sock, _ in self._poller.poll(timeout_ms):
            owner = self._owner.get(sock)
            if owner is None:
                continue
            stream, is_sub = owner
            before = stream.dealer
            stream.on_live() if is_sub else stream.on_answer()
            self._track(stream, before)
        for stream in list(self.streams.values()):
            before = stream.dealer
            stream.check_deadline()
            self._track(stream, before)

    def _track(self, stream: PeerStream, before) -> None:
        """Keep the poller in step with a stream that replaced its DEALER."""
        if stream.dealer is before:
            return
        if before is not None and before in self._owner:
            self._poller.unregister(before)
            del self._owner[before]
        if stream.dealer is not None:
            self._poller.register(stream.dealer, self._zmq.POLLIN)
            self._owner[stream.dealer] = (stream, False)

    def refresh(self) -> None:
        """Follow membership: streams for new members, none for those gone or re-registered."""
        want = {m.node_id: m for m in self.members() if m.node_id != self.cfg.self_id and m.events_addr}
        for node_id, stream in list(self.streams.items()):
            m = want.get(node_id)
            if m is None or m.epoch != stream.member.epoch or m.events_addr != stream.member.events_addr:
                self._detach(node_id)
        for node_id, m in want.items():
            if node_id not in self.streams:
                self._attach(m)

    def _attach(self, m: Member) -> None:
        with self.lock:
            node = self.directory.add_node(m.node_id, m.epoch, getattr(m, "namespaces", ()) or ())
        s = self.streams[m.node_id] = self.stream_cls(self._ctx, self._zmq, m, node, self.directory, self.lock,
                                                 self.cfg, self.clock)
        for sock in s.sockets():
            self._poller.register(sock, self._zmq.POLLIN)
            self._owner[sock] = (s, sock is s.sub)
        log.info("cluster: reading %s (epoch %d) at %s", m.node_id, m.epoch, m.events_addr)

    def _detach(self, node_id: str) -> None:
        s = self.streams.pop(node_id)
        for sock in s.sockets():
            self._poller.unregister(sock)
            self._owner.pop(sock, None)
        s.close()
        with self.lock:
            self.directory.drop_node(node_id)
        log.info("cluster: %s (epoch %d) left; its entries are dropped", node_id, s.member.epoch)
