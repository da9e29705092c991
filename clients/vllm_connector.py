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
``block_size``); loads start at a kvstore block boundary. Every TP size stores under TP=1's
namespace, so engines of any TP size share prefixes: a block holds every KV head of its tokens,
each rank writes its heads as one part of it (the daemon shows the block once every part is
committed) and reads its heads of it (:class:`~kvstore.layout.HeadShard`; with fewer KV heads
than ranks, the first rank of each head writes it). MLA's latent, which every rank holds whole,
is written by rank 0 and read by all.
Models of several KV cache groups (vLLM's hybrid KV cache manager): :mod:`kvstore.clients.vllm_hybrid`.

The two sides live in their own modules: :class:`~kvstore.clients.vllm_scheduler.ConnectorScheduler`
and :class:`~kvstore.clients.vllm_worker.ConnectorWorker`; this class builds the one its role
needs and hands vLLM's calls to it (the split vLLM's own connectors use). Not thread-safe;
vLLM calls each side from one thread (a pull's calls to the daemon run on the fetcher's
threads, which touch none of the connector's state).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import torch
from vllm.distributed.kv_events import KVCacheEvent
from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1, KVConnectorRole,
                                                              KVConnectorTransferResults, SupportsHMA)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvstore.clients.vllm_hybrid import HybridScheduler, HybridWorker, IdleWorker, Refused, ReuseOff, hybrid_sides
from kvstore.clients.vllm_scheduler import BlockSpan, ConnectorScheduler, KVStoreConnectorMetadata
from kvstore.clients.vllm_setup import (ConnectorSettings, KVStoreConnectorStats, KVStoreKVEvents, Link,
                                        check_on_import, join_vllm_logging, kv_layout, tp_rank)
from kvstore.clients.vllm_worker import ConnectorWorker
from kvstore.keys import Namespace
from kvstore.layout import AttnKind, HeadShard, KVLayout

log = logging.getLogger("kvstore.vllm")

# vLLM's first process imports this module while it checks its config, long before a model
# loads: the config is checked (and the daemon reached) now, so a typo fails the start at once.
check_on_import(__name__)


