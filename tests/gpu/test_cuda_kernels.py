"""The batched copy kernels (issue 18) on CUDA, bit-exact against the legacy path: every page
layout the vLLM connector maps (built here with vLLM 0.32's strides, since a bare GPU image has
no vLLM: tests/test_vllm_pages.py checks those strides against vLLM's own allocator), the HF
adapter's ``[1, heads, tokens, dim]`` tensors, block-size mismatch, MLA, partial runs and
unaligned slots; zero-copy and staged; layer by layer and in bulk. Also the HBM pool's batched
device-to-device copy."""

import pytest
from cuda_env import requires_cuda

from kvstore.layout import KVLayout

pytestmark = [pytest.mark.gpu, requires_cuda]

PATHS = ["zerocopy", "staged"]
GQA = KVLayout(2, 8, 128, "bf16", block_tokens=16)
MLA = KVLayout(2, kind="mla", kv_lora_rank=512, qk_rope_head_dim=64, dtype="bf16", block_tokens=16)
ODD = KVLayout(2, 2, 40, "fp16", block_tokens=16)


def vllm_views(layout, num_blocks: int, block_size: int, kind: str, ratio: int = 1):
    """``make_pages`` for vLLM 0.32's standardized views ``[B, H, N, C]`` of ``kind``:
    ``LBNHC`` / ``LBHNC`` with a ``[K | V]`` cell (FlashAttention, FlashInfer, Triton), the
    CPU backend's ``[K^T, V]`` page, or an MLA latent page; ``ratio`` kernel blocks per block."""
    import torch

    from kvstore.clients.hbm_paged import LayerPages

    kb, n = num_blocks * ratio, block_size // ratio
    mla = layout.kind.value == "mla"
    h, d = (1, layout.kv_lora_rank + layout.qk_rope_head_dim) if mla else (layout.num_kv_heads, layout.head_dim)
    cell = d if mla else 2 * d
    dt = torch.bfloat16 if layout.dtype.label == "bf16" else torch.float16

    def one():
        if kind == "LBNHC":
            mem = torch.zeros((kb, n, h, cell), dtype=dt, device="cuda")
            view = mem.permute(0, 2, 1, 3)
        else:
            mem = torch.zeros((kb, h, n, cell), dtype=dt, device="cuda")
            view = mem
        if mla:
            return LayerPages((view,), ratio), mem
        if kind == "CPU":
            halves = mem.view(kb, h, 2, n * d)
            return LayerPages((halves[:, :, 0].view(kb, h, d, n).transpose(2, 3), halves[:, :, 1].view(kb, h, n, d)), ratio), mem
        return LayerPages((view[..., :d], view[..., d:]), ratio), mem

    def make():
        made = [one() for _ in range(layout.num_layers)]
        return [p for p, _ in made], [m for _, m in made]
    return make


def hf_tensors(layout, tokens: int):
    """``make_pages`` for the HF adapter's per-layer K and V ``[1, heads, tokens, dim]``."""
    import torch

    from kvstore.clients.hbm_paged import LayerPages

    def make():
        mem = [torch.zeros((2, 1, layout.num_kv_heads, tokens, layout.head_dim), dtype=torch.bfloat16, device="cuda")
               for _ in range(layout.num_layers)]
        return [LayerPages((m[0], m[1])) for m in mem], mem
    return make


@pytest.fixture(autouse=True)
def kernels_run_here():
    """Triton must launch on this GPU (it builds its driver module with the host C compiler on
    first use); where it cannot, the product falls back to the legacy path, and these say why."""
    import torch

    from kvstore.tiers.kv_copy import CopyPath, resolve_copy_path

    path, why = resolve_copy_path("zerocopy", torch.device("cuda", 0))
    if path is CopyPath.LEGACY:
        pytest.skip(f"copy kernels cannot run here: {why}")


CASES = {
    "flash-LBNHC": (GQA, "LBNHC", 16, 1), "flashinfer-LBHNC": (GQA, "LBHNC", 16, 1),
    "triton-LBNHC-32/16": (GQA, "LBNHC", 32, 2), "flashinfer-LBHNC-64/16": (GQA, "LBHNC", 64, 4),
    "block-128": (GQA, "LBNHC", 128, 1), "cpu-K-transposed": (GQA, "CPU", 16, 1),
    "mla-LBNHC": (MLA, "LBNHC", 16, 1), "mla-LBHNC-128/64": (MLA, "LBHNC", 128, 2), "odd-heads-fp16": (ODD, "LBNHC", 8, 1),
}


@pytest.mark.parametrize("layerwise", [True, False], ids=["layerwise", "bulk"])
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("name", CASES)
def test_cuda_kernels_match_legacy_every_layout(name, path, layerwise):
    import numpy as np
    from kv_copy_check import check_both_ways, scattered_offsets

    layout, kind, bs, ratio = CASES[name]
    n = 5
    nb = -(-n * layout.block_tokens // bs) + 3
    table = np.random.default_rng(7).permutation(nb)[:nb - 3].tolist()
    offsets = scattered_offsets(layout, n, skip=(2,), misalign=2 if name.startswith("odd") else 0)
    check_both_ways(layout, vllm_views(layout, nb, bs, kind, ratio), table, n, offsets, path, layerwise)


@pytest.mark.parametrize("path", PATHS)
def test_cuda_kernels_hf_tensors(path):
    from kv_copy_check import check_both_ways, scattered_offsets

    n = 4
    offsets = scattered_offsets(GQA, n)
    check_both_ways(GQA, hf_tensors(GQA, n * GQA.block_tokens), [0], n, offsets, path, True)


def test_cuda_hbm_copy_many_one_call():
    import numpy as np

    from kvstore.tiers.hbm import HbmTier, HbmTierConfig

    slot = 1 << 20
    tier = HbmTier(HbmTierConfig(64 * slot, extent_bytes=16 * slot, device="0", prefault=False))
    try:
        ns = b"k" * 32
        a = [tier.allocate(ns, slot) for _ in range(8)]
        b = [tier.allocate(ns, slot) for _ in range(8)]
        for i, s in enumerate(a):
            tier.write(s, np.full(slot, i + 1, np.uint8))
        tier.copy_many([(d, s, slot - 3) for s, d in zip(a, b)]).result(30)  # odd lengths: narrower words
        for i, d in enumerate(b):
            out = np.zeros(slot, np.uint8)
            tier.read(d, out)
            assert (out[:slot - 3] == i + 1).all()
    finally:
        tier.close()
