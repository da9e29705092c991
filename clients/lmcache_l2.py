"""kvstore as an LMCache L2 adapter (``L2AdapterInterface``), loaded by LMCache's ``plugin`` type:

    {"type": "plugin", "module_path": "kvstore.clients.lmcache_l2", "class_name": "KVStoreL2Adapter",
     "adapter_params": {"socket_path": "/run/kvstore/kvstore.sock"}}

LMCache's store and prefetch controllers submit tasks and wait on three eventfds; two worker
threads here run them against the daemon, one for stores and one for lookups, loads and unlocks
(so a large store never delays a prefetch), each with its own daemon sessions.

- Store: a task succeeds only if every object was committed; a failed one leaves nothing visible
  (see :mod:`kvstore.clients.engine_store`).
- Lookup-and-lock pins the leading hits of each object group with a kvstore read lease; the lease
  is held until LMCache unlocks every key of it (after its load, or when its plan drops them) and
  renewed meanwhile, so a locked object cannot be evicted. A load pins again for its copy, so
  even an object whose lock had lapsed is a miss rather than another object's bytes.
- An object is stored as LMCache wrote it (its own format); its namespace names that format
  (shapes and dtypes), the model, the KV rank, the object group and both salts (the adapter's
  ``tenant_salt`` and the key's ``cache_salt``), so objects of different shape or tenant never
  meet. LMCache's keys are its own chunk hashes, so these blocks are LMCache's alone.
"""

from __future__ import annotations

import hashlib
import logging
import queue
import threading
import time
from collections import OrderedDict, defaultdict
from typing import Callable

import numpy as np

from lmcache.lmcache_native import Bitmap
from lmcache.v1.distributed.internal_api import L2StoreResult
from lmcache.v1.distributed.l2_adapters.base import L2AdapterInterface, L2TaskId
from lmcache.v1.distributed.l2_adapters.config import L2AdapterConfigBase
from lmcache.v1.platform import create_event_notifier

from kvstore.clients.engine_store import DaemonTarget, EngineStore, failed
from kvstore.layout import AttnKind, DType, KVLayout

log = logging.getLogger("kvstore.lmcache")


class KVStoreL2AdapterConfig(L2AdapterConfigBase):
    """``adapter_params``: socket_path, timeout_s, load_wait_s, tenant_salt or tenant_salt_file
    (:class:`kvstore.clients.engine_store.DaemonTarget`)."""

    def __init__(self, target: DaemonTarget) -> None:
        self.target = target

    @classmethod
    def from_dict(cls, d: dict) -> "KVStoreL2AdapterConfig":
        return cls(DaemonTarget.from_params(d, "kvstore adapter_params"))

    @classmethod
    def help(cls) -> str:
        return ("kvstore L2 adapter (plugin) adapter_params:\n- socket_path (str): the daemon's unix socket\n"
                "- timeout_s (float): deadline of every daemon call, seconds (default 5)\n"
                "- load_wait_s (float): longest wait for blocks promoted from NVMe, seconds (default 1)\n"
                "- tenant_salt_file (str): a 0600 file holding this tenant's salt (or tenant_salt)")


def _signature(shapes, dtypes) -> tuple[str, int]:
    """(the object format's name, its size in bytes), from an object's or a group's shapes."""
    parts, nbytes = [], 0
    for shape, dtype in zip(shapes, dtypes, strict=True):
        dims = [int(x) for x in shape]
        n = int(np.prod(dims)) * dtype.itemsize
        parts.append(f"{str(dtype).removeprefix('torch.')}{dims}".replace(" ", ""))
        nbytes += n
    return "+".join(parts), nbytes


def opaque_layout(nbytes: int) -> KVLayout:
    """The namespace layout of objects of ``nbytes`` bytes kept as LMCache wrote them: one
    "layer" of one row (the format itself is named in the namespace's model id)."""
    return KVLayout(1, dtype=DType.INT8, kind=AttnKind.MLA, block_tokens=1, kv_lora_rank=nbytes)


class _Worker:
    """One thread, its own daemon sessions (one per namespace, the least recently used closed past
    ``MAX_SESSIONS`` unless ``in_use`` says it holds locks), and a queue of jobs."""

    MAX_SESSIONS = 64  # many cache_salts mean many namespaces; each session maps the arena once

    def __init__(self, name: str, target: DaemonTarget, idle: Callable[[], float] | None = None,
                 in_use: Callable[[EngineStore], bool] = lambda s: False) -> None:
        """``idle``: work between jobs (lease renewal); returns the seconds until it is due again."""
        self.target, self._idle, self._in_use = target, idle, in_use
        self.stores: OrderedDict[tuple, EngineStore] = OrderedDict()
        self.jobs: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def store_for(self, ns: tuple) -> EngineStore:
        s = self.stores.get(ns)
        if s is not None:
            self.stores.move_to_end(ns)
            return s
        for old in [k for k, v in self.stores.items() if not self._in_use(v)][:max(0, len(self.stores) + 1 - self.MAX_SESSIONS)]:
            self.stores.pop(old).close()
        model_id, salt, nbytes = ns
        target = DaemonTarget(self.target.socket_path, self.target.timeout_s, self.target.load_wait_s, salt)
        s = self.stores[ns] = EngineStore(target, opaque_layout(nbytes), model_id)
        return s

    def _run(self) -> None:
        due = 1.0
        while True:
            try:
                job = self.jobs.get(timeout=due)
            except queue.Empty:
                job = ()
            if job is None:
                break
            try:
                if job:
                    job()
                if self._idle is not None:
                    due = self._idle()
            except Exception:  # a job posts its own result; this thread must outlive any bug in one
                log.exception("kvstore L2 worker")
        for s in self.stores.values():
            s.close()


