"""Three real daemons in one fleet on a real etcd, pulling over mutual TLS (certificates made
here). Where the test may create network namespaces (root, iproute2) each daemon runs in one of
its own and etcd in a fourth that holds the bridge joining them, so every byte crosses a real
(virtual) link; elsewhere they share the loopback.

Shown: a prefix stored on A is pulled by C and served bit-exact; one only on B's NVMe is
promoted there and pulled too; blocks evicted on A between C's look and its pull are a clean
miss; a Push whose certificate names another node than the requester it claims is refused;
etcd stopped and started again with every daemon
serving throughout and registered again; A paused: the pull ends at its deadline; A killed:
C's pulls fail within their deadline and C stops listing A once its lease is gone; A back with a new epoch: served again, never an old
block, and a Push naming A's old epoch is refused; C stops cleanly, its channels to peers
closed."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvstore.app.bench.cluster import fleet_certificates
from kvstore.clients import KVStoreClient, KVStoreError
from kvstore.layout import KVLayout
from kvstore.v1 import kvstore_pb2 as pb, peer_pb2 as ppb, peer_pb2_grpc as peer_grpc
from tests.daemon_util import free_port
from tests.etcd_util import EtcdServer, cli_members, node, scraped_in
from tests.netns_util import star
from tests.wait_util import wait_for

LAYOUT = KVLayout(4, 2, 64, "fp16")  # 16-token blocks of 32 KiB
MODEL = "pull-test"
NAMES = ("pull-a", "pull-b", "pull-c")


@dataclass
class Net:
    etcd_prefix: list[str]
    etcd_host: str
    nodes: dict[str, tuple[list[str], str]]  # node id -> (command prefix, address)


def in_ns(ns: str) -> list[str]:
    return ["ip", "netns", "exec", ns]


@pytest.fixture(scope="module")
def net():
    if os.geteuid() != 0 or shutil.which("ip") is None:
        yield Net([], "127.0.0.1", {n: ([], "127.0.0.1") for n in NAMES})
        return
    with star("kvc", 232, 3) as ((hub, hub_addr), spokes):
        yield Net(in_ns(hub), hub_addr, {n: (in_ns(ns), addr) for n, (ns, addr) in zip(NAMES, spokes)})


@pytest.fixture(scope="module")
def etcd(tmp_path_factory, net):
    server = EtcdServer(tmp_path_factory.mktemp("etcd"), host=net.etcd_host, prefix=net.etcd_prefix).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def fleet_pki(tmp_path_factory, net):
    """One CA, and per daemon a certificate naming its node id (CN, DNS SAN) and every address."""
    return fleet_certificates(tmp_path_factory.mktemp("pki"), NAMES, {"127.0.0.1"} | {a for _, a in net.nodes.values()})


def member(net: Net, etcd, pki, name, *flags):
    prefix, addr = net.nodes[name]
    return node(etcd, name, "--server-tcp-listen", f"{addr}:{free_port()}", "--server-tls-cert-file", str(pki / f"{name}.crt"),
                "--server-tls-key-file", str(pki / f"{name}.key"), "--server-tls-client-ca-file", str(pki / "ca.crt"),
                "--server-auth-token", "fleet-token", "--transport-timeout-s", "5", *flags,
                prefix=prefix or None, transfer_addr=f"{addr}:{free_port()}")


def with_nvme(tmp_path):
    """B: a DRAM tier of 256 blocks over an NVMe tier, so a prefix can sit on its NVMe only; the
    tier stores blocks encoded (the fp16 test KV: planes-zstd), so a pull reads them decoded."""
    return ("--nvme-dir", str(tmp_path / "nvme-b"), "--nvme-capacity-bytes", "64MiB", "--nvme-file-bytes", "64MiB",
            "--nvme-codec", "planes-zstd",
            "--dram-capacity-bytes", "8MiB")


def kv_for(tokens, seed):
    return np.random.default_rng(seed).standard_normal(LAYOUT.tensor_shape(len(tokens))).astype(np.float16)


def client(d) -> KVStoreClient:
    c = KVStoreClient(d.socket_path, timeout_s=10)
    c.register(LAYOUT, MODEL)
    return c


def served(c: KVStoreClient, tokens, seed) -> bool:
    out = np.zeros_like(kv_for(tokens, seed))
    return c.get(tokens, out) == len(tokens) and np.array_equal(out, kv_for(tokens, seed))


def pull(d, c: KVStoreClient, tokens, holder="", deadline_s=3.0) -> ppb.PullResponse:
    with grpc.insecure_channel(f"unix:{d.socket_path}") as ch:
        return peer_grpc.PeerStub(ch).Pull(ppb.PullRequest(session_id=c.session_id, keys=b"".join(c.keys(tokens)),
                                                           holder=holder, deadline_s=deadline_s), timeout=deadline_s + 10)


def cpu_s(d) -> float:
    """CPU seconds the daemon's process has used (utime + stime, /proc/<pid>/stat)."""
    with open(f"/proc/{d.proc.pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def health(d, service: str) -> str:
    with grpc.insecure_channel(f"unix:{d.socket_path}") as ch:
        r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)


