"""The arena handout: ``<socket>.arena``, where a registered client gets the DRAM arena's file
descriptor (SCM_RIGHTS) or, asking with ``H``, the HBM pool's handle. Never a path: only a
client that can reach the socket and names a live session gets the memory."""

from __future__ import annotations

import logging
import os
import socket
import threading

from kvstore.daemon.core import Core
from kvstore.tiers.arena import Arena, send_fd

log = logging.getLogger("kvstore.daemon.handout")


class ArenaHandout:
    def __init__(self, path: str, mode: int, arena: Arena, core: Core, hbm_cache=None) -> None:
        self.path = path
        self.mode = mode
        self.arena = arena
        self.core = core
        self.hbm_cache = hbm_cache  # kvstore.daemon.hbm_cache.HbmCache or None
        self._listener: socket.socket | None = None
        self._stopping = threading.Event()

    def start(self) -> None:
        if os.path.exists(self.path):
            os.unlink(self.path)
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(self.path)
        os.chmod(self.path, self.mode)
        self._listener.listen(64)
        threading.Thread(target=self._loop, name="arena-handout", daemon=True).start()

    def _loop(self) -> None:
        while not self._stopping.is_set():
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            with conn:
                conn.settimeout(2.0)
                try:
                    req = conn.recv(17)  # session id, then b"H" for the HBM pool's handle
                    sid, what = req[:16], req[16:]
                    with self.core.lock:
                        known = sid in self.core.sessions
                    if known and what == b"H":
                        if self.hbm_cache is not None:  # without an HBM tier the connection just closes
                            self.hbm_cache.handout(conn)
                    elif known:
                        send_fd(conn, self.arena.fd, self.arena.size_bytes)
                except OSError as e:
                    log.warning("arena handout failed: %s", e)

    def stop(self) -> None:
        self._stopping.set()
        if self._listener is not None:
            try:
                self._listener.close()
            except OSError:
                pass
        try:
            os.unlink(self.path)
        except OSError:
            pass
