"""The client side of a query channel (:mod:`kvstore.daemon.query_channel`): Lookup and Acquire
of one session over its own unix connection to the daemon, a raw round trip instead of a gRPC
call. One call at a time: a caller that finds it busy uses gRPC."""

from __future__ import annotations

import select
import socket
import threading

import grpc

from kvstore.clients.leases import KVStoreError
from kvstore.daemon.query_channel import FRAME, METHOD_IDS, REFUSAL_LEN, ChannelClosed, recv_exactly
from kvstore.v1 import kvstore_pb2 as pb

RESPONSES = {"Lookup": pb.LookupResponse, "Acquire": pb.AcquireResponse}
CODES = {c.value[0]: c for c in grpc.StatusCode}
POLLRDHUP = getattr(select, "POLLRDHUP", 0x2000)


class Unsent(Exception):
    """The request never reached the daemon (the channel was closed): send it over gRPC."""


class QueryChannel:
    def __init__(self, sock: socket.socket, session_id: bytes) -> None:
        self.sock, self.session_id = sock, session_id
        self._busy = threading.Lock()
        self.closed = False

    def serves(self, method: str, request) -> bool:
        return not self.closed and method in RESPONSES and getattr(request, "session_id", b"") == self.session_id

    def call(self, method: str, request, timeout_s: float):
        """The daemon's answer; KVStoreError for its refusals and for a channel that broke during
        the call (then closed: the next call goes over gRPC). Raises :class:`Unsent` when the
        channel is busy or the request could not be sent (nothing reached the daemon)."""
        if not self._busy.acquire(blocking=False):
            raise Unsent("busy")
        try:
            if self.closed or self._hung_up():
                self.close()
                raise Unsent("closed")
            body = request.SerializeToString()
            try:
                self.sock.settimeout(timeout_s)
                self.sock.sendall(FRAME.pack(len(body), METHOD_IDS[method]) + body)
            except OSError:
                self.close()
                raise Unsent("send failed") from None
            try:
                n, status = FRAME.unpack(recv_exactly(self.sock, FRAME.size))
                out = recv_exactly(self.sock, n)
            except TimeoutError:
                self.close()  # the answer may still come: this channel is out of step
                raise KVStoreError(grpc.StatusCode.DEADLINE_EXCEEDED, f"{method}: no answer within {timeout_s:g} s "
                                   "on the query channel") from None
            except (ChannelClosed, OSError) as e:
                self.close()
                raise KVStoreError(grpc.StatusCode.UNAVAILABLE, f"{method}: the daemon closed the query channel "
                                   f"({e})") from None
        finally:
            self._busy.release()
        if status == 0:
            return RESPONSES[method].FromString(out)
        k = REFUSAL_LEN.unpack(out[:REFUSAL_LEN.size])[0]
        name = out[REFUSAL_LEN.size:REFUSAL_LEN.size + k].decode(errors="replace")
        try:
            refusal = pb.Refusal.Value(name) if name else 0
        except ValueError:
            refusal = 0
        raise KVStoreError(CODES.get(status, grpc.StatusCode.UNKNOWN),
                           out[REFUSAL_LEN.size + k:].decode(errors="replace"), refusal)

    def _hung_up(self) -> bool:
        """The daemon closed its end (it restarted, or the session ended): nothing else ever
        arrives unasked, so anything to read now means that."""
        p = select.poll()
        p.register(self.sock, select.POLLIN | select.POLLHUP | select.POLLERR | POLLRDHUP)
        try:
            return bool(p.poll(0))
        except OSError:
            return True

    def close(self) -> None:
        self.closed = True
        try:
            self.sock.close()
        except OSError:
            pass
