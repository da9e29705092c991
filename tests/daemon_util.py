"""Start the real daemon as a process for tests; wait until it serves; stop it cleanly."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from kvstore.local import wait_serving


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class DaemonProc:
    proc: subprocess.Popen
    socket_path: str
    metrics_port: int
    log_path: Path
    args: list

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    def log(self) -> str:
        try:
            return self.log_path.read_text()
        except OSError:
            return ""

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, sig=signal.SIGTERM, timeout_s: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                raise AssertionError(f"daemon ignored {sig!r} for {timeout_s} s:\n{self.log()}")
        return self.proc.returncode

    def kill(self) -> None:
        self.stop(signal.SIGKILL)


def start_daemon(workdir: Path, *extra: str, dram: str = "64MiB", env: dict | None = None,
                 socket_path: str | None = None, metrics_port: int | None = None,
                 name: str = "kvstore", prefix: list[str] | None = None) -> DaemonProc:
    """Run ``python -m kvstore serve`` with a private socket, a small DRAM tier and a free metrics port."""
    workdir.mkdir(parents=True, exist_ok=True)
    sock = socket_path or str(workdir / f"{name}.sock")
    log_path = workdir / f"{name}.log"
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    for attempt in range(3):
        port = metrics_port or free_port()
        args = [sys.executable, "-m", "kvstore", "serve", "--server-socket-path", sock,
                "--dram-capacity-bytes", dram, "--dram-extent-bytes", "4MiB", "--metrics-port", str(port),
                "--metrics-host", "127.0.0.1", *extra]
        with open(log_path, "ab") as log:
            proc = subprocess.Popen([*(prefix or []), *args], stdout=log, stderr=subprocess.STDOUT, env=full_env)
        try:
            wait_serving(sock, proc, log_path)
            return DaemonProc(proc, sock, port, log_path, args)
        except RuntimeError as e:
            # The free port we picked was taken before the daemon bound it: pick another.
            if metrics_port or attempt == 2 or "metrics.port: cannot listen" not in str(e):
                raise
    raise AssertionError("unreachable")
