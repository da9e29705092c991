"""Transfers arriving from other daemons (the receiving side of :mod:`kvstore.transport`), and
the AwaitTransfer RPC a decode worker calls to read them as they land.

:class:`DaemonSink` is the transport's Sink over the DRAM tier: a transfer reserves DRAM slots
for every block, all or nothing, in the namespace its metadata describes (created here if this
daemon has not seen it), under a session of the daemon's own (``Core.own_session``); chunks land
straight in the slots; the doorbell counts complete layers for a decode worker that called
AwaitTransfer; success commits the blocks, anything else frees every slot (a pinned one when its
reader lets go). Sending is :mod:`kvstore.daemon.outbound`.
"""

from __future__ import annotations

import logging
import threading
import time
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvstore import doorbell
from kvstore.config import TransportConfig, is_loopback
from kvstore.daemon import transfer_meta
from kvstore.daemon.core import Core, Session
from kvstore.daemon.index import BlockState
from kvstore.daemon.leases import Lease, LeaseKind
from kvstore.daemon.metrics import Metrics
from kvstore.daemon.outbound import failure_reason
from kvstore.errors import KVError
from kvstore.keys import Namespace, check_tokens
from kvstore.tier_kind import TierKind
from kvstore.transport import Listener, TransferConfig, TransferError, TransferHeader, TransferStatus
from kvstore.transport.auth import Peer
from kvstore.transport.sink import LayerProgress
from kvstore.transport.ucx_env import fused
from kvstore.v1 import kvstore_pb2 as pb

if TYPE_CHECKING:
    from kvstore.daemon.tiering import Tiering

log = logging.getLogger("kvstore.daemon.inbound")


@dataclass(eq=False)
class Incoming:
    """One transfer arriving here."""

    header: TransferHeader
    session: Session  # internal session of the namespace, owner of the write lease
    lease: Lease
    offsets: list[int]  # per block: its reserved slot, or a scratch slot for a block we have
    scratch: list[int]
    bell: int
    progress: LayerProgress
    ended: threading.Event = field(default_factory=threading.Event)
    ok: bool = False


class DaemonSink:
    """The transport's Sink over the daemon's DRAM tier."""

    def __init__(self, svc: "Inbound") -> None:
        self.svc = svc
        self.core: Core = svc.core

    def begin(self, h: TransferHeader, peer: Peer) -> "_Target":
        try:
            meta = transfer_meta.decode(h.meta)
        except ValueError as e:
            raise TransferError(TransferStatus.PROTOCOL_ERROR, f"transfer metadata: {e}") from None
        ns = meta.ns
        if not self.svc.accepts(peer, ns):  # before anything is reserved or a namespace created
            self.svc.metrics.transfer_failures.labels(reason="forbidden").inc()
            who = repr(peer.name) if peer.name else "an unauthenticated peer"
            log.warning("refused a transfer of %d blocks of model %r from %s (%s): not in transport.accept",
                        len(h.keys), ns.model_id, who, peer.address)
            raise TransferError(TransferStatus.FORBIDDEN, f"the receiving daemon does not accept namespace "
                                f"{ns.root.hex()[:16]}.. (model {ns.model_id!r}) from {who} (its transport.accept)")
        lay = ns.layout
        if h.chunk_bytes != lay.layer_chunk_bytes or h.n_layers != lay.num_layers:
            raise TransferError(TransferStatus.PROTOCOL_ERROR,
                                f"chunks of {h.chunk_bytes} bytes x {h.n_layers} layers do not match the layout")
        core = self.core
        packed = b"".join(h.keys)
        parent = tokens = b""
        if meta.tokens and core.keeps_tokens:  # for the KV events; checked as Reserve checks a writer's
            try:
                check_tokens(ns.root, meta.parent, packed, meta.tokens, lay.block_tokens)
            except ValueError as e:
                raise TransferError(TransferStatus.PROTOCOL_ERROR, f"transfer metadata: {e}") from None
            parent, tokens = meta.parent, meta.tokens  # the tokens chaining to the keys vouch for the parent
        with core.lock:
            st = core.ns_state(ns)
            s = core.own_session(st)
            try:
                lease, offsets, states = core.reserve(s, packed, parent, tokens=tokens)
            except KVError as e:
                raise TransferError(TransferStatus.REFUSED, e.message) from None
            scratch = []
            for i, state in enumerate(states):
                if state != pb.SLOT_RESERVED:  # already here (or arriving): receive into a scratch slot
                    off = core.allocate_slot(st)
                    if off is None:
                        core.residency.free_scratch(st.id, scratch)
                        if lease:
                            core.abort(s, lease.id)
                        raise TransferError(TransferStatus.REFUSED, "receiving DRAM tier is full")
                    offsets[i] = off
                    scratch.append(off)
            if lease is None:  # every block already here: still take the bytes, then drop them
                lease = Lease(0, LeaseKind.WRITE, s, [], 0.0)
            lease.expires = core.clock() + h.deadline_s + 5.0  # the reaper must not free it mid-transfer
            bell = core.doorbells.alloc() if core.doorbells is not None else 0
            inc = Incoming(h, s, lease, offsets, scratch, bell, LayerProgress(len(h.keys), h.n_layers))
            self.svc.incoming[(st.id, h.keys[0])] = inc
            self.svc.arrived.notify_all()
        tiering = self.svc.tiering
        if tiering is not None:  # as a Register does: its NVMe blocks must be recoverable after a restart
            try:
                tiering.remember(st)
            except OSError as e:
                log.error("cannot record namespace for NVMe recovery: %s", e)
        return _Target(self, inc)


    def peer_refused(self, address: str, reason: str, detail: str) -> None:
        """A peer failed the listener's handshake (logged by the transport): count it."""
        self.svc.metrics.transfer_auth_failures.labels(reason=reason if reason in _AUTH_REASONS else "protocol").inc()


