"""vLLM 0.32's per-layer KV cache views, read as kvstore's canonical block layout.

vLLM 0.32 hands a connector one standardized view per layer, ``[B, H, N, C]``: kernel blocks,
KV head slots, tokens per kernel block and the bytes of one (head, token) cell viewed in the
cache dtype (``allocate_kv_cache`` / ``create_kv_cache_views``). The strides follow the
engine's ``KVCacheLayout`` (``LBNHC`` for FlashAttention, ``LBHNC`` for FlashInfer and the CPU
backend, ...), but what a cell holds is the attention backend's business:

- FlashAttention, FlashInfer, Triton, FlexAttention (and the ROCm ones): the cell is ``[K | V]``
  (``kv_cache.transpose(1, 2).split(head_size, dim=-1)`` in each backend);
- the CPU backend reinterprets each (block, head) page ``[N, 2D]`` as ``[2N, D]``: K in the
  first half, V in the second. What each half holds depends on the kernels it picked
  (``_get_attn_isa``): the ``vec`` and ``vec16`` kernels keep K transposed, ``[D, N]``, and V
  as ``[N, D]``; the ``amx`` ones (bf16 on CPUs with AMX tiles) keep both in AMX B-tile order,
  K as 16-token groups of element pairs, V as 16-element groups of token pairs
  (``cpu_attn_amx.hpp``, ``reshape_and_cache``), read here as tiled views; fp8 caches (bytes)
  keep the same orders, pairs of bytes in the ``amx`` tiles (``cpu_attn_fp8.hpp``);
- MLA backends: one head slot holding the latent, ``kv_lora_rank`` then the rope part.

:func:`layer_pages` turns a view into :class:`~kvstore.clients.hbm_paged.LayerPages`, logical
``[blocks, heads, tokens, dim]`` K and V views over the same memory, so the copies in
:mod:`kvstore.clients.hbm_paged` read and write token rows in kvstore's one canonical order
(per layer ``[2, block_tokens, kv_heads, head_dim]``, MLA ``[block_tokens, latent]``) whatever
the backend. A block stored by vLLM on any backend, by the HF adapter or by ``put`` is the same
bytes for the same tokens. A layout this module does not know is refused with an error naming
it; it never guesses. The CPU backend's layout is also checked by running the backend's own
cache-write kernel on a scratch page once (:func:`check_cpu_pages`).
"""

from __future__ import annotations

import torch

from kvstore.layout import AttnKind, KVLayout
from kvstore.clients.hbm_paged import LayerPages, page_rows

# Backends whose page cell is [K | V] (each splits the cell at head_size).
SPLIT_CELL_BACKENDS = frozenset({
    "FLASH_ATTN", "FLASHINFER", "TRITON_ATTN", "FLEX_ATTENTION", "ROCM_ATTN", "ROCM_AITER_UNIFIED_ATTN",
})
CPU_BACKEND = "CPU_ATTN"
# MLA backends whose page is the plain latent in the cache dtype (fp8_ds_mla packs scales too).
MLA_BACKENDS = frozenset({
    "FLASHMLA", "FLASH_ATTN_MLA", "CUTLASS_MLA", "TRITON_MLA", "FLASHINFER_MLA", "CPU_MLA", "AMX_MLA",
    "ROCM_AITER_MLA", "AITER_TRITON_MLA",
})


class UnsupportedPages(ValueError):
    """The engine's KV pages are in a form kvstore cannot map to its canonical layout."""


