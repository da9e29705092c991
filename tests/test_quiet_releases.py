"""The worker's load Releases wait for the engine to be quiet (kvstore.clients.leases.QuietReleases):
held while steps run, sent once quiet or when the oldest has waited ``within_s``, in order."""

from __future__ import annotations

import threading
import time

from wait_util import wait_for

from kvstore.clients.leases import QuietReleases


class Engine:
    """``quiet()`` for a QuietReleases: seconds since the last step, or 0 while ``busy``."""

    def __init__(self) -> None:
        self.busy = True
        self.since = time.monotonic()

    def quiet(self) -> float:
        return 0.0 if self.busy else time.monotonic() - self.since

    def stop(self) -> None:
        self.since, self.busy = time.monotonic(), False


def _releases(engine: Engine, **kw):
    sent: list = []
    lock = threading.Lock()

    def send(items):
        with lock:
            sent.extend(items)

    return QuietReleases(send, engine.quiet, **kw), sent


def test_held_while_the_engine_steps_and_sent_once_it_is_quiet():
    engine = Engine()
    r, sent = _releases(engine, quiet_s=0.05, within_s=60)
    try:
        r.hold([("a", 1), ("b", 2)])
        r.hold([("c", 3)])
        time.sleep(0.3)
        assert sent == []  # the engine never paused
        engine.stop()
        wait_for(lambda: sent == [("a", 1), ("b", 2), ("c", 3)], 10, "the releases sent in order once quiet")
    finally:
        r.close()


def test_an_engine_that_never_pauses_gets_them_within_its_bound():
    engine = Engine()
    r, sent = _releases(engine, quiet_s=0.05, within_s=0.3)
    try:
        t0 = time.monotonic()
        r.hold([("a", 1)])
        wait_for(lambda: sent == [("a", 1)], 10, "the release sent past within_s")
        assert time.monotonic() - t0 >= 0.3  # not before it: the engine was busy throughout
    finally:
        r.close()


def test_flush_and_close_send_what_is_held_at_once():
    engine = Engine()
    r, sent = _releases(engine, quiet_s=0.05, within_s=60)
    r.hold([("a", 1)])
    r.flush()
    assert sent == [("a", 1)]
    r.hold([("b", 2)])
    r.hold([])  # nothing: nothing changes
    r.close()
    assert sent == [("a", 1), ("b", 2)]
