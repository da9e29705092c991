"""UCX backend on ucxx: the same frames as TCP, carried as tagged messages.

Tags are matched per worker, so each side of a connection picks a 32-bit receive prefix ``rx``
(exchanged in a stream-API handshake) and the peer addresses it::

    control frames  tag = rx << 32                   (one posted receive, in order)
    chunk payloads  tag = rx << 32 | 1 << 31 | seq   (received straight into the sink's buffer)

Chunks queued together leave as one BATCH control message carrying up to ``MAX_BATCH`` CHUNK
headers, then their payloads: one control message per batch instead of one per chunk, which is
a UCX request and two completions less per chunk on each side.

The receiver posts a payload's receive when its CHUNK header arrives; large payloads travel by
rendezvous, so the bytes land in the destination slot without a bounce through Python. The
arena is one long-lived mapping, so where UCX registers memory (zero-copy rendezvous on RDMA
transports) its registration cache maps each slot once, not per message.
"""

from __future__ import annotations

import collections
import logging
import time

import numpy as np

from .admission import Dropped, Handshakes
from .auth import HELLO_BYTES, AuthError, Peer, ServerHandshake, refusal
from .config import TransferConfig
from .protocol import (BATCH_BYTES, FRAME_BYTES, Frame, FrameType, ProtocolError, TransferError,
                       TransferStatus, max_manifest_bytes, payload_digests, split_batch, status_frame)
from .session import InboundSession, refused
from .sink import Sink
from .ucx_env import Engine, fused_lanes

log = logging.getLogger("kvstore.transport")

_DATA_BIT = 1 << 31
_FULL_MASK = (1 << 64) - 1
_REPLY_MAX = FRAME_BYTES + 8192
MAX_HANDSHAKES = 256  # UCX connections in their handshake at once (admission.py)


def ctrl_tag(api, rx: int):
    return api.UCXXTag(rx << 32)


def data_tag_value(rx: int, seq: int) -> int:
    return rx << 32 | _DATA_BIT | seq & 0x7FFFFFFF


def data_tag(api, rx: int, seq: int):
    return api.UCXXTag(data_tag_value(rx, seq))


def _req_error(req, ep) -> TransferError | None:
    """None if ``req`` succeeded; else PEER_LOST with the endpoint's own reason if it has one."""
    try:
        req.check_error()
        return None
    except Exception as exc:
        why = str(exc)
    try:
        ep.raise_on_error()
    except Exception as exc:
        why = str(exc)
    return TransferError(TransferStatus.PEER_LOST, f"UCX: {why}")


def hello_buf(msg: bytes = b"") -> np.ndarray:
    """A handshake message (auth.py) as the stream API sends it, or room to receive one."""
    return np.frombuffer(msg, dtype=np.uint8).copy() if msg else np.zeros(HELLO_BYTES, dtype=np.uint8)


