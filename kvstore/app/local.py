"""A private kvstore daemon run as a child process: what the benchmarks and the examples start.

``start_daemon(workdir, "name", *flags)`` runs ``python -m kvstore serve`` on a unix socket in
``workdir`` (metrics off, log in ``workdir/<name>.log``) and returns once it answers its health
check; ``LocalDaemon.stop()`` sends SIGTERM (a graceful shutdown) and returns the exit status.
A ``workdir`` too deep for a unix socket's path gets its sockets in a private directory under
the system's temporary directory instead, named after the work directory (removed at stop).
"""

from __future__ import annotations

import hashlib
import os
import secrets
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from kvstore.config import ARENA_SUFFIX, UNIX_PATH_MAX


@dataclass
class LocalDaemon:
    proc: subprocess.Popen
    socket_path: str
    log_path: Path
    socket_dir: str | None = None  # a private directory of its own for the sockets, removed at stop

    def stop(self, timeout_s: float = 60.0) -> int:
        """SIGTERM, wait up to ``timeout_s`` (then SIGKILL); the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.socket_dir is not None:
            shutil.rmtree(self.socket_dir, ignore_errors=True)
        return self.proc.returncode


_HANDED: set[int] = set()  # the ports free_port returned in this process
_HANDED_LOCK = threading.Lock()


def free_port(low: int = 20000, high: int | None = None) -> int:
    """A loopback TCP port nothing listens on right now, for a listener started next, and never
    one this process was handed before (two picks for one start, with nothing bound between
    them, could otherwise meet). Drawn at random in [low, high); ``high`` defaults to the
    bottom of the kernel's ephemeral range (ip_local_port_range, 32768 by default): a port the
    kernel hands out for bind(0) is also what it hands every outgoing connection, and one of
    those took such a port between the pick and the daemon's listen (CI saw EADDRINUSE)."""
    if high is None:
        try:
            with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
                high = int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            high = 32768
    if high <= low:
        raise ValueError(f"free_port: empty range [{low}, {high})")
    with _HANDED_LOCK:
        handed = {p for p in _HANDED if low <= p < high}
        if len(handed) == high - low:
            _HANDED.difference_update(handed)  # every one handed out: start the range again
        for _ in range(1000):
            port = low + secrets.randbelow(high - low)
            if port in _HANDED:
                continue
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue
            _HANDED.add(port)
            return port
    raise RuntimeError(f"no free loopback port in [{low}, {high})")


def wait_serving(socket_path: str, proc: subprocess.Popen, log_path: Path, timeout_s: float = 120.0) -> None:
    """Return once the daemon on ``socket_path`` answers its health check as SERVING; raise
    RuntimeError (with the end of its log) if ``proc`` exits or ``timeout_s`` passes first."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"daemon exited with {proc.returncode}:\n{log_path.read_text()[-4000:]}")
        if os.path.exists(socket_path):
            try:
                with grpc.insecure_channel(f"unix:{socket_path}") as ch:
                    r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=1)
                    if r.status == health_pb2.HealthCheckResponse.SERVING:
                        return
            except grpc.RpcError:
                pass
        time.sleep(0.05)
    proc.kill()
    proc.wait()
    raise RuntimeError(f"daemon not serving after {timeout_s} s:\n{log_path.read_text()[-4000:]}")


def _socket_dir(workdir: Path) -> str:
    """A private directory for the sockets of daemons run in ``workdir``: the same one for every
    start in that work directory, so a daemon restarted there (a benchmark's NVMe phase) is on
    the socket path its clients were given. Refused if something else already holds the name."""
    d = os.path.join(tempfile.gettempdir(), "kvstore-" + hashlib.sha256(os.fsencode(workdir.resolve())).hexdigest()[:16])
    try:
        os.mkdir(d, 0o700)
    except FileExistsError:
        st = os.lstat(d)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
            raise RuntimeError(f"{d}: exists and is not a private directory of this user; remove it") from None
    return d


def start_daemon(workdir: str | Path, name: str, *flags: str, timeout_s: float = 120.0) -> LocalDaemon:
    """Start ``kvstore serve`` with ``flags``; raises RuntimeError (with the log) if it exits or
    is not serving within ``timeout_s``."""
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    sock, sock_dir = str(workdir / f"{name}.sock"), None
    if len(os.fsencode(sock + ARENA_SUFFIX)) > UNIX_PATH_MAX:
        sock_dir = _socket_dir(workdir)
        sock = os.path.join(sock_dir, f"{name}.sock")
    log_path = workdir / f"{name}.log"
    args = [sys.executable, "-m", "kvstore", "serve", "--server-socket-path", sock, "--metrics-port", "0", *flags]
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        wait_serving(sock, proc, log_path, timeout_s)
    except BaseException:
        if sock_dir is not None:
            shutil.rmtree(sock_dir, ignore_errors=True)
        raise
    return LocalDaemon(proc, sock, log_path, sock_dir)
