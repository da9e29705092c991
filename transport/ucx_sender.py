"""UCX backend, sending side: connecting to a peer's listener and streaming chunks.

Chunk payloads are posted as tagged sends without waiting for earlier ones to complete, up to
``config.max_inflight_bytes`` in flight (UCX completes a rendezvous send only when the receiver
has pulled its bytes, so the window bounds what the receiver must absorb at once).
"""

from __future__ import annotations

import collections
import logging
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout

import numpy as np

from .config import TransferConfig, format_peer
from .protocol import (BATCH_BYTES, FRAME_BYTES, MAX_BATCH, Frame, FrameType, ProtocolError, TransferError,
                       TransferStatus, pack_batch, parse_status)
from .auth import AuthError, ClientHandshake, refusal
from .ucx import _REPLY_MAX, _Conn, _req_error, data_tag, hello_buf
from .ucx_env import Engine

log = logging.getLogger("kvstore.transport")
# A receiver that fails a transfer sends its ERROR frame and closes; UCX may report the reset of
# that close before the frame it already delivered. A lost connection waits this long (seconds)
# for the frame before the caller hears PEER_LOST, so it hears the receiver's reason.
LOST_GRACE_S = 0.25


class UcxChannel(_Conn):
    """Client end of one UCX connection (see :class:`~kvstore.transport.sender.Channel`)."""

    def __init__(self, connector: "UcxConnector", ep, peer: str) -> None:
        super().__init__(connector.engine, ep, peer, _REPLY_MAX)
        self.connector = connector
        self.err: TransferError | None = None
        self.queue: collections.deque = collections.deque()
        self.inflight_bytes = 0
        self.max_inflight = connector.config.max_inflight_bytes
        self.waiting: Future | None = None
        self.deadline: float | None = None
        self.lost_at: float | None = None  # when the connection was lost (LOST_GRACE_S)
        self.pump_deferred = False  # a _pump is scheduled after the engine's pending calls

    # -- any thread -----------------------------------------------------------------------------

    def post_chunk(self, frame: Frame, wire, trailer: bytes = b"") -> None:
        self.engine.call_soon(self._enqueue, ("chunk", frame, trailer, wire))

    def abort(self, frame: Frame, data: bytes) -> None:
        def run() -> None:
            self.queue.clear()  # queued chunks no longer matter
            if self.err is None and not self.closed:
                req = self.send_ctrl(frame, data)
                self.engine.progress_until(lambda: req.completed, 0.5)
            self._close()
        if not self.closed:
            self.engine.call(run, timeout_s=10.0)

    def call(self, frame: Frame, data: bytes, deadline: float) -> tuple[Frame, bytes]:
        fut: Future = Future()
        self.engine.call_soon(self._enqueue, ("call", frame, data, fut))
        try:
            return fut.result(timeout=max(0.0, deadline - time.monotonic()) + 0.5)
        except FutureTimeout:
            raise TransferError(TransferStatus.DEADLINE_EXCEEDED, f"no answer from {self.peer} in time") from None

    def error(self) -> TransferError | None:
        return None if self._in_grace() else self.err

    def _in_grace(self) -> bool:
        """Lost with no reason yet, and the receiver's ERROR frame may still arrive."""
        err, at = self.err, self.lost_at
        return (err is not None and err.status is TransferStatus.PEER_LOST and at is not None and not self.closed
                and time.monotonic() - at < LOST_GRACE_S)

    def alive(self) -> bool:
        if self.err is not None or self.closed:
            return False
        try:
            return bool(self.engine.call(lambda: self.ep.alive and self.err is None, timeout_s=2.0))
        except Exception:
            return False

    def set_deadline(self, deadline: float | None) -> None:
        self.deadline = deadline  # set at open, cleared when the transfer is over
        self.engine.call_soon(self.connector.refresh_open)  # before the next tick: see refresh_open

    def close(self) -> None:
        if not self.closed:
            self.engine.call(self._close, timeout_s=10.0)

    # -- engine thread --------------------------------------------------------------------------

    def _close(self) -> None:
        if not self.closed:
            self.teardown()  # returns once UCX no longer reads any caller buffer
            self.lost(TransferError(TransferStatus.ABORTED, "connection closed"))
            self.connector.channels.discard(self)

    def _enqueue(self, item) -> None:
        if self.err is not None or self.closed:
            fut = item[3] if item[0] == "call" else None
            if fut is not None and not fut.done():
                if self._in_grace() and self.waiting is None:
                    self.waiting = fut  # answered by the receiver's reason, or PEER_LOST at the grace's end
                    return
                fut.set_exception(self.err or TransferError(TransferStatus.ABORTED, "connection closed"))
            return
        self.queue.append(item)
        if not self.pump_deferred:  # pump once the calls queued with this one are in: one batch
            self.pump_deferred = True
            self.engine.defer(self._deferred_pump)

    def _deferred_pump(self) -> None:
        self.pump_deferred = False
        self._pump()

    def _pump(self) -> None:
        while self.queue and self.err is None:
            kind, frame, data, extra = self.queue[0]
            if kind == "chunk":
                if not self._send_chunks():
                    return  # resumed by the completion of an earlier payload
            else:
                self.queue.popleft()
                if kind == "call":
                    self.waiting = extra
                self.send_ctrl(frame, data)

    def _send_chunks(self) -> int:
        """Send the queued chunks at the head of the queue that fit the in-flight window (at
        most MAX_BATCH, BATCH_BYTES of headers): their headers (each with a run's digests) in one
        control message, then each payload. Each queued frame carries the checksum of its
        source; its wire bytes are what goes out."""
        batch, size = [], 0
        while self.queue and self.queue[0][0] == "chunk" and len(batch) < MAX_BATCH:
            _, frame, trailer, wire = self.queue[0]
            if self.inflight_bytes and self.inflight_bytes + frame.length > self.max_inflight:
                break
            if batch and size + FRAME_BYTES + len(trailer) > BATCH_BYTES:
                break
            self.queue.popleft()
            self.inflight_bytes += frame.length
            size += FRAME_BYTES + len(trailer)
            batch.append((frame, trailer, wire))
        if len(batch) == 1:
            self.send_ctrl(batch[0][0], batch[0][1])
        elif batch:
            headers = pack_batch((frame, trailer) for frame, trailer, _ in batch)
            self.send_ctrl(Frame(FrameType.BATCH, batch[0][0].transfer_id, length=len(headers)), headers)
        for frame, _, wire in batch:
            req = self.ep.tag_send(self.engine.Array(wire), data_tag(self.api, self.peer_rx, frame.seq))
            n = frame.length
            self.track(req, lambda r, n=n, _keep=wire: self._on_payload_sent(r, n), ordered=True)
        return len(batch)

    def _on_payload_sent(self, req, n: int) -> None:
        self.inflight_bytes -= n
        err = _req_error(req, self.ep)
        if err is not None:
            return self.lost(err)
        if self.inflight_bytes <= self.max_inflight - self.max_inflight // 4:
            self._pump()  # a quarter of the window free (or more): room for a batch

    def on_frame(self, frame: Frame, data: bytes) -> None:
        fut, self.waiting = self.waiting, None
        if fut is not None:
            fut.set_result((frame, data))
        else:  # unsolicited: the receiver failed the transfer (ERROR) and is closing
            self.lost(parse_status(frame, data) or ProtocolError(f"unexpected {frame.type.name} frame"))

    def lost(self, err: TransferError) -> None:
        # The receiver's own reason (its ERROR frame) wins over the reset of the endpoint it
        # closes just after: UCX may report the reset first, so a caller waiting for an answer
        # hears a bare PEER_LOST only after LOST_GRACE_S without that frame.
        if self.err is None or (self.err.status is TransferStatus.PEER_LOST and err.status is not TransferStatus.PEER_LOST):
            self.err = err
        self.queue.clear()
        if self.err.status is TransferStatus.PEER_LOST and not self.closed:
            if self.lost_at is None:
                self.lost_at = time.monotonic()
            return
        self._fail_waiter()

    def _fail_waiter(self) -> None:
        fut, self.waiting = self.waiting, None
        if fut is not None and not fut.done():
            fut.set_exception(self.err)

    def tick(self, now: float) -> None:
        if self.waiting is not None and self.lost_at is not None and now - self.lost_at >= LOST_GRACE_S:
            self._fail_waiter()
        if self.deadline is not None and now >= self.deadline and self.err is None:
            self.lost(TransferError(TransferStatus.DEADLINE_EXCEEDED, f"transfer to {self.peer} past its deadline"))


