"""The daemon reads the pages of a DRAM hit a Lookup pins, ahead of the client's copy
(kvstore.daemon.warmer): which bytes it reads, what it drops, and the real daemon doing it."""

from __future__ import annotations

import ctypes
import itertools
import mmap
import threading
import time
import urllib.request

import numpy as np
import pytest

from kvstore.clients import KVStoreClient
from kvstore.daemon.warmer import PageWarmer
from kvstore.layout import KVLayout
from kvstore.tiers.arena import Arena

PAGE = mmap.PAGESIZE
_libc = ctypes.CDLL(None, use_errno=True)


class Outcomes:
    """``counted`` for a PageWarmer: the jobs it reported, and an event per outcome."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, int]] = []
        self.any = threading.Event()

    def __call__(self, outcome: str, nbytes: int) -> None:
        self.seen.append((outcome, nbytes))
        self.any.set()


def resident_pages(arena: Arena) -> set[int]:
    """The arena's pages present in memory (mincore), by page number."""
    n = arena.size_bytes // PAGE
    vec = (ctypes.c_ubyte * n)()
    assert _libc.mincore(ctypes.c_void_p(arena.buf.ctypes.data), ctypes.c_size_t(arena.size_bytes), vec) == 0
    return {i for i in range(n) if vec[i] & 1}


@pytest.mark.parametrize("nbytes", [PAGE, 3 * PAGE + 100, 196608])
def test_the_bytes_read_cover_every_page_of_each_range(nbytes):
    w = PageWarmer(lambda: None)
    try:
        offsets = np.array([0, 5 * PAGE + 1000, 64 * PAGE - 7, 1 << 20], dtype=np.intp)
        read = w.pages(offsets, nbytes)
        want = {p for o in offsets for p in range(o // PAGE, (o + nbytes - 1) // PAGE + 1)}
        assert {int(b) // PAGE for b in read} == want
        assert all(any(o <= b < o + nbytes for o in offsets) for b in read)  # nothing outside them
    finally:
        w.close()


def test_a_warmed_range_is_in_memory_and_nothing_else_is():
    """An arena not pre-faulted has no page in memory; after a warm, the ranges' pages are,
    and only they (a read fault of a shared memfd page brings it in)."""
    arena = Arena(64 * PAGE, prefault=False)
    seen = Outcomes()
    w = PageWarmer(lambda: arena.buf, seen)
    try:
        assert resident_pages(arena) == set()
        assert w.warm([2 * PAGE + 10, 40 * PAGE], 3 * PAGE)
        assert seen.any.wait(10)
        assert seen.seen == [("read", 6 * PAGE)]
        assert resident_pages(arena) == {2, 3, 4, 5, 40, 41, 42}
    finally:
        w.close()
        arena.close()


def test_over_the_backlog_a_job_is_dropped_and_a_late_one_is_not_read():
    seen = Outcomes()
    w = PageWarmer(lambda: np.zeros(1 << 20, np.uint8), seen, backlog_bytes=8 * PAGE)
    try:
        assert not w.warm([0, PAGE, 2 * PAGE], 3 * PAGE)  # 9 pages > 8
        assert seen.seen == [("full", 9 * PAGE)]
        assert not w.warm([], PAGE)  # nothing to read: nothing queued, nothing counted
        assert len(seen.seen) == 1
    finally:
        w.close()
    seen = Outcomes()
    clock = itertools.count(0.0, 1.0).__next__  # each reading of the clock one second on
    w = PageWarmer(lambda: np.zeros(1 << 20, np.uint8), seen, clock=clock)
    try:
        assert w.warm([0], PAGE)
        assert seen.any.wait(10)
        assert seen.seen == [("late", PAGE)]  # queued at 0, taken at 1.0 > LATE_S
    finally:
        w.close()


def _scraped(d, outcome: str) -> float:
    text = urllib.request.urlopen(d.metrics_url, timeout=5).read().decode()
    want = f'kvstore_warmed_bytes_total{{outcome="{outcome}"}} '
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(want))


@pytest.mark.parametrize("on", [True, False])
def test_the_daemon_reads_a_hit_it_pins_ahead_and_only_that(daemons, on):
    from wait_util import wait_for

    d = daemons(*(() if on else ("--dram-warm-pinned-hits", "false")))
    layout = KVLayout(4, 2, 64, "fp16")
    c = KVStoreClient(d.socket_path, timeout_s=10)
    try:
        c.register(layout, "warm-model")
        bt = layout.block_tokens
        tokens = list(range(300, 300 + 6 * bt))
        keys = c.keys(tokens)
        assert c.put(tokens, np.ones(layout.tensor_shape(len(tokens)), np.float16)) == 6
        c.lookup_keys(keys)  # no pin: nothing to read ahead
        c.lookup_keys(keys, promote_from=0)
        assert _scraped(d, "read") == 0
        r = c.lookup_keys(keys, promote_from=1, promote_to=5, pin=True)
        assert r.lease_id and len(r.offsets) == 4
        if on:
            wait_for(lambda: _scraped(d, "read") == 4 * layout.block_bytes, 10, "the pinned blocks read ahead")
        else:
            time.sleep(0.5)  # what a warmer would have read by now, had it been made
            assert _scraped(d, "read") == 0
        assert _scraped(d, "full") == _scraped(d, "late") == 0
    finally:
        c.close()
