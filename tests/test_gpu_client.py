"""The client GPU path against a real daemon, on the emulated device (CPU tensors, copy
threads for streams): paged cache -> kvstore -> another paged cache with another block table
and block size, bit-exact; same bytes as the plain client's put/get; layer-wise waits in order;
failed copies never committed."""

import threading

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from kvstore.clients.client import KVStoreError  # noqa: E402
from kvstore.clients.gpu import GpuKVPath, KVMover, PagedKV  # noqa: E402
from kvstore.layout import KVLayout  # noqa: E402
from kvstore.tiers.arena import slot_runs as _runs  # noqa: E402

LAYOUT = KVLayout(4, 2, 64, "fp16")  # 32 KiB blocks: adjacent slots, bulk DMA coalesces
ODD = KVLayout(3, 1, 40, "fp16")  # 7680-byte blocks in 8 KiB slots: never adjacent
MLA = KVLayout(2, kind="mla", kv_lora_rank=64, qk_rope_head_dim=16, dtype="bf16")
SHARE_DAEMON = True  # each test keeps to tokens or a model id of its own; its clients close, leaving no lease


def paged(layout: KVLayout, num_blocks: int, block_size: int, seed: int | None = 0):
    """Per-layer caches ``[2, num_blocks, block_size, heads, dim]`` (MLA: no leading 2)."""
    g = torch.Generator().manual_seed(seed or 0)
    dt = torch.bfloat16 if layout.dtype.label == "bf16" else torch.float16
    if layout.kind.value == "mla":
        shape = (num_blocks, block_size, layout.kv_lora_rank + layout.qk_rope_head_dim)
    else:
        shape = (2, num_blocks, block_size, layout.num_kv_heads, layout.head_dim)
    make = (lambda: torch.randn(shape, generator=g).to(dt)) if seed is not None else (lambda: torch.zeros(shape, dtype=dt))
    return [make() for _ in range(layout.num_layers)]


def layer_major(layout: KVLayout, caches, table, tokens: int) -> torch.Tensor:
    """What the plain client stores: ``layout.tensor_shape(tokens)`` gathered through ``table``."""
    p = PagedKV(caches, layout)
    rows = p.token_rows(table, tokens)
    return torch.stack([p.gather(l, rows) for l in range(layout.num_layers)]).reshape(-1)  # bytes, layer-major


def same_tokens(layout, a, table_a, b, table_b, tokens) -> bool:
    return torch.equal(layer_major(layout, a, table_a, tokens), layer_major(layout, b, table_b, tokens))


def prompt(n_tokens: int, seed: int = 1) -> list[int]:
    return np.random.default_rng(seed).integers(0, 32000, n_tokens).tolist()


def tables(num_blocks: int, n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).permutation(num_blocks)[:n].tolist()


