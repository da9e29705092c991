"""The gRPC servicer: validates at the boundary, takes the core lock, maps errors to statuses.

Every handler turns a :class:`KVError` into the gRPC status of the same name with its message;
any other exception becomes INTERNAL with the exception text, and the daemon keeps serving.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import time
from contextlib import contextmanager, nullcontext
from typing import TYPE_CHECKING

import grpc

from kvstore.daemon.advice import Advisor
from kvstore.config import ServerConfig
from kvstore.daemon.core import Core, SessionEnd
from kvstore.daemon.hints import HintError, RouteHints
from kvstore.errors import REFUSAL_KEY, Code, KVError, invalid, not_found
from kvstore.daemon.metrics import Metrics
from kvstore.daemon.places import Places
from kvstore.daemon.stats import Reporter
from kvstore.keys import KEY_BYTES, Namespace, check_tokens
from kvstore.layout import KVLayout, LayoutError
from kvstore.tier_kind import TierKind
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc

if TYPE_CHECKING:
    from kvstore.daemon.tiering import Tiering
    from kvstore.daemon.inbound import Inbound
    from kvstore.daemon.outbound import Outbound
    from kvstore.daemon.remote import ClusterAdvisor


log = logging.getLogger("kvstore.daemon.service")


def layout_from_pb(m: pb.Layout) -> KVLayout:
    try:
        if not m.dtype:
            raise LayoutError("dtype: missing")
        return KVLayout(num_layers=m.num_layers, num_kv_heads=m.num_kv_heads, head_dim=m.head_dim,
                        dtype=m.dtype, kind=m.kind or "gqa", block_tokens=m.block_tokens or 16,
                        kv_lora_rank=m.kv_lora_rank, qk_rope_head_dim=m.qk_rope_head_dim,
                        state_bytes=m.state_bytes)
    except LayoutError as e:
        raise invalid(f"layout.{e}") from None


def finite(value: float, name: str, unit: str, most: float = math.inf) -> float:
    """``value`` if it is a finite number in [0, ``most``], else INVALID_ARGUMENT naming the
    field: NaN passes every ``< 0`` check and ``min(nan, cap)`` is NaN, so a NaN wait would never
    end; a huge one overflows the clocks it is added to."""
    if not (math.isfinite(value) and value >= 0):
        raise invalid(f"{name}: must be a finite number of {unit} >= 0, got {value}")
    if value > most:
        raise invalid(f"{name}: must be at most {most:g} {unit}, got {value:g}")
    return value


MAX_TRANSFER_DEADLINE_S = 86400.0  # a day: past any real transfer, far below what overflows time_t


# Prefetch targets: proto3 enums are open, so a request may carry any int32 there.
PREFETCH_TARGETS = "TIER_UNSPECIFIED (= DRAM) or TIER_DRAM"
class Waits(Places):
    """The places for calls that wait in the daemon (AwaitTransfer, PrefetchStatus and Acquire
    with wait_s, Reserve waiting for demotion): at most ``per_session`` for one session and
    ``total`` in all, so waiting calls never hold every gRPC worker and Stats, Lookup or
    Register always find one. A call over either bound is refused at once."""

    def __init__(self, total: int, per_session: int) -> None:
        super().__init__(total, per_session,
                         lambda n, cap: (f"this session already has {n} calls waiting in the daemon "
                                         f"(server.max_waits_per_session = {cap} per session); let one end first"),
                         lambda n, cap: (f"{n} calls are waiting in the daemon in all (server.max_waits = {cap}); "
                                         "retry shortly, or wait less per call"))

    @contextmanager
    def place(self, sid: bytes, method: str):
        why = self.take(sid)
        if why:
            raise KVError(Code.RESOURCE_EXHAUSTED, f"{method}: {why}")
        try:
            yield
        finally:
            self.leave(sid)


def wait_budget(context, wait_s: float) -> float:
    """``wait_s`` cut to the call's deadline: a wait ends before its client stops listening."""
    left = context.time_remaining()
    return wait_s if left is None else max(0.0, min(wait_s, left))


