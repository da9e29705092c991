"""Remote hits for Lookup in a cluster: which peer holds the blocks after the local prefix, the
measured link to it, and the choice among loading the local prefix, pulling the extension and
recomputing (:func:`kvstore.source_policy.choose_source`). docs/cluster.md, "Choosing: load, pull or
recompute".

Where remote hits come from is a seam (:class:`RemoteHits`). One source,
:class:`AskedRemoteHits`, asks the peers advertising the namespace (membership knows
namespaces, not chains) for their leading blocks, in parallel, with a short deadline
(``cluster.peer_lookup_timeout_s``). That costs one round trip on a Lookup that misses locally,
but its answer is exact (no stale directory entry points at an evicted block), and every answer
times a round trip for the link estimate. The event-fed cluster prefix directory answers the same
question from memory, with no round trip (:class:`kvstore.cluster.holders.DirectoryRemoteHits`):
where the daemon has a directory it is consulted first, on every Lookup, and the peers are asked
only for a Lookup with ``ask_peers`` that the directory had no holder for (a peer that
publishes no events is in no directory).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Protocol, Sequence

import grpc

from kvstore.cluster.metrics import ClusterMetrics
from kvstore.config import ClusterConfig
from kvstore.daemon.core import Core, NsState
from kvstore.policy import Decision, LoadPolicy
from kvstore.source_policy import LinkEstimator, RemoteHit, SourceChoice, choose_source
from kvstore.tier_kind import TierKind
from kvstore.v1 import kvstore_pb2 as pb, peer_pb2 as ppb

if TYPE_CHECKING:
    from kvstore.cluster.member import Member
    from kvstore.cluster.membership import Membership

log = logging.getLogger("kvstore.daemon.remote")
ADVICE = {SourceChoice.LOAD: pb.ADVICE_LOAD, SourceChoice.PULL: pb.ADVICE_PULL,
          SourceChoice.RECOMPUTE: pb.ADVICE_RECOMPUTE}


class RemoteHits(Protocol):
    """Peers holding the blocks right after a Lookup's local hits: ``keys`` are the keys after
    them, in chain order; each answer is (peer, how many of ``keys`` lead there, the slowest
    tier among them). Never this daemon; an answer may be stale (a pull then misses cleanly)."""

    def remote_prefix(self, ns_hex: str, keys: list[bytes], head: Sequence[bytes] = ()
                      ) -> list[tuple["Member", int, TierKind]]: ...

    # A source whose ``round_trip`` is true (it asks peers) is consulted only for a Lookup with
    # ask_peers set; one answering from memory (a directory) need not define it.


class LinkMeter:
    """The per-peer link estimates (:class:`kvstore.source_policy.LinkEstimator`) behind a lock, fed by
    pulls and peer lookups from gRPC threads, mirrored into the link gauges."""

    def __init__(self, c: ClusterConfig, metrics: ClusterMetrics, clock=time.monotonic) -> None:
        self.estimator = LinkEstimator(c.link_prior_bytes_per_s, c.link_prior_rtt_s, c.link_alpha)
        self.metrics = metrics
        self.cooldown_s = c.peer_cooldown_s
        self.clock = clock
        self._lock = threading.Lock()
        self._set_aside: dict[tuple[str, int], float] = {}  # (peer, epoch) -> until when

    def failed(self, peer: str, epoch: int) -> None:
        """A Push to ``peer`` at ``epoch`` failed on the wire (unreachable, or late): advising it
        or asking it again would cost every request that meets it a deadline until its lease
        runs out, so it is set aside for ``cluster.peer_cooldown_s``. A new epoch is a new
        registration, not set aside."""
        if self.cooldown_s > 0:
            with self._lock:
                self._set_aside[(peer, epoch)] = self.clock() + self.cooldown_s
            log.info("peer %s@%d set aside for %.1f s: its push failed on the wire", peer, epoch, self.cooldown_s)

    def answered(self, peer: str, epoch: int) -> None:
        """``peer`` answered (a Push that shipped, a peer Lookup): no longer set aside."""
        if self._set_aside:
            with self._lock:
                self._set_aside.pop((peer, epoch), None)

    def set_aside(self, peer: str, epoch: int) -> bool:
        if not self._set_aside:
            return False
        with self._lock:
            until = self._set_aside.get((peer, epoch))
            if until is not None and until <= self.clock():
                del self._set_aside[(peer, epoch)]
                until = None
        return until is not None

    def rtt(self, peer: str, seconds: float) -> None:
        with self._lock:
            self.estimator.rtt(peer, seconds)
            est = self.estimator.estimate(peer)
        self.metrics.link_rtt.labels(peer=peer).set(est.latency_s)

    def pull(self, peer: str, nbytes: int, seconds: float) -> None:
        if nbytes <= 0 or seconds <= 0:
            return
        with self._lock:
            self.estimator.pull(peer, nbytes, seconds)
            est = self.estimator.estimate(peer)
        self.metrics.link_bandwidth.labels(peer=peer).set(est.bytes_per_s)

    def estimate(self, peer: str):
        with self._lock:
            return self.estimator.estimate(peer)

    def links_pb(self) -> list[pb.PeerLink]:
        """Stats' view: every peer pulled from or asked."""
        with self._lock:
            snap = self.estimator.snapshot()
        return [pb.PeerLink(node_id=p, bytes_per_s=e.bytes_per_s, rtt_s=e.latency_s, pulls=int(e.weight),
                            round_trips=n) for p, (e, n) in snap.items()]


