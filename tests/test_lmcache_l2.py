"""kvstore as an LMCache 0.5.6 L2 adapter: configured with LMCache's own ``--l2-adapter`` parser
(type ``plugin``), built by its adapter factory, driven through the eventfd task protocol with
LMCache's own ObjectKey / TensorMemoryObj / Bitmap, against a real daemon."""

from __future__ import annotations

import argparse
import json
import os
import select
import time

import pytest

pytest.importorskip("lmcache.v1.distributed.l2_adapters.base", reason="LMCache is installed by scripts/install_vllm.sh")

import torch  # noqa: E402

from lmcache.v1.distributed.api import MemoryLayoutDesc, ObjectKey  # noqa: E402
from lmcache.v1.distributed.l2_adapters.config import add_l2_adapters_args, parse_args_to_l2_adapters_config  # noqa: E402
from lmcache.v1.distributed.l2_adapters.factory import create_l2_adapter_from_registry  # noqa: E402
from lmcache.v1.memory_management import MemoryFormat, MemoryObjMetadata, TensorMemoryObj  # noqa: E402

from kvstore.clients import KVStoreClient  # noqa: E402
from tests.wait_util import wait_for  # noqa: E402
from kvstore.clients.engine_store import DaemonTarget, DaemonUnreachable, EngineStore, EngineTierConfigError  # noqa: E402
from kvstore.clients.lmcache_l2 import KVStoreL2Adapter, opaque_layout  # noqa: E402

SHAPE = torch.Size([2, 3, 16, 32])  # KV_2LTD: [K/V, layers, tokens, hidden]
WAIT_S = 10.0


def build(**params):
    """The adapter as LMCache's server builds it from ``--l2-adapter JSON``."""
    spec = {"type": "plugin", "module_path": "kvstore.clients.lmcache_l2", "class_name": "KVStoreL2Adapter",
            "adapter_params": params}
    parser = add_l2_adapters_args(argparse.ArgumentParser())
    cfg = parse_args_to_l2_adapters_config(parser.parse_args(["--l2-adapter", json.dumps(spec)]))
    return create_l2_adapter_from_registry(cfg.adapters[0])


def obj(seed: int | None = None) -> TensorMemoryObj:
    data = (torch.randn(SHAPE, generator=torch.Generator().manual_seed(seed)) if seed is not None
            else torch.zeros(SHAPE)).to(torch.float16)
    meta = MemoryObjMetadata(shape=SHAPE, dtype=torch.float16, address=0, phy_size=data.nbytes, ref_count=1,
                             fmt=MemoryFormat.KV_2LTD)
    return TensorMemoryObj(raw_data=data, metadata=meta, parent_allocator=None)


def key(i: int, salt: str = "") -> ObjectKey:
    return ObjectKey(chunk_hash=i.to_bytes(8, "little") * 4, model_name="tiny/llama", kv_rank=0, cache_salt=salt)


DESCS = {0: MemoryLayoutDesc(shapes=[SHAPE], dtypes=[torch.float16])}


def wait(fd: int) -> None:
    assert select.select([fd], [], [], WAIT_S)[0], "the adapter did not signal its eventfd in time"
    os.eventfd_read(fd)


def store(a, keys, objs):
    tid = a.submit_store_task(keys, objs)
    while True:
        wait(a.get_store_event_fd())
        done = a.pop_completed_store_tasks()
        if tid in done:
            return done[tid]


def lookup(a, keys) -> list[bool]:
    tid = a.submit_lookup_and_lock_task(keys, DESCS)
    while (r := a.query_lookup_and_lock_result(tid)) is None:
        wait(a.get_lookup_and_lock_event_fd())
    return [r.test(i) for i in range(len(keys))]


def load(a, keys, objs) -> list[bool]:
    tid = a.submit_load_task(keys, objs)
    while (r := a.query_load_result(tid)) is None:
        wait(a.get_load_event_fd())
    return [r.test(i) for i in range(len(keys))]


def unlock(a, keys) -> None:
    a.submit_unlock(keys)
    lookup(a, [])  # the fetch thread runs jobs in order: this answers after the unlock ran


@pytest.fixture(scope="module")
def adapter(module_daemon):
    a = build(socket_path=module_daemon.socket_path, timeout_s=5)
    yield a
    a.close()


def raw_client(socket_path: str, a: KVStoreL2Adapter, *ks: ObjectKey) -> tuple[KVStoreClient, list[bytes]]:
    """A client of the adapter's namespace for ``ks`` (objects of SHAPE, one model, rank and
    salt), to look at the daemon's side; and ``ks`` as kvstore keys there."""
    model_id, salt, nbytes = a.namespace(ks[0], [SHAPE], [torch.float16])
    s = EngineStore(DaemonTarget(socket_path, tenant_salt=salt), opaque_layout(nbytes), model_id)
    OPENED.append(s)
    return s.client, s.keys([k.chunk_hash for k in ks])


OPENED: list[EngineStore] = []


@pytest.fixture(autouse=True)
def _close_opened():
    yield
    while OPENED:
        OPENED.pop().close()


