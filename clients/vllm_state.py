"""Recurrent-state groups of hybrid models in vLLM's KV connector on kvstore: the Mamba /
linear-attention (gated delta net, ...) layers of Qwen3-Next-, Jamba-, Bamba- or Nemotron-H-style
models (see :mod:`kvstore.clients.vllm_hybrid` for the other groups).

Such a layer keeps no KV per token: one state per request, overwritten token after token. vLLM's
prefix caching keeps snapshots of it in its ``"align"`` mode (the default with prefix caching):
prefill is split so that steps end on block boundaries, and the state after token ``i *
block_size`` is left in the block at index ``i - 1`` of the group's table; the scheduler hands
each snapshot it keeps to the connector with its exact block (``SchedulerOutput.
kv_connector_block_state.boundary_state_offloads``). kvstore stores exactly those:

- **Key.** The snapshot after block ``i``'s last token is stored under block ``i``'s chain key,
  in the group's own namespace (state layout: one chunk of ``state_bytes`` per layer, the
  engine's bytes as vLLM's pages hold them, conv then SSM state). A state namespace is sparse:
  only the boundaries vLLM kept have a snapshot, each filed as a chain head of its own (the
  daemon keeps, evicts, writes out and recovers it on its own, like a one-block prefix).
- **Hits.** A prefix of ``n`` blocks is a hit only when every token-row group holds its ``n``
  leading blocks and every state group the snapshot at block ``n`` (the scheduler looks the
  state keys up each on its own, ``Lookup(each=true)``, and takes the longest such ``n``).
- **Loads** put the snapshot into the one block vLLM allocated at index ``n - 1`` for the
  request (the others behind it are vLLM's null block), while vLLM holds the request back
  (asynchronous loads, as for every hybrid model); a request whose snapshot cannot be loaded is
  reported failed and vLLM recomputes it whole.
- **Saves** copy the snapshot out of the block vLLM named, in the step that computed it (vLLM
  keeps the block's bytes for that step only), and commit it.

Refused at start-up (the model then runs as plain vLLM): Mamba groups outside ``align`` mode
(no snapshots to store), speculative-decoding state blocks, and a cache vLLM did not hand over
as one state tensor (or list of state tensors) per layer of the expected size.

Not thread-safe: vLLM calls each worker from one thread.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from kvstore.clients.client import KVStoreError
from kvstore.clients.leases import RESERVED
from kvstore.clients.vllm_setup import KVStoreConnectorStats, Link
from kvstore.layout import KVLayout

log = logging.getLogger("kvstore.vllm")


@dataclass(slots=True)
class Snapshot:
    """A state snapshot vLLM handed over: the state after ``token_ids`` (a whole number of
    kvstore blocks from token 0) sits in vLLM's block ``block_id`` of KV cache group ``group``."""

    req_id: str
    group: int
    block_id: int
    token_ids: list[int]


def state_signature(spec) -> str:
    """The state's shapes and dtypes, e.g. ``3x512.bfloat16+4x64x64.bfloat16``: named in the
    group's namespace so snapshots of other shapes or dtypes never alias."""
    return "+".join("x".join(map(str, shape)) + "." + str(dt).removeprefix("torch.")
                    for shape, dt in zip(spec.shapes, spec.dtypes))


@dataclass(frozen=True, slots=True)
class StateShard:
    """A TP rank's share of a recurrent state, in snapshots of the whole model's state (TP=1's
    bytes), so engines of every TP size share them. Each rank writes its share as part ``part``
    of ``parts`` of the snapshot's block (the daemon shows it once every rank committed) and
    reads its share back. ``runs``: ``(offset in the rank's state, offset in the whole state,
    bytes)`` of one layer; ``signature``: the whole state's shapes (in the namespace)."""

    runs: tuple[tuple[int, int, int], ...]
    local_bytes: int
    full_bytes: int
    part: int
    parts: int
    signature: str


# Models whose gated-delta-net layers vLLM shards as Qwen3-Next's: conv channels [q | k | v],
# each split evenly over the ranks (mamba_v2_sharded_weight_loader), value heads split evenly.
GDN_MODEL_TYPES = frozenset({"qwen3_next"})


