"""Integration: the real daemon process, real shared memory, real gRPC."""

import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from kvstore.clients import KVStoreClient
from kvstore.clients.leases import PinnedPieces, ReadLease
from kvstore.layout import KVLayout
from kvstore.v1 import kvstore_pb2 as pb
from wait_util import wait_for


def _kv(layout: KVLayout, tokens: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    shape = layout.tensor_shape(tokens)
    if layout.dtype.label == "bf16":
        return torch.randn(shape, generator=g).to(torch.bfloat16)
    if layout.dtype.label == "fp8_e4m3":
        return torch.randn(shape, generator=g).to(torch.float8_e4m3fn)
    if layout.dtype.label == "fp16":
        return np.random.default_rng(seed).standard_normal(shape).astype(np.float16)
    return np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8)  # int8 / int4 packed


SHARE_DAEMON = True  # one daemon for the module: only the advice test counts daemon-wide, on one of its own

LAYOUTS = {
    "gqa-bf16": KVLayout(4, 2, 64, "bf16", "gqa"),
    "mha-fp16": KVLayout(3, 4, 32, "fp16", "mha", block_tokens=8),
    "mla-bf16": KVLayout(3, dtype="bf16", kind="mla", kv_lora_rank=64, qk_rope_head_dim=16),
    "gqa-fp8": KVLayout(4, 2, 64, "fp8", "gqa"),
    "gqa-int4": KVLayout(2, 2, 64, "int4", "gqa"),
}


def _bytes(t) -> bytes:
    if isinstance(t, torch.Tensor):
        return t.contiguous().view(torch.uint8).numpy().tobytes()
    return np.ascontiguousarray(t).tobytes()


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_put_get_round_trip_bit_exact(client_factory, name):
    layout = LAYOUTS[name]
    c = client_factory(layout, model_id=f"model-{name}")
    bt = layout.block_tokens
    tokens = list(range(1000, 1000 + 5 * bt + 3))  # 5 full blocks and a partial one
    kv = _kv(layout, len(tokens), 1)
    assert c.put(tokens, kv) == 5
    assert c.put(tokens, kv) == 0  # already cached: nothing stored twice
    assert c.lookup(tokens) == 5 * bt
    out = torch.zeros_like(kv) if isinstance(kv, torch.Tensor) else np.zeros_like(kv)
    assert c.get(tokens, out) == 5 * bt
    if isinstance(kv, torch.Tensor):
        got, want = out[..., : 5 * bt, :, :] if layout.kind.value != "mla" else out[:, : 5 * bt], \
            kv[..., : 5 * bt, :, :] if layout.kind.value != "mla" else kv[:, : 5 * bt]
    else:
        got, want = out[:, :, : 5 * bt], kv[:, :, : 5 * bt]
    assert _bytes(got) == _bytes(want)
    # The partial last block was not stored, and nothing past the prefix was written.
    tail = out[..., 5 * bt:, :, :] if layout.kind.value != "mla" else out[:, 5 * bt:]
    assert not _bytes(tail).strip(b"\0")


def test_lookup_stops_at_first_miss(client_factory):
    c = client_factory()
    bt = c.layout.block_tokens
    tokens = list(range(8 * bt))
    keys = c.keys(tokens)
    # Store blocks 0-2 and 4-7; block 3 is missing, so only 3 leading blocks hit.
    for i in [0, 1, 2, 4, 5, 6, 7]:
        with c.reserve([keys[i]], parent=keys[i - 1] if i else b"") as w:
            w.view(0)[:] = 7
    r = c.lookup_keys(keys)
    assert r.hit_blocks == 3 and r.tiers == bytes([pb.TIER_DRAM]) * 3
    assert c.lookup(tokens[:2 * bt + 5]) == 2 * bt
    assert c.lookup([99] * bt) == 0
    # A different first block shares nothing with the chain, even with the same later tokens.
    assert c.lookup([1] * bt + tokens[bt:]) == 0


