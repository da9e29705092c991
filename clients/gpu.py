"""Client GPU path: move KV between a worker's paged cache and kvstore on a side stream.

The worker's cache is vLLM-style, one tensor per layer, ``[2, num_blocks, block_size,
kv_heads, head_dim]`` (MLA: ``[num_blocks, block_size, latent]``), plus a block table that maps
the request's block ``i`` (``block_size`` tokens) to a physical block id. kvstore stores a block
of ``block_tokens`` tokens layer-major in an arena slot, ``[layers, 2, block_tokens, row]``
with ``row = kv_heads * head_dim * elem`` bytes (``KVStoreClient._block_shape``); the two block
sizes need not match. Gather (store) and scatter (load) run on a side stream with the shared
arena page-locked (``cudaHostRegister``) in this process, so arena <-> GPU copies are DMA:

    path = GpuKVPath(client, kv_caches)
    with path.load(prompt_ids, block_table) as h:    # issues layer 0, 1, ... in order
        for l in range(num_layers):
            h.wait_layer(l)                           # compute stream waits for layer l only
            run_layer(l)                              # starts as soon as layer l is resident
    h = path.store(prompt_ids, block_table)           # after the KV was written
    ...                                               # the worker goes on
    h.commit()                                        # blocks until the DMA is done, then commits

Layer-wise store for disaggregated prefill: ``h = path.begin_store(...)``, then
``h.store_layer(l)`` after each layer, then ``h.commit()``.

With CPU tensors (no GPU) the same calls run on an emulated device: the side stream is a copy
thread, events are ``threading.Event`` s (:mod:`kvstore.tiers.hbm_device`), and
``path.emulated`` is True with ``path.reason`` saying why.

Not thread-safe: one path per worker thread, like the client it wraps.
"""

from __future__ import annotations

import os
import time
from typing import Sequence

import numpy as np
import torch

from kvstore.layout import AttnKind, KVLayout
from kvstore.tiers.arena import Arena
from kvstore.tiers.hbm_device import (CudaEvent, DeviceChoice, DeviceKind, EmuEvent, EmuStream, HostPin,
                                      choose_device, make_stream)

RESERVED = 0  # WriteLease state of a slot this request must fill
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


def _runs(offsets: Sequence[int | None], block_bytes: int):
    """``(first, end, offset)`` for each run of blocks whose slots are adjacent in the arena."""
    j, n = 0, len(offsets)
    while j < n:
        if offsets[j] is None:
            j += 1
            continue
        k = j + 1
        while k < n and offsets[k] is not None and offsets[k] == offsets[k - 1] + block_bytes:
            k += 1
        yield j, k, offsets[j]
        j = k


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
        if not self.paged.device.type == "cuda":
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
                for a, b, off in _runs(offsets[j0:j1], B):
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
                for a, b, off in _runs(offsets[j0:j1], B):
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


class StoreHandle:
    """Reserved slots being filled from the paged cache. ``commit`` waits for the copies and
    then makes the blocks visible; a failed copy aborts the leases (nothing half-written is
    ever served). As a context manager it commits on success and aborts on an exception."""

    def __init__(self, path: "GpuKVPath", leases, offsets, rows) -> None:
        self.path, self.leases, self.offsets, self._rows = path, leases, offsets, rows
        self.blocks = sum(o is not None for o in offsets)
        self._layers_done: set[int] = set()
        self.events: list = []
        self.done = False

    def store_layer(self, l: int, after=None):
        """Copy layer ``l`` once the work ``after`` stands for is done (default: the current
        stream's work so far); returns the event the worker may wait on before reusing it."""
        if not 0 <= l < self.path.layout.num_layers:
            raise IndexError(f"layer {l} outside [0, {self.path.layout.num_layers})")
        if l in self._layers_done:
            raise ValueError(f"layer {l} already stored")
        self._layers_done.add(l)
        m = self.path.mover
        m.after(after)
        ev = m.store_layer(l, self._rows, self.offsets) if self.blocks else m.stream.record()
        self.events.append(ev)
        return ev

    def store_all(self, after=None):
        """Copy every layer (bulk DMA); returns the event of the copy."""
        if self._layers_done:
            for l in range(self.path.layout.num_layers):
                if l not in self._layers_done:
                    self.store_layer(l, after)
            return self.events[-1]
        self._layers_done = set(range(self.path.layout.num_layers))
        m = self.path.mover
        m.after(after)
        ev = m.store_all(self._rows, self.offsets) if self.blocks else m.stream.record()
        self.events.append(ev)
        return ev

    def wait(self, timeout_s: float | None = None) -> bool:
        return wait_events(self.events, timeout_s)

    def commit(self, timeout_s: float | None = None) -> int:
        """Wait for the copies (at most ``timeout_s``), then commit; returns blocks committed."""
        if self.done:
            return 0
        if len(self._layers_done) != self.path.layout.num_layers:
            self.abort()
            raise RuntimeError(f"commit: only {len(self._layers_done)} of {self.path.layout.num_layers} "
                               "layers were stored; the reservation was aborted")
        try:
            if not self.wait(timeout_s):
                raise TimeoutError(f"store copies not done after {timeout_s} s")
        except BaseException:
            self.abort()
            raise
        self.done = True
        return sum(lease.commit() for lease in self.leases)

    def abort(self) -> None:
        if self.done:
            return
        self.done = True
        try:
            wait_events(self.events)  # the slots go back to the daemon: no DMA may still write them
        except BaseException:  # noqa: BLE001 - aborting anyway
            pass
        for lease in self.leases:
            lease.abort()

    def __enter__(self) -> "StoreHandle":
        return self

    def __exit__(self, exc_type, *_):
        if exc_type is None:
            self.commit()
        else:
            self.abort()


