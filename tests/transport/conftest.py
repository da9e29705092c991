"""Fixtures for the transport tests: both backends over real loopback sockets / UCX endpoints.

UCX tests skip with the exact reason when ucxx cannot create a context here.
"""

from __future__ import annotations

import hashlib
import os
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from kvstore.transport import Listener, MemorySink, Sender, TransferConfig, ucx_available
from wait_util import wait_for  # noqa: F401 - the transport tests import it from here

PEER = str(Path(__file__).with_name("transport_peer.py"))


def pytest_generate_tests(metafunc):
    if "backend" not in metafunc.fixturenames:
        return
    backends = getattr(metafunc.module, "BACKENDS", ["tcp", "ucx"])  # a module may narrow this
    pool = getattr(metafunc.module, "POOL_VERIFY", False) and "ucx" in backends
    if pool and "verify_threads" in metafunc.fixturenames:
        # UCX again with its receiver hashing payloads once landed instead of as they are copied
        # in (the fused receive, where built), and again verifying chunks on a pool (auto picks
        # none on 2 CPUs).
        metafunc.parametrize("backend,verify_threads,fused_verify",
                             [(b, 0, True) for b in backends] + [("ucx", 0, False), ("ucx", 2, True)],
                             ids=[*backends, "ucx-landed", "ucx-pool"], indirect=["backend"])
    else:
        metafunc.parametrize("backend", backends, indirect=True)


@pytest.fixture
def verify_threads():
    """The listener's ``TransferConfig.verify_threads`` (parametrized where a module sets POOL_VERIFY)."""
    return -1


@pytest.fixture
def backend(request):
    if request.param == "ucx":
        ok, why = ucx_available()
        if not ok:
            pytest.skip(why)
    return request.param


@pytest.fixture
def fused_verify():
    """The listener's ``TransferConfig.ucx_fused_verify`` (parametrized with POOL_VERIFY)."""
    return True


@pytest.fixture
def config(backend, verify_threads, fused_verify):
    # With a pool, every chunk goes through it (the tests' chunks are under the 1 MiB default).
    return TransferConfig(backend=backend, default_deadline_s=20.0, verify_threads=verify_threads,
                          verify_min_bytes=0 if verify_threads > 0 else 1 << 20, ucx_fused_verify=fused_verify)


@pytest.fixture
def sink():
    return MemorySink(slot_bytes=256 << 10, n_slots=64)


@pytest.fixture
def listener(config, sink):
    lst = Listener(config, sink)
    lst.start()
    yield lst
    lst.stop()


@pytest.fixture
def sender(config):
    s = Sender(config)
    yield s
    s.close()


def make_payload(seed: int, blocks: int, layers: int, chunk: int):
    keys = [hashlib.sha256(f"{seed}:{b}".encode()).digest() for b in range(blocks)]
    data = np.random.default_rng(seed).integers(0, 256, (blocks, layers, chunk), dtype=np.uint8)
    return keys, data



class Peer:
    """A transport_peer.py subprocess whose stdout lines the test reads (through a reader
    thread: a selector on a buffered pipe can miss lines already read into the buffer)."""

    def __init__(self, *args: str, prefix: list[str] | None = None) -> None:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen([*(prefix or []), sys.executable, PEER, *args], stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, env=env)
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def expect(self, prefix: str, timeout_s: float = 20.0) -> str:
        """The next stdout line starting with ``prefix`` (its remainder)."""
        end = time.monotonic() + timeout_s
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, end - time.monotonic()))
            except queue.Empty:
                break
            if line is None:
                break
            if line.startswith(prefix):
                return line[len(prefix):].strip()
        self.kill()
        raise AssertionError(f"peer never printed {prefix!r}; stderr:\n{self.proc.stderr.read()[-3000:]}")

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)


@pytest.fixture(autouse=True)
def no_buffer_left_with_ucx(caplog):
    """Fail any test after which UCX still held a buffer the transport had released."""
    yield
    kept = [r.getMessage() for r in caplog.records if "after close" in r.getMessage()]
    assert not kept, kept
