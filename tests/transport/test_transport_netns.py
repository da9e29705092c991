"""The two peers in separate network namespaces joined by a veth pair, so traffic crosses a
real (virtual) link instead of loopback. The test creates the namespaces itself when it has
the rights (root with CAP_SYS_ADMIN and the ``ip`` tool) and skips, saying why, when not.
Only the test's own addresses (10.231.N.1-2/30 inside its namespaces) are used."""

from __future__ import annotations

import pytest

from conftest import Peer
from netns_util import veth_pair


@pytest.fixture(scope="module")
def netns():
    with veth_pair("kvt", 231) as pair:
        yield pair


def in_ns(ns: str) -> list[str]:
    return ["ip", "netns", "exec", ns]


def test_bit_exact_across_namespaces(netns, backend):
    (NS_A, ADDR_A), (NS_B, ADDR_B) = netns
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
    (NS_A, ADDR_A), (NS_B, ADDR_B) = netns
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
