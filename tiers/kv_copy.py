"""Batched copies between a worker's paged KV cache and kvstore's arena slots (issue 18).

The path before this (:attr:`CopyPath.LEGACY`) made one small copy per (block, layer) for
layer-wise loads and a chain of torch index kernels per layer and half: 0.07-0.13 of pinned
``cudaMemcpy`` layer by layer on an H200. Here one Triton launch moves one layer of all of a
request's blocks (layer-wise) or every layer (bulk), in kvstore's canonical order, from whatever
page layout the attention backend uses, with block-size mismatch, MLA and unaligned slots:

- :attr:`CopyPath.ZEROCOPY`: the kernel reads and writes the registered (``cudaHostRegister``)
  arena itself, over the bus, through its device address (unified addressing): no staging, no
  DMA call. The default until an H200 run says otherwise (docs/gpu.md).
- :attr:`CopyPath.STAGED`: the kernel gathers into (scatters from) a device staging buffer, and
  one DMA per run of adjacent slots moves it: ``cudaMemcpy2DAsync`` per layer (a layer's chunks
  are ``block_bytes`` apart in the arena), one plain copy per run for a bulk step.

Without Triton, or for CPU caches without ``TRITON_INTERPRET=1``, :func:`resolve_copy_path`
falls back to the legacy path and says so in a log line. On CPU tensors with
``TRITON_INTERPRET=1`` the same kernels run in Triton's interpreter: CI checks them bit-exact
against the legacy path there (emulated; no figure from it is a GPU figure).
"""

from __future__ import annotations

import ctypes
import enum
import functools
import importlib.util
import logging
import os
from collections.abc import Sequence

import numpy as np
import torch

from kvstore.tiers.arena import slot_runs
from kvstore.tiers.hbm_device import libcudart

log = logging.getLogger("kvstore.gpu")

WORDS = {8: (torch.int64, ctypes.c_int64, "<i8"), 4: (torch.int32, ctypes.c_int32, "<i4"),
         2: (torch.int16, ctypes.c_int16, "<i2"), 1: (torch.uint8, ctypes.c_uint8, "|u1")}
CUDA_MEMCPY_DEFAULT = 4  # cudaMemcpyDefault: direction from unified addresses


class CopyPath(enum.Enum):
    """How KV moves between the paged cache and arena slots (config ``copy_path``)."""

    LEGACY = "legacy"
    ZEROCOPY = "zerocopy"
    STAGED = "staged"

    @classmethod
    def parse(cls, value) -> "CopyPath":
        if isinstance(value, cls):
            return value
        try:
            return cls(str(value).strip().lower())
        except ValueError:
            raise ValueError(f"copy_path: expected one of {', '.join(p.value for p in cls)}, got {value!r}") from None


DEFAULT_COPY_PATH = CopyPath.ZEROCOPY  # not yet measured on a GPU: tests/gpu/run.sh decides


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "") == "1"


def triton_missing(device: torch.device) -> str:
    """Why the kernels cannot run on tensors of ``device`` ("" when they can)."""
    if importlib.util.find_spec("triton") is None:
        return "Triton is not installed (CUDA builds of torch ship it)"
    if device.type == "cuda":
        return _cuda_launch_fails(device.index if device.index is not None else torch.cuda.current_device())
    if device.type == "cpu":
        return "" if interpreting() else "the tensors are on the CPU and TRITON_INTERPRET=1 is not set"
    return f"Triton does not run on {device.type} tensors"


@functools.cache
def _cuda_launch_fails(index: int) -> str:
    """Launch one tiny kernel on device ``index`` once per process: Triton builds its driver
    module with the host C compiler on first use (cached in ~/.triton), and a machine without
    one must get the legacy path at start-up, not a failed copy later."""
    try:
        scratch = torch.zeros(64, dtype=torch.uint8, device=f"cuda:{index}")
        copy_spans(scratch, [(32, 0, 32)])
        torch.cuda.synchronize(index)
    except Exception as e:  # noqa: BLE001 - any failure means: no kernels here
        return f"Triton could not launch a kernel on cuda:{index} ({type(e).__name__}: {e})"
    return ""


