"""One block layout for every TP size: blocks hold every KV head of their tokens, each TP rank
writes its heads as one part of the block (Reserve's part/parts) and the daemon shows the block
only when every part is committed. Real daemon processes, real client copy path (emulated
device: CPU tensors); a TP=2 or TP=4 rank's cache is its slice of the heads of a TP=1 cache, as
vLLM and SGLang shard them."""

import multiprocessing as mp
import os
import signal

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from kvstore.clients import KVStoreClient  # noqa: E402
from kvstore.clients.gpu import GpuKVPath  # noqa: E402
from kvstore.clients.leases import RESERVED  # noqa: E402
from kvstore.layout import HeadShard, KVLayout, LayoutError  # noqa: E402
from kvstore.v1 import kvstore_pb2 as pb  # noqa: E402

from wait_util import wait_for  # noqa: E402

LAYOUT = KVLayout(3, 4, 32, "bf16", block_tokens=16)  # 4 KV heads: TP=2 holds 2 each, TP=4 one
BT = LAYOUT.block_tokens
NUM_BLOCKS = 12


def caches(seed: int, heads: int = 4, block_size: int = BT) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn((2, NUM_BLOCKS, block_size, heads, LAYOUT.head_dim), generator=g).to(torch.bfloat16)
            for _ in range(LAYOUT.num_layers)]


def heads_of(full: list[torch.Tensor], shard: HeadShard) -> list[torch.Tensor]:
    """A rank's own cache: its heads of the TP=1 cache, contiguous (what the engine allocates)."""
    return [t[:, :, :, shard.first:shard.first + shard.count].contiguous() for t in full]


def tokens(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 30000, n).tolist()


def client(sock: str, shard: HeadShard | None = None, model: str = "shards") -> KVStoreClient:
    c = KVStoreClient(sock, timeout_s=10)
    c.register(LAYOUT, model)  # the namespace of every TP size: TP=1's
    c.shard = shard
    return c


def hits(c: KVStoreClient, toks) -> int:
    return c.lookup_keys(c.keys(toks)).hit_blocks


# --- the shard arithmetic ----------------------------------------------------------------------

def test_heads_split_as_the_engines_split_them():
    assert [HeadShard.of_rank(4, r, 2) for r in range(2)] == [HeadShard(0, 2, 0, 2), HeadShard(2, 2, 1, 2)]
    # Fewer KV heads than ranks: each head on two ranks, the first of them writes it.
    tp4 = [HeadShard.of_rank(2, r, 4) for r in range(4)]
    assert [(s.first, s.part, s.parts, s.writes) for s in tp4] == [(0, 0, 2, True), (0, 0, 2, False),
                                                                   (1, 1, 2, True), (1, 1, 2, False)]
    assert HeadShard.of_rank(4, 1, 2).columns(LAYOUT) == (2 * 32 * 2, 4 * 32 * 2)
    assert HeadShard.of_rank(4, 1, 2).local(LAYOUT).block_bytes * 2 == LAYOUT.block_bytes
    with pytest.raises(LayoutError, match="do not split over 4 ranks"):
        HeadShard.of_rank(6, 0, 4)
    with pytest.raises(LayoutError, match="mla block has no KV heads"):
        HeadShard.of_rank(4, 0, 2).columns(KVLayout(2, kind="mla", kv_lora_rank=64, dtype="bf16"))


# --- the real daemon ---------------------------------------------------------------------------