def test_pinned_pieces_pin_what_is_there_from_where_the_last_piece_ended(client_factory):
    """Each Acquire names every key left and pins every leading one in DRAM: seven resident
    blocks in pieces of at least three come as one lease; a chain whose fourth block is missing
    gives its three, then an empty lease that ends the pieces."""
    c = client_factory()
    bt = c.layout.block_tokens
    tokens = list(range(500, 500 + 7 * bt))
    keys = c.keys(tokens)
    assert c.put(tokens, np.ones(c.layout.tensor_shape(len(tokens)), np.float16)) == 7
    with ThreadPoolExecutor(1) as ex, PinnedPieces(c, keys, 3, 0.0, ex) as pieces:
        got = [(want, lease.count, lease.offsets) for want, lease in pieces]
        again = c.acquire(keys)
        assert got == [(3, 7, again.offsets)]
        again.release(wait=True)
    assert c.delete(keys[3:]) == 0  # the pieces' lease is the caller's to release
    more = c.keys(list(range(500, 500 + 9 * bt)))  # the same chain two blocks on: not stored
    with ThreadPoolExecutor(1) as ex, PinnedPieces(c, keys[:3] + more[7:], 2, 0.0, ex) as pieces:
        got = [(want, lease.count) for want, lease in pieces]
        assert got == [(2, 3), (2, 0)]
    with ThreadPoolExecutor(1) as ex, PinnedPieces(c, [], 2, 0.0, ex) as pieces:
        assert list(pieces) == []  # nothing asked, no Acquire


def test_pinned_pieces_not_taken_are_released(client_factory):
    c = client_factory()
    bt = c.layout.block_tokens
    tokens = list(range(700, 700 + 7 * bt))
    keys = c.keys(tokens)
    assert c.put(tokens, np.ones(c.layout.tensor_shape(len(tokens)), np.float16)) == 7
    with ThreadPoolExecutor(1) as ex:
        pieces = PinnedPieces(c, keys, 3, 0.0, ex)
        pieces.close()  # before taking its lease: released as it answers
        assert list(pieces) == []
    assert wait_for(lambda: c.delete(keys) == 7, 10, "the untaken pieces' pins released")


def test_lookup_pins_a_dram_hit_for_another_client_to_release(client_factory):
    """LookupRequest.pin: an engine's scheduler pins the blocks its worker loads next; the
    worker (another session) copies them and releases the lease naming the scheduler's session."""
    sched, worker = client_factory(), client_factory()
    bt = sched.layout.block_tokens
    tokens = list(range(900, 900 + 6 * bt))
    keys = sched.keys(tokens)
    assert sched.put(tokens, np.ones(sched.layout.tensor_shape(len(tokens)), np.float16)) == 6
    assert sched.info.arena_id == worker.info.arena_id and len(sched.info.arena_id) == 16
    assert sched.lookup_keys(keys, pin=True).lease_id == 0  # pins only what is about to load
    r = sched.lookup_keys(keys + [os.urandom(32)], promote_from=2, promote_to=5, pin=True)  # a miss after 6 hits
    assert r.hit_blocks == 6 and r.lease_id
    same = worker.acquire(keys[2:5])
    assert list(r.offsets) == same.offsets
    same.release(wait=True)
    assert sched.delete(keys[5:]) == 1 and worker.delete(keys[2:5]) == 0  # pinned: not deleted
    # A scheduler whose daemon answered late drops its connection but not its session: the pins
    # the worker copies from stay until the worker releases them naming that session.
    sid = sched.session_id
    sched.close(end_session=False)
    assert worker.delete(keys[2:5]) == 0
    ReadLease(worker, pb.AcquireResponse(lease_id=r.lease_id), session_id=sid).release(wait=True)
    assert worker.delete(keys[2:5]) == 3