_AUTH_REASONS = ("tls", "hmac", "mode", "deadline", "admission", "protocol")


class _Target:
    def __init__(self, sink: DaemonSink, inc: Incoming) -> None:
        self.sink, self.inc = sink, inc
        self.chunk = inc.header.chunk_bytes
        self.buf = sink.core.dram.arena.buf
        self.digests = array("Q", bytes(8 * inc.header.n_chunks))  # filled by the session, verified

    def buffer(self, block: int, layer: int):
        off = self.inc.offsets[block] + layer * self.chunk
        return self.buf[off:off + self.chunk]

    def run(self, block: int, layer: int, k: int):
        off = self.inc.offsets[block] + layer * self.chunk  # a slot holds its layers back to back
        return self.buf[off:off + k * self.chunk]

    def arrived(self, block: int, layer: int) -> None:
        p = self.inc.progress
        if p.arrived(layer) and self.inc.bell:
            # Layers complete in order (the sender ships them in order); count the leading run.
            ready = 0
            while ready < len(p.counts) and p.counts[ready] == p.n_blocks:
                ready += 1
            doorbell.ring(self.buf, self.inc.bell, ready)

    def end(self, status: TransferStatus, detail: str) -> None:
        inc, core, svc = self.inc, self.sink.core, self.sink.svc
        blocks = []
        with core.lock:
            s, lease = inc.session, inc.lease
            if status is TransferStatus.OK and lease.id:
                blocks = list(lease.blocks)
                core.commit(s, lease.id, b"")
                n, index = inc.header.n_layers, {k: i for i, k in enumerate(inc.header.keys)}
                for b in blocks:  # every chunk was verified against these
                    i = index[b.key]
                    b.keep_digests(self.digests[i * n:(i + 1) * n])
            elif lease.id and lease.id in core.leases:
                core.abort(s, lease.id)
            core.residency.free_scratch(s.ns.id, inc.scratch)
            inc.ok = status is TransferStatus.OK
            self._count(status)  # before any waiter wakes: one that sees the end sees it counted
            if inc.bell:
                core.doorbells.set(inc.bell, inc.header.n_layers if inc.ok else inc.progress.ready_layers,
                                   doorbell.DONE if inc.ok else doorbell.FAILED)
                core.doorbells.release(inc.bell)
            inc.ended.set()
            svc.incoming.pop((s.ns.id, inc.header.keys[0]), None)
            svc.arrived.notify_all()
        if not inc.ok:
            log.warning("incoming transfer %d failed: %s %s", inc.header.transfer_id, status.name, detail)
        elif blocks and svc.tiering is not None:
            # As a client's Commit: with nvme.durable_commit the blocks are written through
            # before the sender hears OK (a failure reaches it as SINK_ERROR; the blocks stay
            # in DRAM). This runs on the connection's thread (UCX: the engine's, which waits).
            svc.tiering.committed(blocks)

    def _count(self, status: TransferStatus) -> None:
        inc, svc = self.inc, self.sink.svc
        m = svc.metrics
        if inc.ok:
            m.transfer_chunks.labels(direction="recv", backend=svc.backend).inc(inc.progress.n_blocks * inc.header.n_layers)
            m.transfer_bytes.labels(direction="recv", backend=svc.backend).inc(inc.header.total_bytes)
        else:
            m.transfer_failures.labels(reason=failure_reason(status)).inc()


