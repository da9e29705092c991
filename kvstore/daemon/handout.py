"""The arena handout: ``<socket>.arena``, where a registered client gets the DRAM arena's file
descriptor (SCM_RIGHTS) or, asking with ``H``, the HBM pool's handle; asking with ``W`` it gets
nothing but the watch every handout gives (:mod:`kvstore.daemon.peer_watch`: the session ends
with the process); asking with ``Q``, the watch and a query channel on the same connection
(:mod:`kvstore.daemon.query_channel`). Never a path: only a client that can reach the socket and names a live
session gets the memory."""

from __future__ import annotations

import logging
import os
import socket
import struct
import threading
import time

from kvstore.config import ServerConfig
from kvstore.daemon.core import Core
from kvstore.daemon.peer_watch import PeerWatch
from kvstore.daemon.places import Places
from kvstore.tiers.arena import Arena, send_fd, send_refusal

log = logging.getLogger("kvstore.daemon.handout")
# Connections served at once, all users together: each costs a thread for at most
# server.handout_timeout_s, and a handout itself takes microseconds.
MAX_CONNECTIONS = 64
_PEERCRED = struct.Struct("3i")  # pid, uid, gid


class ArenaHandout:
    """Serves each connection on its own thread, so an idle or slow one holds up no other: a
    connection that has not sent its request within ``server.handout_timeout_s`` is closed, and
    one uid may have at most ``server.handout_per_user`` open (more are closed at once), so a
    user can only ever stall its own handouts."""

    def __init__(self, path: str, cfg: ServerConfig, arena: Arena, core: Core, hbm_cache=None,
                 peers: PeerWatch | None = None) -> None:
        self.path = path
        self.peers = peers  # the process that asks for a session's memory is watched: its exit ends it
        self.cfg = cfg
        self.arena = arena
        self.core = core
        self.hbm_cache = hbm_cache  # kvstore.daemon.hbm_cache.HbmCache or None
        self._listener: socket.socket | None = None
        self._stopping = threading.Event()
        self._served = Places(MAX_CONNECTIONS, cfg.handout_per_user,
                              lambda n, _: f"{n} connections of this user are open (server.handout_per_user)",
                              lambda n, _: f"{n} connections are open in all")
        self.channels = None  # kvstore.daemon.query_channel.QueryChannels: ``Q`` requests (None: refused)

    def start(self) -> None:
        if os.path.exists(self.path):
            os.unlink(self.path)
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(self.path)
        os.chmod(self.path, self.cfg.socket_mode)
        self._listener.listen(64)
        threading.Thread(target=self._loop, name="arena-handout", daemon=True).start()

    def _loop(self) -> None:
        while not self._stopping.is_set():
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            try:
                uid = _PEERCRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))[1]
            except OSError as e:  # the accept loop must outlive any one connection
                log.warning("arena handout: cannot tell who connected (%s); closing", e)
                conn.close()
                continue
            why = self._served.take(uid)
            if why:
                log.warning("arena handout: uid %d turned away: %s", uid, why)
                send_refusal(conn, f"arena handout busy: {why}; retry", retryable=True)
                conn.close()
                continue
            threading.Thread(target=self._serve, args=(conn, uid), name="arena-handout-conn", daemon=True).start()

    def _serve(self, conn: socket.socket, uid: int) -> None:
        sid = b""
        try:
            sid = self._handle(conn, uid)
        except OSError as e:
            log.warning("arena handout failed: %s", e)
        finally:
            self._served.leave(uid)
            if not sid:
                conn.close()
        if sid:  # a query channel: served on this thread, counted among the channels, not the handouts
            self.channels.serve(conn, sid, uid)

    def _handle(self, conn: socket.socket, uid: int) -> bytes:
        """Answer one handout request; the session id when the connection goes on as its query
        channel (admitted, answered), else b"" (close it)."""
        req = self._request(conn)  # session id, then b"H" for the HBM pool's handle
        if req is None:
            log.debug("arena handout: uid %d sent no request within %.2f s", uid, self.cfg.handout_timeout_s)
            send_refusal(conn, f"no request within server.handout_timeout_s "
                               f"({self.cfg.handout_timeout_s:g} s)", retryable=False)
            return b""
        sid, what = req[:16], req[16:]
        with self.core.lock:
            known = sid in self.core.sessions
            if known and self.peers is not None:
                self.peers.watch(sid, conn)
        if not known:
            send_refusal(conn, "unknown or expired session (register again)", retryable=False)
        elif what == b"W":  # watch only: a client that maps no memory (a scheduler's lookups)
            conn.sendall((0).to_bytes(8, "little"))
        elif what == b"Q":  # the session's query channel (kvstore.daemon.query_channel)
            why = "this daemon serves no query channels" if self.channels is None else self.channels.admit(uid)
            if why:
                send_refusal(conn, why, retryable=False)
                return b""
            try:
                conn.sendall((0).to_bytes(8, "little"))
            except OSError:
                self.channels.release(uid)
                raise
            conn.settimeout(None)
            return sid
        elif what == b"H":
            if self.hbm_cache is None:
                send_refusal(conn, "this daemon has no HBM tier (hbm.capacity_bytes)", retryable=False)
            else:
                self.hbm_cache.handout(conn)
        else:
            send_fd(conn, self.arena.fd, self.arena.size_bytes)
        return b""

    def _request(self, conn: socket.socket) -> bytes | None:
        """The 16- or 17-byte request, read within ``handout_timeout_s`` of accept however the
        client paces its bytes; None if it did not come in time (or the client left)."""
        deadline = time.monotonic() + self.cfg.handout_timeout_s
        req = b""
        while len(req) < 16:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            conn.settimeout(left)
            try:
                piece = conn.recv(17 - len(req))
            except TimeoutError:
                return None
            if not piece:
                return None
            req += piece
        if len(req) == 16:  # a 17th byte (b"H") comes in the same write as the id
            conn.setblocking(False)  # in timeout mode Python would wait out EAGAIN
            try:
                req += conn.recv(1)
            except BlockingIOError:
                pass
            conn.settimeout(max(0.05, deadline - time.monotonic()))  # the answer goes out in time too
        return req

    def stop(self) -> None:
        self._stopping.set()
        if self.channels is not None:
            self.channels.close_all()
        if self._listener is not None:
            try:
                self._listener.close()
            except OSError:
                pass
        try:
            os.unlink(self.path)
        except OSError:
            pass
