"""The fused UCX receive (transport/_fused.c): a tagged receive whose copy-out also computes each
layer's xxh3-64, over real UCX endpoints on loopback (shared memory between two workers).

`make test` builds the module (scripts/build_fused.sh); where UCX is available and the module is
not, the first test fails and says how to build it, rather than the fused path going untested.
"""

from __future__ import annotations

import gc
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest
import xxhash

from conftest import make_payload
from kvstore.transport import Listener, MemorySink, Sender, TransferConfig, ucx_available
from kvstore.transport import session as session_mod
from kvstore.transport import ucx as ucx_mod
from kvstore.transport import ucx_env
from kvstore.transport.protocol import TransferError, TransferStatus

BACKENDS = ["ucx"]
FULL = (1 << 64) - 1

pytestmark = pytest.mark.skipif(not ucx_available()[0], reason=f"UCX: {ucx_available()[1]}")


def test_the_fused_receive_is_built_where_ucx_is():
    module, why = ucx_env.fused()
    assert module is not None, f"{why} (make test runs it)"


class Pair:
    """Two UCX workers of this process, the second connected to the first; progressed by hand."""

    def __init__(self) -> None:
        api, self.Array = ucx_env.load()
        self.api = api
        feats = (api.Feature.TAG, api.Feature.STREAM)
        self.rx = api.UCXWorker(api.UCXContext(feature_flags=feats))
        self.tx = api.UCXWorker(api.UCXContext(feature_flags=feats))
        self.fused = ucx_env.fused()[0]
        if self.fused is None:
            pytest.skip(ucx_env.fused()[1])
        eps: list = []
        self.listener = api.UCXListener.create(
            worker=self.rx, port=0, cb_func=lambda cr: eps.append(self.listener.create_endpoint_from_conn_request(cr, True)))
        self.ep = api.UCXEndpoint.create(self.tx, "127.0.0.1", self.listener.port, True)
        self.until(lambda: eps)
        self.rx_ep = eps[0]
        # a first message each way finishes wireup, so the lanes below are the final ones
        self.transfer(np.zeros(8, np.uint8), 8)

    def until(self, done, timeout_s: float = 10.0) -> None:
        end = time.monotonic() + timeout_s
        while not done():
            assert time.monotonic() < end, "UCX request did not complete"
            self.rx.progress()
            self.tx.progress()

    def recv(self, buf, piece: int, tag: int = 7):
        return self.fused.Recv(self.rx.handle, buf, tag, FULL, piece)

    def send(self, data: np.ndarray, tag: int = 7):
        return self.ep.tag_send(self.Array(data), self.api.UCXXTag(tag))

    def transfer(self, data: np.ndarray, piece: int, size: int | None = None):
        """Send ``data``; receive it into a fresh buffer of ``size`` bytes. (request, buffer)."""
        buf = np.zeros(size or data.nbytes, np.uint8)
        r = self.recv(buf, piece)
        s = self.send(data)
        self.until(lambda: r.completed and s.completed)
        return r, buf

    def close(self) -> None:
        self.ep.close_blocking()
        self.listener = None


@pytest.fixture
def pair():
    p = Pair()
    yield p
    p.close()


@pytest.mark.parametrize("layers,piece", [(1, 4 << 10), (4, 64 << 10), (4, 256 << 10), (1, 4 << 20), (8, 1 << 20)],
                         ids=["4KiB-eager", "4x64KiB", "4x256KiB", "4MiB", "8x1MiB"])
def test_each_layer_of_a_message_lands_with_its_xxh3(pair, layers, piece):
    data = np.random.default_rng(piece + layers).integers(0, 256, layers * piece, dtype=np.uint8)
    r, buf = pair.transfer(data, piece)
    r.check_error()
    assert r.status == "" and r.length == data.nbytes
    assert np.array_equal(buf, data)
    assert r.digests == [xxhash.xxh3_64_intdigest(data[i * piece:(i + 1) * piece]) for i in range(layers)]


