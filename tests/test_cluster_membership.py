"""Membership on a real etcd (Debian's etcd-server) with real daemon processes: registration and
leave, lease expiry and the epoch that fences a node coming back, etcd stopped and started with
every daemon serving throughout, and lease renewal while the daemon's GIL is kept busy.

Leases are 3 s, renewed every second with 1 s deadlines (etcd's shortest lease is 2 s; on this
shared 2-core machine a 0.5 s deadline was seen to miss)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvstore.clients import KVStoreClient
from kvstore.cluster.etcd import Event
from kvstore.layout import KVLayout
from tests import busy_daemon
from tests.etcd_util import TTL, EtcdServer, node, registered, registered_revision, scraped
from tests.wait_util import wait_for

LAYOUT = KVLayout(4, 2, 64, "fp16")


@pytest.fixture(scope="module")
def etcd(tmp_path_factory):
    server = EtcdServer(tmp_path_factory.mktemp("etcd")).start()
    yield server
    server.stop()


@pytest.fixture
def etcd_client(etcd):
    c = etcd.client()
    yield c
    c.close()


def cluster_health(d) -> str:
    with grpc.insecure_channel(f"unix:{d.socket_path}") as ch:
        r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service="kvstore.v1.Cluster"), timeout=5)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)


def serves(d, tokens) -> bool:
    """A put and a bit-exact get through the daemon."""
    c = KVStoreClient(d.socket_path, timeout_s=10)
    try:
        c.register(LAYOUT, "cluster-test")
        kv = np.random.default_rng(len(tokens)).standard_normal(LAYOUT.tensor_shape(len(tokens))).astype(np.float16)
        c.put(tokens, kv)
        out = np.zeros_like(kv)
        return c.get(tokens, out) == len(tokens) and np.array_equal(out, kv)
    finally:
        c.close()


def test_daemons_register_see_each_other_advertise_namespaces_and_leave(daemons, etcd, etcd_client):
    a, b = daemons.start(node(etcd, "reg-a"), node(etcd, "reg-b"))
    seen = wait_for(lambda: (m := registered(etcd_client)).keys() >= {"reg-a", "reg-b"} and m, what="both registered")
    assert seen["reg-a"]["epoch"] == 1 and seen["reg-b"]["epoch"] == 1
    assert seen["reg-a"]["transfer_addr"] == a.transfer_addr and seen["reg-a"]["capabilities"]["transport"] == "tcp"
    assert 0 < seen["reg-a"]["lease_ttl_s"] <= TTL
    wait_for(lambda: scraped(a, "kvstore_cluster_members") >= 2 and scraped(b, "kvstore_cluster_members") >= 2,
             what="each daemon sees the other")
    assert cluster_health(a) == "SERVING"

    assert serves(a, list(range(64)))  # a namespace on a: advertised with the same lease and epoch
    m = wait_for(lambda: registered(etcd_client)["reg-a"]["namespaces"] == 1 and registered(etcd_client)["reg-a"],
                 what="a's namespace in its record")
    assert m["epoch"] == 1

    out = subprocess.run([sys.executable, "-m", "kvstore", "cluster", "--etcd-endpoints", etcd.endpoint, "--json"],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    shown = json.loads(out.stdout)
    assert {"reg-a", "reg-b"} <= {m["node_id"] for m in shown["members"]}
    assert shown["etcd"][0]["healthy"] and shown["etcd"][0]["version"].startswith("3.")

    b.stop_cleanly()  # leaving revokes the lease: gone at once, not a TTL later
    assert "reg-b" not in registered(etcd_client)
    wait_for(lambda: scraped(a, "kvstore_cluster_members") == len(registered(etcd_client)), what="a sees b leave")


def test_a_node_whose_lease_ran_out_comes_back_with_a_new_epoch(daemons, etcd, etcd_client):
    a, b = daemons.start(node(etcd, "fence-a"), node(etcd, "fence-b"))
    wait_for(lambda: {"fence-a", "fence-b"} <= registered(etcd_client).keys(), what="both registered")
    watch = etcd_client.watch_prefix(b"/kvstore/members/fence-b", registered_revision(etcd_client))
    events = iter(watch)
    b.proc.send_signal(signal.SIGSTOP)  # frozen past its TTL: etcd expires the lease
    try:
        _, evs = next(events)
        assert [e.type for e in evs] == [Event.DELETE]
        wait_for(lambda: scraped(a, "kvstore_cluster_members") == 1, what="a stops listing b")
    finally:
        b.proc.send_signal(signal.SIGCONT)
    _, evs = next(events)  # b notices its lease is gone and registers again
    assert [e.type for e in evs] == [Event.PUT] and json.loads(evs[0].kv.value)["epoch"] == 2
    watch.cancel()
    wait_for(lambda: scraped(b, "kvstore_cluster_epoch") == 2 and scraped(b, "kvstore_cluster_rejoins_total") == 1,
             what="b at epoch 2")
    wait_for(lambda: scraped(a, "kvstore_cluster_members") == 2, what="a lists b again")

    b.kill()  # a crash: the old lease lingers, the new process still gets a new epoch
    b2 = daemons.start(node(etcd, "fence-b"))[0]
    wait_for(lambda: registered(etcd_client).get("fence-b", {}).get("epoch") == 3, what="b restarted at epoch 3")
    # The gauge is set once registration returns, a moment after etcd has the record.
    wait_for(lambda: scraped(b2, "kvstore_cluster_epoch") == 3, what="b's gauge at epoch 3")


def test_etcd_stopped_and_restarted_every_daemon_serves_throughout_and_rejoins(daemons, etcd, etcd_client):
    a, b = daemons.start(node(etcd, "down-a"), node(etcd, "down-b"))
    wait_for(lambda: {"down-a", "down-b"} <= registered(etcd_client).keys(), what="both registered")
    etcd.stop()
    try:
        for i, d in enumerate((a, b)):  # nothing on the request path waits for etcd
            assert serves(d, list(range(1000 + 64 * i, 1064 + 64 * i)))
        wait_for(lambda: all(cluster_health(d) == "NOT_SERVING" for d in (a, b)), what="health says not registered")
        wait_for(lambda: all(scraped(d, "kvstore_cluster_epoch") == 0 for d in (a, b)),
                 what="each daemon withdraws its epoch once its lease may have run out")
        for i, d in enumerate((a, b)):
            assert serves(d, list(range(2000 + 64 * i, 2064 + 64 * i)))
            assert _health(d) == "SERVING"
    finally:
        etcd.start()
    wait_for(lambda: all(cluster_health(d) == "SERVING" for d in (a, b)), timeout_s=20, what="both rejoined")
    # etcd keeps leases across its restart and extends them: each daemon renews its old lease
    # and gets its epoch back, so peers never saw it leave (a new epoch needs a lease that ran out).
    m = registered(etcd_client)
    assert m["down-a"]["epoch"] == 1 and m["down-b"]["epoch"] == 1
    for d in (a, b):
        assert scraped(d, "kvstore_cluster_epoch") == 1 and scraped(d, "kvstore_cluster_rejoins_total") == 0
        assert scraped(d, 'kvstore_cluster_etcd_errors_total{op="keepalive"}') >= 1


def _health(d) -> str:
    with grpc.insecure_channel(f"unix:{d.socket_path}") as ch:
        r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)


def test_the_lease_never_expires_while_the_daemon_gil_is_busy(daemons, etcd, etcd_client):
    """Four threads spinning in pure Python (and the machine's two cores with them): the
    renewal thread still renews every third of the TTL, for 3 TTLs' worth of renewals."""
    d = daemons.start(node(etcd, "busy", launcher=busy_daemon.launcher(4)))[0]
    wait_for(lambda: "busy" in registered(etcd_client), what="registered")
    watch = etcd_client.watch_prefix(b"/kvstore/members/busy", registered_revision(etcd_client))
    start = scraped(d, "kvstore_cluster_lease_renew_seconds_count")
    wait_for(lambda: scraped(d, "kvstore_cluster_lease_renew_seconds_count") >= start + 9, timeout_s=30,
             what="nine renewals")
    etcd_client.put(b"/kvstore/members/busy-end", b"-", 2.0)  # ends the watch's window below
    changes = []
    for _, evs in watch:
        changes += [(e.type, e.kv.key) for e in evs]
        if any(k.endswith(b"busy-end") for _, k in changes):
            break
    watch.cancel()
    etcd_client.delete(b"/kvstore/members/busy-end", 2.0)
    assert [c for c in changes if not c[1].endswith(b"busy-end")] == [], "the lease expired under load"
    assert scraped(d, "kvstore_cluster_epoch") == 1 and scraped(d, "kvstore_cluster_rejoins_total") == 0
