"""A pull asks the peer the cluster prefix directory names, and only that one: three real
daemons on a real etcd, each publishing its KV events; C reads A's and B's streams into its
directory. A advertises the namespace but lacks the chain, B holds it. Membership alone (every
peer advertising the namespace, in node-id order) would ask A first; the directory sends the
Push to B at once, and A is never asked. The same fleet shows ``kvstore cluster``'s daemon part:
C's streams from A and B (live, their entries), its directory's size, and A's lag growing
once A is frozen."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("zmq")

from kvstore.app.bench.cluster import fleet_certificates  # noqa: E402
from kvstore.clients import KVStoreClient  # noqa: E402
from kvstore.layout import KVLayout  # noqa: E402
from tests.daemon_util import free_port  # noqa: E402
from tests.etcd_util import EtcdServer, node, scraped  # noqa: E402
from tests.test_cluster_pull import pull  # noqa: E402
from tests.wait_util import wait_for  # noqa: E402

LAYOUT = KVLayout(4, 2, 64, "fp16")
NAMES = ("dir-a", "dir-b", "dir-c")
HEARTBEAT_S = 0.2  # an idle publisher's empty batch: a live stream's lag stays about under it


@pytest.fixture(scope="module")
def etcd(tmp_path_factory):
    server = EtcdServer(tmp_path_factory.mktemp("etcd")).start()
    yield server
    server.stop()


def spec(etcd, pki, name):
    return node(etcd, name, "--server-tcp-listen", f"127.0.0.1:{free_port()}",
                "--server-tls-cert-file", str(pki / f"{name}.crt"), "--server-tls-key-file", str(pki / f"{name}.key"),
                "--server-tls-client-ca-file", str(pki / "ca.crt"), "--transport-timeout-s", "5",
                "--events-publish", f"tcp://127.0.0.1:{free_port()}", "--events-replay", f"tcp://127.0.0.1:{free_port()}",
                "--events-heartbeat-s", str(HEARTBEAT_S), transfer_addr=f"127.0.0.1:{free_port()}")


def kv(tokens, seed):
    return np.random.default_rng(seed).standard_normal(LAYOUT.tensor_shape(len(tokens))).astype(np.float16)


def streams(client) -> dict[str, object]:
    """The daemon's peer streams from its Stats, by node id."""
    return {s.node_id: s for s in client.stats().streams}


def test_the_directory_names_the_holder_and_no_other_peer_is_asked(daemons, etcd, tmp_path, capsys):
    # No IP SANs: peers dial 127.0.0.1 and check that the certificate names the node id they
    # registered under (as under Helm, where a pod's certificate cannot name its IP).
    pki = fleet_certificates(tmp_path / "pki", NAMES, ips=())
    a, b, c = daemons.start(*(spec(etcd, pki, n) for n in NAMES))
    ca_, cb, cc = the_directory_names_the_holder(a, b, c, "dir-b")

    # `kvstore cluster --json` with C's socket: C reads A's and B's streams, live, with the
    # blocks each stored (A's 4, B's 4: the chain C pulled is C's own, never in its directory).
    wait_for(lambda: {n: (s.entries, s.state) for n, s in streams(cc).items()} == {"dir-a": (4, 0), "dir-b": (4, 0)},
             what="C's directory holds A's and B's blocks")
    out = subprocess.run([sys.executable, "-m", "kvstore", "cluster", "--etcd-endpoints", etcd.endpoint,
                          "--socket", c.socket_path, "--json"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    view = json.loads(out.stdout)
    assert {m["node_id"] for m in view["members"]} == set(NAMES)
    got = {s["node_id"]: s for s in view["daemon"]["streams"]}
    assert {n: (s["state"], s["entries"], s["held_batches"]) for n, s in got.items()} == \
        {"dir-a": ("live", 4, 0), "dir-b": ("live", 4, 0)}
    assert all(s["lag_s"] is not None and s["batches"] > 0 and s["snapshots"] == 1 for s in got.values())
    assert view["daemon"]["directory"]["entries"] == 8 and view["daemon"]["directory"]["blocks"] == 8
    assert view["daemon"]["directory"]["approx_bytes"] > 0
    assert scraped(c, "kvstore_cluster_directory_entries") == 8
    # A frozen: no heartbeat comes, so its lag grows past several heartbeats while B's stays
    # short, until A's lease runs out and C drops its stream.
    a.pause()
    try:
        lagging = wait_for(lambda: (st := streams(cc)).get("dir-a") and st["dir-a"].lag_s > 5 * HEARTBEAT_S and st,
                           what="A's lag past 5 heartbeats")
        assert lagging["dir-b"].lag_s < lagging["dir-a"].lag_s
        assert scraped(c, 'kvstore_cluster_stream_lag_seconds{peer="dir-a"}') > 0
    finally:
        a.proc.send_signal(signal.SIGCONT)
    # No daemon on the socket: the etcd part still answers, and one line says what is missing.
    from kvstore.cluster.cli import main

    capsys.readouterr()
    assert main(["--etcd-endpoints", etcd.endpoint, "--socket", str(tmp_path / "none.sock")]) == 0
    text = capsys.readouterr().out
    assert "dir-b" in text and f"daemon at {tmp_path / 'none.sock'}: no answer (UNAVAILABLE" in text


def the_directory_names_the_holder(a, b, c, holder: str):
    """A advertises the namespace without the chain, B holds it: C's pull asks B alone, and a
    chain nobody announced is a miss that asks no one. The clients of A, B and C."""
    ca_, cb, cc = (KVStoreClient(d.socket_path, timeout_s=10) for d in (a, b, c))
    for cl in (ca_, cb, cc):
        cl.register(LAYOUT, "dir-test")
    other, chain = list(range(5000, 5064)), list(range(0, 64))
    assert ca_.put(other, kv(other, 1)) == 4  # A advertises the namespace, without the chain
    assert cb.put(chain, kv(chain, 2)) == 4
    # Until C's directory has read B's blocks (and membership has A's namespace), a pull may
    # miss; once it lands it came from B.
    r = wait_for(lambda: (r := pull(c, cc, chain)).pulled and r, what="C pulls the chain")
    assert (r.pulled, r.holder) == (4, holder)
    out = np.zeros_like(kv(chain, 2))
    assert cc.get(chain, out) == 64 and np.array_equal(out, kv(chain, 2))
    assert scraped(a, 'kvstore_cluster_pushes_total{result="missing"}') == 0  # A was never asked
    assert scraped(b, 'kvstore_cluster_pushes_total{result="ok"}') == 1
    # A chain nobody's events announce is a miss without a Push to anyone.
    nowhere = list(range(9000, 9064))
    assert pull(c, cc, nowhere).pulled == 0
    assert scraped(a, 'kvstore_cluster_pushes_total{result="missing"}') == 0
    assert scraped(b, 'kvstore_cluster_pushes_total{result="missing"}') == 0
    return ca_, cb, cc