def test_loaded_by_lmcaches_plugin_loader(adapter):
    assert type(adapter) is KVStoreL2Adapter
    fds = {adapter.get_store_event_fd(), adapter.get_lookup_and_lock_event_fd(), adapter.get_load_event_fd()}
    assert len(fds) == 3


def test_store_lookup_lock_load_unlock_bit_exact(adapter, module_daemon):
    keys, src = [key(i) for i in range(4)], [obj(i) for i in range(4)]
    r = store(adapter, keys, src)
    assert r.is_successful() and r.bytes_transferred() == 4 * SHAPE.numel() * 2
    assert lookup(adapter, keys + [key(99)]) == [True] * 4 + [False]
    # Locked: the daemon refuses to drop them (Delete skips pinned blocks).
    client, k0 = raw_client(module_daemon.socket_path, adapter, keys[0])
    assert client.delete(k0) == 0
    dst = [obj() for _ in range(4)]
    assert load(adapter, keys, dst) == [True] * 4
    assert all(torch.equal(s.raw_tensor.view(torch.int16), d.raw_tensor.view(torch.int16)) for s, d in zip(src, dst))
    unlock(adapter, keys)
    assert client.delete(k0) == 1  # unlocked: evictable again
    assert lookup(adapter, keys) == [False] * 4


def test_evicted_before_load_is_a_clean_miss(adapter, module_daemon):
    keys, src = [key(i) for i in range(10, 13)], [obj(i) for i in range(10, 13)]
    assert store(adapter, keys, src).is_successful()
    client, k1 = raw_client(module_daemon.socket_path, adapter, keys[1])
    assert client.delete(k1) == 1  # gone, as an eviction would take it, with no lock held
    dst = [obj() for _ in range(3)]
    assert load(adapter, keys, dst) == [True, False, False]
    assert torch.equal(dst[0].raw_tensor, src[0].raw_tensor)
    assert not dst[1].raw_tensor.any() and not dst[2].raw_tensor.any()


def test_failed_store_is_never_visible(adapter):
    # Object group 1 holds objects larger than the daemon's whole DRAM tier: their store is
    # refused, the task fails, and nothing of them is visible; group 0's object is stored.
    huge = torch.Size([2, 1, 16, 1 << 20])  # 64 MiB of fp16
    meta = MemoryObjMetadata(shape=huge, dtype=torch.float16, address=0, phy_size=huge.numel() * 2, ref_count=1,
                             fmt=MemoryFormat.KV_2LTD)
    big = TensorMemoryObj(raw_data=torch.ones(huge, dtype=torch.float16), metadata=meta, parent_allocator=None)
    k_big = ObjectKey(chunk_hash=b"\x15" * 32, model_name="tiny/llama", kv_rank=0, object_group_id=1)
    r = store(adapter, [key(20), k_big], [obj(20), big])
    assert not r.is_successful()
    descs = {**DESCS, 1: MemoryLayoutDesc(shapes=[huge], dtypes=[torch.float16])}
    tid = adapter.submit_lookup_and_lock_task([key(20), k_big], descs)
    while (hits := adapter.query_lookup_and_lock_result(tid)) is None:
        wait(adapter.get_lookup_and_lock_event_fd())
    assert [hits.test(0), hits.test(1)] == [True, False]
    unlock(adapter, [key(20)])


def test_cache_salt_and_tenant_salt_keep_objects_apart(adapter, module_daemon, tmp_path):
    assert store(adapter, [key(30)], [obj(30)]).is_successful()
    assert lookup(adapter, [key(30, salt="user-b")]) == [False]
    salt = tmp_path / "salt"
    salt.write_text("tenant-b\n")
    salt.chmod(0o600)
    other = build(socket_path=module_daemon.socket_path, tenant_salt_file=str(salt))
    try:
        assert lookup(other, [key(30)]) == [False]
    finally:
        other.close()
    assert lookup(adapter, [key(30)]) == [True]
    unlock(adapter, [key(30)])


def test_a_lock_outlives_the_lease_ttl_until_unlocked(daemons):
    """With 0.6 s leases, a lock held for three TTLs keeps its objects (the adapter renews the
    lease); a plain pin of the same namespace, not renewed, lapses in that time."""
    d = daemons("--server-lease-ttl-s", "0.6", "--server-reaper-interval-s", "0.05")
    a = build(socket_path=d.socket_path)
    try:
        keys = [key(50), key(51)]
        assert store(a, keys, [obj(50), obj(51)]).is_successful()
        assert lookup(a, [keys[0]]) == [True]  # locks key 50
        client, (k50, k51) = raw_client(d.socket_path, a, *keys)
        plain = client.acquire([k51])  # pins key 51, never renewed
        assert plain.count == 1 and client.delete([k51]) == 0
        end = time.monotonic() + 1.8
        while time.monotonic() < end:
            assert client.delete([k50]) == 0, "the locked object became deletable: its lease lapsed"
            time.sleep(0.1)
        assert client.delete([k51]) == 1  # the unrenewed pin lapsed meanwhile
        unlock(a, [keys[0]])
        # The unlock's Release is not waited for (a read lease's release never is): the delete
        # may get there first on a loaded host, so it is tried until the release has landed.
        wait_for(lambda: client.delete([k50]) == 1, timeout_s=5, what="key 50 deletable once unlocked")
    finally:
        a.close()


