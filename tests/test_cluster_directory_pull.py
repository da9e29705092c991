"""A pull asks the peer the cluster prefix directory names, and only that one: three real
daemons on a real etcd, each publishing its KV events; C reads A's and B's streams into its
directory. A advertises the namespace but lacks the chain, B holds it. Membership alone (every
peer advertising the namespace, in node-id order) would ask A first; the directory sends the
Push to B at once, and A is never asked."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("zmq")

from kvstore.bench.cluster import fleet_certificates  # noqa: E402
from kvstore.clients import KVStoreClient  # noqa: E402
from kvstore.layout import KVLayout  # noqa: E402
from tests.daemon_util import free_port  # noqa: E402
from tests.etcd_util import EtcdServer, node, scraped  # noqa: E402
from tests.test_cluster_pull import pull  # noqa: E402
from tests.wait_util import wait_for  # noqa: E402

LAYOUT = KVLayout(4, 2, 64, "fp16")
NAMES = ("dir-a", "dir-b", "dir-c")


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
                transfer_addr=f"127.0.0.1:{free_port()}")


def kv(tokens, seed):
    return np.random.default_rng(seed).standard_normal(LAYOUT.tensor_shape(len(tokens))).astype(np.float16)


def test_the_directory_names_the_holder_and_no_other_peer_is_asked(daemons, etcd, tmp_path):
    pki = fleet_certificates(tmp_path / "pki", NAMES)
    a, b, c = daemons.start(*(spec(etcd, pki, n) for n in NAMES))
    ca_, cb, cc = (KVStoreClient(d.socket_path, timeout_s=10) for d in (a, b, c))
    for cl in (ca_, cb, cc):
        cl.register(LAYOUT, "dir-test")
    other, chain = list(range(5000, 5064)), list(range(0, 64))
    assert ca_.put(other, kv(other, 1)) == 4  # A advertises the namespace, without the chain
    assert cb.put(chain, kv(chain, 2)) == 4
    # Until C's directory has read B's stream (and membership has A's namespace), a pull may
    # miss; once it lands it came from B.
    r = wait_for(lambda: (r := pull(c, cc, chain)).pulled and r, what="C pulls the chain")
    assert (r.pulled, r.holder) == (4, "dir-b")
    out = np.zeros_like(kv(chain, 2))
    assert cc.get(chain, out) == 64 and np.array_equal(out, kv(chain, 2))
    assert scraped(a, 'kvstore_cluster_pushes_total{result="missing"}') == 0  # A was never asked
    assert scraped(b, 'kvstore_cluster_pushes_total{result="ok"}') == 1
    # A chain nobody's events announce is a miss without a Push to anyone.
    nowhere = list(range(9000, 9064))
    assert pull(c, cc, nowhere).pulled == 0
    assert scraped(a, 'kvstore_cluster_pushes_total{result="missing"}') == 0
    assert scraped(b, 'kvstore_cluster_pushes_total{result="missing"}') == 0