@pytest.mark.parametrize("bs_src,bs_dst", [(16, 16), (8, 32), (32, 8)])
@pytest.mark.parametrize("layerwise_store,layerwise_load", [(False, True), (True, False)])
def test_round_trip_other_table_and_block_size(client_factory, bs_src, bs_dst, layerwise_store, layerwise_load):
    c = client_factory(LAYOUT, model_id=f"round-trip-{bs_src}-{bs_dst}-{layerwise_store}")
    ids = prompt(5 * 16 + 7)  # 5 full blocks; the 7-token tail is never stored
    src, t_src = paged(LAYOUT, 40, bs_src, seed=1), tables(40, -(-87 // bs_src), seed=2)
    dst, t_dst = paged(LAYOUT, 24, bs_dst, seed=None), tables(24, -(-87 // bs_dst), seed=3)
    with GpuKVPath(c, src) as path:
        assert path.emulated and "CPU tensors" in path.reason
        h = path.begin_store(ids, t_src)
        if layerwise_store:
            for l in range(LAYOUT.num_layers):
                h.store_layer(l)
        else:
            h.store_all()
        assert (h.blocks, h.commit(30)) == (5, 5)
    with GpuKVPath(c, dst) as path, path.load(ids, t_dst, layerwise=layerwise_load) as h:
        assert (h.blocks, h.tokens) == (5, 80)
        for l in range(LAYOUT.num_layers):
            h.wait_layer(l, timeout_s=30)
    assert same_tokens(LAYOUT, src, t_src, dst, t_dst, 80)
    untouched = torch.ones(24, bs_dst, dtype=torch.bool)  # [blocks, tokens]
    rows = PagedKV(dst, LAYOUT).token_rows(t_dst, 80)
    untouched[rows[:, 0], rows[:, 1]] = False
    assert all((c[:, untouched] == 0).all() for c in dst)


def test_same_bytes_as_the_plain_client(client_factory):
    """GPU-path blocks read back through ``get``, and ``put`` blocks load through the GPU path."""
    c = client_factory(LAYOUT)
    ids_a, ids_b = prompt(64, seed=5), prompt(48, seed=6)
    src, t_src = paged(LAYOUT, 16, 16, seed=7), tables(16, 4, seed=8)
    with GpuKVPath(c, src) as path:
        path.store(ids_a, t_src).commit(30)
    out = torch.zeros(LAYOUT.tensor_shape(64), dtype=torch.float16)
    assert c.get(ids_a, out) == 64
    assert torch.equal(out.view(torch.uint8).reshape(-1), layer_major(LAYOUT, src, t_src, 64))

    kv = torch.randn(LAYOUT.tensor_shape(48)).to(torch.float16)
    assert c.put(ids_b, kv) == 3
    dst, t_dst = paged(LAYOUT, 8, 16, seed=None), [5, 2, 7]
    with GpuKVPath(c, dst) as path, path.load(ids_b, t_dst) as h:
        assert h.tokens == 48
    assert torch.equal(layer_major(LAYOUT, dst, t_dst, 48), kv.view(torch.uint8).reshape(-1))


@pytest.mark.parametrize("layout", [ODD, MLA], ids=["unaligned-blocks", "mla"])
def test_round_trip_other_layouts(client_factory, layout):
    c = client_factory(layout, model_id=f"m-{layout.kind.value}-{layout.num_layers}")
    ids = prompt(3 * 16)
    src, t_src = paged(layout, 10, 16, seed=11), [9, 0, 4]
    dst, t_dst = paged(layout, 6, 16, seed=None), [1, 5, 3]
    with GpuKVPath(c, src) as path:
        assert path.store(ids, t_src).commit(30) == 3
    with GpuKVPath(c, dst) as path, path.load(ids, t_dst, layerwise=False) as h:
        assert h.tokens == 48
    assert same_tokens(layout, src, t_src, dst, t_dst, 48)


def test_layer_waits_in_order(client_factory, monkeypatch):
    c = client_factory(LAYOUT)
    ids = prompt(4 * 16, seed=21)
    src, t_src = paged(LAYOUT, 8, 16, seed=22), [7, 6, 5, 4]
    with GpuKVPath(c, src) as path:
        path.store(ids, t_src).commit(30)
    dst, t_dst = paged(LAYOUT, 8, 16, seed=None), [0, 2, 4, 6]
    with GpuKVPath(c, dst) as path:
        order = []
        for name in ("scatter", "scatter_blocks"):  # token rows or whole blocks: whichever runs
            real = getattr(path.paged, name)
            monkeypatch.setattr(path.paged, name, lambda l, *a, real=real: (real(l, *a), order.append(l)))
        if path.mover.native is not None:  # the C whole-block copies
            real = path.mover.native.run
            monkeypatch.setattr(path.mover.native, "run",
                                lambda idx, offs, layers, to_slots: (real(idx, offs, layers, to_slots), order.extend(layers)))
        gate = threading.Event()
        path.mover.stream.submit(lambda: gate.wait(30))  # hold the side stream
        h = path.load(ids, t_dst)
        assert not any(h.layer_ready(l) for l in range(LAYOUT.num_layers))
        with pytest.raises(TimeoutError):
            h.wait_layer(0, timeout_s=0.05)
        gate.set()
        for l in range(LAYOUT.num_layers):
            h.wait_layer(l, timeout_s=30)
            assert all(h.layer_ready(k) for k in range(l + 1))  # earlier layers are resident too
            expect = layer_major(KVLayout(1, 2, 64, "fp16"), [src[l]], t_src, 64)
            assert torch.equal(layer_major(KVLayout(1, 2, 64, "fp16"), [dst[l]], t_dst, 64), expect)
        h.release()
    assert order == [0, 1, 2, 3]


def test_load_starts_after_the_given_work(client_factory):
    """``after`` holds the copies back until the worker's earlier work on those blocks ran."""
    from kvstore.tiers.hbm_device import EmuStream

    c = client_factory(LAYOUT)
    ids = prompt(2 * 16, seed=25)
    src = paged(LAYOUT, 4, 16, seed=26)
    compute = EmuStream()
    try:
        with GpuKVPath(c, src) as path:
            path.store(ids, [0, 1]).commit(30)
            gate = threading.Event()
            compute.submit(lambda: gate.wait(30))  # a kernel still reading blocks 2 and 3
            with path.load(ids, [2, 3], after=compute) as h:
                assert not h.wait(0.05)
                gate.set()
                assert h.wait(30)
        assert same_tokens(LAYOUT, src, [0, 1], src, [2, 3], 32)
    finally:
        compute.close()


def test_partial_hit_loads_the_cached_prefix(client_factory):
    c = client_factory(LAYOUT)
    ids = prompt(6 * 16, seed=31)
    src = paged(LAYOUT, 8, 16, seed=32)
    with GpuKVPath(c, src) as path:
        path.store(ids[:2 * 16], [0, 1]).commit(30)
        with path.load(ids, [2, 3, 4, 5, 6, 7]) as h:
            assert (h.blocks, h.tokens) == (2, 32)
        assert same_tokens(LAYOUT, src, [0, 1], src, [2, 3], 32)
        # A table with room for one block loads one block, not more.
        with path.load(ids, [6]) as h:
            assert h.tokens == 16
    assert c.lookup(ids) == 32


def test_a_lease_on_another_mapping_is_never_copied(client_factory):
    """A lease answered to another mapping of an arena (another client's; in a worker, the
    client's mapping before another thread's call registered it anew with a restarted daemon)
    names offsets this path does not copy from: refused and ended, never copied."""
    c, other = client_factory(LAYOUT), client_factory(LAYOUT)
    ids = prompt(2 * 16, seed=141)
    with GpuKVPath(c, paged(LAYOUT, 4, 16, seed=142)) as path:
        path.store(ids, [0, 1]).commit(30)
        keys = c.keys(ids)
        path.check_arena([c.acquire(keys)])  # its own mapping's lease: fine
        foreign = other.acquire(keys)
        with pytest.raises(KVStoreError, match="new arena"):
            path.check_arena([foreign])
        assert foreign.lease_id == 0  # ended


def test_blocks_already_cached_are_skipped(client_factory):
    c = client_factory(LAYOUT)
    ids = prompt(3 * 16, seed=41)
    kv = torch.randn(LAYOUT.tensor_shape(16)).to(torch.float16)
    assert c.put(ids[:16], kv) == 1
    src, t = paged(LAYOUT, 4, 16, seed=42), [3, 1, 2]
    with GpuKVPath(c, src) as path:
        h = path.store(ids, t)
        assert h.blocks == 2 and h.commit(30) == 2
    out = torch.zeros(LAYOUT.tensor_shape(48), dtype=torch.float16)
    assert c.get(ids, out) == 48
    assert torch.equal(out[:, :, :16], kv)  # the first block kept its original bytes


def test_failed_copy_is_never_committed(client_factory, monkeypatch):
    c = client_factory(LAYOUT)
    ids = prompt(2 * 16, seed=51)
    with GpuKVPath(c, paged(LAYOUT, 4, 16, seed=52)) as path:
        fail = lambda *a: (_ for _ in ()).throw(OSError("injected"))  # noqa: E731
        monkeypatch.setattr(path.mover, "_gather", fail)  # token rows or whole blocks: whichever runs
        monkeypatch.setattr(path.paged, "gather_blocks", fail)
        if path.mover.native is not None:  # the C whole-block copies
            monkeypatch.setattr(path.mover.native, "run", fail)
        h = path.store(ids, [0, 1])
        with pytest.raises(OSError, match="injected"):
            h.commit(30)
    assert c.lookup(ids) == 0
    assert c.stats().counters["leases"] == 0


def test_commit_with_layers_missing_aborts(client_factory):
    c = client_factory(LAYOUT)
    ids = prompt(16, seed=61)
    with GpuKVPath(c, paged(LAYOUT, 2, 16, seed=62)) as path:
        h = path.begin_store(ids, [1])
        h.store_layer(0)
        with pytest.raises(RuntimeError, match="1 of 4 layers"):
            h.commit(30)
        with pytest.raises(ValueError, match="already stored"):
            h.store_layer(0)
    assert c.lookup(ids) == 0


def test_bad_caches_and_tables_are_refused_without_leaking_leases(client_factory):
    c = client_factory(LAYOUT)
    ids = prompt(2 * 16, seed=71)
    with pytest.raises(ValueError, match="3 layer tensors"):
        GpuKVPath(c, paged(LAYOUT, 4, 16)[:3])
    with pytest.raises(ValueError, match="needs"):
        GpuKVPath(c, [torch.zeros(2, 4, 16, 2, 32, dtype=torch.float16)] * 4)  # head_dim 32, not 64
    with pytest.raises(ValueError, match="cannot hold the layout.s fp16 KV"):  # same bytes per token, another element type
        GpuKVPath(c, [torch.zeros(2, 4, 16, 2, 64, dtype=torch.bfloat16)] * 4)
    strided = [torch.zeros(2, 4, 16, 64, 2, dtype=torch.float16).transpose(3, 4) for _ in range(4)]
    GpuKVPath(c, strided).close()  # any strides: pages are views, not flat rows
    with GpuKVPath(c, paged(LAYOUT, 4, 16, seed=72)) as path:
        with pytest.raises(ValueError, match="cover fewer"):
            path.store(ids, [0])
        with pytest.raises(ValueError, match=r"ids must be in \[0, 4\)"):
            path.store(ids, [0, 4])
        path.store(ids, [0, 1]).commit(30)
        with pytest.raises(ValueError, match=r"ids must be in \[0, 4\)"):
            path.load(ids, [0, -1])
    assert c.stats().counters["leases"] == 0


# --- the mover alone (no daemon) -------------------------------------------------------------

def test_runs_coalesce_adjacent_slots_only():
    B = 100
    assert list(_runs([0, 100, 200, None, 400, 900, 1000], B)) == [(0, 3, 0), (4, 5, 400), (5, 7, 900)]
    assert list(_runs([None, None], B)) == []


def test_mover_store_waits_for_the_given_event():
    """``after`` orders the side stream behind the worker's work (emulated: an event)."""
    from kvstore.tiers.hbm_device import EmuStream

    host = np.zeros(4 * LAYOUT.block_bytes, np.uint8)
    src = paged(LAYOUT, 2, 16, seed=81)
    m = KVMover(PagedKV(src, LAYOUT), LAYOUT, host)
    compute = EmuStream()
    try:
        gate = threading.Event()
        compute.submit(lambda: gate.wait(30))
        compute.submit(lambda: src[0].fill_(1))  # the "kernel" that writes layer 0
        m.after(compute)
        rows = PagedKV(src, LAYOUT).token_rows([1], 16)
        ev = m.store_layer(0, rows, [LAYOUT.block_bytes])
        assert not ev.query()
        gate.set()
        ev.synchronize(30)
        C = LAYOUT.layer_chunk_bytes
        got = host[LAYOUT.block_bytes:LAYOUT.block_bytes + C]
        assert (got.view(np.float16) == 1).all()  # the copy saw the kernel's write
    finally:
        compute.close()
        m.close()
