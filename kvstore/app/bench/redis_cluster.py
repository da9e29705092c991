"""A real Redis-protocol cluster on loopback for the directory's benches and tests: ``masters``
``redis-server`` (or ``valkey-server``) processes in cluster mode on free ports, private
directories, an ACL password and optionally TLS, joined with ``redis-cli --cluster create``
(slots split evenly, no replicas). Debian's ``redis-server`` 7.0 (``make sysdeps``) has
everything this needs."""

from __future__ import annotations

import secrets
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path


def _free_port_pair() -> int:
    """A loopback port under 55536 free, with the one 10000 above it (the cluster bus) free too."""
    for _ in range(1000):
        port = secrets.randbelow(55535 - 20000) + 20000
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + 10000))
            return port
        except OSError:
            continue
    raise RuntimeError("no free loopback port pair for a redis cluster node")


def server_binaries() -> tuple[str, str] | None:
    """(server, cli) on PATH: valkey's where a machine has it, else redis's; None when neither."""
    for server, cli in (("valkey-server", "valkey-cli"), ("redis-server", "redis-cli")):
        s, c = shutil.which(server), shutil.which(cli)
        if s and c:
            return s, c
    return None


@dataclass(frozen=True)
class StoreTls:
    """PEM files: the servers' certificate and key (their CA: ``ca_file``), and for clients
    that must present one (``tls-auth-clients yes``), the CA they chain to (the same CA)."""

    ca_file: str
    cert_file: str
    key_file: str
    auth_clients: bool = False


class LocalRedisCluster:
    """``masters`` cluster-mode servers in ``work`` (private), started by :meth:`start`. The
    password (``password``) is written to ``password_file`` (mode 0600), as the daemon reads it."""

    def __init__(self, work: Path, masters: int = 3, *, tls: StoreTls | None = None, maxmemory: str = "") -> None:
        found = server_binaries()
        if found is None:
            raise FileNotFoundError("needs redis-server and redis-cli (Debian: apt-get install redis-server) "
                                    "or valkey-server and valkey-cli on PATH")
        self.server_bin, self.cli_bin = found
        self.work = work
        self.work.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.tls = tls
        self.maxmemory = maxmemory
        self.password = secrets.token_hex(16)
        self.password_file = work / "password"
        self.password_file.touch(mode=0o600)
        self.password_file.write_text(self.password + "\n")
        self.ports = [_free_port_pair() for _ in range(masters)]
        self.procs: dict[int, subprocess.Popen] = {}

    @property
    def nodes(self) -> str:
        """``host:port,...``: what ``cluster.redis_nodes`` takes."""
        return ",".join(f"127.0.0.1:{p}" for p in self.ports)

    def start(self) -> "LocalRedisCluster":
        for port in self.ports:
            self.start_node(port)
        for port in self.ports:
            self._wait_up(port)
        out = self._cli(self.ports[0], "--cluster", "create", *(f"127.0.0.1:{p}" for p in self.ports),
                        "--cluster-replicas", "0", "--cluster-yes", timeout_s=60)
        if out.returncode != 0:
            self.stop()
            raise RuntimeError(f"redis-cli --cluster create failed:\n{out.stdout[-2000:]}{out.stderr[-2000:]}")
        self.wait_ok()
        return self

    def _args(self, port: int) -> list[str]:
        d = self.work / str(port)
        d.mkdir(mode=0o700, exist_ok=True)
        args = [self.server_bin, "--bind", "127.0.0.1", "--dir", str(d), "--cluster-enabled", "yes",
                "--cluster-config-file", "nodes.conf", "--cluster-node-timeout", "2000",
                "--appendonly", "no", "--save", "", "--requirepass", self.password, "--masterauth", self.password,
                "--logfile", str(d / "server.log"), "--protected-mode", "yes"]
        if self.maxmemory:
            args += ["--maxmemory", self.maxmemory]
        if self.tls is None:
            return args + ["--port", str(port)]
        t = self.tls
        return args + ["--port", "0", "--tls-port", str(port), "--tls-cluster", "yes", "--tls-replication", "yes",
                       "--tls-cert-file", t.cert_file, "--tls-key-file", t.key_file, "--tls-ca-cert-file", t.ca_file,
                       "--tls-auth-clients", "yes" if t.auth_clients else "no"]

    def start_node(self, port: int) -> None:
        """Start (or restart, on its own directory and port) the server of ``port``."""
        self.procs[port] = subprocess.Popen(self._args(port), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def _cli(self, port: int, *args: str, timeout_s: float = 10) -> subprocess.CompletedProcess:
        tls = ["--tls", "--cacert", self.tls.ca_file] if self.tls else []
        if self.tls and self.tls.auth_clients:
            tls += ["--cert", self.tls.cert_file, "--key", self.tls.key_file]
        # REDISCLI_AUTH keeps the password off the command line (ps)
        return subprocess.run([self.cli_bin, "-h", "127.0.0.1", "-p", str(port), *tls, *args], capture_output=True,
                              text=True, timeout=timeout_s, env={"REDISCLI_AUTH": self.password, "PATH": "/usr/bin:/bin"})

    def cli(self, port: int, *args: str) -> str:
        """One redis-cli command on ``port``'s server; its output."""
        return self._cli(port, *args).stdout.strip()

    def _wait_up(self, port: int, timeout_s: float = 20) -> None:
        deadline = time.monotonic() + timeout_s
        while self.cli(port, "PING") != "PONG":
            if self.procs[port].poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"redis server on {port} did not start: "
                                   + self.log(port)[-2000:])
            time.sleep(0.05)

    def wait_ok(self, timeout_s: float = 30) -> None:
        """Until every node says the cluster is ok (all slots served)."""
        deadline = time.monotonic() + timeout_s
        while not all("cluster_state:ok" in self.cli(p, "CLUSTER", "INFO") for p in self.ports if self.alive(p)):
            if time.monotonic() > deadline:
                raise RuntimeError("redis cluster not ok in time: " + self.cli(self.ports[0], "CLUSTER", "INFO"))
            time.sleep(0.1)

    def alive(self, port: int) -> bool:
        p = self.procs.get(port)
        return p is not None and p.poll() is None

    def log(self, port: int) -> str:
        try:
            return (self.work / str(port) / "server.log").read_text(errors="replace")
        except OSError:
            return ""

    def stop_node(self, port: int, kill: bool = False) -> None:
        p = self.procs.get(port)
        if p is None or p.poll() is not None:
            return
        p.kill() if kill else p.terminate()
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()

    def pause_node(self, port: int) -> None:
        """SIGSTOP: the server holds its connections and answers nothing (a hung store)."""
        self.procs[port].send_signal(19)

    def resume_node(self, port: int) -> None:
        self.procs[port].send_signal(18)

    def info(self, port: int, section: str) -> dict[str, str]:
        out = {}
        for line in self.cli(port, "INFO", section).splitlines():
            k, sep, v = line.partition(":")
            if sep:
                out[k.strip()] = v.strip()
        return out

    def stop(self) -> None:
        for port in self.ports:
            if self.alive(port):
                self.procs[port].send_signal(18)  # a paused server cannot take SIGTERM's exit
            self.stop_node(port)
