"""Many same-shaped strided copies in one C call, for CPU caches: KV blocks between the arena's
slots and an engine's pages (:class:`~kvstore.clients.hbm_paged.KVMover`'s whole-block copies).

A torch ``copy_`` per run of adjacent slots costs Python time per run, and slots a daemon hands
out are scattered: a 2048-token hit measured 12-29 ms of CPU in the engine's thread for 12.4 MB.
:class:`ItemCopy` moves every block of a (layer, half) in one call, with the GIL released,
whatever the slots' order. The library is ``tiers/_kvcopy.c``, built by
``scripts/build_kvcodec.sh``; without it (:func:`native` is None) the callers keep their torch
copies.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
import torch

_lib: list = []
MAX_DIMS, MAX_GROUPS = 8, 256  # as tiers/_kvcopy.c has them


def native():
    """The C library, or None where it was not built."""
    if not _lib:
        path = Path(__file__).with_name("_kvcopy.so")
        lib = None
        if path.exists():
            lib = ctypes.CDLL(str(path))
            lib.kvc_copy.restype = ctypes.c_int
            lib.kvc_copy.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,
                                     ctypes.c_int]
        _lib.append(lib)
    return _lib[0]


class ItemCopy:
    """Copies of items that are views of one shape, ``dst_strides`` and ``src_strides`` (in
    elements of ``esize`` bytes, as torch gives them), at per-item base addresses. The dims are
    ordered by destination stride (writes run forward) and merged where both sides are
    contiguous across them, so a dense row is one memcpy."""

    def __init__(self, shape, dst_strides, src_strides, esize: int, threads: int = 1) -> None:
        if not (len(shape) == len(dst_strides) == len(src_strides)):
            raise ValueError(f"shape {tuple(shape)} and strides {tuple(dst_strides)} / {tuple(src_strides)} differ in rank")
        dims = sorted(((int(n), int(d) * esize, int(s) * esize) for n, d, s in zip(shape, dst_strides, src_strides)
                       if int(n) != 1), key=lambda x: -abs(x[1]))
        merged: list[list[int]] = []
        for n, d, s in dims:
            if merged and merged[-1][1] == n * d and merged[-1][2] == n * s:
                merged[-1] = [merged[-1][0] * n, d, s]
            else:
                merged.append([n, d, s])
        merged = merged or [[1, esize, esize]]
        if len(merged) > MAX_DIMS:
            raise ValueError(f"a view of {len(merged)} dims after merging; the C copy takes {MAX_DIMS}")
        self.shape, self.ds, self.ss = ([m[k] for m in merged] for k in range(3))  # strides in bytes
        self.nbytes = int(np.prod(self.shape)) * esize  # one item's bytes
        pad = [0] * (MAX_DIMS - len(merged))
        self.desc = [len(merged)] + self.shape + pad + self.ds + pad + self.ss + pad
        self.esize, self.threads = esize, threads

    @classmethod
    def of(cls, dst: torch.Tensor, src: torch.Tensor, threads: int = 1) -> "ItemCopy":
        """The copy of views shaped like ``src`` into ones shaped like ``dst`` (one item each)."""
        if dst.shape != src.shape or dst.element_size() != src.element_size():
            raise ValueError(f"items {tuple(src.shape)} x {src.element_size()} B into {tuple(dst.shape)} x "
                             f"{dst.element_size()} B")
        return cls(dst.shape, dst.stride(), src.stride(), dst.element_size(), threads)

    def run(self, dst: np.ndarray, src: np.ndarray) -> None:
        """Copy item ``i`` from address ``src[i]`` to ``dst[i]`` (int64 arrays): addresses the
        caller has checked against its buffers."""
        copy_groups([(self, dst, src)], self.threads)


def copy_groups(groups, threads: int = 1) -> None:
    """One C call (per ``MAX_GROUPS``) for ``(ItemCopy, dst addresses, src addresses)`` groups
    of one element size, split over ``threads`` threads."""
    if len(groups) > MAX_GROUPS:
        for k in range(0, len(groups), MAX_GROUPS):
            copy_groups(groups[k:k + MAX_GROUPS], threads)
        return
    if not groups:
        return
    if len({c.esize for c, _, _ in groups}) > 1:
        raise ValueError(f"groups of element sizes {sorted({c.esize for c, _, _ in groups})}: one call copies one")
    for _, d, s in groups:
        if np.shape(d) != np.shape(s):
            raise ValueError(f"{np.size(d)} destinations for {np.size(s)} sources")
    desc = np.array([[np.size(d)] + c.desc for c, d, _ in groups], dtype=np.int64)
    dst = np.concatenate([np.asarray(d, np.int64).reshape(-1) for _, d, _ in groups])
    src = np.concatenate([np.asarray(s, np.int64).reshape(-1) for _, _, s in groups])
    if native().kvc_copy(len(groups), desc.ctypes.data, dst.ctypes.data, src.ctypes.data, groups[0][0].esize, threads):
        raise ValueError(f"kvc_copy refused {len(groups)} groups of items {[c.shape for c, _, _ in groups]}")


class BlockCopy:
    """Whole-block copies between the arena's slots and a :class:`~kvstore.clients.hbm_paged.PagedKV`
    on the CPU, one :class:`ItemCopy` call per (layer, half): every block's slot, wherever it
    lies, and its kernel blocks, wherever vLLM put them.

    ``slot(off)``: the slot at arena offset ``off`` as bytes ``[1, layers, halves, bt, row]``
    (this rank's columns); ``host``: the arena (a uint8 tensor) the offsets count in."""

    def __init__(self, paged, slot, host: torch.Tensor, block_bytes: int, threads: int = 1) -> None:
        self.paged, self.slot, self.host, self.block_bytes, self.threads = paged, slot, host, block_bytes, threads
        self._plans: dict[tuple, tuple] = {}

    def _plan(self, l: int, i: int, m: int, to_slots: bool):
        """(copy, slot item's offset in its slot, step between a block's kernel blocks in the slot)."""
        key = (l, i, m, to_slots)
        if key not in self._plans:
            h = self.paged.pages[l].halves[i]
            v = self.paged._block_view(h, self.slot(0)[:, l][:, i], m)[0]  # [m, heads, ...] of the slot at 0
            page = h[0]
            copy = ItemCopy.of(v[0], page) if to_slots else ItemCopy.of(page, v[0])
            self._plans[key] = (copy, v[0].data_ptr() - self.host.data_ptr(), v.stride(0) * v.element_size())
        return self._plans[key]

    def check(self, idx: torch.Tensor, offsets: np.ndarray) -> None:
        """Raise unless every slot lies in the arena and every kernel block in the pages: the C
        copy writes wherever an address points."""
        if offsets.size and (offsets.min() < 0 or offsets.max() + self.block_bytes > self.host.numel()):
            raise ValueError(f"slot offsets [{offsets.min()}, {offsets.max()}] + {self.block_bytes}-byte blocks fall "
                             f"outside the {self.host.numel()}-byte arena")
        kblocks = self.paged.pages[0].halves[0].shape[0]
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= kblocks):
            raise ValueError(f"kernel blocks [{int(idx.min())}, {int(idx.max())}] outside the cache's {kblocks}")

    def run(self, idx: torch.Tensor, offsets: np.ndarray, layers, to_slots: bool) -> None:
        """Copy ``layers`` of block ``j`` between the slot at ``offsets[j]`` and kernel blocks
        ``idx[j]`` (:meth:`PagedKV.block_index`, ``[n, m]``), checked by :meth:`check`."""
        if not offsets.size:
            return
        m = int(idx.shape[1])
        kb = idx.numpy().astype(np.int64)
        base = self.host.data_ptr() + offsets[:, None]
        groups = []
        for l in layers:
            for i, h in enumerate(self.paged.pages[l].halves):
                copy, rel, step = self._plan(l, i, m, to_slots)
                slots = base + rel + np.arange(m, dtype=np.int64) * step
                pages = h.data_ptr() + kb * (h.stride(0) * h.element_size())
                groups.append((copy, slots, pages) if to_slots else (copy, pages, slots))
        copy_groups(groups, self.threads)
