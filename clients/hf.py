"""Hugging Face transformers adapter: a ``DynamicCache`` that starts from a prompt's cached
prefix in kvstore and stores the prompt's new full blocks after prefill.

    adapter = HFAdapter(client, model, HFAdapterConfig(model_id="my-llama"))  # registers
    cache = adapter.cache_for(input_ids)        # Lookup (policy) + Acquire; layer copies queued
    out = model.generate(input_ids, past_key_values=cache, max_new_tokens=32, do_sample=False)
    cache.wait_stored()                          # the prompt's new full blocks are committed

``generate`` sees a cache that already holds ``cache.plan.load_tokens`` tokens and runs the
model on the rest of the prompt only (the partial last block and any blocks the policy chose to
recompute). Llama-architecture models (MHA/GQA/MQA, full attention), batch size 1; transformers
5 (the ``>=5.16.1,<5.20`` the ``hf`` extra pins), which sizes positions and the causal mask from
the cache's ``get_seq_length`` and calls ``update(k, v, layer_idx)`` with nothing else.

How loading overlaps compute. ``cache_for`` runs on the caller's thread: Lookup (the daemon's
load-or-recompute answer, ``load_blocks``) and Acquire, which pins the blocks to load in the
DRAM arena (promoting NVMe blocks first). It then queues one copy per layer, in layer order,
on the adapter's side thread (:class:`kvstore.tiers.hbm_device.EmuStream`), each followed by
an event. Copies go straight from the pinned arena slots (kvstore's canonical layout, the same
bytes the vLLM connector stores: layer-major, ``[2, tokens, heads, dim]`` per block and layer)
into that layer's ``[1, heads, tokens, dim]`` K and V tensors. The forward starts at once: HF
calls ``cache.update(k, v, l)`` from layer ``l``'s attention, and only that call waits, for
layer ``l``'s event. So while the main thread computes layer ``l`` (attention, MLP, then layer
``l+1``'s projections), the side thread copies layer ``l+1``; torch and numpy copies release
the GIL, so the two really run at once. With ``copy_path`` ``zerocopy`` or ``staged`` (the
default, where Triton runs: a GPU model, or ``TRITON_INTERPRET=1``) each layer's copy is one
launch of :mod:`kvstore.tiers.kv_copy`'s kernel between the arena and K/V on the model's device,
on the side thread's own CUDA stream; else the CPU copies described here. ``cache.timings``
records how long the main thread blocked (``load_wait_s``) against the side thread's copy time.

How storing works. The side thread reserves slots for the prompt's full blocks that were not
loaded (blocks already cached come back PRESENT and are skipped). When ``update`` of layer
``l`` in the prefill forward holds that layer's KV for every full block, a copy of layer ``l``
into the slots is queued; after the last layer a Commit. The store overlaps the rest of the
forward and the decode steps; ``wait_stored`` waits for it. A failed store is never committed
(its lease is aborted or expires), and a failed load raises from ``update``: no data from a
failed read is used.

Not thread-safe: one adapter (and one client) per worker thread. While a cache's copies are
queued the side thread uses the client's RPCs too (gRPC stubs are thread-safe; the client's
fire-and-forget release queue is not touched from the side thread).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Sequence

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from kvstore.clients.client import KVStoreClient, KVStoreError, LookupResult
from kvstore.clients.leases import RESERVED
from kvstore.layout import AttnKind, DType, KVLayout
from kvstore.modelcfg import ModelConfig, from_hf
from kvstore.tiers.hbm_device import DeviceChoice, DeviceKind, EmuEvent, EmuStream, HostPin
from kvstore.tiers.arena import slot_runs
from kvstore.clients.hbm_paged import BULK_STAGING_BYTES, LayerPages
from kvstore.tiers.kv_copy import DEFAULT_COPY_PATH, BatchedKV, CopyPath, resolve_copy_path

log = logging.getLogger("kvstore.hf")

TORCH_TO_KV_DTYPE = {torch.float32: DType.FP32, torch.bfloat16: DType.BF16, torch.float16: DType.FP16}


# --- model facts ------------------------------------------------------------------------------

def model_config(config: Any) -> ModelConfig:
    """kvstore's view of a HF config (``PretrainedConfig`` or its dict)."""
    d = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    return from_hf(d, str(d.get("_name_or_path") or d.get("model_type") or "config"))


