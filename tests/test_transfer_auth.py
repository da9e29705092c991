"""Authenticated daemon-to-daemon transfer, with real daemons: mutual TLS on TCP, the cluster
secret's handshake on UCX, per-peer namespace acceptance, the bound address, and start-up
refusals. One pair of daemons per backend for the whole module (receiver B, sender A)."""

import json
import os
import socket
import ssl
import subprocess
import sys
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from daemon_util import DaemonSpec, cluster_secret, free_port
from kvstore.clients import KVStoreClient, KVStoreError
from kvstore.layout import KVLayout
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.transport import Sender, TransferConfig, TransferError, TransferStatus, ucx_available
from kvstore import config as C
from kvstore.transport.auth import TlsFiles, read_secret
from kvstore.transport.listener import listening_addresses
from kvstore.transport.tcp import MAX_HANDSHAKES_PER_HOST
from wait_util import wait_for
from test_tls import _cert, _pem

LAYOUT = KVLayout(4, 2, 64, "fp16")
ALLOWED, OTHER = "allowed-model", "other-model"
_NO_UCX = pytest.mark.skipif(not ucx_available()[0], reason=f"UCX: {ucx_available()[1]}")


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """Certificates of the cluster CA for node-a and node-b, and one of another CA."""
    d = tmp_path_factory.mktemp("transfer-pki")
    ca, ca_key = _cert("cluster-ca", ca=True)
    other_ca, other_key = _cert("other-ca", ca=True)
    made = {"ca": (ca, ca_key), "node-a": _cert("node-a", ca, ca_key), "node-b": _cert("node-b", ca, ca_key),
            "rogue": _cert("node-a", other_ca, other_key)}  # claims node-a, signed by the wrong CA
    for name, (c, k) in made.items():
        cp, kp = _pem(c, k)
        (d / f"{name}.crt").write_bytes(cp)
        (d / f"{name}.key").write_bytes(kp)
        os.chmod(d / f"{name}.key", 0o600)
    return d


def tls_flags(pki, name):
    return ("--transport-tls-cert-file", str(pki / f"{name}.crt"), "--transport-tls-key-file", str(pki / f"{name}.key"),
            "--transport-tls-ca-file", str(pki / "ca.crt"))


ACCEPT = ("--transport-accept", f"node-a={ALLOWED}")


@pytest.fixture(scope="module")
def tcp_pair(module_daemons, pki):
    nvme = ("--nvme-dir", str(module_daemons.workdir / "nvme-b"), "--nvme-capacity-bytes", "64MiB",
            "--nvme-durable-commit", "true")  # B writes what it receives through to NVMe
    b, a = module_daemons.start(DaemonSpec((*tls_flags(pki, "node-b"), *ACCEPT, *nvme), name="tls-b", transfer="tcp"),
                                DaemonSpec(tls_flags(pki, "node-a"), name="tls-a", transfer="tcp"))
    return a, b


@pytest.fixture(scope="module")
def ucx_pair(module_daemons):
    if not ucx_available()[0]:
        pytest.skip(f"UCX: {ucx_available()[1]}")
    # Both get the module's cluster secret (DaemonSpec gives UCX daemons the workdir's one).
    b, a = module_daemons.start(DaemonSpec(("--transport-node-name", "node-b", *ACCEPT), name="ucx-b", transfer="ucx"),
                                DaemonSpec(("--transport-node-name", "node-a"), name="ucx-a", transfer="ucx"))
    return a, b


@pytest.fixture(params=["tcp", pytest.param("ucx", marks=_NO_UCX)])
def pair(request):
    return request.param, request.getfixturevalue(f"{request.param}_pair")


def metric(d, name: str, **labels) -> float:
    text = urllib.request.urlopen(d.metrics_url, timeout=5).read().decode()
    want = name + ("{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}" if labels else "")
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()  # no labels: all of them
               if line.startswith(want + " ") or (not labels and line.startswith(name + "{")))


def client(d, model: str) -> KVStoreClient:
    c = KVStoreClient(d.socket_path, timeout_s=20)
    c.register(LAYOUT, model)
    return c


def kv_for(tokens, seed):
    return np.random.default_rng(seed).standard_normal(LAYOUT.tensor_shape(len(tokens))).astype(np.float16)