class _Conn:
    """What both ends share: an endpoint, the peer's receive prefix, our posted control receive,
    control sends kept alive until UCX completes them. Engine thread only."""

    def __init__(self, engine: Engine, ep, peer: str, max_ctrl: int) -> None:
        self.engine, self.api, self.ep, self.peer = engine, engine.api, ep, peer
        self.rx = engine.new_rx_id()
        self.peer_rx = 0
        self.ctrl_buf = np.empty(max_ctrl, dtype=np.uint8)
        self.inflight: set = set()  # every request not yet completed, so teardown can wait for them
        self.writers: set = set()   # the subset that writes into sink buffers
        self.lane = engine.new_lane()
        self.closed = False
        self.ctrl_sent = 0  # control messages sent (a BATCH of chunk headers counts once)

    def track(self, req, cb, ordered: bool = False, writes: bool = False) -> None:
        """Watch ``req``; ``ordered`` for payloads, which complete in the order posted;
        ``writes`` for receives into sink buffers."""
        self.inflight.add(req)
        if writes:
            self.writers.add(req)

        def done(r) -> None:
            self.inflight.discard(r)
            self.writers.discard(r)
            cb(r)
        self.engine.watch(req, done, self.lane if ordered else None)

    def send_ctrl(self, frame: Frame, data: bytes = b"", checksum: int | None = None):
        buf = np.frombuffer(frame.pack(checksum) + bytes(data), dtype=np.uint8)
        req = self.ep.tag_send(self.engine.Array(buf), ctrl_tag(self.api, self.peer_rx))
        self.ctrl_sent += 1
        self.track(req, lambda r, _keep=buf: self.on_sent(r))  # the closure keeps buf alive
        return req

    def on_sent(self, req) -> None:
        err = _req_error(req, self.ep)
        if err is not None:
            self.lost(err)

    def post_ctrl_recv(self) -> None:
        if not self.closed:
            # ucxx does not report how many bytes a tag receive got: clear the header so a short
            # message fails the magic check instead of re-reading the previous frame.
            self.ctrl_buf[:FRAME_BYTES] = 0
            req = self.ep.tag_recv(self.engine.Array(self.ctrl_buf), ctrl_tag(self.api, self.rx))
            self.track(req, self._on_ctrl)

    def _on_ctrl(self, req) -> None:
        if self.closed:
            return
        err = _req_error(req, self.ep)
        if err is not None:
            return self.lost(err)
        try:
            frame = Frame.unpack(self.ctrl_buf[:FRAME_BYTES].tobytes())
            n = frame.trailer_bytes if frame.type is FrameType.CHUNK else frame.length  # CHUNK: run digests
            if FRAME_BYTES + n > self.ctrl_buf.nbytes:
                raise ProtocolError(f"{frame.type.name} frame of {n} bytes is too large")
            data = self.ctrl_buf[FRAME_BYTES:FRAME_BYTES + n].tobytes()
        except TransferError as err:
            return self.lost(err)
        self.post_ctrl_recv()
        if frame.type is not FrameType.BATCH:
            return self.on_frame(frame, data)
        try:
            chunks = split_batch(data)
        except TransferError as err:
            return self.lost(err)
        for chunk, trailer in chunks:
            if self.closed:
                return
            self.on_frame(chunk, trailer)

    def teardown(self) -> None:
        """Close the endpoint and wait until UCX has let go of every buffer we handed it."""
        self.closed = True
        try:
            self.ep.close_blocking()  # cancels ucxx's inflight requests, then closes
        except Exception:
            pass
        for req in list(self.writers):  # fused receives are not ucxx's: cancel them ourselves
            cancel = getattr(req, "cancel", None)
            if cancel is not None and not req.completed:
                cancel()
        # Completed is enough: a request can be done with its callback still queued behind the
        # one that called us (its callback then sees `closed` and does nothing). Receives into
        # sink buffers must be over before those are released; UCX cancels them at once. Sends
        # to a hung (not dead) peer may stay pending in UCX: they can only read their buffer,
        # on an endpoint that is closed, so we wait for them only briefly.
        done = self.engine.progress_until(lambda: all(r.completed for r in self.inflight), 1.0)
        if not done and not self.engine.progress_until(lambda: all(r.completed for r in self.writers), 4.0):
            log.error("UCX kept %d receives from %s after close; their buffers may still be written",
                      sum(not r.completed for r in self.writers), self.peer)
        elif not done:
            log.warning("UCX still holds %d sends to %s on the closed endpoint (they only read)",
                        sum(not r.completed for r in self.inflight), self.peer)
        if done:
            self.engine.progress_until(lambda: not self.lane, 1.0)  # let queued callbacks run
        self.engine.drop_lane(self.lane)

    def on_frame(self, frame: Frame, data: bytes) -> None:
        raise NotImplementedError

    def lost(self, err: TransferError) -> None:
        raise NotImplementedError


# -- receiving side ------------------------------------------------------------------------------

