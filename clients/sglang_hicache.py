"""kvstore as SGLang's HiCache storage backend (its L3 tier), loaded by module path:

    --enable-hierarchical-cache --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "kvstore",
        "module_path": "kvstore.clients.sglang_hicache", "class_name": "KVStoreHiCache",
        "interface_v1": 1, "socket_path": "/run/kvstore/kvstore.sock"}'

SGLang's ``StorageBackendFactory`` builds the class with ``(storage_config, kwargs)`` and its
HiCacheController then calls ``register_mem_pool_host`` with the host KV pool; that pool's
shape (layers, heads, head dim, dtype, page size, MHA or MLA) is the kvstore layout, so the
namespace is known only then. A page is one kvstore block, stored in kvstore's canonical
layout: the copy between SGLang's host pool (any of its layouts) and the daemon's arena is the
one copy there is, and it converts on the way.

The controller calls from three threads (prefetch: ``batch_exists``; prefetch I/O:
``batch_get_v1``; backup: ``batch_set_v1``); each thread gets its own daemon session.
Failures are misses or failed stores, never exceptions into SGLang's threads; bad
configuration raises at construction with a message naming the setting.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, List, Optional

import torch

from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig, HiCacheStorageExtraInfo

from kvstore.clients.engine_store import DaemonTarget, EngineStore, EngineTierConfigError, failed
from kvstore.layout import AttnKind, DType, KVLayout

log = logging.getLogger("kvstore.sglang")

_DTYPES = {torch.float16: DType.FP16, torch.bfloat16: DType.BF16, torch.float32: DType.FP32,
           torch.float8_e4m3fn: DType.FP8_E4M3, torch.float8_e5m2: DType.FP8_E5M2, torch.int8: DType.INT8}
# SGLang's own keys in the extra config (the dynamic loader's, and the controller's switch).
_SGLANG_KEYS = {"backend_name", "module_path", "class_name", "interface_v1"}
_OUR_KEYS = {"load_policy", "kv_dtype"}


class PageFormat:
    """How one SGLang host pool lays out a page, as a kvstore layout plus a view that turns a
    page of the pool (or a flat page of the legacy calls) into the canonical block order:
    ``[layers, 2, page, heads, head_dim]`` (MLA: ``[layers, page, latent + rope]``)."""

    def __init__(self, pool, kv_dtype: str | None = None) -> None:
        kinds = {c.__name__ for c in type(pool).__mro__}
        if not kinds & {"MHATokenToKVPoolHost", "MLATokenToKVPoolHost"}:
            # A hybrid model's HostPoolGroup (sliding-window, Mamba state or DSA indexer pools
            # beside the KV pool), a K-only pool, ...: stored in part it would be served wrong.
            raise EngineTierConfigError(f"kvstore: SGLang host pool {type(pool).__name__} is not supported: kvstore "
                                        "stores models with one MHA or MLA KV pool (hybrid models' pool groups, "
                                        "with sliding-window, Mamba state or indexer pools, are refused, not stored "
                                        "in part)")
        self.pool, self.kind = pool, pool.layout
        what = f"{type(pool).__name__} (layout {pool.layout})"
        dtype = _DTYPES.get(pool.dtype)
        if kv_dtype is not None:
            dtype = DType.parse(kv_dtype)
            if pool.dtype.itemsize * 8 != dtype.bits:
                raise EngineTierConfigError(f"hicache extra_config.kv_dtype: {kv_dtype} does not match the host pool's {pool.dtype}")
        if dtype is None:
            raise EngineTierConfigError(f"kvstore: host pool dtype {pool.dtype} has no kvstore dtype; "
                                        f"set kv_dtype (e.g. fp8_e4m3 for an fp8 cache stored as uint8)")
        if hasattr(pool, "kv_lora_rank"):
            if pool.kv_cache_dim != pool.kv_lora_rank + pool.qk_rope_head_dim:
                raise EngineTierConfigError(f"kvstore: {what} packs rows of {pool.kv_cache_dim} elements, not "
                                            f"kv_lora_rank + qk_rope_head_dim; this pool is not supported")
            self.layout = KVLayout(pool.layer_num, dtype=dtype, kind=AttnKind.MLA, block_tokens=pool.page_size,
                                   kv_lora_rank=pool.kv_lora_rank, qk_rope_head_dim=pool.qk_rope_head_dim)
            orders = {"layer_first": lambda p: p[:, :, 0], "page_first": lambda p: p.permute(1, 0, 2, 3)[:, :, 0],
                      "page_first_direct": lambda p: p[0, :, :, 0]}
        else:
            if getattr(pool, "v_head_dim", pool.head_dim) != pool.head_dim:
                raise EngineTierConfigError(f"kvstore: {what} has K head dim {pool.head_dim} and V head dim "
                                            f"{pool.v_head_dim}; kvstore layouts need one head dim")
            self.layout = KVLayout(pool.layer_num, pool.head_num, pool.head_dim, dtype=dtype, kind=AttnKind.GQA,
                                   block_tokens=pool.page_size)
            orders = {"layer_first": lambda p: p.permute(1, 0, 2, 3, 4), "page_first": lambda p: p.permute(2, 0, 1, 3, 4),
                      "page_first_direct": lambda p: p[:, 0].permute(1, 0, 2, 3, 4),
                      "page_head": lambda p: p[:, 0].permute(3, 0, 2, 1, 4)}
        if pool.layout not in orders:
            raise EngineTierConfigError(f"kvstore: host pool layout {pool.layout!r} is not supported; "
                                        f"use one of {sorted(orders)} (--hicache-mem-layout)")
        self._order = orders[pool.layout]
        self._page_shape = tuple(pool.get_data_page(0, flat=False).shape)
        shape = self.layout.tensor_shape(self.layout.block_tokens)
        self.block_shape = shape
        self.torch_dtype = pool.dtype

    def page(self, index: int) -> torch.Tensor:
        """The pool's page starting at token slot ``index``, viewed in canonical order (no copy)."""
        return self._order(self.pool.get_data_page(index, flat=False))

    def flat(self, data: torch.Tensor) -> torch.Tensor:
        """A flat page (``get_data_page(flat=True)`` order) viewed in canonical order."""
        return self._order(data.view(self._page_shape))

    def slot(self, view) -> torch.Tensor:
        """A block's arena slot (uint8) as a tensor in canonical order."""
        return torch.from_numpy(view).view(self.torch_dtype).view(self.block_shape)