def layer_pages(name: str, view: torch.Tensor, layout: KVLayout, backend: str, num_blocks: int,
                cpu_isa: str = "vec") -> LayerPages:
    """The canonical K/V views of layer ``name``'s standardized view ``[B, H, N, C]``
    (``num_blocks`` engine blocks; ``B`` may be a multiple when vLLM splits them). For the CPU
    backend, ``cpu_isa`` names the kernels it runs on this cache (its layer's ``isa``)."""
    if view.dim() != 4:
        raise UnsupportedPages(f"{name}: expected vLLM's [blocks, heads, tokens, cell] view, got {tuple(view.shape)}")
    kb, heads, n, cell = (int(x) for x in view.shape)
    if num_blocks <= 0 or kb % num_blocks:
        raise UnsupportedPages(f"{name}: {kb} kernel blocks are not a multiple of the engine's {num_blocks} blocks")
    ratio = kb // num_blocks
    if layout.kind is AttnKind.MLA:
        latent = layout.kv_lora_rank + layout.qk_rope_head_dim
        if backend not in MLA_BACKENDS:
            raise UnsupportedPages(f"{name}: MLA backend {backend} is not one kvstore maps "
                                   f"(known: {', '.join(sorted(MLA_BACKENDS))})")
        if heads != 1 or cell != latent:
            raise UnsupportedPages(f"{name}: MLA page of {heads} heads x {cell} elements; kvstore stores one "
                                   f"latent of {latent} (kv_lora_rank + rope) per token: packed caches such as "
                                   "fp8_ds_mla are not supported")
        return LayerPages((view,), ratio)
    d = layout.head_dim
    if heads != layout.num_kv_heads or cell != 2 * d:
        raise UnsupportedPages(f"{name}: page of {heads} heads x {cell} elements; the layout has {layout.num_kv_heads} "
                               f"KV heads of K and V with head_dim {d} (quantized or packed caches with scales "
                               "are not supported)")
    if backend in SPLIT_CELL_BACKENDS:
        return LayerPages((view[..., :d], view[..., d:]), ratio)
    if backend == CPU_BACKEND:
        return cpu_pages(name, view, d, ratio, cpu_isa)
    raise UnsupportedPages(f"{name}: attention backend {backend} is not one kvstore maps to its canonical layout "
                           f"(known: {', '.join(sorted(SPLIT_CELL_BACKENDS | {CPU_BACKEND} | MLA_BACKENDS))})")


def cpu_pages(name: str, view: torch.Tensor, d: int, ratio: int, isa: str = "vec") -> LayerPages:
    """The CPU backend's page: per (block, head) ``[N, 2D]`` memory read as its K half then its
    V half, each ``N * D`` elements, in the order the ``isa`` kernels write them."""
    kb, heads, n, cell = view.shape
    if view.stride(3) != 1 or view.stride(2) != cell:
        raise UnsupportedPages(f"{name}: the CPU backend's pages must be contiguous per (block, head) "
                               f"(LBHNC); got strides {view.stride()}")
    if isa == "amx":
        return amx_pages(name, view, d, ratio)
    halves = view.view(kb, heads, 2, n * d)  # the backend's own view(B, H, 2N, D), split in two
    k = halves[:, :, 0].view(kb, heads, d, n).transpose(2, 3)
    v = halves[:, :, 1].view(kb, heads, n, d)
    return LayerPages((k, v), ratio)


