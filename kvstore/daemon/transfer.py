"""Daemon-to-daemon transfer: the Transfer and AwaitTransfer RPCs over :mod:`kvstore.transport`.

Sending: the blocks' DRAM slots are marked busy (neither evicted nor deleted) and shipped layer
by layer. Committed blocks go at once; a pipelined transfer follows a write lease's doorbell,
shipping layer ``l`` of every block as soon as the prefill worker has announced it, while the
worker computes layer ``l + 1``.

Receiving (:class:`DaemonSink`): a transfer reserves DRAM slots for every block, all or nothing,
with the namespace described in the transfer's metadata; chunks land straight in the slots; the
doorbell counts complete layers for a decode worker that called AwaitTransfer; success commits
the blocks, anything else frees every slot (a pinned one when its reader lets go).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from array import array
from dataclasses import dataclass, field

from kvstore import doorbell
from kvstore.config import TransportConfig
from kvstore.daemon.core import Core, Lease, LeaseKind, Session
from kvstore.errors import Code, KVError
from kvstore.daemon.index import BlockState
from kvstore.keys import Namespace
from kvstore.daemon.metrics import Metrics
from kvstore.policy import LoadPolicy
from kvstore.tiers.base import TierKind
from kvstore.transport import (Listener, Sender, TransferConfig, TransferError, TransferHeader,
                               TransferStatus, parse_peer)
from kvstore.transport.sink import LayerProgress
from kvstore.v1 import kvstore_pb2 as pb

log = logging.getLogger("kvstore.daemon.transfer")


def _ns_meta(ns: Namespace) -> bytes:
    return json.dumps(ns.to_dict()).encode()


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

    def __init__(self, svc: "TransferService") -> None:
        self.svc = svc
        self.core: Core = svc.core

    def begin(self, h: TransferHeader) -> "_Target":
        try:
            ns = Namespace.from_dict(json.loads(h.meta))
        except ValueError as e:  # not JSON (UnicodeDecodeError and JSONDecodeError are ValueErrors), or not a namespace
            raise TransferError(TransferStatus.PROTOCOL_ERROR, f"transfer metadata: not a namespace: {e}") from None
        lay = ns.layout
        if h.chunk_bytes != lay.layer_chunk_bytes or h.n_layers != lay.num_layers:
            raise TransferError(TransferStatus.PROTOCOL_ERROR,
                                f"chunks of {h.chunk_bytes} bytes x {h.n_layers} layers do not match the layout")
        core = self.core
        with core.lock:
            st = core.ns_state(ns)
            s = core.own_session(st)
            try:
                lease, offsets, states = core.reserve(s, b"".join(h.keys), b"")
            except KVError as e:
                raise TransferError(TransferStatus.REFUSED, e.message) from None
            scratch = []
            for i, state in enumerate(states):
                if state != pb.SLOT_RESERVED:  # already here (or arriving): receive into a scratch slot
                    off = core.allocate_slot(st)
                    if off is None:
                        for o in scratch:
                            core.dram.free(st.id, o)
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
        return _Target(self, inc)


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
            for off in inc.scratch:
                core.dram.free(s.ns.id, off)
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

    def _count(self, status: TransferStatus) -> None:
        inc, svc = self.inc, self.sink.svc
        m = svc.metrics
        if inc.ok:
            m.transfer_chunks.labels(direction="recv", backend=svc.backend).inc(inc.progress.n_blocks * inc.header.n_layers)
            m.transfer_bytes.labels(direction="recv", backend=svc.backend).inc(inc.header.total_bytes)
        else:
            m.transfer_failures.labels(reason=_reason(status)).inc()


def _reason(status: TransferStatus) -> str:
    return {TransferStatus.CHECKSUM_MISMATCH: "checksum", TransferStatus.DEADLINE_EXCEEDED: "timeout",
            TransferStatus.PEER_LOST: "peer"}.get(status, "other")


class TransferService:
    """The daemon's transfer listener (receiving: :class:`DaemonSink`) and its sender.
    ``sender_cls``: what sends the daemon's transfers (a test passes a subclass of
    :class:`Sender` that injects faults)."""

    def __init__(self, core: Core, t: TransportConfig, *, metrics: Metrics, policy: LoadPolicy,
                 sender_cls: type[Sender] = Sender) -> None:
        self.core = core
        self.metrics = metrics
        self.policy = policy
        host, port = parse_peer(t.listen)
        self.backend = t.backend
        self.config = TransferConfig(backend=t.backend, host=host, port=port, default_deadline_s=t.timeout_s,
                                     ucx_progress=t.ucx_progress, verify_threads=t.verify_threads,
                                     verify_min_bytes=t.verify_min_bytes)
        self.incoming: dict[tuple[bytes, bytes], Incoming] = {}
        self.arrived = threading.Condition(self.core.lock)
        self.listener = Listener(self.config, DaemonSink(self))
        self.sender = sender_cls(self.config)

    def start(self) -> str:
        host, port = self.listener.start()
        if self.backend == "ucx":
            log.info("transfer listener (ucx, %s progress, %d verify threads for payloads >= %d bytes) on %s:%d",
                     self.config.ucx_progress.value, self.config.resolved_verify_threads(),
                     self.config.verify_min_bytes, host, port)
        else:
            log.info("transfer listener (%s) on %s:%d", self.backend, host, port)
        return f"{host}:{port}"

    def stop(self, grace_s: float) -> None:
        self.listener.stop(min(grace_s, 5.0))
        self.sender.close()

    # --- sending ----------------------------------------------------------------------------
    def transfer(self, s: Session, keys: list[bytes], peer: str, deadline_s: float, pipelined: bool,
                 lease_id: int) -> tuple[int, int, float]:
        try:
            parse_peer(peer)
        except ValueError as e:
            raise KVError(Code.INVALID_ARGUMENT, str(e)) from None
        core, st = self.core, s.ns
        deadline_s = deadline_s or self.config.default_deadline_s
        bell = 0
        with core.lock:
            if pipelined and lease_id not in core.leases and all(
                    (b := st.blocks.get(k)) is not None and b.state is BlockState.COMMITTED for k in keys):
                # The writer committed before this request got here (a short prefill, a busy
                # server): every layer is in, so ship the committed blocks.
                pipelined = False
            if pipelined:
                lease = core.lease(s, lease_id, LeaseKind.WRITE)
                if not lease.doorbell:
                    raise KVError(Code.FAILED_PRECONDITION, f"lease {lease_id}: has no doorbell; Reserve with doorbell=true")
                by_key = {b.key: b for b in lease.blocks}
                missing = [k for k in keys if k not in by_key]
                if missing:
                    raise KVError(Code.FAILED_PRECONDITION, f"key {missing[0].hex()[:16]}...: not reserved under lease {lease_id}")
                blocks = [by_key[k] for k in keys]
                bell = lease.doorbell
                core.doorbells.ref(bell)
            else:
                blocks = []
                for i, k in enumerate(keys):
                    b = st.blocks.get(k)
                    if b is None or b.state is not BlockState.COMMITTED:
                        raise KVError(Code.NOT_FOUND, f"key {i} ({k.hex()[:16]}...): no committed block to transfer")
                    if b.tier is not TierKind.DRAM:
                        raise KVError(Code.FAILED_PRECONDITION, f"key {i}: on {b.tier.name}; prefetch it into DRAM first")
                    blocks.append(b)
            busy = [b for b in blocks if not b.busy]
            for b in busy:
                b.busy = True
        lay = st.ns.layout
        chunk = lay.layer_chunk_bytes
        buf = core.dram.arena.buf
        # Committed blocks keep the digests their first transfer computed; the others are hashed
        # now (pipelined blocks are still being written, so theirs are not kept).
        fresh: dict[int, array] = {}
        t0 = time.monotonic()
        try:
            tx = self.sender.open(peer, keys, lay.num_layers, chunk, deadline_s=deadline_s, meta=_ns_meta(st.ns))
            try:
                if bell:  # layer-pipelined: layer l of every block as soon as the worker rings for it
                    for layer in range(lay.num_layers):
                        self._wait_bell(bell, layer + 1, tx.deadline, lease_id)
                        tx.send_layer(layer, [buf[b.offset + layer * chunk: b.offset + (layer + 1) * chunk]
                                              for b in blocks])
                else:  # committed: a block's layers lie back to back in its slot; runs of them
                    k = run_layers(chunk, lay.num_layers)
                    for i, b in enumerate(blocks):
                        sums = []
                        for first in range(0, lay.num_layers, k):
                            n = min(k, lay.num_layers - first)
                            view = buf[b.offset + first * chunk: b.offset + (first + n) * chunk]
                            sums += tx.send_run(i, first, view, None if b.digests is None else b.digests[first:first + n])
                        if b.digests is None:
                            fresh[i] = array("Q", sums)
                result = tx.finish()
            except BaseException:
                tx.abort("sender gave up")
                raise
        except TransferError as e:
            self.metrics.transfer_failures.labels(reason=_reason(e.status)).inc()
            # the transport's table (docs/transport.md): DATA_LOSS for a corrupted chunk, etc.
            raise KVError(Code(e.status.grpc_code), f"transfer to {peer}: {e}") from None
        finally:
            with core.lock:
                for b in busy:
                    b.busy = False
                if bell:
                    core.doorbells.release(bell)
        with core.lock:  # the receiver verified every chunk against these
            for i, sums in fresh.items():
                blocks[i].keep_digests(sums)
        secs = time.monotonic() - t0
        m = self.metrics
        m.transfer_bytes.labels(direction="send", backend=self.backend).inc(result.bytes)
        m.transfer_chunks.labels(direction="send", backend=self.backend).inc(result.chunks)
        m.transfer_latency.labels(backend=self.backend).observe(secs)
        self.policy.observe(f"peer:{peer}", result.bytes, secs)
        return len(blocks), result.bytes, secs

    def _wait_bell(self, bell: int, layers: int, deadline: float, lease_id: int) -> None:
        """Poll the worker's doorbell (a shared-memory word) with a bounded backoff."""
        pause = 20e-6
        while self.core.doorbells.layers(bell) < layers:
            if time.monotonic() >= deadline:
                raise TransferError(TransferStatus.DEADLINE_EXCEEDED,
                                    f"the writer announced {self.core.doorbells.layers(bell)} of the layers in time")
            if lease_id not in self.core.leases and self.core.doorbells.layers(bell) < layers:
                raise TransferError(TransferStatus.ABORTED, f"write lease {lease_id} ended before layer {layers - 1} was written")
            time.sleep(pause)
            pause = min(pause * 2, 2e-4)

    # --- receiving --------------------------------------------------------------------------
    def await_transfer(self, s: Session, keys: list[bytes], wait_s: float):
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
                if left <= 0:
                    return pb.AwaitTransferResponse(state=pb.TRANSFER_UNKNOWN, detail="no transfer of these blocks has started")
                self.arrived.wait(left)


RUN_BYTES = 4 << 20  # a committed block travels in messages of about this size


def run_layers(chunk_bytes: int, n_layers: int) -> int:
    """Layers per message when a committed block is sent: small layer chunks go together (one
    UCX message costs ~10 us of Python on each side, a 64 KiB chunk ~10 us of wire), up to
    ``RUN_BYTES``, beyond which the receiver would verify a message only long after its first
    bytes landed (cold, and not overlapped with the next message)."""
    return max(1, min(n_layers, RUN_BYTES // chunk_bytes))

