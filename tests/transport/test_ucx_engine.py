"""The UCX progress engine's own contract: work handed over from other threads always wakes a
sleeping engine (no lost wake-up), a blocking engine keeps polling for a short window after work,
an adaptive one polls only while a transfer is open, and an idle engine sleeps instead of spinning."""

from __future__ import annotations

import contextlib
import threading
import time

import pytest

from conftest import make_payload, wait_for
from kvstore.transport import Listener, Sender, TransferConfig, ucx_available
from kvstore.transport import session as session_mod
from kvstore.transport import ucx as ucx_mod
from kvstore.transport.config import UcxProgress
from kvstore.transport.sink import MemorySink

BACKENDS = ["ucx"]  # for the listener / sender fixtures


def rounds_and_sleeps_during(engine, seconds: float) -> tuple[int, int]:
    """Engine loop rounds run while this thread sleeps ``seconds``, and how many of them went
    into ``progress_worker_event``."""
    loops, sleeps = engine.loops, engine.sleeps
    time.sleep(seconds)
    return engine.loops - loops, engine.sleeps - sleeps


def past_spin_window(engine) -> None:
    """Wait out the polling window that follows the engine's last work."""
    time.sleep(engine.SPIN_S + 0.05)


def assert_asleep(engine, seconds: float = 0.3) -> None:
    """``engine`` sleeps in epoll_wait: a handful of rounds in ``seconds`` at most (a spinning
    engine does ~10^5)."""
    rounds, _ = rounds_and_sleeps_during(engine, seconds)
    assert rounds < 20, rounds


def assert_polling(engine, seconds: float = 0.2) -> None:
    """``engine`` spins: it runs rounds and none of them sleeps. Round rates are not asserted
    from below: on a loaded machine a starved engine thread runs few rounds."""
    rounds, sleeps = rounds_and_sleeps_during(engine, seconds)
    assert rounds > 0 and sleeps == 0, (rounds, sleeps)


@contextlib.contextmanager
def running(engine):
    """``engine``, stopped when the block ends however it ends."""
    try:
        yield engine
    finally:
        engine.stop()


@pytest.fixture
def engine_cls():
    ok, why = ucx_available()
    if not ok:
        pytest.skip(why)
    from kvstore.transport.ucx_env import Engine

    class SlowTickEngine(Engine):
        # Its timed wake-up is a minute away, so a call whose wake-up was lost would hang the
        # caller past its 10 s timeout instead of being rescued by the next tick.
        TICK_S = 60.0
    return SlowTickEngine