@pytest.mark.parametrize("layers,piece", [(1, 4 << 10), (4, 1 << 20)], ids=["eager", "4x1MiB-rendezvous"])
def test_a_message_sent_before_its_receive_is_posted_lands_with_its_xxh3(pair, layers, piece):
    """The sender does not wait for the receive: UCX holds an eager message as unexpected (and
    a rendezvous one as its announcement) until the receive is posted, then unpacks it."""
    data = np.random.default_rng(layers).integers(0, 256, layers * piece, dtype=np.uint8)
    s = pair.send(data)
    for _ in range(200):  # the message reaches the receiving worker before any receive exists
        pair.rx.progress()
        pair.tx.progress()
    buf = np.zeros(data.nbytes, np.uint8)
    r = pair.recv(buf, piece)
    pair.until(lambda: r.completed and s.completed)
    r.check_error()
    assert r.length == data.nbytes and np.array_equal(buf, data)
    assert r.digests == [xxhash.xxh3_64_intdigest(data[i * piece:(i + 1) * piece]) for i in range(layers)]


def test_lanes_between_two_workers_of_one_node_are_shared_memory(pair):
    ok, lanes = ucx_env.fused_lanes(pair.fused, pair.rx_ep)
    assert ok, lanes
    assert "sysv" in lanes or "posix" in lanes, lanes


def test_a_short_message_reports_its_length_and_no_digests(pair):
    data = np.arange(3 << 10, dtype=np.uint32).view(np.uint8)  # 12 KiB into 16 KiB
    r, buf = pair.transfer(data, 16 << 10, size=16 << 10)
    r.check_error()
    assert r.length == data.nbytes
    assert r.digests is None  # the last layer never filled: nothing to vouch for
    assert np.array_equal(buf[:data.nbytes], data)


def test_a_message_longer_than_the_buffer_fails_and_writes_nothing_past_it(pair):
    data = np.full(64 << 10, 9, np.uint8)
    guard = np.zeros(96 << 10, np.uint8)
    r = pair.recv(guard[:32 << 10], 32 << 10)
    s = pair.send(data)
    pair.until(lambda: r.completed and s.completed)
    assert r.status and "trunc" in r.status.lower(), r.status
    with pytest.raises(RuntimeError, match="UCX receive failed"):
        r.check_error()
    assert r.digests is None
    assert not guard[32 << 10:].any()


def test_a_cancelled_receive_completes_with_an_error_and_the_worker_goes_on(pair):
    buf = np.zeros(1 << 20, np.uint8)
    r = pair.recv(buf, 1 << 20, tag=99)
    assert not r.completed and r.status is None
    r.cancel()
    pair.until(lambda: r.completed)
    assert "cancel" in r.status.lower(), r.status
    # A receive dropped while still posted: UCX is told to cancel it and its memory is kept until
    # UCX lets go (then freed when the next receive is posted); the worker still works.
    pending = pair.recv(np.zeros(1 << 20, np.uint8), 1 << 20, tag=98)
    del pending
    gc.collect()
    for _ in range(20):
        pair.rx.progress()
    data = np.random.default_rng(5).integers(0, 256, 1 << 20, dtype=np.uint8)
    r2, out = pair.transfer(data, 1 << 20)
    assert r2.digests == [xxhash.xxh3_64_intdigest(data)] and np.array_equal(out, data)


def test_buffers_that_are_not_whole_layers_or_not_writable_are_refused(pair):
    with pytest.raises(ValueError, match="whole pieces"):
        pair.recv(np.zeros(1000, np.uint8), 300)
    with pytest.raises(ValueError, match="whole pieces"):
        pair.recv(np.zeros(1000, np.uint8), 0)
    with pytest.raises((TypeError, BufferError)):
        pair.recv(bytes(1024), 1024)


@pytest.mark.parametrize("lanes,fused", [([("sysv", "memory"), ("tcp", "lo"), ("tcp", "")], True),
                                         ([("posix", "memory")], True),
                                         ([("tcp", "eth0")], False),  # another node over TCP
                                         ([("rc_mlx5", "mlx5_0:1"), ("sysv", "memory")], False),  # RDMA: zero-copy
                                         ([("cma", "memory"), ("sysv", "memory")], False),
                                         ([], False)])