class KVStoreConnector(KVConnectorBase_V1, SupportsHMA):
    """vLLM V1 KV connector backed by a kvstore daemon on this node (see module docstring).
    A subclass may name its own sides (``scheduler_class``, ``worker_class``,
    ``hybrid_worker_class``). Models of
    several KV cache groups (vLLM's hybrid KV cache manager stays on) run on
    :mod:`kvstore.clients.vllm_hybrid`'s sides instead."""

    scheduler_class = ConnectorScheduler
    worker_class = ConnectorWorker
    hybrid_worker_class = HybridWorker  # the worker side for several KV cache groups

    @property
    def requires_kv_delivery(self) -> bool:
        """A cache: a dropped save is a later miss, so preemption need not wait for one.
        (Transfers to a decode node read committed blocks from the daemon, not vLLM's.)"""
        return False

    def __init__(self, vllm_config, role, kv_cache_config=None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        join_vllm_logging()
        self.settings = s = ConnectorSettings.from_vllm(vllm_config)
        block_size = int(vllm_config.cache_config.block_size)
        bt = int(s.block_tokens or block_size)
        ktc = vllm_config.kv_transfer_config
        scheduler_side = role == KVConnectorRole.SCHEDULER
        if scheduler_side and ktc.kv_load_failure_policy != "recompute":
            # vLLM reads the policy after building the scheduler's connector. For a cache, a
            # block that cannot be loaded is a miss to recompute, not a failed request.
            log.info("kvstore: kv_load_failure_policy %r -> 'recompute' (a block kvstore cannot load is "
                     "recomputed, never served)", ktc.kv_load_failure_policy)
            ktc.kv_load_failure_policy = "recompute"
        self.layout = kv_layout(vllm_config, bt)
        model_id = s.model_id or str(getattr(vllm_config.model_config, "model", "model"))
        tp_world = max(1, int(getattr(vllm_config.parallel_config, "tensor_parallel_size", 1) or 1))
        rank = 0 if scheduler_side else tp_rank(s)
        self.writes, shard, store_layout = True, None, self.layout
        hybrid = kv_cache_config is not None and len(kv_cache_config.kv_cache_groups) > 1
        if self.layout.kind is AttnKind.MLA:
            # The latent is the same on every rank: one copy, under TP=1's namespace, written by
            # rank 0 and read by all (so engines of every TP size share it).
            rank, tp_world, self.writes = 0, 1, rank == 0
        elif tp_world > 1:
            # Blocks of every KV head, under TP=1's namespace: each rank writes its heads as one
            # part of the block (the daemon shows it once all are in) and reads its heads of it,
            # so engines of every TP size share prefixes.
            store_layout = kv_layout(vllm_config, bt, all_heads=True)
            shard = HeadShard.of_rank(store_layout.num_kv_heads, rank, tp_world)
        self._scheduler: ConnectorScheduler | None = None
        self._worker: ConnectorWorker | HybridWorker | IdleWorker | None = None
        if hybrid:  # rank and size go on: a state kvstore cannot split keeps a namespace per rank
            self._init_hybrid(vllm_config, kv_cache_config, model_id, rank, tp_world, bt, scheduler_side,
                              store_layout, shard)
            return
        if shard is not None:
            rank, tp_world, self.writes = 0, 1, shard.writes
        self.link = Link(s, store_layout, model_id, rank, tp_world, map_arena=not scheduler_side,
                         shard=None if scheduler_side else shard)
        self.links = [self.link]
        if scheduler_side:
            can_load = bool(ktc.is_kv_consumer) and not _prefill_ignores_context(vllm_config, model_id)
            # One worker (TP and PP of 1) copies what the scheduler loads: its Lookups pin DRAM hits.
            one_worker = int(getattr(vllm_config.parallel_config, "world_size", 1) or 1) == 1
            self._scheduler = self.scheduler_class(s, self.link, bt, can_load, bool(ktc.is_kv_producer),
                                                   pin=one_worker)
        else:
            # The scheduler looks keys up in rank 0's namespace; events name blocks by those keys.
            root0 = Namespace(model_id, store_layout, 0, tp_world, s.tenant_salt, s.kv_codec).root
            self._worker = self.worker_class(vllm_config, kv_cache_config, s, self.link, self.layout, bt, block_size,
                                             root0, writes=self.writes)

    def _init_hybrid(self, vllm_config, kv_cache_config, model_id: str, rank: int, tp_world: int, bt: int,
                     scheduler_side: bool, store_layout: KVLayout, shard: HeadShard | None) -> None:
        """Sides for several KV cache groups, one session each; a model kvstore cannot restore
        exactly runs as plain vLLM, said once at start-up (by the scheduler's connector)."""
        s, ktc = self.settings, vllm_config.kv_transfer_config
        try:
            groups, self.links, layouts, roots = hybrid_sides(vllm_config, kv_cache_config, s, self.layout,
                                                              model_id, rank, tp_world, not scheduler_side,
                                                              store_layout, shard)
        except Refused as e:
            if scheduler_side:
                log.warning("kvstore: prefix reuse is off for %s: %s; the engine runs as plain vLLM (no lookups, "
                            "no saves)", model_id, e)
            self.links, self.link = [], None
            self._scheduler = ReuseOff(s, None, bt, False, False) if scheduler_side else None
            self._worker = None if scheduler_side else IdleWorker()
            return
        self.link = self.links[0]
        if scheduler_side:
            self._scheduler = HybridScheduler(s, groups, self.links, bt, bool(ktc.is_kv_consumer),
                                              bool(ktc.is_kv_producer))
        else:
            self._worker = self.hybrid_worker_class(vllm_config, kv_cache_config, s, groups, self.links, layouts, bt, roots)

    @property
    def scheduler(self) -> ConnectorScheduler:
        if self._scheduler is None:
            raise RuntimeError("kvstore: a scheduler-side call on a worker's connector")
        return self._scheduler

    @property
    def worker(self) -> ConnectorWorker:
        if self._worker is None:
            raise RuntimeError("kvstore: a worker-side call on the scheduler's connector")
        return self._worker

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config) -> str | None:
        """None: the connector reads every layout vLLM 0.32 allocates (see vllm_pages)."""
        return None

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """True: a full CUDA graph would replay attention without ``wait_for_layer_load``, over
        blocks the side stream may still be writing. vLLM asks this in the first process, while
        it checks its config (where full CUDA graphs are on: GPUs), long before a model loads:
        ``kv_connector_extra_config`` is checked here too (as on this module's import by that
        check), so a typo fails the start at once."""
        ConnectorSettings.from_extra(extra_config)
        return True

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return KVStoreConnectorStats(data=dict(data)) if data is not None else KVStoreConnectorStats()

    # ==== scheduler side: ConnectorScheduler ======================================================
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def get_external_cache_hit_sources(self, request, num_external_tokens: int) -> dict[CacheHitSource, int]:
        return self.scheduler.get_external_cache_hit_sources(request, num_external_tokens)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        self.scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output) -> KVStoreConnectorMetadata:
        return self.scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output) -> None:
        self.scheduler.update_connector_output(connector_output)

    def take_events(self) -> Iterable[KVCacheEvent]:
        return self.scheduler.take_events()

    def request_finished(self, request, block_ids) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler.request_finished(request, block_ids)

    def request_finished_all_groups(self, request, block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        """vLLM's hybrid KV cache manager: every group's blocks (saves are committed inside
        their steps, so none of them is held)."""
        return self.scheduler.request_finished(request, block_ids[0] if block_ids else [])

    # ==== worker side: ConnectorWorker ============================================================
    def _step_meta(self) -> KVStoreConnectorMetadata | None:
        return self._get_connector_metadata() if self.has_connector_metadata() else None

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.worker.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        self.worker.start_load_kv(self._get_connector_metadata())

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.worker.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any) -> None:
        self.worker.save_kv_layer(layer_name, self._step_meta())

    def wait_for_save(self) -> None:
        self.worker.wait_for_save(self._step_meta())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self.worker.get_finished(finished_req_ids)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        w = self.worker
        if isinstance(w, ConnectorWorker):
            return super().get_transfer_results(finished_req_ids)
        return w.get_transfer_results(finished_req_ids)  # several groups: failures by request

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.get_block_ids_with_load_errors()

    def get_kv_connector_kv_cache_events(self) -> KVStoreKVEvents | None:
        return self.worker.get_kv_connector_kv_cache_events()

    # ==== both ====================================================================================
    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """The workers' load and save counts since the last call (the scheduler has none)."""
        return self._worker.get_kv_connector_stats() if self._worker is not None else None

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
        for link in self.links:
            link.close()


def _prefill_ignores_context(vllm_config, model_id: str) -> bool:
    """True where the engine's prefill cannot attend to a prefix it did not compute in the same
    pass: vLLM's CPU MLA (without AMX) runs prefill over the new tokens alone, which is why vLLM
    turns its own prefix caching and chunked prefill off there. A loaded prefix would be
    ignored and the output wrong, so the connector loads nothing there (it still stores the
    engine's blocks for engines that can load them), and says so once."""
    from vllm.platforms import current_platform

    mc = vllm_config.model_config
    if not (getattr(mc, "use_mla", False) and current_platform.is_cpu()
            and not vllm_config.cache_config.enable_prefix_caching):
        return False
    log.warning("kvstore: %s: vLLM's CPU MLA prefill does not attend to a cached prefix (vLLM turned its "
                "own prefix caching off for it); kvstore stores this engine's blocks and loads none here", model_id)
    return True


__all__ = ["BlockSpan", "ConnectorScheduler", "ConnectorSettings", "ConnectorWorker", "KVStoreConnector",
           "KVStoreConnectorMetadata", "KVStoreConnectorStats", "kv_layout"]
