"""Promoter.promote_soon: a Lookup's promotion planned on the promoter's own thread, in order,
dropped once the tier shuts down, and never holding up its caller."""

import threading
import time

from kvstore.config import NvmeConfig
from kvstore.daemon.promotion import MAX_SOON, Promoter
from wait_util import wait_for


class Recording(Promoter):
    """Records its promotions; the first waits for ``gate``."""

    def __init__(self) -> None:
        super().__init__(None, None, NvmeConfig(), metrics=None, policy=None)
        self.seen, self.gate, self.done, self.entered = [], threading.Event(), threading.Event(), threading.Event()

    def promote(self, st, keys, each=False):
        self.entered.set()
        self.gate.wait(10)
        self.seen.append(keys)
        if keys == ["last"]:
            self.done.set()
        return 0


def test_promotions_run_in_order_behind_their_caller():
    p = Recording()
    p.promote_soon("ns", ["a"])  # returns while the promotion waits at its gate
    p.promote_soon("ns", ["b"])
    assert p.seen == []
    p.gate.set()
    p.promote_soon("ns", ["last"])
    assert p.done.wait(10)
    assert p.seen == [["a"], ["b"], ["last"]]


def test_a_full_queue_drops_what_does_not_fit():
    p = Recording()
    p.promote_soon("ns", [0])
    assert p.entered.wait(10)  # taken off the queue, waiting at the gate
    for i in range(1, MAX_SOON + 50):
        p.promote_soon("ns", [i])
    p.gate.set()
    wait_for(p._soon.empty, 10)
    p.promote_soon("ns", ["last"])
    assert p.done.wait(10)
    assert [k[0] for k in p.seen[:-1]] == list(range(MAX_SOON + 1))  # the one taken, then as many as fit


def test_a_stopped_tier_skips_what_was_queued():
    p = Recording()
    p.promote_soon("ns", [0])
    assert p.entered.wait(10)
    for i in range(1, 5):
        p.promote_soon("ns", [i])
    p.stopping.set()
    p.gate.set()
    wait_for(p._soon.empty, 10)
    time.sleep(0.1)
    assert p.seen == [[0]]  # taken before the stop; the rest skipped