def test_only_endpoints_whose_bulk_lanes_copy_through_shared_memory_are_fused(lanes, fused):
    module = SimpleNamespace(transports=lambda handle: lanes)
    assert ucx_env.fused_lanes(module, SimpleNamespace(handle=1))[0] is fused


@pytest.mark.parametrize("as_runs,in_place", [(False, True), (True, True), (True, False)],
                         ids=["layers", "runs-in-place", "runs-bounced"])
def test_through_the_transport_payloads_are_verified_without_a_second_hash(as_runs, in_place, monkeypatch):
    """The listener's engine hashes nothing once landed: every digest came out of UCX's copy."""
    hashed: list[str] = []
    real = session_mod.payload_digests

    def spy(frame, buf):
        hashed.append(threading.current_thread().name)
        return real(frame, buf)
    monkeypatch.setattr(ucx_mod, "payload_digests", spy)
    monkeypatch.setattr(session_mod, "payload_digests", spy)
    cfg = TransferConfig(backend="ucx", verify_threads=0)
    chunk = 256 << 10
    sink = MemorySink(slot_bytes=chunk, n_slots=64, runs=in_place)
    listener = Listener(cfg, sink)
    try:
        listener.start()
        assert listener._server.engine.fused is not None
        with Sender(cfg) as sender:
            keys, data = make_payload(41, blocks=4, layers=4, chunk=chunk)
            tx = sender.open(listener.address, keys, 4, chunk)
            if as_runs:
                for b in range(4):
                    tx.send_run(b, 0, data[b])
            else:
                for layer in range(4):
                    tx.send_layer(layer, [data[b, layer] for b in range(4)])
            res = tx.finish()
        assert sink.wait_result(res.transfer_id, 10) == (ucx_mod.TransferStatus.OK, "")
    finally:
        listener.stop()
    assert not hashed, hashed
    assert sink.runs_in_place == (4 if as_runs and in_place else 0)
    assert all(sink.data[(res.transfer_id, keys[b], layer)] == data[b, layer].tobytes()
               for b in range(4) for layer in range(4))


def test_a_payload_shorter_than_its_header_fails_the_transfer_and_stores_nothing():
    """A sender whose payload is shorter than the length its header announced (here: the last
    4 KiB of the second chunk cut off on the wire): the fused receive reports the length it
    got, the listener fails the transfer with PROTOCOL_ERROR, stores none of it, and serves the
    next sender."""
    chunk = 256 << 10
    cfg = TransferConfig(backend="ucx", verify_threads=0)
    sink = MemorySink(slot_bytes=chunk, n_slots=16)
    listener = Listener(cfg, sink)

    def cut_second_layer(frame, mv):
        return mv[:-4096] if frame.seq == 1 else mv  # the second chunk on the wire
    try:
        listener.start()
        assert listener._server.engine.fused is not None
        keys, data = make_payload(43, blocks=2, layers=4, chunk=chunk)
        with Sender(cfg, tamper=cut_second_layer) as sender:
            tx = sender.open(listener.address, keys, 4, chunk)
            with pytest.raises(TransferError, match="chunk 1: 258048 bytes arrived, its header announced 262144") as e:
                for layer in range(4):
                    tx.send_layer(layer, [data[b, layer] for b in range(2)])
                tx.finish()
            assert e.value.status is TransferStatus.PROTOCOL_ERROR  # the sender hears why
        status, detail = sink.wait_result(tx.transfer_id, 10)
        assert status is TransferStatus.PROTOCOL_ERROR and "bytes arrived, its header announced" in detail
        assert not sink.data
        with Sender(cfg) as sender:  # the listener goes on serving
            tx = sender.open(listener.address, keys, 4, chunk)
            for layer in range(4):
                tx.send_layer(layer, [data[b, layer] for b in range(2)])
            res = tx.finish()
        assert sink.wait_result(res.transfer_id, 10) == (TransferStatus.OK, "")
        assert all(sink.data[(res.transfer_id, keys[b], layer)] == data[b, layer].tobytes()
                   for b in range(2) for layer in range(4))
    finally:
        listener.stop()
