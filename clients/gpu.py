"""Client GPU path: move KV between a worker's paged cache and kvstore on a side stream.

The worker's cache is vLLM-style, one tensor per layer, ``[2, num_blocks, block_size,
kv_heads, head_dim]`` (MLA: ``[num_blocks, block_size, latent]``), plus a block table that maps
the request's block ``i`` (``block_size`` tokens) to a physical block id. kvstore stores a block
of ``block_tokens`` tokens layer-major in an arena slot, ``[layers, 2, block_tokens, row]``
with ``row = kv_heads * head_dim * elem`` bytes (``kvstore.clients.blocks_io.block_shape``);
the two block sizes need not match. Gather (store) and scatter (load) run on a side stream with the shared
arena page-locked (``cudaHostRegister``) in this process, so arena <-> GPU copies are DMA:

    path = GpuKVPath(client, kv_caches)
    with path.load(prompt_ids, block_table) as h:    # issues layer 0, 1, ... in order
        for l in range(num_layers):
            h.wait_layer(l)                           # compute stream waits for layer l only
            run_layer(l)                              # starts as soon as layer l is resident
    h = path.store(prompt_ids, block_table)           # after the KV was written
    ...                                               # the worker goes on
    h.commit()                                        # blocks until the DMA is done, then commits

The copies are one batched Triton launch per layer (or per bulk op) by default
(``copy_path="zerocopy"``: the kernel reads and writes the registered arena over the bus;
``"staged"``: through a device buffer and one DMA per slot run; ``"legacy"``: the per-block
copies from before, for A/B); see :mod:`kvstore.tiers.kv_copy`.

Layer-wise store for disaggregated prefill: ``h = path.begin_store(...)``, then
``h.store_layer(l)`` after each layer, then ``h.commit()``. The copies themselves are
:class:`kvstore.clients.hbm_paged.KVMover`; this module adds the daemon's leases. A worker maps
the daemon's HBM pool with :func:`open_pool` (CUDA IPC).

With CPU tensors (no GPU) the same calls run on an emulated device: the side stream is a copy
thread, events are ``threading.Event`` s (:mod:`kvstore.tiers.hbm_device`), and
``path.emulated`` is True with ``path.reason`` saying why.

Not thread-safe: one path per worker thread, like the client it wraps.
"""

from __future__ import annotations

from collections.abc import Sequence

import grpc
import torch

from kvstore.tiers.hbm import PoolMapping, open_pool
from kvstore.tiers.hbm_device import CudaEvent, EmuStream
from kvstore.clients.hbm_paged import KVMover, PagedKV, wait_events
from kvstore.tiers.kv_copy import DEFAULT_COPY_PATH, CopyPath
from kvstore.clients.leases import RESERVED, CommitOnExit, KVStoreError  # RESERVED: WriteLease state of a slot to fill

__all__ = ["GpuKVPath", "KVMover", "LoadHandle", "PagedKV", "PoolMapping", "StoreHandle", "open_pool", "wait_events"]


class StoreHandle(CommitOnExit):
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

    def release(self, wait: bool = False) -> None:
        """Wait for the issued copies, then end the read leases (``wait``: wait for the
        daemon's answer too, see :meth:`ReadLease.release`)."""
        try:
            wait_events(self._events)
        finally:
            for lease in self.leases:
                lease.release(wait=wait)
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
    call :meth:`close` before closing the client. ``copy_path``: the batched kernels
    (``zerocopy``, ``staged``) or the per-block ``legacy`` copies (:mod:`kvstore.tiers.kv_copy`).
    ``inline``: CPU caches whose copies the caller waits for at once run them in its thread
    (:class:`~kvstore.tiers.hbm_device.InlineStream`), not on a copy thread."""

    def __init__(self, client, kv_caches: Sequence[torch.Tensor], copy_path: CopyPath | str = DEFAULT_COPY_PATH,
                 inline: bool = False) -> None:
        client.require_data_session()
        self.client, self.layout = client, client.layout
        shard = client.shard  # a TP rank's heads of blocks that hold all of them, or None
        self.paged = PagedKV(kv_caches, shard.local(self.layout) if shard is not None else self.layout)
        self.arena = client.arena
        self.mover = KVMover(self.paged, self.layout, client.arena.buf, copy_path, inline=inline, shard=shard)

    @property
    def copy_path(self) -> CopyPath:
        """The copy path that runs (``legacy`` where the kernels cannot: see ``mover.copy_reason``)."""
        return self.mover.copy_path

    def check_arena(self, leases=()) -> None:
        """Raise (ending ``leases``) when the client re-registered with a restarted daemon since
        this path was made, or when a lease's offsets name another arena than the path's (it
        was answered before a re-registration on another thread): slot offsets would point into
        another arena than the one it copies to and from. Make a new path."""
        if self.client.arena is self.arena and all(getattr(l, "arena", self.arena) is self.arena for l in leases):
            return
        for lease in leases:
            try:
                (lease.abort if hasattr(lease, "abort") else lease.release)()
            except Exception:  # noqa: BLE001 - that daemon is gone or the TTL reclaims it
                pass
        raise KVStoreError(grpc.StatusCode.UNAVAILABLE, "the daemon restarted since this GpuKVPath was made; "
                           "its slots live in a new arena: make a new path")

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
        leases = self.client.reserve_all(keys, token_ids=token_ids)
        offsets = [o if s == RESERVED else None for w in leases for s, o in zip(w.states, w.offsets)]
        self.check_arena(leases)
        return StoreHandle(self, leases, offsets, self.mover.device_rows(rows))

    def store(self, token_ids, block_table, after=None) -> StoreHandle:
        """Store every layer now (bulk DMA); ``commit()`` the handle once the worker can wait."""
        h = self.begin_store(token_ids, block_table)
        h.store_all(after)
        return h

    def begin_load(self, token_ids, block_table, after=None) -> LoadHandle:
        """Pin the longest cached prefix of ``token_ids`` that ``block_table`` has room for;
        copy with ``load_layer`` / ``load_all`` (or enter the handle: issues every layer).
        The copies start after ``after`` (default: the current stream's work so far, which
        may still read the blocks the table hands out)."""
        bs, bt = self.paged.block_size, self.layout.block_tokens
        room = torch.as_tensor(block_table).numel() * bs // bt
        keys = self.client.keys(token_ids)[:room]
        leases, offsets = [], []
        step = self.client.max_batch_blocks()
        try:
            for start in range(0, len(keys), step):
                chunk = keys[start:start + step]
                r = self.client.acquire(chunk, allow_partial=True)
                leases.append(r)
                offsets += list(r.offsets[:r.count])
                if r.count < len(chunk):
                    break
            self.check_arena()
            rows = self.paged.token_rows(block_table, len(offsets) * bt)
            self.mover.after(after)
            return LoadHandle(self, leases, offsets, self.mover.device_rows(rows))
        except BaseException:
            for r in leases:
                try:
                    r.release(wait=True)  # refused request: leave nothing pinned behind
                except Exception:  # noqa: BLE001 - the lease TTL reclaims it; report the first error
                    pass
            raise

    def load(self, token_ids, block_table, layerwise: bool = True, after=None) -> LoadHandle:
        """Pin the cached prefix and issue its copies: layer by layer (so layer 0 is resident
        first) or in bulk (fewer, larger DMAs; every layer resident at once)."""
        h = self.begin_load(token_ids, block_table, after)
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