@pytest.mark.parametrize("vllm_block", [BT, 8], ids=["whole-pages", "token-rows"])
def test_tp2_ranks_write_the_block_tp1_reads_and_back(daemon, vllm_block):
    """Two ranks each write their heads; the block is a miss until both committed, then it is
    byte for byte the block a TP=1 engine writes for the same KV, and a TP=1 engine's block
    loads into each rank's heads. Both copy paths of the CPU caches: whole pages (vLLM's block
    is kvstore's) and token rows (it is not)."""
    full = caches(1, block_size=vllm_block)
    table = list(range(NUM_BLOCKS))
    toks = tokens(5 * BT, seed=vllm_block)
    shards = [HeadShard.of_rank(4, r, 2) for r in range(2)]
    ranks = [client(daemon.socket_path, s) for s in shards]
    one = client(daemon.socket_path)
    paths = [GpuKVPath(c, heads_of(full, s)) for c, s in zip(ranks, shards)]
    try:
        h0 = paths[0].store(toks, table)
        assert h0.wait(10) and h0.commit() == 0      # rank 0's part alone publishes nothing
        assert hits(one, toks) == 0
        h1 = paths[1].begin_store(toks, table)
        assert [s for w in h1.leases for s in w.states] == [RESERVED] * 5  # joined rank 0's slots
        h1.store_all()
        assert h1.wait(10) and h1.commit() == 5      # the last part makes the blocks readable
        assert hits(one, toks) == 5
        # A TP=1 engine's block for the same KV is the same bytes.
        with GpuKVPath(one, full) as whole:
            dst = [torch.zeros_like(t) for t in full]
            with GpuKVPath(one, dst) as into:
                with into.load(toks, table) as h:
                    assert h.wait(10)
            assert all(torch.equal(a[:, :5 * BT // vllm_block], b[:, :5 * BT // vllm_block]) for a, b in zip(dst, full))
            # And back: TP=1 writes, each TP=2 rank loads its heads.
            other = tokens(3 * BT, seed=100 + vllm_block)
            w = whole.store(other, table)
            assert w.wait(10) and w.commit() == 3
        for p, s in zip(paths, shards):
            mine = [torch.zeros_like(t) for t in heads_of(full, s)]
            with GpuKVPath(p.client, mine) as into, into.load(other, table) as h:
                assert h.wait(10) and h.blocks == 3
            n = 3 * BT // vllm_block
            assert all(torch.equal(a[:, :n], b[:, :n]) for a, b in zip(mine, heads_of(full, s)))
    finally:
        for p in paths:
            p.close()
        for c in (*ranks, one):
            c.close()


def test_replicated_heads_one_writer_each(daemon):
    """Two KV heads at TP=4: ranks 0 and 2 write head 0 and 1; ranks 1 and 3 hold copies and
    only read. The block is visible once both writers committed."""
    layout2 = KVLayout(3, 2, 32, "bf16", block_tokens=BT)
    full = [t[:, :, :, :2].contiguous() for t in caches(2)]
    toks = tokens(2 * BT, seed=7)
    shards = [HeadShard.of_rank(2, r, 4) for r in range(4)]
    cs = []
    for s in shards:
        c = KVStoreClient(daemon.socket_path, timeout_s=10)
        c.register(layout2, "shards-tp4")
        c.shard = s
        cs.append(c)
    try:
        for c, s in zip(cs, shards):
            if s.writes:
                with GpuKVPath(c, [t[:, :, :, s.first:s.first + 1].contiguous() for t in full]) as p:
                    h = p.store(toks, range(NUM_BLOCKS))
                    assert h.wait(10)
                    h.commit()
        assert hits(cs[1], toks) == 2
        # A TP=1 engine of the model reads both heads of it.
        plain = KVStoreClient(daemon.socket_path, timeout_s=10)
        plain.register(layout2, "shards-tp4")
        got = [torch.zeros_like(t) for t in full]
        with GpuKVPath(plain, got) as p, p.load(toks, range(NUM_BLOCKS)) as h:
            assert h.wait(10) and h.blocks == 2
        assert all(torch.equal(a[:, :2], b[:, :2]) for a, b in zip(got, full))
        plain.close()
    finally:
        for c in cs:
            c.close()


def _reserve_part_and_die(sock: str, toks, ready) -> None:
    c = client(sock, HeadShard.of_rank(4, 1, 2))
    w = c.reserve(c.keys(toks))
    w.view(0)[:] = 7  # half-written, never committed
    ready.set()
    signal.pause()


def test_a_writer_killed_between_parts_leaves_a_miss(daemons):
    """Rank 0 commits its part; rank 1 is SIGKILLed with its part reserved: the block never
    becomes visible, its slot is freed, and the prefix is written afresh later."""
    d = daemons("--server-session-ttl-s", "600", "--server-lease-ttl-s", "600")
    toks = tokens(2 * BT, seed=11)
    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    p = ctx.Process(target=_reserve_part_and_die, args=(d.socket_path, toks, ready))
    p.start()
    assert ready.wait(60)
    r0 = client(d.socket_path, HeadShard.of_rank(4, 0, 2))
    obs = client(d.socket_path)
    try:
        w = r0.reserve(r0.keys(toks))
        assert bytes(w.states) == bytes([pb.SLOT_RESERVED] * 2)  # joined the dying rank's blocks
        assert w.commit() == 0 and hits(obs, toks) == 0
        assert obs.stats().tiers[0].blocks == 2
        os.kill(p.pid, signal.SIGKILL)
        p.join()
        wait_for(lambda: obs.stats().tiers[0].blocks == 0, 30, "the dead writer's slots to be freed")
        assert hits(obs, toks) == 0
        again = [client(d.socket_path, HeadShard.of_rank(4, r, 2)) for r in range(2)]
        ws = [c.reserve(c.keys(toks)) for c in again]  # a fresh block: no part is left over
        assert all(bytes(w.states) == bytes([pb.SLOT_RESERVED] * 2) for w in ws)
        assert [w.commit() for w in ws] == [0, 2] and hits(obs, toks) == 2
        for c in again:
            c.close()
    finally:
        r0.close()
        obs.close()


def test_parts_refused_or_busy_as_they_should_be(daemon):
    toks = tokens(BT, seed=12)
    a, b, c = (client(daemon.socket_path, HeadShard.of_rank(4, r, 2)) for r in (0, 0, 1))
    one = client(daemon.socket_path)
    try:
        keys = a.keys(toks)
        w = a.reserve(keys)
        assert bytes(b.reserve(keys).states) == bytes([pb.SLOT_BUSY])   # its part is being written
        assert bytes(one.reserve(keys).states) == bytes([pb.SLOT_BUSY])  # a whole-block writer waits too
        four = client(daemon.socket_path, HeadShard.of_rank(4, 1, 4))
        assert bytes(four.reserve(keys).states) == bytes([pb.SLOT_BUSY])  # another split: not mixed
        four.close()
        for req, why in [(pb.ReserveRequest(keys=b"".join(keys), part=2, parts=2), "part: 2 of 2 parts"),
                         (pb.ReserveRequest(keys=b"".join(keys), part=0, parts=1000), "at most 256 parts"),
                         (pb.ReserveRequest(keys=b"".join(keys), part=1, parts=2, doorbell=True), "no layer doorbell")]:
            req.session_id = c.session_id
            with pytest.raises(Exception) as e:
                c.call("Reserve", req)
            assert e.value.code.name == "INVALID_ARGUMENT" and why in str(e.value)
        w.abort()  # rank 0 gives up: the block is gone; rank 1 starts a new one
        w1 = c.reserve(keys)
        assert bytes(w1.states) == bytes([pb.SLOT_RESERVED])
        assert w1.commit() == 0 and hits(one, toks) == 0
        assert a.reserve(keys).commit() == 1 and hits(one, toks) == 1
        assert bytes(b.reserve(keys).states) == bytes([pb.SLOT_PRESENT])
    finally:
        for x in (a, b, c, one):
            x.close()


# --- the copy paths a TP rank's heads take: legacy and the zero-copy kernels (emulated) ----------

@pytest.mark.parametrize("path", ["legacy", "zerocopy", "staged"])
@pytest.mark.parametrize("layerwise", [True, False], ids=["layerwise", "bulk"])
def test_each_copy_path_writes_and_reads_a_ranks_heads_in_place(monkeypatch, path, layerwise):
    """Two TP=2 ranks store their heads into the same slots, through one copy path: the slots
    hold what a TP=1 cache stores, byte for byte; each rank loads its heads back. The zero-copy
    kernels run EMULATED in Triton's interpreter (no GPU figure); staged falls back to legacy."""
    pytest.importorskip("triton")
    from kvstore.clients.hbm_paged import KVMover, PagedKV, wait_events
    from kvstore.tiers.arena import Arena

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    full, n = caches(5), 3
    table = [7, 2, 9]
    offsets = [3 * LAYOUT.block_bytes, 0, LAYOUT.block_bytes]  # scattered slots
    arena, ref = Arena(4 * LAYOUT.block_bytes, prefault=False), Arena(4 * LAYOUT.block_bytes, prefault=False)
    try:
        whole = KVMover(PagedKV(full, LAYOUT), LAYOUT, ref.buf, "legacy")
        rows = whole.paged.token_rows(table, n * BT)
        wait_events([whole.store_all(rows, offsets)])
        whole.close()
        shards = [HeadShard.of_rank(4, r, 2) for r in range(2)]
        for s in shards:
            m = KVMover(PagedKV(heads_of(full, s), s.local(LAYOUT)), LAYOUT, arena.buf, path, shard=s)
            assert m.copy_path.value == ("legacy" if path == "staged" else path), m.copy_reason
            ops = [m.store_layer(l, rows, offsets) for l in range(LAYOUT.num_layers)] if layerwise else \
                [m.store_all(rows, offsets)]
            wait_events(ops)
            m.close()
        assert ref.buf.any() and np.array_equal(arena.buf, ref.buf)
        for s in shards:
            mine = [torch.zeros_like(t) for t in heads_of(full, s)]
            m = KVMover(PagedKV(mine, s.local(LAYOUT)), LAYOUT, arena.buf, path, shard=s)
            ops = [m.load_layer(l, rows, offsets) for l in range(LAYOUT.num_layers)] if layerwise else \
                m.load_all(rows, offsets)
            wait_events(ops)
            m.close()
            want = heads_of(full, s)
            assert all(torch.equal(a[:, table], b[:, table]) for a, b in zip(mine, want))
    finally:
        arena.close(), ref.close()
