"""The batched copy kernels of issue 18 (kvstore.tiers.kv_copy), EMULATED: Triton's interpreter
(``TRITON_INTERPRET=1``) runs them on CPU tensors, and each is checked bit-exact against the
legacy per-block path on the same inputs, for every vLLM 0.32 page layout the connector maps
(engine caches allocated by vLLM's own code), block-size mismatch both ways, MLA, partial runs
(blocks skipped in a store), unaligned slots, and the HF adapter's tensors. No figure from here
is a GPU figure: tests/gpu/run.sh runs the same checks and the bandwidth table on CUDA."""

from __future__ import annotations

import logging

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from kv_copy_check import check_both_ways, classic, scattered_offsets  # noqa: E402
from test_vllm_pages import CASES, NUM_BLOCKS, engine_caches, mapped, tiled  # noqa: E402

from kvstore.clients import KVStoreClient  # noqa: E402
from kvstore.clients.gpu import GpuKVPath  # noqa: E402
from kvstore.layout import KVLayout  # noqa: E402
from kvstore.tiers.hbm import HbmTier, HbmTierConfig  # noqa: E402
from kvstore.clients.hbm_paged import KVMover, PagedKV  # noqa: E402
from kvstore.tiers.kv_copy import CopyPath, copy_spans, resolve_copy_path  # noqa: E402

KERNEL_PATHS = ["zerocopy", "staged"]
BT = 16  # kvstore's block: the cases' engine blocks are 16 to 128 tokens, kernel blocks 16 to 64
SHARE_DAEMON = True


@pytest.fixture
def interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


# Staged differs from zero-copy only on the slot side, which no page layout touches: its four
# cases cover split cells, kernel-split blocks, the CPU backend's transposed K and MLA.
STAGED_CASES = ("flash-LBNHC-fp16", "triton-LBNHC-fp16-32/16", "cpu-bf16-vec", "flashmla-LBHNC-bf16-128/64")
# The CPU backend's 'amx' pages (forced, or picked on CPUs with AMX tiles) are tiled: they take
# the legacy copies (tested below).
VLLM_CASES = [pytest.param(case, "zerocopy", id=f"{name}-zerocopy") for name, case in CASES.items()
              if not tiled(case)] + \
    [pytest.param(CASES[name], "staged", id=f"{name}-staged") for name in STAGED_CASES]


