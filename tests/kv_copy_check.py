"""The check both the emulated (tests/test_kv_kernels_emulated.py, Triton's interpreter on CPU
tensors) and the CUDA (tests/gpu/test_cuda_kernels.py) kernel tests run: the same blocks through
the legacy path and a batched path, compared byte for byte in the arena and in the cache.
Imports only numpy, torch and ``kvstore.tiers`` (a bare GPU image has no more)."""

from __future__ import annotations

import numpy as np
import torch

from kvstore.tiers.arena import Arena
from kvstore.clients.hbm_paged import KVMover, PagedKV
from kvstore.tiers.kv_copy import CopyPath


def fill(tensors, seed: int) -> None:
    """Small integers (exact in every float type) in every element of ``tensors``."""
    g = torch.Generator().manual_seed(seed)
    for t in tensors:
        t.copy_(torch.randint(-100, 100, t.shape, generator=g).to(t.dtype))


def _movers(pages, layout, host_a, host_b, path):
    legacy = KVMover(PagedKV(pages[0], layout), layout, host_a, "legacy")
    batched = KVMover(PagedKV(pages[1], layout), layout, host_b, path)
    assert batched.copy_path is CopyPath(path) and batched.batched is not None, batched.copy_reason
    return legacy, batched


def _run(movers, op, *args) -> None:
    evs = [getattr(m, op)(*args) for m in movers]
    for e in evs:
        (e[-1] if isinstance(e, list) else e).synchronize()


def _rows(mover, table, tokens):
    return mover.device_rows(mover.paged.token_rows(table, tokens))


def check_both_ways(layout, make_pages, table, n_blocks: int, offsets, path: str, layerwise: bool) -> None:
    """Store the same blocks through both paths into two arenas (equal, byte for byte), then
    load them from the arena into two equal destination caches (equal, untouched bytes too).
    ``make_pages()`` returns (what PagedKV takes, the tensors that hold its memory)."""
    span = max(o for o in offsets if o is not None) + layout.block_bytes + 64
    arena_a, arena_b = Arena(span, prefault=False), Arena(span, prefault=False)
    host_a, host_b = arena_a.buf, arena_b.buf
    try:
        (src_a, mem_a), (src_b, mem_b) = make_pages(), make_pages()
        fill(mem_a, 1), fill(mem_b, 1)
        legacy, batched = _movers((src_a, src_b), layout, host_a, host_b, path)
        try:
            rows = _rows(legacy, table, n_blocks * layout.block_tokens)
            if layerwise:
                for l in range(layout.num_layers):
                    _run((legacy, batched), "store_layer", l, rows, offsets)
            else:
                _run((legacy, batched), "store_all", rows, offsets)
            assert host_a.any() and np.array_equal(host_a, host_b)
        finally:
            legacy.close(), batched.close()
        present = [o for o in offsets if o is not None]
        (dst_a, mem_a), (dst_b, mem_b) = make_pages(), make_pages()
        fill(mem_a, 2), fill(mem_b, 2)
        legacy, batched = _movers((dst_a, dst_b), layout, host_a, host_a, path)
        try:
            rows = _rows(legacy, table, len(present) * layout.block_tokens)
            if layerwise:
                for l in range(layout.num_layers):
                    _run((legacy, batched), "load_layer", l, rows, present)
            else:
                _run((legacy, batched), "load_all", rows, present)
            assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(mem_a, mem_b))
        finally:
            legacy.close(), batched.close()
    finally:
        arena_a.close(), arena_b.close()


def scattered_offsets(layout, n: int, skip=(), misalign: int = 0) -> list:
    """Slots out of order, the first two adjacent (one run), ``misalign`` bytes off any word;
    None = skip the block (a store's partial run: cached already or written elsewhere)."""
    offs = [s * layout.block_bytes + misalign for s in (3, 4, 0, 6, 1, 7)[:n]]
    return [None if j in skip else o for j, o in enumerate(offs)]


def classic(layout, num_blocks: int, block_size: int, device="cpu"):
    """``make_pages`` for the classic paged shape ``[2, blocks, block_size, heads, dim]``
    (MLA ``[blocks, block_size, latent]``)."""
    dt = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[layout.dtype.label]
    if layout.kind.value == "mla":
        shape = (num_blocks, block_size, layout.kv_lora_rank + layout.qk_rope_head_dim)
    else:
        shape = (2, num_blocks, block_size, layout.num_kv_heads, layout.head_dim)

    def make():
        t = [torch.zeros(shape, dtype=dt, device=device) for _ in range(layout.num_layers)]
        return t, t
    return make
