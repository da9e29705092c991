"""The HBM tier on a real CUDA device: the tier contract, copies on side streams only, the
arena pinned in place, cross-stream ordering, and the pool opened by another process."""

import os
import pickle
import subprocess
import sys

import numpy as np
import pytest
from cuda_env import SKIP_REASON, requires_cuda
from tier_contract import SlotTierContract

from kvstore.tiers.arena import Arena
from kvstore.tiers.hbm import HbmTier, HbmTierConfig

pytestmark = [pytest.mark.gpu, requires_cuda]

MiB = 1 << 20
SLOT = 1 * MiB
NS = b"G" * 32


def _pattern(seed: int, nbytes: int = SLOT) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


@pytest.fixture
def arena():
    a = Arena(64 * SLOT)
    yield a
    a.close()


@pytest.fixture
def tier(arena):  # set up after the arena, so closed (and the arena unpinned) before it is unmapped
    t = HbmTier(HbmTierConfig(64 * SLOT, extent_bytes=16 * SLOT, device="0"))
    yield t
    t.close()


@pytest.mark.skipif(bool(SKIP_REASON), reason=SKIP_REASON or "CUDA present")
class TestHbmCudaContract(SlotTierContract):
    def make_tier(self, tmp_path, capacity_bytes):
        return HbmTier(HbmTierConfig(capacity_bytes, extent_bytes=4 * self.SLOT, device="0"))


def test_auto_picks_the_gpu_and_says_so():
    t = HbmTier(HbmTierConfig(4 * SLOT))
    try:
        st = t.stats()
        assert not t.emulated and not st.emulated and t.reason == ""
        assert (st.extra["backend"], st.extra["device"]) == ("cuda", "cuda:0")
        assert "reason" not in st.extra
    finally:
        t.close()


def test_register_host_pins_the_arena_in_place(tier, arena):
    import torch

    host = torch.from_numpy(arena.buf)
    assert not host.is_pinned()
    assert tier.register_host(arena) is True
    assert host.is_pinned() and tier.stats().extra["host_pinned"]
    tier.close()
    assert not host.is_pinned()


def test_copies_never_touch_the_default_stream(tier, arena):
    """With the default stream busy for about a second, promotions and demotions still finish."""
    import torch

    tier.register_host(arena)
    slots = [tier.allocate(NS, SLOT) for _ in range(8)]
    arena.buf[: 8 * SLOT] = np.resize(_pattern(1), 8 * SLOT)
    torch.cuda.synchronize()
    torch.cuda._sleep(4_000_000_000)  # ~2 s of spinning on the default stream
    up = tier.promote([(s, arena.view(i * SLOT, SLOT)) for i, s in enumerate(slots)])
    down = tier.demote([(s, arena.view((8 + i) * SLOT, SLOT)) for i, s in enumerate(slots)])
    up.result(1.0)
    down.result(1.0)
    assert not torch.cuda.default_stream().query(), "the default stream finished first: test too slow to tell"
    assert np.array_equal(arena.buf[8 * SLOT:16 * SLOT], arena.buf[:8 * SLOT])
    torch.cuda.synchronize()


def test_cross_stream_hazards_keep_program_order(tier, arena):
    tier.register_host(arena)
    slots = [tier.allocate(NS, SLOT) for _ in range(16)]
    for rep in range(3):
        for i in range(len(slots)):
            arena.buf[i * SLOT:(i + 1) * SLOT] = _pattern(100 * rep + i)
        ups = [tier.write_async(s, arena.view(i * SLOT, SLOT)) for i, s in enumerate(slots)]
        # Issued at once on the demotion stream: each must wait for its slot's promotion.
        downs = [tier.read_async(s, arena.view((16 + i) * SLOT, SLOT)) for i, s in enumerate(slots)]
        # And the next promotion into the slot must wait for the demotion (write after read).
        again = [tier.write_async(s, arena.view(32 * SLOT, SLOT)) for s in slots]
        for t in ups + downs + again:
            t.result(30)
        for i in range(16):
            assert np.array_equal(arena.buf[(16 + i) * SLOT:(17 + i) * SLOT], _pattern(100 * rep + i)), (rep, i)


def test_device_to_device_copy_then_demote(tier, arena):
    tier.register_host(arena)
    a, b = tier.allocate(NS, SLOT), tier.allocate(NS, SLOT)
    arena.buf[:SLOT] = _pattern(7)
    tier.write_async(a, arena.view(0, SLOT))
    tier.copy_async(b, a, SLOT)
    tier.read_async(b, arena.view(SLOT, SLOT)).result(30)
    assert np.array_equal(arena.buf[SLOT:2 * SLOT], _pattern(7))


_CHILD = r"""
import pickle, sys
import numpy as np
from kvstore.tiers.hbm import open_pool
h, slot, n = pickle.load(sys.stdin.buffer)
m = open_pool(h)
seen = m.mem[slot:slot + n].cpu().numpy()
m.mem[slot:slot + n] = 0x5A
import torch; torch.cuda.synchronize()
sys.stdout.write(seen.tobytes().hex())
"""


def test_ipc_handle_opens_the_pool_in_a_worker_process(tier):
    s = tier.allocate(NS, SLOT)
    tier.write(s, _pattern(3))
    handle = tier.ipc_handle()
    assert handle["kind"] == "cuda"
    r = subprocess.run([sys.executable, "-c", _CHILD], input=pickle.dumps((handle, s, SLOT)),
                       capture_output=True, timeout=120, env=os.environ.copy())
    assert r.returncode == 0, r.stderr.decode()[-2000:]
    assert bytes.fromhex(r.stdout.decode()) == _pattern(3).tobytes()  # the worker saw the daemon's write
    dst = np.zeros(SLOT, np.uint8)
    tier.read(s, dst)
    assert (dst == 0x5A).all()  # and the daemon sees the worker's
