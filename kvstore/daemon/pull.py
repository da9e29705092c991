"""Pulls: a daemon that lacks a prefix fetches it from the peer that holds it (kvstore.v1.Peer).

The requester's worker calls Pull on its own daemon. The daemon asks a holder (named, or each
peer advertising the namespace in etcd, in turn) to Push the blocks it lacks: a unary call on the
holder's TLS control listener, carrying both ends' epochs. The holder checks that its own epoch
and the requester's are the ones etcd holds now (a node that lost its lease and came back is
fenced either way), then runs an ordinary transfer (:class:`~kvstore.daemon.outbound.Outbound`)
of the leading committed blocks (those only on its NVMe promoted first, within the deadline) to
the requester's *registered* transfer listener, never to an address in the request. A Push is
served only to a caller whose client certificate names the node id it claims. The transfer
commits the blocks at the requester before the holder's Push answers, so when Pull answers they
are local blocks the worker reads as any other. Everything a pull can meet (no holder, a fenced
epoch, blocks evicted on the holder, a dead or late peer) ends as a miss within the deadline:
the worker recomputes. docs/cluster.md, "Pull".
"""

from __future__ import annotations

import logging
import math
import threading
import time
from typing import TYPE_CHECKING, Protocol, Sequence

import grpc

from kvstore.cluster.member import Member
from kvstore.cluster.membership import Membership
from kvstore.cluster.metrics import ClusterMetrics
from kvstore.config import ServerConfig, TransportConfig
from kvstore.daemon.core import Core, NsState, Session
from kvstore.daemon.index import BlockState
from kvstore.daemon.metrics import Metrics
from kvstore.daemon.outbound import Outbound
from kvstore.daemon.service import MAX_TRANSFER_DEADLINE_S, finite, rpc
from kvstore.errors import Code, KVError, invalid
from kvstore.tier_kind import TierKind
from kvstore.transport.auth import read_regular
from kvstore.v1 import peer_pb2 as ppb, peer_pb2_grpc as peer_grpc

if TYPE_CHECKING:
    from kvstore.daemon.remote import LinkMeter
    from kvstore.daemon.tiering import Tiering

log = logging.getLogger("kvstore.daemon.pull")
# A Push that ended so failed on the wire or in the holder's transfer: the holder is set aside
# (LinkMeter.failed). NOT_FOUND (evicted), FAILED_PRECONDITION (fenced) and PERMISSION_DENIED
# are answers with a reason from a live peer.
WIRE_FAILURES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.ABORTED,
                           grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL, grpc.StatusCode.DATA_LOSS})
PROMOTE_SHARE = 0.5  # of a push's deadline, what promoting NVMe-only blocks may use; the rest ships them


def leading(st: NsState, keys: list[bytes], tiers: tuple[TierKind, ...] = (TierKind.DRAM, TierKind.NVME)) -> int:
    """How many leading ``keys`` are committed here in one of ``tiers`` (core lock held)."""
    n = 0
    for k in keys:
        b = st.blocks.get(k)
        if b is None or b.state is not BlockState.COMMITTED or b.tier not in tiers:
            break
        n += 1
    return n


class Holders(Protocol):
    """Where a pull looks for the peers that may hold a chain: the peers to ask, best first.
    A peer asked that lacks the blocks answers NOT_FOUND and the next is asked, so a source
    may over-approximate; it must never name this daemon."""

    def candidates(self, ns_hex: str, keys: list[bytes], head: Sequence[bytes] = ()) -> list[Member]: ...


class AdvertisedHolders:
    """Every registered peer advertising the namespace, in node-id order: membership knows
    namespaces, not chains. The cluster prefix directory (built from the peers' KV events)
    is the source that names the peers holding the chain's longest prefix instead."""

    def __init__(self, membership: Membership) -> None:
        self.membership = membership

    def candidates(self, ns_hex: str, keys: list[bytes], head: Sequence[bytes] = ()) -> list[Member]:
        return [m for m in self.membership.peers() if ns_hex in m.namespaces]


def certificate_names(context: grpc.ServicerContext) -> frozenset[str]:
    """The names in the caller's verified client certificate (its CN and every SAN), empty for
    a call without one (the unix socket, or TLS without client certificates)."""
    ctx = context.auth_context() or {}
    names = [*ctx.get("x509_common_name", ()), *ctx.get("x509_subject_alternative_name", ())]
    return frozenset(n.decode(errors="replace") if isinstance(n, bytes) else str(n) for n in names)


