"""Membership on etcd: this daemon's registration under a lease, and the view of its peers.

Keys, under ``cluster.prefix`` (``/kvstore`` by default)::

    <prefix>/members/<node_id>   the Member record (JSON), attached to this registration's lease
    <prefix>/epochs/<node_id>    how many times the node has registered (no lease: it outlives them)

**Registration** is one transaction: if the epoch counter is unchanged since it was read, it is
incremented and the member record is written under a fresh lease. A daemon whose lease ran out
therefore comes back with a higher epoch, and peers drop what they knew of the old one (see
docs/cluster.md: nothing is served to or from an epoch that is no longer registered).

**Renewal** runs on its own thread (``cluster-lease``) and never touches the daemon's locks:
every third of the TTL it renews with one short keepalive stream under a deadline
(``cluster.etcd_timeout_s``, at most a third of the TTL), so two renewals can fail and a third
still lands before etcd would expire the lease. The thread spends its time blocked in gRPC (the
GIL released), so a busy process delays it by thread switches (milliseconds), not seconds.
The daemon counts its own lease as lost at ``time sent + TTL`` of its last successful renewal,
which is no later than etcd does: it stops claiming its epoch first.

**etcd unreachable**: the daemon goes on serving from its own tiers (nothing on the request
path waits for etcd). Its state says UNREACHABLE while the lease may still be alive, LOST once it
may not be (its epoch is then withdrawn: :attr:`Membership.epoch` is 0). When etcd answers
again it renews the old lease if etcd still has it (same epoch), else registers again (new
lease, new epoch).

**Peers**: the ``cluster-watch`` thread lists the members, then watches the prefix from that
revision; a broken or compacted watch lists again and reports the difference, so no join,
leave or epoch change is missed, only reported late. :meth:`Membership.members` is the view;
:meth:`Membership.subscribe` gives a queue of :class:`MemberEvent`.
"""

from __future__ import annotations

import enum
import logging
import queue
import threading
import time
from dataclasses import replace

from kvstore.cluster.etcd import Etcd, EtcdError, Event, WatchLost
from kvstore.cluster.member import Change, Member, MemberEvent
from kvstore.cluster.metrics import ClusterMetrics
from kvstore.config import ClusterConfig

log = logging.getLogger("kvstore.cluster")


class State(enum.Enum):
    JOINING = "joining"          # not registered yet (start-up, or etcd never answered)
    REGISTERED = "registered"    # lease renewed in time; peers see this daemon at its epoch
    UNREACHABLE = "unreachable"  # etcd does not answer; the lease may still be alive
    LOST = "lost"                # the lease has (or may have) run out: epoch withdrawn until etcd says which