class Inbound:
    """The transfer listener, the transfers arriving through it, and AwaitTransfer."""

    def __init__(self, core: Core, t: TransportConfig, wire: TransferConfig, *, metrics: Metrics,
                 tiering: "Tiering | None" = None) -> None:
        self.core = core
        self.metrics = metrics
        self.tiering = tiering  # NVMe: received namespaces recorded, blocks written through if durable
        self.backend = t.backend
        self.config = wire  # wire_config(t), read once at start
        self.allow_unauthenticated = t.allow_unauthenticated
        self.accept = {peer: frozenset(names) for peer, names in t.accept.items()}
        self.incoming: dict[tuple[bytes, bytes], Incoming] = {}
        self.arrived = threading.Condition(self.core.lock)
        self.listener = Listener(self.config, DaemonSink(self))

    def accepts(self, peer: Peer, ns: Namespace) -> bool:
        """Whether ``peer`` may send blocks of ``ns`` here: with no ``transport.accept`` rules
        every peer that passed the handshake may; with rules, what the peer's own entry and the
        ``"*"`` entry name (model ids, namespace ids in hex, or "*"). An unauthenticated peer
        (no TLS, no secret) has no name: only the ``"*"`` entry applies to it."""
        if not self.accept:
            return True
        names = self.accept.get("*", frozenset())
        if peer.name:
            names = names | self.accept.get(peer.name, frozenset())
        return bool(names & {"*", ns.model_id, ns.root.hex()})

    def start(self) -> str:
        """Listen; returns host:port."""
        host, port = self.listener.start()
        c = self.config
        bound = self.listener.bound()
        auth = ("mutual TLS" + (" and the cluster secret" if c.secret else "") if c.tls is not None else
                f"the cluster secret, as {c.node_name!r}" if c.secret else "NONE: any peer that reaches it")
        open_beyond = [a for a in bound if not is_loopback(a)]
        if open_beyond and not (c.tls is not None or c.secret or self.allow_unauthenticated):
            # Config validation refuses this; what the kernel says is listening is the last word.
            self.listener.stop()
            raise TransferError(TransferStatus.UNAUTHENTICATED, f"listens on {', '.join(bound)}, beyond loopback, "
                                f"without authentication: set transport.secret_file")
        if self.backend == "ucx":
            threads = c.resolved_verify_threads()
            if threads:
                verify = f"{threads} verify threads for payloads >= {c.verify_min_bytes} bytes"
            elif not c.ucx_fused_verify:
                verify = "payloads hashed once landed (transport.ucx_fused_verify is off)"
            else:
                module, why = fused()
                verify = "payloads over shared memory hashed as UCX copies them in" if module else why
            log.info("transfer listener (ucx, %s progress, %s) on %s:%d, bound to %s (ucxx takes no bind "
                     "address); authentication: %s", c.ucx_progress.value, verify, host, port,
                     ", ".join(bound) or "?", auth)
        else:
            log.info("transfer listener (%s) on %s:%d; authentication: %s", self.backend, host, port, auth)
        if not self.accept:
            log.info("transfer listener accepts every namespace from every peer that authenticates "
                     "(transport.accept restricts that per peer)")
        return f"{host}:{port}"

    def stop(self, grace_s: float) -> None:
        self.listener.stop(min(grace_s, 5.0))

    def await_transfer(self, s: Session, keys: list[bytes], wait_s: float, wanted: Callable[[], bool] = lambda: True):
        """Wait at most ``wait_s`` for a transfer of ``keys`` to start (or to have ended), and
        pin what it brings. ``wanted`` (the call's ``is_active``) is asked every 50 ms: a wait
        whose client gave up ends then and frees its worker."""
        core = self.core
        deadline = time.monotonic() + wait_s
        with core.lock:
            while True:
                inc = self.incoming.get((s.ns.id, keys[0])) if keys else None
                if inc is not None and list(inc.header.keys[:len(keys)]) == keys:
                    blocks = [s.ns.blocks.get(k) for k in keys]
                    blocks = [b for b in blocks if b is not None and b.lease_id == inc.lease.id]
                    lease = core.pin(s, blocks) if len(blocks) == len(keys) else None
                    if inc.bell:
                        core.doorbells.ref(inc.bell)
                        if lease is not None:
                            lease.doorbell = inc.bell  # released with the read lease
                        else:
                            core.doorbells.release(inc.bell)
                    if lease is None:
                        return pb.AwaitTransferResponse(state=pb.TRANSFER_RUNNING, detail="blocks already here; read them after the transfer")
                    return pb.AwaitTransferResponse(state=pb.TRANSFER_RUNNING, lease_id=lease.id,
                                                    offsets=[b.offset for b in blocks], doorbell_offset=inc.bell,
                                                    layers_ready=core.doorbells.layers(inc.bell) if inc.bell else 0)
                done = [s.ns.blocks.get(k) for k in keys]
                if keys and all(b is not None and b.state is BlockState.COMMITTED and b.tier is TierKind.DRAM for b in done):
                    lease = core.pin(s, done)
                    return pb.AwaitTransferResponse(state=pb.TRANSFER_DONE, lease_id=lease.id, offsets=[b.offset for b in done],
                                                    layers_ready=s.ns.ns.layout.num_layers, detail="already here")
                left = deadline - time.monotonic()
                if left <= 0 or not wanted():
                    return pb.AwaitTransferResponse(state=pb.TRANSFER_UNKNOWN, detail="no transfer of these blocks has started")
                self.arrived.wait(min(left, 0.05))


