"""Receiving-side protocol state of one connection, shared by the TCP and UCX listeners.

The backend does the I/O; this class decides. It validates every frame against the manifest
(sizes, ranges, keys, duplicates), asks the sink for destinations, verifies checksums and ends
the transfer exactly once. Any :class:`TransferError` it raises fails the running transfer: the
backend then calls :meth:`fail`, sends the ERROR frame it returns and closes the connection
(closing, rather than draining the rest of a failed transfer, keeps a broken stream from ever
being parsed again; the sender simply opens a new connection).

Not thread-safe: one session belongs to one connection and is driven by one thread.
"""

from __future__ import annotations

import hmac
import logging
import time

from .config import TransferConfig
from .protocol import (Frame, FrameType, ProtocolError, TransferError, TransferHeader, TransferStatus,
                       checksum, status_frame)
from .sink import Sink, Target

log = logging.getLogger("kvstore.transport")

Reply = tuple[Frame, bytes]


class _Active:
    __slots__ = ("header", "target", "deadline", "seen", "count", "digests")

    def __init__(self, header: TransferHeader, target: Target, deadline: float) -> None:
        self.header = header
        self.target = target
        self.deadline = deadline
        self.seen = bytearray(header.n_chunks)
        self.count = 0
        self.digests = getattr(target, "digests", None)  # optional: verified xxh3 per chunk index


