"""The TCP control listener: TLS required, optional mutual TLS and bearer token, with real
certificates made here."""

import datetime
import ipaddress

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from daemon_util import free_port
from kvstore.clients import KVStoreClient, KVStoreError
from kvstore.layout import KVLayout


def _cert(name, issuer=None, issuer_key=None, ca=False):
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.timezone.utc)
    b = (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer.subject if issuer else subject)
         .public_key(key.public_key()).serial_number(x509.random_serial_number())
         .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
         .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if not ca:
        b = b.add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                         x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
    cert = b.sign(issuer_key or key, hashes.SHA256())
    return cert, key


def _pem(cert, key):
    return (cert.public_bytes(serialization.Encoding.PEM),
            key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    d = tmp_path_factory.mktemp("pki")
    ca, ca_key = _cert("kvstore-test-ca", ca=True)
    srv, srv_key = _cert("localhost", ca, ca_key)
    cli, cli_key = _cert("worker-1", ca, ca_key)
    rogue_ca, rogue_key = _cert("rogue-ca", ca=True)
    rogue, rogue_cli_key = _cert("rogue", rogue_ca, rogue_key)
    files = {}
    for name, (c, k) in {"ca": (ca, ca_key), "server": (srv, srv_key), "client": (cli, cli_key), "rogue": (rogue, rogue_cli_key)}.items():
        cp, kp = _pem(c, k)
        (d / f"{name}.crt").write_bytes(cp)
        (d / f"{name}.key").write_bytes(kp)
        files[name] = (cp, kp)
    return d, files


def _stats(port, ca, cert=None, key=None, token=None):
    c = KVStoreClient(target=f"localhost:{port}", root_ca=ca, client_cert=cert, client_key=key, token=token, timeout_s=5)
    try:
        return c.stats()
    finally:
        c.close()


def test_mutual_tls_and_token(daemons, pki):
    d_pki, f = pki
    port = free_port()
    d = daemons("--server-tcp-listen", f"127.0.0.1:{port}",
                "--server-tls-cert-file", str(d_pki / "server.crt"), "--server-tls-key-file", str(d_pki / "server.key"),
                "--server-tls-client-ca-file", str(d_pki / "ca.crt"), "--server-auth-token", "s3cret")
    ca = f["ca"][0]
    assert _stats(port, ca, *f["client"], token="s3cret").tiers[0].capacity_bytes == 64 << 20
    with pytest.raises(KVStoreError) as e:
        _stats(port, ca, *f["client"], token="wrong")
    assert e.value.code == grpc.StatusCode.UNAUTHENTICATED and "bearer token" in e.value.message
    with pytest.raises(KVStoreError) as e:
        _stats(port, ca, token="s3cret")  # no client certificate
    assert e.value.code == grpc.StatusCode.UNAVAILABLE
    with pytest.raises(KVStoreError) as e:
        _stats(port, ca, *f["rogue"], token="s3cret")  # certificate from another CA
    assert e.value.code == grpc.StatusCode.UNAVAILABLE
    # Control calls work over TCP; data calls say they need the unix socket.
    c = KVStoreClient(target=f"localhost:{port}", root_ca=ca, client_cert=f["client"][0], client_key=f["client"][1], token="s3cret")
    c.register(KVLayout(2, 2, 64, "fp16"), "m")
    assert c.lookup(list(range(32))) == 0
    with pytest.raises(RuntimeError, match="unix socket"):
        c.put(list(range(16)), None)
    c.close()
    # A plaintext client gets nothing.
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        from kvstore.v1 import kvstore_pb2 as pb, kvstore_pb2_grpc as pbg
        with pytest.raises(grpc.RpcError):
            pbg.KVStoreStub(ch).Stats(pb.StatsRequest(), timeout=3)
    # The unix socket stays the default and needs none of it.
    local = KVStoreClient(d.socket_path)
    assert local.stats().tiers[0].capacity_bytes == 64 << 20
    local.close()


def test_tls_without_client_auth(daemons, pki):
    d_pki, f = pki
    port = free_port()
    daemons("--server-tcp-listen", f"127.0.0.1:{port}",
            "--server-tls-cert-file", str(d_pki / "server.crt"), "--server-tls-key-file", str(d_pki / "server.key"))
    assert _stats(port, f["ca"][0]).tiers[0].blocks == 0
    with pytest.raises(KVStoreError):
        _stats(port, f["rogue"][0])  # the client does not trust the server's CA
