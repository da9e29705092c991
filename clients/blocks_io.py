"""Whole blocks between a caller's layer-major tensor and the daemon's arena, what
``KVStoreClient.put`` and ``get`` do: one copy, between the caller's tensor and the slots (the
arena mapped from the fd the daemon passed; the daemon never touches the bytes). Tensors are
layer-major ``[layers, 2, tokens, kv_heads, head_dim]`` (MLA: ``[layers, tokens, kv_lora_rank +
qk_rope_head_dim]``), numpy arrays or CPU torch tensors."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import grpc
import numpy as np

from kvstore.layout import AttnKind, KVLayout
from kvstore.tiers.arena import slot_runs
from kvstore.v1 import kvstore_pb2 as pb

from kvstore.clients.leases import RESERVED, KVStoreError, pack

if TYPE_CHECKING:
    from kvstore.clients.client import KVStoreClient

COMMIT_PIECE_BYTES = 32 << 20  # put() commits a reserved batch in pieces of about this size


def as_bytes_view(kv, layout: KVLayout, what: str) -> np.ndarray:
    """A zero-copy uint8 view of ``kv`` shaped ``[layers, 2, tokens, row]`` (MLA:
    ``[layers, tokens, row]``), ``row`` being the bytes of one token of one K or V."""
    if hasattr(kv, "numpy") and hasattr(kv, "is_cuda"):  # torch.Tensor without importing torch
        if kv.is_cuda:
            raise ValueError(f"{what}: CUDA tensors go through the GPU path (kvstore.clients.gpu)")
        if not kv.is_contiguous():
            raise ValueError(f"{what}: tensor must be contiguous (call .contiguous() first)")
        import torch

        arr = kv.detach().view(torch.uint8).numpy() if kv.element_size() > 0 else None
    else:
        arr = np.asarray(kv)
        if not arr.flags.c_contiguous:
            raise ValueError(f"{what}: array must be C-contiguous (np.ascontiguousarray)")
        arr = arr.view(np.uint8)
    lead = 2 if layout.kind is AttnKind.MLA else 3
    if arr.ndim < lead or arr.shape[0] != layout.num_layers:
        raise ValueError(f"{what}: expected shape {layout.tensor_shape(0)[:lead - 1]} + (tokens, ...) "
                         f"for this layout, got {tuple(getattr(kv, 'shape', arr.shape))}")
    if layout.kind is not AttnKind.MLA and arr.shape[1] != 2:
        raise ValueError(f"{what}: dimension 1 must be 2 (K and V), got {arr.shape[1]}")
    tokens = arr.shape[lead - 1]
    row = layout.bytes_per_token_layer // (1 if layout.kind is AttnKind.MLA else 2)
    if arr.nbytes != layout.num_layers * tokens * layout.bytes_per_token_layer:
        raise ValueError(f"{what}: {arr.nbytes} bytes for {tokens} tokens, but the layout needs "
                         f"{layout.bytes_per_token_layer} bytes per token per layer "
                         f"({layout.num_layers * tokens * layout.bytes_per_token_layer} bytes); check dtype and shape")
    shape = (layout.num_layers, tokens, row) if layout.kind is AttnKind.MLA else (layout.num_layers, 2, tokens, row)
    return arr.reshape(shape)


class Copier:
    """Copies of ``[n, *block_shape]`` views for one client (not thread-safe, as the client is
    not): runs of 4 MiB and more are split over two threads (numpy releases the GIL while
    copying: measured 12.9-14.6 against 9.8-10.6 GB/s here) unless ``threads`` is 1. The second
    thread starts with the first such run."""

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None

    def copy(self, dst: np.ndarray, src: np.ndarray, threads: int = 2) -> None:
        n = dst.shape[0]
        if threads < 2 or n < 2 or dst[0].nbytes * n < (4 << 20):
            np.copyto(dst, src)
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="kvstore-copy")
        h = n // 2
        f = self._pool.submit(np.copyto, dst[h:], src[h:])
        np.copyto(dst[:h], src[:h])
        f.result()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None


def put(client: "KVStoreClient", token_ids, kv, copier: Copier) -> int:
    """Store the full blocks of ``token_ids`` from ``kv``; returns blocks newly stored
    (blocks already cached or being written by another client are skipped)."""
    client.require_data_session()
    if client.shard is not None:
        raise ValueError("put: writes whole blocks; a client writing a TP rank's heads (shard) stores through "
                         "kvstore.clients.gpu.GpuKVPath")
    src = as_bytes_view(kv, client.layout, "kv")
    keys = client.keys(token_ids)
    bt = client.layout.block_tokens
    if src.shape[-2] < len(keys) * bt:
        raise ValueError(f"kv: holds {src.shape[-2]} tokens, fewer than the {len(keys) * bt} of full blocks")
    # With durable commits each reserved batch is committed in pieces of about
    # COMMIT_PIECE_BYTES as the copy goes, so the daemon is writing NVMe while the rest of
    # the batch is copied (without them a Commit is quick, and one per batch is cheaper).
    # Batches are pipelined: the Commits of batch k may still run while batch k+1 is
    # reserved and copied; before batch k+2, batch k's Commits are settled.
    stored = 0
    step = client.max_batch_blocks()
    durable = client.info.durable_commit
    per = max(1, COMMIT_PIECE_BYTES // client.layout.block_bytes) if durable else step
    # With durable commits the daemon's NVMe writes run while we copy: a second copy thread
    # took the core they need (durable writes measured 1.5-1.9 GB/s with it, 2.0-2.3 without).
    threads = 1 if durable else 2
    pending: list[list[grpc.Future]] = []  # per batch, the Commits in flight
    try:
        for start, w in client.reserve_chain(keys, token_ids=token_ids, batch_blocks=step):
            chunk = w.keys
            futures: list[grpc.Future] = []
            pending.append(futures)
            try:
                wanted = [o if st == RESERVED else None for o, st in zip(w.offsets, w.states)]
                left = len(chunk) - wanted.count(None)
                for p0 in range(0, len(chunk), per):
                    piece = wanted[p0:p0 + per]
                    for i, end, off in slot_runs(piece, client.slot_stride_bytes):
                        blocks = blocks_of(client.layout, src, (start + p0 + i) * bt, end - i)
                        copier.copy(slots(client, off, end - i), blocks, threads)
                    mine = [chunk[p0 + j] for j, o in enumerate(piece) if o is not None]
                    if not mine:
                        continue
                    # Each Commit names its keys (they may reach the daemon in any order);
                    # the lease ends with the last of them.
                    futures.append(client.stub.Commit.future(pb.CommitRequest(
                        session_id=client.session_id, lease_id=w.lease_id, keys=pack(mine)), timeout=client.timeout_s))
                    left -= len(mine)
                    w.done = left == 0
            except BaseException:
                w.abort()
                raise
            while len(pending) > 2:
                for f in pending.pop(0):
                    stored += _committed(f)
    finally:
        for futures in pending:  # settle what is in flight even when raising
            for f in futures:
                stored += _committed(f)
    return stored


def _committed(f: grpc.Future) -> int:
    try:
        return f.result().committed
    except grpc.RpcError as e:
        raise KVStoreError(e.code(), e.details() or "") from None


def get(client: "KVStoreClient", token_ids, out, wait_s: float, copier: Copier) -> int:
    """Read the longest cached prefix of ``token_ids`` into ``out``; returns tokens read.
    Blocks on a lower tier are promoted first, waiting at most ``wait_s`` seconds."""
    client.require_data_session()
    dst = as_bytes_view(out, client.layout, "out")
    keys = client.keys(token_ids)
    bt = client.layout.block_tokens
    if dst.shape[-2] < len(keys) * bt:
        keys = keys[: dst.shape[-2] // bt]
    read = 0
    step = client.max_batch_blocks()
    for start in range(0, len(keys), step):
        chunk = keys[start:start + step]
        with client.acquire(chunk, allow_partial=True, wait_s=wait_s) as r:
            for i, end, off in slot_runs(r.offsets[:r.count], client.slot_stride_bytes):
                copier.copy(blocks_of(client.layout, dst, (start + i) * bt, end - i), slots(client, off, end - i))
            read += r.count
        if r.count < len(chunk):
            break
    return read * bt


def block_shape(layout: KVLayout) -> tuple[int, ...]:
    """One block's slot as bytes: ``[layers, 2, block_tokens, row]`` (MLA: no 2)."""
    if layout.kind is AttnKind.MLA:
        return (layout.num_layers, layout.block_tokens, layout.bytes_per_token_layer)
    return (layout.num_layers, 2, layout.block_tokens, layout.bytes_per_token_layer // 2)


def slots(client: "KVStoreClient", offset: int, n: int) -> np.ndarray:
    """``n`` neighbouring slots of the client's arena from ``offset``, as one
    ``[n, *block_shape]`` view."""
    L = client.layout
    base = client.arena.buf[offset:offset + (n - 1) * client.slot_stride_bytes + L.block_bytes]
    inner = np.lib.stride_tricks.as_strided(base, (n, L.block_bytes), (client.slot_stride_bytes, 1))
    return inner.reshape((n, *block_shape(L)))


def blocks_of(layout: KVLayout, t: np.ndarray, t0: int, n: int) -> np.ndarray:
    """Tokens ``[t0, t0 + n * block_tokens)`` of a layer-major byte view, block-major:
    ``[n, *block_shape]`` (a strided view, no copy)."""
    bt = layout.block_tokens
    part = t[..., t0:t0 + n * bt, :]
    if layout.kind is AttnKind.MLA:  # [L, n*bt, row] -> [n, L, bt, row]
        return part.reshape(part.shape[0], n, bt, part.shape[-1]).transpose(1, 0, 2, 3)
    return part.reshape(part.shape[0], 2, n, bt, part.shape[-1]).transpose(2, 0, 1, 3, 4)