def test_an_authenticated_peer_s_blocks_arrive_bit_exact(pair):
    backend, (a, b) = pair
    ca, cb = client(a, ALLOWED), client(b, ALLOWED)
    try:
        tokens = [7, backend == "ucx", *range(100, 100 + 6 * 16)]
        kv = kv_for(tokens, 1)
        ca.put(tokens, kv)
        r = ca.transfer(ca.keys(tokens), b.transfer_addr, deadline_s=20)
        assert r.blocks == 6
        out = np.zeros_like(kv)
        assert cb.get(tokens, out) == 96 and out[:, :, :96].tobytes() == kv[:, :, :96].tobytes()
    finally:
        ca.close()
        cb.close()


def test_a_namespace_not_accepted_from_that_peer_is_refused_and_nothing_lands(pair):
    backend, (a, b) = pair
    ca = client(a, OTHER)
    try:
        tokens = [9, backend == "ucx", *range(300, 300 + 4 * 16)]
        ca.put(tokens, kv_for(tokens, 2))
        used, refused = client_stats(b).tiers[0].used_bytes, metric(b, "kvstore_transfer_failures_total",
                                                                               reason="forbidden")
        with pytest.raises(KVStoreError) as e:
            ca.transfer(ca.keys(tokens), b.transfer_addr, deadline_s=20)
        assert e.value.code.name == "PERMISSION_DENIED", e.value
        assert OTHER in e.value.message and "node-a" in e.value.message and "transport.accept" in e.value.message
        cb = client(b, OTHER)
        assert cb.lookup(tokens) == 0 and cb.stats().tiers[0].used_bytes == used
        assert metric(b, "kvstore_transfer_failures_total", reason="forbidden") == refused + 1
        cb.close()
    finally:
        ca.close()


def test_received_blocks_are_written_through_and_their_namespace_recorded(tcp_pair):
    a, b = tcp_pair
    ca = KVStoreClient(a.socket_path, timeout_s=20)
    ca.register(LAYOUT, ALLOWED, tenant_salt="t-durable")  # a namespace B has never seen
    try:
        tokens = list(range(500, 500 + 3 * 16))
        ca.put(tokens, kv_for(tokens, 3))
        nvme_blocks = lambda: next(t.blocks for t in client_stats(b).tiers if t.tier == pb.TIER_NVME)  # noqa: E731
        before = nvme_blocks()
        ca.transfer(ca.keys(tokens), b.transfer_addr, deadline_s=20)
        assert nvme_blocks() == before + 3  # durable_commit: on NVMe when the Transfer returned
        known = json.loads((Path(b.args[b.args.index("--nvme-dir") + 1]) / "namespaces.json").read_text())
        assert any(n["tenant_salt"] == "t-durable" and n["model_id"] == ALLOWED for n in known.values())
    finally:
        ca.close()


def client_stats(d):
    c = client(d, ALLOWED)
    try:
        return c.stats()
    finally:
        c.close()


def _refused(b, cfg: TransferConfig, what: str) -> None:
    """A peer with ``cfg`` is refused before any block is accepted; B keeps serving."""
    with Sender(cfg) as s, pytest.raises(TransferError) as e:
        s.open(b.transfer_addr, [os.urandom(32)], LAYOUT.num_layers, LAYOUT.layer_chunk_bytes,
               meta=b"{}", deadline_s=5)
    assert e.value.status is TransferStatus.UNAUTHENTICATED and what in e.value.detail, e.value


