"""The HBM tier keeps the tier contract on the emulated device, and its streams keep CUDA's
ordering: work on one stream in order, cross-stream hazards on a slot ordered by events, a
failed copy never passing for a good one."""

import threading

import numpy as np
import pytest
from stream_util import BLOCKED_S, Gate
from tier_contract import SlotTierContract

from kvstore.tiers.arena import Arena
from kvstore.tiers.base import TierError, TierKind
from kvstore.tiers import hbm as hbm_mod
from kvstore.tiers.hbm import HbmTier, HbmTierConfig

KiB = 1024
SLOT = 64 * KiB
NS = b"N" * 32


def _pattern(seed: int, nbytes: int = SLOT) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


class TestHbmEmulatedContract(SlotTierContract):
    def make_tier(self, tmp_path, capacity_bytes):
        return HbmTier(HbmTierConfig(capacity_bytes, extent_bytes=4 * self.SLOT, device="emulated",
                                     prefault=False))


class TestHbmEmulatedFourStreamsContract(SlotTierContract):
    def make_tier(self, tmp_path, capacity_bytes):
        return HbmTier(HbmTierConfig(capacity_bytes, extent_bytes=4 * self.SLOT, device="emulated",
                                     streams=4, prefault=False))


@pytest.fixture
def tier():
    t = HbmTier(HbmTierConfig(16 * SLOT, extent_bytes=4 * SLOT, device="emulated", prefault=False))
    yield t
    t.close()


# --- configuration and stats -----------------------------------------------------------------

def test_config_validation():
    with pytest.raises(ValueError, match="streams"):
        HbmTier(HbmTierConfig(SLOT, device="emulated", streams=1))
    with pytest.raises(ValueError, match="capacity_bytes"):
        HbmTier(HbmTierConfig(0, device="emulated"))


def test_stats_report_emulated_and_reason(tier):
    st = tier.stats()
    assert st.kind is TierKind.HBM and st.emulated and tier.emulated
    assert st.extra["backend"] == "emulated" and st.extra["streams"] == 2
    assert st.extra["reason"] == "emulated by configuration (device = 'emulated')"
    assert st.extra["host_pinned"] is False


def test_register_host_is_a_noop_when_emulated(tier):
    arena = Arena(4 * SLOT, prefault=False)
    try:
        assert tier.register_host(arena) is False
    finally:
        tier.close()
        arena.close()


def test_from_daemon_config():
    from kvstore.config import Config

    cfg = Config()
    cfg.hbm.capacity_bytes = 8 * SLOT
    cfg.hbm.device = "emulated"
    c = HbmTierConfig.from_config(cfg)
    assert (c.capacity_bytes, c.device, c.streams) == (8 * SLOT, "emulated", 2)
    assert c.extent_bytes == min(cfg.dram.extent_bytes, 8 * SLOT)


# --- ordering inside the tier ----------------------------------------------------------------

def test_read_after_write_on_another_stream_sees_the_write(tier):
    s = tier.allocate(NS, SLOT)
    up, down = tier.promote_lanes[0], tier.demote_lanes[0]
    assert up is not down
    gate = Gate()
    up.stream.submit(gate)  # the promotion stream is busy
    w = tier.write_async(s, _pattern(1))
    dst = np.zeros(SLOT, np.uint8)
    r = tier.read_async(s, dst)
    assert not r.wait(BLOCKED_S), "the read ran before the write it follows"
    gate.open()
    r.result(30)
    w.result(30)
    assert np.array_equal(dst, _pattern(1))


def test_write_after_read_waits_for_the_read(tier):
    s = tier.allocate(NS, SLOT)
    tier.write(s, _pattern(1))
    gate = Gate()
    tier.demote_lanes[0].stream.submit(gate)  # the demotion stream is busy
    dst = np.zeros(SLOT, np.uint8)
    r = tier.read_async(s, dst)
    w = tier.write_async(s, _pattern(2))
    assert not w.wait(BLOCKED_S), "the write overtook a read issued before it"
    gate.open()
    r.result(30)
    w.result(30)
    assert np.array_equal(dst, _pattern(1))  # the read saw the old content
    tier.read(s, dst)
    assert np.array_equal(dst, _pattern(2))


def test_read_on_same_stream_after_device_copy(tier):
    a, b = tier.allocate(NS, SLOT), tier.allocate(NS, SLOT)
    tier.write_async(a, _pattern(3))
    tier.copy_async(b, a, SLOT)  # same promotion stream: ordered by the stream itself
    dst = np.zeros(SLOT, np.uint8)
    tier.read_async(b, dst).result(30)
    assert np.array_equal(dst, _pattern(3))