PUSH_AS = """
import sys, grpc
from kvstore.v1 import peer_pb2 as ppb, peer_pb2_grpc as peer_grpc
pki, cert, addr, ns, keys = sys.argv[1], sys.argv[2], sys.argv[3], bytes.fromhex(sys.argv[4]), bytes.fromhex(sys.argv[5])
read = lambda n: open(f"{pki}/{n}", "rb").read()
creds = grpc.composite_channel_credentials(
    grpc.ssl_channel_credentials(read("ca.crt"), read(cert + ".key"), read(cert + ".crt")),
    grpc.access_token_call_credentials("fleet-token"))
with grpc.secure_channel(addr, creds) as ch:
    try:
        peer_grpc.PeerStub(ch).Push(ppb.PushRequest(requester="pull-c", requester_epoch=1, holder_epoch=1,
                                                    namespace_id=ns, keys=keys, deadline_s=2), timeout=10)
        print("SERVED")
    except grpc.RpcError as e:
        print(e.code().name, e.details())
"""


def push_as(net, pki, cert: str, addr: str, ns: bytes, keys: bytes) -> str:
    """A Push claiming to come from pull-c at epoch 1 to A's epoch 1, sent from C's network
    with ``cert``'s certificate: the holder's answer, as ``CODE details`` (or SERVED)."""
    out = subprocess.run([*net.nodes["pull-c"][0], sys.executable, "-c", PUSH_AS, str(pki), cert, addr, ns.hex(), keys.hex()],
                         capture_output=True, text=True, timeout=60)
    return out.stdout + out.stderr


