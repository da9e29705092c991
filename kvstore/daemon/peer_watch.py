"""Sessions that end with their process. A local client maps the arena through the handout
socket, naming its session; the kernel tells the daemon which process is on the other end
(``SO_PEERPIDFD``, or the pid of ``SO_PEERCRED`` opened as a pidfd), and the daemon watches
that process: when it exits (returned, SIGKILLed, OOM-killed, force-killed by vLLM's default
shutdown) its sessions end at once, with their leases, instead of at ``server.session_ttl_s``.

Nothing is trusted that was not before: a session is authorized by its id as always, and the
process is the kernel's word, not the client's. What cannot be watched keeps the TTL: TCP
clients, a peer whose pid the daemon's pid namespace cannot see on a kernel without
``SO_PEERPIDFD`` (before Linux 6.5), more than :data:`MAX_WATCHED` processes at once.

One thread waits on every pidfd (a pidfd reads ready when its process has exited). Lock order:
the core lock, then this watch's own; the thread takes the core lock only with its own let go.
Processes are told apart by their pidfd, not their pid: a pid whose process has exited (its
exit not yet handled) may already name another process, whose sessions must not end with it.
"""

from __future__ import annotations

import logging
import os
import select
import selectors
import socket
import struct
import threading
from typing import TYPE_CHECKING

from kvstore.daemon.sessions import SessionEnd

if TYPE_CHECKING:
    from kvstore.daemon.core import Core

log = logging.getLogger("kvstore.daemon.sessions")

SO_PEERPIDFD = getattr(socket, "SO_PEERPIDFD", 77)  # Linux 6.5: a pidfd of the peer, any pid namespace
MAX_WATCHED = 4096  # processes watched at once; past it, new ones fall back to the TTL
_PEERCRED = struct.Struct("3i")  # pid, uid, gid


def peer_pidfd(conn: socket.socket) -> tuple[int, int] | None:
    """``(pid, pidfd)`` of the process at the other end of a unix socket, or None when the kernel
    cannot say (the peer's pid is outside this pid namespace and there is no SO_PEERPIDFD)."""
    try:
        pid = _PEERCRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))[0]
    except OSError:
        return None
    try:
        return pid, int.from_bytes(conn.getsockopt(socket.SOL_SOCKET, SO_PEERPIDFD, 4), "little", signed=True)
    except OSError:
        pass
    if pid <= 0:
        return None
    try:
        return pid, os.pidfd_open(pid)
    except OSError:  # it has exited already: the TTL ends its session
        return None


class PeerWatch:
    """Ends the sessions of processes that exit. :meth:`watch` is called with the core lock held
    (the handout checks the session under it); the thread started by :meth:`start` does the ending."""

    def __init__(self, core: "Core") -> None:
        self.core = core
        self._lock = threading.Lock()
        self._peers: dict[int, tuple[int, set[bytes]]] = {}  # pidfd -> (pid, its session ids)
        self._by_pid: dict[int, int] = {}  # pid -> the pidfd of the latest process seen with it
        self._sel: selectors.BaseSelector | None = None  # from start to the thread's end
        self._stopping = False
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = os.pipe()
        self._sel.register(self._wake_r, selectors.EVENT_READ, None)
        self._thread = threading.Thread(target=self._loop, name="peer-watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        if self._thread is None or self._stopping:
            return
        self._stopping = True
        os.write(self._wake_w, b"x")
        self._thread.join(timeout=5)

    def __len__(self) -> int:
        with self._lock:
            return len(self._peers)

    def watch(self, sid: bytes, conn: socket.socket) -> None:
        """End session ``sid`` when the process at the other end of ``conn`` exits. With the core
        lock held: the ids of this process's sessions that ended otherwise are dropped here."""
        if self._sel is None or self._stopping:
            return
        peer = peer_pidfd(conn)
        if peer is None:
            return
        pid, pidfd = peer
        with self._lock:
            known = self._by_pid.get(pid)
            if known is not None and not _has_exited(known):
                os.close(pidfd)  # the same live process: one pidfd per process is enough
                sids = self._peers[known][1]
                sids.intersection_update(self.core.sessions)
                sids.add(sid)
                return
            # New, or a pid whose process exited (its exit not handled yet) reused by another.
            if len(self._peers) >= MAX_WATCHED:
                os.close(pidfd)
                log.debug("peer watch: %d processes watched; pid %d's session ends by its TTL", MAX_WATCHED, pid)
                return
            self._peers[pidfd] = (pid, {sid})
            self._by_pid[pid] = pidfd
            self._sel.register(pidfd, selectors.EVENT_READ, pidfd)

    def _loop(self) -> None:
        while not self._stopping:
            for key, _ in self._sel.select():
                if key.data is not None:
                    self._exited(key.data)
        self._sel.close()
        with self._lock:
            for pidfd in self._peers:
                os.close(pidfd)
            self._peers.clear()
            self._by_pid.clear()
        os.close(self._wake_r)
        os.close(self._wake_w)

    def _exited(self, pidfd: int) -> None:
        with self._lock:
            pid, sids = self._peers.pop(pidfd)
            if self._by_pid.get(pid) == pidfd:
                del self._by_pid[pid]
            self._sel.unregister(pidfd)
            os.close(pidfd)
        ended = leases = 0
        with self.core.lock:
            for sid in sids:
                s = self.core.sessions.find(sid)
                if s is not None:
                    leases += self.core.close_session(s, SessionEnd.EXITED)
                    ended += 1
        if ended:
            log.info("process %d exited: %d session(s) ended, %d lease(s) with them", pid, ended, leases)


def _has_exited(pidfd: int) -> bool:
    """Whether the process of ``pidfd`` has exited (its pidfd reads ready), without waiting."""
    p = select.poll()
    p.register(pidfd, select.POLLIN)
    return bool(p.poll(0))
