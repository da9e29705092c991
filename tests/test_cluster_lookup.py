"""Lookup in a fleet (two real daemons on a real etcd, mutual TLS, loopback): remote hits from
a peer's Lookup, the advice among load, pull and recompute, a worker acting on a PULL advice,
and the per-peer link estimate that the first timed pull replaces the configured prior with.
A paused peer costs a Lookup no more than the peer lookups' deadline. Without a cluster a
Lookup's answer carries none of the new fields."""

from __future__ import annotations

import signal

import grpc
import numpy as np
import pytest

from kvstore.app import cli
from kvstore.app.bench.cluster import fleet_certificates
from kvstore.clients import KVStoreClient
from kvstore.layout import KVLayout
from kvstore.v1 import kvstore_pb2 as pb, peer_pb2 as ppb, peer_pb2_grpc as peer_grpc
from tests.daemon_util import free_port
from tests.etcd_util import EtcdServer, node, scraped
from tests.wait_util import wait_for

LAYOUT = KVLayout(4, 2, 64, "fp16")  # 16-token blocks of 32 KiB
MODEL = "lookup-test"
BT = LAYOUT.block_tokens


@pytest.fixture(scope="module")
def etcd(tmp_path_factory):
    server = EtcdServer(tmp_path_factory.mktemp("etcd")).start()
    yield server
    server.stop()


def member(etcd, pki, name, *flags, control=""):
    return node(etcd, name, "--server-tcp-listen", control or f"127.0.0.1:{free_port()}",
                "--server-tls-cert-file", str(pki / f"{name}.crt"), "--server-tls-key-file", str(pki / f"{name}.key"),
                "--server-tls-client-ca-file", str(pki / "ca.crt"), "--dram-capacity-bytes", "16MiB",
                "--policy-prefill-tokens-per-s", "50",
                # a peer's answer over loopback TLS can take more than the default 50 ms on a loaded
                # 2-core host; what is tested is which answer the advice follows, not how fast it comes
                "--cluster-peer-lookup-timeout-s", "2", *flags, transfer_addr=f"127.0.0.1:{free_port()}")


def kv_for(tokens, seed=0):
    return np.random.default_rng(seed).standard_normal(LAYOUT.tensor_shape(len(tokens))).astype(np.float16)


def client(d) -> KVStoreClient:
    c = KVStoreClient(d.socket_path, timeout_s=10)
    c.register(LAYOUT, MODEL)
    return c