def test_independent_slots_do_not_wait_on_each_other(tier):
    a, b = tier.allocate(NS, SLOT), tier.allocate(NS, SLOT)
    tier.write(b, _pattern(4))
    gate = Gate()
    tier.promote_lanes[0].stream.submit(gate)
    tier.write_async(a, _pattern(5))
    dst = np.zeros(SLOT, np.uint8)
    tier.read_async(b, dst).result(30)  # no hazard on b: not held up by the gated stream
    assert np.array_equal(dst, _pattern(4))
    gate.open()
    tier.synchronize()


def test_batched_promote_and_demote_count_bytes(tier):
    slots = [tier.allocate(NS, SLOT) for _ in range(4)]
    t = tier.promote([(s, _pattern(10 + i)) for i, s in enumerate(slots)])
    t.result(30)
    assert t.nbytes == 4 * SLOT
    dsts = [np.zeros(SLOT, np.uint8) for _ in slots]
    tier.demote(list(zip(slots, dsts))).result(30)
    assert all(np.array_equal(d, _pattern(10 + i)) for i, d in enumerate(dsts))
    st = tier.stats()
    assert (st.extra["bytes_promoted"], st.extra["bytes_demoted"]) == (4 * SLOT, 4 * SLOT)


def _count_copies(tier, monkeypatch) -> list:
    calls: list = []
    real = tier.pool.copy

    def counted(dst, src):
        calls.append(dst.nbytes)
        real(dst, src)
    monkeypatch.setattr(tier.pool, "copy", counted)
    return calls