def rpc(method):
    """Wrap a handler: latency histogram, KVError -> status, crash -> INTERNAL."""
    name = method.__name__

    @functools.wraps(method)
    def handler(self, request, context):
        t0 = time.perf_counter()
        try:
            return method(self, request, context)
        except KVError as e:
            self._reject(name, e.code.value)
            if e.refusal:
                context.set_trailing_metadata(((REFUSAL_KEY, pb.Refusal.Name(e.refusal)),))
            context.abort(getattr(grpc.StatusCode, e.code.value), e.message)
        except Exception as e:  # noqa: BLE001 - a bug must not take the daemon down
            log.exception("%s failed", name)
            self._reject(name, "INTERNAL")
            context.abort(grpc.StatusCode.INTERNAL, f"{name}: internal error: {type(e).__name__}: {e}")
        finally:
            if self.metrics:
                self.metrics.rpc_latency.labels(method=name).observe(time.perf_counter() - t0)

    return handler


class KVStoreService(pb_grpc.KVStoreServicer):
    """Every RPC of kvstore.v1.KVStore. ``tiering`` (NVMe), ``outbound`` and ``inbound`` (daemon
    to daemon transfer) are None when off; their RPCs then answer UNAVAILABLE (or NOT_FOUND for
    a prefetch handle) saying what to set."""

    def __init__(self, core: Core, cfg: ServerConfig, *, advisor: Advisor, reporter: Reporter, metrics: Metrics,
                 arena_socket: str, tiering: Tiering | None = None, outbound: Outbound | None = None,
                 inbound: Inbound | None = None, cluster: ClusterAdvisor | None = None,
                 hints: RouteHints | None = None) -> None:
        """``cluster``: remote hits and the load/pull/recompute advice in Lookup (None alone);
        ``hints``: RouteHints' answers (:mod:`kvstore.daemon.hints`)."""
        self.core = core
        self.cfg = cfg  # SIGHUP may change reserve_wait_s
        self.advisor = advisor
        self.reporter = reporter
        self.metrics = metrics
        self.arena_socket = arena_socket
        self.arena_id = os.urandom(16)  # RegisterResponse.arena_id: offsets name this arena's slots
        self.tiering = tiering
        self.outbound = outbound
        self.inbound = inbound
        self.cluster = cluster
        self.hints = hints or RouteHints(core, advisor)
        self.waits = Waits(cfg.resolved_max_waits(), cfg.max_waits_per_session)

    @property
    def durable_commit(self) -> bool:
        """Commits wait for NVMe (nvme.durable_commit, with the tier up)."""
        t = self.tiering
        return t is not None and t.nvme.enabled and t.cfg.durable_commit

    def _reject(self, method: str, code: str) -> None:
        if self.metrics:
            self.metrics.rejections.labels(method=method, code=code).inc()

    def _session(self, sid: bytes):
        if len(sid) != 16:
            raise invalid(f"session_id: must be 16 bytes, got {len(sid)}")
        return self.core.session(sid)

    @rpc
    def Register(self, req, context):
        layout = layout_from_pb(req.layout)
        finite(req.prefill_tokens_per_s, "prefill_tokens_per_s", "tokens per second")
        finite(req.model_params, "model_params", "parameters")
        try:
            ns = Namespace(req.model_id, layout, req.tp_rank, req.tp_world or 1, req.tenant_salt, req.kv_codec)
        except LayoutError as e:
            raise invalid(str(e)) from None
        with self.core.lock:
            s = self.core.register(ns, req.prefill_tokens_per_s, req.model_params)
            self._count_sessions()
            if self.metrics:
                self.metrics.namespaces.set(len(self.core.namespaces))
            self.advisor.price(s.ns)
        if self.tiering is not None:
            try:
                self.tiering.remember(s.ns)
            except OSError as e:
                log.error("cannot record namespace for NVMe recovery: %s", e)
        c = self.core.cfg
        return pb.RegisterResponse(
            session_id=s.id, namespace_id=ns.root, arena_socket=self.arena_socket,
            arena_bytes=self.core.dram.arena.size_bytes, block_bytes=layout.block_bytes,
            layer_chunk_bytes=layout.layer_chunk_bytes, lease_ttl_s=self.core.leases.ttl_s,
            max_keys_per_request=c.max_keys, hbm_emulated=self.reporter.hbm_emulated,
            durable_commit=self.durable_commit, session_ttl_s=c.session_ttl_s,
            slot_stride_bytes=self.core.dram.slot_stride(layout.block_bytes), arena_id=self.arena_id)

    def _count_sessions(self) -> None:
        """The sessions gauge at once (the reaper refreshes it after expiries); under the lock."""
        if self.metrics:
            self.metrics.sessions.set(len(self.core.sessions))

    @rpc
    def CloseSession(self, req, context):
        with self.core.lock:
            ended = self.core.close_session(self._session(req.session_id), SessionEnd.CLOSED)
            self._count_sessions()
        return pb.CloseSessionResponse(leases_ended=ended)

    @rpc
    def Lookup(self, req, context):
        pin = {}
        with self.core.lock:
            s = self._session(req.session_id)
            hits, tiers, found = self.core.lookup(s, req.keys, req.each)
            # Keys each on its own (sparse snapshots): no prefix to advise on or count as one.
            decision = None if req.each else self.advisor.decide(s.ns, tiers)
            if req.pin and req.promote and not req.each:
                pin = self._pin_for_load(s, req, tiers)
        if req.each:
            if self.metrics:
                self.metrics.lookups.inc()
            return pb.LookupResponse(hit_blocks=len(hits), tiers=tiers, found=found)
        advice = self.advisor.fields(decision)
        try:
            if req.promote and self.tiering is not None:
                self._promote_for_load(s, req, tiers, advice.get("load_blocks", len(hits)))
            if self.cluster is not None:  # without a cluster the answer has none of these fields
                advice.update(self.cluster.advise(s.ns, self.core.keys(req.keys), decision, req.ask_peers))
        except BaseException:
            if pin:  # the caller never learns of the lease: end it now, not at its TTL
                with self.core.lock:
                    self.core.release(s, pin["lease_id"])
            raise
        m = self.metrics
        if m:
            bt = s.ns.ns.layout.block_tokens
            m.lookups.inc()
            m.lookup_query_tokens.inc(len(req.keys) // KEY_BYTES * bt)
            for t in set(tiers):
                m.lookup_hit_tokens.labels(tier=TierKind(t).name.lower()).inc(tiers.count(t) * bt)
        return pb.LookupResponse(hit_blocks=len(hits), tiers=tiers, **advice, **pin)

    def _pin_for_load(self, s, req, tiers: bytes) -> dict:
        """Lookup(pin), under the core lock with the lookup itself: the hit's blocks from
        ``promote_from`` (to ``promote_to``) pinned, as the Acquire that would follow would pin
        them, where every one is in DRAM; else nothing (the caller Acquires, waiting for reads)."""
        first, end = req.promote_from, min(len(tiers), req.promote_to or len(tiers))
        if first >= end or any(t != TierKind.DRAM for t in tiers[first:end]):
            return {}
        lease, blocks = self.core.acquire(s, req.keys[first * KEY_BYTES:end * KEY_BYTES], allow_partial=True)
        return {"lease_id": lease.id, "offsets": [b.offset for b in blocks]} if lease else {}

    def _promote_for_load(self, s, req, tiers: bytes, load_blocks: int) -> None:
        """Lookup(promote): the NVMe blocks of the hit the caller is about to load start moving
        into DRAM (planned on the promoter's thread, read on the NVMe tier's; nothing here
        waits), so their reads overlap the caller's scheduling and its Acquire's round trip."""
        first, end = req.promote_from, min(load_blocks, len(tiers), req.promote_to or len(tiers))
        if first < end and TierKind.NVME in tiers[first:end]:
            self.tiering.promote_soon(s.ns, self.core.keys(req.keys)[first:end])

    @rpc
    def RouteHints(self, req, context):
        try:
            return self.hints.answer(req.namespace_id, req.keys, req.token_ids, req.max_nodes)
        except HintError as e:
            raise (not_found if e.code == "not_found" else invalid)(f"RouteHints: {e}") from None

    @rpc
    def Reserve(self, req, context):
        # DRAM full of blocks still being demoted: wait here, woken when a demotion lands,
        # rather than have the client poll (the client retries past this bound).
        # A wait takes one of the session's places (Waits); with none free the refusal goes
        # back at once, and the client retries as it would after the wait.
        deadline = None  # set at the first refusal: the common path pays nothing
        placed = b""
        # Hashed without the lock, one SHA-256 per block (1.5-4 us here), and only where the KV
        # events carry them (else the core checks their size alone and drops them).
        if req.token_ids and self.core.keeps_tokens:
            with self.core.lock:
                ns = self._session(req.session_id).ns.ns
            try:
                check_tokens(ns.root, req.parent, req.keys, req.token_ids, ns.layout.block_tokens)
            except ValueError as e:
                raise invalid(str(e)) from None
        try:
            with self.core.lock:
                while True:
                    s = self._session(req.session_id)  # again after a wait: it may have closed
                    try:
                        lease, offsets, states = self.core.reserve(s, req.keys, req.parent, req.doorbell, req.token_ids,
                                                                   req.part, req.parts)
                        break
                    except KVError as e:
                        if deadline is None:
                            deadline = time.monotonic() + wait_budget(context, self.cfg.reserve_wait_s)
                            if e.transient and not self.waits.take(s.id):
                                placed = s.id
                        left = deadline - time.monotonic()
                        if not e.transient or not placed or left <= 0 or not context.is_active():
                            raise
                        self.core.changed.wait(min(left, 0.02))
        finally:
            if placed:
                self.waits.leave(placed)
        return pb.ReserveResponse(lease_id=lease.id if lease else 0, offsets=offsets, states=states,
                                  expires_in_s=self.core.leases.ttl_s if lease else 0.0,
                                  doorbell_offset=lease.doorbell if lease else 0)

    @rpc
    def Commit(self, req, context):
        with self.core.lock:
            s = self._session(req.session_id)
            blocks = self.core.commit(s, req.lease_id, req.keys)
        if self.outbound is not None:  # digests taken once, here, for transfers and the NVMe tier
            self.outbound.committed(blocks)
        if self.tiering is not None:
            self.tiering.committed(blocks)
        return pb.CommitResponse(committed=len(blocks))

    @rpc
    def Abort(self, req, context):
        with self.core.lock:
            return pb.AbortResponse(freed=self.core.abort(self._session(req.session_id), req.lease_id))

    @rpc
    def Acquire(self, req, context):
        finite(req.wait_s, "wait_s", "seconds")
        if req.min_blocks and not (req.allow_partial or req.each):
            raise invalid(f"min_blocks: {req.min_blocks} needs allow_partial or each (an answer before every "
                          f"key is resident pins only the keys resident then)")
        with self.core.lock:
            s = self._session(req.session_id)
        if req.wait_s > 0 and self.tiering is not None:
            with self._waiting(s, "Acquire", req.wait_s):
                self.tiering.make_resident(s, self.core.keys(req.keys), wait_budget(context, min(req.wait_s, 60.0)),
                                           context.is_active, each=req.each, enough=req.min_blocks)
        found = bytearray() if req.each else None
        with self.core.lock:
            s = self._session(req.session_id)  # again after the wait: it may have ended
            lease, blocks = self.core.acquire(s, req.keys, req.allow_partial, found)
            hbm = [b.hbm_slot for b in blocks] if self.core.cfg.hot_after_reads else []
        return pb.AcquireResponse(lease_id=lease.id if lease else 0, offsets=[b.offset for b in blocks],
                                  acquired=len(blocks), expires_in_s=self.core.leases.ttl_s if lease else 0.0,
                                  hbm_offsets=hbm, found=bytes(found or b""))

    @rpc
    def Release(self, req, context):
        with self.core.lock:
            self.core.release(self._session(req.session_id), req.lease_id)
        return pb.ReleaseResponse()

    @rpc
    def KeepAlive(self, req, context):
        with self.core.lock:
            expired = self.core.keepalive(self._session(req.session_id), list(req.lease_ids))
        return pb.KeepAliveResponse(expired=expired, expires_in_s=self.core.leases.ttl_s,
                                    session_ttl_s=self.core.cfg.session_ttl_s)

    @rpc
    def Delete(self, req, context):
        with self.core.lock:
            deleted, busy = self.core.delete(self._session(req.session_id), req.keys)
        return pb.DeleteResponse(deleted=deleted, busy=busy)

    @rpc
    def DropNamespace(self, req, context):
        with self.core.lock:
            dropped, busy = self.core.drop_namespace(req.namespace_id_hex)
        return pb.DropNamespaceResponse(dropped=dropped, busy=busy)

    @rpc
    def Prefetch(self, req, context):
        finite(req.deadline_s, "deadline_s", "seconds")
        with self.core.lock:
            s = self._session(req.session_id)
            keys = self.core.keys(req.keys)
        if req.target not in (pb.TIER_UNSPECIFIED, pb.TIER_DRAM):
            what = pb.Tier.Name(req.target) if req.target in pb.Tier.values() else f"{req.target} (no such tier)"
            raise invalid(f"target: {what} is not a prefetch target; use {PREFETCH_TARGETS}")
        if self.tiering is None:
            raise KVError(Code.UNAVAILABLE, "prefetch: no lower tier is enabled (set nvme.dir); DRAM blocks are already resident")
        handle = self.tiering.prefetch(s, keys, req.deadline_s)
        return pb.PrefetchResponse(handle=handle)

    @rpc
    def PrefetchStatus(self, req, context):
        finite(req.wait_s, "wait_s", "seconds")
        with self.core.lock:
            s = self._session(req.session_id)
        if self.tiering is None:
            raise not_found(f"prefetch {req.handle}: unknown handle")
        with self._waiting(s, "PrefetchStatus", req.wait_s):
            state, ready, total, detail = self.tiering.prefetch_status(
                s, req.handle, wait_budget(context, min(req.wait_s, 300.0)), context.is_active)
        return pb.PrefetchStatusResponse(state=state, ready_blocks=ready, total_blocks=total, detail=detail)

    @rpc
    def Transfer(self, req, context):
        with self.core.lock:
            s = self._session(req.session_id)
            keys = self.core.keys(req.keys)
        if not keys:
            raise invalid("keys: name the blocks to ship")
        if not req.peer:
            raise invalid("peer: host:port of the peer's transfer listener is required")
        finite(req.deadline_s, "deadline_s", "seconds", MAX_TRANSFER_DEADLINE_S)
        if req.pipelined and not req.lease_id:
            raise invalid("lease_id: a pipelined transfer names the write lease whose doorbell it follows")
        blocks, nbytes, secs = self._listening(self.outbound).transfer(s, keys, req.peer, req.deadline_s,
                                                                       req.pipelined, req.lease_id)
        return pb.TransferResponse(blocks=blocks, bytes=nbytes, seconds=secs)

    @rpc
    def AwaitTransfer(self, req, context):
        finite(req.wait_s, "wait_s", "seconds")
        with self.core.lock:
            s = self._session(req.session_id)
            keys = self.core.keys(req.keys)
        if not keys:
            raise invalid("keys: name the blocks being shipped here")
        inbound = self._listening(self.inbound)
        with self._waiting(s, "AwaitTransfer", req.wait_s):
            return inbound.await_transfer(s, keys, wait_budget(context, min(req.wait_s, 300.0)), context.is_active)

    def _waiting(self, s, method: str, wait_s: float):
        """A place among the waiting calls (:class:`Waits`) for a call that may wait; a call
        that only looks (wait_s = 0) needs none."""
        return self.waits.place(s.id, method) if wait_s > 0 else nullcontext()

    @staticmethod
    def _listening(side):
        if side is None:
            raise KVError(Code.UNAVAILABLE, "transfer: the transfer listener is off (set transport.listen)")
        return side

    @rpc
    def Stats(self, req, context):
        return self.reporter.stats_pb()

