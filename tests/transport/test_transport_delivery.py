"""Delivery over both backends on loopback: bit-exact data, layer-pipelined arrival, refusal,
abort, deadlines and bad use. Every test also checks that no sink slot stays reserved."""

from __future__ import annotations

import os
import time

import pytest

from conftest import make_payload, wait_for
from daemon_util import free_port
from kvstore.transport import Sender, TransferConfig, TransferError, TransferStatus

POOL_VERIFY = True  # UCX tests run again with the receiver's verify pool (conftest)


def test_bit_exact_delivery(listener, sender, sink):
    keys, data = make_payload(1, blocks=5, layers=3, chunk=64 << 10)
    tx = sender.open(listener.address, keys, 3, 64 << 10, meta=b"ns-1")
    for layer in range(3):
        tx.send_layer(layer, [data[b, layer] for b in range(5)])
    res = tx.finish()
    assert (res.chunks, res.bytes) == (15, 15 * (64 << 10))
    assert sink.wait_result(res.transfer_id, 5) == (TransferStatus.OK, "")
    for b, key in enumerate(keys):
        for layer in range(3):
            assert sink.data[(res.transfer_id, key, layer)] == data[b, layer].tobytes()
    assert sink.reserved_slots == 0


def test_connection_is_reused_for_the_next_transfer(listener, sender, sink):
    keys, data = make_payload(2, blocks=2, layers=1, chunk=4096)
    for _ in range(3):
        tx = sender.open(listener.address, keys, 1, 4096)
        tx.send_layer(0, [data[0, 0], data[1, 0]])
        tx.finish()
    assert len(sender._idle[next(iter(sender._idle))]) == 1
    assert sink.reserved_slots == 0


def test_layers_arrive_in_order_while_later_layers_are_not_yet_sent(listener, sender, sink):
    blocks, layers = 4, 6
    keys, data = make_payload(3, blocks, layers, 32 << 10)
    tx = sender.open(listener.address, keys, layers, 32 << 10)
    for layer in range(layers):
        tx.send_layer(layer, [data[b, layer] for b in range(blocks)])
        # Layer l is complete at the receiver before layer l+1 is even handed to the sender.
        wait_for(lambda: sum(1 for _, ly, _t in sink.arrivals[tx.transfer_id] if ly == layer) == blocks,
                 what=f"layer {layer} to arrive")
    tx.finish()
    arrived = [ly for _b, ly, _t in sink.arrivals[tx.transfer_id]]
    assert arrived == sorted(arrived) and len(arrived) == blocks * layers
    assert sink.layers_ready[tx.transfer_id] == list(range(layers))
    assert sink.reserved_slots == 0


def test_refused_when_the_sink_has_no_room(listener, sender, sink):
    keys, _ = make_payload(4, blocks=65, layers=1, chunk=1024)  # 65 chunks, the sink has 64 slots
    with pytest.raises(TransferError) as ei:
        sender.open(listener.address, keys, 1, 1024)
    assert ei.value.status is TransferStatus.REFUSED
    assert ei.value.status.grpc_code == "RESOURCE_EXHAUSTED"
    assert sink.reserved_slots == 0
    keys, data = make_payload(4, blocks=1, layers=1, chunk=1024)  # the connection still works
    tx = sender.open(listener.address, keys, 1, 1024)
    tx.send(0, 0, data[0, 0])
    tx.finish()


def test_abort_releases_every_slot(listener, sender, sink):
    keys, data = make_payload(5, blocks=3, layers=2, chunk=8192)
    tx = sender.open(listener.address, keys, 2, 8192)
    tx.send_layer(0, [data[b, 0] for b in range(3)])
    wait_for(lambda: len(sink.arrivals[tx.transfer_id]) == 3, what="layer 0")
    assert sink.reserved_slots == 6
    tx.abort("prefill cancelled")
    status, detail = sink.wait_result(tx.transfer_id, 10)
    assert status is TransferStatus.ABORTED and "prefill cancelled" in detail
    assert sink.reserved_slots == 0
    assert not any(k[0] == tx.transfer_id for k in sink.data)


def test_end_before_every_chunk_is_a_protocol_error(listener, sender, sink):
    keys, data = make_payload(6, blocks=2, layers=2, chunk=4096)
    tx = sender.open(listener.address, keys, 2, 4096)
    tx.send_layer(0, [data[0, 0], data[1, 0]])
    with pytest.raises(TransferError) as ei:
        tx.finish()
    assert ei.value.status is TransferStatus.PROTOCOL_ERROR and "END after 2 of 4 chunks" in ei.value.detail
    assert sink.wait_result(tx.transfer_id, 10)[0] is TransferStatus.PROTOCOL_ERROR
    assert sink.reserved_slots == 0


def test_receiver_enforces_the_deadline(listener, sender, sink):
    keys, data = make_payload(7, blocks=2, layers=1, chunk=4096)
    tx = sender.open(listener.address, keys, 1, 4096, deadline_s=2.0)
    tx.send(0, 0, data[0, 0])
    wait_for(lambda: len(sink.arrivals.get(tx.transfer_id, ())) == 1, what="chunk 0 at the receiver")
    status, detail = sink.wait_result(tx.transfer_id, 10)
    assert status is TransferStatus.DEADLINE_EXCEEDED and "1 of 2 chunks" in detail
    assert sink.reserved_slots == 0
    with pytest.raises(TransferError) as ei:
        tx.send(1, 0, data[1, 0])
        tx.finish()
    assert ei.value.status is TransferStatus.DEADLINE_EXCEEDED


