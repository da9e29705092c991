"""RouteHints, for request routers: three real daemons on a real etcd with the cluster directory
(their KV event streams). A holds a prompt in DRAM, B on its NVMe only, C its first two blocks.
Asked at C, the hints list all three with their cached tokens by tier and the modelled time to
the prompt's KV, fastest first; the same over HTTP/JSON on C's hints listener (mutual TLS), which
a client without a certificate cannot reach and a trickling client does not hold up. Bad
requests get clear errors; a hint counts no policy decision."""

from __future__ import annotations

import json
import socket
import ssl
import time
import urllib.error
import urllib.request

import grpc
import numpy as np
import pytest

pytest.importorskip("zmq")

from kvstore.app.bench.cluster import fleet_certificates  # noqa: E402
from kvstore.clients import KVStoreClient  # noqa: E402
from kvstore.clients.client import KVStoreError  # noqa: E402
from kvstore.layout import KVLayout  # noqa: E402
from kvstore.v1 import kvstore_pb2 as pb  # noqa: E402
from tests.daemon_util import free_port  # noqa: E402
from tests.etcd_util import EtcdServer, node, scraped  # noqa: E402
from tests.wait_util import wait_for  # noqa: E402

LAYOUT = KVLayout(4, 2, 64, "fp16")  # 16-token blocks of 32 KiB
NAMES = ("hint-a", "hint-b", "hint-c")
BT = 16


@pytest.fixture(scope="module")
def etcd(tmp_path_factory):
    server = EtcdServer(tmp_path_factory.mktemp("etcd")).start()
    yield server
    server.stop()


def spec(etcd, pki, name, *flags):
    return node(etcd, name, "--server-tcp-listen", f"127.0.0.1:{free_port()}",
                "--server-tls-cert-file", str(pki / f"{name}.crt"), "--server-tls-key-file", str(pki / f"{name}.key"),
                "--server-tls-client-ca-file", str(pki / "ca.crt"), "--transport-timeout-s", "5",
                "--events-publish", f"tcp://127.0.0.1:{free_port()}", "--events-replay", f"tcp://127.0.0.1:{free_port()}",
                "--events-heartbeat-s", "0.2", "--policy-prefill-tokens-per-s", "2000", *flags,
                transfer_addr=f"127.0.0.1:{free_port()}")


def kv(tokens, seed):
    return np.random.default_rng(seed).standard_normal(LAYOUT.tensor_shape(len(tokens))).astype(np.float16)


def client(d) -> KVStoreClient:
    c = KVStoreClient(d.socket_path, timeout_s=10)
    c.register(LAYOUT, "hints-test")
    return c