def _check_supported(config: Any, mc: ModelConfig) -> None:
    if mc.is_mla:
        raise ValueError("model: MLA models (kv_lora_rank) are not supported by the HF adapter; "
                         "it handles Llama-architecture MHA/GQA/MQA models")
    types = getattr(config, "layer_types", None) or []
    window = getattr(config, "sliding_window", None)
    if window and getattr(config, "use_sliding_window", True) or any(t != "full_attention" for t in types):
        raise ValueError("model: sliding-window layers keep only the last window of KV; the HF adapter "
                         "handles full-attention models only")


def layout_for(model: torch.nn.Module, block_tokens: int = 16) -> KVLayout:
    """The KV layout of ``model``: shape from its config, dtype from its weights."""
    dtype = next(model.parameters()).dtype
    if dtype not in TORCH_TO_KV_DTYPE:
        raise ValueError(f"model: weights in {dtype}; the HF adapter stores fp32, bf16 or fp16 KV")
    mc = model_config(model.config)
    _check_supported(model.config, mc)
    return mc.layout(TORCH_TO_KV_DTYPE[dtype], block_tokens)


def non_embedding_params(model: torch.nn.Module) -> int:
    """Parameters a prefill token runs through: all but the input embedding and the LM head
    (HF prefill runs the head for the last token only). The daemon's cost model takes this."""
    mc = model_config(model.config)
    try:
        return mc.params(active=True) - mc.embedding_params()
    except ValueError:  # config lacks a field the count needs: count the module instead
        skip = {id(p) for m in (model.get_input_embeddings(), model.get_output_embeddings()) if m is not None
                for p in m.parameters()}
        return sum(p.numel() for p in model.parameters() if id(p) not in skip)


@torch.no_grad()
def measure_prefill_tokens_per_s(model: torch.nn.Module, tokens: int = 2048, repeats: int = 3, seed: int = 0) -> float:
    """Prefill throughput of ``model`` on a ``tokens``-token prompt (tokens/s): the fastest of
    ``repeats`` timed runs after one untimed run of the same size (the first run at a new shape
    pays one-off kernel selection and page faults; other load on the machine only slows a run
    down). The daemon's cost model is calibrated at 2,048 tokens, so that is the default."""
    vocab = model.config.vocab_size
    device = next(model.parameters()).device
    ids = torch.randint(0, vocab, (1, tokens), generator=torch.Generator().manual_seed(seed)).to(device)
    times = []
    for i in range(repeats + 1):
        t0 = time.perf_counter()
        model(ids, past_key_values=DynamicCache(), use_cache=True, logits_to_keep=1)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i:
            times.append(time.perf_counter() - t0)
    return tokens / min(times)


# --- configuration and plans ------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class HFAdapterConfig:
    """How the adapter registers and loads. Times are seconds."""

    model_id: str
    block_tokens: int = 16
    tenant_salt: str = ""
    prefill_tokens_per_s: float = 0.0   # measured by the worker; 0 = the daemon's default
    model_params: float | None = None   # None = count the model's non-embedding parameters
    acquire_wait_s: float = 10.0        # how long Acquire may wait for NVMe blocks to be promoted
    layer_wait_s: float = 30.0          # bound on waiting for one layer's copy
    copy_path: str = DEFAULT_COPY_PATH.value  # zerocopy | staged | legacy (kvstore.tiers.kv_copy)


@dataclass(frozen=True, slots=True)
class LoadPlan:
    """What ``cache_for`` decided for one prompt. ``advised_blocks`` is the daemon's answer;
    ``load_blocks`` is what is loaded: the advice, capped so at least one prompt token is left
    to compute (the model needs its logits), and what Acquire could pin."""

    prompt_tokens: int
    block_tokens: int
    hit_blocks: int
    advised_blocks: int
    load_blocks: int
    tiers: bytes
    est_load_s: float
    est_recompute_s: float
    reason: str

    @property
    def load_tokens(self) -> int:
        return self.load_blocks * self.block_tokens

    @property
    def outcome(self) -> str:
        """The policy's choice: ``none`` (no hit), ``load``, ``partial`` or ``recompute``."""
        if self.hit_blocks == 0:
            return "none"
        if self.advised_blocks >= self.hit_blocks:
            return "load"
        return "recompute" if self.advised_blocks == 0 else "partial"


# --- the cache --------------------------------------------------------------------------------