def state_shard(spec, hf_config, rank: int, tp: int) -> StateShard | None:
    """Rank ``rank``'s share of a layer's state in the whole state, for the state kinds whose
    sharding kvstore knows (Qwen3-Next's gated delta net); None at TP=1 or for any other kind
    (its snapshots keep a namespace per rank)."""
    if tp == 1 or getattr(hf_config, "model_type", "") not in GDN_MODEL_TYPES \
            or getattr(spec.mamba_type, "name", "") != "GDN_ATTN" or len(spec.shapes) != 2:
        return None
    nk, dk = hf_config.linear_num_key_heads, hf_config.linear_key_head_dim
    nv, dv = hf_config.linear_num_value_heads, hf_config.linear_value_head_dim
    w = hf_config.linear_conv_kernel_dim - 1
    kd, vd = nk * dk, nv * dv
    if kd % tp or vd % tp or nv % tp:
        return None
    cd, cdl = 2 * kd + vd, (2 * kd + vd) // tp
    (conv, ssm), (ec, es) = spec.shapes, (torch.empty(0, dtype=d).element_size() for d in spec.dtypes)
    if tuple(ssm) != (nv // tp, dv, dk) or tuple(conv) not in ((w, cdl), (cdl, w)):
        return None
    dim_first = tuple(conv) == (cdl, w) and w != cdl
    segments = [(0, rank * kd // tp, kd // tp), (kd // tp, kd + rank * kd // tp, kd // tp),
                (2 * kd // tp, 2 * kd + rank * vd // tp, vd // tp)]  # (rank's channel, whole's, channels)
    if dim_first:
        runs = [(lc * w * ec, fc * w * ec, n * w * ec) for lc, fc, n in segments]
    else:
        runs = [((j * cdl + lc) * ec, (j * cd + fc) * ec, n * ec) for j in range(w) for lc, fc, n in segments]
    share = nv // tp * dv * dk * es
    runs.append((cdl * w * ec, cd * w * ec + rank * share, share))
    whole = ((cd, w) if dim_first else (w, cd), (nv, dv, dk))
    signature = "+".join("x".join(map(str, shape)) + "." + str(dt).removeprefix("torch.")
                         for shape, dt in zip(whole, spec.dtypes))
    return StateShard(tuple(runs), cdl * w * ec + share, cd * w * ec + tp * share, rank, tp, signature)


def state_layout(num_layers: int, nbytes: int, block_tokens: int) -> KVLayout:
    return KVLayout(num_layers=num_layers, num_kv_heads=0, head_dim=0, dtype="int8", kind="state",
                    block_tokens=block_tokens, state_bytes=nbytes)


def _parts(cache, layer: str, nbytes: int) -> list[torch.Tensor]:
    """A layer's state tensors, each ``[num_blocks, ...]``, checked against ``nbytes`` per block.
    vLLM 0.32 hands a state layer's cache as one raw byte view of its pages (the CPU runner)
    or as one tensor per state (conv, SSM); both are read per block, part by part."""
    parts = list(cache) if isinstance(cache, (list, tuple)) else [cache]
    per_block = sum(p[0].numel() * p.element_size() for p in parts)
    if per_block < nbytes or (len(parts) > 1 and per_block != nbytes):
        raise ValueError(f"kvstore: vLLM's state cache of {layer} holds {per_block} bytes per block, the "
                         f"model's state {nbytes}")
    return parts


class StateWorker:
    """One state group's worker (see the module docstring), over its own session (``link``).
    The interface :class:`~kvstore.clients.vllm_hybrid.HybridWorker` drives: loads are the
    step's ``pulls`` cut to the group (one block: the snapshot's), saves its ``snapshots``;
    ``failed`` holds the requests whose snapshot could not be loaded."""

    def __init__(self, link: Link, layout: KVLayout, layers: tuple[str, ...], load_wait_s: float) -> None:
        self.link, self.layout, self.layers = link, layout, layers
        # ``layout``: the snapshots' (whole states, with ``link.shard``: this rank's share of each)
        self.shard: StateShard | None = getattr(link, "shard", None)
        self.local_bytes = self.shard.local_bytes if self.shard is not None else layout.state_bytes
        self.load_wait_s = load_wait_s
        self.failed: set[str] = set()
        self.saves_failed: set[str] = set()  # requests a snapshot of this step was not stored for
        self.unannounced: set[str] = set()   # (a state group announces nothing anyway)
        self._done: set[str] = set()
        self._caches: list[list[torch.Tensor]] = []
        self._stats = KVStoreConnectorStats()

    def register_kv_caches(self, kv_caches: dict) -> None:
        self._caches = [_parts(kv_caches[name], name, self.local_bytes) for name in self.layers]

    # --- copies between vLLM's blocks and a slot's bytes ---------------------------------------
    def _read(self, block_id: int, out) -> None:
        """Block ``block_id``'s state, layer after layer, into ``out`` (a slot, uint8): whole, or
        with a shard this rank's share of each layer's whole state."""
        if self.shard is None:
            return self._read_local(block_id, out)
        mine = np.empty(len(self._caches) * self.local_bytes, np.uint8)
        self._read_local(block_id, mine)
        self._runs(out, mine, to_slot=True)

    def _write(self, block_id: int, src) -> None:
        """``src`` (a slot's bytes, as :meth:`_read` wrote them) into block ``block_id``."""
        if self.shard is None:
            return self._write_local(block_id, src)
        mine = np.empty(len(self._caches) * self.local_bytes, np.uint8)
        self._runs(src, mine, to_slot=False)
        self._write_local(block_id, mine)

    def _runs(self, slot, mine, to_slot: bool) -> None:
        """Move this rank's share of each layer between a slot (whole states) and ``mine`` (this
        rank's states, layer after layer)."""
        n, whole = self.local_bytes, self.layout.state_bytes
        for layer in range(len(self._caches)):
            for local, full, size in self.shard.runs:
                a, b = layer * n + local, layer * whole + full
                if to_slot:
                    slot[b:b + size] = mine[a:a + size]
                else:
                    mine[a:a + size] = slot[b:b + size]

    def _read_local(self, block_id: int, out) -> None:
        """Block ``block_id``'s state as this rank holds it, layer after layer, into ``out``."""
        dst = torch.from_numpy(out)
        n = self.local_bytes
        for layer, parts in enumerate(self._caches):
            pos = layer * n
            for p in parts:
                raw = p[block_id].contiguous().reshape(-1).view(torch.uint8)
                raw = raw[:n - (pos - layer * n)]
                dst[pos:pos + raw.numel()].copy_(raw)
                pos += raw.numel()

    def _write_local(self, block_id: int, src) -> None:
        """``src`` (this rank's states, as :meth:`_read_local` wrote them) into block ``block_id``."""
        data = torch.from_numpy(src)
        n = self.local_bytes
        for layer, parts in enumerate(self._caches):
            pos = layer * n
            for p in parts:
                view = p[block_id]
                # As _read took them: at most the state's bytes (a raw page holds more after them).
                size = min(view.numel() * view.element_size(), n - (pos - layer * n))
                if view.is_contiguous():
                    view.reshape(-1).view(torch.uint8)[:size].copy_(data[pos:pos + size])
                else:  # a strided state tensor: whole (_parts checked the sizes add up)
                    view.copy_(data[pos:pos + size].view(view.dtype).view(view.shape))
                pos += size

    # --- vLLM's hooks, as HybridWorker hands them on -------------------------------------------
    def start_load_kv(self, part) -> None:
        """Each pull of the step is one snapshot: pinned, copied into the block vLLM allocated
        for it, released (the request is held back by vLLM meanwhile)."""
        if part is None:
            return
        for span in part.pulls:
            ok = False
            try:
                ok = self._load(span)
            except (KVStoreError, OSError, RuntimeError, ValueError) as e:
                log.warning("kvstore: state load of %s failed; vLLM recomputes it: %s", span.req_id, e)
                self.link.lost(e)
            if not ok:
                self.failed.add(span.req_id)
                self._stats.data["load_failed_blocks"] += 1
            self._done.add(span.req_id)

    def _load(self, span) -> bool:
        client = self.link.get()
        if client is None or span.end - span.start != 1:
            return False
        key = client.keys(span.token_ids[:span.end * self.layout.block_tokens])[-1]
        lease = client.acquire([key], allow_partial=True, wait_s=self.load_wait_s)
        try:
            if lease.count != 1:
                return False
            self._write(span.block_table[span.start], lease.view(0))
        finally:
            lease.release()
        self._stats.data["loaded_blocks"] += 1
        return True

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass  # loads land before vLLM schedules the request

    def save_kv_layer(self, layer_name: str, part) -> None:
        pass  # snapshots are read in wait_for_save, once the step's forward has written them

    def wait_for_save(self, part) -> None:
        """The step's snapshots, each reserved, copied out of vLLM's block and committed; one
        that fails is aborted (a later miss)."""
        if part is None or not part.snapshots:
            self.link.retire()
            return
        client = self.link.get()
        if client is None:
            self.saves_failed.update(snap.req_id for snap in part.snapshots)
            return
        for snap in part.snapshots:
            # Filed as a chain head of its own: its namespace holds no block before it (the
            # snapshots are sparse), and a block whose parent is missing is unreachable to the
            # daemon (dropped at NVMe recovery, left out of the shutdown write-out). No token
            # ids: they would be checked against that empty parent, and state groups publish
            # no KV events.
            key = client.keys(snap.token_ids)[-1]
            try:
                w = client.reserve([key])
                if w.states[0] != RESERVED:
                    continue  # stored already, or another engine is writing it
                try:
                    self._read(snap.block_id, w.view(0))
                except BaseException:
                    w.abort()
                    raise
                w.commit()
                self._stats.data["saved_blocks"] += 1
            except Exception as e:  # noqa: BLE001 - a save is best effort; never fail vLLM's step
                log.warning("kvstore: state save of %s not stored (a later miss): %s", snap.req_id, e)
                self._stats.data["save_failed_blocks"] += 1
                self.saves_failed.add(snap.req_id)
                if isinstance(e, KVStoreError):
                    self.link.lost(e)
                if self.link.client is not client:  # the daemon is gone: the rest would fail too
                    self.saves_failed.update(x.req_id for x in part.snapshots)
                    break
        self.link.retire()  # a lost daemon's client closed (nothing of it in flight any more)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        done, self._done = self._done, set()
        return None, done or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return set()  # reported by request (``failed``)

    def get_kv_connector_stats(self) -> KVStoreConnectorStats | None:
        if self._stats.is_empty():
            return None
        s, self._stats = self._stats, KVStoreConnectorStats()
        return s

    def get_kv_connector_kv_cache_events(self) -> None:
        return None  # events come from a full-attention group

    def shutdown(self) -> None:
        pass