def test_neighbouring_slots_move_in_one_copy_each_way(tier, monkeypatch):
    slots = [tier.allocate(NS, SLOT) for _ in range(4)]
    assert slots == [slots[0] + i * SLOT for i in range(4)]  # one extent, back to back
    arena = Arena(8 * SLOT, prefault=False)
    try:
        for i in range(4):
            arena.view(i * SLOT, SLOT)[:] = _pattern(20 + i)
        calls = _count_copies(tier, monkeypatch)
        tier.promote([(s, arena.view(i * SLOT, SLOT)) for i, s in enumerate(slots)]).result(30)
        assert calls == [4 * SLOT]
        # Host side: the first two back to back in the arena, the others separate arrays.
        dst = [arena.view(4 * SLOT, SLOT), arena.view(5 * SLOT, SLOT), np.zeros(SLOT, np.uint8),
               np.zeros(SLOT, np.uint8)]
        calls.clear()
        tier.demote(list(zip(slots, dst))).result(30)
        assert calls == [2 * SLOT, SLOT, SLOT]
        assert all(np.array_equal(d, _pattern(20 + i)) for i, d in enumerate(dst))
        # Out of order in the pool: nothing merges.
        calls.clear()
        tier.promote([(s, arena.view(i * SLOT, SLOT)) for i, s in reversed(list(enumerate(slots)))]).result(30)
        assert calls == [SLOT] * 4
        # A partly filled slot ends a run: the next slot's bytes do not start where it ended.
        calls.clear()
        tier.promote([(slots[0], arena.view(0, SLOT // 2)), (slots[1], arena.view(SLOT // 2, SLOT))]).result(30)
        assert calls == [SLOT // 2, SLOT]
        out = np.zeros(SLOT, np.uint8)
        tier.read(slots[1], out)
        assert np.array_equal(out, arena.view(SLOT // 2, SLOT))
    finally:
        arena.close()


def test_host_span_merges_only_adjacent_views_of_one_buffer():
    buf = np.arange(4 * SLOT, dtype=np.uint8) % 251
    a, b = buf[:SLOT], buf[SLOT:2 * SLOT]
    merged = hbm_mod._host_span(a, b)
    assert merged is not None and merged.ctypes.data == a.ctypes.data and merged.nbytes == 2 * SLOT
    buf.flags.writeable = False
    ro = hbm_mod._host_span(buf[:SLOT], buf[SLOT:2 * SLOT])
    assert ro is not None and not ro.flags.writeable  # a source may be read-only; it stays so
    assert hbm_mod._host_span(buf[:SLOT], buf[2 * SLOT:3 * SLOT]) is None  # not adjacent
    assert hbm_mod._host_span(np.zeros(SLOT, np.uint8), np.zeros(SLOT, np.uint8)) is None  # two buffers


def _fail_first_copy(tier, monkeypatch) -> None:
    """The pool's next copy raises an injected DMA failure; later copies work."""
    real, calls = tier.pool.copy, []

    def flaky(dst, src):
        calls.append(1)
        if len(calls) == 1:
            raise OSError("injected DMA failure")
        real(dst, src)

    monkeypatch.setattr(tier.pool, "copy", flaky)


def test_failed_write_never_serves_data(tier, monkeypatch):
    s = tier.allocate(NS, SLOT)
    tier.write(s, _pattern(1))
    _fail_first_copy(tier, monkeypatch)
    w = tier.write_async(s, _pattern(2))
    dst = np.full(SLOT, 7, np.uint8)
    r = tier.read_async(s, dst)  # another stream, reads what the failed write left
    with pytest.raises(OSError, match="injected"):
        w.result(30)
    with pytest.raises(TierError, match="earlier transfer"):
        r.result(30)
    assert (dst == 7).all(), "a read of a slot whose write failed must not copy"
    with pytest.raises(TierError):  # still poisoned: the failure is already known
        tier.read(s, dst)
    tier.write(s, _pattern(3))  # a new write replaces it, failure or not
    tier.read(s, dst)
    assert np.array_equal(dst, _pattern(3))


def test_failed_write_fails_a_device_copy_on_the_same_stream(tier, monkeypatch):
    a, b = tier.allocate(NS, SLOT), tier.allocate(NS, SLOT)
    _fail_first_copy(tier, monkeypatch)
    gate = Gate()
    tier.promote_lanes[0].stream.submit(gate)
    w = tier.write_async(a, _pattern(1))
    c = tier.copy_async(b, a, SLOT)  # same stream as the write: must still see it failed
    gate.open()
    with pytest.raises(OSError):
        w.result(30)
    with pytest.raises(TierError, match="earlier transfer"):
        c.result(30)
    with pytest.raises(TierError):  # b's content came from nowhere good either
        tier.read(b, np.zeros(SLOT, np.uint8))


def test_failed_read_does_not_fail_the_next_write(tier, monkeypatch):
    s = tier.allocate(NS, SLOT)
    tier.write(s, _pattern(1))
    _fail_first_copy(tier, monkeypatch)
    gate = Gate()
    tier.demote_lanes[0].stream.submit(gate)
    r = tier.read_async(s, np.zeros(SLOT, np.uint8))
    w = tier.write_async(s, _pattern(2))  # waits for the read, does not inherit its failure
    gate.open()
    with pytest.raises(OSError):
        r.result(30)
    w.result(30)
    dst = np.zeros(SLOT, np.uint8)
    tier.read(s, dst)
    assert np.array_equal(dst, _pattern(2))


def test_free_waits_for_copies_in_flight(tier):
    s = tier.allocate(NS, SLOT)
    gate = Gate()
    tier.promote_lanes[0].stream.submit(gate)
    w = tier.write_async(s, _pattern(1))
    threading.Timer(BLOCKED_S, gate.open).start()
    tier.free(NS, s)  # returns only once the write that targets the slot ran
    assert np.array_equal(tier.pool.slice(s, SLOT), _pattern(1))
    w.result(30)
    assert tier.stats().blocks == 0


def test_double_free_raises(tier):
    s = tier.allocate(NS, SLOT)
    keep = tier.allocate(NS, SLOT)  # keeps the extent owned
    tier.free(NS, s)
    with pytest.raises(ValueError):
        tier.free(NS, s)
    assert tier.stats().blocks == 1 and keep is not None


def test_closed_tier_refuses_work():
    t = HbmTier(HbmTierConfig(4 * SLOT, device="emulated", prefault=False))
    s = t.allocate(NS, SLOT)
    t.close()
    with pytest.raises(TierError, match="closed"):
        t.write_async(s, _pattern(1))
    t.close()  # idempotent


# --- sharing the pool with a worker ----------------------------------------------------------

def test_emulated_ipc_handle_maps_the_same_pool(tier):
    pytest.importorskip("torch")
    from kvstore.tiers.hbm import open_pool

    h = tier.ipc_handle()
    assert h["kind"] == "emulated" and h["capacity_bytes"] == 16 * SLOT
    s = tier.allocate(NS, SLOT)
    tier.write(s, _pattern(9))
    m = open_pool(h)
    try:
        assert np.array_equal(m.mem[s:s + SLOT].numpy(), _pattern(9))
        m.mem[s:s + 4] = 1  # the worker writes; the daemon reads it back
        dst = np.zeros(4, np.uint8)
        tier.read(s, dst)
        assert (dst == 1).all()
    finally:
        m.close()


def test_cpu_tensors_are_host_buffers_too(tier):
    torch = pytest.importorskip("torch")
    s = tier.allocate(NS, SLOT)
    tier.write(s, torch.from_numpy(_pattern(12)))
    dst = torch.zeros(SLOT, dtype=torch.uint8)
    tier.read(s, dst)
    assert np.array_equal(dst.numpy(), _pattern(12))


def test_daemon_reports_the_emulated_hbm_tier(tmp_path):
    """With no GPU the daemon's HBM tier runs emulated and says so everywhere a figure shows."""
    import json
    import subprocess
    import sys
    import urllib.request

    from daemon_util import start_daemon

    d = start_daemon(tmp_path, "--hbm-capacity-bytes", "16MiB")
    try:
        out = json.loads(subprocess.run([sys.executable, "-m", "kvstore", "stats", "--json", "--socket", d.socket_path],
                                        capture_output=True, text=True, timeout=30).stdout)
        assert out["hbm_emulated"] is True
        hbm = [t for t in out["tiers"] if t["tier"] == "TIER_HBM"][0]
        assert hbm["emulated"] is True and hbm["capacity_bytes"] == str(16 << 20) and "no CUDA device" in hbm["detail"]
        text = urllib.request.urlopen(d.metrics_url, timeout=5).read().decode()
        assert "kvstore_hbm_emulated 1.0" in text and 'hbm_emulated="true"' in text
        assert 'kvstore_tier_capacity_bytes{tier="hbm"} 1.6777216e+07' in text
    finally:
        assert d.stop() == 0


def test_daemon_keeps_hot_blocks_in_the_hbm_pool(tmp_path):
    """Blocks read twice get an HBM copy (emulated device here); a worker maps the pool and
    finds each block's bytes at the offset Acquire reports; DRAM eviction drops the copy too."""
    import time

    import numpy as np

    from daemon_util import start_daemon
    from kvstore.clients import KVStoreClient, KVStoreError
    from kvstore.layout import KVLayout

    d = start_daemon(tmp_path, "--hbm-capacity-bytes", "4MiB", "--hbm-admit-reads", "2", dram="16MiB")
    try:
        layout = KVLayout(4, 2, 64, "fp16")  # 32 KiB blocks: 128 fit the 4 MiB pool
        c = KVStoreClient(d.socket_path)
        c.register(layout, "hot")
        tokens = list(range(8 * 16))
        kv = np.random.default_rng(5).standard_normal(layout.tensor_shape(len(tokens))).astype(np.float16)
        c.put(tokens, kv)
        keys = c.keys(tokens)
        with c.acquire(keys[:4]) as r:
            assert r.hbm_offsets == [-1] * 4  # read once: not hot yet
        with c.acquire(keys[:4]):
            pass
        deadline = time.monotonic() + 10
        # Only keys[:4] are ever read: reading the others twice would admit them in the
        # background, racing the before/after counts below.
        while time.monotonic() < deadline:
            with c.acquire(keys[:4]) as r:
                if all(o >= 0 for o in r.hbm_offsets):
                    break
            time.sleep(0.05)
        pool = c.map_hbm_pool()
        with c.acquire(keys[:4]) as r:
            assert all(o >= 0 for o in r.hbm_offsets)
            for i in range(4):
                o = r.hbm_offsets[i]
                assert pool.mem[o:o + layout.block_bytes].numpy().tobytes() == r.view(i).tobytes()
        with c.acquire(keys[4:]) as r:
            assert r.hbm_offsets == [-1] * 4  # read once: still DRAM only
        hbm = [t for t in c.stats().tiers if t.tier == 1][0]
        assert hbm.emulated and hbm.blocks == 4 and hbm.used_bytes == 4 * layout.block_bytes
        assert c.delete(keys[:4]) == 4  # DRAM copy gone: HBM copy freed with it
        after = [t for t in c.stats().tiers if t.tier == 1][0]
        assert after.blocks == 0 and after.used_bytes == 0
        pool.close()
        c.close()
        # A daemon without an HBM tier says so.
    finally:
        assert d.stop() == 0
    d2 = start_daemon(tmp_path / "nohbm")
    try:
        c = KVStoreClient(d2.socket_path)
        c.register(KVLayout(4, 2, 64, "fp16"), "x")
        with pytest.raises(KVStoreError, match="no HBM tier"):
            c.map_hbm_pool()
        c.close()
    finally:
        assert d2.stop() == 0