def test_pulls_across_a_fleet_with_failures_and_an_etcd_restart(daemons, net, etcd, fleet_pki, tmp_path):
    members = lambda: cli_members(net.etcd_prefix, etcd.endpoint) or {}  # noqa: E731
    a, b, c = daemons.start(*(member(net, etcd, fleet_pki, n, *(with_nvme(tmp_path) if n == "pull-b" else ()))
                              for n in NAMES))
    ca_, cb, cc = client(a), client(b), client(c)
    first, second, third = (list(range(s, s + 64)) for s in (0, 1000, 2000))
    for i, t in enumerate((first, second, third)):
        assert ca_.put(t, kv_for(t, i)) == 4
    # C pulls from whoever advertises the namespace: A once its record says so (B has not put
    # anything; C is never its own holder).
    wait_for(lambda: members().get("pull-a", {}).get("namespaces") == 1, what="A advertises the namespace")
    assert cc.lookup(first) == 0
    r = wait_for(lambda: (r := pull(c, cc, first)).pulled and r, what="C pulls from A")
    assert (r.blocks, r.pulled, r.holder, r.holder_epoch, r.detail) == (4, 4, "pull-a", 1, "")
    assert served(cc, first, 0)  # bit-exact, out of C's own DRAM
    assert pull(c, cc, first).pulled == 0  # already here: nothing moves

    # Idle, a daemon whose peers publish no KV events costs next to no CPU: its directory
    # thread once spun on an empty zmq poll, holding the GIL from every RPC (a pull took 0.25 s).
    before = [cpu_s(d) for d in (a, b, c)]
    time.sleep(1.0)
    used = [cpu_s(d) - x for d, x in zip((a, b, c), before)]
    assert max(used) < 0.3, f"CPU seconds in one idle second: {used}"

    # A worker following a pull layer by layer (pull_layers): the holder ships layer-major, so
    # C's doorbell counts complete layers while later ones are still on the wire, and each
    # layer reads bit-exact as soon as it is announced. Shipped block by block, layer 0 would be
    # complete only with the last block, and the first wait would already see every layer.
    deep = KVLayout(32, 4, 64, "fp16")  # 16 KiB layer chunks, 512 KiB blocks
    xa, xc = (KVStoreClient(d.socket_path, timeout_s=10) for d in (a, c))
    for x in (xa, xc):
        x.register(deep, "pull-layers")
    toks = list(range(9000, 9000 + 40 * 16))  # 20 MiB
    kv = np.random.default_rng(9).standard_normal(deep.tensor_shape(len(toks))).astype(np.float16)
    src = kv.view(np.uint8).reshape(deep.num_layers, 2, len(toks), -1)
    assert xa.put(toks, kv) == 40
    with xc.pull_layers(xc.keys(toks), holder="pull-a", deadline_s=5.0) as p:
        assert p.state == pb.TRANSFER_RUNNING and p.blocks == 40, p.detail
        last = deep.num_layers - 1
        p.wait_layer(0)
        # Layer 0 of every block is in, and not yet the last layer of the first block (it
        # comes in the last 1/32 of the bytes; block by block it would have come first).
        assert not np.array_equal(p.layer_view(0, last), src[last, :, :16])
        for layer in range(deep.num_layers):
            p.wait_layer(layer)
            for i in (0, 39):
                assert np.array_equal(p.layer_view(i, layer), src[layer, :, i * 16:(i + 1) * 16])
        r = p.result()
    assert (r.blocks, r.pulled, r.holder) == (40, 40, "pull-a"), r.detail
    out = np.zeros_like(kv)
    assert xc.get(toks, out) == len(toks) and np.array_equal(out, kv)
    # Nothing to follow: a pull that misses says why at the first wait (the worker recomputes).
    missing = list(range(20_000, 20_000 + 4 * 16))
    with xc.pull_layers(xc.keys(missing), holder="pull-a", deadline_s=2.0) as p:
        with pytest.raises(KVStoreError, match="NOT_FOUND"):
            p.wait_layer(0)
    for x in (xa, xc):
        x.delete(x.keys(toks))
        x.close()

    # On B's NVMe only (a prefix put, then pushed out of B's DRAM by 320 more blocks): B
    # promotes it within the pull's deadline and ships it.
    fourth = list(range(3000, 3064))
    assert cb.put(fourth, kv_for(fourth, 3)) == 4
    for s in range(5):
        filler = list(range(100_000 + s * 1024, 100_000 + (s + 1) * 1024))
        assert cb.put(filler, kv_for(filler, 0)) == 64
    wait_for(lambda: bytes(cb.lookup_keys(cb.keys(fourth)).tiers) == bytes([3] * 4), what="the prefix on B's NVMe only")
    nvme_b = next(t for t in cb.stats().tiers if t.tier == pb.TIER_NVME)
    assert all(u["slot_bytes"] < u["raw_bytes"] for u in json.loads(nvme_b.detail)["namespaces"].values())  # encoded
    r = pull(c, cc, fourth, holder="pull-b")
    assert (r.blocks, r.pulled, r.holder, r.detail) == (4, 4, "pull-b", "")
    assert served(cc, fourth, 3)

    # A certificate of the fleet that names another node than the requester it claims: refused
    # before anything else is looked at.
    addr_a = members()["pull-a"]["capabilities"]["control_addr"]
    said = push_as(net, fleet_pki, "pull-b", addr_a, ca_.namespace.root, b"".join(ca_.keys(first)))
    assert said.startswith("PERMISSION_DENIED") and "pull-c" in said, said

    # Evicted on A between C's look and its pull: a clean miss, nothing served.
    ca_.delete(ca_.keys(second))
    r = pull(c, cc, second, holder="pull-a")
    assert (r.blocks, r.pulled) == (0, 0) and "NOT_FOUND" in r.detail
    assert cc.lookup(second) == 0

    # etcd stopped: every daemon goes on serving its workers, says it is not registered, and
    # registers again once etcd is back (same epoch: etcd kept the leases).
    etcd.stop()
    try:
        for i, (d, x) in enumerate(((a, ca_), (b, cb), (c, cc))):
            tokens = list(range(5000 + 64 * i, 5064 + 64 * i))
            assert x.put(tokens, kv_for(tokens, 10 + i)) == 4 and served(x, tokens, 10 + i)
        wait_for(lambda: all(health(d, "kvstore.v1.Cluster") == "NOT_SERVING" for d in (a, b, c)),
                 what="each daemon says it is not registered")
        assert all(health(d, "") == "SERVING" for d in (a, b, c))
    finally:
        etcd.start()
    wait_for(lambda: all(health(d, "kvstore.v1.Cluster") == "SERVING" for d in (a, b, c)), timeout_s=20,
             what="every daemon registered again")
    assert {n: m["epoch"] for n, m in members().items() if n in NAMES} == {n: 1 for n in NAMES}

    # A stalls (paused, still registered): C's pull ends at its deadline, as a miss.
    a.pause()
    try:
        r = pull(c, cc, third, holder="pull-a", deadline_s=1.0)
    finally:
        a.proc.send_signal(signal.SIGCONT)
    assert (r.blocks, r.pulled) == (0, 0) and "DEADLINE_EXCEEDED" in r.detail

    # A dies: C's pull fails within its deadline, as a miss; C stops listing A once its lease is gone.
    a.kill()
    r = pull(c, cc, third, holder="pull-a", deadline_s=2.0)
    assert (r.blocks, r.pulled) == (0, 0) and r.detail
    # ...and, its push having failed on the wire, A is set aside (cluster.peer_cooldown_s): a
    # pull naming no holder asks only B, which lacks the blocks, instead of waiting on A again.
    r = pull(c, cc, third, deadline_s=2.0)
    assert (r.blocks, r.pulled) == (0, 0) and "pull-b" in r.detail and "pull-a" not in r.detail, r.detail
    wait_for(lambda: "not a registered peer" in pull(c, cc, third, holder="pull-a").detail, what="C drops A")

    # A back: a new epoch and an empty DRAM, so nothing of the old A is served; new blocks are.
    a2 = daemons.start(member(net, etcd, fleet_pki, "pull-a"))[0]
    ca2 = client(a2)
    wait_for(lambda: "NOT_FOUND" in pull(c, cc, third, holder="pull-a").detail, what="C lists A again")
    assert cc.lookup(third) == 0
    assert ca2.put(third, kv_for(third, 2)) == 4
    r = pull(c, cc, third, holder="pull-a")
    assert (r.pulled, r.holder_epoch) == (4, 2)
    assert served(cc, third, 2)

    # A Push naming A's old epoch, as a stale directory entry would, from C with C's own
    # certificate: refused.
    said = push_as(net, fleet_pki, "pull-c", members()["pull-a"]["capabilities"]["control_addr"],
                   ca2.namespace.root, b"".join(ca2.keys(third)))
    assert said.startswith("FAILED_PRECONDITION") and "epoch" in said, said
    prefix_c, prefix_a = net.nodes["pull-c"][0], net.nodes["pull-a"][0]
    assert scraped_in(prefix_c, c.metrics_port, 'kvstore_cluster_pulls_total{result="ok"}') == 4
    assert scraped_in(prefix_a, a2.metrics_port, 'kvstore_cluster_pushes_total{result="fenced"}') == 1
    for x in (cb, cc, ca2):
        x.close()
    # C, which has pulled from A and B over channels of its own, stops at once and cleanly.
    c.stop_cleanly()
    assert " ERROR " not in c.log() and "Traceback" not in c.log(), c.log()[-4000:]