def resolve_copy_path(requested, device: torch.device) -> tuple[CopyPath, str]:
    """The path that will run for ``requested`` on ``device`` and, when it is not the one
    asked for, why (also logged: a GPU worker on the slow path must be visible)."""
    path = CopyPath.parse(requested)
    if path is CopyPath.LEGACY:
        return path, "copy_path = legacy (configured)"
    why = triton_missing(device)
    if not why:
        return path, ""
    reason = f"copy_path {path.value} needs Triton kernels: {why}; using the legacy per-block copies"
    (log.warning if device.type == "cuda" else log.info)("kvstore: %s", reason)
    return CopyPath.LEGACY, reason


def _align(values) -> int:
    """The widest word (8, 4, 2 or 1 bytes) every value is a multiple of."""
    w = 8
    for v in values:
        while int(v) % w:
            w //= 2
    return w


def word_at(addr: int, word: int, device: torch.device) -> torch.Tensor:
    """A one-word tensor at ``addr``: the base pointer every kernel offset counts from. It owns
    nothing; the memory it points into is kept alive by its owner."""
    dtype, ctype, typestr = WORDS[word]
    if device.type == "cuda":
        class _At:  # __cuda_array_interface__: how torch wraps a raw device address, no cupy needed
            __cuda_array_interface__ = {"shape": (1,), "typestr": typestr, "data": (addr, False), "strides": None,
                                        "version": 3}

        return torch.as_tensor(_At(), device=device)
    return torch.from_numpy(np.ctypeslib.as_array((ctype * 1).from_address(addr)))


def device_address(host_ptr: int) -> int:
    """The device address of registered host memory at ``host_ptr``."""
    lib = libcudart()
    if lib is not None and hasattr(lib, "cudaHostGetDevicePointer"):
        out = ctypes.c_void_p()
        if lib.cudaHostGetDevicePointer(ctypes.byref(out), ctypes.c_void_p(host_ptr), 0) == 0 and out.value:
            return int(out.value)
        lib.cudaGetLastError()
    return host_ptr  # unified addressing: a registered range has the same address on the device


def memcpy_2d(dst: int, dpitch: int, src: int, spitch: int, width: int, height: int) -> None:
    """``height`` rows of ``width`` bytes, ``spitch`` / ``dpitch`` apart, on the current CUDA
    stream: one DMA for a layer's chunks of a run of adjacent slots."""
    lib = libcudart()
    if lib is None:
        raise RuntimeError("copy_path staged: no CUDA runtime library found for cudaMemcpy2DAsync")
    stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
    err = lib.cudaMemcpy2DAsync(ctypes.c_void_p(dst), ctypes.c_size_t(dpitch), ctypes.c_void_p(src),
                                ctypes.c_size_t(spitch), ctypes.c_size_t(width), ctypes.c_size_t(height),
                                CUDA_MEMCPY_DEFAULT, stream)
    if err != 0:
        lib.cudaGetLastError()
        raise RuntimeError(f"cudaMemcpy2DAsync failed with cudaError {err}")


def _view_desc(v: torch.Tensor) -> tuple[int, ...]:
    """(address, block / head / token / element strides, element bytes) of a page view, bytes."""
    e = v.element_size()
    sb, sh, sn, sd = (int(s) * e for s in v.stride())
    return v.data_ptr(), sb, sh, sn, sd, e


