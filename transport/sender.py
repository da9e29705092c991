"""Sending side: a :class:`Sender` per daemon holds idle connections per peer; ``open`` starts
one transfer on one connection and returns an :class:`OutboundTransfer` to feed chunks into.

Chunks are queued and put on the wire by the backend's I/O thread in submission order, so the
caller can hand over layer ``l`` as soon as it is committed while earlier layers are still in
flight: that is the whole of layer pipelining on this side. ``send`` hashes the chunk (xxh3
releases the GIL, so this overlaps the wire) and queues it.

Buffers handed to ``send`` must stay alive and unchanged until ``finish`` or ``abort`` returns;
on return (success or failure) the transport no longer reads them.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

from .config import Backend, TransferConfig, parse_peer
from .protocol import (BEGIN_ENCODED, KEY_BYTES, Frame, FrameType, TransferError, TransferHeader, TransferStatus,
                       MAX_RUN_LAYERS, checksum, layer_digests, pack_digests, parse_status, run_checksum,
                       status_frame)

log = logging.getLogger("kvstore.transport")

# Fault injection (the integrity tests): given a CHUNK frame and its payload, return the bytes
# to put on the wire instead. The frame keeps the checksum of the source.
Tamper = Callable[[Frame, memoryview], "bytes | memoryview"]


class Channel(Protocol):
    """One connection to a peer, used by one transfer at a time (backend-specific)."""

    def call(self, frame: Frame, data: bytes, deadline: float) -> tuple[Frame, bytes]:
        """Queue a control frame behind every posted chunk and wait for the peer's next frame."""
    def post_chunk(self, frame: Frame, wire, trailer: bytes = b"") -> None:
        """Queue a CHUNK frame (carrying the checksum of the source), its ``trailer`` (a run's
        layer digests) and put ``wire`` on the wire: the source buffer unless a test tampers with
        it. Returns at once."""
    def abort(self, frame: Frame, data: bytes) -> None:
        """Drop queued chunks, send ``frame`` (ABORT) best-effort within ~0.5 s, then close."""
    def error(self) -> TransferError | None:
        """The failure seen by the I/O side (ERROR frame, lost peer, deadline), if any."""
    def alive(self) -> bool: ...
    def set_deadline(self, deadline: float | None) -> None: ...
    def close(self) -> None:
        """Tear down; on return no posted buffer is read any more."""


class ChunkEncoder(Protocol):
    """What :meth:`Sender.open` encodes chunks with (:class:`kvstore.codec.ChunkEncoder` in a
    daemon): ``codec``, the id encoded chunks carry; a call returns a chunk's (or run's)
    payload, or None to send it raw."""

    codec: int

    def __call__(self, buf: memoryview) -> bytes | None: ...


@dataclass(frozen=True, slots=True)
class TransferResult:
    transfer_id: int
    chunks: int
    bytes: int
    seconds: float  # open() to the receiver's verdict
    wire_bytes: int = -1  # payload bytes sent (encoded chunks at their encoded size); -1: = bytes

    def __post_init__(self) -> None:
        if self.wire_bytes < 0:
            object.__setattr__(self, "wire_bytes", self.bytes)

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


