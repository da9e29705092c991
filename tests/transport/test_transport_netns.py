"""The two peers in separate network namespaces joined by a veth pair, so traffic crosses a
real (virtual) link instead of loopback. The test creates the namespaces itself when it has
the rights (root with CAP_SYS_ADMIN and the ``ip`` tool) and skips, saying why, when not.
Only the test's own addresses (10.231.N.1-2/30 inside its namespaces) are used."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from conftest import Peer

SUFFIX = f"{os.getpid() % 100000}"
NS_A, NS_B = f"kvt-a-{SUFFIX}", f"kvt-b-{SUFFIX}"
NET = f"10.231.{os.getpid() % 250}"
ADDR_A, ADDR_B = f"{NET}.1", f"{NET}.2"


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=20)


@pytest.fixture(scope="module")
def netns():
    if shutil.which("ip") is None:
        pytest.skip("netns test: the `ip` tool (iproute2) is not installed")
    if os.geteuid() != 0:
        pytest.skip("netns test: needs root to create network namespaces")
    try:
        _ip("netns", "add", NS_A)
    except subprocess.CalledProcessError as exc:
        pytest.skip(f"netns test: cannot create a network namespace here: {exc.stderr.strip()}")
    try:
        _ip("netns", "add", NS_B)
        _ip("link", "add", f"kva{SUFFIX}", "type", "veth", "peer", "name", f"kvb{SUFFIX}")
        _ip("link", "set", f"kva{SUFFIX}", "netns", NS_A)
        _ip("link", "set", f"kvb{SUFFIX}", "netns", NS_B)
        for ns, dev, addr in ((NS_A, f"kva{SUFFIX}", ADDR_A), (NS_B, f"kvb{SUFFIX}", ADDR_B)):
            _ip("-n", ns, "addr", "add", f"{addr}/30", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        yield
    except subprocess.CalledProcessError as exc:
        pytest.skip(f"netns test: cannot wire the namespaces: {exc.stderr.strip()}")
    finally:
        for ns in (NS_A, NS_B):  # deleting a namespace deletes its end of the veth pair
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=20)


def in_ns(ns: str) -> list[str]:
    return ["ip", "netns", "exec", ns]


def test_bit_exact_across_namespaces(netns, backend):
    recv = Peer("recv", "--backend", backend, "--host", ADDR_B, "--port", "0", prefix=in_ns(NS_B))
    try:
        address = recv.expect("LISTEN ")
        assert address.startswith(ADDR_B)
        send = Peer("send", "--backend", backend, "--peer", address, "--blocks", "6", "--layers", "4",
                    "--chunk", str(128 << 10), "--seed", "21", prefix=in_ns(NS_A))
        try:
            tid = send.expect("TID ")
            sent = send.expect("DONE ")
        finally:
            send.kill()
        got = recv.expect(f"RESULT {tid} ")
    finally:
        recv.kill()
    assert sent.startswith("OK digest=")
    assert got == f"OK reserved=0 digest={sent.split('=', 1)[1]}"


def test_sender_killed_across_namespaces_releases_every_slot(netns, backend):
    recv = Peer("recv", "--backend", backend, "--host", ADDR_B, "--port", "0", prefix=in_ns(NS_B))
    try:
        address = recv.expect("LISTEN ")
        send = Peer("send", "--backend", backend, "--peer", address, "--blocks", "4", "--layers", "4",
                    "--chunk", str(64 << 10), "--stop-after", "5", "--deadline", "15", prefix=in_ns(NS_A))
        try:
            tid = send.expect("TID ")
            send.expect("HALF")
        finally:
            send.kill()
        got = recv.expect(f"RESULT {tid} ", timeout_s=15)
    finally:
        recv.kill()
    assert got.startswith("PEER_LOST reserved=0 ")