class UcxConnector:
    """Opens UCX connections for a :class:`~kvstore.transport.Sender`; owns its engine."""

    def __init__(self, config: TransferConfig) -> None:
        self.config = config
        self.engine = Engine(config, "sender")
        self.channels: set[UcxChannel] = set()
        self.engine.add_ticker(self._tick)

    def _tick(self, now: float) -> None:
        for ch in list(self.channels):
            ch.tick(now)
        self.refresh_open()

    def refresh_open(self) -> None:
        """Whether a transfer is open on a channel (engine thread): at every tick, and at once
        when one opens or ends, since an adaptive engine polls exactly while one is open."""
        self.engine.transfers_open = any(ch.deadline is not None for ch in self.channels)

    def connect(self, host: str, port: int, timeout_s: float) -> UcxChannel:
        peer = format_peer(host, port)
        fut: Future = Future()
        self.engine.call_soon(self._connect, host, port, peer, fut)
        try:
            return fut.result(timeout=max(timeout_s, 1e-3))
        except FutureTimeout:
            ch = getattr(fut, "channel", None)
            if ch is not None:
                ch.close()
            raise TransferError(TransferStatus.CONNECT_FAILED, f"UCX handshake with {peer} timed out "
                                f"after {timeout_s:.3g} s") from None

    def _connect(self, host: str, port: int, peer: str, fut: Future) -> None:
        api = self.engine.api
        try:
            ep = api.UCXEndpoint.create(self.engine.worker, host, port, True)
        except Exception as exc:
            fut.set_exception(TransferError(TransferStatus.CONNECT_FAILED, f"cannot reach {peer}: {exc}"))
            return
        ch = fut.channel = UcxChannel(self, ep, peer)
        self.channels.add(ch)
        hs = ClientHandshake(self.config.secret, self.config.node_name, ch.rx)

        def fail(exc: TransferError) -> None:
            ch._close()
            if not fut.done():
                fut.set_exception(exc)

        def send(msg: bytes) -> None:
            out = hello_buf(msg)
            ch.track(ep.stream_send(self.engine.Array(out)), lambda r, _keep=out: None)

        def recv(step: int) -> None:
            buf = hello_buf()
            ch.track(ep.stream_recv(self.engine.Array(buf)), lambda r: on_reply(r, step, buf))

        def on_reply(req, step: int, buf: np.ndarray) -> None:
            err = _req_error(req, ep)
            try:
                if err is not None:
                    raise TransferError(TransferStatus.CONNECT_FAILED, f"cannot connect to {peer}: {err.detail}")
                if step == 2:
                    send(hs.third(buf.tobytes()))
                    return recv(4)
                hs.done(buf.tobytes())
            except AuthError as exc:
                if not exc.by_peer:  # we refuse the listener: tell it why first
                    out = hello_buf(refusal(3, exc))
                    req = ep.stream_send(self.engine.Array(out))
                    self.engine.progress_until(lambda: req.completed, 0.5)
                return fail(AuthError(f"{peer}: {exc.detail}", exc.reason))
            except TransferError as exc:
                return fail(exc)
            ch.peer_rx = hs.peer_rx
            ch.post_ctrl_recv()
            if not fut.done():
                fut.set_result(ch)
        send(hs.first())
        recv(2)

    def close(self) -> None:
        def shut() -> None:
            for ch in list(self.channels):
                ch._close()
        try:
            self.engine.call(shut)
        finally:
            self.engine.stop()