def test_tcp_peers_without_a_certificate_or_with_another_ca_s_are_refused(tcp_pair, pki):
    a, b = tcp_pair
    before = metric(b, "kvstore_transfer_auth_failures_total", reason="tls")
    _refused(b, TransferConfig(backend="tcp"), "requires mutual TLS")  # plaintext
    rogue = TlsFiles(str(pki / "rogue.crt"), str(pki / "rogue.key"), str(pki / "ca.crt"))
    _refused(b, TransferConfig(backend="tcp", tls=rogue), "closed the connection during the handshake")
    # The receiver's certificate is checked too: a sender that trusts another CA will not talk to it.
    mistrust = TlsFiles(str(pki / "node-a.crt"), str(pki / "node-a.key"), str(pki / "rogue.crt"))
    _refused(b, TransferConfig(backend="tcp", tls=mistrust), "TLS handshake")
    # A TLS client with no certificate at all: B ends the TLS session before reading a byte.
    ctx = ssl.create_default_context(cafile=str(pki / "ca.crt"))
    ctx.check_hostname = False
    host, port = b.transfer_addr.rsplit(":", 1)
    with pytest.raises((ssl.SSLError, ConnectionError)):
        with ctx.wrap_socket(socket.create_connection((host, int(port)), timeout=10)) as anon:
            anon.sendall(b"x" * 400)
            assert anon.recv(1) == b""  # TLS 1.3: the alert comes on the first read
            raise ConnectionError("closed")
    # B counts each as it drops it (the last ones after the peer already gave up).
    wait_for(lambda: metric(b, "kvstore_transfer_auth_failures_total", reason="tls") >= before + 4)
    assert "requires mutual TLS" in b.log() and "CERTIFICATE" in b.log().upper()  # why, and it serves on
    test_an_authenticated_peer_s_blocks_arrive_bit_exact(("tcp", tcp_pair))


@_NO_UCX
def test_ucx_peers_with_a_wrong_or_no_secret_are_refused(ucx_pair):
    a, b = ucx_pair
    before = metric(b, "kvstore_transfer_auth_failures_total", reason="hmac")
    _refused(b, TransferConfig(backend="ucx", secret=b"not-the-cluster-secret", node_name="node-a"),
             "could not prove it holds the cluster secret")
    _refused(b, TransferConfig(backend="ucx", node_name="node-a"), "requires the cluster secret")
    wait_for(lambda: metric(b, "kvstore_transfer_auth_failures_total", reason="hmac") == before + 1)
    wait_for(lambda: metric(b, "kvstore_transfer_auth_failures_total", reason="mode") >= 1)
    test_an_authenticated_peer_s_blocks_arrive_bit_exact(("ucx", ucx_pair))


def test_a_peer_that_never_finishes_its_handshake_stalls_nobody(tcp_pair):
    a, b = tcp_pair
    host, port = b.transfer_addr.rsplit(":", 1)

    def dropped() -> float:  # silent peers let go: at their deadline, as they leave, or at once
        return metric(b, "kvstore_transfer_auth_failures_total")
    before = dropped()
    silent = [socket.create_connection((host, int(port))) for _ in range(4)]
    try:
        test_an_authenticated_peer_s_blocks_arrive_bit_exact(("tcp", tcp_pair))
    finally:
        for s in silent:
            s.close()
    wait_for(lambda: dropped() >= before + 4)
    # One host gets MAX_HANDSHAKES_PER_HOST connections in their handshake at once; the next is
    # closed at once (counted), before any of the others reaches its deadline: a flood costs no
    # more threads.
    silent = [socket.create_connection((host, int(port))) for _ in range(MAX_HANDSHAKES_PER_HOST)]
    try:
        extra = socket.create_connection((host, int(port)))
        extra.settimeout(10)
        assert extra.recv(1) == b""
        extra.close()
        for s in silent:  # still open: B closed the extra one, not a deadline
            with pytest.raises(BlockingIOError):
                s.recv(1, socket.MSG_DONTWAIT)
    finally:
        for s in silent:
            s.close()
    wait_for(lambda: dropped() >= before + 4 + MAX_HANDSHAKES_PER_HOST + 1)
    test_an_authenticated_peer_s_blocks_arrive_bit_exact(("tcp", tcp_pair))  # and the host is served again


def test_secrets_are_in_no_log(pair):
    backend, (a, b) = pair
    if backend == "ucx":
        secret = open(cluster_secret(a.log_path.parent)).read().strip()
        assert secret and all(secret not in d.log() for d in (a, b))
    key = [line for line in open(a.args[a.args.index("--transport-tls-key-file") + 1]).read().splitlines()
           if "PRIVATE" not in line] if backend == "tcp" else []
    assert all(k not in d.log() for k in key for d in (a, b))


def _ports(d) -> list[str]:
    return listening_addresses(int(d.transfer_addr.rsplit(":", 1)[1]), d.proc.pid)