class InboundSession:
    """Protocol state machine of the receiving end of one connection. Times are monotonic seconds."""

    def __init__(self, config: TransferConfig, sink: Sink, peer: str, clock=time.monotonic) -> None:
        self.config = config
        self.sink = sink
        self.peer = peer
        self.clock = clock
        self.active: _Active | None = None

    @property
    def deadline(self) -> float | None:
        """When the running transfer must be over; None between transfers."""
        return self.active.deadline if self.active else None

    def check_hello(self, frame: Frame, data: bytes) -> Reply:
        """Validate the peer's HELLO (version is checked by Frame.unpack) and its token."""
        if frame.type is not FrameType.HELLO:
            raise ProtocolError(f"expected HELLO, got {frame.type.name}")
        if not hmac.compare_digest(bytes(data), self.config.auth_token):
            raise ProtocolError("HELLO: wrong auth token")
        return Frame(FrameType.HELLO), b""

    # -- control frames -------------------------------------------------------------------------

    def on_control(self, frame: Frame, data: bytes) -> Reply | None:
        """Handle BEGIN / END / ABORT; returns the reply to send, if any."""
        if frame.type is FrameType.BEGIN:
            return self._begin(frame, data)
        active = self._require(frame)
        if frame.type is FrameType.END:
            n = active.header.n_chunks
            if active.count != n or frame.seq != n:
                raise ProtocolError(f"END after {active.count} of {n} chunks (sender counted {frame.seq})",
                                    frame.transfer_id)
            self.active = None
            try:
                active.target.end(TransferStatus.OK, "")
            except Exception as exc:  # commit failed: the sender must know nothing was stored
                log.exception("sink failed to commit transfer %#x", frame.transfer_id)
                return status_frame(FrameType.RESULT, frame.transfer_id, TransferStatus.SINK_ERROR,
                                    f"receiver could not commit: {exc!r}")
            return status_frame(FrameType.RESULT, frame.transfer_id, TransferStatus.OK)
        if frame.type is FrameType.ABORT:
            self._end(TransferStatus.ABORTED, "sender aborted: " + bytes(data).decode(errors="replace"))
            return None
        raise ProtocolError(f"unexpected {frame.type.name} frame", frame.transfer_id)

    def _begin(self, frame: Frame, data: bytes) -> Reply:
        if self.active is not None:
            raise ProtocolError("BEGIN while another transfer runs on this connection", frame.transfer_id)
        c = self.config
        header = TransferHeader.decode(frame.transfer_id, data, c.max_blocks, c.max_chunk_bytes,
                                       c.max_meta_bytes)
        tid = frame.transfer_id
        try:
            target = self.sink.begin(header)
        except TransferError as exc:
            return status_frame(FrameType.REFUSE, tid, exc.status, exc.detail)
        except Exception as exc:
            log.exception("sink.begin failed for transfer %#x", tid)
            return status_frame(FrameType.REFUSE, tid, TransferStatus.SINK_ERROR, f"receiver sink failed: {exc!r}")
        if target is None:
            return status_frame(FrameType.REFUSE, tid, TransferStatus.REFUSED,
                                f"receiver has no room for {header.n_chunks} chunks of {header.chunk_bytes} bytes")
        deadline = self.clock() + min(header.deadline_s, c.max_deadline_s)
        self.active = _Active(header, target, deadline)
        return Frame(FrameType.ACCEPT, tid), b""

    def _require(self, frame: Frame) -> _Active:
        a = self.active
        if a is None or a.header.transfer_id != frame.transfer_id:
            raise ProtocolError(f"{frame.type.name} for transfer {frame.transfer_id:#x}, which is not running here",
                                frame.transfer_id)
        return a

    # -- chunks ---------------------------------------------------------------------------------

    def chunk_buffer(self, frame: Frame) -> memoryview:
        """Validate a CHUNK header and return where its payload must be written."""
        a = self._require(frame)
        h = a.header
        if frame.type is not FrameType.CHUNK:
            raise ProtocolError(f"expected CHUNK, got {frame.type.name}", frame.transfer_id)
        if not (frame.block < len(h.keys) and frame.layer < h.n_layers):
            raise ProtocolError(f"chunk (block {frame.block}, layer {frame.layer}) outside the manifest "
                                f"({len(h.keys)} blocks x {h.n_layers} layers)", h.transfer_id)
        if frame.length != h.chunk_bytes:
            raise ProtocolError(f"chunk of {frame.length} bytes, manifest says {h.chunk_bytes}", h.transfer_id)
        if frame.key != h.keys[frame.block]:
            raise ProtocolError(f"chunk key {frame.key.hex()[:16]}.. is not key {frame.block} of the manifest",
                                h.transfer_id)
        if a.seen[frame.block * h.n_layers + frame.layer]:
            raise ProtocolError(f"chunk (block {frame.block}, layer {frame.layer}) sent twice", h.transfer_id)
        try:
            mv = memoryview(a.target.buffer(frame.block, frame.layer)).cast("B")
        except Exception as exc:
            raise TransferError(TransferStatus.SINK_ERROR, f"receiver sink gave no buffer: {exc!r}",
                                h.transfer_id) from exc
        if mv.readonly or mv.nbytes != h.chunk_bytes:
            raise TransferError(TransferStatus.SINK_ERROR, f"sink buffer is read-only or {mv.nbytes} bytes, "
                                f"not {h.chunk_bytes}", h.transfer_id)
        return mv

    def chunk_landed(self, frame: Frame, mv: memoryview) -> None:
        """The payload of ``frame`` is in ``mv``: verify its checksum, then report it arrived."""
        self.chunk_verified(frame, checksum(mv))

    def chunk_verified(self, frame: Frame, got: int) -> None:
        """Like :meth:`chunk_landed`, with the payload's checksum ``got`` computed elsewhere
        (off the I/O thread). Raises CHECKSUM_MISMATCH if it differs from the sender's."""
        a = self._require(frame)
        if got != frame.checksum:
            raise TransferError(TransferStatus.CHECKSUM_MISMATCH,
                                f"chunk {frame.seq} (block {frame.block}, layer {frame.layer}, key "
                                f"{frame.key.hex()[:16]}..) arrived with xxh3 {got:#018x}, sender computed "
                                f"{frame.checksum:#018x}; nothing of the transfer was kept", frame.transfer_id)
        i = frame.block * a.header.n_layers + frame.layer
        a.seen[i] = 1
        a.count += 1
        if a.digests is not None:
            a.digests[i] = got
        try:
            a.target.arrived(frame.block, frame.layer)
        except Exception as exc:
            raise TransferError(TransferStatus.SINK_ERROR, f"receiver sink failed on arrival: {exc!r}",
                                frame.transfer_id) from exc

    # -- failure --------------------------------------------------------------------------------

    def fail(self, err: TransferError) -> Reply:
        """End the running transfer (if any) with ``err``; returns the ERROR frame to send (also
        between transfers, so a sender learns why e.g. its BEGIN was malformed).
        The caller must have stopped all writes into the transfer's buffers before calling."""
        a = self.active
        tid = a.header.transfer_id if a is not None else err.transfer_id
        self._end(err.status, err.detail)
        return status_frame(FrameType.ERROR, tid, err.status, err.detail)

    def expire(self) -> TransferError | None:
        """The deadline error if the running transfer is past its deadline."""
        a = self.active
        if a is not None and self.clock() >= a.deadline:
            return TransferError(TransferStatus.DEADLINE_EXCEEDED,
                                 f"transfer from {self.peer} not finished within {a.header.deadline_s:.3g} s "
                                 f"({a.count} of {a.header.n_chunks} chunks arrived)", a.header.transfer_id)
        return None

    def _end(self, status: TransferStatus, detail: str) -> None:
        a, self.active = self.active, None
        if a is None:
            return
        log.info("transfer %#x from %s ended: %s %s", a.header.transfer_id, self.peer, status.name, detail)
        try:
            a.target.end(status, detail)
        except Exception:
            log.exception("sink failed to release transfer %#x", a.header.transfer_id)
