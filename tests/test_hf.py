"""HF transformers adapter against real daemons: greedy generation with the prompt's prefix
loaded from kvstore (DRAM tier, NVMe tier after a restart, shipped to a second daemon) gives
exactly the tokens of plain generation, for fp32 and bf16 Llama models."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
import torch  # noqa: E402
from transformers import DynamicCache  # noqa: E402

from daemon_util import DaemonSpec  # noqa: E402
from kvstore.clients import KVStoreClient  # noqa: E402
from kvstore.clients.hf import HFAdapter, HFAdapterConfig, layout_for  # noqa: E402
from kvstore.v1 import kvstore_pb2 as pb  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
from common import build_llama, model_id, plain_generate, random_tokens  # noqa: E402

BT = 16
VOCAB = 512
SYSTEM = random_tokens(100, seed=11, vocab=VOCAB)      # 6 full blocks + 4 tokens
TURN_A = random_tokens(13, seed=12, vocab=VOCAB)       # SYSTEM + TURN_A: 113 tokens, 7 full blocks + 1
TURN_B = random_tokens(21, seed=13, vocab=VOCAB)       # SYSTEM + TURN_B: 121 tokens, 7 full blocks + 9
NEW_TOKENS = 10
DTYPES = ["fp32", "bf16"]
SLOW_PREFILL = 50.0  # tokens/s reported at Register: recompute looks slow, so the policy loads


def nvme_args(d):
    return ("--nvme-dir", str(d), "--nvme-capacity-bytes", "256MiB", "--nvme-file-bytes", "128MiB",
            "--nvme-durable-commit", "true")


@pytest.fixture(scope="module")
def models():
    return {dt: build_llama("tiny", dt, seed=0) for dt in DTYPES}


@pytest.fixture(scope="module")
def reference(models):
    """Plain HF greedy tokens for each dtype and prompt."""
    return {(dt, name): plain_generate(models[dt], SYSTEM + turn, NEW_TOKENS)
            for dt in DTYPES for name, turn in (("a", TURN_A), ("b", TURN_B))}


def make_adapter(socket_path, model, dtype, prefill_tokens_per_s=SLOW_PREFILL):
    client = KVStoreClient(socket_path, timeout_s=10)
    cfg = HFAdapterConfig(model_id("tiny", 0), block_tokens=BT, prefill_tokens_per_s=prefill_tokens_per_s)
    return HFAdapter(client, model, cfg)


def close(adapter):
    adapter.close()
    adapter.client.close()


def canonical(cache, tokens):
    """The KV of a HF cache's first ``tokens`` tokens (HF: ``[batch, kv_heads, tokens, head_dim]``
    per layer) in kvstore's canonical layout, ``[layers, 2, tokens, kv_heads, head_dim]``: what
    ``put`` and the vLLM connector store for those tokens."""
    kv = [torch.stack([layer.keys[0, :, :tokens], layer.values[0, :, :tokens]]) for layer in cache.layers]
    return torch.stack(kv).transpose(2, 3).contiguous()


def test_layout_from_model_config(models):
    lay = layout_for(models["bf16"], BT)
    assert (lay.num_layers, lay.num_kv_heads, lay.head_dim, lay.dtype.label, lay.kind.value) == (4, 2, 32, "bf16", "gqa")
    assert layout_for(models["fp32"], BT).bytes_per_token == 4 * 2 * 2 * 32 * 4


@pytest.mark.parametrize("dtype", DTYPES)
def test_dram_prefix_reuse_matches_plain_generation(daemon, models, reference, dtype):
    model = models[dtype]
    a = make_adapter(daemon.socket_path, model, dtype)
    try:
        toks, c1 = a.generate(SYSTEM + TURN_A, NEW_TOKENS)  # cold: computes all, stores 7 blocks
        assert c1.plan.outcome == "none" and c1.loaded_tokens == 0
        assert c1.wait_stored() == 7
        assert toks == reference[(dtype, "a")]

        toks, c2 = a.generate(SYSTEM + TURN_B, NEW_TOKENS)  # shared system prompt: 6 blocks hit
        assert (c2.plan.hit_blocks, c2.plan.advised_blocks, c2.plan.load_blocks) == (6, 6, 6)
        assert c2.plan.tiers == bytes([pb.TIER_DRAM]) * 6 and c2.plan.outcome == "load"
        assert toks == reference[(dtype, "b")]
        assert c2.wait_stored() == 1  # TURN_B's first full block

        # The exact prompt again: every full block hits; the partial last block is recomputed.
        toks, c3 = a.generate(SYSTEM + TURN_A, NEW_TOKENS)
        assert c3.plan.hit_blocks == 7 and c3.loaded_tokens == 112
        assert toks == reference[(dtype, "a")]
        # The loaded KV is bit for bit the KV a plain prefill of this prompt computes.
        plain = DynamicCache()
        with torch.no_grad():
            model(torch.tensor([SYSTEM + TURN_A]), past_key_values=plain, use_cache=True)
        for l in range(model.config.num_hidden_layers):
            assert torch.equal(c3.layers[l].keys[:, :, :112], plain.layers[l].keys[:, :, :112])
            assert torch.equal(c3.layers[l].values[:, :, :112], plain.layers[l].values[:, :, :112])
    finally:
        close(a)


@pytest.mark.parametrize("dtype", DTYPES)
def test_blocks_are_the_canonical_layout_both_ways(daemon, models, reference, dtype):
    """A prefix another writer stored in the canonical layout (``put``, as the vLLM connector
    does) loads into the adapter, and the block the adapter stores reads back as the canonical
    layout of its own cache."""
    model = models[dtype]
    plain = DynamicCache(config=model.config)
    with torch.no_grad():
        model(torch.tensor([SYSTEM + TURN_A]), past_key_values=plain, use_cache=True)
    a = make_adapter(daemon.socket_path, model, dtype)
    try:
        assert a.client.put(SYSTEM, canonical(plain, 96)) == 6
        toks, cache = a.generate(SYSTEM + TURN_A, NEW_TOKENS)
        assert cache.loaded_tokens == 96 and toks == reference[(dtype, "a")]
        assert torch.equal(canonical(cache, 96), canonical(plain, 96))
        assert cache.wait_stored() == 1  # block 6, computed on top of the loaded prefix
        out = torch.empty(a.layout.tensor_shape(112), dtype=model.dtype)
        assert a.client.get(SYSTEM + TURN_A, out) == 112
        assert torch.equal(out, canonical(cache, 112))
    finally:
        close(a)


def test_policy_recompute_advice_is_followed(daemon, models, reference):
    model = models["fp32"]
    seed = make_adapter(daemon.socket_path, model, "fp32")
    try:
        seed.generate(SYSTEM + TURN_A, NEW_TOKENS)
    finally:
        close(seed)
    # A worker that prefills at 10^12 tokens/s: recomputing beats any load, so nothing is loaded.
    fast = make_adapter(daemon.socket_path, model, "fp32", prefill_tokens_per_s=1e12)
    try:
        cache = fast.cache_for(SYSTEM + TURN_B)
        assert cache.plan.hit_blocks == 6 and cache.plan.outcome == "recompute" and cache.loaded_tokens == 0
        assert "recompute" in cache.plan.reason
        toks, _ = fast.generate(SYSTEM + TURN_B, NEW_TOKENS, cache=cache)
        assert toks == reference[("fp32", "b")]
        # Overriding the policy loads the hit blocks and still matches.
        toks, forced = fast.generate(SYSTEM + TURN_B, NEW_TOKENS, cache=fast.cache_for(SYSTEM + TURN_B, follow_policy=False))
        assert forced.loaded_tokens == 112 and toks == reference[("fp32", "b")]
    finally:
        close(fast)


def test_daemon_gone_falls_back_to_recompute(daemon, models, reference):
    a = make_adapter(daemon.socket_path, models["fp32"], "fp32")
    try:
        a.generate(SYSTEM + TURN_A, NEW_TOKENS)
        daemon.stop_cleanly()
        toks, cache = a.generate(SYSTEM + TURN_B, NEW_TOKENS)
        assert cache.loaded_tokens == 0 and cache.plan.reason.startswith("kvstore unavailable")
        assert toks == reference[("fp32", "b")]
    finally:
        close(a)


def test_nvme_tier_after_restart_matches_plain_generation(tmp_path, daemons, models, reference):
    nv = tmp_path / "nvme"
    d = daemons(*nvme_args(nv))
    for dt in DTYPES:
        a = make_adapter(d.socket_path, models[dt], dt)
        try:
            a.generate(SYSTEM + TURN_A, NEW_TOKENS)  # durable commit: on NVMe when Commit returns
        finally:
            close(a)
    d.stop_cleanly()
    d = daemons(*nvme_args(nv), name="restarted")  # empty DRAM; NVMe index recovered
    for dt in DTYPES:
        a = make_adapter(d.socket_path, models[dt], dt)
        try:
            toks, cache = a.generate(SYSTEM + TURN_B, NEW_TOKENS)
            assert cache.plan.tiers == bytes([pb.TIER_NVME]) * 6, cache.plan
            assert cache.loaded_tokens == 96
            assert toks == reference[(dt, "b")]
        finally:
            close(a)


def test_disaggregated_prefill_and_decode_match_plain_generation(daemons, models, reference):
    da, db = daemons.start(DaemonSpec(name="prefill", transfer="tcp"), DaemonSpec(name="decode", transfer="tcp"))
    peer = db.transfer_addr
    decoders = {}
    try:
        # The decode worker is up (its namespace registered on B) before the prefill ships.
        decoders.update({dt: make_adapter(db.socket_path, models[dt], dt) for dt in DTYPES})
        # Prefill in another process against daemon A; A ships the prompt's blocks to B.
        out = subprocess.run([sys.executable, str(ROOT / "examples" / "disaggregated.py"), "prefill",
                              "--socket", da.socket_path, "--peer", peer, "--size", "tiny",
                              "--dtypes", ",".join(DTYPES), "--prompt-json", json.dumps(SYSTEM + TURN_B)],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stdout + out.stderr
        shipped = {r["dtype"]: r for r in map(json.loads, [x for x in out.stdout.splitlines() if x.startswith("{")])}
        # Decode here, against daemon B only.
        for dt in DTYPES:
            assert shipped[dt]["transferred_blocks"] == 7
            a = decoders.pop(dt)
            try:
                toks, cache = a.generate(SYSTEM + TURN_B, NEW_TOKENS, cache=a.cache_for(SYSTEM + TURN_B, store=False))
                assert cache.loaded_tokens == 112, cache.plan
                assert toks == reference[(dt, "b")]
                assert toks[0] == shipped[dt]["first_token"]
            finally:
                close(a)
    finally:
        for a in decoders.values():
            close(a)
