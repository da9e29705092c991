"""A thin vLLM V1 KV connector on kvstore (``KVConnectorBase_V1`` shape).

Enable it in vLLM (see docs/vllm.md)::

    --kv-transfer-config '{"kv_connector": "KVStoreConnector",
                           "kv_connector_module_path": "kvstore.clients.vllm_connector",
                           "kv_role": "kv_both",
                           "kv_connector_extra_config": {"kvstore_socket": "/run/kvstore/kvstore.sock"}}'

Scheduler side (one process): ``get_num_new_matched_tokens`` looks the prompt's block keys up
in the daemon and answers with the tokens the daemon's load-or-recompute policy says to load
(``load_blocks``), beyond what vLLM's own prefix cache already holds;
``update_state_after_alloc`` remembers the requests to load; ``build_connector_meta`` turns
this step's scheduled requests into load and save work for the workers (load: the external
blocks of new requests; save: prompt blocks that become full in this step, so chunked prefill
saves as it goes); ``request_finished`` forgets the request (and, with ``transfer_peer`` set,
asks the daemon to ship the prompt's blocks to a decode node's daemon).

Worker side (each TP rank): vLLM's paged cache is one tensor per layer, ``[2, num_blocks,
block_size, kv_heads, head_dim]``, plus the request's block table; the moves go through
:class:`kvstore.clients.gpu.GpuKVPath` (a side CUDA stream with the arena page-locked, or an
emulated stream for CPU tensors). ``start_load_kv`` pins the blocks and issues their copies
layer by layer; ``wait_for_layer_load(layer)`` orders the compute stream after that layer's
copies only; ``save_kv_layer`` copies one layer of the blocks reserved for this step into
their slots; ``wait_for_save`` waits for the copies and commits, then releases the loads.
Saves complete inside the step, so ``request_finished`` never needs to delay freeing blocks
and ``get_finished`` has nothing to report. Blocks that could not be pinned (evicted since the
scheduler's Lookup) are reported by ``get_block_ids_with_load_errors`` and vLLM recomputes them.

Keys and block sizes: kvstore keys full blocks of ``block_tokens`` tokens (default: vLLM's
``block_size``); loads start at a kvstore block boundary, so with a local prefix hit that is not
a multiple of ``block_tokens`` nothing is loaded. The scheduler looks keys up in TP rank 0's
namespace; every rank stores the same token blocks in its own namespace.

Not thread-safe; vLLM calls each side from one thread.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from kvstore.clients.client import KVStoreClient, KVStoreError, pack
from kvstore.clients.leases import RESERVED
from kvstore.clients.gpu import GpuKVPath, LoadHandle, StoreHandle
from kvstore.layout import DType, KVLayout
from kvstore.modelcfg import from_hf
from kvstore.v1 import kvstore_pb2 as pb

log = logging.getLogger("kvstore.vllm")

try:  # the real base class when vLLM is installed
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1, KVConnectorMetadata,
                                                                   KVConnectorRole)
except ImportError:  # vLLM absent: a stand-in with the same surface, so the connector imports and tests run
    class KVConnectorRole(enum.Enum):
        SCHEDULER = 0
        WORKER = 1

    class KVConnectorMetadata:  # noqa: D101 - mirrors vLLM's empty base
        pass

    class KVConnectorBase_V1:  # noqa: N801 - vLLM's name
        def __init__(self, vllm_config, role, kv_cache_config=None) -> None:
            self._connector_metadata = None
            self._vllm_config = vllm_config
            self._kv_transfer_config = vllm_config.kv_transfer_config
            self._kv_cache_config = kv_cache_config
            self._role = role

        @property
        def role(self):
            return self._role

        def bind_connector_metadata(self, connector_metadata) -> None:
            self._connector_metadata = connector_metadata

        def clear_connector_metadata(self) -> None:
            self._connector_metadata = None

        def _get_connector_metadata(self):
            assert self._connector_metadata is not None
            return self._connector_metadata

        def has_connector_metadata(self) -> bool:
            return self._connector_metadata is not None

CACHE_DTYPES = {"fp8": DType.FP8_E4M3, "fp8_e4m3": DType.FP8_E4M3, "fp8_e5m2": DType.FP8_E5M2}
TORCH_DTYPES = {torch.float32: DType.FP32, torch.bfloat16: DType.BF16, torch.float16: DType.FP16}


# --- settings ---------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class ConnectorSettings:
    """What the connector reads from ``kv_connector_extra_config`` (seconds, tokens/s)."""

    socket_path: str | None = None       # "kvstore_socket"; None = the daemon's default socket
    model_id: str = ""                   # "model_id"; "" = vLLM's model name
    block_tokens: int = 0                # "block_tokens"; 0 = vLLM's block_size
    tenant_salt: str = ""                # "tenant_salt"
    prefill_tokens_per_s: float = 0.0    # "prefill_tokens_per_s": this engine's measured prefill rate
    model_params: float = 0.0            # "model_params"; 0 = the daemon derives it
    follow_policy: bool = True           # "follow_policy": False loads every hit block
    load_wait_s: float = 10.0            # "load_wait_s": Acquire may wait this long for NVMe blocks
    save_timeout_s: float = 30.0         # "save_timeout_s": bound on wait_for_save
    transfer_peer: str = ""              # "transfer_peer": host:port of a decode daemon's transfer listener
    tp_rank: int | None = None           # "tp_rank"; None = vLLM's tensor-parallel rank

    @classmethod
    def from_vllm(cls, vllm_config) -> "ConnectorSettings":
        extra = dict(getattr(vllm_config.kv_transfer_config, "kv_connector_extra_config", None) or {})
        names = {"kvstore_socket": "socket_path", "model_id": "model_id", "block_tokens": "block_tokens",
                 "tenant_salt": "tenant_salt", "prefill_tokens_per_s": "prefill_tokens_per_s",
                 "model_params": "model_params", "follow_policy": "follow_policy", "load_wait_s": "load_wait_s",
                 "save_timeout_s": "save_timeout_s", "transfer_peer": "transfer_peer", "tp_rank": "tp_rank"}
        unknown = sorted(set(extra) - set(names))
        if unknown:
            raise ValueError(f"kv_connector_extra_config: unknown key {unknown[0]!r}; known: {', '.join(sorted(names))}")
        return cls(**{names[k]: v for k, v in extra.items()})


def kv_layout(vllm_config, block_tokens: int) -> KVLayout:
    """The KV layout one TP rank holds: shape from the HF config, dtype from the cache dtype."""
    mc = vllm_config.model_config
    hf = mc.hf_config
    cfg = from_hf(hf.to_dict() if hasattr(hf, "to_dict") else dict(hf), str(getattr(mc, "model", "model")))
    cache_dtype = str(getattr(vllm_config.cache_config, "cache_dtype", "auto") or "auto")
    if cache_dtype == "auto":
        dt = mc.dtype
        dtype = TORCH_DTYPES.get(dt) if isinstance(dt, torch.dtype) else DType.parse(str(dt))
        if dtype is None:
            raise ValueError(f"model_config.dtype: {dt} has no kvstore KV dtype")
    elif cache_dtype in CACHE_DTYPES:
        dtype = CACHE_DTYPES[cache_dtype]
    else:
        dtype = DType.parse(cache_dtype)
    tp = int(getattr(vllm_config.parallel_config, "tensor_parallel_size", 1) or 1)
    return cfg.gpu_layout(dtype, tp, block_tokens)


def _tp_rank(settings: ConnectorSettings) -> int:
    if settings.tp_rank is not None:
        return int(settings.tp_rank)
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank
        return int(get_tensor_model_parallel_rank())
    except Exception:  # noqa: BLE001 - vLLM absent or its groups not set up: one rank
        return 0


# --- metadata: scheduler -> workers -----------------------------------------------------------

@dataclass(slots=True)
class BlockSpan:
    """kvstore blocks ``[start, end)`` of a request's token ids, and the request's vLLM block
    table (physical block ids of vLLM's ``block_size``-token blocks, from token 0)."""

    req_id: str
    token_ids: list[int]     # the prompt up to block ``end`` (keys are chained from token 0)
    start: int
    end: int
    block_table: list[int]


@dataclass
class KVStoreConnectorMetadata(KVConnectorMetadata):
    loads: list[BlockSpan] = field(default_factory=list)
    saves: list[BlockSpan] = field(default_factory=list)


@dataclass(slots=True)
class _ReqState:
    prompt: list[int]
    block_table: list[int]
    saved_blocks: int = 0  # prompt blocks already handed to a save (or loaded from kvstore)


# --- the connector ----------------------------------------------------------------------------

class KVStoreConnector(KVConnectorBase_V1):
    """vLLM V1 KV connector backed by a kvstore daemon on this node (see module docstring)."""

    def __init__(self, vllm_config, role, kv_cache_config=None) -> None:
        try:
            super().__init__(vllm_config, role, kv_cache_config)
        except TypeError:  # vLLM releases before kv_cache_config was added
            super().__init__(vllm_config, role)
        self.settings = ConnectorSettings.from_vllm(vllm_config)
        s = self.settings
        self.block_size = int(vllm_config.cache_config.block_size)
        self.bt = int(s.block_tokens or self.block_size)
        ktc = vllm_config.kv_transfer_config
        self.can_load = bool(getattr(ktc, "is_kv_consumer", True))
        self.can_save = bool(getattr(ktc, "is_kv_producer", True))
        self.scheduler_side = getattr(role, "name", str(role)).upper().endswith("SCHEDULER")
        rank = 0 if self.scheduler_side else _tp_rank(s)
        self.layout = kv_layout(vllm_config, self.bt)
        self.client = KVStoreClient(s.socket_path)
        self.client.register(self.layout, s.model_id or str(getattr(vllm_config.model_config, "model", "model")),
                             tp_rank=rank, tp_world=max(1, int(getattr(vllm_config.parallel_config,
                                                                       "tensor_parallel_size", 1) or 1)),
                             tenant_salt=s.tenant_salt, prefill_tokens_per_s=float(s.prefill_tokens_per_s),
                             model_params=float(s.model_params))
        # scheduler side
        self._matched: dict[str, tuple[int, int]] = {}   # req_id -> (local tokens, external tokens)
        self._to_load: dict[str, int] = {}               # req_id -> external tokens to load
        self._reqs: dict[str, _ReqState] = {}
        # worker side
        self._layer_names: list[str] = []
        self._layer_index: dict[str, int] = {}
        self._path: GpuKVPath | None = None
        self._loads: list[LoadHandle] = []
        self._saves: list[StoreHandle] = []
        self._load_errors: set[int] = set()

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config) -> str | None:
        """Token-major blocks (``[.., block_size, kv_heads, head_dim]``), as the copies assume."""
        return "NHD"

    # ==== scheduler side =========================================================================
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens beyond ``num_computed_tokens`` to load from kvstore: the leading blocks the
        policy says to load, leaving at least one prompt token to compute. Loads are synchronous
        (inside the next forward), so the second element is always False."""
        if not self.can_load:
            return 0, False
        prompt = list(request.prompt_token_ids or [])
        cap = (len(prompt) - 1) // self.bt
        if cap <= 0 or num_computed_tokens % self.bt:
            return 0, False
        keys = self.client.keys(prompt[:cap * self.bt])
        r = self.client.lookup_keys(keys)
        blocks = min(r.load_blocks if self.settings.follow_policy else r.hit_blocks, r.hit_blocks)
        ext = max(0, blocks * self.bt - num_computed_tokens)
        self._matched[request.request_id] = (num_computed_tokens, ext)
        return ext, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        """Remember a request whose external tokens got blocks; its load goes into the next
        ``build_connector_meta`` (the block ids come from the scheduler output there)."""
        if num_external_tokens > 0:
            self._to_load[request.request_id] = num_external_tokens

    def build_connector_meta(self, scheduler_output) -> KVStoreConnectorMetadata:
        """This step's loads (new requests with external tokens) and saves (prompt blocks that
        are full once this step's tokens are computed). Clears the pending loads."""
        meta = KVStoreConnectorMetadata()
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            prompt = list(new.prompt_token_ids or [])
            st = self._reqs[new.req_id] = _ReqState(prompt, list(new.block_ids[0]))
            ext = self._to_load.pop(new.req_id, 0)
            local, _ = self._matched.pop(new.req_id, (new.num_computed_tokens - ext, ext))
            if ext:
                end = (local + ext) // self.bt
                meta.loads.append(BlockSpan(new.req_id, prompt[:end * self.bt], local // self.bt, end,
                                            st.block_table))
                st.saved_blocks = end
            self._add_save(meta, new.req_id, st, new.num_computed_tokens + scheduled.get(new.req_id, 0))
        cached = scheduler_output.scheduled_cached_reqs
        resumed = set(getattr(cached, "resumed_req_ids", ()) or ())
        flags = getattr(cached, "resumed_from_preemption", None)  # vLLM releases before resumed_req_ids
        if flags is not None:
            resumed |= {rid for rid, r in zip(cached.req_ids, flags) if r}
        for i, req_id in enumerate(cached.req_ids):
            st = self._reqs.get(req_id)
            if st is None:
                continue
            new_ids = cached.new_block_ids[i]
            if new_ids is not None:
                # A request resumed after preemption gets its whole block table anew.
                st.block_table = list(new_ids[0]) if req_id in resumed else st.block_table + list(new_ids[0])
            ext = self._to_load.pop(req_id, 0) if req_id in resumed else 0
            if ext:  # its KV was dropped at preemption; reload the external part
                local, _ = self._matched.pop(req_id, (cached.num_computed_tokens[i] - ext, ext))
                end = (local + ext) // self.bt
                meta.loads.append(BlockSpan(req_id, st.prompt[:end * self.bt], local // self.bt, end,
                                            list(st.block_table)))
                st.saved_blocks = max(st.saved_blocks, end)
            self._add_save(meta, req_id, st, cached.num_computed_tokens[i] + scheduled.get(req_id, 0))
        self._to_load.clear()
        return meta

    def _add_save(self, meta: KVStoreConnectorMetadata, req_id: str, st: _ReqState, done_tokens: int) -> None:
        if not self.can_save:
            return
        full = min(done_tokens, len(st.prompt)) // self.bt
        if full > st.saved_blocks:
            meta.saves.append(BlockSpan(req_id, st.prompt[:full * self.bt], st.saved_blocks, full,
                                        list(st.block_table)))
            st.saved_blocks = full

    def request_finished(self, request, block_ids) -> tuple[bool, dict[str, Any] | None]:
        """Forget the request. Its saves were committed inside their steps, so vLLM may free
        its blocks now (False). With ``transfer_peer`` set, the daemon is asked (without
        waiting) to ship the prompt's committed blocks to that peer; the returned params say so."""
        st = self._reqs.pop(request.request_id, None)
        self._matched.pop(request.request_id, None)
        self._to_load.pop(request.request_id, None)
        peer = self.settings.transfer_peer
        if not peer or st is None or st.saved_blocks == 0:
            return False, None
        keys = self.client.keys(st.prompt[:st.saved_blocks * self.bt])
        req = pb.TransferRequest(session_id=self.client.session_id, keys=pack(keys), peer=peer,
                                 deadline_s=self.settings.save_timeout_s, pipelined=False)
        fut = self.client.stub.Transfer.future(req, timeout=self.settings.save_timeout_s)
        fut.add_done_callback(lambda f: f.exception() and log.warning("transfer to %s failed: %s", peer, f.exception()))
        return False, {"kvstore_transfer_peer": peer, "kvstore_blocks": st.saved_blocks}

    # ==== worker side ============================================================================
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """The engine's per-layer paged caches, in layer order (vLLM's dict order)."""
        self._layer_names = list(kv_caches)
        self._layer_index = {n: i for i, n in enumerate(self._layer_names)}
        if self._path is not None:
            self._path.close()
        self._path = GpuKVPath(self.client, list(kv_caches.values()))

    def _ensure_path(self, forward_context) -> GpuKVPath:
        if self._path is None:
            layers = {name: layer.kv_cache[getattr(forward_context, "virtual_engine", 0)]
                      for name, layer in forward_context.no_compile_layers.items()
                      if getattr(layer, "kv_cache", None) is not None}
            self.register_kv_caches(layers)
        return self._path

    def _rows(self, path: GpuKVPath, span: BlockSpan) -> torch.Tensor:
        bt = self.bt
        return path.paged.token_rows(span.block_table, span.end * bt)[span.start * bt:span.end * bt]

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        """Pin this step's load blocks and issue their copies, layer 0 first; reserve slots for
        this step's saves (so ``save_kv_layer`` only issues copies)."""
        meta = self._get_connector_metadata()
        if not meta.loads and not meta.saves:
            return
        path = self._ensure_path(forward_context)
        for span in meta.loads:
            keys = self.client.keys(span.token_ids)[span.start:span.end]
            try:
                lease = self.client.acquire(keys, allow_partial=True, wait_s=self.settings.load_wait_s)
                got = lease.count
            except KVStoreError as e:
                log.warning("kvstore load of %s failed; vLLM recomputes it: %s", span.req_id, e)
                lease, got = None, 0
            if got < len(keys):
                # Evicted since the Lookup (or the daemon failed): vLLM recomputes these blocks
                # (reported as its block ids, in its block size).
                first_tok, end_tok = (span.start + got) * self.bt, span.end * self.bt
                self._load_errors.update(span.block_table[first_tok // self.block_size:
                                                          -(-end_tok // self.block_size)])
            if got == 0:
                if lease is not None:
                    lease.release()
                continue
            part = BlockSpan(span.req_id, span.token_ids, span.start, span.start + got, span.block_table)
            h = LoadHandle(path, [lease], list(lease.offsets[:got]), path.mover.device_rows(self._rows(path, part)))
            for l in range(self.layout.num_layers):
                h.load_layer(l)
            self._loads.append(h)
        for span in meta.saves:
            keys = self.client.keys(span.token_ids)
            try:
                w = self.client.reserve(keys[span.start:span.end], parent=keys[span.start - 1] if span.start else b"")
            except KVStoreError as e:  # a save is best effort: the blocks stay uncached
                log.warning("kvstore save of %s skipped: %s", span.req_id, e)
                continue
            offsets = [o if s == RESERVED else None for s, o in zip(w.states, w.offsets)]
            self._saves.append(StoreHandle(path, [w], offsets, path.mover.device_rows(self._rows(path, span))))

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Order the compute stream (emulated: this thread) after this layer's load copies."""
        l = self._layer_index.get(layer_name)
        if l is None or not self._loads:
            return
        for h in self._loads:
            h.wait_layer(l, timeout_s=self.settings.load_wait_s)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any) -> None:
        """Issue the copy of this layer of this step's save blocks into their reserved slots,
        after the KV the compute stream wrote so far."""
        l = self._layer_index.get(layer_name)
        if l is None or not self._saves:
            return
        for h in self._saves:
            h.store_layer(l)

    def wait_for_save(self) -> None:
        """Wait for this step's save copies and commit them; release this step's loads."""
        saves, self._saves = self._saves, []
        loads, self._loads = self._loads, []
        try:
            for h in saves:
                h.commit(self.settings.save_timeout_s)
        except (KVStoreError, RuntimeError, TimeoutError) as e:
            log.warning("kvstore save failed (blocks not stored, nothing served from them): %s", e)
            for h in saves:
                h.abort()
        finally:
            for h in loads:
                h.release()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return None, None  # loads and saves finish inside their step

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self) -> None:
        for h in self._saves:
            h.abort()
        for h in self._loads:
            h.release()
        self._saves, self._loads = [], []
        if self._path is not None:
            self._path.close()
            self._path = None
        self.client.close()


__all__ = ["BlockSpan", "ConnectorSettings", "KVStoreConnector", "KVStoreConnectorMetadata", "kv_layout"]
