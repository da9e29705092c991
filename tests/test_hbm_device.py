"""The device layer under the HBM tier: which device ``auto`` and explicit specs choose, and the
emulated streams and events keeping CUDA's ordering (in order on one stream, across streams by
events, a failure failing its event and everything waiting on it)."""

import pytest
from stream_util import BLOCKED_S, Gate

from kvstore.tiers.base import TierError
from kvstore.tiers.hbm_device import EmuEvent, EmuStream, choose_device


# --- device choice ---------------------------------------------------------------------------

def test_auto_without_cuda_is_emulated_with_reason():
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: auto picks it")
    c = choose_device("auto")
    assert c.emulated and c.reason.startswith("no CUDA device: torch.cuda.is_available() is False")


def test_explicit_cuda_index_without_cuda_raises():
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    with pytest.raises(TierError, match="CUDA device 0 requested"):
        choose_device("0")


@pytest.mark.parametrize("bad", ["gpu", "-1", "cuda:x", ""])
def test_bad_device_spec_raises(bad):
    with pytest.raises(ValueError, match="device"):
        choose_device(bad)


# --- emulated streams and events ---------------------------------------------------------------

def test_emu_stream_runs_in_submission_order():
    s = EmuStream()
    gate, seen = Gate(), []
    try:
        s.submit(gate)
        for i in range(5):
            s.submit(lambda i=i: seen.append(i))
        ev = s.record()
        assert not ev.query() and seen == []  # everything queued behind the gate
        gate.open()
        ev.synchronize(30)
        assert seen == [0, 1, 2, 3, 4]
    finally:
        s.close()


def test_emu_wait_event_orders_another_stream():
    a, b = EmuStream(), EmuStream()
    gate, seen = Gate(), []
    try:
        a.submit(gate)
        a.submit(lambda: seen.append("a"))
        ev_a = a.record()
        b.wait_event(ev_a)
        b.submit(lambda: seen.append("b"))
        ev_b = b.record()
        with pytest.raises(TimeoutError):
            ev_b.synchronize(BLOCKED_S)
        gate.open()
        ev_b.synchronize(30)
        assert seen == ["a", "b"]
    finally:
        a.close()
        b.close()


def test_emu_error_fails_its_event_and_every_waiter():
    a, b = EmuStream(), EmuStream()
    ran = []
    try:
        a.submit(lambda: 1 / 0)
        bad = a.record()
        a.submit(lambda: ran.append("a-next"))
        good = a.record()
        b.wait_event(bad)
        b.submit(lambda: ran.append("b"))  # its input failed: must not run
        dependent = b.record()
        with pytest.raises(ZeroDivisionError):
            bad.synchronize(30)
        good.synchronize(30)  # an error belongs to one op, not to the stream forever
        with pytest.raises(TierError, match="earlier transfer"):
            dependent.synchronize(30)
        assert ran == ["a-next"]
    finally:
        a.close()
        b.close()


def test_emu_event_timeout():
    with pytest.raises(TimeoutError):
        EmuEvent().synchronize(0.001)
