"""Start the real daemon as a process for tests; wait until it serves; stop it and check that it
exited cleanly. Tests normally take the ``daemons`` / ``daemon`` fixtures (tests/conftest.py),
which stop what they started and fail a test whose daemon did not exit 0 on SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from kvstore.app.local import free_port as _free_port
from kvstore.app.local import wait_serving

LOG_TAIL = 4000  # characters of a daemon's log shown when it misbehaves
PORTS = (20000, 32768)  # below the kernel's ephemeral range (32768-60999 by default)


def worker_ports() -> tuple[int, int]:
    """This xdist worker's own slice of PORTS: the two workers each pick ports they bind a
    little later, and the same random pick in both once took a daemon's listener (EADDRINUSE in
    CI)."""
    n = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
    count = max(1, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
    span = (PORTS[1] - PORTS[0]) // count
    return PORTS[0] + n * span, PORTS[0] + (n + 1) * span


def free_port() -> int:
    """A free loopback port from this worker's slice (:func:`worker_ports`)."""
    return _free_port(*worker_ports())


# The benchmarks a test runs in this process pick their daemons' ports with kvstore's own
# free_port and its default range: keep those in this worker's slice too.
_free_port.__defaults__ = worker_ports()


@dataclass
class DaemonProc:
    proc: subprocess.Popen
    socket_path: str
    metrics_port: int
    log_path: Path
    args: list
    transfer_addr: str = ""  # host:port of its transfer listener, if it has one
    killed: bool = False     # SIGKILLed on purpose: its exit status says nothing

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def alive(self) -> bool:
        return self.proc.poll() is None

    def serving(self) -> "DaemonProc":
        """This daemon, once it answers its health check as SERVING; RuntimeError, with its log,
        if it exits or does not serve in time."""
        wait_serving(self.socket_path, self.proc, self.log_path)
        return self

    def stop(self, sig=signal.SIGTERM, timeout_s: float = 30.0) -> int:
        """Send ``sig`` (unless it has exited) and :meth:`wait` for the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.wait(timeout_s)

    def wait(self, timeout_s: float = 30.0) -> int:
        """The exit status, within ``timeout_s``; AssertionError, after a SIGKILL, if it is still
        running then (it ignored its signal)."""
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"daemon {self.log_path.stem} still running {timeout_s} s after its signal:\n"
                                 f"{self.log()[-LOG_TAIL:]}") from None

    def stop_cleanly(self, timeout_s: float = 30.0) -> None:
        """SIGTERM; AssertionError (with the end of its log) unless it exits 0 within ``timeout_s``."""
        rc = self.stop(timeout_s=timeout_s)
        assert rc == 0, self.unclean(rc)

    def unclean(self, rc: int) -> str:
        return f"daemon {self.log_path.stem} exited with {rc} on SIGTERM:\n{self.log()[-LOG_TAIL:]}"

    def kill(self) -> None:
        self.killed = True
        self.stop(signal.SIGKILL)

    def pause(self, timeout_s: float = 10.0) -> None:
        """SIGSTOP, and return once every thread of the daemon is stopped: a request sent before
        the signal took hold could still be answered (a paused peer once answered a Lookup sent
        right after its SIGSTOP, in CI)."""
        self.proc.send_signal(signal.SIGSTOP)
        task = Path(f"/proc/{self.proc.pid}/task")
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                states = [(t / "stat").read_text().rsplit(")", 1)[1].split()[0] for t in task.iterdir()]
            except (OSError, IndexError):
                states = []  # a thread ended while read: read again
            if states and all(x in "Tt" for x in states):
                return
            time.sleep(0.005)
        raise AssertionError(f"daemon {self.log_path.stem} not stopped {timeout_s} s after SIGSTOP")


def spawn(args: list[str], socket_path: str, log_path: Path, *, env: dict | None = None,
          prefix: list[str] | None = None, metrics_port: int = 0, transfer_addr: str = "",
          launcher: list[str] | None = None) -> DaemonProc:
    """Start ``python -m kvstore serve *args`` (behind ``prefix``, e.g. ``ip netns exec NS``;
    ``launcher`` replaces ``python -m kvstore``, e.g. tests/faulty_daemon.py's for a daemon with
    injected faults),
    its output appended to ``log_path``, and return at once: :meth:`DaemonProc.serving` waits
    for it. The caller's KVSTORE_* variables are dropped: a test daemon is configured by
    ``args`` and ``env`` only."""
    argv = [*(launcher or [sys.executable, "-m", "kvstore"]), "serve", *args]
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    full_env.update(PYTHONUNBUFFERED="1", **(env or {}))
    with open(log_path, "ab") as log:
        proc = subprocess.Popen([*(prefix or []), *argv], stdout=log, stderr=subprocess.STDOUT, env=full_env)
    return DaemonProc(proc, socket_path, metrics_port, log_path, argv, transfer_addr)


def launch(args: list[str], socket_path: str, log_path: Path, **kw) -> DaemonProc:
    """:func:`spawn`, returning once the daemon serves on ``socket_path``; RuntimeError, with its
    log, if it exits or does not serve in time."""
    return spawn(args, socket_path, log_path, **kw).serving()


def cluster_secret(workdir: Path) -> str:
    """A transfer secret file (0600) shared by the daemons of ``workdir``."""
    path = workdir / "transfer.secret"
    if not path.exists():
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.write(fd, os.urandom(32).hex().encode())
        os.close(fd)
    return str(path)


@dataclass
class DaemonSpec:
    """One daemon for :func:`start_daemons`: a private socket (``workdir/<name>.sock``), a small
    DRAM tier, a free metrics port, ``flags`` on top; with ``transfer`` (a backend) also a
    transfer listener on ``transfer_addr``, else on a free loopback port."""

    flags: tuple[str, ...] = ()
    name: str = "kvstore"
    dram: str = "64MiB"
    env: dict | None = None
    socket_path: str | None = None
    metrics_port: int | None = None
    prefix: list[str] | None = None
    transfer: str | None = None
    transfer_addr: str | None = None
    launcher: list[str] | None = None  # replaces ``python -m kvstore`` (see spawn)

    def spawn(self, workdir: Path) -> DaemonProc:
        sock = self.socket_path or str(workdir / f"{self.name}.sock")
        port = self.metrics_port or free_port()
        addr = (self.transfer_addr or f"127.0.0.1:{free_port()}") if self.transfer else ""
        listen = ["--transport-listen", addr, "--transport-backend", self.transfer] if self.transfer else []
        reachable = self.transfer == "ucx" or not addr.startswith("127.")
        if reachable and not any(f.startswith(("--transport-secret-file", "--transport-allow-unauth", "--transport-tls"))
                                 for f in self.flags):
            # UCX listens on every interface, and a listener on a namespace's bridge address is
            # reachable beyond the host, so such a daemon needs a secret: the daemons of one
            # workdir share one, so they authenticate to each other.
            listen += ["--transport-secret-file", cluster_secret(workdir)]
        args = ["--server-socket-path", sock, "--dram-capacity-bytes", self.dram, "--dram-extent-bytes", "4MiB",
                "--metrics-port", str(port), "--metrics-host", "127.0.0.1", *listen, *self.flags]
        return spawn(args, sock, workdir / f"{self.name}.log", env=self.env, prefix=self.prefix,
                     metrics_port=port, transfer_addr=addr, launcher=self.launcher)

    def port_was_taken(self, said: str) -> bool:
        """Whether the daemon's log ``said`` that a port picked for it was taken meanwhile."""
        return (not self.metrics_port and "metrics.port: cannot listen" in said) or \
            bool(self.transfer and not self.transfer_addr and "listener on 127.0.0.1" in said)