def test_hints_name_each_holder_by_tier_and_time_over_grpc_and_https(daemons, etcd, tmp_path):
    pki = fleet_certificates(tmp_path / "pki", (*NAMES, "router", "stranger-ca-less"), ips={"127.0.0.1"})
    hints_port = free_port()
    nvme = ("--nvme-dir", str(tmp_path / "nvme-b"), "--nvme-capacity-bytes", "64MiB", "--nvme-file-bytes", "64MiB",
            "--dram-capacity-bytes", "8MiB")
    a, b, c = daemons.start(spec(etcd, pki, "hint-a"), spec(etcd, pki, "hint-b", *nvme),
                            spec(etcd, pki, "hint-c", "--server-hints-listen", f"127.0.0.1:{hints_port}"))
    ca_, cb, cc = client(a), client(b), client(c)
    prompt = list(range(8 * BT))
    assert ca_.put(prompt, kv(prompt, 1)) == 8
    assert cb.put(prompt, kv(prompt, 1)) == 8
    for s in range(5):  # pushed out of B's 8 MiB of DRAM: on its NVMe only
        filler = list(range(100_000 + s * 1024, 100_000 + (s + 1) * 1024))
        assert cb.put(filler, kv(filler, 0)) == 64
    wait_for(lambda: bytes(cb.lookup_keys(cb.keys(prompt)).tiers) == bytes([pb.TIER_NVME] * 8), what="B's NVMe only")
    assert cc.put(prompt[:2 * BT], np.ascontiguousarray(kv(prompt, 1)[:, :, :2 * BT])) == 2
    decisions = scraped(c, 'kvstore_policy_decisions_total{decision="load"}')

    def held(r):
        return {n.node_id: (n.hbm_tokens, n.dram_tokens, n.nvme_tokens) for n in r.nodes}

    want = {"hint-a": (0, 128, 0), "hint-b": (0, 0, 128), "hint-c": (0, 32, 0)}
    r = wait_for(lambda: (r := cc.route_hints(token_ids=prompt)) and held(r) == want and r, what="C's directory has A and B")
    assert r.prompt_tokens == 128 and r.reason == ""
    by = {n.node_id: n for n in r.nodes}
    # A loads all of it from DRAM: fastest, and faster than recomputing the whole prompt;
    # B reads it off NVMe first; C holds 2 blocks and gets the rest from A or recomputes it.
    assert [n.node_id for n in r.nodes][0] == "hint-a" and by["hint-a"].advice == pb.ADVICE_LOAD
    assert by["hint-a"].time_to_kv_s < by["hint-b"].time_to_kv_s < r.recompute_s
    assert by["hint-a"].time_to_kv_s < by["hint-c"].time_to_kv_s <= r.recompute_s
    assert by["hint-c"].local and not by["hint-a"].local
    if by["hint-c"].advice == pb.ADVICE_PULL:
        assert by["hint-c"].pull_from == "hint-a"
    assert [n.time_to_kv_s for n in r.nodes] == sorted(n.time_to_kv_s for n in r.nodes)
    # by keys, the same answer; at most one node when asked so
    assert held(cc.route_hints(keys=cc.keys(prompt))) == want
    assert [n.node_id for n in cc.route_hints(token_ids=prompt, max_nodes=1).nodes] == ["hint-a"]
    # a node not listed holds none of it: it would pull from A or recompute, no slower than that
    assert by["hint-a"].time_to_kv_s < r.elsewhere_s <= r.recompute_s
    # a prompt nobody holds: this daemon alone, recomputing, as anywhere else
    other = cc.route_hints(token_ids=list(range(50_000, 50_064)))
    assert [(n.node_id, n.advice) for n in other.nodes] == [("hint-c", pb.ADVICE_RECOMPUTE)]
    assert other.nodes[0].time_to_kv_s == pytest.approx(other.recompute_s) == pytest.approx(other.elsewhere_s)
    # read-only: no decision counted, and B's blocks are still where they were
    assert scraped(c, 'kvstore_policy_decisions_total{decision="load"}') == decisions

    # Bad requests: a clear error each, and the daemon answers on.
    ns = cc.namespace.root
    for req, code, what in (
            (pb.RouteHintsRequest(namespace_id=b"short"), grpc.StatusCode.INVALID_ARGUMENT, "32"),
            (pb.RouteHintsRequest(namespace_id=b"\0" * 32, token_ids=[1] * 16), grpc.StatusCode.NOT_FOUND, "not held"),
            (pb.RouteHintsRequest(namespace_id=ns, keys=b"x" * 33), grpc.StatusCode.INVALID_ARGUMENT, "32 per block"),
            (pb.RouteHintsRequest(namespace_id=ns, keys=b"x" * 32, token_ids=[1]), grpc.StatusCode.INVALID_ARGUMENT, "not both"),
            (pb.RouteHintsRequest(namespace_id=ns, token_ids=[2**31] * 16), grpc.StatusCode.INVALID_ARGUMENT, "int32"),
            (pb.RouteHintsRequest(namespace_id=ns, token_ids=[1] * 16, max_nodes=65), grpc.StatusCode.INVALID_ARGUMENT,
             "max_nodes")):
        with pytest.raises(KVStoreError) as e:
            cc.call("RouteHints", req)
        assert e.value.code == code and what in str(e.value), str(e.value)

    # HTTP/JSON on C's hints listener, with a client certificate of the fleet's CA.
    url = f"https://127.0.0.1:{hints_port}/v1/route-hints"
    tls = ssl.create_default_context(cafile=str(pki / "ca.crt"))
    tls.check_hostname = False
    tls.load_cert_chain(str(pki / "router.crt"), str(pki / "router.key"))

    def post(body, ctx=tls, path=""):
        req = urllib.request.Request(url + path, json.dumps(body).encode(), {"content-type": "application/json"})
        try:
            with urllib.request.urlopen(req, context=ctx, timeout=10) as resp:
                return resp.status, json.load(resp)
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    # a client holding the connection open without a byte does not hold up the others
    idle = socket.create_connection(("127.0.0.1", hints_port))
    try:
        t = time.monotonic()
        status, body = post({"namespace_id": ns.hex(), "token_ids": prompt})
        assert time.monotonic() - t < 5
    finally:
        idle.close()
    assert status == 200
    assert {n["node_id"]: (n["hbm_tokens"], n["dram_tokens"], n["nvme_tokens"]) for n in body["nodes"]} == want
    assert body["nodes"][0]["node_id"] == "hint-a" and body["nodes"][0]["advice"] == "load"
    assert body["prompt_tokens"] == 128 and body["elsewhere_s"] == pytest.approx(r.elsewhere_s, rel=0.5)
    assert post({"namespace_id": ns.hex(), "keys": [k.hex() for k in cc.keys(prompt)]})[1]["nodes"] == body["nodes"]
    for bad, code in (({"namespace_id": "zz"}, 400), ({"namespace_id": ns.hex(), "token_ids": ["a"]}, 400),
                      ({"namespace_id": "00" * 32, "token_ids": prompt}, 404), ([1, 2], 400)):
        status, err = post(bad)
        assert status == code and err["error"], (bad, status, err)
    assert post({}, path="x")[0] == 404
    # without a client certificate: no TLS session, no answer
    bare = ssl.create_default_context(cafile=str(pki / "ca.crt"))
    bare.check_hostname = False
    with pytest.raises((ssl.SSLError, urllib.error.URLError, ConnectionError)):
        post({"namespace_id": ns.hex(), "token_ids": prompt}, ctx=bare)
    for x in (ca_, cb, cc):
        x.close()