class RowCopy:
    """One launch moves token rows between paged views and slot-ordered bytes.

    ``layers``: per layer, the views (``(K, V)`` or ``(latent,)``) as ``[kernel_blocks, heads,
    n, dim]`` with any strides. A slot holds per layer ``[halves, block_tokens, heads, dim]``
    bytes. Launches go to the current stream (CUDA) or run in Triton's interpreter (CPU)."""

    # Words per program (tokens x row words). On CUDA 4096 with 8 warps is 16 words and their
    # 64-bit addresses per thread: no register spills. The interpreter pays per program, not
    # per word, so it takes tiles as large as the request.
    TILE_WORDS, NUM_WARPS, INTERPRETED_TILE_WORDS = 4096, 8, 1 << 16

    def __init__(self, layers: Sequence[Sequence[torch.Tensor]], block_tokens: int, slot_row: int = 0,
                 slot_col: int = 0) -> None:
        first = layers[0][0]
        self.device = first.device
        self.halves, self.heads = len(layers[0]), int(first.shape[1])
        self.head_bytes = int(first.shape[3]) * first.element_size()
        self.row = self.heads * self.head_bytes
        # A slot's token row: these heads' bytes, or (a TP rank's heads in a block of every head)
        # ``slot_row`` bytes of which these are the ``row`` from byte ``slot_col`` on.
        self.slot_row, self.slot_col = slot_row or self.row, slot_col
        self.bt = block_tokens
        self.chunk = self.halves * block_tokens * self.slot_row
        self.table = np.array([[_view_desc(v) for v in halves] for halves in layers], dtype=np.int64)
        contiguous = self.table[..., 4] == self.table[..., 5]
        # A word may span elements only along a contiguous dim; else it is at most one element.
        self.word = _align([*self.table[..., :4].ravel(), self.head_bytes, self.slot_row, self.slot_col,
                            *self.table[..., 4:][~contiguous].ravel()])
        self.anchor = int(self.table[..., 0].min()) // 8 * 8  # base address: every offset counts from it
        self._desc: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._tok_cache: dict[tuple, torch.Tensor] = {}
        from kvstore.tiers import kv_kernels

        self.kernel = kv_kernels.build(self.device.type != "cuda")[0]

    def _base(self, word: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(base word tensor, desc [layers, halves, 6] in words) for this word size, made once."""
        if word not in self._desc:
            t = self.table
            contiguous = t[..., 4] == t[..., 5]
            d = np.empty(t.shape, np.int64)
            d[..., 0] = (t[..., 0] - self.anchor) // word
            d[..., 1:4] = t[..., 1:4] // word
            d[..., 4] = np.where(contiguous, 1, t[..., 4] // word)
            d[..., 5] = np.where(contiguous, 1, np.maximum(t[..., 5] // word, 1))
            self._desc[word] = (word_at(self.anchor, word, self.device), _to_device(d, self.device))
        return self._desc[word]

    def launch(self, rows: torch.Tensor, block_addrs: Sequence[int], layers: range, layer_stride: int,
               to_slots: bool, slot_layer0: int | None = None) -> None:
        """Copy page layers ``layers`` of the tokens at ``rows`` ([T, 2] on the device, block
        after block) to (``to_slots``) or from the slot-ordered bytes of block ``j`` at address
        ``block_addrs[j]``, slot layer ``s`` at ``+ s * layer_stride`` bytes; slot layers start
        at ``slot_layer0`` (default: the first page layer)."""
        T = int(rows.shape[0])
        if T == 0 or not len(layers):
            return
        w = min(self.word, _align([a - self.anchor for a in block_addrs] + [layer_stride]))
        base, desc = self._base(w)
        dw = self.head_bytes // w
        bd = triton_next_pow2(self.halves * self.heads * dw)
        tile = self.TILE_WORDS if self.device.type == "cuda" else self.INTERPRETED_TILE_WORDS
        bt_tile = max(1, min(triton_next_pow2(T), tile // bd))
        grid = (-(-T // bt_tile), len(layers))
        s0 = layers.start if slot_layer0 is None else slot_layer0
        self.kernel[grid](base, rows.contiguous(), self._tokens(block_addrs, w, T), desc, T, self.halves,
                          self.heads * dw, dw, self.bt * self.slot_row // w, layer_stride // w, layers.start, s0,
                          TO_SLOTS=to_slots, BT=bt_tile, BD=bd, num_warps=self.NUM_WARPS)

    def _tokens(self, block_addrs: Sequence[int], w: int, T: int) -> torch.Tensor:
        """Word offset of each token's row in its block (device int64 [T]). A layer-wise op
        asks for the same table once per layer: the last few are kept (keyed by value)."""
        key = (tuple(block_addrs), w, T)
        tok = self._tok_cache.get(key)
        if tok is None:
            blk = (np.asarray(block_addrs, np.int64) - self.anchor + self.slot_col) // w
            rows = np.arange(self.bt, dtype=np.int64) * (self.slot_row // w)
            tok = _to_device((blk[:, None] + rows[None, :]).reshape(-1)[:T], self.device)
            if len(self._tok_cache) >= 8:
                self._tok_cache.pop(next(iter(self._tok_cache)))
            self._tok_cache[key] = tok
        return tok


def _row_bytes(v: torch.Tensor) -> int:
    """Bytes of one token's row of a ``[blocks, heads, n, dim]`` page view (plain or tiled)."""
    return int(v.shape[1]) * int(np.prod(v.shape[3:] if v.dim() == 4 else v.shape[4:])) * v.element_size()


def triton_next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _to_device(a: np.ndarray, device: torch.device) -> torch.Tensor:
    t = torch.from_numpy(np.ascontiguousarray(a))
    if device.type != "cuda":
        return t
    return t.pin_memory().to(device, non_blocking=True)


class BatchedKV:
    """The batched gather/scatter of :class:`~kvstore.clients.hbm_paged.KVMover` for the
    zero-copy and staged paths: ``store_layer`` / ``load_layer`` are one launch (plus, staged,
    one DMA per run of adjacent slots), ``store_all`` / ``load_all`` one launch per staging
    step (zero-copy: one launch in all). Offsets are arena byte offsets (None: skip)."""

    def __init__(self, pages, layout, host: torch.Tensor, path: CopyPath, staging_bytes: int,
                 slot_col: int = 0) -> None:
        """``slot_col``: the pages hold some of ``layout``'s KV heads (a TP rank's), from byte
        ``slot_col`` of each token row of a slot on (zero-copy only: the staged path moves whole
        chunks, which would overwrite the other ranks' heads)."""
        self.path, self.layout, self.host = path, layout, host
        halves = len(pages[0].halves)
        if slot_col or layout.bytes_per_token_layer // halves != _row_bytes(pages[0].halves[0]):
            if path is not CopyPath.ZEROCOPY:
                raise ValueError("copy_path staged moves whole chunks: a TP rank's heads of a block take zerocopy "
                                 "or legacy")
        self.rows = RowCopy([p.halves for p in pages], layout.block_tokens,
                            slot_row=layout.bytes_per_token_layer // halves, slot_col=slot_col)
        self.device = self.rows.device
        host_ptr = host.data_ptr()
        # The kernel reaches the arena through its device address (UVA); the staged path's DMA
        # and the interpreter through the host one.
        self.arena = device_address(host_ptr) if self.device.type == "cuda" and path is CopyPath.ZEROCOPY else host_ptr
        self.staging_bytes = staging_bytes

    def _present(self, rows: torch.Tensor, offsets, bt: int):
        """The rows and offsets of the blocks to copy (a store skips blocks cached already).
        A kernel writes wherever an offset points, unlike a slice: each must lie in the arena."""
        keep = [j for j, o in enumerate(offsets) if o is not None]
        if keep:
            lo, hi = min(offsets[j] for j in keep), max(offsets[j] for j in keep)
            if lo < 0 or hi + self.layout.block_bytes > self.host.numel():
                raise ValueError(f"slot offsets [{lo}, {hi}] + {self.layout.block_bytes}-byte blocks fall outside "
                                 f"the {self.host.numel()}-byte arena")
        if len(keep) == len(offsets):
            return rows, list(offsets)
        idx = torch.tensor(keep, dtype=torch.int64).to(rows.device)
        return rows.view(len(offsets), bt, 2).index_select(0, idx).reshape(-1, 2), [offsets[j] for j in keep]

    def _layer(self, l: int, rows, offsets, to_slots: bool, page_layer: int | None) -> None:
        bt, C, B = self.layout.block_tokens, self.layout.layer_chunk_bytes, self.layout.block_bytes
        rows, offsets = self._present(rows, offsets, bt)
        if not offsets:
            return
        pages = range(l, l + 1) if page_layer is None else range(page_layer, page_layer + 1)
        if self.path is CopyPath.ZEROCOPY:
            self.rows.launch(rows, [self.arena + o for o in offsets], pages, C, to_slots, slot_layer0=l)
            return
        staged = torch.empty(len(offsets) * C, dtype=torch.uint8, device=self.device)
        s = staged.data_ptr()
        if not to_slots:
            for a, b, off in slot_runs(offsets, B):
                self._chunks(s + a * C, self.arena + off + l * C, C, B, b - a, to_host=False)
        self.rows.launch(rows, [s + j * C for j in range(len(offsets))], pages, 0, to_slots)
        if to_slots:
            for a, b, off in slot_runs(offsets, B):
                self._chunks(s + a * C, self.arena + off + l * C, C, B, b - a, to_host=True)

    def _chunks(self, dev: int, host: int, width: int, pitch: int, n: int, to_host: bool) -> None:
        """``n`` chunks of ``width`` bytes: contiguous on the device, ``pitch`` apart in the arena."""
        if self.device.type == "cuda":
            if to_host:
                memcpy_2d(host, pitch, dev, width, width, n)
            else:
                memcpy_2d(dev, width, host, pitch, width, n)
            return
        h = self.host.as_strided((n, width), (pitch, 1), host - self.host.data_ptr())
        d = torch.from_numpy(np.ctypeslib.as_array((ctypes.c_uint8 * (n * width)).from_address(dev))).view(n, width)
        (h.copy_(d) if to_host else d.copy_(h))

    def store_layer(self, l: int, rows, offsets, page_layer: int | None = None) -> None:
        """Layer ``l`` of the blocks into their slots, read from the pages of ``page_layer``
        (default ``l``; an adapter whose tensors come one layer at a time passes 0)."""
        self._layer(l, rows, offsets, True, page_layer)

    def load_layer(self, l: int, rows, offsets, page_layer: int | None = None) -> None:
        self._layer(l, rows, offsets, False, page_layer)

    def _all(self, rows, offsets, to_slots: bool) -> None:
        L, bt, B = self.layout.num_layers, self.layout.block_tokens, self.layout.block_bytes
        rows, offsets = self._present(rows, offsets, bt)
        if not offsets:
            return
        C = self.layout.layer_chunk_bytes
        if self.path is CopyPath.ZEROCOPY:
            self.rows.launch(rows, [self.arena + o for o in offsets], range(L), C, to_slots)
            return
        per = max(1, self.staging_bytes // B)
        for j0 in range(0, len(offsets), per):
            part = offsets[j0:j0 + per]
            staged = torch.empty((len(part), B), dtype=torch.uint8, device=self.device)
            s = staged.data_ptr()
            if not to_slots:
                for a, b, off in slot_runs(part, B):
                    staged[a:b].view(-1).copy_(self.host[off:off + (b - a) * B], non_blocking=True)
            self.rows.launch(rows[j0 * bt:(j0 + len(part)) * bt], [s + j * B for j in range(len(part))],
                             range(L), C, to_slots)
            if to_slots:
                for a, b, off in slot_runs(part, B):
                    self.host[off:off + (b - a) * B].copy_(staged[a:b].view(-1), non_blocking=True)

    def store_all(self, rows, offsets) -> None:
        self._all(rows, offsets, True)

    def load_all(self, rows, offsets) -> None:
        self._all(rows, offsets, False)


def copy_spans(base: torch.Tensor, spans: Sequence[tuple[int, int, int]]) -> None:
    """Copy each ``(dst, src, nbytes)`` byte span inside ``base`` (a uint8 tensor: the HBM pool)
    with one launch on the current stream. Spans must not overlap each other's destinations."""
    spans = [s for s in spans if s[2] > 0]
    if not spans:
        return
    from kvstore.tiers import kv_kernels

    w = _align([base.data_ptr()] + [v for s in spans for v in s])
    t = np.array(spans, dtype=np.int64) // w
    chunk = 1 << 16  # words per program: big programs, few of them
    grid = (len(spans), -(-int(t[:, 2].max()) // chunk))
    kernel = kv_kernels.build(base.device.type != "cuda")[1]
    kernel[grid](word_at(base.data_ptr(), w, base.device), _to_device(t, base.device), CHUNK=chunk, BLOCK=4096,
                 num_warps=8)