def test_bad_config_is_refused_clearly(module_daemon, tmp_path):
    with pytest.raises(DaemonUnreachable, match="is `kvstore serve` running"):
        build(socket_path=str(tmp_path / "nobody.sock"), timeout_s=0.5)
    with pytest.raises(EngineTierConfigError, match="unknown setting 'sockett_path'"):
        build(sockett_path=module_daemon.socket_path)
    empty = tmp_path / "empty"
    empty.write_text("")
    empty.chmod(0o600)
    with pytest.raises(EngineTierConfigError, match="tenant salt is missing"):
        build(socket_path=module_daemon.socket_path, tenant_salt_file=str(empty))
    loose = tmp_path / "loose"
    loose.write_text("s")
    loose.chmod(0o644)
    with pytest.raises(EngineTierConfigError, match="chmod 600"):
        build(socket_path=module_daemon.socket_path, tenant_salt_file=str(loose))
    with pytest.raises(EngineTierConfigError, match="timeout_s"):
        build(socket_path=module_daemon.socket_path, timeout_s=0)


def test_lmcache_storage_manager_stores_to_and_prefetches_from_kvstore(module_daemon):
    """LMCache's own StorageManager (what its multiprocess server runs: L1 in DRAM, the store
    controller writing L1 objects down to L2, the prefetch controller bringing them back) with
    kvstore as its only L2, configured by the server's own arguments."""
    from lmcache.v1.distributed.config import add_storage_manager_args, parse_args_to_config
    from lmcache.v1.distributed.storage_manager import StorageManager
    from lmcache.v1.distributed.api import GroupedObjectKeys, PrefetchTaskSpec

    spec = {"type": "plugin", "module_path": "kvstore.clients.lmcache_l2", "class_name": "KVStoreL2Adapter",
            "adapter_params": {"socket_path": module_daemon.socket_path}}
    parser = add_storage_manager_args(argparse.ArgumentParser())
    sm = StorageManager(parse_args_to_config(parser.parse_args(
        ["--l1-size-gb", "0.05", "--eviction-policy", "LRU", "--l2-adapter", json.dumps(spec)])))
    try:
        (desc, l2), = sm.l2_adapters()
        assert type(l2) is KVStoreL2Adapter
        keys = [ObjectKey(chunk_hash=bytes([40 + i]) * 32, model_name="tiny/llama", kv_rank=0) for i in range(4)]
        layout = DESCS[0]
        objs = sm.reserve_write(keys, layout)
        src = {}
        for i, k in enumerate(keys):
            t = objs[k].tensor
            t.copy_(torch.randn(t.shape, generator=torch.Generator().manual_seed(40 + i)).to(t.dtype))
            src[k] = t.clone()
        sm.finish_write(keys)  # the store controller writes them to L2 in the background
        client, all_keys = raw_client(module_daemon.socket_path, l2, *keys)
        deadline = time.monotonic() + WAIT_S
        while client.lookup_keys(all_keys).hit_blocks < 4:
            assert time.monotonic() < deadline, "LMCache's store controller did not reach kvstore in time"
            time.sleep(0.01)
        # Gone from L1: only kvstore has them. The store controller's read lock on an object it
        # has just written to L2 may still be held (a loaded host): those are skipped, so retry.
        deleted = 0
        while True:
            d, skipped = sm.delete_l1_keys(keys)
            deleted += d
            if not skipped:
                break
            assert time.monotonic() < deadline, f"{skipped} of LMCache's L1 objects stayed locked"
            time.sleep(0.01)
        assert deleted == 4
        h = sm.submit_prefetch_task(PrefetchTaskSpec(key_groups=[GroupedObjectKeys(keys=keys, object_group_id=0,
                                                                                   layout_desc=layout)]))
        assert sm.wait_prefetch_status(h, WAIT_S)
        r = sm.query_prefetch_status(h)
        assert [r.l2_hit_cells[0].test(i) for i in range(4)] == [True] * 4
        with sm.read_prefetched_results(keys) as got:
            assert got is not None
            assert all(torch.equal(o.tensor.view(torch.int16), src[k].view(torch.int16)) for o, k in zip(got, keys))
        sm.finish_read_prefetched(keys)
        # The prefetch unlocks what it locked in kvstore; the adapter's worker thread does the
        # unlock after finish_read_prefetched returns, so it is awaited, not assumed.
        deadline, deleted = time.monotonic() + WAIT_S, 0
        while deleted < 4:
            assert time.monotonic() < deadline, f"only {deleted} of 4 unlocked after the read"
            deleted += client.delete(all_keys)
            time.sleep(0.01)
    finally:
        sm.close()
