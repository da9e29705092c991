"""The HBM copier over the real core, DRAM tier and emulated HBM tier, its thread started as in
the daemon: a hot block gets an HBM copy, and a promotion that fails leaves nothing behind."""

from __future__ import annotations

import hashlib
import threading
import time

import pytest

from kvstore.daemon.core import Core, CoreConfig
from kvstore.daemon.hbm_cache import HbmCache
from kvstore.daemon.metrics import Metrics
from kvstore.keys import Namespace, chain_keys
from kvstore.layout import KVLayout
from kvstore.tiers.arena import Arena
from kvstore.tiers.base import TierError
from kvstore.tiers.dram import DramTier
from kvstore.tiers.hbm import HbmTier, HbmTierConfig

LAYOUT = KVLayout(2, 1, 64, "fp16", block_tokens=16)  # 8 KiB blocks
BLOCK = LAYOUT.block_bytes
EXTENT = 8 * BLOCK


class BrokenHbm(HbmTier):
    """An HBM tier whose promotions raise at submission (a device error, a closed pool)."""

    def __init__(self, config: HbmTierConfig) -> None:
        super().__init__(config)
        self.tried = threading.Event()

    def promote(self, pairs):
        self.tried.set()
        raise TierError("device lost")


def wait_until(cond, timeout_s: float = 3.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.01)
    return cond()


@pytest.fixture
def make():
    made = []

    def make(hbm_cls=HbmTier):
        arena = Arena(4 * EXTENT, prefault=False)
        hbm = hbm_cls(HbmTierConfig(4 * EXTENT, extent_bytes=EXTENT, device="emulated", prefault=False))
        core = Core(DramTier(arena, EXTENT), CoreConfig(max_keys=64, hot_after_reads=1), hbm=hbm)
        cache = HbmCache(core.residency, hbm, metrics=Metrics())
        made.append((arena, hbm, cache))
        s = core.register(Namespace("m", LAYOUT))
        keys = chain_keys(hashlib.sha256(b"hbm-root").digest(), list(range(64)), 16)
        with core.lock:
            lease, _, _ = core.reserve(s, b"".join(keys), b"")
            blocks = core.commit(s, lease.id, b"")
            read = core.acquire(s, b"".join(keys), allow_partial=False)[0]  # read once: hot
            core.release(s, read.id)
        cache.start()
        cache.kick.set()
        return core, s, hbm, blocks

    yield make
    for arena, hbm, cache in made:
        cache.close()
        hbm.close()
        arena.close()


def test_a_hot_block_gets_an_hbm_copy(make):
    core, s, hbm, blocks = make()
    assert wait_until(lambda: all(b.hbm_slot >= 0 for b in blocks))
    assert not any(b.busy for b in blocks)


def test_a_promotion_that_raises_leaves_no_block_busy_and_no_hbm_slot_taken(make):
    core, s, hbm, blocks = make(BrokenHbm)
    assert hbm.tried.wait(3.0)
    # Before: the blocks stayed busy for good, so they could never be evicted or deleted.
    assert wait_until(lambda: not any(b.busy for b in blocks)), [b.busy for b in blocks]
    assert all(b.hbm_slot == -1 for b in blocks) and hbm.stats().used_bytes == 0
    with core.lock:
        assert core.delete(s, b"".join(b.key for b in blocks)) == (len(blocks), 0)