@pytest.mark.parametrize("case,path", VLLM_CASES)
def test_emulated_every_vllm_layout_matches_legacy(interpret, case, path):
    layout = case.kv_layout()
    layout = KVLayout(**{**layout.to_dict(), "block_tokens": BT})

    def make_pages():
        names, views = engine_caches(case)
        return mapped(case, names, views), views

    n = 3
    table = np.random.default_rng(5).permutation(NUM_BLOCKS)[:-(-n * BT // case.block_size)].tolist()
    offsets = scattered_offsets(layout, n, skip=(1,) if path == "staged" else (2,))
    check_both_ways(layout, make_pages, table, n, offsets, path, layerwise=True)
    check_both_ways(layout, make_pages, table, n, offsets, path, layerwise=False)


@pytest.mark.parametrize("path", KERNEL_PATHS)
def test_emulated_tiled_amx_pages_take_the_legacy_copies(interpret, path):
    case = CASES["cpu-bf16-amx"]
    names, views = engine_caches(case)
    layout = case.kv_layout()
    paged = PagedKV(mapped(case, names, views), layout)
    assert paged.tiled
    m = KVMover(paged, layout, np.zeros(4 * layout.block_bytes, np.uint8), path)
    try:
        assert m.copy_path is CopyPath.LEGACY and m.batched is None
        assert "tiled (the CPU backend's AMX layout)" in m.copy_reason
    finally:
        m.close()


GQA = KVLayout(3, 2, 64, "fp16", block_tokens=8)
MLA = KVLayout(2, kind="mla", kv_lora_rank=64, qk_rope_head_dim=16, dtype="bf16", block_tokens=32)
ODD = KVLayout(2, 1, 40, "fp16", block_tokens=16)  # 80-byte heads: 8-byte words at best


@pytest.mark.parametrize("path", KERNEL_PATHS)
@pytest.mark.parametrize("layout,block_size,misalign,skip", [
    (GQA, 16, 0, ()),        # engine blocks of two kvstore blocks
    (GQA, 4, 2, (0, 3)),     # engine blocks of half a kvstore block; slots 2 bytes off; partial run
    (MLA, 16, 0, (1,)),      # one latent per token, no K/V split
    (ODD, 16, 6, ()),        # head of 80 bytes, slots 6 bytes off any 4-byte word
], ids=["gqa-16/8", "gqa-4/8-unaligned-partial", "mla-16/32-partial", "odd-unaligned"])
def test_emulated_block_size_mismatch_mla_partial_unaligned(interpret, path, layout, block_size, misalign, skip):
    n = 4
    nb = -(-n * layout.block_tokens // block_size) + 3
    table = np.random.default_rng(7).permutation(nb)[:nb - 3].tolist()
    offsets = scattered_offsets(layout, n, skip=skip, misalign=misalign)
    for layerwise in (True, False):
        check_both_ways(layout, classic(layout, nb, block_size), table, n, offsets, path, layerwise)


@pytest.mark.parametrize("path", KERNEL_PATHS)
def test_emulated_offsets_outside_the_arena_fail_the_op(interpret, path):
    """A kernel writes wherever an offset points (a slice would raise): the path checks first,
    and the op's event carries the error; the arena is untouched."""
    host = np.zeros(2 * GQA.block_bytes, np.uint8)
    pages, _ = classic(GQA, 4, 16)()
    m = KVMover(PagedKV(pages, GQA), GQA, host, path)
    try:
        rows = m.paged.token_rows([0], 8)
        with pytest.raises(ValueError, match="outside the .*-byte arena"):
            m.store_layer(0, rows, [GQA.block_bytes + 1]).synchronize(10)
        with pytest.raises(ValueError, match="outside"):
            m.load_all(rows, [-8])[-1].synchronize(10)
        assert not host.any()
    finally:
        m.close()


def test_emulated_d2d_spans_one_launch(interpret):
    pool = torch.zeros(1 << 16, dtype=torch.uint8)
    pool[:1 << 15] = torch.randint(0, 255, (1 << 15,), dtype=torch.uint8)
    spans = [(40000, 0, 4096), (50001, 4096 + 3, 777), (60000, 9000, 1)]  # aligned, odd, one byte
    want = pool.clone()
    for d, s, n in spans:
        want[d:d + n] = want[s:s + n]
    copy_spans(pool, spans)
    assert torch.equal(pool, want)


def test_hbm_copy_many_is_one_transfer_with_slot_order():
    tier = HbmTier(HbmTierConfig(1 << 20, extent_bytes=1 << 18, device="emulated", prefault=False))
    try:
        ns, slot = b"n" * 32, 8192
        a = [tier.allocate(ns, slot) for _ in range(4)]
        b = [tier.allocate(ns, slot) for _ in range(4)]
        data = [np.full(slot, i + 1, np.uint8) for i in range(4)]
        tier.promote(zip(a, data))  # on the same stream as the copies: ordered before them
        t = tier.copy_many([(d, s, slot) for s, d in zip(a, b)])
        t.result(10)
        assert t.nbytes == 4 * slot
        for i, d in enumerate(b):
            out = np.zeros(slot, np.uint8)
            tier.read(d, out)
            assert (out == i + 1).all()
        with pytest.raises(ValueError, match="do not fit"):
            tier.copy_many([(b[0], a[0], slot + 1)])
    finally:
        tier.close()


def test_without_interpreter_cpu_caches_fall_back_to_legacy_with_a_reason(monkeypatch, caplog):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with caplog.at_level(logging.INFO, logger="kvstore.gpu"):
        path, why = resolve_copy_path("zerocopy", torch.device("cpu"))
    assert path is CopyPath.LEGACY and "TRITON_INTERPRET=1 is not set" in why
    assert "using the legacy per-block copies" in caplog.text
    assert resolve_copy_path("legacy", torch.device("cpu"))[0] is CopyPath.LEGACY
    with pytest.raises(ValueError, match="copy_path: expected one of legacy, zerocopy, staged"):
        CopyPath.parse("dma")


LAYOUT = KVLayout(4, 2, 64, "fp16")


@pytest.mark.parametrize("path", KERNEL_PATHS)
def test_emulated_gpu_path_round_trip_through_a_daemon(interpret, client_factory, path):
    """Stored layer by layer with the kernels, loaded in bulk with the legacy path and layer by
    layer with the kernels into another table and block size: the same bytes everywhere."""
    from test_gpu_client import paged, prompt, same_tokens, tables

    c = client_factory(LAYOUT, model_id=f"kernels-{path}")
    ids = prompt(5 * 16 + 7, seed=path == "staged")
    src, t_src = paged(LAYOUT, 40, 16, seed=1), tables(40, 6, seed=2)
    with GpuKVPath(c, src, copy_path=path) as p:
        assert p.copy_path is CopyPath(path)
        h = p.begin_store(ids, t_src)
        for l in range(LAYOUT.num_layers):
            h.store_layer(l)
        assert h.commit() == 5
    for copy_path, bs in (("legacy", 32), (path, 8)):
        dst, t_dst = paged(LAYOUT, 24, bs, seed=None), tables(24, -(-87 // bs), seed=3)
        with GpuKVPath(c, dst, copy_path=copy_path) as p, p.load(ids, t_dst, layerwise=copy_path != "legacy") as h:
            h.wait()
            assert h.tokens == 80
        assert same_tokens(LAYOUT, src, t_src, dst, t_dst, 80)


def test_emulated_hf_adapter_kernels_store_and_load_canonical_blocks(interpret, daemon):
    """The HF adapter on the kernels (one launch per layer from and into its ``[1, heads,
    tokens, dim]`` tensors): the blocks it stores read back as the canonical layout of a plain
    prefill, and a second prompt sharing the prefix loads them and generates the plain tokens."""
    pytest.importorskip("transformers")
    from test_hf import NEW_TOKENS, SYSTEM, TURN_A, TURN_B, canonical
    from transformers import DynamicCache

    from common import build_llama, plain_generate
    from kvstore.clients.hf import HFAdapter, HFAdapterConfig

    model = build_llama("tiny", "bf16", seed=0)
    plain = DynamicCache(config=model.config)
    with torch.no_grad():
        model(torch.tensor([SYSTEM + TURN_B]), past_key_values=plain, use_cache=True)
    a = HFAdapter(KVStoreClient(daemon.socket_path, timeout_s=10), model,
                  HFAdapterConfig("tiny-kernels", block_tokens=16, prefill_tokens_per_s=50.0, copy_path="zerocopy"))
    try:
        assert a.copy_path is CopyPath.ZEROCOPY, a.copy_reason
        _, c1 = a.generate(SYSTEM + TURN_A, 1)
        assert c1.wait_stored() == 7
        out = torch.empty(a.layout.tensor_shape(96), dtype=model.dtype)
        assert a.client.get(SYSTEM, out) == 96
        assert torch.equal(out, canonical(plain, 96))
        toks, c2 = a.generate(SYSTEM + TURN_B, NEW_TOKENS)
        assert c2.loaded_tokens == 96 and torch.equal(canonical(c2, 96), canonical(plain, 96))
        assert toks == plain_generate(model, SYSTEM + TURN_B, NEW_TOKENS)
    finally:
        a.close()
        a.client.close()


def test_connector_copy_path_switch():
    from vllm.config import KVTransferConfig, VllmConfig

    from kvstore.clients.vllm_setup import ConnectorSettings

    def settings(extra):
        return ConnectorSettings.from_vllm(VllmConfig(kv_transfer_config=KVTransferConfig(
            kv_connector="KVStoreConnector", kv_connector_module_path="kvstore.clients.vllm_connector",
            kv_role="kv_both", kv_connector_extra_config=extra)))

    assert settings({}).copy_path == "zerocopy"
    assert settings({"copy_path": "legacy"}).copy_path == "legacy"
    with pytest.raises(ValueError, match="kv_connector_extra_config: copy_path: expected one of"):
        settings({"copy_path": "dma"})


def test_bench_kernels_dry_run_emulated(interpret, capsys, monkeypatch):
    """tests/gpu/bench_kernels.py end to end on CPU tensors (Triton's interpreter, a tiny
    layout), so the H200 run does not spend its minutes finding a bug in the script. EMULATED:
    its figures say nothing about a GPU and are not checked."""
    import json
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).parent / "gpu"))
    import bench_kernels

    assert bench_kernels.main(["--emulated", "--reps", "1"]) == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert res["emulated"] is True and "skipped" not in res["layouts"][0], res
    for path in ("legacy", "zerocopy", "staged"):
        assert set(res["layouts"][0]["ratio"][path]) == {"load_layerwise", "store_layerwise", "load_bulk", "store_bulk"}
    assert set(res["d2d"]["ratio"]) == {"copy_many", "copy_async_per_slot"}
    assert res["table_md"].count("| tiny") == 3
