"""The DRAM tier keeps the slot tier contract."""

import os

from tier_contract import SlotTierContract

from kvstore.tiers.arena import Arena
from kvstore.tiers.dram import DramTier


class TestDramContract(SlotTierContract):
    def make_tier(self, tmp_path, capacity_bytes):
        self._arena = Arena(capacity_bytes, prefault=False)
        return DramTier(self._arena, 4 * self.SLOT)

    def close_tier(self, tier):
        tier.arena.close()


def test_map_in_background_fills_a_second_mapping_and_keeps_data():
    """A client-side mapping of the daemon's arena is filled in a background thread; writes
    through either mapping are seen by the other, before and after it finishes."""
    from kvstore.tiers.arena import Arena

    owner = Arena(64 << 20, prefault=True)
    owner.buf[:4096] = 7
    mine = Arena(64 << 20, fd=os.dup(owner.fd), prefault=False)
    done = mine.map_in_background(chunk_bytes=8 << 20)
    mine.buf[-4096:] = 9  # while mapping: faults as usual
    assert done.wait(30)
    assert (mine.buf[:4096] == 7).all() and (owner.buf[-4096:] == 9).all()
    mine.close()
    owner.close()


def allocations_while(busy) -> list[float]:
    """Seconds each large allocation (and its page faults) took while ``busy()``."""
    import time

    import numpy as np

    waits = []
    while busy():
        t = time.perf_counter()
        a = np.empty(8 << 20, np.uint8)  # above malloc's mmap threshold: an mmap and a munmap
        a[::4096] = 1
        del a
        waits.append(time.perf_counter() - t)
    return waits


def test_mapping_in_background_does_not_hold_up_the_callers_allocations():
    """While a client maps a daemon's arena in the background, the process's own large
    allocations (mmap, which waits for the mmap lock an MADV_POPULATE_READ holds for its whole
    range) go on: most wait less than a tenth of the whole mapping's time. With the 256 MiB
    chunks this replaced, each allocation waited a whole chunk's time, a quarter of it."""
    import time

    import pytest

    owner = Arena(1 << 30, prefault=True)
    try:
        mine = Arena(1 << 30, fd=os.dup(owner.fd), prefault=False)
        t0 = time.perf_counter()
        done = mine.map_in_background()
        waits = allocations_while(lambda: not done.is_set())
        whole = time.perf_counter() - t0
        mine.close()
    finally:
        owner.close()
    if whole < 0.01:
        pytest.skip(f"mapped in {whole * 1e3:.1f} ms: nothing to measure")
    # The median: on a loaded machine the first allocation may wait for a core (the mapping's
    # thread has just started), whatever the chunk size.
    assert len(waits) >= 5 and sorted(waits)[len(waits) // 2] < whole / 10, (waits, whole)


def test_unmapping_does_not_hold_up_the_callers_allocations():
    """A client unmaps a dead daemon's arena off the engine's thread, at the lowest priority
    (Arena.unmap_in_background); the process's own large allocations go on meanwhile (one
    munmap of the mapped arena held the mmap lock for all of it: one allocation got through,
    after waiting out nearly the whole unmap)."""
    import time

    import pytest

    owner = Arena(1 << 30, prefault=True)
    try:
        mine = Arena(1 << 30, fd=os.dup(owner.fd), prefault=False)
        mine.map_in_background().wait(60)  # every page-table entry filled, as in a client
        view = mine.buf[:4096]  # a copy path's view: close leaves the mapping to unmap
        mine.close()
        assert not mine.mmap.closed
        del view
        t0 = time.perf_counter()
        done = mine.unmap_in_background()
        waits = allocations_while(done.is_alive)
        whole = time.perf_counter() - t0
    finally:
        owner.close()
    assert mine.mmap.closed
    if whole < 0.01:
        pytest.skip(f"unmapped in {whole * 1e3:.1f} ms: nothing to measure")
    # One munmap let a single allocation through, after waiting out nearly all of it.
    assert len(waits) >= 5 and sorted(waits)[len(waits) // 2] < whole / 10, (waits, whole)


def test_an_unmap_waits_for_its_caller_to_be_quiet_and_no_longer_than_told():
    """``idle``: the engine's seconds since its last step. Busy (0 s): the unmap waits, up to
    ``within_s``; quiet for ``idle_s``: it goes at once."""
    import time

    def closed_arena(owner: Arena) -> Arena:
        a = Arena(16 << 20, fd=os.dup(owner.fd), prefault=False)
        view = a.buf[:8]  # a copy path's view: close leaves the mapping to unmap
        a.close()
        del view
        return a

    owner = Arena(16 << 20, prefault=True)
    try:
        busy, quiet = closed_arena(owner), closed_arena(owner)
        t0 = time.monotonic()
        waiting = busy.unmap_in_background(lambda: 0.0, idle_s=0.2, within_s=1.0)
        quiet.unmap_in_background(lambda: 5.0, idle_s=0.2, within_s=1.0).join(5)
        assert quiet.mmap.closed and time.monotonic() - t0 < 0.5
        time.sleep(0.3)
        assert not busy.mmap.closed  # still waiting for the caller to be quiet
        waiting.join(5)
        assert busy.mmap.closed and time.monotonic() - t0 >= 1.0
    finally:
        owner.close()


def test_a_background_close_leaves_a_viewed_arena_to_the_views_owner(caplog):
    """A client that re-registers closes the old arena in the background while a copy path
    may still view it: no collection, no warning; the mapping goes when the owner unmaps it."""
    import threading

    owner = Arena(16 << 20, prefault=True)
    try:
        a = Arena(16 << 20, fd=os.dup(owner.fd), prefault=False)
        view = a.buf[:8]
        with caplog.at_level("WARNING", logger="kvstore.arena"):
            a.close(background=True)
            for t in threading.enumerate():
                if t.name == "kvstore-unmap":
                    t.join(5)
        assert not a.mmap.closed and not caplog.records
        del view
        a.unmap()
        assert a.mmap.closed
    finally:
        owner.close()
