"""The client GPU path on a real CUDA device: paged CUDA caches <-> pinned arena slots on a
side stream, ordered against the worker's compute stream by events, bit-exact."""

import numpy as np
import pytest
from cuda_env import daemon_skip_reason, requires_cuda

from kvstore.layout import KVLayout
from kvstore.tiers.arena import Arena

pytestmark = [pytest.mark.gpu, requires_cuda]

LAYOUT = KVLayout(4, 8, 128, "bf16")  # 64 KiB layer chunks, 256 KiB blocks
SPIN = 200_000_000  # cycles of torch.cuda._sleep: ~0.1 s, long enough to lose any race


def caches(num_blocks: int, block_size: int, seed=None):
    import torch

    g = torch.Generator(device="cuda").manual_seed(seed or 0)
    shape = (2, num_blocks, block_size, LAYOUT.num_kv_heads, LAYOUT.head_dim)
    if seed is None:
        return [torch.zeros(shape, dtype=torch.bfloat16, device="cuda") for _ in range(LAYOUT.num_layers)]
    return [torch.randn(shape, generator=g, device="cuda").to(torch.bfloat16) for _ in range(LAYOUT.num_layers)]


def gathered(paged, table, tokens: int):
    import torch

    rows = paged.token_rows(table, tokens).cuda()
    return torch.stack([paged.gather(l, rows) for l in range(len(paged.pages))]).cpu()


@pytest.fixture
def mover_factory():
    from kvstore.clients.hbm_paged import KVMover, PagedKV

    arena = Arena(64 * LAYOUT.block_bytes)
    made = []

    def make(kv):
        m = KVMover(PagedKV(kv, LAYOUT), LAYOUT, arena.buf)
        made.append(m)
        return m

    yield arena, make
    for m in made:
        m.close()
    arena.close()


def test_arena_is_pinned_and_path_is_not_emulated(mover_factory):
    import torch

    arena, make = mover_factory
    m = make(caches(4, 16, seed=1))
    assert not m.emulated and m.pin.pinned
    assert torch.from_numpy(arena.buf).is_pinned()
    assert m.stream.raw != torch.cuda.default_stream()


@pytest.mark.parametrize("bulk", [True, False])
def test_store_then_load_into_other_table_and_block_size(mover_factory, bulk):
    import torch

    _, make = mover_factory
    B, n = LAYOUT.block_bytes, 6
    src, dst = caches(32, 16, seed=2), caches(24, 32, seed=None)
    ms, md = make(src), make(dst)
    t_src, t_dst = [31, 3, 17, 8, 0, 22], [5, 11, 0]
    offsets = [B * i for i in (0, 1, 2, 5, 6, 9)]  # two runs of adjacent slots and one alone
    rows_s = ms.device_rows(ms.paged.token_rows(t_src, n * 16))
    rows_d = md.device_rows(md.paged.token_rows(t_dst, n * 16))
    if bulk:
        ms.store_all(rows_s, offsets).synchronize()
        evs = md.load_all(rows_d, offsets)
    else:
        for l in range(LAYOUT.num_layers):
            ms.store_layer(l, rows_s, offsets)
        ms.stream.synchronize()
        evs = [md.load_layer(l, rows_d, offsets) for l in range(LAYOUT.num_layers)]
    for ev in evs:
        ev.synchronize()
    torch.cuda.synchronize()
    assert torch.equal(gathered(ms.paged, t_src, n * 16), gathered(md.paged, t_dst, n * 16))


def test_compute_stream_waits_for_layer_l_only(mover_factory):
    """The side stream is held back by a spin; a clone on the compute stream after
    ``wait_event(layer 0)`` must see layer 0 loaded (without the wait it would see zeros)."""
    import torch

    _, make = mover_factory
    B, n = LAYOUT.block_bytes, 4
    src, dst = caches(8, 16, seed=3), caches(8, 16, seed=None)
    ms, md = make(src), make(dst)
    offsets = [B * i for i in range(n)]
    ms.store_all(ms.device_rows(ms.paged.token_rows([0, 1, 2, 3], 64)), offsets).synchronize()
    rows = md.device_rows(md.paged.token_rows([7, 6, 5, 4], 64))
    md.stream.submit(lambda: torch.cuda._sleep(SPIN))
    evs = [md.load_layer(l, rows, offsets) for l in range(LAYOUT.num_layers)]
    assert not evs[0].query()
    compute = torch.cuda.current_stream()
    compute.wait_event(evs[0].raw)
    snap = dst[0].clone()  # on the compute stream, after layer 0 only
    torch.cuda.synchronize()
    assert torch.equal(snap, dst[0]) and snap.abs().sum() > 0
    assert torch.equal(gathered(ms.paged, [0, 1, 2, 3], 64), gathered(md.paged, [7, 6, 5, 4], 64))


