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

import logging
import threading
import time

from .auth import AuthError, Peer
from .config import TransferConfig
from .protocol import (BEGIN_ENCODED, DECODES, MAX_RUN_LAYERS, Frame, FrameType, ProtocolError, TransferError,
                       TransferHeader, TransferStatus, checksum, layer_digests, payload_digests, run_checksum,
                       status_frame, unpack_digests)
from .sink import Sink, Target

log = logging.getLogger("kvstore.transport")

Reply = tuple[Frame, bytes]


class _Quiet:
    """Log lines of refusals, per reason, as a token bucket (``burst`` at once, then ``rate`` a
    second), each line saying how many were left out before it: a flood of bad connections must
    not become a flood of log lines, while a few refusals are each logged (all are counted)."""

    def __init__(self, burst: int = 20, rate: float = 2.0) -> None:
        self.burst, self.rate = burst, rate
        self._lock = threading.Lock()
        self._state: dict[str, list] = {}  # reason -> [tokens, when, left out since the last line]

    def allow(self, reason: str) -> tuple[bool, int]:
        now = time.monotonic()
        with self._lock:
            st = self._state.setdefault(reason, [float(self.burst), now, 0])
            st[0] = min(float(self.burst), st[0] + (now - st[1]) * self.rate)
            st[1] = now
            if st[0] < 1:
                st[2] += 1
                return False, 0
            st[0] -= 1
            skipped, st[2] = st[2], 0
            return True, skipped


_quiet = _Quiet()


def refused(sink: Sink, address: str, err: AuthError) -> None:
    """A peer failed the handshake: log it (the reason, never a credential; rate-limited per
    reason) and tell the sink, which counts it. Nothing of a transfer was accepted from it."""
    ok, skipped = _quiet.allow(err.reason)
    if ok:
        log.warning("transfer listener refused %s: %s (%s)%s", address, err.detail, err.reason,
                    f"; {skipped} more refused for {err.reason} since the last such line" if skipped else "")
    report = getattr(sink, "peer_refused", None)
    if report is not None:
        try:
            report(address, err.reason, err.detail)
        except Exception:
            log.exception("sink.peer_refused failed")


class _Active:
    __slots__ = ("header", "target", "deadline", "seen", "count", "digests", "bounce", "encoded", "raw")

    def __init__(self, header: TransferHeader, target: Target, deadline: float, encoded: bool = False) -> None:
        self.header = header
        self.target = target
        self.deadline = deadline
        self.seen = bytearray(header.n_chunks)
        self.count = 0
        self.digests = getattr(target, "digests", None)  # optional: verified xxh3 per chunk index
        self.bounce: dict[tuple[int, int], bytearray] = {}  # runs the target cannot take in one piece
        self.encoded = encoded  # encoded chunks were agreed at BEGIN
        self.raw: dict[tuple[int, int], memoryview] = {}  # an encoded chunk's destination, until decoded