class OutboundTransfer:
    """One running transfer. Not thread-safe: feed it from one thread (the doorbell watcher)."""

    def __init__(self, sender: "Sender", channel: Channel, header: TransferHeader, key: tuple,
                 deadline: float, t_open: float, codec: int | None = None, encoder=None) -> None:
        self._sender, self._channel, self.header, self._pool_key = sender, channel, header, key
        self.deadline = deadline
        self._t_open = t_open
        self.codec, self._encoder = codec, encoder  # chunks are encoded with codec (None: raw)
        self._seq = 0     # CHUNK frames posted (a run is one)
        self._chunks = 0  # layer chunks posted
        self._wire = 0    # payload bytes posted (encoded ones at their encoded size)
        self._sent = bytearray(header.n_chunks)
        self._state = "open"  # -> "done" | "failed"
        self.submit_times: list[float] | None = None  # monotonic per seq, when a benchmark sets a list

    @property
    def transfer_id(self) -> int:
        return self.header.transfer_id

    def send(self, block: int, layer: int, buf, digest: int | None = None) -> None:
        """Queue layer ``layer`` of block ``block`` (``header.chunk_bytes`` bytes, C-contiguous).
        Raises TransferError at once if the transfer has already failed.

        ``digest``: the chunk's xxh3-64 when the caller already holds it (a daemon records each
        layer chunk's digest once, when it first hashes or verifies the block), so the sender
        skips hashing it again. The receiver checks the bytes against it: a digest that does not
        match the bytes fails the transfer with CHECKSUM_MISMATCH and nothing is kept."""
        self._check_open()
        h = self.header
        if not (0 <= block < len(h.keys) and 0 <= layer < h.n_layers):
            raise ValueError(f"chunk (block {block}, layer {layer}) outside {len(h.keys)} x {h.n_layers}")
        if self._sent[block * h.n_layers + layer]:
            raise ValueError(f"chunk (block {block}, layer {layer}) already sent")
        mv = memoryview(buf).cast("B")
        if mv.nbytes != h.chunk_bytes:
            raise ValueError(f"chunk of {mv.nbytes} bytes, transfer declared {h.chunk_bytes}")
        self._check_channel()
        # Hashed here, on the caller's thread, so it overlaps the I/O thread's work on earlier
        # chunks (xxh3 releases the GIL) instead of stalling the wire.
        sums = [checksum(mv) if digest is None else digest]
        if not self._post_encoded(block, layer, mv, sums):
            self._post(Frame(FrameType.CHUNK, h.transfer_id, self._seq, block, layer, mv.nbytes, sums[0],
                             h.keys[block]), mv)

    def send_run(self, block: int, first_layer: int, buf, digests: Sequence[int] | None = None) -> list[int]:
        """Queue layers ``first_layer .. first_layer + k - 1`` of block ``block`` in one message:
        ``buf`` is their ``k * header.chunk_bytes`` contiguous bytes (a daemon's block slot holds
        its layers back to back). ``digests``: the layers' xxh3-64s if known, else hashed here.
        Returns the per-layer digests sent. The receiver verifies each layer on its own, and
        takes the run in one piece where its memory allows (else it copies it into place)."""
        self._check_open()
        h = self.header
        mv = memoryview(buf).cast("B")
        k = mv.nbytes // h.chunk_bytes
        if k == 0 or mv.nbytes != k * h.chunk_bytes:
            raise ValueError(f"run of {mv.nbytes} bytes: not a whole number of {h.chunk_bytes}-byte layers")
        if k > MAX_RUN_LAYERS:
            raise ValueError(f"run of {k} layers: at most {MAX_RUN_LAYERS}")
        if not (0 <= block < len(h.keys) and 0 <= first_layer and first_layer + k <= h.n_layers):
            raise ValueError(f"run (block {block}, layers {first_layer}..{first_layer + k - 1}) outside "
                             f"{len(h.keys)} x {h.n_layers}")
        first = block * h.n_layers + first_layer
        if any(self._sent[first:first + k]):
            raise ValueError(f"run (block {block}, layers {first_layer}..{first_layer + k - 1}) repeats a sent layer")
        if digests is not None and len(digests) != k:
            raise ValueError(f"send_run: {len(digests)} digests for {k} layers")
        self._check_channel()
        sums = list(digests) if digests is not None else layer_digests(mv, h.chunk_bytes)
        if not self._post_encoded(block, first_layer, mv, sums):
            self._post(Frame(FrameType.CHUNK, h.transfer_id, self._seq, block, first_layer, mv.nbytes,
                             run_checksum(sums), h.keys[block], flags=k if k > 1 else 0),
                       mv, pack_digests(sums) if k > 1 else b"")
        return sums

    def _post_encoded(self, block: int, first_layer: int, mv: memoryview, sums: list[int]) -> bool:
        """Post layers ``first_layer..`` of ``block`` (``mv``, their raw bytes, with their
        digests ``sums``) encoded, if the transfer encodes and they shrink; False: post them raw.
        Encoded here, on the caller's thread, like the hashing."""
        if self.codec is None:
            return False
        payload = self._encoder(mv)
        if payload is None:
            return False
        k, h = len(sums), self.header
        self._post(Frame(FrameType.CHUNK, h.transfer_id, self._seq, block, first_layer, len(payload),
                         sums[0] if k == 1 else run_checksum(sums), h.keys[block], status=self.codec,
                         flags=k if k > 1 else 0), memoryview(payload), pack_digests(sums) if k > 1 else b"", k)
        return True

    def _check_channel(self) -> None:
        err = self._channel.error()
        if err is not None:
            self._fail(err)

    def _post(self, frame: Frame, mv: memoryview, trailer: bytes = b"", k: int = 0) -> None:
        """Hand a validated CHUNK (one layer or a run of ``k``; raw: from its length) to the
        channel and mark its layers sent."""
        tamper = self._sender.tamper
        if self.submit_times is not None:
            self.submit_times.append(time.monotonic())
        self._channel.post_chunk(frame, tamper(frame, mv) if tamper else mv, trailer)
        k = k or frame.length // self.header.chunk_bytes
        self._wire += frame.length
        first = frame.block * self.header.n_layers + frame.layer
        self._sent[first:first + k] = b"\x01" * k
        self._seq += 1
        self._chunks += k

    def send_layer(self, layer: int, bufs: Sequence, digests: Sequence | None = None) -> None:
        """Queue layer ``layer`` of every block: ``bufs[b]`` is block ``b``'s chunk, ``digests[b]``
        its xxh3-64 if known (None: hash it here; see :meth:`send`)."""
        if len(bufs) != len(self.header.keys) or (digests is not None and len(digests) != len(bufs)):
            raise ValueError(f"send_layer: {len(bufs)} buffers / {len(digests) if digests is not None else '-'} "
                             f"digests for {len(self.header.keys)} blocks")
        for block, buf in enumerate(bufs):
            self.send(block, layer, buf, None if digests is None else digests[block])

    def finish(self) -> TransferResult:
        """Wait (until the deadline) for the receiver to verify and commit every chunk."""
        self._check_open()
        try:
            frame, data = self._channel.call(Frame(FrameType.END, self.transfer_id, seq=self._chunks), b"",
                                             self.deadline)
        except TransferError as err:
            self._fail(err)
        err = parse_status(frame, data)
        if err is not None or frame.type is not FrameType.RESULT:
            self._fail(err or TransferError(TransferStatus.PROTOCOL_ERROR, f"got {frame.type.name} after END"))
        self._state = "done"
        self._sender._give_back(self._pool_key, self._channel)
        h = self.header
        return TransferResult(h.transfer_id, self._chunks, self._chunks * h.chunk_bytes, time.monotonic() - self._t_open,
                              self._wire)

    def abort(self, reason: str = "aborted by caller") -> None:
        """Give up: the receiver releases everything it reserved. Idempotent."""
        if self._state != "open":
            return
        self._state = "failed"
        self._channel.abort(*status_frame(FrameType.ABORT, self.transfer_id, TransferStatus.ABORTED, reason))

    def __enter__(self) -> "OutboundTransfer":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort(f"sender failed: {exc_type.__name__}")

    def _check_open(self) -> None:
        if self._state != "open":
            raise TransferError(TransferStatus.ABORTED, f"transfer {self.transfer_id:#x} is already {self._state}",
                                self.transfer_id)
        if time.monotonic() >= self.deadline:
            self._fail(TransferError(TransferStatus.DEADLINE_EXCEEDED, "transfer deadline passed on the sender"))

    def _fail(self, err: TransferError):
        """Close the connection, telling the receiver why if it can still hear (ABORT), and raise."""
        self._state = "failed"
        err.transfer_id = self.transfer_id
        self._channel.abort(*status_frame(FrameType.ABORT, self.transfer_id, err.status, f"sender: {err.detail}"))
        raise err


