"""Pulls between real daemons in one fleet on a real etcd, over mutual TLS (certificates made
here): a prefix stored on A is pulled by C and served bit-exact; blocks evicted on A, A killed,
and A back with a new epoch are each a clean miss on C (never an error, never old data), and
a Push naming A's old epoch is refused."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from kvstore.clients import KVStoreClient
from kvstore.layout import KVLayout
from kvstore.v1 import peer_pb2 as ppb, peer_pb2_grpc as peer_grpc
from tests.daemon_util import free_port
from tests.etcd_util import EtcdServer, node, registered, scraped
from tests.test_tls import _cert, _pem
from tests.wait_util import wait_for

LAYOUT = KVLayout(4, 2, 64, "fp16")  # 16-token blocks of 32 KiB
MODEL = "pull-test"


@pytest.fixture(scope="module")
def etcd(tmp_path_factory):
    server = EtcdServer(tmp_path_factory.mktemp("etcd")).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def fleet_pki(tmp_path_factory):
    """One CA and one certificate for 127.0.0.1 that every daemon serves and presents."""
    d = tmp_path_factory.mktemp("pki")
    ca, ca_key = _cert("fleet-ca", ca=True)
    for name, (c, k) in {"ca": (ca, ca_key), "node": _cert("localhost", ca, ca_key)}.items():
        cp, kp = _pem(c, k)
        (d / f"{name}.crt").write_bytes(cp)
        (d / f"{name}.key").write_bytes(kp)
    return d


def member(etcd, pki, name):
    port = free_port()
    return node(etcd, name, "--server-tcp-listen", f"127.0.0.1:{port}", "--server-tls-cert-file", str(pki / "node.crt"),
                "--server-tls-key-file", str(pki / "node.key"), "--server-tls-client-ca-file", str(pki / "ca.crt"),
                "--server-auth-token", "fleet-token", "--transport-timeout-s", "5")


def kv_for(tokens, seed):
    return np.random.default_rng(seed).standard_normal(LAYOUT.tensor_shape(len(tokens))).astype(np.float16)


def client(d) -> KVStoreClient:
    c = KVStoreClient(d.socket_path, timeout_s=10)
    c.register(LAYOUT, MODEL)
    return c


def pull(d, c: KVStoreClient, tokens, holder="", deadline_s=3.0) -> ppb.PullResponse:
    with grpc.insecure_channel(f"unix:{d.socket_path}") as ch:
        return peer_grpc.PeerStub(ch).Pull(ppb.PullRequest(session_id=c.session_id, keys=b"".join(c.keys(tokens)),
                                                           holder=holder, deadline_s=deadline_s), timeout=deadline_s + 10)


def test_a_prefix_is_pulled_from_its_holder_and_every_failure_is_a_clean_miss(daemons, etcd, fleet_pki, tmp_path):
    etcd_client = etcd.client()
    a, _b, c = daemons.start(*(member(etcd, fleet_pki, n) for n in ("pull-a", "pull-b", "pull-c")))
    ca_, cc = client(a), client(c)
    first, second, third = (list(range(s, s + 64)) for s in (0, 1000, 2000))
    for i, t in enumerate((first, second, third)):
        assert ca_.put(t, kv_for(t, i)) == 4
    # C pulls from whoever advertises the namespace: A (B holds none of it; C's own worker
    # registered it, but a daemon is never its own holder).
    wait_for(lambda: registered(etcd_client)["pull-a"]["namespaces"] == 1, what="A advertises the namespace")
    wait_for(lambda: scraped(c, "kvstore_cluster_members") == 3, what="C sees the fleet")
    assert cc.lookup(first) == 0
    r = pull(c, cc, first)
    assert (r.blocks, r.pulled, r.holder, r.holder_epoch, r.detail) == (4, 4, "pull-a", 1, "")
    out = np.zeros_like(kv_for(first, 0))
    assert cc.get(first, out) == 64 and np.array_equal(out, kv_for(first, 0))  # bit-exact, from C's DRAM
    assert pull(c, cc, first).pulled == 0  # already here: nothing moves

    # Evicted on A between C's lookup and its pull: a clean miss, nothing served.
    ca_.delete(ca_.keys(second))
    r = pull(c, cc, second, holder="pull-a")
    assert (r.blocks, r.pulled) == (0, 0) and "NOT_FOUND" in r.detail
    assert cc.lookup(second) == 0

    # A dies: C's pull fails within its deadline, as a miss; C stops listing A once its lease is gone.
    a.kill()
    r = pull(c, cc, third, holder="pull-a", deadline_s=2.0)
    assert (r.blocks, r.pulled) == (0, 0) and r.detail
    wait_for(lambda: scraped(c, "kvstore_cluster_members") == 2, what="C drops A after its lease")
    r = pull(c, cc, third, holder="pull-a")
    assert r.pulled == 0 and "not a registered peer" in r.detail

    # A back: a new epoch, its DRAM empty, so nothing of the old A is served; new blocks are.
    a2 = daemons.start(member(etcd, fleet_pki, "pull-a"))[0]
    wait_for(lambda: scraped(c, "kvstore_cluster_members") == 3, what="C lists A again")
    ca2 = client(a2)
    r = pull(c, cc, third, holder="pull-a")
    assert r.pulled == 0 and "NOT_FOUND" in r.detail
    assert ca2.put(third, kv_for(third, 2)) == 4
    r = pull(c, cc, third, holder="pull-a")
    assert (r.pulled, r.holder_epoch) == (4, 2)
    out = np.zeros_like(kv_for(third, 2))
    assert cc.get(third, out) == 64 and np.array_equal(out, kv_for(third, 2))

    # A Push naming A's old epoch, as a stale directory entry would: refused.
    creds = grpc.composite_channel_credentials(
        grpc.ssl_channel_credentials((fleet_pki / "ca.crt").read_bytes(), (fleet_pki / "node.key").read_bytes(),
                                     (fleet_pki / "node.crt").read_bytes()),
        grpc.access_token_call_credentials("fleet-token"))
    addr = registered(etcd_client)["pull-a"]["capabilities"]["control_addr"]
    with grpc.secure_channel(addr, creds) as ch:
        with pytest.raises(grpc.RpcError) as e:
            peer_grpc.PeerStub(ch).Push(ppb.PushRequest(requester="pull-c", requester_epoch=1, holder_epoch=1,
                                                        namespace_id=ca2.namespace.root, keys=b"".join(ca2.keys(third)),
                                                        deadline_s=2), timeout=10)
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "epoch" in e.value.details()
    assert scraped(c, 'kvstore_cluster_pulls_total{result="ok"}') == 2
    assert scraped(a2, 'kvstore_cluster_pushes_total{result="fenced"}') == 1
    for x in (cc, ca2):
        x.close()
    etcd_client.close()
