"""The daemon's watch on client processes (:mod:`kvstore.daemon.peer_watch`) tells processes
apart by pidfd: a pid whose process exited, its exit not handled yet, may already name a new
process, whose sessions must not end with the old one. Real processes and pidfds; the daemon's
core is a stand-in holding sessions (what the watch reads and ends), and a test subclass holds
the watch's thread back as a busy daemon would."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest

from kvstore.daemon import peer_watch
from kvstore.daemon.peer_watch import PeerWatch
from wait_util import wait_for

pytestmark = pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="needs pidfds (Linux 5.3+)")


class Sessions(dict):
    def find(self, sid: bytes):
        return self.get(sid)


class Core:
    def __init__(self, *sids: bytes) -> None:
        self.lock = threading.Lock()
        self.sessions = Sessions({s: s for s in sids})
        self.ended: list[bytes] = []

    def close_session(self, s, why) -> int:
        self.ended.append(s)
        del self.sessions[s]
        return 0


class HeldBack(PeerWatch):
    """Handles an exit only once ``go`` is set."""

    def __init__(self, core) -> None:
        super().__init__(core)
        self.go = threading.Event()

    def _exited(self, pidfd: int) -> None:
        self.go.wait(30)
        super()._exited(pidfd)


def sleeper() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


def test_a_reused_pid_is_another_process(monkeypatch):
    monkeypatch.setattr(peer_watch, "peer_pidfd", lambda peer: peer)  # (pid, pidfd) as the kernel says
    a, b = sleeper(), sleeper()
    core = Core(b"A", b"B", b"B2")
    w = HeldBack(core)
    w.start()
    try:
        pid = 4242  # both processes seen under one pid: the second got the first one's, reused
        w.watch(b"A", (pid, os.pidfd_open(a.pid)))
        a.kill()
        a.wait()
        w.watch(b"B", (pid, os.pidfd_open(b.pid)))  # A's exit not handled yet
        w.watch(b"B2", (pid, os.pidfd_open(b.pid)))  # B again: the same live process, one pidfd
        assert len(w) == 2
        w.go.set()
        wait_for(lambda: core.ended == [b"A"], what="A's session to end with A")
        assert set(core.sessions) == {b"B", b"B2"} and len(w) == 1
        b.kill()
        b.wait()
        wait_for(lambda: not core.sessions, what="B's sessions to end with B")
        assert sorted(core.ended) == [b"A", b"B", b"B2"] and len(w) == 0
    finally:
        for p in (a, b):
            p.kill()
            p.wait()
        w.stop()