class KVStoreL2Adapter(L2AdapterInterface):
    """LMCache L2 on the node's kvstore daemon."""

    def __init__(self, config: KVStoreL2AdapterConfig, l1_memory_desc=None) -> None:
        super().__init__(max_capacity_bytes=0)  # the daemon evicts by itself (leaves-first LRU, NVMe below)
        if isinstance(config, dict):  # raw-dict plugin mode
            config = KVStoreL2AdapterConfig.from_dict(config)
        self.target = config.target
        self.target.connect().close()  # no daemon: the adapter fails to load, now
        self._efds = {k: create_event_notifier() for k in ("store", "lookup", "load")}
        self._lock = threading.Lock()  # guards the task ids and results below
        self._next_id = 0
        self._stores: dict[L2TaskId, L2StoreResult] = {}
        self._lookups: dict[L2TaskId, Bitmap] = {}
        self._loads: dict[L2TaskId, Bitmap] = {}
        # Locks, on the fetch thread only: key -> its read leases (oldest first); lease -> keys
        # still locked under it, and the store that holds it.
        self._locks: dict = defaultdict(list)
        self._held: dict = {}
        self._renewed = 0.0
        self._writer = _Worker("kvstore-l2-store", self.target)
        self._fetcher = _Worker("kvstore-l2-fetch", self.target, idle=self._renew_locks,
                                in_use=lambda s: any(held[1] is s for held in self._held.values()))

    # --- event fds --------------------------------------------------------------------------
    def get_store_event_fd(self) -> int:
        return self._efds["store"].fileno()

    def get_lookup_and_lock_event_fd(self) -> int:
        return self._efds["lookup"].fileno()

    def get_load_event_fd(self) -> int:
        return self._efds["load"].fileno()

    def _task_id(self) -> L2TaskId:
        with self._lock:
            self._next_id += 1
            return self._next_id

    def _finish(self, results: dict, task_id: L2TaskId, value, efd: str) -> None:
        with self._lock:
            results[task_id] = value
        self._efds[efd].notify()

    def _take(self, results: dict, task_id: L2TaskId):
        """A finished task's result, once (None while it runs)."""
        with self._lock:
            return results.pop(task_id, None)

    # --- namespaces -------------------------------------------------------------------------
    def namespace(self, key, shapes, dtypes) -> tuple:
        """(model id, tenant salt, object bytes): the kvstore namespace of ``key``'s objects of
        these shapes and dtypes."""
        fmt, nbytes = _signature(shapes, dtypes)
        if len(fmt) > 128:
            fmt = "sha256:" + hashlib.sha256(fmt.encode()).hexdigest()
        model_id = f"lmcache:{key.model_name}@rank{key.kv_rank}/group{key.object_group_id}/{fmt}"
        # Both salts are inside the namespace hash; the length prefix keeps their boundary.
        salt = f"{len(self.target.tenant_salt)}:{self.target.tenant_salt}{key.cache_salt}"
        return model_id, salt, nbytes

    @staticmethod
    def _groups(keys, namespaces) -> dict:
        """Indices of keys per namespace, in order (None: no namespace, a miss)."""
        out: dict = defaultdict(list)
        for i, ns in enumerate(namespaces):
            out[ns].append(i)
        return out

    def _object_namespace(self, key, obj) -> tuple:
        shapes = obj.get_shapes() if obj.metadata.shapes is not None else [obj.get_shape()]
        dtypes = obj.get_dtypes() if obj.metadata.dtypes is not None else [obj.get_dtype()]
        return self.namespace(key, shapes, dtypes)

    # --- store ------------------------------------------------------------------------------
    def submit_store_task(self, keys, objects) -> L2TaskId:
        task_id = self._task_id()
        self._writer.jobs.put(lambda: self._store(task_id, list(keys), list(objects)))
        return task_id

    def _store(self, task_id: L2TaskId, keys, objects) -> None:
        ok, stored = True, 0
        try:
            for ns, idx in self._groups(keys, [self._object_namespace(k, o) for k, o in zip(keys, objects, strict=True)]).items():
                store = self._writer.store_for(ns)

                def fill(i: int, slot, idx=idx) -> None:
                    slot[:] = np.frombuffer(objects[idx[i]].byte_array, np.uint8, ns[2])

                done = store.store(store.keys([keys[i].chunk_hash for i in idx]), fill)
                ok &= all(done)
                stored += sum(ns[2] for d in done if d)
                if any(done):
                    self._notify_keys_stored([keys[i] for i, d in zip(idx, done) if d], [ns[2]] * sum(done))
        except Exception as e:
            ok = failed(e)
        self._finish(self._stores, task_id, L2StoreResult(ok, stored), "store")

    def pop_completed_store_tasks(self) -> dict[L2TaskId, L2StoreResult]:
        with self._lock:
            done, self._stores = self._stores, {}
        return done

    # --- lookup and lock --------------------------------------------------------------------
    def submit_lookup_and_lock_task(self, keys, group_layout_descs) -> L2TaskId:
        task_id = self._task_id()
        self._fetcher.jobs.put(lambda: self._lookup(task_id, list(keys), dict(group_layout_descs or {})))
        return task_id

    def _lookup(self, task_id: L2TaskId, keys, descs) -> None:
        hits = Bitmap(len(keys))
        try:
            namespaces = []
            for k in keys:
                d = descs.get(k.object_group_id)
                namespaces.append(None if d is None else self.namespace(k, d.shapes, d.dtypes))
            for ns, idx in self._groups(keys, namespaces).items():
                if ns is None:
                    continue  # no layout for this group: LMCache gave nothing to size it by
                store = self._fetcher.store_for(ns)
                lease = store.pin(store.keys([keys[i].chunk_hash for i in idx]))
                if not lease.count:
                    lease.release()
                    continue
                self._held[lease.lease_id] = [lease, store, lease.count]
                for i in idx[:lease.count]:
                    hits.set(i)
                    self._locks[keys[i]].append(lease.lease_id)
        except Exception as e:
            failed(e)
        self._finish(self._lookups, task_id, hits, "lookup")

    def query_lookup_and_lock_result(self, task_id: L2TaskId):
        return self._take(self._lookups, task_id)

    def submit_unlock(self, keys) -> None:
        self._fetcher.jobs.put(lambda: self._unlock(list(keys)))

    def _unlock(self, keys) -> None:
        for k in keys:
            leases = self._locks.get(k)
            if not leases:
                continue  # not locked here (or already unlocked): nothing to do
            lid = leases.pop(0)
            if not leases:
                del self._locks[k]
            held = self._held[lid]
            held[2] -= 1
            if held[2] == 0:
                del self._held[lid]
                try:
                    # Waited for (this is the adapter's own thread, not LMCache's): once the
                    # unlock has run, the blocks are evictable. Fire-and-forget let a Delete or
                    # an eviction right after it find them still pinned (CI saw it once), and
                    # so did the loads' own leases, released without a wait as they finished.
                    held[1].client.flush_releases()
                    held[0].release(wait=True)
                except Exception as e:  # the daemon drops it at its TTL
                    failed(e)

    def _renew_locks(self) -> float:
        """Extend the read leases of locks LMCache still holds, every third of the lease TTL
        (on the fetch thread, between jobs); returns the seconds until the next renewal."""
        if not self._held:
            return 1.0
        stores = {id(store): store for _, store, _ in self._held.values()}
        period = min(s.client.info.lease_ttl_s for s in stores.values()) / 3
        left = self._renewed + period - time.monotonic()
        if left > 0:
            return left
        self._renewed = time.monotonic()
        for sid, store in stores.items():
            try:
                store.client.keepalive([lid for lid, (_, s, _) in self._held.items() if id(s) == sid])
            except Exception as e:
                failed(e)
        return period

    # --- load -------------------------------------------------------------------------------
    def submit_load_task(self, keys, objects) -> L2TaskId:
        task_id = self._task_id()
        self._fetcher.jobs.put(lambda: self._load(task_id, list(keys), list(objects)))
        return task_id

    def _load(self, task_id: L2TaskId, keys, objects) -> None:
        loaded = Bitmap(len(keys))
        try:
            for ns, idx in self._groups(keys, [self._object_namespace(k, o) for k, o in zip(keys, objects, strict=True)]).items():
                store = self._fetcher.store_for(ns)

                def drain(i: int, slot, idx=idx) -> None:
                    np.frombuffer(objects[idx[i]].byte_array, np.uint8, ns[2])[:] = slot

                n = store.load(store.keys([keys[i].chunk_hash for i in idx]), drain)
                for i in idx[:n]:
                    loaded.set(i)
                if n:
                    self._notify_keys_accessed([keys[i] for i in idx[:n]])
        except Exception as e:
            failed(e)
        self._finish(self._loads, task_id, loaded, "load")

    def query_load_result(self, task_id: L2TaskId):
        return self._take(self._loads, task_id)

    # --- the rest ---------------------------------------------------------------------------
    def report_status(self) -> dict:
        return {"is_healthy": self._writer.thread.is_alive() and self._fetcher.thread.is_alive(),
                "type": "KVStoreL2Adapter", "socket_path": self.target.socket_path, "locked_keys": len(self._locks)}

    def close(self) -> None:
        self._fetcher.jobs.put(lambda: self._unlock([k for k, v in list(self._locks.items()) for _ in v]))
        for w in (self._writer, self._fetcher):
            w.jobs.put(None)
        for w in (self._writer, self._fetcher):
            w.thread.join(timeout=self.target.timeout_s * 2)
        for e in self._efds.values():
            e.close()
