"""Query channels: Lookup and Acquire over a session's own unix connection, one round trip of a
raw socket instead of a gRPC call.

An engine's scheduler looks each prompt up before it schedules it, and its worker Acquires the
hit before it copies: both sit on the request's time to first token. On a 2-core VM a gRPC call
made after 0.2 s idle took 3.6 ms where a raw unix-socket round trip took 0.2 ms, the handler
0.57 ms (scratch measurements, each against the other in the same script). A local client
asks the arena socket for a channel (its session id, then ``Q``); the daemon checks the session
and watches the process as for any handout, then serves that connection on a thread of its
own: the same handlers as the gRPC service, the same validation and the same answers.

Nothing new is trusted: a channel is bound to the session it was opened for (a request naming
another session is refused), reachable only through the arena socket (``server.socket_mode``),
and ends when its session does. A client with no channel (TCP, a refused one) uses gRPC.

Frames, little endian: a request is ``u32 length, u8 method, message`` (:data:`METHODS`); an
answer ``u32 length, u8 status`` then the response message (status 0) or, for a gRPC status
code, ``u16 length, refusal name, details``.
"""

from __future__ import annotations

import logging
import socket
import struct
import threading

import grpc

from kvstore.daemon.places import Places
from kvstore.errors import REFUSAL_KEY
from kvstore.v1 import kvstore_pb2 as pb

log = logging.getLogger("kvstore.daemon.handout")

METHODS = {1: ("Lookup", pb.LookupRequest), 2: ("Acquire", pb.AcquireRequest)}
METHOD_IDS = {name: i for i, (name, _) in METHODS.items()}
FRAME = struct.Struct("<IB")
REFUSAL_LEN = struct.Struct("<H")
MAX_FRAME_BYTES = 64 << 20  # a Lookup of 2M keys; the gRPC server takes no larger message
IDLE_CHECK_S = 10.0  # an idle channel checks this often that its session still lives
FRAME_TIMEOUT_S = 30.0  # a frame begun must arrive whole within this


class ChannelClosed(Exception):
    """The client went away, or broke the framing: the channel ends."""


class _Abort(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code, self.details = code, details


class _Context:
    """What the service's handlers ask of a gRPC context, for one call on a channel."""

    def __init__(self) -> None:
        self.refusal = ""

    def abort(self, code: grpc.StatusCode, details: str):
        raise _Abort(code, details)

    def set_trailing_metadata(self, md) -> None:
        for key, value in md:
            if key == REFUSAL_KEY:
                self.refusal = value

    def is_active(self) -> bool:
        return True  # one call at a time per channel: a client that gave up stalls only its own

    def time_remaining(self):
        return None  # waits are bounded by the request's own wait_s


def recv_exactly(conn: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = conn.recv_into(view[got:])
        if k == 0:
            raise ChannelClosed("closed")
        got += k
    return bytes(buf)


class QueryChannels:
    """Admits channels (at most ``max_total``, ``max_per_user`` per uid) and serves each on the
    thread that accepted it. ``sessions()``: the live session ids (the core's)."""

    def __init__(self, service, sessions, lock, max_total: int = 256, max_per_user: int = 64,
                 idle_check_s: float = IDLE_CHECK_S) -> None:
        self.service, self.sessions, self.core_lock = service, sessions, lock
        self.idle_check_s = idle_check_s
        self._open = Places(max_total, max_per_user, lambda n, _: f"{n} query channels of this user are open",
                            lambda n, _: f"{n} query channels are open in all")
        self.admit, self.release = self._open.take, self._open.leave  # admit: "" or why not
        self._conns: set[socket.socket] = set()  # the channels being served
        self._conns_lock = threading.Lock()
        self._stopping = False

    def __len__(self) -> int:
        return self._open.held

    def serve(self, conn: socket.socket, sid: bytes, uid: int) -> None:
        """Answer ``conn``'s calls until the client closes it, its session ends or the daemon
        stops (:meth:`close_all`); then close it."""
        with self._conns_lock:
            if not self._stopping:
                self._conns.add(conn)
        try:
            while not self._stopping:
                conn.settimeout(self.idle_check_s)
                try:
                    head = conn.recv(FRAME.size, socket.MSG_PEEK)
                except TimeoutError:
                    with self.core_lock:
                        alive = sid in self.sessions
                    if not alive:
                        return
                    continue
                if not head:
                    return
                conn.settimeout(FRAME_TIMEOUT_S)  # the frame is on its way: a client that stalls in it is closed
                n, method = FRAME.unpack(recv_exactly(conn, FRAME.size))
                if n > MAX_FRAME_BYTES or method not in METHODS:
                    log.warning("query channel: uid %d sent a bad frame (%d bytes, method %d); closing", uid, n, method)
                    return
                self._answer(conn, sid, method, recv_exactly(conn, n))
        except (ChannelClosed, OSError):
            return
        finally:
            with self._conns_lock:
                self._conns.discard(conn)
            conn.close()
            self.release(uid)

    def close_all(self) -> None:
        """The daemon stops: every channel ends (its client's next call goes over gRPC, which
        answers as a stopping daemon does), and no new one is served."""
        with self._conns_lock:
            self._stopping = True
            conns = list(self._conns)
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def _answer(self, conn: socket.socket, sid: bytes, method: int, body: bytes) -> None:
        name, kind = METHODS[method]
        ctx = _Context()
        try:
            req = kind.FromString(body)
            if req.session_id != sid:
                raise _Abort(grpc.StatusCode.PERMISSION_DENIED, f"{name}: this query channel serves the session it "
                                                                "was opened for; use gRPC for others")
            out = getattr(self.service, name)(req, ctx).SerializeToString()
            status = 0
        except _Abort as e:
            status = e.code.value[0]
            refusal = ctx.refusal.encode()
            out = REFUSAL_LEN.pack(len(refusal)) + refusal + e.details.encode()
        except Exception as e:  # noqa: BLE001 - a message that does not parse
            status = grpc.StatusCode.INVALID_ARGUMENT.value[0]
            out = REFUSAL_LEN.pack(0) + f"{name}: request does not parse: {e}".encode()
        conn.sendall(FRAME.pack(len(out), status) + out)
