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
    transfer_addr: str = ""  # host:port of its transfer listener, if it has one

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
                 name: str = "kvstore", prefix: list[str] | None = None,
                 transfer: str | None = None, transfer_addr: str | None = None,
                 launcher: list[str] | None = None) -> DaemonProc:
    """Run ``python -m kvstore serve`` with a private socket, a small DRAM tier and a free metrics
    port; with ``transfer`` (a backend) also a transfer listener on ``transfer_addr``, else on a
    free loopback port. A port picked here that something else takes before the daemon binds it
    (the daemon then exits saying so) is picked again. ``launcher`` replaces ``python -m kvstore``
    (e.g. tests/faulty_daemon.py's, for a daemon with injected faults)."""
    workdir.mkdir(parents=True, exist_ok=True)
    sock = socket_path or str(workdir / f"{name}.sock")
    log_path = workdir / f"{name}.log"
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    for attempt in range(3):
        port = metrics_port or free_port()
        addr = (transfer_addr or f"127.0.0.1:{free_port()}") if transfer else ""
        listen = ["--transport-listen", addr, "--transport-backend", transfer] if transfer else []
        args = [*(launcher or [sys.executable, "-m", "kvstore"]), "serve", "--server-socket-path", sock,
                "--dram-capacity-bytes", dram, "--dram-extent-bytes", "4MiB", "--metrics-port", str(port),
                "--metrics-host", "127.0.0.1", *listen, *extra]
        logged = log_path.stat().st_size if log_path.exists() else 0
        with open(log_path, "ab") as log:
            proc = subprocess.Popen([*(prefix or []), *args], stdout=log, stderr=subprocess.STDOUT, env=full_env)
        try:
            wait_serving(sock, proc, log_path)
            return DaemonProc(proc, sock, port, log_path, args, addr)
        except RuntimeError:
            said = log_path.read_bytes()[logged:].decode(errors="replace")  # this attempt's log only
            taken = (not metrics_port and "metrics.port: cannot listen" in said) or \
                    (transfer and not transfer_addr and "listener on 127.0.0.1" in said)
            if attempt == 2 or not taken:
                raise


def stop_all(*daemons: DaemonProc) -> None:
    """Stop every daemon, then check that each exited cleanly (one that did not still lets the
    others be stopped)."""
    codes = [d.stop() for d in daemons]
    assert codes == [0] * len(codes), codes