def test_calls_from_many_threads_always_wake_the_sleeping_engine(engine_cls):
    with running(engine_cls(TransferConfig(backend="ucx"), "test")) as engine:
        ran_on: set[str] = set()

        def hammer(n: int) -> None:
            for i in range(n):
                assert engine.call(lambda i=i: ran_on.add(threading.current_thread().name) or i,
                                   timeout_s=10.0) == i
                if i % 50 == 0:
                    time.sleep(0.002)  # let the engine go back to sleep between bursts
        threads = [threading.Thread(target=hammer, args=(400,)) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert ran_on == {engine._thread.name}


def test_an_idle_engine_sleeps_instead_of_spinning(engine_cls):
    with running(engine_cls(TransferConfig(backend="ucx"), "test")) as engine:
        engine.call(lambda: None)
        past_spin_window(engine)
        assert_asleep(engine, 0.5)
        assert engine.call(lambda: 42) == 42  # and it still wakes for work


def test_a_polling_engine_spins_and_still_serves_calls(engine_cls):
    with running(engine_cls(TransferConfig(backend="ucx", ucx_progress=UcxProgress.POLLING), "test")) as engine:
        engine.call(lambda: None)
        past_spin_window(engine)
        assert_polling(engine)  # still
        assert engine.call(lambda: 7) == 7


def test_after_work_a_blocking_engine_polls_for_its_spin_window_then_sleeps(engine_cls):
    class LongSpin(engine_cls):
        SPIN_S = 1.0
    with running(LongSpin(TransferConfig(backend="ucx", ucx_progress=UcxProgress.BLOCKING), "test")) as engine:
        engine.call(lambda: None)
        assert_polling(engine, 0.1)  # still inside the window
        time.sleep(1.0)
        assert_asleep(engine)  # the window closed
        assert engine.call(lambda: 5) == 5


def test_after_work_an_adaptive_engine_with_no_transfer_open_sleeps_at_once(engine_cls):
    """No spin window in adaptive mode: it polls only while a transfer is open (below); polling
    after every piece of work took a core from the daemon's RPC threads on 2 cores."""
    class LongSpin(engine_cls):
        SPIN_S = 1.0
    with running(LongSpin(TransferConfig(backend="ucx"), "test")) as engine:
        engine.call(lambda: None)
        assert_asleep(engine, 0.3)  # inside what would be the 1 s window
        assert engine.call(lambda: 5) == 5


def test_while_a_transfer_is_open_a_blocking_engine_naps_at_most_a_millisecond(engine_cls):
    with running(engine_cls(TransferConfig(backend="ucx", ucx_progress=UcxProgress.BLOCKING), "test")) as engine:
        engine.call(setattr, engine, "transfers_open", True)  # as the listener's / connector's ticker does
        past_spin_window(engine)
        rounds, sleeps = rounds_and_sleeps_during(engine, 1.0)
        # ~1 ms naps: every round sleeps (not a spin), ~1000 of them; asleep for whole 20 ms
        # ticks it would be ~50 (the threshold leaves 10x for a loaded machine)
        assert sleeps > 100 and rounds - sleeps < 10, (rounds, sleeps)
        engine.call(setattr, engine, "transfers_open", False)
        past_spin_window(engine)
        assert_asleep(engine)


def test_both_engines_know_while_a_transfer_is_open(listener, sender, sink):
    lst_engine = listener._server.engine
    keys, data = make_payload(31, blocks=2, layers=2, chunk=4096)
    tx = sender.open(listener.address, keys, 2, 4096)
    tx_engine = tx._channel.engine
    wait_for(lambda: tx_engine.transfers_open and lst_engine.transfers_open, what="both engines see the open transfer")
    tx.send_layer(0, [data[0, 0], data[1, 0]])
    tx.send_layer(1, [data[0, 1], data[1, 1]])
    tx.finish()
    wait_for(lambda: not tx_engine.transfers_open and not lst_engine.transfers_open, what="both engines see it closed")


@pytest.mark.parametrize("verify_threads,min_bytes,hashed_by", [(2, 0, "kvt-verify"), (2, 128 << 10, "kvt-ucx"),
                                                                (0, 0, "kvt-ucx")])
def test_a_verify_pool_hashes_arrived_chunks_off_the_engine_thread(backend, sink, monkeypatch, verify_threads,
                                                                      min_bytes, hashed_by):
    """64 KiB chunks: on the pool when it takes payloads that small, else on the engine thread
    (once landed: the fused receive, which hashes inside UCX's copy, has tests of its own)."""
    cfg = TransferConfig(backend=backend, verify_threads=verify_threads, verify_min_bytes=min_bytes,
                         ucx_fused_verify=False)
    hashed_on: set[str] = set()
    real = ucx_mod.payload_digests

    def spy(frame, buf):
        hashed_on.add(threading.current_thread().name)
        return real(frame, buf)
    monkeypatch.setattr(ucx_mod, "payload_digests", spy)  # the pool's hash
    monkeypatch.setattr(session_mod, "payload_digests", spy)  # the engine thread's (landed_digests)
    listener = Listener(cfg, sink)
    try:
        listener.start()
        assert (listener._server.engine.verify_pool is not None) == (verify_threads > 0)
        with Sender(cfg) as sender:
            keys, data = make_payload(32, blocks=4, layers=3, chunk=64 << 10)
            tx = sender.open(listener.address, keys, 3, 64 << 10)
            for layer in range(3):
                tx.send_layer(layer, [data[b, layer] for b in range(4)])
            tx.finish()
    finally:
        listener.stop()
    assert hashed_on and all(name.startswith(hashed_by) for name in hashed_on), hashed_on
    assert all(sink.data[(tx.transfer_id, keys[b], layer)] == data[b, layer].tobytes()
               for b in range(4) for layer in range(3))


def test_an_adaptive_engine_polls_while_a_transfer_is_open_and_sleeps_otherwise(engine_cls):
    with running(engine_cls(TransferConfig(backend="ucx", ucx_progress=UcxProgress.ADAPTIVE), "test")) as engine:
        engine.call(setattr, engine, "transfers_open", True)
        past_spin_window(engine)
        assert_polling(engine)  # still, while the transfer is open
        engine.call(setattr, engine, "transfers_open", False)
        past_spin_window(engine)
        assert_asleep(engine)
        assert engine.call(lambda: 3) == 3


def test_while_payloads_are_in_flight_the_sender_waits_inside_ucx_not_round_its_loop(backend):
    """A 4 MiB rendezvous returns from ``progress_worker_event`` once per few fragments; the
    sending engine going round its whole loop each time measured 600-800 rounds per payload
    here (sender and listener in one process: they share the GIL), against 2-60 waiting for
    the next completion in ``_wait_in_flight``. Rounds in the spin window after a busy round
    count too, so a transfer on a loaded machine takes a few hundred now and then (CI, the
    whole suite on two cores: 637, 422 and 165 in three): the fewest of five must be under the
    threshold, which the old loop never was (every transfer took 600-800)."""
    chunk, n = 4 << 20, 24
    cfg = TransferConfig(backend=backend)
    sink = MemorySink(slot_bytes=chunk, n_slots=n, keep=False)
    listener = Listener(cfg, sink)
    rounds, ids = [], []
    try:
        listener.start()
        with Sender(cfg) as sender:
            _, data = make_payload(33, blocks=4, layers=1, chunk=chunk)
            for t in range(5):
                keys = [bytes([t, i]) * 16 for i in range(n)]
                tx = sender.open(listener.address, keys, 1, chunk)
                engine = tx._channel.engine
                loops = engine.loops
                for b in range(n):
                    tx.send(b, 0, data[b % 4, 0])
                tx.finish()
                rounds.append((engine.loops - loops) / n)
                ids.append(tx.transfer_id)
    finally:
        listener.stop()
    assert all(sink.results[i][0].name == "OK" for i in ids), sink.results
    assert min(rounds) < 200, f"engine rounds per 4 MiB payload: {[round(r) for r in rounds]}"
