"""A client's side of its daemon session: kept alive while the client lives, ended when it goes.

The daemon ends a session it has heard no call of for ``session_ttl_s`` seconds (RegisterResponse),
taking its leases with it: that is how a killed worker's reservations and pins go. A live client
that is idle must therefore say it is alive: :class:`SessionKeeper` sends KeepAlive from a daemon
thread whenever the client has made no call for a third of the TTL, so two keep-alives in a row
may be lost (or late) before the session ends. Ending is explicit (``close``), and also happens
when the client is garbage-collected or the process exits normally, so only a crash (SIGKILL, a
hung process) leaves the session to the TTL.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import weakref
from typing import TYPE_CHECKING

import grpc

from kvstore.errors import REFUSAL_KEY
from kvstore.v1 import kvstore_pb2 as pb

if TYPE_CHECKING:
    from kvstore.clients.client import KVStoreClient

log = logging.getLogger("kvstore.client")

CLOSE_TIMEOUT_S = 2.0  # bound on CloseSession when a client closes or its process exits (seconds)
# gRPC's reconnect backoff on the daemon's unix socket. A call made while the daemon was away
# (restarting) fails to connect; gRPC then fails every call at once, without trying, until its
# backoff has passed: 1 s by default, growing to 120 s. A local socket costs nothing to retry.
# (Not grpc.min_reconnect_backoff_ms: gRPC core takes that as the connect timeout.)
UNIX_CHANNEL_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 100), ("grpc.max_reconnect_backoff_ms", 1000)]
# How gRPC says a call was never sent: it found no connection to the daemon (an UNAVAILABLE the
# daemon sends itself, e.g. a draining daemon's Reserve, must not be sent again).
NOT_CONNECTED = "failed to connect to all addresses"


def listening(socket_path: str) -> bool:
    """Whether a daemon accepts connections on the unix socket ``socket_path`` now."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(0.5)
        try:
            s.connect(socket_path)
        except OSError:
            return False
    return True


def refusal(e: grpc.RpcError) -> int:
    """The ``pb.Refusal`` the daemon named in the call's trailing metadata (0 = none)."""
    md = getattr(e, "trailing_metadata", None)
    for key, value in (md() if callable(md) else None) or ():
        if key == REFUSAL_KEY:
            try:
                return pb.Refusal.Value(value)
            except ValueError:
                return 0  # a refusal this client does not know: treat the error as it reads
    return 0


class SessionKeeper:
    """Keeps one session alive and ends it once. ``used`` is when the client last sent a call
    naming the session (``time.monotonic()`` seconds; the client stamps it): the keep-alive
    goes only once a third of the TTL has passed since. Thread-safe: the keep-alive thread reads
    ``used`` and the client's stub, nothing else of the client."""

    def __init__(self, client: "KVStoreClient", session_id: bytes, ttl_s: float) -> None:
        self.session_id = session_id
        self.ttl_s = ttl_s
        self.used = time.monotonic()
        self._client = weakref.ref(client)  # the thread must not keep a dropped client alive
        self._stop = threading.Event()
        # Runs once: at close(), when the client is collected, or at the normal exit of this
        # process (weakref.finalize runs at exit); never in a forked child, whose parent still
        # uses the session.
        self._end = weakref.finalize(client, _end_session, client.stub, session_id, os.getpid(), self._stop)
        if ttl_s > 0:  # 0: an older daemon that never ends sessions itself
            threading.Thread(target=self._run, name="kvstore-keepalive", daemon=True).start()

    def close(self) -> None:
        """End the session now (CloseSession); its leases end with it. Idempotent."""
        self._end()

    def abandon(self) -> None:
        """The session already ended in the daemon: stop keeping it, send nothing."""
        self._end.detach()
        self._stop.set()

    def _run(self) -> None:
        retry_at = 0.0
        while True:
            period = self.ttl_s / 3
            due = max(self.used + period, retry_at)
            if self._stop.wait(max(0.0, due - time.monotonic())):
                return
            if time.monotonic() < self.used + period:
                continue  # the client made a call meanwhile: that renewed the session
            client = self._client()
            if client is None:
                return
            stub, timeout_s = client.stub, min(client.timeout_s, period)
            del client
            sent = time.monotonic()
            try:
                resp = stub.KeepAlive(pb.KeepAliveRequest(session_id=self.session_id), timeout=timeout_s)
            except grpc.RpcError as e:
                if refusal(e) == pb.REFUSAL_SESSION_UNKNOWN:
                    log.warning("kvstore session ended in the daemon (%s); the next call registers again", e.details())
                    return
                # The daemon is busy or restarting: try again soon, while the TTL still allows.
                retry_at = time.monotonic() + period / 3
                continue
            except ValueError:  # the channel was closed under us: the client is closing
                return
            self.used = max(self.used, sent)
            if resp.session_ttl_s > 0:
                self.ttl_s = resp.session_ttl_s  # a config reload may have changed it


def _end_session(stub, session_id: bytes, pid: int, stop: threading.Event) -> None:
    stop.set()
    if os.getpid() != pid:
        return
    try:
        stub.CloseSession(pb.CloseSessionRequest(session_id=session_id), timeout=CLOSE_TIMEOUT_S)
    except grpc.RpcError:
        pass  # NOT_FOUND: it already expired; UNAVAILABLE: the daemon is gone. Nothing left to free.
    except ValueError:
        pass  # the channel is already closed (a client collected after close() of its channel)
