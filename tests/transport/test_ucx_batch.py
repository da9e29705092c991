"""UCX: chunks queued together leave as one BATCH control message (up to MAX_BATCH chunk
headers) followed by their payloads; what lands is still bit-exact, and a malformed BATCH fails
the transfer with PROTOCOL_ERROR and releases every slot."""

from __future__ import annotations

import threading

import pytest

from conftest import make_payload
from kvstore.transport import MemorySink, TransferError, TransferStatus
from kvstore.transport.protocol import FRAME_BYTES, MAX_BATCH, Frame, FrameType

BACKENDS = ["ucx"]


@pytest.fixture
def sink():
    return MemorySink(slot_bytes=4096, n_slots=256)


def queue_behind_busy_engine(tx, send) -> None:
    """Run ``send`` while the sender's engine is held busy, so everything it queues is waiting
    together when the engine gets to it."""
    engine = tx._channel.engine
    gate = threading.Event()
    engine.call_soon(gate.wait, 10)
    try:
        send()
    finally:
        gate.set()


@pytest.mark.parametrize("blocks", [40, MAX_BATCH + 36])
def test_a_layer_queued_at_once_travels_in_batches(listener, sender, sink, blocks):
    keys, data = make_payload(21, blocks=blocks, layers=2, chunk=4096)
    tx = sender.open(listener.address, keys, 2, 4096)
    sent_before = tx._channel.ctrl_sent  # the BEGIN
    for layer in range(2):
        queue_behind_busy_engine(tx, lambda: tx.send_layer(layer, [data[b, layer] for b in range(blocks)]))
    res = tx.finish()
    assert sink.wait_result(res.transfer_id, 10) == (TransferStatus.OK, "")
    for b, key in enumerate(keys):
        for layer in range(2):
            assert sink.data[(res.transfer_id, key, layer)] == data[b, layer].tobytes()
    batches_per_layer = -(-blocks // MAX_BATCH)
    assert tx._channel.ctrl_sent - sent_before == 2 * batches_per_layer + 1  # + END
    assert sink.reserved_slots == 0


@pytest.mark.parametrize("content, length, message", [
    (lambda tid: Frame(FrameType.END, tid).pack(), FRAME_BYTES, "BATCH may only carry CHUNK frames"),
    (lambda tid: Frame(FrameType.CHUNK, tid, 1, 1, 0, 4096).pack() + b"x", FRAME_BYTES + 1,
     "not 1..64 whole CHUNK entries"),
    (lambda tid: b"", 0, "not 1..64 whole CHUNK entries"),
])
def test_a_malformed_batch_fails_the_transfer_and_frees_its_slots(listener, sender, sink, content, length,
                                                                  message):
    keys, data = make_payload(22, blocks=2, layers=1, chunk=4096)
    tx = sender.open(listener.address, keys, 1, 4096)
    tx.send(0, 0, data[0, 0])
    ch = tx._channel
    bad = Frame(FrameType.BATCH, tx.transfer_id, length=length)
    ch.engine.call(lambda: ch.send_ctrl(bad, content(tx.transfer_id)))
    status, detail = sink.wait_result(tx.transfer_id, 10)
    assert status is TransferStatus.PROTOCOL_ERROR and message in detail
    assert sink.reserved_slots == 0
    with pytest.raises(TransferError):
        tx.finish()