def test_the_tcp_listener_binds_exactly_the_configured_address(tcp_pair):
    a, b = tcp_pair
    assert _ports(b) == ["127.0.0.1"]
    assert "authentication: mutual TLS" in b.log()


@_NO_UCX
def test_the_ucx_listener_says_it_binds_every_interface_and_does(ucx_pair):
    a, b = ucx_pair
    assert _ports(b) == ["0.0.0.0"]  # ucxx 0.52 takes no bind address (docs/transport.md)
    assert "bound to 0.0.0.0 (ucxx takes no bind address); authentication: the cluster secret, as 'node-b'" in b.log()


# -- start-up refusals (each exits 2 before the arena is built) --------------------------------

def _serve(tmp_path, *flags, env=None):
    sock = str(tmp_path / f"r{len(list(tmp_path.iterdir()))}.sock")
    return subprocess.Popen([sys.executable, "-m", "kvstore", "serve", "--server-socket-path", sock,
                             "--dram-capacity-bytes", "64MiB", "--metrics-port", "0", *flags],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, **(env or {})))


def test_start_up_refuses_a_bad_secret_file_and_an_unauthenticated_listener_beyond_loopback(tmp_path):
    loose = tmp_path / "loose.secret"
    loose.write_text("0123456789abcdef0123456789abcdef")
    os.chmod(loose, 0o644)
    cases = [  # real start-ups: exit 2 with the reason, before the arena is built
        (("--transport-listen", f"127.0.0.1:{free_port()}", "--transport-secret-file", str(loose)),
         "transport.secret_file: " + str(loose) + " is readable or writable by group or others (mode 0644)"),
        (("--transport-listen", f"0.0.0.0:{free_port()}"), "transport.listen: 0.0.0.0:"),
    ]
    procs = [_serve(tmp_path, *flags) for flags, _ in cases]
    for p, (_, said) in zip(procs, cases):
        out, err = p.communicate(timeout=60)
        assert p.returncode == 2 and said in err, (p.returncode, err)
        assert "0123456789abcdef" not in out + err
    short = tmp_path / "short.secret"
    short.write_text("tiny")
    os.chmod(short, 0o600)
    with pytest.raises(ValueError, match="holds 4 bytes"):
        read_secret(str(short))
    listen = {"transport.listen": f"127.0.0.1:{free_port()}"}
    for more, said in [({"transport.backend": "ucx"}, "the ucx listener listens on every interface"),
                       ({"transport.tls_cert_file": "x.crt"}, "mutual TLS needs all three"),
                       ({"transport.listen": "10.1.2.3:7470"}, "reachable beyond this host")]:
        with pytest.raises(C.ConfigError, match=said):
            C.load(env={}, overrides={**listen, **more})
    # With the explicit opt-out the same listeners are allowed.
    C.load(env={}, overrides={"transport.listen": "10.1.2.3:7470", "transport.allow_unauthenticated": "true"})
    C.load(env={}, overrides={**listen, "transport.backend": "ucx", "transport.allow_unauthenticated": "true"})


def test_print_config_and_help_name_the_files_never_a_secret(tmp_path):
    secret = tmp_path / "cluster.secret"
    secret.write_text("s3cr3t-" * 6)
    os.chmod(secret, 0o600)
    p = subprocess.run([sys.executable, "-m", "kvstore", "serve", "--print-config", "--transport-secret-file", str(secret),
                        "--transport-accept", "node-a=m1,m2;*=m3"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert f'secret_file = "{secret}"' in p.stdout and "s3cr3t" not in p.stdout + p.stderr
    assert 'accept = {"node-a" = ["m1", "m2"], "*" = ["m3"]}' in p.stdout
    import tomllib
    assert tomllib.loads(p.stdout)["transport"]["accept"] == {"node-a": ["m1", "m2"], "*": ["m3"]}
    from kvstore.app.cli import build_parser
    helptext = build_parser()._subparsers._group_actions[0].choices["serve"].format_help()
    for flag in ("--transport-secret-file", "--transport-tls-cert-file", "--transport-tls-key-file",
                 "--transport-tls-ca-file", "--transport-allow-unauthenticated", "--transport-accept",
                 "--transport-node-name"):
        assert flag in helptext