class PeerLinks:
    """gRPC channels to peers' TLS control listeners, one per address. A daemon's own server
    certificate is its client certificate, checked against the fleet's CA
    (``server.tls_client_ca_file``), and its bearer token goes along when one is set: daemons of
    one fleet share a CA and a token."""

    def __init__(self, s: ServerConfig) -> None:
        self.why_off = "" if s.tcp_listen and s.tls_client_ca_file else \
            "pulls need server.tcp_listen with mutual TLS (server.tls_client_ca_file: the fleet's CA)"
        self._creds = None
        if not self.why_off:
            self._creds = grpc.ssl_channel_credentials(read_regular(s.tls_client_ca_file, "server.tls_client_ca_file"),
                                                       read_regular(s.tls_key_file, "server.tls_key_file"),
                                                       read_regular(s.tls_cert_file, "server.tls_cert_file"))
            if s.auth_token:
                self._creds = grpc.composite_channel_credentials(
                    self._creds, grpc.access_token_call_credentials(s.auth_token))
        self._lock = threading.Lock()
        self._stubs: dict[tuple[str, str], tuple[grpc.Channel, peer_grpc.PeerStub]] = {}
        self.closed = False

    def stub(self, addr: str, node_id: str = "") -> peer_grpc.PeerStub:
        """A stub for the peer at ``addr``. With ``node_id`` the peer's server certificate
        must name that node id (CN or DNS SAN) rather than ``addr``: a pod's certificate cannot
        name the IP it is given after its volumes are mounted (cert-manager's csi-driver), and a
        certificate naming the node proves more than one naming an address."""
        with self._lock:
            if self.closed:  # a pull still running while the daemon stops: no new channel
                raise KVError(Code.UNAVAILABLE, "this daemon is stopping")
            got = self._stubs.get((addr, node_id))
            if got is None:
                opts = [("grpc.ssl_target_name_override", node_id)] if node_id else []
                ch = grpc.secure_channel(addr, self._creds, options=opts)
                got = self._stubs[(addr, node_id)] = (ch, peer_grpc.PeerStub(ch))
            return got[1]

    def close(self) -> None:
        """Close every channel (at the daemon's stop: each holds a connection and gRPC's
        polling of it); a pull still running then fails as a miss."""
        with self._lock:
            self.closed = True
            for ch, _ in self._stubs.values():
                ch.close()
            self._stubs.clear()