def test_store_waits_for_the_compute_stream(mover_factory):
    """``after`` (default: the current stream) orders the gather behind the kernel that
    produced the KV."""
    import torch

    arena, make = mover_factory
    src = caches(2, 16, seed=4)
    m = make(src)
    rows = m.device_rows(m.paged.token_rows([1], 16))
    torch.cuda._sleep(SPIN)  # the "attention kernel" on the compute stream...
    src[0].fill_(1.0)  # ...that writes layer 0
    m.after(None)
    m.store_layer(0, rows, [0]).synchronize()
    got = np.frombuffer(arena.buf[:LAYOUT.layer_chunk_bytes].tobytes(), dtype=np.uint16)
    assert (got == 0x3F80).all()  # bf16 1.0


def test_daemon_round_trip(tmp_path):
    reason = daemon_skip_reason()
    if reason:
        pytest.skip(reason)
    import torch
    from daemon_util import start_daemon

    from kvstore.clients import KVStoreClient
    from kvstore.clients.gpu import GpuKVPath, PagedKV

    d = start_daemon(tmp_path)
    try:
        with KVStoreClient(d.socket_path, timeout_s=10) as c:
            c.register(LAYOUT, "gpu-model")
            ids = list(range(5 * 16 + 3))
            src, dst = caches(16, 16, seed=5), caches(12, 8, seed=None)
            t_src, t_dst = [15, 2, 9, 4, 11, 1], [3, 1, 10, 0, 7, 5, 2, 11, 6, 8]
            with GpuKVPath(c, src) as path:
                assert not path.emulated
                assert path.store(ids, t_src).commit(30) == 5
            with GpuKVPath(c, dst) as path, path.load(ids, t_dst) as h:
                for l in range(LAYOUT.num_layers):
                    h.wait_layer(l)
                assert h.tokens == 80
            torch.cuda.synchronize()
            assert torch.equal(gathered(PagedKV(src, LAYOUT), t_src, 80), gathered(PagedKV(dst, LAYOUT), t_dst, 80))
    finally:
        d.stop_cleanly()


@pytest.mark.parametrize("path", ["zerocopy", "legacy"])
def test_tp_ranks_write_their_heads_of_one_block(path):
    """Two TP=2 ranks' CUDA caches (4 of 8 KV heads each) store into the same pinned slots: the
    slots hold a TP=1 cache's blocks byte for byte, and each rank loads its heads back."""
    import torch

    from kvstore.clients.hbm_paged import KVMover, PagedKV, wait_events
    from kvstore.layout import HeadShard

    full, table = caches(8, 16, seed=3), [5, 1, 6]
    offsets = [2 * LAYOUT.block_bytes, 0, 4 * LAYOUT.block_bytes]
    arena, ref = Arena(6 * LAYOUT.block_bytes), Arena(6 * LAYOUT.block_bytes)
    try:
        whole = KVMover(PagedKV(full, LAYOUT), LAYOUT, ref.buf, "legacy")
        rows = whole.paged.token_rows(table, 3 * 16)
        wait_events([whole.store_all(whole.device_rows(rows), offsets)])
        whole.close()
        shards = [HeadShard.of_rank(8, r, 2) for r in range(2)]
        mine = {}
        for s in shards:
            kv = [t[:, :, :, s.first:s.first + s.count].contiguous() for t in full]
            m = KVMover(PagedKV(kv, s.local(LAYOUT)), LAYOUT, arena.buf, path, shard=s)
            assert m.copy_path.value == path, m.copy_reason
            wait_events([m.store_all(m.device_rows(rows), offsets)])
            m.close()
            mine[s.part] = kv
        assert np.array_equal(arena.buf, ref.buf)
        for s in shards:
            dst = [torch.zeros_like(t) for t in mine[s.part]]
            m = KVMover(PagedKV(dst, s.local(LAYOUT)), LAYOUT, arena.buf, path, shard=s)
            wait_events(m.load_all(m.device_rows(rows), offsets))
            m.close()
            assert all(torch.equal(a[:, table], b[:, table]) for a, b in zip(dst, mine[s.part]))
    finally:
        arena.close(), ref.close()