AMX_TILE_ROW_BYTES = 64  # one row of an AMX tile; a B tile's row is 4 bytes of each of 16 columns
AMX_B_COLUMNS = AMX_TILE_ROW_BYTES // 4
AMX_PAIR = 2  # a B tile's 4 bytes hold two bf16 elements; fp8 caches pack two bytes per 16 bits
AMX_ALIGN = 2 * AMX_B_COLUMNS  # the kernels' BlockSizeAlignment and HeadDimAlignment
# vLLM's fp8 cache dtypes (its CPU caches hold them as bytes).
FP8_CACHE_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def amx_pages(name: str, view: torch.Tensor, d: int, ratio: int) -> LayerPages:
    """The ``amx`` kernels' halves (``AttentionImpl<ISA::AMX>::reshape_and_cache``, and for fp8
    caches ``reshape_and_cache_fp8_amx_impl``), with ``q = 2`` elements to a pair, as tiled
    views (:class:`~kvstore.clients.hbm_paged.LayerPages`):

    - K: groups of 16 tokens; in a group, for each pair of elements ``d // q``, the 16 tokens'
      ``q`` elements: token ``t``, element ``e`` at ``(t // 16) * 16 D + (e // q) * 16 q +
      (t % 16) * q + e % q``;
    - V: groups of 16 elements; in a group, for each ``q`` tokens ``t // q``, the 16 elements of
      those tokens interleaved: ``(e // 16) * 16 N + (t // q) * 16 q + (e % 16) * q + t % q``."""
    kb, heads, n, _ = view.shape
    q, c = AMX_PAIR, AMX_B_COLUMNS
    if view.element_size() > 2 or n % AMX_ALIGN or d % AMX_ALIGN:
        raise UnsupportedPages(f"{name}: the CPU backend's 'amx' pages need tokens and head_dim in multiples of "
                               f"{AMX_ALIGN} and 1- or 2-byte elements; got {n} tokens x {d} of {view.dtype}")
    sb, sh = view.stride(0), view.stride(1)  # cpu_pages checked each (block, head) page is contiguous
    base = view.storage_offset()
    k = view.as_strided((kb, heads, n // c, c, d // q, q), (sb, sh, c * d, q, c * q, 1), base)
    v = view.as_strided((kb, heads, n // q, q, d // c, c), (sb, sh, c * q, 1, c * n, q), base + n * d)
    return LayerPages((k, v), ratio)


def check_cpu_pages(view: torch.Tensor, isa: str, model_dtype: torch.dtype, kv_cache_dtype: str = "auto",
                    pages=cpu_pages) -> None:
    """Run the CPU backend's cache-write kernel on a scratch page shaped like ``view`` and
    check that ``pages`` (:func:`cpu_pages`) reads back what it wrote, byte for byte. Different
    ISAs (``vec``, ``amx``, ...) and cache dtypes lay K/V out differently; one whose layout
    kvstore does not know is refused instead of storing scrambled KV."""
    from vllm import _custom_ops as ops

    _, heads, n, cell = view.shape
    d = cell // 2
    held = FP8_CACHE_DTYPES.get(kv_cache_dtype, view.dtype)  # what the cache's elements are
    scratch = torch.zeros((1, heads, n, cell), dtype=view.dtype)
    kc, vc = scratch.view(1, heads, 2 * n, d).chunk(2, dim=2)
    g = torch.Generator().manual_seed(0)

    def exact() -> torch.Tensor:
        """Nonzero +-m * 2^e, m in 1..7, e in -3..3: exact in every cache type (fp8 too), so a
        quantizing write is the identity; no -0 (vLLM's fp8 write stores it as +0)."""
        m = torch.randint(1, 8, (n, heads, d), generator=g).float()
        e = torch.randint(-3, 4, (n, heads, d), generator=g).float()
        return (torch.randint(0, 2, (n, heads, d), generator=g).float() * 2 - 1) * m * torch.exp2(e)
    key, value = exact(), exact()
    try:
        ops.cpu_attn_reshape_and_cache(key.to(model_dtype), value.to(model_dtype), kc, vc,
                                       torch.arange(n, dtype=torch.int64), isa, kv_cache_dtype=kv_cache_dtype)
    except (RuntimeError, NotImplementedError) as e:
        raise UnsupportedPages(f"the CPU attention backend's {isa!r} cache write (cache dtype {kv_cache_dtype}) "
                               f"fails on a scratch page: {e}") from None
    mine = pages("probe", scratch, d, 1, isa)
    tokens = torch.arange(n)
    got = [page_rows(h, torch.zeros_like(tokens), tokens).view(torch.uint8) for h in mine.halves]  # [N, H, D bytes]
    if not all(torch.equal(x, want.to(held).view(torch.uint8)) for x, want in zip(got, (key, value))):
        raise UnsupportedPages(f"the CPU attention backend's {isa!r} kernels lay K/V out in a way kvstore does not "
                               f"know (cache dtype {kv_cache_dtype}); nothing is stored or loaded (known: 'vec', "
                               "'vec16', 'amx', on bf16, fp16, fp32 and fp8 caches)")


__all__ = ["CPU_BACKEND", "FP8_CACHE_DTYPES", "MLA_BACKENDS", "SPLIT_CELL_BACKENDS", "UnsupportedPages",
           "amx_pages", "check_cpu_pages", "cpu_pages", "layer_pages"]
