"""Copies between a worker's paged KV cache and kvstore block slots, on a side stream.

The worker's cache is vLLM-style, one tensor per layer, ``[2, num_blocks, block_size,
kv_heads, head_dim]`` (MLA: ``[num_blocks, block_size, latent]``); a block table maps the
request's block ``i`` (``block_size`` tokens) to a physical block id. kvstore keeps a block of
``block_tokens`` tokens layer-major in a slot, ``[layers, 2, block_tokens, row]`` with ``row =
kv_heads * head_dim * elem`` bytes (``KVStoreClient._block_shape``); the two block sizes need
not match. Gather and scatter are index kernels on the cache's device; slot copies are one DMA
per (block, layer) for layer-wise ops and one per run of adjacent slots for bulk ops.

CUDA caches run on a :class:`~kvstore.tiers.hbm_device.CudaStream` with the host arena
page-locked in place; CPU caches run the same code on an emulated stream (a copy thread).
:mod:`kvstore.clients.gpu` wraps this with the daemon's leases.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np
import torch

from kvstore.layout import AttnKind, KVLayout
from kvstore.tiers.arena import slot_runs
from kvstore.tiers.hbm_device import (CudaEvent, DeviceChoice, DeviceKind, EmuEvent, EmuStream, HostPin,
                                      choose_device, make_stream)

BULK_STAGING_BYTES = 64 << 20  # device staging per bulk store/load step (bytes)


class PagedKV:
    """A worker's paged per-layer KV cache, seen as bytes: layer ``l`` is ``rows[l]`` of shape
    ``[halves, num_blocks * block_size, row]`` (``halves`` 2 for K/V, 1 for MLA)."""

    def __init__(self, layers: Sequence[torch.Tensor], layout: KVLayout) -> None:
        if len(layers) != layout.num_layers:
            raise ValueError(f"kv_caches: {len(layers)} layer tensors for a {layout.num_layers}-layer layout")
        mla = layout.kind is AttnKind.MLA
        self.halves = 1 if mla else 2
        self.row = layout.bytes_per_token_layer // self.halves
        self.device = layers[0].device
        first = layers[0]
        if mla:
            self.num_blocks, self.block_size = int(first.shape[0]), int(first.shape[1])
        else:
            if first.dim() < 3 or first.shape[0] != 2:
                raise ValueError(f"kv_caches[0]: expected [2, num_blocks, block_size, kv_heads, head_dim], "
                                 f"got {tuple(first.shape)}")
            self.num_blocks, self.block_size = int(first.shape[1]), int(first.shape[2])
        want = self.halves * self.num_blocks * self.block_size * self.row
        self.rows = []
        for l, t in enumerate(layers):
            if t.device != self.device:
                raise ValueError(f"kv_caches[{l}]: on {t.device}, layer 0 is on {self.device}")
            if not t.is_contiguous():
                raise ValueError(f"kv_caches[{l}]: must be contiguous")
            lead = tuple(t.shape[:2]) if mla else tuple(t.shape[:3])
            exp = (self.num_blocks, self.block_size) if mla else (2, self.num_blocks, self.block_size)
            nbytes = t.numel() * t.element_size()
            if lead != exp or nbytes != want:
                raise ValueError(f"kv_caches[{l}]: shape {tuple(t.shape)} of {t.dtype} is {nbytes} bytes; the layout "
                                 f"needs {exp} + per-token rows of {self.row} bytes ({want} bytes); check dtype and heads")
            self.rows.append(t.view(torch.uint8).view(self.halves, self.num_blocks * self.block_size, self.row))

    def token_rows(self, block_table, n_tokens: int) -> torch.Tensor:
        """Row index (CPU int64) of each of the request's first ``n_tokens`` tokens."""
        table = torch.as_tensor(block_table).reshape(-1).to("cpu", torch.int64)
        need = -(-n_tokens // self.block_size)
        if table.numel() < need:
            raise ValueError(f"block_table: {table.numel()} blocks of {self.block_size} tokens cover fewer than "
                             f"{n_tokens} tokens")
        table = table[:need]
        if need and (int(table.min()) < 0 or int(table.max()) >= self.num_blocks):
            raise ValueError(f"block_table: ids must be in [0, {self.num_blocks}), got "
                             f"[{int(table.min())}, {int(table.max())}]")
        t = torch.arange(n_tokens, dtype=torch.int64)
        return table[t // self.block_size] * self.block_size + t % self.block_size


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
    No daemon: offsets are arena byte offsets of the blocks (None = skip that block)."""

    def __init__(self, paged: PagedKV, layout: KVLayout, host: np.ndarray) -> None:
        self.paged, self.layout = paged, layout
        self.choice = _choice_for(paged.device)
        self.stream = make_stream(self.choice, "kvstore-gpu-side")
        self.pin = HostPin(self.choice, host.ctypes.data, host.nbytes)
        self.host = torch.from_numpy(host)
        self.chunk = layout.layer_chunk_bytes

    @property
    def emulated(self) -> bool:
        return self.choice.emulated

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
        g = p.rows[l].index_select(1, rows)  # [halves, n * bt, row]
        return g.view(p.halves, n, self.layout.block_tokens, p.row).transpose(0, 1)  # [n, halves, bt, row]

    def _scatter(self, l: int, rows: torch.Tensor, staged: torch.Tensor) -> None:
        p = self.paged
        p.rows[l].index_copy_(1, rows, staged.transpose(0, 1).reshape(p.halves, -1, p.row))

    def store_layer(self, l: int, rows: torch.Tensor, offsets: Sequence[int | None]):
        """Gather layer ``l`` of the blocks into their slots; returns the op's event."""
        C = self.chunk

        def run() -> None:
            staged = self._gather(l, rows, len(offsets)).contiguous()
            for j, off in enumerate(offsets):
                if off is not None:
                    self.host[off + l * C: off + (l + 1) * C].copy_(staged[j].view(-1), non_blocking=True)

        self.stream.submit(run)
        return self.stream.record()

    def load_layer(self, l: int, rows: torch.Tensor, offsets: Sequence[int]):
        """Scatter layer ``l`` of the blocks from their slots; returns the op's event."""
        p, C = self.paged, self.chunk

        def run() -> None:
            staged = torch.empty((len(offsets), p.halves, self.layout.block_tokens, p.row),
                                 dtype=torch.uint8, device=p.device)
            for j, off in enumerate(offsets):
                staged[j].view(-1).copy_(self.host[off + l * C: off + (l + 1) * C], non_blocking=True)
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

        def run() -> None:
            for j0, j1 in self._steps(len(offsets)):
                staged = torch.empty((j1 - j0, L, p.halves, bt, p.row), dtype=torch.uint8, device=p.device)
                for l in range(L):
                    staged[:, l] = self._gather(l, rows[j0 * bt:j1 * bt], j1 - j0)
                for a, b, off in slot_runs(offsets[j0:j1], B):
                    self.host[off:off + (b - a) * B].copy_(staged[a:b].view(-1), non_blocking=True)

        self.stream.submit(run)
        return self.stream.record()

    def load_all(self, rows: torch.Tensor, offsets: Sequence[int]) -> list:
        """All layers, one DMA per run of adjacent slots; returns one event per layer (all
        fire together: the blocks arrive whole before any layer is scattered)."""
        L, bt, B = self.layout.num_layers, self.layout.block_tokens, self.layout.block_bytes
        p = self.paged

        def run() -> None:
            for j0, j1 in self._steps(len(offsets)):
                staged = torch.empty((j1 - j0, L, p.halves, bt, p.row), dtype=torch.uint8, device=p.device)
                for a, b, off in slot_runs(offsets[j0:j1], B):
                    staged[a:b].view(-1).copy_(self.host[off:off + (b - a) * B], non_blocking=True)
                for l in range(L):
                    self._scatter(l, rows[j0 * bt:j1 * bt], staged[:, l])

        self.stream.submit(run)
        ev = self.stream.record()
        return [ev] * L

    def close(self) -> None:
        self.stream.synchronize()
        self.stream.close()
        self.pin.close()