class _PrefixLayer(DynamicLayer):
    """A ``DynamicLayer`` whose first ``prefix_tokens`` tokens arrive from the side thread.
    Until then it reports them in ``get_seq_length`` (HF sizes positions and masks from it)."""

    def __init__(self, prefix_tokens: int = 0) -> None:
        super().__init__()
        self.prefix_tokens = prefix_tokens
        self.ready: EmuEvent | None = None  # the side thread's event for this layer's copy
        self.loaded: tuple[torch.Tensor, torch.Tensor] | None = None  # set by the side thread
        self.wait_s = 0.0

    def get_seq_length(self) -> int:
        if self.ready is not None:
            return self.prefix_tokens
        return super().get_seq_length()

    def materialize(self, like: torch.Tensor, timeout_s: float) -> None:
        t0 = time.perf_counter()
        self.ready.synchronize(timeout_s)  # raises the copy's error: a failed load is never used
        self.wait_s = time.perf_counter() - t0
        k, v = self.loaded
        self.ready, self.loaded = None, None
        if k.dtype != like.dtype:
            raise ValueError(f"kvstore KV is {k.dtype} but the model computes {like.dtype}; "
                             "register the layout with the dtype the model runs in")
        self.lazy_initialization(like, like)  # takes dtype and device from the model's KV
        self.keys, self.values = k.to(self.device), v.to(self.device)

    def update(self, key_states, value_states, *args, **kwargs):
        if self.ready is not None:
            raise RuntimeError("materialize() must run before update() of a loading layer")
        return super().update(key_states, value_states, *args, **kwargs)


class KVStoreCache(DynamicCache):
    """A ``DynamicCache`` for one prompt, pre-filled from kvstore and storing back (see the
    module docstring). Make it with :meth:`HFAdapter.cache_for`."""

    def __init__(self, adapter: "HFAdapter", token_ids: Sequence[int], *, load: bool = True,
                 store: bool = True, follow_policy: bool = True) -> None:
        super().__init__()
        self.adapter = adapter
        self.token_ids = [int(t) for t in token_ids]
        client, lay = adapter.client, adapter.layout
        bt, L = lay.block_tokens, lay.num_layers
        self.timings: dict[str, float] = {"lookup_s": 0.0, "acquire_s": 0.0, "load_copy_s": 0.0,
                                          "load_wait_s": 0.0, "store_copy_s": 0.0}
        self._side = adapter.side
        keys = client.keys(self.token_ids)
        self.block_keys = keys
        lease, got = None, 0
        try:
            t0 = time.perf_counter()
            r = client.lookup_keys(keys) if keys else LookupResult(0, b"", 0, 0.0, 0.0, "no full block")
            self.timings["lookup_s"] = time.perf_counter() - t0
            cap = (len(self.token_ids) - 1) // bt  # leave >= 1 token to compute: its logits start decoding
            want = min(r.load_blocks if follow_policy else r.hit_blocks, r.hit_blocks, cap) if load else 0
            if want > 0:
                t0 = time.perf_counter()
                lease = client.acquire(keys[:want], allow_partial=True, wait_s=adapter.config.acquire_wait_s)
                self.timings["acquire_s"] = time.perf_counter() - t0
                got = lease.count  # fewer than asked only if blocks were evicted since the Lookup
                if got == 0:
                    lease.release()
                    lease = None
        except KVStoreError as e:
            # The daemon is down or refused: serve the prompt by recomputing it, store nothing.
            log.warning("kvstore unavailable, recomputing the prompt: %s", e)
            r = LookupResult(0, b"", 0, 0.0, 0.0, f"kvstore unavailable: {e}")
            store = False
        self.plan = LoadPlan(len(self.token_ids), bt, r.hit_blocks, r.load_blocks, got, bytes(r.tiers),
                             r.est_load_s, r.est_recompute_s, r.reason)
        self.layers = [_PrefixLayer(got * bt) for _ in range(L)]
        self.layer_class_to_replicate = None
        if got:
            self._queue_loads(lease, got)
        self._store = _PromptStore(self, keys, got) if store and got < len(keys) else None

    # --- loading (side thread) --------------------------------------------------------------
    def _queue_loads(self, lease, blocks: int) -> None:
        lay, side = self.adapter.layout, self._side
        bt, H = lay.block_tokens, lay.num_kv_heads
        elem = lay.dtype.bits // 8
        De = lay.head_dim * elem
        B = lay.block_bytes
        adapter = self.adapter
        arena = adapter.arena_bytes()
        runs = list(slot_runs(lease.offsets[:blocks], B))
        dtype = adapter.torch_dtype
        T = blocks * bt
        if adapter.copy_path is not CopyPath.LEGACY:
            # One launch per layer, straight into K/V on the model's device (allocated here, on
            # the caller's stream, so the forward may use them once the layer's event fired).
            dst_all = torch.empty((lay.num_layers, 2, H, T, De), dtype=torch.uint8, device=adapter.device)
            kernels = adapter.batched([LayerPages((d[0:1], d[1:2])) for d in dst_all])
            rows, offsets = _prompt_rows(T, adapter.device), list(lease.offsets[:blocks])

        def copy_layer(l: int, layer: _PrefixLayer) -> None:
            t0 = time.perf_counter()
            if adapter.copy_path is not CopyPath.LEGACY:
                adapter.on_device(lambda: kernels.load_layer(l, rows, offsets))
                dst = dst_all[l]
            else:
                dst = torch.empty((2, H, T, De), dtype=torch.uint8)
                for a, b, off in runs:
                    k = b - a
                    src = arena[off:off + k * B].view(k, lay.num_layers, 2, bt, H, De)[:, l]  # [k, 2, bt, H, De]
                    dst[:, :, a * bt:b * bt].view(2, H, k, bt, De).copy_(src.permute(1, 3, 0, 2, 4))
            kv = dst.view(dtype)  # [2, H, T, D]
            layer.loaded = (kv[0:1], kv[1:2])
            self.timings["load_copy_s"] += time.perf_counter() - t0

        for l, layer in enumerate(self.layers):
            side.submit(lambda l=l, layer=layer: copy_layer(l, layer))
            layer.ready = side.record()  # fires once layer l's copy ran (or failed)

        def release() -> None:
            try:
                lease.release(wait=True)
            except Exception:  # noqa: BLE001 - a lost release is reclaimed at the lease TTL
                pass

        side.submit(release)

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        if key_states.shape[0] != 1:
            raise ValueError(f"KVStoreCache: batch size must be 1, got {key_states.shape[0]}")
        layer = self.layers[layer_idx]
        if layer.ready is not None:
            layer.materialize(key_states, self.adapter.config.layer_wait_s)
            self.timings["load_wait_s"] += layer.wait_s
        keys, values = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        if self._store is not None:
            self._store.layer_ready(layer_idx, keys, values)
        return keys, values

    # --- storing ----------------------------------------------------------------------------
    def wait_stored(self, timeout_s: float | None = 60.0) -> int:
        """Wait until the prompt's new full blocks are committed; returns blocks committed
        (0 when nothing was new). Raises if the store failed or the prefill did not run."""
        if self._store is None:
            return 0
        return self._store.wait(timeout_s)

    def close(self) -> None:
        """Give back a store that will not complete (its reservation is aborted)."""
        if self._store is not None:
            self._store.abort()

    @property
    def loaded_tokens(self) -> int:
        return self.plan.load_tokens