class Pulls:
    """Both ends of a pull: :meth:`pull` on the requester, :meth:`push` on the holder."""

    def __init__(self, core: Core, membership: Membership, outbound: Outbound, links: PeerLinks,
                 t: TransportConfig, *, holders: Holders, tiering: "Tiering | None",
                 metrics: ClusterMetrics, meter: "LinkMeter") -> None:
        """``holders``: which peers a pull asks; ``tiering``: promotes what a push finds only
        on NVMe (None without an NVMe tier); ``meter``: each pull's bytes and time, per peer."""
        self.core = core
        self.membership = membership
        self.outbound = outbound
        self.links = links
        self.cfg = t  # SIGHUP may change timeout_s, the default deadline
        self.holders = holders
        self.tiering = tiering
        self.metrics = metrics
        self.meter = meter

    def close(self) -> None:
        self.links.close()

    def pull(self, s: Session, keys: list[bytes], holder: str, deadline_s: float,
             layer_major: bool = False) -> ppb.PullResponse:
        t0 = time.monotonic()
        deadline = t0 + (deadline_s or self.cfg.timeout_s)
        with self.core.lock:
            have = leading(s.ns, keys)
        if have == len(keys):
            return ppb.PullResponse(blocks=have)
        r = self._pull_from_peers(s, keys, have, holder, deadline, layer_major)
        self.metrics.pulls.labels(result="ok" if r.pulled else "miss").inc()
        self.metrics.pull_latency.observe(time.monotonic() - t0)
        return r

    def _pull_from_peers(self, s: Session, keys: list[bytes], have: int, holder: str,
                         deadline: float, layer_major: bool) -> ppb.PullResponse:
        def miss(why: str) -> ppb.PullResponse:
            return ppb.PullResponse(blocks=have, detail=why)

        if self.links.why_off:
            return miss(self.links.why_off)
        me = self.membership.epoch
        if not me:
            return miss(f"this daemon is not registered in the cluster ({self.membership.state.value})")
        ns_hex = s.ns.id.hex()
        if holder:
            m = self.membership.member(holder)
            if m is None or holder == self.membership.node_id:
                return miss(f"holder {holder!r}: not a registered peer")
            candidates = [m]
        else:
            candidates = self.holders.candidates(ns_hex, keys[have:], head=keys[:have])
            if not candidates:
                return miss("no registered peer holds this namespace")
            # Set aside after a failed push: unless named, not asked again for a while.
            aside = [m for m in candidates if self.meter.set_aside(m.node_id, m.epoch)]
            candidates = [m for m in candidates if m not in aside]
            if not candidates:
                return miss(f"every holder is set aside after a failed push: {', '.join(m.node_id for m in aside)} "
                            f"(cluster.peer_cooldown_s)")
        why, got, first = [], ppb.PullResponse(blocks=have), None
        for m in candidates:
            left = deadline - time.monotonic()
            addr = m.capabilities.get("control_addr", "")
            if left <= 0:
                why.append(f"{m.node_id}: deadline passed before it was asked")
                break
            if not addr or not m.transfer_addr:
                why.append(f"{m.node_id}: offers no control listener or no transfer listener")
                continue
            req = ppb.PushRequest(requester=self.membership.node_id, requester_epoch=me, holder_epoch=m.epoch,
                                  namespace_id=s.ns.id, keys=b"".join(keys[got.blocks:]), deadline_s=left * 0.9,
                                  layer_major=layer_major)
            try:
                # The transfer's own deadline is a tenth earlier, so a late holder's
                # transfer ends (and frees its slots here) before this call gives up.
                t_push = time.monotonic()
                r = self.links.stub(addr, m.node_id).Push(req, timeout=left)
            except grpc.RpcError as e:
                why.append(f"{m.node_id}@{m.epoch}: {e.code().name}: {e.details()}")
                if e.code() in WIRE_FAILURES:  # not a refusal with a reason: the peer or its link failed
                    self.meter.failed(m.node_id, m.epoch)
                continue
            self.meter.pull(m.node_id, r.bytes, time.monotonic() - t_push)
            self.meter.answered(m.node_id, m.epoch)
            with self.core.lock:
                now = leading(s.ns, keys)
            first = first or m
            got = ppb.PullResponse(blocks=now, pulled=got.pulled + r.blocks, holder=first.node_id,
                                   holder_epoch=first.epoch, bytes=got.bytes + r.bytes)
            if now == len(keys):
                return got
            # A holder with the chain's head only: the next may hold its tail.
            why.append(f"{m.node_id}@{m.epoch}: {r.blocks} blocks, then no more")
        if got.pulled:
            got.detail = "; ".join(why)
            return got
        log.info("pull of %d blocks missed: %s", len(keys) - have, "; ".join(why))
        return miss("; ".join(why))

    @staticmethod
    def check_caller(requester: str, caller: frozenset[str]) -> None:
        """PERMISSION_DENIED unless the caller's client certificate names ``requester``."""
        if requester not in caller:
            shown = ", ".join(sorted(caller)[:4]) or "no client certificate"
            raise KVError(Code.PERMISSION_DENIED, f"requester {requester!r}: the caller's certificate does not name "
                          f"it ({shown}); each daemon needs a certificate whose CN or a SAN is its node id")

    def lookup(self, req: ppb.PeerLookupRequest, keys: list[bytes], caller: frozenset[str]) -> ppb.PeerLookupResponse:
        """A peer's Lookup: only a registered fleet member learns what this daemon holds (a
        namespace id alone must not tell a unix-socket client another tenant's chains)."""
        self.check_caller(req.requester, caller)
        if self.membership.member(req.requester) is None:
            raise KVError(Code.FAILED_PRECONDITION, f"requester {req.requester!r}: not a registered peer")
        with self.core.lock:
            st = self.core.namespaces.get(req.namespace_id)
            n = leading(st, keys) if st is not None else 0
            tiers = bytes(st.blocks[k].tier for k in keys[:n])
        return ppb.PeerLookupResponse(blocks=n, tiers=tiers, epoch=self.membership.epoch)

    def push(self, req: ppb.PushRequest, keys: list[bytes], deadline_s: float,
             caller: frozenset[str]) -> ppb.PushResponse:
        """``deadline_s``: what is left of the caller's wait; the transfer ends within it.
        ``caller``: the names in the caller's client certificate; one must be the requester's
        node id, else any fleet member could have blocks shipped in another's name."""
        try:
            self.check_caller(req.requester, caller)
        except KVError:
            self.metrics.pushes.labels(result="denied").inc()
            raise
        me = self.membership.epoch
        if not me or req.holder_epoch != me:
            self.metrics.pushes.labels(result="fenced").inc()
            raise KVError(Code.FAILED_PRECONDITION, f"holder_epoch {req.holder_epoch}: this daemon's epoch is "
                          f"{me or 'withdrawn (not registered)'}; what was learnt of the old one is stale")
        m = self.membership.member(req.requester)
        if m is None or m.epoch != req.requester_epoch or not m.transfer_addr:
            self.metrics.pushes.labels(result="fenced").inc()
            raise KVError(Code.FAILED_PRECONDITION, f"requester {req.requester!r} at epoch {req.requester_epoch}: "
                          "not registered so (or without a transfer listener)")
        with self.core.lock:
            st = self.core.namespaces.get(req.namespace_id)
            held = leading(st, keys) if st is not None else 0  # in DRAM or on NVMe
            n = leading(st, keys, (TierKind.DRAM,)) if held else 0
            s = self.core.own_session(st) if held else None
        if n < held and self.tiering is not None:
            # On NVMe only: promoted into DRAM first (the transfer ships from the arena), within
            # a share of the deadline; what is not resident by then is not shipped.
            t0 = time.monotonic()
            self.tiering.make_resident(s, keys[:held], deadline_s * PROMOTE_SHARE)
            deadline_s -= time.monotonic() - t0
            with self.core.lock:
                n = leading(st, keys, (TierKind.DRAM,))
        if not n:
            self.metrics.pushes.labels(result="missing").inc()
            raise KVError(Code.NOT_FOUND, "none of the leading blocks is here (evicted, or never here)" if not held else
                          "the leading blocks are on NVMe and could not be brought into DRAM within the deadline")
        try:
            blocks, nbytes, _ = self.outbound.transfer(s, keys[:n], m.transfer_addr, deadline_s, False, 0,
                                                       layer_major=req.layer_major)
        except KVError:  # evicted between the look and the transfer (NOT_FOUND), or the wire failed
            self.metrics.pushes.labels(result="failed").inc()
            raise
        self.metrics.pushes.labels(result="ok").inc()
        return ppb.PushResponse(blocks=blocks, bytes=nbytes)


