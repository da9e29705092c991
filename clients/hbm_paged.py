"""Copies between a worker's paged KV cache and kvstore block slots, on a side stream.

The worker's cache is paged, one set of views per layer (:class:`LayerPages`: K and V as
``[blocks, heads, tokens, dim]`` over whatever memory layout the attention backend uses, or
a tensor in the classic ``[2, num_blocks, block_size, kv_heads, head_dim]`` shape; MLA: one
latent); a block table maps the request's block ``i`` (``block_size`` tokens) to a physical
block id. kvstore keeps a block of
``block_tokens`` tokens layer-major in a slot, ``[layers, 2, block_tokens, row]`` with ``row =
kv_heads * head_dim * elem`` bytes (``kvstore.clients.blocks_io.block_shape``); the two block sizes need
not match. By default one batched Triton launch per layer (or per bulk op) moves all of a
request's blocks (:mod:`kvstore.tiers.kv_copy`); the legacy path (``copy_path="legacy"``, and
wherever the kernels cannot run) gathers and scatters with index kernels on the cache's device,
with one slot DMA per (block, layer) for layer-wise ops and one per run of adjacent slots for
bulk ops.

CUDA caches run on a :class:`~kvstore.tiers.hbm_device.CudaStream` with the host arena
page-locked in place; CPU caches run the same code on an emulated stream (a copy thread).
:mod:`kvstore.clients.gpu` wraps this with the daemon's leases.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvstore.layout import AttnKind, DType, HeadShard, KVLayout
from kvstore.tiers import cpu_copy
from kvstore.tiers.arena import slot_runs
from kvstore.tiers.hbm_device import (CudaEvent, DeviceChoice, DeviceKind, EmuEvent, EmuStream, HostPin,
                                      choose_device, make_stream)
from kvstore.tiers.kv_copy import DEFAULT_COPY_PATH, BatchedKV, CopyPath, resolve_copy_path

BULK_STAGING_BYTES = 64 << 20  # device staging per bulk store/load step (bytes)

# Element types a cache of each KV dtype may have (engines keep fp8 and packed caches as bytes).
TORCH_DTYPES = {
    DType.FP32: (torch.float32,), DType.FP16: (torch.float16,), DType.BF16: (torch.bfloat16,),
    DType.FP8_E4M3: (torch.float8_e4m3fn, torch.uint8), DType.FP8_E5M2: (torch.float8_e5m2, torch.uint8),
    DType.INT8: (torch.int8, torch.uint8), DType.INT4: (torch.uint8,),
}


@dataclass(frozen=True, slots=True)
class LayerPages:
    """One layer of a worker's paged KV cache as logical views ``[kernel_blocks, heads, n,
    dim]`` over the engine's own memory (any strides, no copy): ``(K, V)``, or ``(latent,)``
    with one head for MLA. ``ratio`` kernel blocks of ``n`` tokens make one block of the
    engine's block table (vLLM splits a manager block for kernels that want smaller pages).

    A view may also be *tiled*, ``[kernel_blocks, heads, n / ni, ni, dim / di, di]``: token
    ``t`` at ``(t // ni, t % ni)``, element ``d`` at ``(d // di, d % di)``, for kernels that
    interleave tokens and elements (the CPU backend's AMX pages). Tiled pages take the legacy
    copies (:class:`KVMover`)."""

    halves: tuple[torch.Tensor, ...]
    ratio: int = 1

    @property
    def tiled(self) -> bool:
        return any(h.dim() == 6 for h in self.halves)


def page_shape(h: torch.Tensor) -> tuple[int, int, int, int]:
    """(kernel blocks, heads, tokens, dim) of a plain or tiled page view (:class:`LayerPages`)."""
    if h.dim() == 4:
        return tuple(int(x) for x in h.shape)
    if h.dim() == 6:
        b, heads, no, ni, do, di = (int(x) for x in h.shape)
        return b, heads, no * ni, do * di
    raise ValueError(f"kv cache pages: expected [blocks, heads, tokens, dim] or a tiled 6-d view, got "
                     f"{tuple(h.shape)}")


def legacy_pages(t: torch.Tensor, layout: KVLayout) -> LayerPages:
    """Pages of a cache tensor in the classic paged shape: ``[2, num_blocks, block_size,
    kv_heads, head_dim]`` (MLA: ``[num_blocks, block_size, latent]``)."""
    if layout.kind is AttnKind.MLA:
        if t.dim() != 3:
            raise ValueError(f"kv cache: expected [num_blocks, block_size, latent] for MLA, got {tuple(t.shape)}")
        return LayerPages((t.unsqueeze(1),))
    if t.dim() != 5 or t.shape[0] != 2:
        raise ValueError(f"kv cache: expected [2, num_blocks, block_size, kv_heads, head_dim], got {tuple(t.shape)}")
    return LayerPages((t[0].permute(0, 2, 1, 3), t[1].permute(0, 2, 1, 3)))


class PagedKV:
    """A worker's paged per-layer KV cache: one :class:`LayerPages` (or a tensor in the
    classic shape, see :func:`legacy_pages`) per layer. Gather and scatter move whole token
    rows in kvstore's canonical order (``[halves, tokens, heads, dim]``), so the block bytes
    are the same whatever page layout the engine's attention backend uses."""

    def __init__(self, layers: Sequence, layout: KVLayout) -> None:
        if len(layers) != layout.num_layers:
            raise ValueError(f"kv_caches: {len(layers)} layer tensors for a {layout.num_layers}-layer layout")
        mla = layout.kind is AttnKind.MLA
        self.halves = 1 if mla else 2
        self.row = layout.bytes_per_token_layer // self.halves
        heads, dim = (1, None) if mla else (layout.num_kv_heads, layout.head_dim)
        self.pages = [p if isinstance(p, LayerPages) else legacy_pages(p, layout) for p in layers]
        first = self.pages[0].halves[0]
        self.device, self.dtype = first.device, first.dtype
        if self.dtype not in TORCH_DTYPES[layout.dtype]:
            raise ValueError(f"kv_caches: {self.dtype} elements cannot hold the layout's {layout.dtype.label} KV "
                             f"(blocks are keyed by dtype; expected {' or '.join(map(str, TORCH_DTYPES[layout.dtype]))})")
        kblocks, _, self.kernel_block, _ = page_shape(first)
        self.ratio = self.pages[0].ratio
        self.num_blocks, self.block_size = kblocks // self.ratio, self.kernel_block * self.ratio
        for l, p in enumerate(self.pages):
            if len(p.halves) != self.halves or p.ratio != self.ratio:
                raise ValueError(f"kv_caches[{l}]: {len(p.halves)} tensors with block ratio {p.ratio}; layer 0 has "
                                 f"{self.halves} with ratio {self.ratio}")
            for h in p.halves:
                b, nh, n, d = page_shape(h)
                nbytes = nh * d * h.element_size()
                if h.device != self.device or h.dtype != self.dtype:
                    raise ValueError(f"kv_caches[{l}]: {h.dtype} on {h.device}, layer 0 is {self.dtype} on {self.device}")
                if (b, n) != (kblocks, self.kernel_block) or nh != heads or (dim is not None and d != dim) \
                        or nbytes != self.row:
                    raise ValueError(f"kv_caches[{l}]: pages {tuple(h.shape)} of {h.dtype} hold {nbytes} bytes per token "
                                     f"and half; the layout needs {heads} heads of {self.row} bytes in all "
                                     f"({kblocks} blocks of {self.kernel_block} tokens); check dtype and heads")

    def token_rows(self, block_table, n_tokens: int, first: int = 0) -> torch.Tensor:
        """Where each of the request's tokens ``[first, n_tokens)`` lives: ``[n_tokens - first, 2]``
        (kernel block, position in it), CPU int64. Slicing it slices tokens."""
        table = torch.as_tensor(block_table).reshape(-1).to("cpu", torch.int64)
        need = -(-n_tokens // self.block_size)
        if table.numel() < need:
            raise ValueError(f"block_table: {table.numel()} blocks of {self.block_size} tokens cover fewer than "
                             f"{n_tokens} tokens")
        table = table[:need]
        if need and (int(table.min()) < 0 or int(table.max()) >= self.num_blocks):
            raise ValueError(f"block_table: ids must be in [0, {self.num_blocks}), got "
                             f"[{int(table.min())}, {int(table.max())}]")
        t = torch.arange(min(first, n_tokens), n_tokens, dtype=torch.int64)
        within = t % self.block_size
        kb = table[t // self.block_size] * self.ratio + within // self.kernel_block
        return torch.stack([kb, within % self.kernel_block], dim=1)

    @property
    def tiled(self) -> bool:
        return any(p.tiled for p in self.pages)

    def gather(self, l: int, rows: torch.Tensor) -> torch.Tensor:
        """Layer ``l`` of the tokens at ``rows`` as bytes ``[halves, tokens, row]``."""
        b, n = rows[:, 0], rows[:, 1]
        g = torch.stack([page_rows(h, b, n) for h in self.pages[l].halves])  # [halves, tokens, heads, dim]
        return g.view(torch.uint8).reshape(self.halves, rows.shape[0], self.row)

    def block_index(self, rows: torch.Tensor, bt: int) -> torch.Tensor | None:
        """The kernel blocks that hold ``rows`` (:meth:`token_rows`) as whole ``bt``-token
        blocks: ``[n, bt // kernel_block]``, when each ``bt`` tokens fill whole kernel blocks in
        order (vLLM's blocks are kvstore's, or split evenly for the kernels); else None."""
        K = self.kernel_block
        if bt % K or rows.shape[0] % bt:
            return None
        n, m = rows.shape[0] // bt, bt // K
        r = rows.view(n, m, K, 2)
        kb = r[:, :, 0, 0]
        if not (torch.equal(r[..., 0], kb.unsqueeze(-1).expand(n, m, K))
                and torch.equal(r[..., 1], torch.arange(K).expand(n, m, K))):
            return None
        return kb.contiguous()

    def _block_view(self, h: torch.Tensor, blocks: torch.Tensor, m: int) -> torch.Tensor:
        """Bytes ``[n, bt, row]`` of one half (any strides; rows contiguous) as the elements
        ``h[idx]`` has for an index ``idx`` of ``[n, m]`` kernel blocks."""
        v = blocks.view(self.dtype).unflatten(2, (h.shape[1], -1))  # [n, bt, heads, dim]
        v = v.unflatten(1, (m, self.kernel_block)).permute(0, 1, 3, 2, 4)  # [n, m, heads, K, dim]
        if h.dim() == 6:  # tiled: token t at (t // ni, t % ni), element d at (d // di, d % di)
            v = v.unflatten(3, (h.shape[2], h.shape[3])).unflatten(5, (h.shape[4], h.shape[5]))
        return v

    @staticmethod
    def runs(idx: torch.Tensor) -> list[tuple[int, int, int]] | None:
        """``(first, end, kernel block)`` of each run of consecutive kernel blocks in ``idx``
        (one kernel block per block), or None: blocks split in several kernel blocks, or so
        many runs that one indexed copy does better."""
        if idx.shape[1] != 1:
            return None
        flat = idx[:, 0]
        cuts = (torch.nonzero(flat[1:] - flat[:-1] != 1).reshape(-1) + 1).tolist()
        if len(cuts) > 8:
            return None
        bounds = [0, *cuts, flat.numel()]
        return [(a, b, int(flat[a])) for a, b in zip(bounds, bounds[1:])]

    def scatter_blocks(self, l: int, idx: torch.Tensor, src: torch.Tensor, runs=False) -> None:
        """Write bytes ``src`` ``[n, halves, bt, row]`` (a view of slots: any strides, rows
        contiguous) into layer ``l``'s kernel blocks ``idx`` (:meth:`block_index`), no
        staging: one strided copy per run of consecutive blocks and half (vLLM hands out a
        fresh request's blocks mostly in runs), else one indexed copy per half. ``runs``:
        :meth:`runs` of ``idx`` where the caller has it (one op copies every layer)."""
        runs = self.runs(idx) if runs is False else runs
        for i, h in enumerate(self.pages[l].halves):
            v = self._block_view(h, src[:, i], idx.shape[1])
            if runs is None:
                h[idx] = v
                continue
            v = v[:, 0]
            for a, b, k in runs:
                h[k:k + b - a].copy_(v[a:b])

    def gather_blocks(self, l: int, idx: torch.Tensor, dst: torch.Tensor, runs=False) -> None:
        """Copy layer ``l``'s kernel blocks ``idx`` into bytes ``dst`` ``[n, halves, bt, row]``
        (a view of slots), the inverse of :meth:`scatter_blocks`."""
        runs = self.runs(idx) if runs is False else runs
        for i, h in enumerate(self.pages[l].halves):
            v = self._block_view(h, dst[:, i], idx.shape[1])
            if runs is None:
                v.copy_(h[idx])
                continue
            v = v[:, 0]  # a view: the copies below write the slots
            for a, b, k in runs:
                v[a:b].copy_(h[k:k + b - a])

    def scatter(self, l: int, rows: torch.Tensor, src: torch.Tensor) -> None:
        """Write bytes ``src`` ``[halves, tokens, row]`` into layer ``l`` at ``rows``."""
        b, n = rows[:, 0], rows[:, 1]
        for i, h in enumerate(self.pages[l].halves):
            dims = h.shape[4:] if h.dim() == 6 else h.shape[3:]  # what one (token, head) holds
            h[_token_index(h, b, n)] = src[i].contiguous().view(self.dtype).view(rows.shape[0], h.shape[1], *dims)


def _token_index(h: torch.Tensor, b: torch.Tensor, n: torch.Tensor) -> tuple:
    """The index of the tokens at kernel blocks ``b``, positions ``n`` in a plain or tiled page
    view ``h`` (:class:`LayerPages`); indexing with it gives ``[tokens, heads, ...]``."""
    if h.dim() == 4:
        return b, slice(None), n
    ni = h.shape[3]
    return b, slice(None), n // ni, n % ni


def page_rows(h: torch.Tensor, b: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """The tokens at kernel blocks ``b``, positions ``n`` of a plain or tiled page view ``h``
    (:class:`LayerPages`): ``[tokens, heads, dim]``, a copy."""
    return h[_token_index(h, b, n)].flatten(2)


def _choice_for(device: torch.device) -> DeviceChoice:
    if device.type == "cuda":
        return DeviceChoice(DeviceKind.CUDA, device.index if device.index is not None else torch.cuda.current_device())
    why = choose_device("auto").reason or "CUDA is available but the caches are on the CPU"
    return DeviceChoice(DeviceKind.EMULATED, reason=f"kv caches are CPU tensors ({why})")


def wait_events(events, timeout_s: float | None = None) -> bool:
    """Block until every event fired (True) or ``timeout_s`` passed (False); raise the first
    failed op's error. CUDA events have no timed wait, so a bounded wait polls ``query``."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    for ev in events:
        if deadline is None or isinstance(ev, EmuEvent):
            try:
                ev.synchronize(None if deadline is None else max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                return False
            continue
        while not ev.query():
            if time.monotonic() >= deadline:
                return False
            time.sleep(50e-6)
    return True


class KVMover:
    """Copies between a :class:`PagedKV` and block slots of a host arena on one side stream.
    No daemon: offsets are arena byte offsets of the blocks (None = skip that block).

    ``copy_path`` (:class:`~kvstore.tiers.kv_copy.CopyPath`): ``zerocopy`` / ``staged`` run
    the batched Triton kernels of :mod:`kvstore.tiers.kv_copy` (one launch per layer, or per
    bulk step); ``legacy`` the per-(block, layer) copies below. Where the kernels cannot run
    (no Triton; CPU caches without ``TRITON_INTERPRET=1``) it is ``legacy``, and
    ``copy_reason`` says why. On CPU caches the legacy copies move whole blocks straight
    between the slots and the pages when each block fills whole pages (:meth:`PagedKV.block_index`),
    else token rows through a staging buffer.

    ``inline`` (CPU caches only): run each copy in the calling thread (:class:`InlineStream`)
    instead of on a copy thread, for a caller that waits for its copies at once (vLLM's CPU
    backend: the caches are the engine's device, not a GPU's stand-in).

    ``shard`` (:class:`~kvstore.layout.HeadShard`): the slots hold every KV head of ``layout``
    and ``paged`` (a TP rank's cache) some of them: the copies read and write those heads'
    columns of each token row, nothing else (the zero-copy kernels and the legacy copies; the
    staged path, which moves whole chunks, falls back to legacy)."""

    def __init__(self, paged: PagedKV, layout: KVLayout, host: np.ndarray,
                 copy_path: CopyPath | str = DEFAULT_COPY_PATH, inline: bool = False,
                 shard: HeadShard | None = None) -> None:
        self.paged, self.layout = paged, layout
        self.slot_row = layout.bytes_per_token_layer // paged.halves  # bytes of a slot's token row
        self.cols = slice(None)
        if shard is not None and shard.count < layout.num_kv_heads:
            self.cols = slice(*shard.columns(layout))
        self.choice = _choice_for(paged.device)
        self.stream = make_stream(self.choice, "kvstore-gpu-side", inline=inline)
        self.pin = HostPin(self.choice, host.ctypes.data, host.nbytes)
        with torch.inference_mode(False):
            # Copies run on the side stream's thread, where the caller's inference mode (vLLM
            # runs its forward under it) does not hold: an inference tensor could not be written.
            self.host = torch.from_numpy(host)
        self.chunk = layout.layer_chunk_bytes
        self.copy_path, self.copy_reason = resolve_copy_path(copy_path, paged.device)
        if self.copy_path is not CopyPath.LEGACY and paged.tiled:
            self.copy_path = CopyPath.LEGACY
            self.copy_reason = ("the pages are tiled (the CPU backend's AMX layout); the batched kernels take "
                                "[blocks, heads, tokens, dim] views: using the legacy per-block copies")
        if self.copy_path is CopyPath.STAGED and self.cols != slice(None):
            self.copy_path = CopyPath.LEGACY
            self.copy_reason = ("the slots hold every KV head and this rank some: the staged path moves whole "
                                "chunks; using the legacy per-block copies of this rank's columns (zerocopy writes "
                                "them in place)")
        self.batched = None
        self.native = None  # the C whole-block copies (CPU caches, where the library was built)
        self._last_index: tuple = (None, None, None)  # (rows, offsets, _block_index of them)
        if paged.device.type == "cpu" and self.copy_path is CopyPath.LEGACY and cpu_copy.native() is not None:
            # As many threads as the engine gives torch's own ops (vLLM: the cores bound to this worker).
            self.native = cpu_copy.BlockCopy(paged, lambda off: self._slot_blocks(0, 1, off), self.host,
                                             layout.block_bytes, threads=min(8, torch.get_num_threads()))
        if self.copy_path is not CopyPath.LEGACY:
            try:
                self.batched = BatchedKV(paged.pages, layout, self.host, self.copy_path, BULK_STAGING_BYTES,
                                         slot_col=self.cols.start or 0)
            except BaseException:
                self.close()
                raise

    @property
    def emulated(self) -> bool:
        return self.choice.emulated

    def _block_index(self, rows: torch.Tensor, offsets: Sequence[int | None]) -> torch.Tensor | None:
        """:meth:`PagedKV.block_index` of ``rows`` where whole-block copies can run (CPU
        caches, element-aligned slots), else None."""
        p = self.paged
        if p.device.type != "cpu" or self.batched is not None:
            return None
        if self._last_index[0] is rows and self._last_index[1] is offsets:
            return self._last_index[2]  # a layer-wise op: the same rows and slots for every layer
        esize = p.pages[0].halves[0].element_size()
        idx = None
        if not (self.chunk % esize or any(o % esize for o in offsets if o is not None)):
            idx = p.block_index(rows, self.layout.block_tokens)
        self._last_index = (rows, offsets, idx)
        return idx

    def _whole_blocks(self, idx: torch.Tensor, offsets: Sequence[int | None], layers, to_slots: bool):
        """Submit the copies of ``layers`` of the blocks straight between the slots and the
        pages (``to_slots``: a store); returns the op's event. With the C copy
        (:class:`~kvstore.tiers.cpu_copy.BlockCopy`) one call per layer and half moves every
        block; else :meth:`PagedKV.gather_blocks` / :meth:`PagedKV.scatter_blocks` per layer
        and run of adjacent slots."""
        if self.native is not None:
            keep = [j for j, o in enumerate(offsets) if o is not None]
            offs = np.array([offsets[j] for j in keep], dtype=np.int64)
            part = idx if len(keep) == len(offsets) else idx[keep]
            self.native.check(part, offs)
            self.stream.submit(lambda: self.native.run(part, offs, layers, to_slots))
            return self.stream.record()
        copy = self.paged.gather_blocks if to_slots else self.paged.scatter_blocks

        def run() -> None:
            for a, b, off in slot_runs(offsets, self.layout.block_bytes):
                slots, part = self._slot_blocks(a, b, off), idx[a:b]
                runs = self.paged.runs(part)  # once for every layer
                for l in layers:
                    copy(l, part, slots[:, l], runs)

        self.stream.submit(run)
        return self.stream.record()

    def _slot_blocks(self, a: int, b: int, off: int) -> torch.Tensor:
        """Slots of blocks ``[a, b)``, adjacent from ``off``, as bytes ``[b - a, layers, halves, bt, row]``
        (this rank's columns of each row)."""
        return self.host[off:off + (b - a) * self.layout.block_bytes].view(
            b - a, self.layout.num_layers, self.paged.halves, self.layout.block_tokens, self.slot_row)[..., self.cols]

    def _slot_layer(self, off: int, l: int) -> torch.Tensor:
        """Layer ``l`` of the slot at ``off`` as bytes ``[halves, bt, row]`` (this rank's columns)."""
        C = self.chunk
        return self.host[off + l * C:off + (l + 1) * C].view(
            self.paged.halves, self.layout.block_tokens, self.slot_row)[..., self.cols]

    def device_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """``rows`` on the cache's device, copied on the side stream (pinned, async)."""
        if self.paged.device.type != "cuda":
            return rows
        out = []
        self.stream.submit(lambda: out.append(rows.pin_memory().to(self.paged.device, non_blocking=True)))
        return out[0]

    def after(self, dep) -> None:
        """Make the side stream wait for ``dep``: None (CUDA: the current stream's work so far),
        a torch CUDA stream or event, or a kvstore event / emulated stream."""
        if isinstance(dep, (CudaEvent, EmuEvent)):
            self.stream.wait_event(dep)
        elif isinstance(dep, EmuStream):
            self.stream.wait_event(dep.record())
        elif self.choice.kind is DeviceKind.CUDA:
            if dep is None:
                dep = torch.cuda.current_stream(self.paged.device)
            if isinstance(dep, torch.cuda.Stream):
                ev = torch.cuda.Event()
                ev.record(dep)
                dep = ev
            self.stream.wait_event(CudaEvent(dep))
        elif dep is not None:
            raise TypeError(f"after: cannot wait on {type(dep).__name__} on an emulated device")

    # --- the copies; each runs inside stream.submit -----------------------------------------
    def _gather(self, l: int, rows: torch.Tensor, n: int) -> torch.Tensor:
        p = self.paged
        g = p.gather(l, rows)  # [halves, n * bt, row]
        return g.view(p.halves, n, self.layout.block_tokens, p.row).transpose(0, 1)  # [n, halves, bt, row]

    def _scatter(self, l: int, rows: torch.Tensor, staged: torch.Tensor) -> None:
        p = self.paged
        p.scatter(l, rows, staged.transpose(0, 1).reshape(p.halves, -1, p.row))

    def store_layer(self, l: int, rows: torch.Tensor, offsets: Sequence[int | None]):
        """Gather layer ``l`` of the blocks into their slots; returns the op's event."""
        if self.batched is not None:
            self.stream.submit(lambda: self.batched.store_layer(l, rows, offsets))
            return self.stream.record()

        idx = self._block_index(rows, offsets)
        if idx is not None:
            return self._whole_blocks(idx, offsets, (l,), True)

        def run() -> None:
            staged = self._gather(l, rows, len(offsets)).contiguous()
            for j, off in enumerate(offsets):
                if off is not None:
                    self._slot_layer(off, l).copy_(staged[j], non_blocking=True)

        self.stream.submit(run)
        return self.stream.record()

    def load_layer(self, l: int, rows: torch.Tensor, offsets: Sequence[int]):
        """Scatter layer ``l`` of the blocks from their slots; returns the op's event."""
        p = self.paged
        if self.batched is not None:
            self.stream.submit(lambda: self.batched.load_layer(l, rows, offsets))
            return self.stream.record()

        idx = self._block_index(rows, offsets)
        if idx is not None:
            return self._whole_blocks(idx, offsets, (l,), False)

        def run() -> None:
            staged = torch.empty((len(offsets), p.halves, self.layout.block_tokens, p.row),
                                 dtype=torch.uint8, device=p.device)
            for j, off in enumerate(offsets):
                staged[j].copy_(self._slot_layer(off, l), non_blocking=True)
            self._scatter(l, rows, staged)

        self.stream.submit(run)
        return self.stream.record()

    def _steps(self, n: int):
        per = max(1, BULK_STAGING_BYTES // self.layout.block_bytes)
        return ((j, min(n, j + per)) for j in range(0, n, per))

    def store_all(self, rows: torch.Tensor, offsets: Sequence[int | None]):
        """All layers, one DMA per run of adjacent slots; returns the event of the last op."""
        L, bt, B = self.layout.num_layers, self.layout.block_tokens, self.layout.block_bytes
        p = self.paged
        if self.batched is not None:
            self.stream.submit(lambda: self.batched.store_all(rows, offsets))
            return self.stream.record()
        idx = self._block_index(rows, offsets)
        if idx is not None:
            return self._whole_blocks(idx, offsets, range(L), True)

        def run() -> None:
            for j0, j1 in self._steps(len(offsets)):
                staged = torch.empty((j1 - j0, L, p.halves, bt, p.row), dtype=torch.uint8, device=p.device)
                for l in range(L):
                    staged[:, l] = self._gather(l, rows[j0 * bt:j1 * bt], j1 - j0)
                for a, b, off in slot_runs(offsets[j0:j1], B):
                    self._slot_blocks(a, b, off).copy_(staged[a:b], non_blocking=True)

        self.stream.submit(run)
        return self.stream.record()

    def load_all(self, rows: torch.Tensor, offsets: Sequence[int]) -> list:
        """All layers, one DMA per run of adjacent slots; returns one event per layer (all
        fire together: the blocks arrive whole before any layer is scattered)."""
        L, bt, B = self.layout.num_layers, self.layout.block_tokens, self.layout.block_bytes
        p = self.paged
        if self.batched is not None:
            self.stream.submit(lambda: self.batched.load_all(rows, offsets))
            return [self.stream.record()] * L
        idx = self._block_index(rows, offsets)
        if idx is not None:
            return [self._whole_blocks(idx, offsets, range(L), False)] * L

        def run() -> None:
            for j0, j1 in self._steps(len(offsets)):
                staged = torch.empty((j1 - j0, L, p.halves, bt, p.row), dtype=torch.uint8, device=p.device)
                for a, b, off in slot_runs(offsets[j0:j1], B):
                    staged[a:b].copy_(self._slot_blocks(a, b, off), non_blocking=True)
                for l in range(L):
                    self._scatter(l, rows[j0 * bt:j1 * bt], staged[:, l])

        self.stream.submit(run)
        ev = self.stream.record()
        return [ev] * L

    def close(self) -> None:
        self.stream.synchronize()
        self.stream.close()
        self.pin.close()
