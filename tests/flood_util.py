"""Peers that never finish a handshake, for the listener hardening tests: each connects from a
chosen loopback source address, sends a prefix (the start of a HELLO, a TLS record header, or
nothing) and then one byte every ``every_s``, and notes when the listener dropped it. A
:class:`Flood` keeps ``per_source`` such connections open from each source, reconnecting each one
the listener drops, as an attacker would."""

from __future__ import annotations

import errno
import socket
import threading
import time
from dataclasses import dataclass, field


@dataclass
class Trickler:
    """One connection: ``dropped_after`` is the seconds from connect to the listener's close."""

    target: tuple[str, int]
    source: str = "127.0.0.1"
    prefix: bytes = b""
    every_s: float | None = 1.0  # None: silent after the prefix
    body: bytes = b""            # trickled after the prefix (zero bytes once it runs out)
    sock: socket.socket | None = None
    t0: float = 0.0
    next_send: float = 0.0
    dropped_after: float | None = None
    pending: bytes = b""

    def connect(self) -> None:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((self.source, 0))
        s.setblocking(False)
        err = s.connect_ex(self.target)
        if err not in (0, errno.EINPROGRESS):
            s.close()
            raise OSError(err, f"connect from {self.source}")
        self.sock, self.t0, self.dropped_after = s, time.monotonic(), None
        self.pending = self.prefix + self.body + b"\x00" * 4096  # the prefix at once, then a byte at a time
        self.next_send = self.t0

    def poll(self, now: float) -> bool:
        """Send what is due; True while the connection is open."""
        if self.sock is None:
            return False
        try:
            data = self.sock.recv(4096)
            if data == b"":
                return self._dropped(now)
            # Bytes from the listener (a refusal): keep reading until it closes.
        except BlockingIOError:
            pass
        except OSError:
            return self._dropped(now)
        if now >= self.next_send and (self.every_s is not None or self.next_send == self.t0):
            n = len(self.prefix) if self.next_send == self.t0 else 1
            if n:
                try:
                    sent = self.sock.send(self.pending[:n])
                    self.pending = self.pending[sent:]
                except BlockingIOError:
                    pass  # not connected yet: try at the next poll
                except OSError:
                    return self._dropped(now)
            self.next_send = now + (self.every_s or 1e9)
        return True

    def _dropped(self, now: float) -> bool:
        self.dropped_after = now - self.t0
        self.sock.close()
        self.sock = None
        return False

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None


def watch(peers: list[Trickler], timeout_s: float) -> None:
    """Poll ``peers`` (connected) until each was dropped, or ``timeout_s``."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end and any(p.sock is not None for p in peers):
        now = time.monotonic()
        for p in peers:
            p.poll(now)
        time.sleep(0.02)


@dataclass
class Flood:
    """``per_source`` trickling connections from each of ``sources``, each re-opened at once
    when the listener drops it, on a thread of its own until :meth:`stop`."""

    target: tuple[str, int]
    sources: list[str]
    per_source: int = 8
    prefix: bytes = b""
    every_s: float = 1.0
    body: bytes = b""
    drops: list[float] = field(default_factory=list)  # seconds each dropped connection had lived
    connects: int = 0

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._peers = [Trickler(self.target, src, self.prefix, self.every_s, self.body)
                       for src in self.sources for _ in range(self.per_source)]
        self._thread = threading.Thread(target=self._run, name="flood", daemon=True)

    def start(self) -> "Flood":
        self._thread.start()
        return self

    def open_now(self) -> int:
        return sum(p.sock is not None for p in self._peers)

    def _run(self) -> None:
        while not self._stop.is_set():
            now = time.monotonic()
            for p in self._peers:
                if p.sock is None:
                    if p.dropped_after is not None:
                        self.drops.append(p.dropped_after)
                        p.dropped_after = None
                    try:
                        p.connect()
                        self.connects += 1
                    except OSError:
                        continue
                p.poll(now)
            time.sleep(0.05)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        for p in self._peers:
            p.close()