class _PromptStore:
    """Reserve -> per-layer copies -> Commit of one prompt's not-yet-loaded full blocks, all on
    the side thread. Blocks another writer holds (BUSY) or already cached (PRESENT) are skipped."""

    def __init__(self, cache: KVStoreCache, keys: list[bytes], first: int) -> None:
        self.cache, self.keys, self.first = cache, keys, first
        self.end_tokens = len(keys) * cache.adapter.layout.block_tokens
        self.leases: list = []
        self.offsets: list[int | None] = []
        self.submitted: set[int] = set()
        self.committed = 0
        self.done: EmuEvent | None = None
        self.aborted = False
        client = cache.adapter.client

        def reserve() -> None:
            for _, w in client.reserve_chain(keys, start=first, token_ids=cache.token_ids):
                self.leases.append(w)
                self.offsets += [o if s == RESERVED else None for s, o in zip(w.states, w.offsets)]

        cache._side.submit(reserve)

    def layer_ready(self, l: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        if l in self.submitted or keys.shape[-2] < self.end_tokens or self.aborted:
            return
        self.submitted.add(l)
        cache = self.cache
        lay = cache.adapter.layout
        bt, H, L = lay.block_tokens, lay.num_kv_heads, lay.num_layers
        De = lay.head_dim * lay.dtype.bits // 8
        B = lay.block_bytes
        first, n = self.first, len(self.keys) - self.first
        end = self.end_tokens
        # [H, tokens, D] each. A DynamicLayer never writes its tensors in place (update cats into
        # new ones, crop slices, reset drops them), so these stay valid while the side thread
        # copies them.
        k_src, v_src = keys[0].detach(), values[0].detach()
        written = cache.adapter.compute_event()  # the forward's stream has written them by then

        def copy_layer() -> None:
            t0 = time.perf_counter()
            adapter = cache.adapter
            if adapter.copy_path is not CopyPath.LEGACY:
                # One launch for the layer's K and V of every new block, from the model's device.
                pages = LayerPages((k_src[:, first * bt:end].unsqueeze(0), v_src[:, first * bt:end].unsqueeze(0)))
                kernels = adapter.batched([pages])
                adapter.on_device(lambda: kernels.store_layer(l, _prompt_rows(n * bt, adapter.device), self.offsets,
                                                              page_layer=0), after=written)
                cache.timings["store_copy_s"] += time.perf_counter() - t0
                return
            arena = adapter.arena_bytes()
            for half, src in enumerate((k_src, v_src)):
                src = src.to("cpu").contiguous().view(torch.uint8)  # [H, tokens, De]
                s = src[:, first * bt:end].view(H, n, bt, De)
                for a, b, off in slot_runs(self.offsets, B):
                    dst = arena[off:off + (b - a) * B].view(b - a, L, 2, bt, H, De)[:, l, half]  # [k, bt, H, De]
                    dst.copy_(s[:, a:b].permute(1, 2, 0, 3))
            cache.timings["store_copy_s"] += time.perf_counter() - t0

        cache._side.submit(copy_layer)
        if len(self.submitted) == L:
            def commit() -> None:
                self.committed = sum(w.commit() for w in self.leases)

            cache._side.submit(commit)
            self.done = cache._side.record()

    def wait(self, timeout_s: float | None) -> int:
        if self.done is None:
            self.abort()
            raise RuntimeError(f"store: the prefill stored {len(self.submitted)} of "
                               f"{self.cache.adapter.layout.num_layers} layers; nothing was committed")
        self.done.synchronize(timeout_s)
        return self.committed

    def abort(self) -> None:
        if self.done is not None or self.aborted:
            return
        self.aborted = True

        def abort() -> None:
            for w in self.leases:
                w.abort()

        self.cache._side.submit(abort)
        self.cache._side.synchronize()


def _prompt_rows(tokens: int, device: torch.device) -> torch.Tensor:
    """(page 0, position t) of each token: a layer's ``[1, heads, tokens, dim]`` K or V read
    as one page, for the batched kernels."""
    t = torch.arange(tokens, dtype=torch.int64)
    return torch.stack([torch.zeros_like(t), t], dim=1).to(device)


# --- the adapter ------------------------------------------------------------------------------

class HFAdapter:
    """Binds a registered :class:`KVStoreClient` to one HF causal LM (batch size 1).

    Registers the model's namespace (layout from the config, dtype from the weights) with the
    worker's measured prefill throughput and parameter count, so the daemon's load-or-recompute
    cost model is calibrated to this worker."""

    def __init__(self, client: KVStoreClient, model: torch.nn.Module, config: HFAdapterConfig) -> None:
        self.client, self.model, self.config = client, model, config
        self.layout = layout_for(model, config.block_tokens)
        if self.layout.kind is AttnKind.MLA:
            raise ValueError("model: MLA is not supported by the HF adapter")
        self.torch_dtype = next(model.parameters()).dtype
        params = non_embedding_params(model) if config.model_params is None else config.model_params
        client.register(self.layout, config.model_id, tenant_salt=config.tenant_salt,
                        prefill_tokens_per_s=config.prefill_tokens_per_s, model_params=float(params))
        self.side = EmuStream("kvstore-hf-side")
        self._arena_t: torch.Tensor | None = None
        self.device = next(model.parameters()).device
        self.copy_path, self.copy_reason = resolve_copy_path(config.copy_path, self.device)
        self._pin: HostPin | None = None
        self._stream = None  # the side thread's CUDA stream for the kernels

    def batched(self, pages) -> BatchedKV:
        """The batched copy kernels between ``pages`` (views on the model's device) and the
        arena; on a GPU the arena is registered for them first (once)."""
        arena = self.arena_bytes()
        if self.device.type == "cuda" and self._pin is None:
            self._pin = HostPin(DeviceChoice(DeviceKind.CUDA, self.device.index or 0), arena.data_ptr(), arena.numel())
        return BatchedKV(pages, self.layout, arena, self.copy_path, BULK_STAGING_BYTES)

    def compute_event(self):
        """An event on the caller's current CUDA stream (None on the CPU): the side stream's
        copies of KV the forward just wrote must start after it."""
        if self.device.type != "cuda":
            return None
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.device))
        return ev

    def on_device(self, fn, after=None) -> None:
        """Run ``fn``'s launches on the side thread's own CUDA stream, after the event
        ``after``, and wait for them (the layer's event then means the copy is done); on the
        CPU just run it."""
        if self.device.type != "cuda":
            fn()
            return
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        if after is not None:
            self._stream.wait_event(after)
        with torch.cuda.stream(self._stream):
            fn()
        self._stream.synchronize()

    def arena_bytes(self) -> torch.Tensor:
        """The client's shared arena as a uint8 tensor (zero copy)."""
        if self._arena_t is None:
            self.client.require_data_session()
            self._arena_t = torch.from_numpy(self.client.arena.buf)
        return self._arena_t

    @staticmethod
    def _ids(input_ids) -> list[int]:
        t = torch.as_tensor(input_ids)
        if t.dim() == 2:
            if t.shape[0] != 1:
                raise ValueError(f"input_ids: batch size must be 1, got {t.shape[0]}")
            t = t[0]
        if t.dim() != 1 or t.numel() == 0:
            raise ValueError(f"input_ids: expected [1, tokens] or [tokens] with tokens >= 1, got {tuple(t.shape)}")
        return t.tolist()

    def cache_for(self, input_ids, *, load: bool = True, store: bool = True,
                  follow_policy: bool = True) -> KVStoreCache:
        """A cache for ``input_ids`` holding the prefix the policy chose to load (its copies
        run on the side thread). ``follow_policy=False`` loads every hit block; ``load=False``
        recomputes everything; ``store=False`` does not write the prompt's new blocks."""
        return KVStoreCache(self, self._ids(input_ids), load=load, store=store, follow_policy=follow_policy)

    @torch.no_grad()
    def prefill(self, input_ids, cache: KVStoreCache | None = None) -> tuple[torch.Tensor, KVStoreCache]:
        """Run the model on the part of the prompt the cache does not hold; returns the logits
        of the last prompt token (``[vocab]``) and the cache, ready for decoding."""
        ids = self._ids(input_ids)
        cache = cache if cache is not None else self.cache_for(ids)
        past = cache.get_seq_length()
        device = next(self.model.parameters()).device
        rest = torch.tensor([ids[past:]], device=device)
        # Positions and the causal mask start at the cache's length (transformers 5 has no
        # cache_position): the loaded prefix counts before its copies have run.
        out = self.model(input_ids=rest, past_key_values=cache, use_cache=True, logits_to_keep=1)
        return out.logits[0, -1], cache

    @torch.no_grad()
    def generate(self, input_ids, max_new_tokens: int, cache: KVStoreCache | None = None,
                 **generate_kwargs) -> tuple[list[int], KVStoreCache]:
        """Greedy ``model.generate`` with the kvstore cache; returns the new tokens and the
        cache. The prompt's new blocks are committed before returning; a failed store is
        logged, not raised (the tokens are right either way)."""
        ids = self._ids(input_ids)
        cache = cache if cache is not None else self.cache_for(ids)
        device = next(self.model.parameters()).device
        x = torch.tensor([ids], device=device)
        kw = {"do_sample": False, "pad_token_id": self.model.config.pad_token_id or 0, **generate_kwargs}
        out = self.model.generate(x, attention_mask=torch.ones_like(x), past_key_values=cache,
                                  max_new_tokens=max_new_tokens, **kw)
        try:
            cache.wait_stored()
        except (KVStoreError, RuntimeError, TimeoutError) as e:  # storing is best effort
            log.warning("kvstore store of the prompt failed (nothing committed): %s", e)
        return out[0, len(ids):].tolist(), cache

    def close(self) -> None:
        """Stop the side thread (after its queued work), unpin the arena. The client stays open."""
        self.side.close()
        if self._pin is not None:
            self._pin.close()
            self._pin = None

    def __enter__(self) -> "HFAdapter":
        return self

    def __exit__(self, *_):
        self.close()


__all__ = ["HFAdapter", "HFAdapterConfig", "KVStoreCache", "LoadPlan", "layout_for", "measure_prefill_tokens_per_s",
           "model_config", "non_embedding_params"]