class Membership:
    """This daemon's registration (as ``node_id``) and its view of the fleet. :meth:`start`
    takes this daemon's record (its epoch is filled in at each registration);
    :meth:`set_namespaces` updates what it holds.
    ``on_state`` is told each change of :class:`State`, on the lease thread (the daemon's health
    service follows it). ``clock`` is monotonic seconds. Thread-safe."""

    def __init__(self, cfg: ClusterConfig, etcd: Etcd, node_id: str, *, metrics: ClusterMetrics,
                 on_state=lambda state: None, clock=time.monotonic) -> None:
        self.cfg = cfg
        self.on_state = on_state
        self.etcd = etcd
        self.metrics = metrics
        self.clock = clock
        self.node_id = node_id
        root = cfg.prefix.encode()
        self.members_prefix = root + b"/members/"
        self.member_key = self.members_prefix + node_id.encode()
        self.epoch_key = root + b"/epochs/" + node_id.encode()
        self._lock = threading.Lock()
        self._advert = Member(node_id, 0)
        self._published: Member | None = None  # the record etcd holds for this registration
        self._state = State.JOINING
        self._lease = 0
        self._lease_deadline = 0.0  # monotonic: the lease is surely alive until then
        self._view: dict[str, Member] = {}
        self._subscribers: list[queue.SimpleQueue] = []
        self._stopping = threading.Event()
        self._wake = threading.Event()  # the lease thread: publish a changed advert now
        self._watch = None
        self._threads: list[threading.Thread] = []
        metrics.set_state(self._state.value)

    # --- what the daemon asks -------------------------------------------------------------
    @property
    def state(self) -> State:
        return self._state

    @property
    def epoch(self) -> int:
        """This daemon's current epoch; 0 while it is not surely registered (LOST, JOINING)."""
        with self._lock:
            return self._published.epoch if self._published is not None and self._state in (
                State.REGISTERED, State.UNREACHABLE) else 0

    def lease_left_s(self) -> float:
        """Seconds the lease is surely alive for (0 when there is none)."""
        return max(0.0, self._lease_deadline - self.clock()) if self._lease else 0.0

    def members(self) -> list[Member]:
        """Every registered node as etcd last told this daemon (itself included), by node id."""
        with self._lock:
            return sorted(self._view.values(), key=lambda m: m.node_id)

    def peers(self) -> list[Member]:
        return [m for m in self.members() if m.node_id != self.node_id]

    def member(self, node_id: str) -> Member | None:
        with self._lock:
            return self._view.get(node_id)

    def subscribe(self) -> "queue.SimpleQueue[MemberEvent]":
        """A queue that receives every join, leave, epoch change and update from now on."""
        q: queue.SimpleQueue = queue.SimpleQueue()
        with self._lock:
            self._subscribers.append(q)
        return q

    def set_namespaces(self, namespaces: list[str]) -> None:
        """The namespaces this daemon holds; published with the same lease and epoch."""
        with self._lock:
            if sorted(namespaces) == self._advert.namespaces:
                return
            self._advert = replace(self._advert, namespaces=sorted(namespaces))
        self._wake.set()

    # --- lifecycle ------------------------------------------------------------------------
    def start(self, advert: Member) -> None:
        """Register ``advert`` (this daemon's addresses and capabilities) and watch the fleet."""
        with self._lock:
            self._advert = replace(advert, node_id=self.node_id, epoch=0, namespaces=self._advert.namespaces)
        for name, fn in (("cluster-lease", self._lease_loop), ("cluster-watch", self._watch_loop)):
            t = threading.Thread(target=fn, name=name, daemon=True)
            t.start()
            self._threads.append(t)

    def stop(self, timeout_s: float = 2.0) -> None:
        """Leave the fleet: revoke the lease (peers see the leave at once), stop the threads."""
        self._stopping.set()
        self._wake.set()
        w = self._watch
        if w is not None:
            w.cancel()
        for t in self._threads:
            t.join(timeout_s)
        if self._lease:
            try:
                self.etcd.revoke(self._lease, min(timeout_s, self.cfg.etcd_timeout_s))
            except EtcdError as e:
                log.warning("leaving the fleet: %s (the lease runs out in %d s)", e, self.cfg.lease_ttl_s)
        self.etcd.close()

    # --- the lease thread -----------------------------------------------------------------
    def _set_state(self, state: State) -> None:
        if state is not self._state:
            log.log(logging.INFO if state is State.REGISTERED else logging.WARNING, "cluster: %s -> %s%s",
                    self._state.value, state.value, f" (epoch {self._published.epoch})" if
                    state is State.REGISTERED and self._published else "")
            self._state = state
            self.metrics.set_state(state.value)
            self.on_state(state)

    def _lease_loop(self) -> None:
        retry = min(0.5, self.cfg.lease_ttl_s / 6)  # after a failed call: bounded, never a busy loop
        while not self._stopping.is_set():
            ok = self._step()
            if not self._lease:  # just lost (register now) or not registered (etcd failed: retry)
                delay = 0.0 if ok else retry
            elif not ok:
                delay = retry
            else:  # the next renewal is due a third of the TTL after the last one
                delay = self._lease_deadline - self.cfg.lease_ttl_s * 2 / 3 - self.clock()
            self._wake.wait(max(0.0, delay))
            self._wake.clear()

    def _step(self) -> bool:
        """One round: register, or renew when due and publish a changed advert. False if an
        etcd call failed."""
        try:
            if not self._lease:
                self._register()
                return True
            if self._renew_due():  # first: the lease matters more than a changed record
                self._renew()
            with self._lock:
                changed = replace(self._advert, epoch=self._published.epoch) != self._published
            if changed and self._lease:
                self._publish()
            return True
        except EtcdError as e:
            self.metrics.etcd_errors.labels(op=e.what).inc()
            if self._lease and self.clock() >= self._lease_deadline:
                # The epoch is withdrawn now; the lease is kept, as etcd may still hold it (it
                # was slow, not gone): the next renewal that lands restores the same epoch.
                self._set_state(State.LOST)
                self.metrics.epoch.set(0)
            elif self._lease:
                self._set_state(State.UNREACHABLE)
            log.debug("cluster: %s", e)
            return False

    def _renew_due(self) -> bool:
        # Renew when a third of the TTL has passed since the last renewal, or at once while the
        # lease's state is in doubt.
        return self._state is not State.REGISTERED or \
            self.clock() >= self._lease_deadline - self.cfg.lease_ttl_s * 2 / 3

    def _register(self) -> None:
        timeout = self.cfg.etcd_timeout_s
        while True:
            kv = self.etcd.get(self.epoch_key, timeout)
            epoch, mod = (int(kv.value), kv.mod_revision) if kv is not None else (0, 0)
            sent = self.clock()
            lease, granted = self.etcd.grant(self.cfg.lease_ttl_s, timeout)
            with self._lock:
                rec = replace(self._advert, epoch=epoch + 1)
            if self.etcd.put_if_unchanged([(self.epoch_key, str(epoch + 1).encode(), 0),
                                           (self.member_key, rec.to_json(), lease)], self.epoch_key, mod, timeout):
                break
            self.etcd.revoke(lease, timeout)  # another registration of this node id won the race
            if self._stopping.is_set():
                return
        if self._published is not None:
            self.metrics.rejoins.inc()
        with self._lock:
            self._lease, self._lease_deadline, self._published = lease, sent + granted, rec
        self.metrics.epoch.set(rec.epoch)
        self.metrics.lease_left.set(granted)
        self._set_state(State.REGISTERED)

    def _publish(self) -> None:
        with self._lock:
            rec = replace(self._advert, epoch=self._published.epoch)
        self.etcd.put(self.member_key, rec.to_json(), self.cfg.etcd_timeout_s, lease=self._lease)
        with self._lock:
            self._published = rec

    def _renew(self) -> None:
        sent = self.clock()
        left = self.etcd.keepalive(self._lease, self.cfg.etcd_timeout_s)
        self.metrics.renew_latency.observe(self.clock() - sent)
        if left <= 0:
            self._lose("etcd says the lease has expired")
            return
        self._lease_deadline = sent + left
        self.metrics.lease_left.set(left)
        self.metrics.epoch.set(self._published.epoch)
        self._set_state(State.REGISTERED)

    def _lose(self, why: str) -> None:
        """etcd says the registration is gone: withdraw the epoch, register again at once."""
        log.warning("cluster: lease %x lost (%s); registering again with a new epoch", self._lease, why)
        with self._lock:
            self._lease, self._lease_deadline = 0, 0.0
        self._set_state(State.LOST)
        self.metrics.epoch.set(0)
        self.metrics.lease_left.set(0)

    # --- the watch thread -----------------------------------------------------------------
    def _watch_loop(self) -> None:
        pause = 0.1
        while not self._stopping.is_set():
            try:
                kvs, rev = self.etcd.get_prefix(self.members_prefix, self.cfg.etcd_timeout_s)
                self._replace_view(kvs)
                self._watch = w = self.etcd.watch_prefix(self.members_prefix, rev + 1)
                if self._stopping.is_set():
                    w.cancel()
                    return
                pause = 0.1
                for _, events in w:
                    self._apply(events)
            except (EtcdError, WatchLost) as e:
                if self._stopping.is_set():
                    return
                self.metrics.etcd_errors.labels(op="watch").inc()
                log.debug("cluster: watch: %s", e)
                self._stopping.wait(pause)
                pause = min(pause * 2, 2.0)

    def _decode(self, value: bytes) -> Member | None:
        try:
            return Member.from_json(value)
        except ValueError:
            return None

    def _replace_view(self, kvs) -> None:
        fresh = {m.node_id: m for m in (self._decode(kv.value) for kv in kvs) if m is not None}
        with self._lock:
            old, self._view = self._view, fresh
            events = [MemberEvent(Change.LEAVE, m) for n, m in old.items() if n not in fresh]
            events += [e for m in fresh.values() if (e := _change(old.get(m.node_id), m)) is not None]
            self._notify(events)

    def _apply(self, events: list[Event]) -> None:
        out = []
        with self._lock:
            for ev in events:
                node = ev.kv.key[len(self.members_prefix):].decode(errors="replace")
                if ev.type == Event.DELETE:
                    gone = self._view.pop(node, None)
                    if gone is not None:
                        out.append(MemberEvent(Change.LEAVE, gone))
                    continue
                m = self._decode(ev.kv.value)
                if m is None:
                    continue
                mine = self._published
                if m.node_id == self.node_id and mine is not None and m.epoch != mine.epoch and \
                        m.transfer_addr != mine.transfer_addr:
                    # Our key now holds another registration: a second daemon was given this
                    # node id. Pushes naming its epoch are refused here, so nothing is served
                    # wrongly, but the two take the name from each other at every restart.
                    log.error("cluster: node id %r was registered again (epoch %d) by another daemon "
                              "(transfer %s); give each daemon its own cluster.node_id",
                              self.node_id, m.epoch, m.transfer_addr or "-")
                e = _change(self._view.get(m.node_id), m)
                self._view[m.node_id] = m
                if e is not None:
                    out.append(e)
            self._notify(out)

    def _notify(self, events: list[MemberEvent]) -> None:
        """Under ``_lock``: the subscribers, and the members gauge."""
        for e in events:
            log.info("cluster: %s %s (epoch %d)", e.change.value, e.member.node_id, e.member.epoch)
            for q in self._subscribers:
                q.put(e)
        self.metrics.members.set(len(self._view))


def _change(old: Member | None, new: Member) -> MemberEvent | None:
    if old is None:
        return MemberEvent(Change.JOIN, new)
    if old.epoch != new.epoch:
        return MemberEvent(Change.EPOCH, new)
    return MemberEvent(Change.UPDATE, new) if old != new else None
