"""Transfers to other daemons: the Transfer RPC, over :mod:`kvstore.transport`'s Sender.

The blocks' DRAM slots are marked busy (neither evicted nor deleted) and shipped layer by layer.
Committed blocks go at once, a block's layers in runs (:func:`run_layers`); a pipelined transfer
follows a write lease's doorbell, shipping layer ``l`` of every block as soon as the prefill
worker has announced it, while the worker computes layer ``l + 1``. Receiving is
:mod:`kvstore.daemon.inbound`.
"""

from __future__ import annotations

import time
from array import array
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

from kvstore.codec import ChunkEncoder, decode_buffer, fast_codec
from kvstore.config import TransportConfig
from kvstore.daemon import transfer_meta
from kvstore.daemon.core import Core, Session
from kvstore.daemon.index import BlockState
from kvstore.daemon.leases import LeaseKind
from kvstore.daemon.metrics import Metrics
from kvstore.errors import Code, KVError
from kvstore.policy import LoadPolicy
from kvstore.tier_kind import TierKind
from kvstore.transport import Sender, TransferConfig, TransferError, TransferStatus, parse_peer
from kvstore.transport.auth import TlsFiles, default_node_name, read_secret
from kvstore.transport.protocol import layer_digests, meta_limit


def wire_config(t: TransportConfig) -> TransferConfig:
    """The transport's settings from the ``[transport]`` section, with the secret read from
    ``secret_file`` (ValueError, naming the key, if that file is not private to this user)."""
    host, port = parse_peer(t.listen)
    tls = TlsFiles(t.tls_cert_file, t.tls_key_file, t.tls_ca_file) if t.tls_cert_file else None
    return TransferConfig(backend=t.backend, host=host, port=port, default_deadline_s=t.timeout_s,
                          ucx_progress=t.ucx_progress, verify_threads=t.verify_threads,
                          verify_min_bytes=t.verify_min_bytes, ucx_fused_verify=t.ucx_fused_verify,
                          secret=read_secret(t.secret_file) if t.secret_file else b"",
                          node_name=t.node_name or default_node_name(), tls=tls, decode=decode_buffer)


def failure_reason(status: TransferStatus) -> str:
    """The ``reason`` label of kvstore_transfer_failures_total."""
    return {TransferStatus.CHECKSUM_MISMATCH: "checksum", TransferStatus.DEADLINE_EXCEEDED: "timeout",
            TransferStatus.PEER_LOST: "peer", TransferStatus.UNAUTHENTICATED: "auth",
            TransferStatus.FORBIDDEN: "forbidden"}.get(status, "other")