class KVStoreHiCache(HiCacheStorage):
    """SGLang HiCache storage on the node's kvstore daemon (``HiCacheStorage``)."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Optional[dict] = None) -> None:
        extra = dict(storage_config.extra_config or {})
        self.target = DaemonTarget.from_params(extra, "hicache extra_config", others=None)
        policy = extra.get("load_policy", "all")
        if policy not in ("all", "advice"):
            raise EngineTierConfigError(f"hicache extra_config.load_policy: 'all' or 'advice', got {policy!r}")
        self.use_advice = policy == "advice"
        self.kv_dtype = extra.get("kv_dtype")
        if not storage_config.model_name:
            raise EngineTierConfigError("kvstore: storage_config.model_name is empty; without it two models' "
                                        "pages would share a namespace (start SGLang with --served-model-name)")
        cfg = storage_config
        shards = "".join(f"/{name}{rank}of{size}" for name, rank, size in
                         (("pp", cfg.pp_rank, cfg.pp_size), ("cp", cfg.attn_cp_rank, cfg.attn_cp_size),
                          ("dcp", cfg.dcp_rank, cfg.dcp_size)) if size > 1)
        self.model_id = f"sglang:{cfg.model_name}{shards}"
        # MLA's latent is the same on every TP rank (SGLang writes it from one rank): one shard.
        self.tp = (0, 1) if cfg.is_mla_model else (cfg.tp_rank, cfg.tp_size)
        self.storage_config = cfg
        self.format: PageFormat | None = None
        self._local = threading.local()
        self._stores: list[EngineStore] = []
        self._lock = threading.Lock()  # guards _stores
        self.target.connect().close()  # a daemon that is not there fails the attach, now

    # --- sessions ---------------------------------------------------------------------------
    def register_mem_pool_host(self, mem_pool_host) -> None:
        super().register_mem_pool_host(mem_pool_host)
        self.format = PageFormat(mem_pool_host, self.kv_dtype)
        self._store()  # registers the namespace: a daemon refusing the layout fails the attach

    def _store(self) -> EngineStore:
        store = getattr(self._local, "store", None)
        if store is None:
            if self.format is None:
                raise RuntimeError("kvstore: register_mem_pool_host was not called")
            store = EngineStore(self.target, self.format.layout, self.model_id, *self.tp)
            self._local.store = store
            with self._lock:
                self._stores.append(store)
        return store

    def close(self) -> None:
        with self._lock:
            stores, self._stores = self._stores, []
        for s in stores:
            s.close()

    @staticmethod
    def _parent(store: EngineStore, extra_info: Optional[HiCacheStorageExtraInfo]) -> bytes:
        prefix = extra_info.prefix_keys if extra_info is not None else None
        return bytes(store.keys([prefix[-1].encode()])[0]) if prefix else b""

    # --- zero-copy interface (interface_v1) -------------------------------------------------
    def batch_exists(self, keys: List[str], extra_info: Optional[HiCacheStorageExtraInfo] = None) -> int:
        """Leading pages stored (or, with ``load_policy: advice``, those the daemon's
        load-or-recompute policy says to load)."""
        try:
            store = self._store()
            hit, load = store.prefix_hits(store.keys([k.encode() for k in keys]))
            return min(hit, load) if self.use_advice else hit
        except Exception as e:
            return int(failed(e))

    def batch_get_v1(self, keys: List[str], host_indices: torch.Tensor,
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> List[bool]:
        fmt, step = self.format, self.format.layout.block_tokens

        def drain(i: int, slot) -> None:
            fmt.page(int(host_indices[i * step])).copy_(fmt.slot(slot))

        return self._load(keys, drain)

    def batch_set_v1(self, keys: List[str], host_indices: torch.Tensor,
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> List[bool]:
        fmt, step = self.format, self.format.layout.block_tokens

        def fill(i: int, slot) -> None:
            fmt.slot(slot).copy_(fmt.page(int(host_indices[i * step])))

        return self._save(keys, fill, extra_info)

    def _load(self, keys: List[str], drain) -> List[bool]:
        try:
            store = self._store()
            n = store.load(store.keys([k.encode() for k in keys]), drain)
        except Exception as e:
            n = failed(e)
        return [i < n for i in range(len(keys))]

    def _save(self, keys: List[str], fill, extra_info=None) -> List[bool]:
        try:
            store = self._store()
            return store.store(store.keys([k.encode() for k in keys]), fill, self._parent(store, extra_info))
        except Exception as e:
            return [failed(e)] * len(keys)

    # --- the generic interface (without interface_v1): flat pages ----------------------------
    def get(self, key: str, target_location: Optional[Any] = None, target_sizes: Optional[Any] = None):
        return self.batch_get([key], [target_location])[0]

    def batch_get(self, keys: List[str], target_locations: Optional[Any] = None, target_sizes: Optional[Any] = None):
        fmt = self.format

        def drain(i: int, slot) -> None:
            fmt.flat(target_locations[i]).copy_(fmt.slot(slot))

        got = self._load(keys, drain)
        return [t if ok else None for t, ok in zip(target_locations, got)]

    def set(self, key: str, value: Optional[Any] = None, target_location: Optional[Any] = None,
            target_sizes: Optional[Any] = None) -> bool:
        return self.batch_set([key], [value])

    def batch_set(self, keys: List[str], values: Optional[Any] = None, target_locations: Optional[Any] = None,
                  target_sizes: Optional[Any] = None) -> bool:
        fmt = self.format

        def fill(i: int, slot) -> None:
            fmt.slot(slot).copy_(fmt.flat(values[i].contiguous()))

        return all(self._save(keys, fill))

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1
