"""The cluster's pieces without processes: the etcd stubs are what protoc makes of the vendored
proto files, member records round-trip, the [cluster] config is checked, the channels to peers
are closed at stop."""

import subprocess
import sys
from pathlib import Path

import pytest

from kvstore import config as C
from kvstore.app.bench.cluster import fleet_certificates
from kvstore.cluster.etcd import prefix_end
from kvstore.cluster.member import Member
from kvstore.daemon.pull import PeerLinks
from kvstore.errors import KVError
from kvstore.v1 import peer_pb2 as ppb

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("pkg, names", [("kvstore/cluster/etcdpb", ("kv", "rpc")), ("kvstore/v1", ("peer",))])
def test_etcd_and_peer_stubs_are_fresh(tmp_path, pkg, names):
    protos = [str(ROOT / "proto" / pkg / f"{n}.proto") for n in names]
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", f"-I{ROOT / 'proto'}", f"--python_out={tmp_path}",
                    f"--pyi_out={tmp_path}", f"--grpc_python_out={tmp_path}", *protos], check=True)
    for n in names:
        for name in (f"{n}_pb2.py", f"{n}_pb2.pyi", f"{n}_pb2_grpc.py"):
            fresh = (tmp_path / pkg / name).read_text()
            assert fresh == (ROOT / pkg / name).read_text(), f"{pkg}/{name} is stale: run make proto"


def test_member_records_round_trip_and_foreign_values_are_refused():
    m = Member("n1", 3, "10.0.0.1:7400", "10.0.0.1:5557", "10.0.0.1:5558", ["ab" * 16], {"transport": "tcp"})
    assert Member.from_json(m.to_json()) == m
    for bad in (b"[]", b'{"node_id": 1, "epoch": 1}', b'{"node_id": "x"}'):
        with pytest.raises(ValueError):
            Member.from_json(bad)


def test_prefix_end():
    assert prefix_end(b"/kvstore/members/") == b"/kvstore/members0"
    assert prefix_end(b"a\xff") == b"b"


@pytest.mark.parametrize("over, key", [
    ({"cluster.etcd_endpoints": "nohost"}, "cluster.etcd_endpoints"),
    ({"cluster.lease_ttl_s": "1"}, "cluster.lease_ttl_s"),
    ({"cluster.lease_ttl_s": "3", "cluster.etcd_timeout_s": "2"}, "cluster.etcd_timeout_s"),
    ({"cluster.prefix": "kv/"}, "cluster.prefix"),
    ({"cluster.node_id": "a b"}, "cluster.node_id"),
    ({"cluster.etcd_cert_file": "/x.pem"}, "cluster.etcd_cert_file"),
])
def test_cluster_config_is_checked(over, key):
    with pytest.raises(C.ConfigError, match=key.replace(".", r"\.")):
        C.load(env={}, overrides=over)


def test_cluster_config_endpoints():
    cfg = C.load(env={}, overrides={"cluster.etcd_endpoints": "10.0.0.1:2379, etcd-1:2379"}).cluster
    assert cfg.endpoints() == ["10.0.0.1:2379", "etcd-1:2379"]


def test_peer_links_close_their_channels_and_open_none_after(tmp_path):
    pki = fleet_certificates(tmp_path / "pki", ["n1"])
    s = C.load(env={}, overrides={"server.tcp_listen": "127.0.0.1:1", "server.tls_cert_file": str(pki / "n1.crt"),
                                  "server.tls_key_file": str(pki / "n1.key"),
                                  "server.tls_client_ca_file": str(pki / "ca.crt")}).server
    links = PeerLinks(s)
    assert links.why_off == ""
    stub = links.stub("127.0.0.1:1")
    assert links.stub("127.0.0.1:1") is stub  # one channel per peer
    links.close()
    with pytest.raises(ValueError, match="closed channel"):
        stub.Push(ppb.PushRequest(), timeout=1)
    with pytest.raises(KVError, match="stopping"):
        links.stub("127.0.0.1:1")
    assert (pki / "n1.key").stat().st_mode & 0o777 == 0o600