class SlowAcquires(KVStoreClient):
    """Records each Acquire's wait and takes ``delay_s`` over it."""

    def __init__(self, *a, delay_s: float = 0.0, **kw) -> None:
        super().__init__(*a, **kw)
        self.delay_s, self.waits = delay_s, []

    def acquire(self, keys, allow_partial=False, wait_s=0.0, min_blocks=0):
        """Pins ``min_blocks`` at most, as a daemon whose reads land one piece at a time would."""
        self.waits.append(wait_s)
        time.sleep(self.delay_s)
        return super().acquire(keys[:min_blocks or len(keys)], allow_partial, wait_s, min_blocks)


def test_pinned_pieces_wait_no_longer_than_one_acquire_would(daemon):
    c = SlowAcquires(daemon.socket_path, timeout_s=10, delay_s=0.2)
    try:
        c.register(KVLayout(4, 2, 64, "fp16"), "test-model")
        tokens = list(range(2000, 2000 + 4 * 16))
        keys = c.keys(tokens)
        assert c.put(tokens, np.ones(c.layout.tensor_shape(len(tokens)), np.float16)) == 4
        with ThreadPoolExecutor(1) as ex, PinnedPieces(c, keys, 1, 1.0, ex) as pieces:
            for _, lease in pieces:
                lease.release(wait=True)
        assert len(c.waits) == 4 and c.waits[0] <= 1.0 and c.waits == sorted(c.waits, reverse=True)
        assert c.waits[-1] <= 1.0 - 3 * 0.2  # the pieces share one deadline (each took 0.2 s more)
    finally:
        c.close()


def _hold_leases_and_die(sock: str, ready) -> None:
    c = KVStoreClient(sock)
    c.register(KVLayout(4, 2, 64, "fp16"), "test-model")
    keys = c.keys(list(range(4 * 16)))
    c.reserve(keys[:2]).view(0)[:] = 1        # write lease, never committed
    with c.reserve(keys[2:], parent=keys[1]):
        pass                                   # committed
    c.acquire(keys[2:])                        # read lease, never released
    ready.set()
    time.sleep(60)


def test_a_stopped_client_leaks_nothing_after_the_lease_ttl(daemons):
    # A client that hangs (SIGSTOP: alive, so its session stays, but silent) loses its leases at
    # their TTL; one that exits loses them at once (test_sessions.py). The TTL must outlast the
    # checks made before the stop (spawned child, new client, stats).
    d = daemons("--server-lease-ttl-s", "5", "--server-reaper-interval-s", "0.1")
    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    p = ctx.Process(target=_hold_leases_and_die, args=(d.socket_path, ready))
    p.start()
    assert ready.wait(30)
    c = KVStoreClient(d.socket_path)
    c.register(KVLayout(4, 2, 64, "fp16"), "test-model")
    dram = c.stats().tiers[0]
    assert dram.blocks == 4  # 2 reserved + 2 committed
    os.kill(p.pid, signal.SIGSTOP)
    wait_for(lambda: c.stats().counters["leases"] == 0, 30, "the silent client's leases to expire")
    os.kill(p.pid, signal.SIGKILL)
    p.join()
    st = c.stats()
    assert st.counters["leases"] == 0
    assert st.tiers[0].blocks == 2  # reserved slots freed, committed blocks kept
    assert st.counters["kvstore_lease_expiries_total"] == 2
    keys = c.keys(list(range(4 * 16)))
    # The pinned blocks are evictable again: deleting them is no longer refused as busy.
    assert c.delete(keys[2:]) == 2
    assert c.stats().tiers[0].used_bytes == 0
    c.close()


