"""Drive kvstore's HiCache backend through SGLang's own HiCacheController, in a process of its own:
``python tests/sglang_hicache_run.py SOCKET WORKDIR`` prints one JSON object of findings that
tests/test_sglang_hicache.py checks.

Everything SGLang here is SGLang's: the device KV pool (MHATokenToKVPool on "cpu"), the host pools
(MHATokenToKVPoolHost, layouts page_first and layer_first), the paged allocator, the
HiCacheController with ``storage_backend="dynamic"`` (so StorageBackendFactory loads the class by
module path, as ``--hicache-storage-backend dynamic`` does) and its prefetch, prefetch-I/O and
backup threads calling ``batch_exists`` / ``batch_get_v1`` / ``batch_set_v1``. This script plays
the scheduler's part only: it queues writes and prefetches, and hands the prefetch its host pages.

One thing is not real, and it is not SGLang's: ``sglang.srt.configs`` imports torchvision (for
InternVL image preprocessing) at import time, and PyPI's torchvision is a CUDA build that breaks
beside CPU torch, so it is not installed. Before SGLang is imported, this process puts inert
torchvision modules in place (any call into them raises); nothing on the HiCache path calls them.
It runs in its own process so that no other test sees them.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import threading
import time
import types


def block_torchvision() -> None:
    importlib.import_module("transformers")  # it looks for torchvision once, at import: finds none

    class Inert:
        def __init__(self, name):
            self._name = name

        def __getattr__(self, attr):
            if attr.startswith("__"):
                raise AttributeError(attr)
            return Inert(f"{self._name}.{attr}")

        def __call__(self, *a, **k):
            raise RuntimeError(f"{self._name}: torchvision is not installed in this test process")

    def module_attr(name):
        def get(attr):
            if attr.startswith("__"):
                raise AttributeError(attr)
            return Inert(f"{name}.{attr}")
        return get

    for name in ("torchvision", "torchvision.transforms", "torchvision.transforms.functional"):
        m = types.ModuleType(name)
        m.__path__ = []
        m.__getattr__ = module_attr(name)
        sys.modules[name] = m


block_torchvision()

import torch  # noqa: E402

from sglang.srt.managers.cache_controller import HiCacheController  # noqa: E402
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo, PoolName  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool  # noqa: E402
from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope  # noqa: E402
from sglang.srt.mem_cache.pool_host.group import HostPoolGroup, PoolEntry  # noqa: E402
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost  # noqa: E402
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost  # noqa: E402
from sglang.srt.mem_cache.utils import get_storage_hash_str  # noqa: E402
from sglang.srt.runtime_context import get_parallel  # noqa: E402

from kvstore.clients.engine_store import DaemonUnreachable, EngineTierConfigError  # noqa: E402

PAGE, LAYERS, HEADS, DIM = 4, 3, 2, 8
LORA, ROPE = 16, 8  # MLA latent and rope dims
WAIT_S = 20.0  # bound on each wait for a controller thread


def extra(socket_path: str, **more) -> dict:
    return {"backend_name": "kvstore", "module_path": "kvstore.clients.sglang_hicache",
            "class_name": "KVStoreHiCache", "interface_v1": 1, "socket_path": socket_path, "timeout_s": 5, **more}


class Engine:
    """SGLang's KV pools and HiCacheController for one small model."""

    def __init__(self, layout: str, extra_config: dict, model: str = "tiny-llama", mla: bool = False) -> None:
        with host_memory_budget_scope(64 << 20):  # SGLang's own booking; the machine's free RAM is not ours
            if mla:
                self.kv = MLATokenToKVPool(256, PAGE, torch.bfloat16, LORA, ROPE, LAYERS, "cpu", False,
                                           start_layer=0, end_layer=LAYERS)
                self.host = MLATokenToKVPoolHost(self.kv.get_device_pool_infos()[0].buffer_info, 2, 0, PAGE, layout,
                                                 pin_memory=False, device_capacity_tokens=self.kv.size,
                                                 start_layer=0, end_layer=LAYERS, target_layer_num=LAYERS)
            else:
                self.kv = MHATokenToKVPool(256, PAGE, torch.float16, HEADS, DIM, LAYERS, "cpu", False,
                                           start_layer=0, end_layer=LAYERS)
                self.host = MHATokenToKVPoolHost(self.kv.get_device_pool_infos()[0].buffer_info, 2, 0, PAGE, layout,
                                                 pin_memory=False, device_capacity_tokens=self.kv.size,
                                                 start_layer=0, end_layer=LAYERS,
                                                 write_back_staging=self.kv.hicache_write_back_staging)
        alloc = PagedTokenToKVPoolAllocator(256, PAGE, torch.float16, "cpu", self.kv, False)
        self.cc = HiCacheController(alloc, self.host, PAGE, None, threading.Event(), storage_backend="dynamic",
                                    model_name=model, storage_backend_extra_config=dict(extra_config))
        self.backend = self.cc.storage_backend

    def fill(self, n_tokens: int, seed: int) -> torch.Tensor:
        """Host pages holding ``n_tokens`` tokens of random KV; returns their host indices."""
        idx = self.host.alloc(n_tokens)
        g = torch.Generator().manual_seed(seed)
        for p in range(0, n_tokens, PAGE):
            page = self.host.get_data_page(int(idx[p]), flat=False)
            page.copy_(torch.randn(page.shape, generator=g, dtype=torch.float32).to(page.dtype))
        return idx

    def pages(self, idx: torch.Tensor) -> list[torch.Tensor]:
        """Copies of the host pages at ``idx``, as int16 (compared bit for bit)."""
        return [self.host.get_data_page(int(idx[p]), flat=True).clone().view(torch.int16)
                for p in range(0, len(idx), PAGE)]

    def round_trip(self, seed: int, pages: int) -> dict:
        """Write pages through the controller, prefetch them into fresh host pages."""
        toks = tokens_of(seed, pages * PAGE)
        src = self.fill(len(toks), seed=seed)
        written = self.write(src, toks)
        found, loaded, dst = self.prefetch(toks)
        return {"written": written, "found": found, "loaded": loaded,
                "exact": dst is not None and all(torch.equal(x, y) for x, y in zip(self.pages(src), self.pages(dst)))}

    def write(self, idx: torch.Tensor, tokens: list[int]) -> int:
        """The controller's write-through to storage; tokens it stored."""
        hashes = get_storage_hash_str(tokens, None, page_size=PAGE)
        self.cc.write_storage(idx, tokens, hash_value=hashes)
        return self.cc.ack_backup_queue.get(timeout=WAIT_S).completed_tokens

    def prefetch(self, tokens: list[int]) -> tuple[int, int, torch.Tensor | None]:
        """The controller's prefetch, the scheduler's part played here: (tokens the storage
        query found, tokens loaded into fresh host pages, those pages' indices)."""
        op = self.cc.prefetch("req", tokens, None, prefix_keys=[])
        hit_op = self.cc.prefetch_hit_queue.get(timeout=WAIT_S)
        assert hit_op is op
        found = op.storage_hit_count
        if found == 0:
            return 0, 0, None
        op.host_indices = self.cc.alloc_prefetch_host_buffers(op, found)
        self.cc.prefetch_buffer.put(op)
        deadline, loaded = time.monotonic() + WAIT_S, 0
        while True:  # one ack per storage batch with the tokens loaded so far, then the last one
            ack = self.cc.ack_prefetch_queue.get(timeout=max(0.1, deadline - time.monotonic()))
            if ack.completed_req:
                return found, loaded, op.host_indices
            loaded = ack.completed_tokens

    def close(self) -> None:
        self.cc.detach_storage_backend()