class PeerService(peer_grpc.PeerServicer):
    """kvstore.v1.Peer. ``pulls`` is None without a cluster or a transfer listener."""

    def __init__(self, core: Core, pulls: Pulls | None, *, metrics: Metrics) -> None:
        self.core = core
        self.pulls = pulls
        self.metrics = metrics

    def _reject(self, method: str, code: str) -> None:
        self.metrics.rejections.labels(method=method, code=code).inc()

    def _on(self) -> Pulls:
        if self.pulls is None:
            raise KVError(Code.UNAVAILABLE, "pull: this daemon is in no cluster (set cluster.etcd_endpoints) "
                          "or has no transfer listener (set transport.listen)")
        return self.pulls

    @rpc
    def Pull(self, req, context):
        finite(req.deadline_s, "deadline_s", "seconds", MAX_TRANSFER_DEADLINE_S)
        with self.core.lock:
            if len(req.session_id) != 16:
                raise invalid(f"session_id: must be 16 bytes, got {len(req.session_id)}")
            s = self.core.session(req.session_id)
            keys = self.core.keys(req.keys)
        if not keys:
            raise invalid("keys: name the blocks to pull")
        return self._on().pull(s, keys, req.holder, req.deadline_s, req.layer_major)

    @rpc
    def Push(self, req, context):
        finite(req.deadline_s, "deadline_s", "seconds", MAX_TRANSFER_DEADLINE_S)
        if len(req.namespace_id) != 32:
            raise invalid(f"namespace_id: must be 32 bytes, got {len(req.namespace_id)}")
        with self.core.lock:
            keys = self.core.keys(req.keys)
        if not keys:
            raise invalid("keys: name the blocks to push")
        # The caller's deadline, as gRPC carries it, bounds the transfer too: a holder that
        # was stalled (paused, swapping) must not ship blocks after the requester gave up.
        left = context.time_remaining()
        deadline_s = min(req.deadline_s or self._on().cfg.timeout_s, left * 0.9 if left is not None else math.inf)
        if deadline_s <= 0.01:
            raise KVError(Code.DEADLINE_EXCEEDED, "push: the requester's deadline has passed")
        return self._on().push(req, keys, deadline_s, certificate_names(context))

    @rpc
    def Lookup(self, req, context):
        if len(req.namespace_id) != 32:
            raise invalid(f"namespace_id: must be 32 bytes, got {len(req.namespace_id)}")
        with self.core.lock:
            keys = self.core.keys(req.keys)
        return self._on().lookup(req, keys, certificate_names(context))