class InboundSession:
    """Protocol state machine of the receiving end of one connection. Times are monotonic seconds.
    ``decodes``: the backend takes encoded chunks (TCP, with ``config.decode``): they are
    received into a buffer of their own, decoded into the destination, then hashed
    (:meth:`chunk_landed`)."""

    def __init__(self, config: TransferConfig, sink: Sink, peer: str, clock=time.monotonic,
                 decodes: bool = False) -> None:
        self.config = config
        self.decodes = decodes and config.decode is not None
        self.sink = sink
        self.peer = peer
        self.clock = clock
        self.active: _Active | None = None
        self.identity: Peer | None = None  # set once the handshake succeeded

    @property
    def deadline(self) -> float | None:
        """When the running transfer must be over; None between transfers."""
        return self.active.deadline if self.active else None

    def authenticated(self, peer: Peer) -> None:
        """The handshake (run by the backend) proved who the peer is; transfers may begin."""
        self.identity = peer
        self.peer = f"{peer.name or 'unauthenticated peer'} ({peer.address})"

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
        if self.identity is None:
            raise ProtocolError("BEGIN before the handshake", tid)
        try:
            target = self.sink.begin(header, self.identity)
        except TransferError as exc:
            return status_frame(FrameType.REFUSE, tid, exc.status, exc.detail)
        except Exception as exc:
            log.exception("sink.begin failed for transfer %#x", tid)
            return status_frame(FrameType.REFUSE, tid, TransferStatus.SINK_ERROR, f"receiver sink failed: {exc!r}")
        if target is None:
            return status_frame(FrameType.REFUSE, tid, TransferStatus.REFUSED,
                                f"receiver has no room for {header.n_chunks} chunks of {header.chunk_bytes} bytes")
        deadline = self.clock() + min(header.deadline_s, c.max_deadline_s)
        encoded = bool(frame.flags & BEGIN_ENCODED) and self.decodes
        self.active = _Active(header, target, deadline, encoded)
        return Frame(FrameType.ACCEPT, tid, flags=DECODES if encoded else 0), b""

    def _require(self, frame: Frame) -> _Active:
        a = self.active
        if a is None or a.header.transfer_id != frame.transfer_id:
            raise ProtocolError(f"{frame.type.name} for transfer {frame.transfer_id:#x}, which is not running here",
                                frame.transfer_id)
        return a

    # -- chunks ---------------------------------------------------------------------------------

    def chunk_buffer(self, frame: Frame) -> memoryview:
        """Validate a CHUNK header (one layer, or a run of layers of one block) and return where
        its payload must be written (an encoded chunk's: a buffer of its own)."""
        a = self._require(frame)
        h = a.header
        if frame.type is not FrameType.CHUNK:
            raise ProtocolError(f"expected CHUNK, got {frame.type.name}", frame.transfer_id)
        if frame.status:  # encoded: flags say how many layers, length is the payload's
            if not a.encoded or not DECODES & (1 << frame.status if frame.status < 32 else 0):
                raise ProtocolError(f"chunk {frame.seq} encoded with codec {frame.status}, which was not agreed "
                                    f"at BEGIN", h.transfer_id)
            k = frame.flags or 1
            if not 0 < frame.length <= k * h.chunk_bytes:
                raise ProtocolError(f"encoded chunk of {frame.length} bytes for {k} layers of {h.chunk_bytes}",
                                    h.transfer_id)
        else:
            k = frame.length // h.chunk_bytes
        if not frame.status and (frame.length != k * h.chunk_bytes or k == 0):
            raise ProtocolError(f"chunk of {frame.length} bytes: not a whole number of {h.chunk_bytes}-byte "
                                f"layers", h.transfer_id)
        if k > MAX_RUN_LAYERS or frame.flags != (k if k > 1 else 0):
            raise ProtocolError(f"chunk of {k} layers announces {frame.flags} layer digests (runs: 2.."
                                f"{MAX_RUN_LAYERS} layers, each with its digest)", h.transfer_id)
        if not (frame.block < len(h.keys) and frame.layer + k <= h.n_layers):
            raise ProtocolError(f"chunk (block {frame.block}, layers {frame.layer}..{frame.layer + k - 1}) outside "
                                f"the manifest ({len(h.keys)} blocks x {h.n_layers} layers)", h.transfer_id)
        if frame.key != h.keys[frame.block]:
            raise ProtocolError(f"chunk key {frame.key.hex()[:16]}.. is not key {frame.block} of the manifest",
                                h.transfer_id)
        first = frame.block * h.n_layers + frame.layer
        if any(a.seen[first:first + k]):
            raise ProtocolError(f"chunk (block {frame.block}, layer {a.seen.index(1, first) - frame.block * h.n_layers}) "
                                f"sent twice", h.transfer_id)
        # Claimed now, not once verified: a backend that verifies after the next header was
        # read (UCX's pool, its pending queue) must still see a chunk sent twice in a row, or
        # a repeat standing in for a chunk never sent would make END's count come out right.
        a.seen[first:first + k] = b"\x01" * k
        try:
            if k == 1:
                dst = a.target.buffer(frame.block, frame.layer)
            else:  # a run: one piece of the target's memory if it has one, else bounced
                run = getattr(a.target, "run", None)
                dst = run(frame.block, frame.layer, k) if run is not None else None
                if dst is None:
                    dst = a.bounce[(frame.block, frame.layer)] = bytearray(k * h.chunk_bytes)
            mv = memoryview(dst).cast("B")
        except Exception as exc:
            raise TransferError(TransferStatus.SINK_ERROR, f"receiver sink gave no buffer: {exc!r}",
                                h.transfer_id) from exc
        if mv.readonly or mv.nbytes != k * h.chunk_bytes:
            raise TransferError(TransferStatus.SINK_ERROR, f"sink buffer is read-only or {mv.nbytes} bytes, "
                                f"not {k * h.chunk_bytes}", h.transfer_id)
        if frame.status:
            a.raw[(frame.block, frame.layer)] = mv
            return memoryview(bytearray(frame.length))
        return mv

    def run_digests(self, frame: Frame, trailer: bytes) -> list[int] | None:
        """The per-layer digests a run's header carried (None for a single layer), checked
        against the frame's checksum."""
        if not frame.flags:
            return None
        if len(trailer) != 8 * frame.flags:
            raise ProtocolError(f"run of {frame.flags} layers came with {len(trailer)} bytes of digests",
                                frame.transfer_id)
        sent = unpack_digests(trailer)
        if run_checksum(sent) != frame.checksum:
            raise ProtocolError(f"chunk {frame.seq}: its layer digests do not match its checksum", frame.transfer_id)
        return sent

    def landed_digests(self, frame: Frame, mv) -> int | list[int]:
        """What :meth:`chunk_verified` needs for the payload of ``frame`` now in ``mv``: its xxh3,
        or for a run the list of its layers' xxh3s (of an encoded chunk: once decoded into its
        destination; a payload that does not decode is a CHECKSUM_MISMATCH, as corrupt bytes)."""
        a = self._require(frame)
        if not frame.status:
            return payload_digests(frame, mv)
        dst = a.raw.pop((frame.block, frame.layer))
        try:
            self.config.decode(mv, dst)
        except ValueError as e:
            raise TransferError(TransferStatus.CHECKSUM_MISMATCH,
                                f"chunk {frame.seq} (block {frame.block}, layer {frame.layer}, key {frame.key.hex()[:16]}..) "
                                f"arrived encoded and does not decode: {e}; nothing of the transfer was kept",
                                frame.transfer_id) from None
        return checksum(dst) if not frame.flags else layer_digests(dst, a.header.chunk_bytes)

    def chunk_landed(self, frame: Frame, mv: memoryview, sent: list[int] | None = None) -> None:
        """The payload of ``frame`` is in ``mv``: verify its checksum, then report it arrived."""
        self.chunk_verified(frame, self.landed_digests(frame, mv), sent)

    def chunk_verified(self, frame: Frame, got: int | list[int], sent: list[int] | None = None) -> None:
        """Like :meth:`chunk_landed`, with the payload's digest ``got`` computed elsewhere (for a
        run: the list of its per-layer digests, and ``sent``: those its header carried, from
        :meth:`run_digests`). Raises CHECKSUM_MISMATCH, naming the layer, if they differ."""
        a = self._require(frame)
        digests = [got] if isinstance(got, int) else got
        expected = sent if sent is not None else [frame.checksum]
        if len(expected) != len(digests):
            raise ProtocolError(f"chunk {frame.seq}: {len(digests)} layers landed, {len(expected)} announced",
                                frame.transfer_id)
        for j, (d, e) in enumerate(zip(digests, expected)):
            if d != e:
                raise TransferError(TransferStatus.CHECKSUM_MISMATCH,
                                    f"chunk {frame.seq} (block {frame.block}, layer {frame.layer + j}, key "
                                    f"{frame.key.hex()[:16]}..) arrived with xxh3 {d:#018x}, sender computed "
                                    f"{e:#018x}; nothing of the transfer was kept", frame.transfer_id)
        bounce = a.bounce.pop((frame.block, frame.layer), None) if a.bounce else None
        n = a.header.n_layers
        try:
            for j, d in enumerate(digests):
                layer = frame.layer + j
                i = frame.block * n + layer
                if bounce is not None:
                    c = a.header.chunk_bytes
                    memoryview(a.target.buffer(frame.block, layer)).cast("B")[:] = bounce[j * c:(j + 1) * c]
                a.count += 1
                if a.digests is not None:
                    a.digests[i] = d
                a.target.arrived(frame.block, layer)
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