def tokens_of(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 32000 for i in range(n)]


def main(socket_path: str, workdir: str) -> dict:
    get_parallel().override_permanently(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_dcp_size=1, attn_dcp_rank=0)
    out: dict = {}

    # Round trip through the controller's threads, page_first host pool; read back into a
    # layer_first pool of the same model: the pages travel in kvstore's canonical layout.
    a = Engine("page_first", extra(socket_path))
    out["backend_class"] = type(a.backend).__module__ + "." + type(a.backend).__name__
    out["zero_copy"] = a.cc.page_get_func.__name__
    toks = tokens_of(1, 6 * PAGE)
    src = a.fill(len(toks), seed=1)
    out["written"] = a.write(src, toks)
    out["rewritten"] = a.write(src, toks)  # already there: PRESENT counts as stored
    found, loaded, dst = a.prefetch(toks)
    out["found"], out["loaded"] = found, loaded
    out["same_pool_exact"] = all(torch.equal(x, y) for x, y in zip(a.pages(src), a.pages(dst)))
    b = Engine("layer_first", extra(socket_path))
    found_b, loaded_b, dst_b = b.prefetch(toks)
    out["other_layout_loaded"] = loaded_b
    canon = [a.host.get_data_page(int(src[p]), flat=False).permute(2, 0, 1, 3, 4) for p in range(0, len(toks), PAGE)]
    other = [b.host.get_data_page(int(dst_b[p]), flat=False).permute(1, 0, 2, 3, 4) for p in range(0, len(toks), PAGE)]
    out["other_layout_exact"] = all(torch.equal(x.view(torch.int16), y.view(torch.int16)) for x, y in zip(canon, other))
    # A hybrid model's host pool group (here: a KV pool and a sliding-window pool) is refused
    # at attach, naming it, not stored in part.
    group = HostPoolGroup([PoolEntry(PoolName.KV, a.host, None, lambda l: l, True),
                           PoolEntry(PoolName.SWA, b.host, None, lambda l: l)])
    try:
        type(a.backend)(a.backend.storage_config, {}).register_mem_pool_host(group)
        out["hybrid_refused"] = ""
    except EngineTierConfigError as e:
        out["hybrid_refused"] = str(e)
    # A prefix of the chain is found, a longer prompt loads only what is stored.
    found_l, loaded_l, _ = a.prefetch(toks + tokens_of(9, 3 * PAGE))
    out["longer_found"], out["longer_loaded"] = found_l, loaded_l

    # Evicted between batch_exists and batch_get_v1: a clean miss; the host pages stay as they were.
    backend = a.backend
    toks2 = tokens_of(2, 3 * PAGE)
    src2 = a.fill(len(toks2), seed=2)
    a.write(src2, toks2)
    hashes2 = get_storage_hash_str(toks2, None, page_size=PAGE)
    out["exists_before_evict"] = backend.batch_exists(hashes2, HiCacheStorageExtraInfo(prefix_keys=[]))
    store = backend._store()
    store.client.delete(store.keys([hashes2[1].encode()]))  # the daemon drops page 1 (as an eviction would)
    dst2 = a.host.alloc(len(toks2))
    before = a.pages(dst2)
    got = backend.batch_get_v1(hashes2, dst2)
    after = a.pages(dst2)
    out["evicted_get"] = got
    out["evicted_pages_untouched"] = [torch.equal(x, y) for x, y in zip(before, after)][1:]
    out["evicted_first_exact"] = torch.equal(after[0], a.pages(src2)[0])

    # A failed store is never visible: the copy out of the host pool fails half-way (a host
    # index past the pool), the lease is aborted, exists finds nothing.
    toks3 = tokens_of(3, 2 * PAGE)
    hashes3 = get_storage_hash_str(toks3, None, page_size=PAGE)
    bad = torch.tensor(list(range(PAGE)) + list(range(10**6, 10**6 + PAGE)), dtype=torch.int64)
    out["failed_set"] = backend.batch_set_v1(hashes3, bad)
    out["failed_set_exists"] = backend.batch_exists(hashes3)

    # Tenants: another salt (from a 0600 file) sees none of tenant a's pages, and its own.
    salt_file = os.path.join(workdir, "salt")
    with open(os.open(salt_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
        f.write("tenant-b-secret\n")
    c = Engine("page_first", extra(socket_path, tenant_salt_file=salt_file))
    out["other_tenant_found"] = c.prefetch(toks)[0]
    srcc = c.fill(len(toks), seed=4)
    out["other_tenant_written"] = c.write(srcc, toks)
    out["first_tenant_still_exact"] = torch.equal(a.pages(a.prefetch(toks)[2])[0], a.pages(src)[0])
    # Another model, same tokens: another namespace.
    d = Engine("page_first", extra(socket_path), model="other-model")
    out["other_model_found"] = d.prefetch(toks)[0]
    # MLA (one latent row per token, one shard for every TP rank), page_first host pool.
    m = Engine("page_first", extra(socket_path), model="tiny-deepseek", mla=True)
    out["mla_layout"] = m.backend.format.layout.to_dict()
    out["mla"] = m.round_trip(seed=5, pages=3)
    # Without interface_v1 SGLang calls the generic batch_get / batch_set with flat pages.
    g = Engine("page_first", {k: v for k, v in extra(socket_path).items() if k != "interface_v1"}, model="tiny-generic")
    out["generic_path"] = g.cc.page_get_func.__name__
    out["generic"] = g.round_trip(seed=6, pages=3)
    # load_policy advice: batch_exists answers what the daemon advises loading (at most the hits).
    v = Engine("page_first", extra(socket_path, load_policy="advice"))
    out["advice_found"] = v.prefetch(toks)[0]
    for e in (a, b, c, d, m, g, v):
        e.close()

    # Bad configuration: each fails the attach with a message naming what to fix.
    errors = {}
    for name, cfg in {"unreachable": extra(os.path.join(workdir, "nobody.sock"), timeout_s=0.5),
                      "salt_missing": extra(socket_path, tenant_salt_file=os.path.join(workdir, "no-such-salt")),
                      "bad_dtype": extra(socket_path, kv_dtype="fp8_e4m3"),
                      "bad_policy": extra(socket_path, load_policy="sometimes")}.items():
        t0 = time.monotonic()
        try:
            Engine("page_first", cfg).close()
            errors[name] = None
        except Exception as e:  # noqa: BLE001 - reported to the test
            cause = e
            while cause.__cause__ is not None and not isinstance(cause, (DaemonUnreachable, EngineTierConfigError)):
                cause = cause.__cause__
            errors[name] = {"type": type(cause).__name__, "message": str(cause), "s": time.monotonic() - t0}
    out["errors"] = errors
    return out


if __name__ == "__main__":
    print("RESULT " + json.dumps(main(sys.argv[1], sys.argv[2])))
