"""vLLM's KV connector on kvstore: prefix reuse across engine processes, restarts and nodes.

Tested against vLLM 0.32 (``KVConnectorBase_V1``). Enable it in vLLM (see docs/vllm.md)::

    --kv-transfer-config '{"kv_connector": "KVStoreConnector",
                           "kv_connector_module_path": "kvstore.clients.vllm_connector",
                           "kv_role": "kv_both",
                           "kv_connector_extra_config": {"kvstore_socket": "/run/kvstore/kvstore.sock"}}'

Scheduler side (one process): ``get_num_new_matched_tokens`` looks the prompt's block keys up
in the daemon and answers with the tokens the daemon's load-or-recompute policy says to load,
beyond what vLLM's own prefix cache holds; local loads are synchronous (inside the next
forward). In a cluster, when the daemon advises a pull (a peer holds the blocks after the local
hits), the answer is asynchronous (vLLM's ``load_kv_async``): vLLM parks the request, the
workers pull the blocks into this node's daemon off vLLM's threads and load them, and
``get_finished`` reports the request (:mod:`kvstore.clients.vllm_pull`, docs/vllm.md "Pulls").
``build_connector_meta`` turns the step's scheduled requests into load and save work (load: the
external blocks of new or resumed requests; save: prompt blocks that become full in this step,
so chunked prefill saves chunk by chunk). ``request_finished`` forgets the request (and, with
``transfer_peer``, asks the daemon to ship the prompt's blocks to a decode node's daemon).

Worker side (each TP rank): ``register_kv_caches`` maps vLLM 0.32's standardized per-layer
views (:mod:`kvstore.clients.vllm_pages`: every attention backend lays K and V out its own way)
to kvstore's one canonical block layout. ``start_load_kv`` pins the blocks and issues their
copies layer by layer; ``wait_for_layer_load`` waits for one layer. Saves do not depend on the
hook order: the first ``save_kv_layer`` of a step (or else ``wait_for_save``) reserves the
step's slots, each ``save_kv_layer`` copies its layer after the attention wrote it, and
``wait_for_save`` copies what is left, waits and commits. vLLM 0.32 calls ``start_load_kv``
after the forward on steps without loads, so nothing there may be needed by the forward.

Failures never serve wrong KV and never stop vLLM: a block that cannot be loaded (evicted
since the Lookup, daemon gone, copy failed) is reported by ``get_block_ids_with_load_errors``
and vLLM recomputes it (the connector sets vLLM's ``kv_load_failure_policy`` to
``recompute``: a cache miss is not a request failure); saves of a request whose load failed in
the same step are dropped, since their KV was computed from the failed prefix; a save that fails
is aborted (a later miss). A daemon that is gone is retried at most every ``reconnect_s``;
meanwhile the engine runs as if it had no connector.

Keys and block sizes: kvstore keys full blocks of ``block_tokens`` tokens (default: vLLM's
``block_size``); loads start at a kvstore block boundary. The scheduler looks keys up in TP rank
0's namespace; every rank stores the same token blocks in its own namespace.

Not thread-safe; vLLM calls each side from one thread (a pull's calls to the daemon run on the
fetcher's threads, which touch none of the connector's state).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import grpc
import torch
from vllm.distributed.kv_events import MEDIUM_CPU, BlockRemoved, BlockStored, KVCacheEvent
from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1, KVConnectorMetadata,
                                                               KVConnectorRole)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvstore.clients.client import KVStoreError, pack
from kvstore.clients.gpu import GpuKVPath, LoadHandle, StoreHandle
from kvstore.clients.leases import RESERVED, ReadLease
from kvstore.clients.vllm_pages import CPU_BACKEND, check_cpu_pages, layer_pages
from kvstore.clients.vllm_pull import PullFetcher
from kvstore.clients.vllm_setup import (HIT_SOURCES, ConnectorSettings, KVStoreConnectorStats, KVStoreKVEvents,
                                        _Link, _tp_rank, kv_layout)
from kvstore.keys import Namespace, chain_keys
from kvstore.tiers.base import TierKind
from kvstore.v1 import kvstore_pb2 as pb

log = logging.getLogger("kvstore.vllm")

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
    holder: str = ""         # pulls: the peer (node id) the scheduler's Lookup named


@dataclass
class KVStoreConnectorMetadata(KVConnectorMetadata):
    loads: list[BlockSpan] = field(default_factory=list)
    saves: list[BlockSpan] = field(default_factory=list)
    pulls: list[BlockSpan] = field(default_factory=list)  # asynchronous: pulled, then loaded


@dataclass(slots=True)
class _ReqState:
    prompt: list[int]
    block_table: list[int]
    saved_blocks: int = 0  # prompt blocks already handed to a save (or loaded from kvstore)


@dataclass(slots=True)
class _Match:
    local: int     # tokens vLLM's own prefix cache holds
    external: int  # tokens to load from kvstore
    tiers: bytes   # tier of each hit block (kvstore.v1.Tier; TIER_REMOTE: to be pulled)
    holder: str = ""  # a pull: the peer holding the blocks after the local hits


# --- the connector ----------------------------------------------------------------------------

class KVStoreConnector(KVConnectorBase_V1):
    """vLLM V1 KV connector backed by a kvstore daemon on this node (see module docstring)."""

    @property
    def requires_kv_delivery(self) -> bool:
        """A cache: a dropped save is a later miss, so preemption need not wait for one.
        (Transfers to a decode node read committed blocks from the daemon, not vLLM's.)"""
        return False

    def __init__(self, vllm_config, role, kv_cache_config=None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self.settings = s = ConnectorSettings.from_vllm(vllm_config)
        self.block_size = int(vllm_config.cache_config.block_size)
        self.bt = int(s.block_tokens or self.block_size)
        ktc = vllm_config.kv_transfer_config
        self.can_load = bool(ktc.is_kv_consumer)
        self.can_save = bool(ktc.is_kv_producer)
        self.scheduler_side = role == KVConnectorRole.SCHEDULER
        if self.scheduler_side and ktc.kv_load_failure_policy != "recompute":
            # vLLM reads the policy after building the scheduler's connector. For a cache, a
            # block that cannot be loaded is a miss to recompute, not a failed request.
            log.info("kvstore: kv_load_failure_policy %r -> 'recompute' (a block kvstore cannot load is "
                     "recomputed, never served)", ktc.kv_load_failure_policy)
            ktc.kv_load_failure_policy = "recompute"
        self.layout = kv_layout(vllm_config, self.bt)
        self.model_id = s.model_id or str(getattr(vllm_config.model_config, "model", "model"))
        tp_world = max(1, int(getattr(vllm_config.parallel_config, "tensor_parallel_size", 1) or 1))
        rank = 0 if self.scheduler_side else _tp_rank(s)
        self.link = _Link(s, self.layout, self.model_id, rank, tp_world)
        # The scheduler looks keys up in rank 0's namespace; events name blocks by those keys.
        self._root0 = Namespace(self.model_id, self.layout, 0, tp_world, s.tenant_salt).root
        # scheduler side
        self._matched: dict[str, _Match] = {}
        self._to_load: dict[str, int] = {}
        self._to_pull: dict[str, BlockSpan] = {}  # allocated, not yet in a step's metadata
        self._pulled: dict[str, int] = {}         # pulled, not yet scheduled: the span's end block
        self._reqs: dict[str, _ReqState] = {}
        self._events: KVStoreKVEvents | None = None
        # worker side
        self._kv_caches: dict[str, torch.Tensor] = {}
        self._layer_index: dict[str, int] = {}
        self._pages: list = []
        self._path: GpuKVPath | None = None
        self._path_generation = 0
        self._loads: list[tuple[BlockSpan, LoadHandle]] = []
        self._saves: list[tuple[BlockSpan, StoreHandle]] | None = None  # None: not reserved this step
        self._failed_reqs: set[str] = set()
        self._load_errors: set[int] = set()
        # vLLM blocks whose load failed in this step or the one before: with async scheduling
        # the next step is built before vLLM hears of the failure, and another request may have
        # hit those blocks in vLLM's own prefix cache. No save covering one of them is committed.
        self._bad_blocks: set[int] = set()
        self._bad_blocks_before: set[int] = set()
        self._stats = KVStoreConnectorStats()
        self._worker_events: list[KVCacheEvent] = []
        # worker side, pulls: fetching on the fetcher's threads, then copying, then reported
        self._fetcher = PullFetcher(s.pull_timeout_s, s.load_wait_s, s.rpc_timeout_s)
        self._pulling: dict[str, BlockSpan] = {}
        self._pull_loads: list[tuple[BlockSpan, LoadHandle, float]] = []  # and the copies' deadline
        self._recved: set[str] = set()  # pulls ended (loaded or not) since the last get_finished

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config) -> str | None:
        """None: the connector reads every layout vLLM 0.32 allocates (see vllm_pages)."""
        return None

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """True: a full CUDA graph would replay attention without ``wait_for_layer_load``, over
        blocks the side stream may still be writing."""
        return True

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return KVStoreConnectorStats(data=dict(data)) if data is not None else KVStoreConnectorStats()

    # ==== scheduler side =========================================================================
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens beyond ``num_computed_tokens`` to load from kvstore, leaving at least one
        prompt token to compute. Local hits: the leading blocks the policy says to load,
        loaded synchronously (inside the next forward): ``(tokens, False)``. When the daemon
        advises a pull (a peer holds the blocks after the local hits, and fetching them beats
        recomputing them): the local and the remote blocks, ``(tokens, True)``, vLLM's
        asynchronous load: the workers pull and load them while vLLM schedules other requests
        (:mod:`kvstore.clients.vllm_pull`). The Lookup costs no network unless ``ask_peers``."""
        self._matched.pop(request.request_id, None)
        client = self.link.get() if self.can_load else None
        prompt = list(request.prompt_token_ids or [])
        cap = (len(prompt) - 1) // self.bt
        if client is None or cap <= 0 or num_computed_tokens % self.bt:
            return 0, False
        s = self.settings
        try:
            r = client.lookup_keys(client.keys(prompt[:cap * self.bt]), ask_peers=s.ask_peers)
        except KVStoreError as e:
            self.link.lost(e)
            return 0, False
        # A request back here after its pull (a whole miss leaves it nothing computed) is not
        # pulled again: a holder that just missed (stopped, cut off) would miss again until its
        # lease ends, and the request would wait out a deadline each time.
        again = request.request_id in self._pulled
        wanted = r.advice == "pull" or not s.follow_policy
        remote = r.remote_blocks if s.pull and wanted and not again and r.remote_node_id else 0
        ext = (r.hit_blocks + remote) * self.bt - num_computed_tokens
        if remote and ext > 0:
            tiers = bytes(r.tiers[:r.hit_blocks]) + bytes([TierKind.REMOTE]) * remote
            self._matched[request.request_id] = _Match(num_computed_tokens, ext, tiers, r.remote_node_id)
            return ext, True
        blocks = min(r.load_blocks if s.follow_policy else r.hit_blocks, r.hit_blocks)
        ext = max(0, blocks * self.bt - num_computed_tokens)
        if ext:
            self._matched[request.request_id] = _Match(num_computed_tokens, ext, bytes(r.tiers[:blocks]))
        return ext, False

    def get_external_cache_hit_sources(self, request, num_external_tokens: int) -> dict[CacheHitSource, int]:
        """The loaded tokens by the tier that holds them (DRAM/HBM: host, NVMe: disk, a peer)."""
        m = self._matched.get(request.request_id)
        if not num_external_tokens:
            return {}
        if m is None or m.external != num_external_tokens:
            return {CacheHitSource.EXTERNAL_UNSPECIFIED: num_external_tokens}
        out: dict[CacheHitSource, int] = {}
        first = m.local // self.bt
        for tier in m.tiers[first:]:
            src = HIT_SOURCES.get(tier, CacheHitSource.EXTERNAL_UNSPECIFIED)  # IntEnum keys match ints
            out[src] = out.get(src, 0) + self.bt
        return out

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        """Remember a request whose external tokens got blocks; its load goes into the next
        ``build_connector_meta`` (the block ids come from the scheduler output there; a pull's
        from ``blocks``: its request is in no step's output until the pull has ended)."""
        if num_external_tokens <= 0:
            return
        m = self._matched.get(request.request_id)
        if m is not None and m.holder:
            end = (m.local + num_external_tokens) // self.bt
            self._to_pull[request.request_id] = BlockSpan(
                request.request_id, list(request.prompt_token_ids or [])[:end * self.bt], m.local // self.bt, end,
                list(blocks.get_block_ids()[0]), m.holder)
        else:
            self._to_load[request.request_id] = num_external_tokens

    def build_connector_meta(self, scheduler_output) -> KVStoreConnectorMetadata:
        """This step's loads (new and resumed requests with external tokens), pulls (requests
        waiting for remote KV since this step) and saves (prompt blocks that are full once this
        step's tokens are computed). Clears the pending loads and pulls."""
        meta = KVStoreConnectorMetadata()
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            st = self._reqs[new.req_id] = _ReqState(list(new.prompt_token_ids or []), list(new.block_ids[0]))
            pulled = self._pulled.pop(new.req_id, None)
            if pulled is not None:  # what the pull loaded is in kvstore; what vLLM recomputes is not
                st.saved_blocks = min(pulled, new.num_computed_tokens // self.bt)
            self._add_load(meta, new.req_id, st, new.num_computed_tokens)
            self._add_save(meta, new.req_id, st, new.num_computed_tokens + scheduled.get(new.req_id, 0))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            st = self._reqs.get(req_id)
            if st is None:
                continue
            new_ids = cached.new_block_ids[i]
            resumed = req_id in cached.resumed_req_ids
            if new_ids is not None:
                # A request resumed after preemption gets its whole block table anew.
                st.block_table = list(new_ids[0]) if resumed else st.block_table + list(new_ids[0])
            if resumed:  # its KV was dropped at preemption; reload the external part
                self._pulled.pop(req_id, None)  # (or a pull did, and saved_blocks already covers it)
                self._add_load(meta, req_id, st, cached.num_computed_tokens[i])
            self._add_save(meta, req_id, st, cached.num_computed_tokens[i] + scheduled.get(req_id, 0))
        for req_id, span in self._to_pull.items():
            self._matched.pop(req_id, None)
            meta.pulls.append(span)
            self._pulled[req_id] = span.end
        self._to_load.clear()
        self._to_pull.clear()
        return meta

    def _add_load(self, meta: KVStoreConnectorMetadata, req_id: str, st: _ReqState, computed: int) -> None:
        ext = self._to_load.pop(req_id, 0)
        m = self._matched.pop(req_id, None)
        if not ext:
            return
        local = m.local if m is not None and m.external == ext else computed - ext
        end = (local + ext) // self.bt
        meta.loads.append(BlockSpan(req_id, st.prompt[:end * self.bt], local // self.bt, end, list(st.block_table)))
        st.saved_blocks = max(st.saved_blocks, end)

    def _add_save(self, meta: KVStoreConnectorMetadata, req_id: str, st: _ReqState, done_tokens: int) -> None:
        if not self.can_save:
            return
        full = min(done_tokens, len(st.prompt)) // self.bt
        if full > st.saved_blocks:
            meta.saves.append(BlockSpan(req_id, st.prompt[:full * self.bt], st.saved_blocks, full,
                                        list(st.block_table)))
            st.saved_blocks = full

    def update_connector_output(self, connector_output) -> None:
        """Collect the workers' KV cache events for ``take_events``."""
        ev = connector_output.kv_cache_events
        if not isinstance(ev, KVStoreKVEvents):
            return
        if self._events is None:
            self._events = ev
        else:
            self._events.add_events(ev.get_all_events())
            self._events.increment_workers(ev.get_number_of_workers())

    def take_events(self) -> Iterable[KVCacheEvent]:
        """Blocks stored into kvstore (``BlockStored``, medium ``CPU``) and blocks a load found
        gone (``BlockRemoved``) since the last call, named by their kvstore keys."""
        if self._events is None:
            return
        events, self._events = self._events, None
        yield from events.aggregate().get_all_events()

    def request_finished(self, request, block_ids) -> tuple[bool, dict[str, Any] | None]:
        """Forget the request. Its saves were committed inside their steps, so vLLM may free
        its blocks now (False). With ``transfer_peer`` set, the daemon is asked (without
        waiting) to ship the prompt's committed blocks to that peer; the returned params say so."""
        st = self._reqs.pop(request.request_id, None)
        for pending in (self._matched, self._to_load, self._to_pull, self._pulled):
            pending.pop(request.request_id, None)
        peer = self.settings.transfer_peer
        client = self.link.get() if peer and st is not None and st.saved_blocks else None
        if client is None:
            return False, None
        keys = client.keys(st.prompt[:st.saved_blocks * self.bt])
        req = pb.TransferRequest(session_id=client.session_id, keys=pack(keys), peer=peer,
                                 deadline_s=self.settings.save_timeout_s, pipelined=False)
        fut = client.stub.Transfer.future(req, timeout=self.settings.save_timeout_s)
        fut.add_done_callback(lambda f: f.exception() and log.warning("transfer to %s failed: %s", peer, f.exception()))
        return False, {"kvstore_transfer_peer": peer, "kvstore_blocks": st.saved_blocks}

    # ==== worker side ============================================================================
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """vLLM's per-layer cache views, in layer order; mapped to canonical pages here so an
        unsupported backend fails at start-up with a clear error, not at the first save."""
        from vllm.config import get_layers_from_vllm_config
        from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

        names = list(kv_caches)
        if len(names) != self.layout.num_layers:
            raise ValueError(f"kvstore: vLLM registered {len(names)} KV cache layers; the model's layout has "
                             f"{self.layout.num_layers} (hybrid models with several cache groups are not supported)")
        layers = get_layers_from_vllm_config(self._vllm_config, AttentionLayerBase, names)
        num_blocks = int(self._kv_cache_config.num_blocks)
        pages = []
        for name in names:
            layer = layers.get(name)
            backend = layer.get_attn_backend().get_name() if layer is not None else "unknown"
            p = layer_pages(name, kv_caches[name], self.layout, backend, num_blocks)
            if backend == CPU_BACKEND and not pages:
                check_cpu_pages(kv_caches[name], getattr(layer, "isa", None) or _cpu_isa(self, kv_caches[name]),
                                self._vllm_config.model_config.dtype,
                                str(self._vllm_config.cache_config.cache_dtype or "auto"))
            pages.append(p)
        self._kv_caches, self._pages = dict(kv_caches), pages
        self._layer_index = {n: i for i, n in enumerate(names)}
        self._ensure_path()

    def _ensure_path(self) -> GpuKVPath | None:
        """The copy path over the current session's arena (re-made after a reconnect)."""
        client = self.link.get()
        if client is None or not self._pages:
            return None
        if self._path is None or self._path_generation != self.link.generation or self._path.arena is not client.arena:
            if self._path is not None:
                self._path.close()
            self._path = GpuKVPath(client, self._pages, copy_path=self.settings.copy_path)
            self._path_generation = self.link.generation
        return self._path

    def _rows(self, path: GpuKVPath, span: BlockSpan) -> torch.Tensor:
        bt = self.bt
        return path.paged.token_rows(span.block_table, span.end * bt)[span.start * bt:span.end * bt]

    def _vllm_blocks(self, span: BlockSpan, first_block: int) -> set[int]:
        """vLLM block ids holding kvstore blocks ``[first_block, span.end)`` of ``span``."""
        lo, hi = first_block * self.bt, span.end * self.bt
        return set(span.block_table[lo // self.block_size: -(-hi // self.block_size)])

    def _event_keys(self, span: BlockSpan) -> list[bytes]:
        return chain_keys(self._root0, span.token_ids, self.bt)[span.start:span.end]

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        """Pin this step's load blocks and issue their copies, layer 0 first. Blocks that
        cannot be pinned are load errors (vLLM recomputes them). Then the pulls: this step's
        start on the fetcher's threads; those fetched since the last step have their copies
        issued, behind this step's loads on the copy stream (the forward waits for those only;
        on steps without synchronous loads vLLM calls this after the forward)."""
        meta = self._get_connector_metadata()
        path = self._ensure_path() if meta.loads else None
        for span in meta.loads:
            got = 0
            try:
                if path is None:
                    raise KVStoreError(grpc.StatusCode.UNAVAILABLE, "kvstore daemon not reachable")
                h = self._start_load(path, span)
                got = h.blocks if h is not None else 0
                if h is not None:
                    self._loads.append((span, h))
            except Exception as e:  # noqa: BLE001 - whatever failed, vLLM recomputes; never fail its step
                log.warning("kvstore load of %s failed; vLLM recomputes it: %s", span.req_id, e)
                if isinstance(e, KVStoreError):
                    self.link.lost(e)
            if got < span.end - span.start:
                # Evicted since the Lookup (or the daemon failed): vLLM recomputes these blocks.
                self._fail_load(span, span.start + got, removed=True)
        if meta.pulls or self._pulling:
            self._advance_pulls(meta.pulls)

    def _start_load(self, path: GpuKVPath, span: BlockSpan) -> LoadHandle | None:
        """Pin the span's blocks (as many leading ones as are still there) and issue every
        layer's copy; None when none is left."""
        client = path.client
        keys = client.keys(span.token_ids)[span.start:span.end]
        return self._load_pinned(path, span, client.acquire(keys, allow_partial=True, wait_s=self.settings.load_wait_s))

    def _load_pinned(self, path: GpuKVPath, span: BlockSpan, lease: ReadLease) -> LoadHandle | None:
        """Issue every layer's copy of the span's leading blocks that ``lease`` pins; None
        (the lease ended) when it pins none."""
        path.check_arena([lease])  # the client re-registered with a restarted daemon: offsets are not ours
        if lease.count == 0:
            lease.release()
            return None
        part = BlockSpan(span.req_id, span.token_ids, span.start, span.start + lease.count, span.block_table)
        try:
            h = LoadHandle(path, [lease], list(lease.offsets[:lease.count]),
                           path.mover.device_rows(self._rows(path, part)))
        except BaseException:
            lease.release()
            raise
        try:
            self._issue_load(path, h)
        except BaseException:
            _quietly(h.release)
            raise
        return h

    @staticmethod
    def _issue_load(path: GpuKVPath, h: LoadHandle) -> None:
        if path.emulated:
            # CPU caches: a copy thread per layer only competes with the forward for the cores
            # (and the GIL); one bulk copy before the forward costs less than it could hide.
            h.load_all()
        else:
            for l in range(h.path.layout.num_layers):  # layer l+1 crosses the bus while layer l computes
                h.load_layer(l)

    def _fail_load(self, span: BlockSpan, first_block: int, removed: bool = False) -> None:
        bad = self._vllm_blocks(span, first_block)
        self._load_errors |= bad
        self._bad_blocks |= bad
        self._failed_reqs.add(span.req_id)
        self._stats.data["load_failed_blocks"] += span.end - first_block
        if removed:
            self._worker_events.append(BlockRemoved(block_hashes=self._event_keys(span)[first_block - span.start:],
                                                    medium=MEDIUM_CPU))

    # --- pulls (vLLM's asynchronous load) ----------------------------------------------------
    def _advance_pulls(self, new: list[BlockSpan]) -> None:
        """Start ``new``'s pulls; issue the copies of the pulls fetched since the last step.
        Nothing here waits for a daemon or a peer."""
        path = self._ensure_path()
        for span in new:
            self._pulling[span.req_id] = span
            if path is None:
                self._end_pull(span, span.start, "kvstore daemon not reachable")
                continue
            self._fetcher.submit(span.req_id, path.client, path.client.keys(span.token_ids), span.start, span.holder)
        for f in self._fetcher.done():
            span = self._pulling[f.req_id]
            self._stats.data["pulled_blocks"] += f.pulled
            h, why = None, f.detail
            if f.lease is not None and (path is None or f.client is not path.client):
                _quietly(f.lease.release)  # the session was lost meanwhile: its offsets are not this path's
                why = "the session with the daemon ended during the pull"
            elif f.lease is not None:
                try:
                    h = self._load_pinned(path, span, f.lease)
                except Exception as e:  # noqa: BLE001 - whatever failed, vLLM recomputes; never fail its step
                    why = f"{why}; {e}" if why else str(e)
                    if isinstance(e, KVStoreError):
                        self.link.lost(e)
            if h is None:
                self._end_pull(span, span.start, why)
                continue
            if h.blocks < span.end - span.start:
                self._end_pull(span, span.start + h.blocks, why, done=False)
            self._pull_loads.append((span, h, time.monotonic() + self.settings.load_wait_s))

    def _end_pull(self, span: BlockSpan, first_block: int, why: str, done: bool = True) -> None:
        """Blocks ``[first_block, span.end)`` of a pulled span did not load: load errors, so
        vLLM recomputes them (reported in the pass the request is, or before). ``done``: the
        request's pull is over (reported finished at the next ``get_finished``)."""
        if first_block < span.end:
            log.warning("kvstore pull of %s: blocks %d-%d not loaded, vLLM recomputes them: %s", span.req_id,
                        first_block, span.end - 1, why or "not here")
            self._load_errors |= self._vllm_blocks(span, first_block)
            self._stats.data["pull_failed_blocks"] += span.end - first_block
        if done:
            self._recved.add(span.req_id)
            self._pulling.pop(span.req_id, None)

    def _land_pulls(self) -> None:
        """Pulled spans whose copies have landed (or failed, or passed ``load_wait_s``) end."""
        now, left = time.monotonic(), []
        for span, h, deadline in self._pull_loads:
            try:
                landed, why = h.wait(0), f"copies not done within {self.settings.load_wait_s} s"
            except Exception as e:  # noqa: BLE001 - a failed copy is a load error
                landed, why = None, f"copy failed: {e}"
            if landed is False and now < deadline:
                left.append((span, h, deadline))
                continue
            _quietly(h.release)
            if landed:
                self._stats.data["loaded_blocks"] += h.blocks
                self._end_pull(span, span.end, "")
            else:
                self._end_pull(span, span.start, why)
        self._pull_loads = left

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Wait (at most ``load_wait_s``) for this layer's load copies; on a GPU, order the
        compute stream after them. A copy that failed or timed out turns its request's blocks
        into load errors: vLLM discards the step's output for it and recomputes."""
        l = self._layer_index.get(layer_name)
        if l is None or not self._loads:
            return
        t0 = time.perf_counter()
        for span, h in list(self._loads):
            if span.req_id in self._failed_reqs:
                continue
            try:
                h.wait_layer(l, timeout_s=self.settings.load_wait_s)
            except Exception as e:  # noqa: BLE001 - a failed copy is a load error, not a failed step
                log.warning("kvstore load of %s failed at layer %d; vLLM recomputes it: %s", span.req_id, l, e)
                self._fail_load(span, span.start)
        self._stats.data["load_s"] += time.perf_counter() - t0

    def _begin_saves(self) -> list[tuple[BlockSpan, StoreHandle]]:
        """Reserve slots for this step's saves, once per step, whichever hook comes first."""
        if self._saves is not None:
            return self._saves
        self._saves = []
        meta = self._get_connector_metadata() if self.has_connector_metadata() else None
        path = self._ensure_path() if meta is not None and meta.saves else None
        for span in (meta.saves if path is not None else ()):
            keys = path.client.keys(span.token_ids)
            try:
                w = path.client.reserve(keys[span.start:span.end], parent=keys[span.start - 1] if span.start else b"",
                                        token_ids=span.token_ids[span.start * self.bt:span.end * self.bt])
            except Exception as e:  # noqa: BLE001 - a save is best effort: the blocks stay uncached
                log.warning("kvstore save of %s skipped: %s", span.req_id, e)
                if isinstance(e, KVStoreError):
                    self.link.lost(e)
                self._stats.data["save_failed_blocks"] += span.end - span.start
                if self.link.client is None:
                    break
                continue
            try:
                path.check_arena([w])
            except KVStoreError as e:
                log.warning("kvstore save of %s skipped: %s", span.req_id, e)
                break
            offsets = [o if st == RESERVED else None for st, o in zip(w.states, w.offsets)]
            self._saves.append((span, StoreHandle(path, [w], offsets, path.mover.device_rows(self._rows(path, span)))))
        return self._saves

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any) -> None:
        """Issue the copy of this layer of this step's save blocks into their reserved slots,
        after the KV the compute stream wrote so far."""
        l = self._layer_index.get(layer_name)
        if l is None:
            return
        for span, h in self._begin_saves():
            if span.req_id not in self._failed_reqs:
                h.store_layer(l)

    def wait_for_save(self) -> None:
        """Copy the layers no ``save_kv_layer`` copied, wait and commit; release the loads."""
        t0 = time.perf_counter()
        saves = self._begin_saves() if self.has_connector_metadata() else (self._saves or [])
        loads, self._loads, self._saves = self._loads, [], None
        failed, self._failed_reqs = self._failed_reqs, set()
        stored: list[KVCacheEvent] = []
        try:
            bad = self._bad_blocks | self._bad_blocks_before
            for span, h in saves:
                if span.req_id in failed or bad & self._vllm_blocks(span, 0):
                    _quietly(h.abort)  # computed from (or over) a prefix that failed to load
                    self._stats.data["save_failed_blocks"] += span.end - span.start
                    continue
                try:
                    h.store_all()
                    n = h.commit(self.settings.save_timeout_s)
                except Exception as e:  # noqa: BLE001 - a save is best effort; never fail vLLM's step
                    log.warning("kvstore save of %s failed (blocks not stored): %s", span.req_id, e)
                    _quietly(h.abort)
                    self._stats.data["save_failed_blocks"] += span.end - span.start
                    if isinstance(e, KVStoreError):
                        self.link.lost(e)
                    continue
                self._stats.data["saved_blocks"] += n
                stored.append(self._stored_event(span))
        finally:
            for span, h in loads:
                if span.req_id not in failed:
                    self._stats.data["loaded_blocks"] += h.blocks
                try:
                    h.release()
                except Exception as e:  # noqa: BLE001 - the lease TTL reclaims the pins
                    log.warning("kvstore release after the load of %s failed: %s", span.req_id, e)
            self._bad_blocks_before, self._bad_blocks = self._bad_blocks, set()
            self.link.retire()
        self._worker_events += stored
        if saves:
            self._stats.data["save_s"] += time.perf_counter() - t0

    def _stored_event(self, span: BlockSpan) -> BlockStored:
        keys = self._event_keys(span)
        return BlockStored(block_hashes=keys, parent_block_hash=self._event_keys(
            BlockSpan(span.req_id, span.token_ids, span.start - 1, span.start, []))[0] if span.start else None,
            token_ids=span.token_ids[span.start * self.bt:span.end * self.bt], block_size=self.bt,
            lora_id=None, medium=MEDIUM_CPU, lora_name=None)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """The requests whose pull ended since the last call (vLLM schedules them now): loaded,
        or with the blocks that did not load among this pass's load errors. Synchronous loads
        and saves finish inside their step."""
        if self._pull_loads:
            self._land_pulls()
        done, self._recved = self._recved, set()
        return None, done or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if self._stats.is_empty():
            return None
        stats, self._stats = self._stats, KVStoreConnectorStats()
        return stats

    def get_kv_connector_kv_cache_events(self) -> KVStoreKVEvents | None:
        if not self._worker_events:
            return None
        ev = KVStoreKVEvents(num_workers=1)
        ev.add_events(self._worker_events)
        self._worker_events = []
        return ev

    def shutdown(self) -> None:
        self._fetcher.close()
        for _, h in self._saves or ():
            _quietly(h.abort)
        for _, h in [*self._loads, *((span, h) for span, h, _ in self._pull_loads)]:
            _quietly(h.release)
        self._saves, self._loads, self._pull_loads = None, [], []
        if self._path is not None:
            _quietly(self._path.close)
            self._path = None
        self.link.close()


def _quietly(fn) -> None:
    """Run a clean-up step whose failure must not stop the next (the lease TTL is the backstop)."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001
        log.warning("kvstore clean-up failed: %s", e)


def _cpu_isa(connector: KVStoreConnector, view: torch.Tensor) -> str:
    """The ISA vLLM's CPU backend picks for this cache (the layer did not say)."""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    return _get_attn_isa(connector._vllm_config.model_config.dtype, int(view.shape[2]), connector.layout.head_dim,
                         str(connector._vllm_config.cache_config.cache_dtype or "auto"))


__all__ = ["BlockSpan", "ConnectorSettings", "KVStoreConnector", "KVStoreConnectorMetadata",
           "KVStoreConnectorStats", "kv_layout"]