def test_lookup_names_a_peers_extension_and_the_advice_follows_the_measured_link(daemons, etcd, tmp_path, capsys):
    pki = fleet_certificates(tmp_path / "pki", ("look-a", "look-c"), {"127.0.0.1"})
    # C assumes a 10 kB/s link until it has timed a pull: pulling 6 blocks (192 KiB) then looks
    # ten times slower (20 s) than recomputing them (96 tokens at a modelled 50 tokens/s: 1.9 s);
    # a loopback pull is far faster than either, even a first one on a host at load 30 (0.3 s).
    control_a = f"127.0.0.1:{free_port()}"
    a, c = daemons.start(member(etcd, pki, "look-a", control=control_a),
                         member(etcd, pki, "look-c", "--cluster-link-prior-bytes-per-s", "1e4"))
    ca_, cc = client(a), client(c)
    prompts = [list(range(s, s + 8 * BT)) for s in (0, 10_000)]
    for i, t in enumerate(prompts):
        assert ca_.put(t, kv_for(t, i)) == 8
        assert cc.put(t[:2 * BT], np.ascontiguousarray(kv_for(t, i)[:, :, :2 * BT])) == 2  # C holds the first two blocks
    wait_for(lambda: cc.lookup_keys(cc.keys(prompts[0]), ask_peers=True).remote_blocks == 6, what="C sees A's extension")

    keys = cc.keys(prompts[0])
    # Not asked to ask the peers: no round trip, no remote hits, the local advice.
    r = cc.call("Lookup", pb.LookupRequest(session_id=cc.session_id, keys=b"".join(keys)))
    assert (r.hit_blocks, r.remote_blocks, r.advice) == (2, 0, pb.ADVICE_LOAD)
    r = cc.call("Lookup", pb.LookupRequest(session_id=cc.session_id, keys=b"".join(keys), ask_peers=True))
    assert (r.hit_blocks, r.remote_blocks, r.remote_node_id, r.remote_epoch, r.remote_tier) == (2, 6, "look-a", 1, pb.TIER_DRAM)
    assert r.advice == pb.ADVICE_LOAD and r.load_blocks == 2, r.reason  # the prior link is too slow
    assert r.time_if_load_s < r.time_if_pull_s and r.time_if_load_s < r.time_if_recompute_s
    link = {x.node_id: x for x in cc.stats().links}["look-a"]
    assert link.round_trips >= 1 and link.pulls == 0 and link.bytes_per_s == 1e4

    # The worker pulls anyway (a named holder); the pull is timed and the link is then known.
    assert cc.pull(keys, "look-a").pulled == 6
    link = {x.node_id: x for x in cc.stats().links}["look-a"]
    assert link.pulls == 1 and link.bytes_per_s > 1e4
    assert scraped(c, 'kvstore_cluster_link_bandwidth_bytes_per_second{peer="look-a"}') == link.bytes_per_s
    assert cli.main(["stats", "--socket", c.socket_path]) == 0
    assert "peer look-a" in capsys.readouterr().out

    # Over the measured (loopback) link the second prompt's extension is worth pulling, and
    # acting on the advice leaves the whole prefix local, bit-exact.
    keys = cc.keys(prompts[1])
    res = cc.lookup_keys(keys, ask_peers=True)
    assert (res.advice, res.hit_blocks, res.remote_blocks, res.remote_node_id) == ("pull", 2, 6, "look-a"), res.reason
    assert res.est_pull_s > 0
    assert cc.advised_blocks(res, keys) == 8
    out = np.zeros_like(kv_for(prompts[1]))
    assert cc.get(prompts[1], out) == 8 * BT and np.array_equal(out, kv_for(prompts[1], 1))
    # All local now: loading wins, and no peer has more.
    res = cc.lookup_keys(keys, ask_peers=True)
    assert (res.advice, res.hit_blocks, res.remote_blocks) == ("load", 8, 0)
    # Nothing anywhere: recompute.
    res = cc.lookup_keys(cc.keys(list(range(50_000, 50_000 + 4 * BT))), ask_peers=True)
    assert (res.advice, res.hit_blocks, res.remote_blocks) == ("recompute", 0, 0)
    assert scraped(c, 'kvstore_cluster_advice_total{advice="pull"}') >= 1

    # A peer's Lookup tells what a daemon holds only to a fleet member its certificate names:
    # not over the unix socket (no certificate), not to a certificate claiming another node.
    req = ppb.PeerLookupRequest(requester="look-c", namespace_id=ca_.namespace.root, keys=b"".join(keys))
    with grpc.insecure_channel(f"unix:{a.socket_path}") as ch:
        with pytest.raises(grpc.RpcError) as e:
            peer_grpc.PeerStub(ch).Lookup(req, timeout=5)
    assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED and "no client certificate" in e.value.details()
    read = lambda n: (pki / n).read_bytes()  # noqa: E731
    creds = grpc.ssl_channel_credentials(read("ca.crt"), read("look-c.key"), read("look-c.crt"))
    with grpc.secure_channel(control_a, creds) as ch:
        r = peer_grpc.PeerStub(ch).Lookup(req, timeout=5)
        assert (r.blocks, bytes(r.tiers), r.epoch) == (8, bytes([pb.TIER_DRAM] * 8), 1)
        req.requester = "look-a"
        with pytest.raises(grpc.RpcError) as e:
            peer_grpc.PeerStub(ch).Lookup(req, timeout=5)
        assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED

    # A stalled peer (paused, still registered) holds up no Lookup beyond the peer lookups'
    # deadline: the answer comes without its blocks, advising from what is local.
    fresh = list(range(20_000, 20_000 + 4 * BT))
    assert ca_.put(fresh, kv_for(fresh, 5)) == 4
    a.pause()
    try:
        res = cc.lookup_keys(cc.keys(fresh), ask_peers=True)
    finally:
        a.proc.send_signal(signal.SIGCONT)
    assert (res.advice, res.hit_blocks, res.remote_blocks) == ("recompute", 0, 0)
    for x in (ca_, cc):
        x.close()


def test_without_a_cluster_lookup_answers_as_before(daemon):
    c = client(daemon)
    t = list(range(4 * BT))
    assert c.put(t, kv_for(t)) == 4
    keys = c.keys(t + list(range(10**6, 10**6 + BT)))
    r = c.call("Lookup", pb.LookupRequest(session_id=c.session_id, keys=b"".join(keys), ask_peers=True))
    assert {f.name for f, _ in r.ListFields()} <= {"hit_blocks", "tiers", "load_blocks", "est_load_s",
                                                  "est_recompute_s", "reason"}
    assert r.hit_blocks == 4 and r.load_blocks == 4 and r.advice == pb.ADVICE_UNSPECIFIED
    assert c.lookup_keys(keys, ask_peers=True).advice == "" and c.advised_blocks(c.lookup_keys(keys), keys) == 4
    assert not c.stats().links
    c.close()