def _worker(sock: str, wid: int, rounds: int, q) -> None:
    """Writes and reads overlapping prefixes; every block's content is a function of its key,
    so any partial or foreign block is detected."""
    try:
        layout = KVLayout(2, 2, 64, "fp16")
        c = KVStoreClient(sock)
        c.register(layout, "shared-model")
        rng = np.random.default_rng(wid)
        bad = 0
        for r in range(rounds):
            prefix = int(rng.integers(0, 4))
            tokens = [prefix] * 64 + [int(x) for x in rng.integers(0, 3, 16 * int(rng.integers(1, 4)))]
            kv = np.empty(layout.tensor_shape(len(tokens)), np.float16)
            keys = c.keys(tokens)
            for i, k in enumerate(keys):
                kv[:, :, i * 16:(i + 1) * 16] = np.frombuffer(k * (kv[:, :, :16].nbytes // 32), np.float16).reshape(kv[:, :, :16].shape)
            c.put(tokens, kv)
            out = np.zeros_like(kv)
            n = c.get(tokens, out)
            bad += int(_bytes(out[:, :, :n]) != _bytes(kv[:, :, :n]))
        c.close()
        q.put((wid, bad, None))
    except Exception as e:  # report, don't hang the parent
        q.put((wid, -1, repr(e)))


def test_concurrent_clients_never_see_partial_or_foreign_blocks(daemon):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(daemon.socket_path, w, 40, q)) for w in range(4)]
    for p in procs:
        p.start()
    results = [q.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(30)
    assert sorted(r[0] for r in results) == [0, 1, 2, 3]
    assert all(r[2] is None for r in results), results
    assert all(r[1] == 0 for r in results), results
    assert daemon.alive()


def test_make_serve_defaults_reachable_by_kvstore_stats(tmp_path, daemons):
    """`kvstore serve` on its embedded defaults (only the socket dir moved into the test)."""
    moved = {"XDG_RUNTIME_DIR": str(tmp_path), "KVSTORE_METRICS_PORT": "0", "KVSTORE_DRAM_MAX_AUTO_BYTES": "256MiB"}
    env = {**os.environ, **moved}
    sock = tmp_path / "kvstore" / "kvstore.sock"
    daemons.launch([], str(sock), env=moved)
    assert oct(os.stat(sock).st_mode & 0o777) == "0o660"
    out = subprocess.run([sys.executable, "-m", "kvstore", "stats"], env=env, capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert "dram" in out.stdout and "0.250" in out.stdout
    js = subprocess.run([sys.executable, "-m", "kvstore", "stats", "--json"], env=env, capture_output=True, text=True, timeout=30)
    import json

    assert json.loads(js.stdout)["tiers"][0]["capacity_bytes"] == str(256 << 20)


def test_lookup_carries_the_load_or_recompute_advice(daemons):
    import urllib.request

    daemon = daemons()  # a fresh one: the test counts its policy decisions
    layout = KVLayout(4, 2, 64, "fp16")
    tokens = list(range(10 * 16))
    kv = np.ones(layout.tensor_shape(len(tokens)), np.float16)
    slow, fast = KVStoreClient(daemon.socket_path, timeout_s=10), KVStoreClient(daemon.socket_path, timeout_s=10)
    slow.register(layout, "slow-prefill", prefill_tokens_per_s=100.0)
    fast.register(layout, "fast-prefill", prefill_tokens_per_s=1e13)
    for c in (slow, fast):
        c.put(tokens, kv)
    a = slow.lookup_keys(slow.keys(tokens))
    assert a.hit_blocks == 10 and a.load_blocks == 10 and a.est_load_s < a.est_recompute_s
    assert a.est_recompute_s == pytest.approx(160 / 100.0, rel=0.05)
    b = fast.lookup_keys(fast.keys(tokens))
    assert b.hit_blocks == 10 and b.load_blocks == 0 and b.est_recompute_s < a.est_recompute_s
    assert "recompute" in b.reason
    text = urllib.request.urlopen(daemon.metrics_url, timeout=5).read().decode()
    assert 'kvstore_policy_decisions_total{decision="load"} 1.0' in text
    assert 'kvstore_policy_decisions_total{decision="recompute"} 1.0' in text
    slow.close()
    fast.close()