class AskedRemoteHits:
    """Asks the peers a :class:`~kvstore.daemon.pull.Holders` source names (at most
    ``peer_lookup_max_peers``) for their leading blocks of ``keys``, all at once, waiting at
    most ``peer_lookup_timeout_s``; a peer that does not answer in time is left out. Each answer
    is a control round trip, timed into the link estimate."""

    round_trip = True  # consulted only for a Lookup with ask_peers (RemoteHits)

    def __init__(self, membership: "Membership", holders, links, meter: LinkMeter, c: ClusterConfig) -> None:
        """``holders``: a Holders source; ``links``: the PeerLinks its channels come from."""
        self.membership = membership
        self.holders = holders
        self.links = links
        self.meter = meter
        self.cfg = c

    def remote_prefix(self, ns_hex: str, keys: list[bytes], head: Sequence[bytes] = ()
                      ) -> list[tuple["Member", int, TierKind]]:
        timeout = self.cfg.peer_lookup_timeout_s
        if not keys or not timeout or self.links.why_off or not self.membership.epoch:
            return []
        req = ppb.PeerLookupRequest(requester=self.membership.node_id, namespace_id=bytes.fromhex(ns_hex),
                                    keys=b"".join(keys))
        asked = []
        for m in self.holders.candidates(ns_hex, keys, head=head)[:self.cfg.peer_lookup_max_peers]:
            addr = m.capabilities.get("control_addr", "")
            if not addr or not m.transfer_addr:
                continue
            try:
                fut = self.links.stub(addr, m.node_id).Lookup.future(req, timeout=timeout)
            except Exception as e:  # noqa: BLE001 - a stopping daemon, a bad address: no hit from it
                log.debug("peer lookup of %s not sent: %s", m.node_id, e)
                continue
            # Each answer's own arrival time (gRPC's thread calls back), not when it is read here.
            t0, done = time.monotonic(), []
            fut.add_done_callback(lambda _f, d=done: d.append(time.monotonic()))
            asked.append((m, t0, done, fut))
        out = []
        for m, t0, done, fut in asked:
            try:
                r = fut.result()
            except grpc.RpcError as e:
                log.debug("peer lookup of %s: %s", m.node_id, e.code().name)
                continue
            self.meter.rtt(m.node_id, (done[0] if done else time.monotonic()) - t0)
            self.meter.answered(m.node_id, m.epoch)
            if r.blocks and r.epoch == m.epoch:  # another epoch: a Push would be fenced
                tier = TierKind.NVME if TierKind.NVME in r.tiers[:r.blocks] else TierKind.DRAM
                out.append((m, r.blocks, tier))
        return out


class ClusterAdvisor:
    """A cluster daemon's Lookup fields beyond the local advice (kvstore.proto, LookupResponse
    7-15): the best remote extension and the choice among load, pull and recompute."""

    def __init__(self, core: Core, policy: LoadPolicy, sources: Sequence[RemoteHits], meter: LinkMeter,
                 metrics: ClusterMetrics) -> None:
        """``sources``: where remote hits come from, in order (the directory, from memory, then
        the peers asked); the first that offers any answers."""
        self.core = core
        self.policy = policy  # its tier estimates: DRAM to GPU, and NVMe standing for a holder's disk
        self.sources = list(sources)
        self.meter = meter
        self.metrics = metrics

    def advise(self, st: NsState, keys: list[bytes], local: Decision, ask_peers: bool) -> dict:
        """Called outside the core lock: asking peers is a round trip, taken only for a
        request that asks for it (``ask_peers``) or from a source that costs none."""
        hit = local.matched_tokens // st.ns.layout.block_tokens
        offers = []
        for src in self.sources if hit < len(keys) else ():
            # A round trip only when the caller can act on a pull and memory knew of no holder.
            if ask_peers or not getattr(src, "round_trip", False):
                offers = src.remote_prefix(st.id.hex(), keys[hit:], head=keys[:hit])
            if offers:
                break
        remotes = [RemoteHit(m.node_id, m.epoch, n, t.name.lower()) for m, n, t in offers
                   if not self.meter.set_aside(m.node_id, m.epoch)]
        with self.core.lock:  # the tier estimator is not thread-safe
            d = choose_source(local, remotes, block_tokens=st.ns.layout.block_tokens, block_bytes=st.block_bytes,
                              cost=st.cost, link=self.meter.estimate, tier=self.policy.bandwidth.estimate,
                              lower_tiers_via_dram=self.policy.config.lower_tiers_via_dram)
        self.metrics.advice.labels(advice=d.choice.value).inc()
        out = {"advice": ADVICE[d.choice], "time_if_load_s": d.load_total_s,
               "time_if_recompute_s": d.recompute_total_s,
               "reason": f"{d.reason}; local {local.reason}" if local.matched_tokens else d.reason}
        if d.remote is not None:
            out.update(remote_blocks=d.remote.blocks, remote_node_id=d.remote.peer, remote_epoch=d.remote.epoch,
                       remote_tier=int(TierKind[d.remote.tier.upper()]), est_pull_s=d.pull_s,
                       time_if_pull_s=d.pull_total_s)
        return out