def start_daemons(workdir: Path, *specs: DaemonSpec) -> list[DaemonProc]:
    """Start a daemon for each spec at once (their start-ups overlap) and return them once each
    serves. A port picked here that something else takes before the daemon binds it (the
    daemon then exits saying so) is picked again. If one cannot start, the others are killed
    and its RuntimeError (with its log) is raised."""
    workdir.mkdir(parents=True, exist_ok=True)
    logged = [(workdir / f"{s.name}.log").stat().st_size if (workdir / f"{s.name}.log").exists() else 0
              for s in specs]
    started = [s.spawn(workdir) for s in specs]
    try:
        for i, spec in enumerate(specs):
            for attempt in range(3):
                try:
                    started[i].serving()
                    break
                except RuntimeError:
                    said = started[i].log_path.read_bytes()[logged[i]:].decode(errors="replace")  # this attempt's
                    if attempt == 2 or not spec.port_was_taken(said):
                        raise
                    logged[i] = started[i].log_path.stat().st_size
                    started[i] = spec.spawn(workdir)
    except BaseException:
        for d in started:
            if d.alive():
                d.kill()
        raise
    return started


def start_daemon(workdir: Path, *flags: str, **kw) -> DaemonProc:
    """One daemon: :class:`DaemonSpec` ``(flags, **kw)`` started by :func:`start_daemons`."""
    return start_daemons(workdir, DaemonSpec(flags, **kw))[0]


def stop_all(*daemons: DaemonProc) -> None:
    """Stop every daemon, then check that each one the test did not kill exited 0 (one that did
    not still lets the others be stopped). They shut down in parallel: each gets one SIGTERM
    (a second one would be taken as a forced exit), then each is waited for."""
    for d in daemons:
        if d.alive():
            d.proc.send_signal(signal.SIGTERM)
    bad = []
    for d in daemons:
        try:
            rc = d.wait()
        except AssertionError as e:
            bad.append(str(e))
            continue
        if rc != 0 and not d.killed:
            bad.append(d.unclean(rc))
    assert not bad, "\n\n".join(bad)


class Daemons:
    """The daemons a test (or a module) starts, stopped together by :meth:`stop_all`, which
    checks their exits. ``daemons(*flags, **kw)`` starts one (:class:`DaemonSpec`'s fields as
    keywords), :meth:`start` several at once, :meth:`launch` one with nothing added; each in
    ``workdir`` unless given another."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.started: list[DaemonProc] = []

    def __call__(self, *flags: str, workdir: Path | None = None, **kw) -> DaemonProc:
        return self.start(DaemonSpec(flags, **kw), workdir=workdir)[0]

    def start(self, *specs: DaemonSpec, workdir: Path | None = None) -> list[DaemonProc]:
        started = start_daemons(workdir or self.workdir, *specs)
        self.started += started
        return started

    def launch(self, args: list[str], socket_path: str, name: str = "kvstore", **kw) -> DaemonProc:
        """:func:`launch`: ``kvstore serve *args`` with nothing added (its log in ``workdir``)."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        d = launch(args, socket_path, self.workdir / f"{name}.log", **kw)
        self.started.append(d)
        return d

    def stop_all(self) -> None:
        stop_all(*self.started)