class _Inbound(_Conn):
    def __init__(self, server: "UcxServer", ep, peer: str) -> None:
        super().__init__(server.engine, ep, peer, server.max_ctrl)
        self.server = server
        self.session = InboundSession(server.config, server.sink, peer)
        self.fused = None  # the _fused module once the handshake found this endpoint's lanes copy by CPU
        self.pending: collections.deque = collections.deque()  # chunks and control frames, in order
        # The handshake: nothing but its four messages is received until it succeeds, and the
        # listener's place table (admission.py) cuts off a peer that has not finished it within
        # connect_timeout_s of connecting, or whose place goes to a newer connection.
        self.hs = ServerHandshake(server.config.secret, server.config.node_name, self.rx)
        self.close_at: float | None = None  # a refused peer is closed then, once it could read why
        self.place = server.places.admit("", lambda why: self.engine.call_soon(self._cut_off, why))
        self._hello_step(1)

    def _cut_off(self, why: Dropped) -> None:
        """The place table took this handshake's place (engine thread)."""
        if self.closed or self.hs is None:  # gone already, or refused and counted
            return
        self._refuse(AuthError(f"UCX handshake not completed within {self.server.config.connect_timeout_s:g} s "
                               f"of connecting" if why is Dropped.DEADLINE else "UCX handshake dropped: its place "
                               "went to a new connection (the table was full)", why.value), False)

    def _hello_step(self, step: int) -> None:
        """Receive the dialer's handshake message ``step`` (1 or 3)."""
        buf = hello_buf()
        self.track(self.ep.stream_recv(self.engine.Array(buf)), lambda r: self._on_hello(r, step, buf))

    def _on_hello(self, req, step: int, buf: np.ndarray) -> None:
        if self.closed:
            return
        err = _req_error(req, self.ep)
        if err is not None:
            return self._refuse(AuthError(f"peer left during the handshake: {err.detail}", "protocol"), False)
        try:
            reply = (self.hs.second if step == 1 else self.hs.fourth)(buf.tobytes())
        except TransferError as exc:
            return self._refuse(exc if isinstance(exc, AuthError) else AuthError(exc.detail, "protocol"))
        if step == 3 and self.server.places.finish(self.place) is not None:
            return  # cut off as it finished: _cut_off, queued, refuses it
        out = hello_buf(reply)
        self.track(self.ep.stream_send(self.engine.Array(out)), lambda r, _keep=out: self.on_sent(r))
        if step == 1:
            return self._hello_step(3)
        self.peer_rx = self.hs.peer_rx
        via = "hmac" if self.server.config.secret else "none"
        self.session.authenticated(Peer(self.hs.peer_name if self.server.config.secret else "", self.peer, via))
        if self.engine.fused is not None:
            ok, lanes = fused_lanes(self.engine.fused, self.ep)
            self.fused = self.engine.fused if ok else None
            log.info("UCX peer %s: lanes %s; payloads %s", self.session.peer, lanes,
                     "hashed as UCX copies them in" if ok else "hashed once landed")
        self.post_ctrl_recv()

    def _refuse(self, err: AuthError, answer: bool = True) -> None:
        """Drop a peer that failed the handshake: tell it why (once that has left, close), count it."""
        refused(self.server.sink, self.peer, err)
        self.hs = None  # counted once
        self.server.places.finish(self.place)
        if not answer:
            return self.lost(err)
        out = hello_buf(refusal(0, err))
        # Closed by the ticker half a second on, not when the send completes: closing at once
        # can reset the endpoint before the peer has read why.
        self.close_at = time.monotonic() + 0.5
        self.track(self.ep.stream_send(self.engine.Array(out)), lambda r, _keep=out: None)

    def on_frame(self, frame: Frame, data: bytes) -> None:
        try:
            if frame.type is FrameType.CHUNK:
                mv = self.session.chunk_buffer(frame)
                sent = self.session.run_digests(frame, data)
                if self.fused is not None:  # copies and hashes each layer of the payload as it lands
                    try:
                        req = self.fused.Recv(self.engine.worker.handle, mv, data_tag_value(self.rx, frame.seq),
                                              _FULL_MASK, frame.length // (frame.flags or 1))
                    except Exception as exc:  # noqa: BLE001 - UCX refused the receive: fail, not hang
                        raise TransferError(TransferStatus.SINK_ERROR, f"receiver could not post the payload's "
                                            f"receive: {exc}", frame.transfer_id) from exc
                else:
                    req = self.ep.tag_recv(self.engine.Array(mv), data_tag(self.api, self.rx, frame.seq))
                item = [frame, mv, req, None, sent]  # [3] becomes the payload's digest(s)
                self.track(req, lambda r, item=item: self._landed(item), ordered=True, writes=True)
                self.pending.append(item)
            else:
                self.pending.append([frame, data, None, None, None])
            self._drain()
        except TransferError as err:
            self.lost(err)

    def _landed(self, item: list) -> None:
        if self.closed:
            return
        req = item[2]
        err = _req_error(req, self.ep)
        if err is not None:
            return self.lost(err)
        if self.fused is not None:
            if req.length != item[0].length:
                return self.lost(ProtocolError(f"chunk {item[0].seq}: {req.length} bytes arrived, its header "
                                               f"announced {item[0].length}", item[0].transfer_id))
            got = req.digests  # None only if UCX handed fragments out of order: hash it now
            if got is not None:
                item[3] = got if item[0].flags else got[0]
                return self._drain()
        # With spare cores (config.verify_threads) a pool hashes payloads of verify_min_bytes or
        # more while this thread goes back to progressing UCX; _drain still takes items strictly
        # in order. Smaller ones hash inline: 256 KiB takes ~8 us, about what the hand-over
        # costs. Inline, the hash runs while the chunk is warm in cache; on 2 cores a helper
        # thread only competed with both engines (4 MiB chunks: 7.3 against 7.7 GB/s inline).
        try:
            if self.engine.verify_pool is None or item[0].length < self.engine.config.verify_min_bytes:
                item[3] = self.session.landed_digests(item[0], item[1])  # an int, or a run's list
            else:
                self.engine.verify_pool.submit(payload_digests, item[0], item[1]).add_done_callback(
                    lambda fut, item=item: self.engine.call_soon(self._verified, item, fut))
                return
        except TransferError as err:
            return self.lost(err)
        self._drain()

    def _verified(self, item: list, fut) -> None:
        """A pool thread hashed ``item``'s payload (engine thread)."""
        if self.closed:
            return
        try:
            item[3] = fut.result()
        except Exception as exc:  # noqa: BLE001 - a hash that raised is a transfer that failed
            return self.lost(exc if isinstance(exc, TransferError) else ProtocolError(f"verify: {exc}"))
        self._drain()

    def _drain(self) -> None:
        """Handle finished items strictly in order: arrival callbacks keep wire order, and END is
        only judged once every payload before it has landed and been verified."""
        try:
            while self.pending and not self.closed:
                frame, obj, req, got, sent = self.pending[0]
                if req is not None and got is None:
                    return
                self.pending.popleft()
                if req is not None:
                    self.session.chunk_verified(frame, got, sent)
                else:
                    reply = self.session.on_control(frame, obj)
                    if reply is not None:
                        self.send_ctrl(*reply)
                    self.server.refresh_open()  # BEGIN opened a transfer, END or ABORT closed it
        except TransferError as err:
            self.lost(err)

    def tick(self, now: float) -> None:
        if self.close_at is not None and now > self.close_at:
            self.lost(AuthError("refused in the handshake", "protocol"))
        elif self.session.deadline is not None and now >= self.session.deadline:
            self.lost(self.session.expire())

    def lost(self, err: TransferError) -> None:
        """Fail the connection: tell the sender why, stop UCX writing into the sink's buffers,
        and only then end the transfer (which releases them)."""
        if self.closed:
            return
        if self.server.stopping:
            err = TransferError(TransferStatus.SHUTDOWN, "receiving daemon is shutting down")
        self.closed = True
        active = self.session.active
        tid = active.header.transfer_id if active is not None else err.transfer_id
        if self.peer_rx and err.status is not TransferStatus.PEER_LOST:
            try:
                req = self.send_ctrl(*status_frame(FrameType.ERROR, tid, err.status, err.detail))
                self.engine.progress_until(lambda: req.completed, 0.5)  # let it leave first
            except Exception:
                pass
        self.server.places.finish(self.place)  # a handshake that ended with the connection
        self.teardown()
        self.session.fail(err)
        self.server.conns.discard(self)
        self.server.refresh_open()


class UcxServer:
    """UCX listener plus its engine; the public face is :class:`~kvstore.transport.Listener`."""

    def __init__(self, config: TransferConfig, sink: Sink) -> None:
        self.config, self.sink = config, sink
        self.engine = Engine(config, "listener")
        self.max_ctrl = FRAME_BYTES + max(max_manifest_bytes(config.max_blocks, config.max_meta_bytes), BATCH_BYTES)
        self.conns: set[_Inbound] = set()
        self.stopping = False
        # ucxx does not say who connects: only the total is bounded, a full table giving the
        # oldest handshake's place to the newcomer. Handshakes here cost no thread.
        self.places = Handshakes(config.connect_timeout_s, per_host=None, total=MAX_HANDSHAKES, name="kvt-ucx-handshakes")
        try:
            self._listener = self.engine.call(self._listen)
        except Exception as exc:
            self.places.stop()
            self.engine.stop()
            raise OSError(f"UCX transfer listener cannot listen on port {config.port}: {exc}") from None
        self.host, self.port = config.host, self._listener.port
        self.engine.add_ticker(self._tick)

    def _listen(self):
        api = self.engine.api

        def on_connect(conn_request) -> None:
            ep = self._listener.create_endpoint_from_conn_request(conn_request, True)
            self.conns.add(_Inbound(self, ep, f"ucx peer {len(self.conns)}"))
        return api.UCXListener.create(worker=self.engine.worker, port=self.config.port, cb_func=on_connect)

    def _tick(self, now: float) -> None:
        for conn in list(self.conns):
            conn.tick(now)
        self.refresh_open()

    def refresh_open(self) -> None:
        """Whether a transfer is open on a connection: at every tick, and at once when one begins
        or ends (as ``UcxConnector.refresh_open``)."""
        self.engine.transfers_open = any(c.session.active is not None for c in self.conns)

    def stop(self, timeout_s: float = 5.0) -> None:
        def shut() -> None:
            self.stopping = True
            for conn in list(self.conns):
                conn.lost(TransferError(TransferStatus.SHUTDOWN, "receiving daemon is shutting down"))
            self._listener = None
        try:
            self.engine.call(shut, timeout_s=timeout_s)
        finally:
            self.places.stop()
            self.engine.stop(timeout_s)