def test_bad_use_is_rejected_locally(listener, sender):
    keys, data = make_payload(8, blocks=1, layers=1, chunk=4096)
    tx = sender.open(listener.address, keys, 1, 4096)
    with pytest.raises(ValueError, match="4096"):
        tx.send(0, 0, data[0, 0][:100])
    with pytest.raises(ValueError, match="outside"):
        tx.send(1, 0, data[0, 0])
    tx.send(0, 0, data[0, 0])
    with pytest.raises(ValueError, match="already sent"):
        tx.send(0, 0, data[0, 0])
    tx.finish()
    with pytest.raises(ValueError, match="32 bytes"):
        sender.open(listener.address, [b"short"], 1, 4096)


def test_oversized_chunk_is_refused_by_the_receiver(backend, sink):
    from kvstore.transport import Listener
    lst = Listener(TransferConfig(backend=backend, max_chunk_bytes=4096), sink)
    lst.start()
    try:
        with Sender(TransferConfig(backend=backend)) as s, pytest.raises(TransferError) as ei:
            s.open(lst.address, make_payload(9, 1, 1, 8)[0], 1, 8192)
        assert ei.value.status is TransferStatus.PROTOCOL_ERROR and "8192" in ei.value.detail
    finally:
        lst.stop()
    assert sink.reserved_slots == 0


def test_connect_to_a_closed_port_fails_fast(config):
    port = free_port()  # nothing listens there
    with Sender(config) as sender:
        t0 = time.monotonic()  # the connect alone, not the engine's start and stop
        with pytest.raises(TransferError) as ei:
            sender.open(f"127.0.0.1:{port}", [os.urandom(32)], 1, 1024, deadline_s=config.connect_timeout_s)
        took = time.monotonic() - t0
    assert ei.value.status is TransferStatus.CONNECT_FAILED
    assert took < config.connect_timeout_s


def test_wrong_secret_is_refused(backend, sink):
    from kvstore.transport import Listener
    lst = Listener(TransferConfig(backend=backend, secret=b"s3cret-s3cret-s3cret", node_name="rx"), sink)
    lst.start()
    try:
        for cfg in (TransferConfig(backend=backend, secret=b"guess-guess-guess-guess"), TransferConfig(backend=backend)):
            with Sender(cfg) as s, pytest.raises(TransferError) as ei:
                s.open(lst.address, [os.urandom(32)], 1, 1024)
            assert ei.value.status is TransferStatus.UNAUTHENTICATED, ei.value
        with Sender(TransferConfig(backend=backend, secret=b"s3cret-s3cret-s3cret", node_name="tx")) as s:
            tx = s.open(lst.address, [os.urandom(32)], 1, 4)
            tx.send(0, 0, b"abcd")
            tx.finish()
        assert sink.reserved_slots == 0
    finally:
        lst.stop()


def test_listener_stop_ends_running_transfers_with_shutdown(config, sink, sender):
    from kvstore.transport import Listener
    lst = Listener(config, sink)
    lst.start()
    keys, data = make_payload(10, blocks=2, layers=1, chunk=4096)
    tx = sender.open(lst.address, keys, 1, 4096)
    tx.send(0, 0, data[0, 0])
    wait_for(lambda: sink.arrivals[tx.transfer_id], what="first chunk")
    lst.stop()
    assert sink.wait_result(tx.transfer_id, 10)[0] is TransferStatus.SHUTDOWN
    assert sink.reserved_slots == 0
    with pytest.raises(TransferError):
        tx.send(1, 0, data[1, 0])
        tx.finish()


def test_a_busy_port_is_a_clear_error(config, listener, sink):
    from kvstore.transport import Listener
    port = int(listener.address.rsplit(":", 1)[1])
    other = Listener(TransferConfig(backend=config.backend, port=port), sink)
    with pytest.raises(OSError, match=f"cannot listen on .*{port}"):
        other.start()


def test_known_digests_are_sent_as_given_and_checked_by_the_receiver(listener, sender, sink):
    from kvstore.transport.protocol import checksum
    keys, data = make_payload(21, blocks=3, layers=2, chunk=64 << 10)
    digests = [[checksum(data[b, layer]) for b in range(3)] for layer in range(2)]
    tx = sender.open(listener.address, keys, 2, 64 << 10)
    for layer in range(2):
        tx.send_layer(layer, [data[b, layer] for b in range(3)], digests[layer])
    res = tx.finish()
    assert sink.wait_result(res.transfer_id, 5) == (TransferStatus.OK, "")
    assert all(sink.data[(res.transfer_id, keys[b], 1)] == data[b, 1].tobytes() for b in range(3))
    # A digest that does not match the bytes (a stale record, memory corrupted since it was taken)
    # fails the transfer as corruption: nothing is kept, no slot stays reserved.
    tx = sender.open(listener.address, keys, 2, 64 << 10)
    with pytest.raises(TransferError) as ei:
        tx.send_layer(0, [data[b, 0] for b in range(3)], [digests[0][0], digests[0][1] ^ 1, digests[0][2]])
        tx.send_layer(1, [data[b, 1] for b in range(3)], digests[1])
        tx.finish()
    assert ei.value.status is TransferStatus.CHECKSUM_MISMATCH
    assert sink.wait_result(tx.transfer_id, 10)[0] is TransferStatus.CHECKSUM_MISMATCH
    assert not any(k[0] == tx.transfer_id for k in sink.data)
    assert sink.reserved_slots == 0
    with pytest.raises(ValueError), sender.open(listener.address, keys, 2, 64 << 10) as tx:
        tx.send_layer(0, [data[b, 0] for b in range(3)], [1, 2])  # two digests for three blocks
    wait_for(lambda: sink.reserved_slots == 0, what="the aborted transfer's slots to be released")
