"""A real etcd server (Debian's ``etcd-server``, ``make sysdeps``) for the cluster tests: one
member on a private data directory and free ports, started, stopped, killed and started again
on the same directory and port (as an operator's restart would)."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import urllib.request

import pytest

from kvstore.cluster.cli import collect
from kvstore.cluster.etcd import Etcd, EtcdError
from tests.daemon_util import DaemonSpec, free_port

# Cluster tests' leases: 3 s, renewed every second with 1 s deadlines (etcd's shortest lease is
# 2 s; on this shared 2-core machine a 0.5 s deadline was seen to miss).
TTL = 3


class EtcdServer:
    def __init__(self, workdir: Path, host: str = "127.0.0.1", prefix: list[str] | None = None) -> None:
        binary = shutil.which("etcd")
        if binary is None:
            pytest.skip("etcd is not installed (make sysdeps installs Debian's etcd-server)")
        self.binary = binary
        self.dir = workdir / "etcd"
        self.host = host
        self.prefix = prefix or []  # e.g. ["ip", "netns", "exec", NS]
        self.port, self.peer_port = free_port(), free_port()
        self.log_path = workdir / "etcd.log"
        self.proc: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self) -> "EtcdServer":
        client, peer = f"http://{self.host}:{self.port}", f"http://{self.host}:{self.peer_port}"
        self.dir.mkdir(mode=0o700, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [*self.prefix, self.binary, "--name", "t", "--data-dir", str(self.dir),
                 "--listen-client-urls", client, "--advertise-client-urls", client,
                 "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                 "--initial-cluster", f"t={peer}", "--log-level", "warn"],
                stdout=log, stderr=subprocess.STDOUT)
        self.wait_ready()
        return self

    def wait_ready(self, timeout_s: float = 20.0) -> None:
        if self.prefix:  # in a network namespace: ask from inside it
            deadline = time.monotonic() + timeout_s
            while cli_members(self.prefix, self.endpoint) is None:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"etcd not ready in {timeout_s} s:\n{self.log()[-3000:]}")
                time.sleep(0.1)
            return
        c = Etcd([self.endpoint])
        try:
            deadline = time.monotonic() + timeout_s
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"etcd exited with {self.proc.returncode}:\n{self.log()[-3000:]}")
                try:
                    c.put(b"/ready", b"1", timeout_s=1.0)  # a write needs a leader, not just a socket
                    return
                except EtcdError:
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"etcd not ready in {timeout_s} s:\n{self.log()[-3000:]}") from None
                    time.sleep(0.05)
        finally:
            c.close()

    def stop(self, sig=signal.SIGTERM) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def client(self) -> Etcd:
        return Etcd([self.endpoint])


def node(etcd: EtcdServer, name: str, *flags: str, **kw) -> DaemonSpec:
    """A daemon in the fleet on ``etcd`` as ``name``, with a TCP transfer listener."""
    return DaemonSpec(("--cluster-etcd-endpoints", etcd.endpoint, "--cluster-node-id", name,
                       "--cluster-lease-ttl-s", str(TTL), "--cluster-etcd-timeout-s", "1", "--dram-prefault", "false",
                       "--server-reaper-interval-s", "0.2", *flags), name=name, transfer="tcp", **kw)


def registered(etcd_client) -> dict[str, dict]:
    """Members as etcd holds them, by node id (``kvstore cluster``'s own reading)."""
    return {m["node_id"]: m for m in collect(etcd_client, "/kvstore", 2.0)["members"]}


def registered_revision(etcd_client) -> int:
    """The revision a watch starts at to see every change from now on."""
    return etcd_client.get_prefix(b"/kvstore/members/", 2.0)[1] + 1


def scraped(d, name: str) -> float:
    text = urllib.request.urlopen(d.metrics_url, timeout=5).read().decode()
    (value,) = [line.split()[1] for line in text.splitlines() if line.startswith(name + " ")]
    return float(value)


def cli_members(prefix: list[str], endpoint: str) -> dict[str, dict] | None:
    """``kvstore cluster --json`` run behind ``prefix`` (e.g. in the etcd's network namespace):
    the members by node id, or None while etcd does not answer."""
    out = subprocess.run([*prefix, sys.executable, "-m", "kvstore", "cluster", "--etcd-endpoints", endpoint, "--json",
                          "--timeout", "1"], capture_output=True, text=True, timeout=30)
    if out.returncode != 0:
        return None
    return {m["node_id"]: m for m in json.loads(out.stdout)["members"]}


def scraped_in(prefix: list[str], port: int, name: str) -> float:
    """:func:`scraped` for a daemon whose /metrics is on 127.0.0.1 of another network namespace."""
    script = ("import sys, urllib.request\n"
              f"t = urllib.request.urlopen('http://127.0.0.1:{port}/metrics', timeout=5).read().decode()\n"
              f"print([l.split()[1] for l in t.splitlines() if l.startswith({name + ' '!r})][0])")
    out = subprocess.run([*prefix, sys.executable, "-c", script], capture_output=True, text=True, timeout=30, check=True)
    return float(out.stdout)