class Sender:
    """Opens transfers to peers ("host:port"), reusing idle connections. Thread-safe.

    ``tamper``: fault injection for the integrity tests, which corrupt chunks on the wire with
    it; None (the default) puts the source bytes on the wire."""

    def __init__(self, config: TransferConfig, *, tamper: Tamper | None = None) -> None:
        self.config = config
        self._idle: dict[tuple[str, int], list[Channel]] = {}
        self._lock = threading.Lock()
        self._closed = False
        self.tamper = tamper
        if config.backend is Backend.UCX:
            from .ucx_sender import UcxConnector
            self._connector = UcxConnector(config)
        else:
            from .tcp import TcpConnector
            self._connector = TcpConnector(config)

    def open(self, peer: str, keys: Sequence[bytes], n_layers: int, chunk_bytes: int, *,
             deadline_s: float | None = None, meta: bytes = b"", transfer_id: int | None = None,
             encoder: "ChunkEncoder | None" = None) -> OutboundTransfer:
        """Start a transfer of ``len(keys) * n_layers`` chunks of ``chunk_bytes`` to ``peer``.

        ``encoder``: sends chunks encoded where the receiver decodes its ``codec`` (TCP; UCX
        links carry raw chunks) and they shrink; the transfer's ``codec`` says what was agreed.

        Blocks until the receiver accepted (it has reserved room for every chunk). Raises
        TransferError: REFUSED, CONNECT_FAILED, PEER_LOST, DEADLINE_EXCEEDED, PROTOCOL_ERROR.
        """
        if self._closed:
            raise TransferError(TransferStatus.SHUTDOWN, "sender is closed")
        keys = tuple(bytes(k) for k in keys)
        if not keys or any(len(k) != KEY_BYTES for k in keys):
            raise ValueError(f"keys: need at least one, each {KEY_BYTES} bytes")
        deadline_s = self.config.default_deadline_s if deadline_s is None else deadline_s
        if deadline_s <= 0:
            raise ValueError(f"deadline_s: must be > 0, got {deadline_s}")
        tid = transfer_id if transfer_id is not None else int.from_bytes(os.urandom(8), "little")
        header = TransferHeader(tid, keys, n_layers, chunk_bytes, deadline_s, bytes(meta))
        t0 = time.monotonic()
        deadline = t0 + deadline_s
        pool_key = parse_peer(peer)
        manifest = header.encode()
        codec = encoder.codec if encoder is not None and self.config.backend is Backend.TCP else None
        for attempt in (0, 1):
            try:
                channel, reused = self._take(pool_key, deadline)
            except TransferError as err:
                err.transfer_id = tid
                raise
            channel.set_deadline(deadline)
            try:
                frame, data = channel.call(Frame(FrameType.BEGIN, tid, length=len(manifest),
                                                 flags=BEGIN_ENCODED if codec is not None else 0), manifest, deadline)
            except TransferError as err:
                channel.close()
                # A pooled connection may predate a restart of the peer: one fresh try.
                if reused and attempt == 0 and err.status is TransferStatus.PEER_LOST:
                    log.info("pooled connection to %s was dead (%s); reconnecting", peer, err.detail)
                    continue
                err.transfer_id = tid
                raise
            err = parse_status(frame, data)
            if err is not None or frame.type is not FrameType.ACCEPT:
                channel.close()
                err = err or TransferError(TransferStatus.PROTOCOL_ERROR, f"got {frame.type.name} after BEGIN")
                err.transfer_id = tid
                raise err
            agreed = codec if codec is not None and frame.flags & (1 << codec) else None
            return OutboundTransfer(self, channel, header, pool_key, deadline, t0, agreed, encoder)
        raise AssertionError("unreachable")

    def _take(self, key: tuple[str, int], deadline: float) -> tuple[Channel, bool]:
        with self._lock:
            idle = self._idle.get(key, [])
            while idle:
                ch = idle.pop()
                if ch.alive():
                    return ch, True
                ch.close()
        timeout = min(self.config.connect_timeout_s, max(0.0, deadline - time.monotonic()))
        return self._connector.connect(key[0], key[1], timeout), False

    def _give_back(self, key: tuple[str, int], channel: Channel) -> None:
        channel.set_deadline(None)
        with self._lock:
            if not self._closed:
                self._idle.setdefault(key, []).append(channel)
                return
        channel.close()

    def close(self) -> None:
        """Close idle connections and the backend; running transfers should be finished first."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, {}
        for chans in idle.values():
            for ch in chans:
                ch.close()
        self._connector.close()

    def __enter__(self) -> "Sender":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