class Outbound:
    """Ships blocks to a peer daemon's listener. ``sender_cls``: what sends (a test passes a
    subclass of :class:`Sender` that injects faults)."""

    def __init__(self, core: Core, t: TransportConfig, wire: TransferConfig, *, metrics: Metrics, policy: LoadPolicy,
                 sender_cls: type[Sender] = Sender) -> None:
        self.core = core
        self.metrics = metrics
        self.policy = policy
        self.backend = t.backend
        self.cfg = t  # SIGHUP may change timeout_s, the default deadline
        self.config = wire  # wire_config(t), read once at start
        self.sender = sender_cls(self.config)
        # Transfers whose chunks are encoded run their sending loop here, not on the Transfer
        # RPC's gRPC thread (which waits for it, at most until the transfer's deadline).
        self._encoding = ThreadPoolExecutor(max_workers=ENCODING_THREADS, thread_name_prefix="kvt-encode")
        self._raw_rate: dict[str, float] = {}  # peer -> bytes/s of its last raw transfer: the link itself
        self._encoded_since: dict[str, int] = {}  # peer -> encoded transfers since that one

    def stop(self) -> None:
        self.sender.close()
        self._encoding.shutdown(wait=False)

    def encoder(self, peer: str, dtype) -> ChunkEncoder | None:
        """How chunks of ``dtype`` go to ``peer``: encoded (transport.compress on, or auto and
        the link slower than compress_below_bytes_per_s), or raw (None). auto judges the link by
        its last raw transfer (before any: the policy's estimate of the peer): an encoded one is
        bounded by the encoding, not the link. Every ``PROBE_EVERY``-th goes raw again, to see
        whether the link got faster."""
        mode = self.cfg.compress
        codec = fast_codec(dtype) if mode != "off" and self.backend == "tcp" else None
        if codec is None:
            return None
        if mode == "auto":
            rate = self._raw_rate.get(peer) or self.policy.bandwidth.estimate(f"peer:{peer}").bytes_per_s
            if rate >= self.cfg.compress_below_bytes_per_s or self._encoded_since.get(peer, 0) >= PROBE_EVERY - 1:
                return None
        return ChunkEncoder(codec, dtype)

    def _measured(self, peer: str, encoded: bool, nbytes: int, secs: float) -> None:
        if encoded:
            self._encoded_since[peer] = self._encoded_since.get(peer, 0) + 1
        else:
            self._raw_rate[peer], self._encoded_since[peer] = nbytes / max(secs, 1e-9), 0

    def committed(self, blocks: list) -> None:
        """Hash the layer chunks of blocks just committed, once, and keep the digests on the
        block: every transfer of it then sends them instead of hashing on its send path, the
        NVMe tier writes them as given (so this runs before a durable commit's write-through),
        and the receiver still checks them, so DRAM that changes afterwards fails the transfer
        with DATA_LOSS rather than being shipped under a fresh hash. On the Commit RPC's
        thread, outside the core lock (xxh3 releases the GIL; up to ~0.5 ms per 2 MiB block on
        a loaded 2-core VM); the blocks are busy meanwhile, so neither eviction nor demotion
        reuses their slots."""
        core, res = self.core, self.core.residency
        with core.lock:  # the filter and the hold in one step: a block must not move in between
            held = res.prepare_read(b for b in blocks if b.digests is None and not b.busy and b.tier is TierKind.DRAM
                                    and b.state is BlockState.COMMITTED)
            work = [(core.dram.view(m.block.offset, core.namespaces[m.ns_id].block_bytes),
                     core.namespaces[m.ns_id].ns.layout.layer_chunk_bytes) for m in held]
        sums: dict[int, array] = {}
        try:
            for m, (view, chunk) in zip(held, work):
                sums[id(m.block)] = array("Q", layer_digests(view, chunk))
        finally:
            res.complete_read(held, sums)

    def transfer(self, s: Session, keys: list[bytes], peer: str, deadline_s: float, pipelined: bool,
                 lease_id: int, *, layer_major: bool = False) -> tuple[int, int, float]:
        """Ship ``keys`` to ``peer``: pipelined (each layer as the writer of ``lease_id`` rings
        for it), or committed blocks, block by block in runs of layers, or, with
        ``layer_major``, layer 0 of every block, then layer 1... (a pull into a worker that
        follows the receiver's doorbell). Returns (blocks, bytes, seconds)."""
        try:
            parse_peer(peer)
        except ValueError as e:
            raise KVError(Code.INVALID_ARGUMENT, str(e)) from None
        core, st = self.core, s.ns
        deadline_s = deadline_s or self.cfg.timeout_s
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
            held = core.residency.prepare_read(blocks)
        lay = st.ns.layout
        chunk = lay.layer_chunk_bytes
        buf = core.dram.arena.buf
        # Committed blocks carry the digests taken at their commit (``committed``), on arrival
        # or by the NVMe tier; any without are hashed now, and pipelined blocks (still being
        # written) always are, without keeping theirs.
        fresh: dict[int, array] = {}
        t0 = time.monotonic()
        try:
            # the namespace, and the blocks' token ids where they fit the header
            meta = transfer_meta.encode(st.ns, blocks, meta_limit(self.config.max_meta_bytes, len(blocks)))
            tx = self.sender.open(peer, keys, lay.num_layers, chunk, deadline_s=deadline_s, meta=meta,
                                  encoder=self.encoder(peer, lay.dtype))

            def ship():
                if bell:  # layer-pipelined: layer l of every block as soon as the worker rings for it
                    for layer in range(lay.num_layers):
                        self._wait_bell(bell, layer + 1, tx.deadline, lease_id)
                        tx.send_layer(layer, [buf[b.offset + layer * chunk: b.offset + (layer + 1) * chunk]
                                              for b in blocks])
                elif layer_major:  # the receiver's doorbell counts layer l once every block has it
                    for layer in range(lay.num_layers):
                        tx.send_layer(layer, [buf[b.offset + layer * chunk: b.offset + (layer + 1) * chunk]
                                              for b in blocks],
                                      [None if b.digests is None else b.digests[layer] for b in blocks])
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
                return tx.finish()
            try:
                if tx.codec is None:
                    result = ship()
                else:
                    try:
                        result = self._encoding.submit(ship).result(max(0.0, tx.deadline - time.monotonic()) + 1.0)
                    except FutureTimeout:
                        raise TransferError(TransferStatus.DEADLINE_EXCEEDED,
                                            "the encoded transfer did not finish by its deadline") from None
            except BaseException:
                tx.abort("sender gave up")
                raise
        except TransferError as e:
            self.metrics.transfer_failures.labels(reason=failure_reason(e.status)).inc()
            # the transport's table (docs/transport.md): DATA_LOSS for a corrupted chunk, etc.
            raise KVError(Code(e.status.grpc_code), f"transfer to {peer}: {e}") from None
        finally:
            core.residency.complete_read(held)
            if bell:
                with core.lock:
                    core.doorbells.release(bell)
        with core.lock:  # the receiver verified every chunk against these
            for i, sums in fresh.items():
                blocks[i].keep_digests(sums)
        secs = time.monotonic() - t0
        m = self.metrics
        m.transfer_bytes.labels(direction="send", backend=self.backend).inc(result.bytes)
        m.transfer_wire_bytes.labels(direction="send", backend=self.backend).inc(result.wire_bytes)
        m.transfer_chunks.labels(direction="send", backend=self.backend).inc(result.chunks)
        m.transfer_latency.labels(backend=self.backend).observe(secs)
        self.policy.observe(f"peer:{peer}", result.bytes, secs)
        self._measured(peer, tx.codec is not None, result.bytes, secs)
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


RUN_BYTES = 4 << 20  # a committed block travels in messages of about this size
ENCODING_THREADS = 16  # encoded transfers at once (a pipelined one waits for its writer on one)
PROBE_EVERY = 16  # compress auto: every 16th transfer to a peer goes raw, measuring the link again


def run_layers(chunk_bytes: int, n_layers: int) -> int:
    """Layers per message when a committed block is sent: small layer chunks go together (one
    UCX message costs ~10 us of Python on each side, a 64 KiB chunk ~10 us of wire), up to
    ``RUN_BYTES``, beyond which the receiver would verify a message only long after its first
    bytes landed (cold, and not overlapped with the next message)."""
    return max(1, min(n_layers, RUN_BYTES // chunk_bytes))