class LoadHandle:
    """Pinned blocks being scattered into the paged cache. ``tokens`` leading tokens hit.
    Layers are issued in order; ``wait_layer(l)`` orders the caller's stream after layer ``l``
    only. ``release`` (or leaving the ``with`` block) waits for the copies, then unpins."""

    def __init__(self, path: "GpuKVPath", leases, offsets, rows) -> None:
        self.path, self.leases, self.offsets, self._rows = path, leases, offsets, rows
        self.blocks = len(offsets)
        self.tokens = self.blocks * path.layout.block_tokens
        self._events: list = []  # event of layer l at index l

    def load_layer(self, l: int):
        """Issue layers up to ``l`` (in order) and return layer ``l``'s event."""
        L = self.path.layout.num_layers
        if not 0 <= l < L:
            raise IndexError(f"layer {l} outside [0, {L})")
        m = self.path.mover
        while len(self._events) <= l:
            k = len(self._events)
            self._events.append(m.load_layer(k, self._rows, self.offsets) if self.blocks else m.stream.record())
        return self._events[l]

    def load_all(self) -> list:
        """Issue every layer not issued yet (bulk DMA when none was); returns their events."""
        L = self.path.layout.num_layers
        if not self._events and self.blocks:
            self._events = self.path.mover.load_all(self._rows, self.offsets)
        return [self.load_layer(l) for l in range(L)] if L else []

    def layer_ready(self, l: int) -> bool:
        return l < len(self._events) and self._events[l].query()

    def wait_layer(self, l: int, stream=None, timeout_s: float | None = None) -> None:
        """Order ``stream`` (default: the current CUDA stream) after layer ``l``'s copies;
        emulated (or ``stream=False``): block this thread until they ran, at most ``timeout_s``."""
        ev = self.load_layer(l)
        if isinstance(ev, CudaEvent) and stream is not False:
            (stream or torch.cuda.current_stream(self.path.mover.paged.device)).wait_event(ev.raw)
        elif isinstance(stream, EmuStream):
            stream.wait_event(ev)
        elif not wait_events([ev], timeout_s):
            raise TimeoutError(f"layer {l} not resident after {timeout_s} s")

    def wait(self, timeout_s: float | None = None) -> bool:
        return wait_events(self._events, timeout_s)

    def release(self) -> None:
        """Wait for the issued copies, then end the read leases."""
        try:
            wait_events(self._events)
        finally:
            for lease in self.leases:
                lease.release()
            self.leases = []

    def __enter__(self) -> "LoadHandle":
        if not self._events:
            for l in range(self.path.layout.num_layers):
                self.load_layer(l)
        return self

    def __exit__(self, *_):
        self.release()


class GpuKVPath:
    """Store from and load into a worker's paged KV cache through a registered client.

    ``kv_caches``: one tensor per layer (see module docstring), all on one CUDA device or
    all on the CPU (emulated). The client's arena is page-locked for this path's lifetime;
    call :meth:`close` before closing the client."""

    def __init__(self, client, kv_caches: Sequence[torch.Tensor]) -> None:
        client._need_session()
        self.client, self.layout = client, client.layout
        self.paged = PagedKV(kv_caches, self.layout)
        self.mover = KVMover(self.paged, self.layout, client.arena.buf)

    @property
    def emulated(self) -> bool:
        return self.mover.emulated

    @property
    def reason(self) -> str:
        return self.mover.choice.reason

    def _plan(self, token_ids, block_table):
        keys = self.client.keys(token_ids)
        rows = self.paged.token_rows(block_table, len(keys) * self.layout.block_tokens)
        return keys, rows

    def begin_store(self, token_ids, block_table) -> StoreHandle:
        """Reserve slots for the full blocks of ``token_ids``; blocks already cached or being
        written elsewhere are skipped. Copy with ``store_layer`` / ``store_all``."""
        keys, rows = self._plan(token_ids, block_table)
        leases, offsets = [], []
        step = self.client._batch()
        try:
            for start in range(0, len(keys), step):
                w = self.client.reserve(keys[start:start + step], parent=keys[start - 1] if start else b"")
                leases.append(w)
                offsets += [o if s == RESERVED else None for s, o in zip(w.states, w.offsets)]
        except BaseException:
            for w in leases:
                w.abort()
            raise
        return StoreHandle(self, leases, offsets, self.mover.device_rows(rows))

    def store(self, token_ids, block_table, after=None) -> StoreHandle:
        """Store every layer now (bulk DMA); ``commit()`` the handle once the worker can wait."""
        h = self.begin_store(token_ids, block_table)
        h.store_all(after)
        return h

    def begin_load(self, token_ids, block_table) -> LoadHandle:
        """Pin the longest cached prefix of ``token_ids`` that ``block_table`` has room for;
        copy with ``load_layer`` / ``load_all`` (or enter the handle: issues every layer)."""
        bs, bt = self.paged.block_size, self.layout.block_tokens
        room = torch.as_tensor(block_table).numel() * bs // bt
        keys = self.client.keys(token_ids)[:room]
        leases, offsets = [], []
        step = self.client._batch()
        try:
            for start in range(0, len(keys), step):
                chunk = keys[start:start + step]
                r = self.client.acquire(chunk, allow_partial=True)
                leases.append(r)
                offsets += list(r.offsets[:r.count])
                if r.count < len(chunk):
                    break
            rows = self.paged.token_rows(block_table, len(offsets) * bt)
            return LoadHandle(self, leases, offsets, self.mover.device_rows(rows))
        except BaseException:
            for r in leases:
                r.release()
            raise

    def load(self, token_ids, block_table, layerwise: bool = True) -> LoadHandle:
        """Pin the cached prefix and issue its copies: layer by layer (so layer 0 is resident
        first) or in bulk (fewer, larger DMAs; every layer resident at once)."""
        h = self.begin_load(token_ids, block_table)
        if layerwise:
            for l in range(self.layout.num_layers):
                h.load_layer(l)
        else:
            h.load_all()
        return h

    def close(self) -> None:
        self.mover.close()

    def __enter__(self) -> "GpuKVPath":
        return self

    def __exit__(self, *_):
        self.close()


class PoolMapping:
    """A worker's mapping of the daemon's HBM pool (``HbmTier.ipc_handle()``): ``mem`` is a
    uint8 tensor of ``capacity_bytes`` (CUDA, or CPU over the emulated pool's memfd)."""

    def __init__(self, handle: dict) -> None:
        self.kind = handle["kind"]
        self._arena = None
        if self.kind == "emulated":
            self._arena = Arena(handle["capacity_bytes"], fd=os.dup(handle["fd"]), prefault=False)
            self.mem = torch.from_numpy(self._arena.buf)
        elif self.kind == "cuda":
            from torch.multiprocessing.reductions import rebuild_cuda_tensor

            self.mem = rebuild_cuda_tensor(
                torch.Tensor, (handle["capacity_bytes"],), (1,), 0, torch.UntypedStorage, torch.uint8,
                handle["device"], handle["handle"], handle["storage_bytes"], handle["storage_offset"], False,
                handle["ref_counter_handle"], handle["ref_counter_offset"], handle["event_handle"],
                handle["event_sync_required"])
        else:
            raise ValueError(f"handle: unknown pool kind {self.kind!r}")

    def close(self) -> None:
        self.mem = None
        if self._arena is not None:
            self._arena.close()


def open_pool(handle: dict) -> PoolMapping:
    """Map the daemon's HBM pool in this process from :meth:`HbmTier.ipc_handle`'s answer."""
    return PoolMapping(handle)
