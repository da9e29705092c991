"""Runs: consecutive layers of one block sent as one CHUNK message (``send_run``), over both
backends. Each layer is verified and reported on its own; a target that cannot take the run in
one piece gets it through a bounce buffer; corruption anywhere in a run fails the transfer and
keeps nothing; malformed runs are protocol errors."""

from __future__ import annotations

import re

import pytest

from conftest import make_payload
from kvstore.transport import MemorySink, TransferConfig, TransferError, TransferHeader, TransferStatus
from kvstore.transport.auth import Peer
from kvstore.transport.protocol import Frame, FrameType, checksum, layer_digests, pack_digests, run_checksum
from kvstore.transport.session import InboundSession

POOL_VERIFY = True  # UCX tests run again with the receiver's verify pool (conftest)

CHUNK = 16 << 10


@pytest.fixture(params=[True, False], ids=["in-place", "bounced"])
def sink(request):
    return MemorySink(slot_bytes=CHUNK, n_slots=64, runs=request.param)


def test_whole_blocks_as_runs_arrive_bit_exact_layer_by_layer(listener, sender, sink):
    keys, data = make_payload(41, blocks=3, layers=4, chunk=CHUNK)
    tx = sender.open(listener.address, keys, 4, CHUNK)
    sent = [tx.send_run(b, 0, data[b]) for b in range(3)]  # data[b]: the block's 4 layers, back to back
    res = tx.finish()
    assert (res.chunks, res.bytes) == (12, 12 * CHUNK)
    assert sink.wait_result(res.transfer_id, 10) == (TransferStatus.OK, "")
    assert sent == [[checksum(data[b, layer]) for layer in range(4)] for b in range(3)]
    for b, key in enumerate(keys):
        for layer in range(4):
            assert sink.data[(res.transfer_id, key, layer)] == data[b, layer].tobytes()
    assert sorted((b, layer) for b, layer, _ in sink.arrivals[res.transfer_id]) == \
        [(b, layer) for b in range(3) for layer in range(4)]
    assert sink.runs_in_place == (3 if sink.runs else 0)
    assert sink.reserved_slots == 0


def test_runs_and_single_layers_mix(listener, sender, sink):
    keys, data = make_payload(42, blocks=2, layers=4, chunk=CHUNK)
    tx = sender.open(listener.address, keys, 4, CHUNK)
    tx.send_run(0, 1, data[0, 1:4], digests=[checksum(data[0, layer]) for layer in range(1, 4)])
    tx.send(0, 0, data[0, 0])
    for layer in range(4):
        tx.send(1, layer, data[1, layer])
    res = tx.finish()
    assert sink.wait_result(res.transfer_id, 10) == (TransferStatus.OK, "")
    assert all(sink.data[(res.transfer_id, keys[b], layer)] == data[b, layer].tobytes()
               for b in range(2) for layer in range(4))


def test_a_corrupted_run_fails_the_transfer_and_keeps_nothing(listener, sender, sink):
    keys, data = make_payload(43, blocks=2, layers=4, chunk=CHUNK)

    def flip_in_layer_2_of_block_1(frame, payload):
        if frame.block != 1:
            return payload
        bad = bytearray(payload)
        bad[2 * CHUNK + 5] ^= 0x04
        return bytes(bad)
    sender.tamper = flip_in_layer_2_of_block_1
    tx = sender.open(listener.address, keys, 4, CHUNK)
    with pytest.raises(TransferError) as ei:
        for b in range(2):
            tx.send_run(b, 0, data[b])
        tx.finish()
    assert ei.value.status is TransferStatus.CHECKSUM_MISMATCH and "block 1, layer 2," in ei.value.detail
    status, _ = sink.wait_result(tx.transfer_id, 10)
    assert status is TransferStatus.CHECKSUM_MISMATCH
    assert not any(k[0] == tx.transfer_id for k in sink.data)
    assert sink.reserved_slots == 0


def test_send_run_rejects_bad_runs_before_anything_is_sent(listener, sender, sink):
    keys, data = make_payload(44, blocks=1, layers=4, chunk=CHUNK)
    tx = sender.open(listener.address, keys, 4, CHUNK)
    with pytest.raises(ValueError, match="whole number"):
        tx.send_run(0, 0, data[0].tobytes()[:CHUNK + 1])
    with pytest.raises(ValueError, match="outside"):
        tx.send_run(0, 2, data[0, :3])
    with pytest.raises(ValueError, match="2 digests for 3 layers"):
        tx.send_run(0, 0, data[0, :3], digests=[1, 2])
    tx.send(0, 1, data[0, 1])
    with pytest.raises(ValueError, match="repeats a sent layer"):
        tx.send_run(0, 0, data[0, :2])
    tx.send_run(0, 2, data[0, 2:])
    tx.send(0, 0, data[0, 0])
    res = tx.finish()
    assert sink.wait_result(res.transfer_id, 10) == (TransferStatus.OK, "")


def test_checksum_of_a_run_is_over_its_layer_digests():
    import struct

    import xxhash
    layers = [bytes([i]) * 1000 for i in range(3)]
    digests = layer_digests(b"".join(layers), 1000)
    assert digests == [checksum(x) for x in layers]
    assert run_checksum(digests) == xxhash.xxh3_64_intdigest(struct.pack("<3Q", *digests))
    assert run_checksum(digests[:1]) == digests[0]  # a run of one layer is a plain chunk


@pytest.mark.parametrize("layer, length, flags, message", [
    (0, CHUNK + 1, 0, "not a whole number"),
    (2, 3 * CHUNK, 3, "layers 2..4) outside the manifest"),
    (1, 2 * CHUNK, 2, "layer 1) sent twice"),
    (2, 2 * CHUNK, 0, "chunk of 2 layers announces 0 layer digests"),
    (2, CHUNK, 1, "chunk of 1 layers announces 1 layer digests"),
])
def test_malformed_runs_are_protocol_errors(layer, length, flags, message):
    keys, data = make_payload(45, blocks=1, layers=4, chunk=CHUNK)
    sink = MemorySink(slot_bytes=CHUNK, n_slots=8)
    s = InboundSession(TransferConfig(), sink, "test")
    s.authenticated(Peer("", "test"))
    header = TransferHeader(7, tuple(keys), 4, CHUNK, 5.0)
    assert s.on_control(Frame(FrameType.BEGIN, 7, length=len(header.encode())), header.encode())[0].type \
        is FrameType.ACCEPT
    one = Frame(FrameType.CHUNK, 7, 0, 0, 1, CHUNK, checksum(data[0, 1]), keys[0])
    mv = s.chunk_buffer(one)
    mv[:] = data[0, 1].tobytes()  # what the backend does: the payload lands, then is checked
    s.chunk_landed(one, mv)
    with pytest.raises(TransferError, match=re.escape(message)) as ei:
        s.chunk_buffer(Frame(FrameType.CHUNK, 7, 1, 0, layer, length, 0, keys[0], flags=flags))
    assert ei.value.status is TransferStatus.PROTOCOL_ERROR
    s.fail(ei.value)
    assert sink.reserved_slots == 0


def test_a_run_header_whose_digests_do_not_match_its_checksum_is_a_protocol_error():
    keys, data = make_payload(46, blocks=1, layers=2, chunk=CHUNK)
    s = InboundSession(TransferConfig(), MemorySink(slot_bytes=CHUNK, n_slots=4), "test")
    s.authenticated(Peer("", "test"))
    header = TransferHeader(8, tuple(keys), 2, CHUNK, 5.0)
    s.on_control(Frame(FrameType.BEGIN, 8, length=len(header.encode())), header.encode())
    sums = layer_digests(data[0], CHUNK)
    run = Frame(FrameType.CHUNK, 8, 0, 0, 0, 2 * CHUNK, run_checksum(sums), keys[0], flags=2)
    assert s.run_digests(run, pack_digests(sums)) == sums
    with pytest.raises(TransferError, match="do not match its checksum"):
        s.run_digests(run, pack_digests([sums[0], sums[1] ^ 1]))
    with pytest.raises(TransferError, match="came with 8 bytes of digests"):
        s.run_digests(run, pack_digests(sums[:1]))


def test_a_chunk_repeated_before_its_first_copy_was_verified_is_a_protocol_error():
    """A backend that verifies after reading the next header (UCX's pool) must still refuse a
    chunk sent twice in a row: a repeat standing in for a chunk never sent would otherwise
    bring END's count out right and commit a block with a layer that never arrived."""
    keys, data = make_payload(46, blocks=1, layers=2, chunk=CHUNK)
    sink = MemorySink(slot_bytes=CHUNK, n_slots=8)
    s = InboundSession(TransferConfig(), sink, "test")
    s.authenticated(Peer("", "test"))
    header = TransferHeader(8, tuple(keys), 2, CHUNK, 5.0)
    s.on_control(Frame(FrameType.BEGIN, 8, length=len(header.encode())), header.encode())
    first = Frame(FrameType.CHUNK, 8, 0, 0, 0, CHUNK, checksum(data[0, 0]), keys[0])
    s.chunk_buffer(first)  # landed, not yet verified
    with pytest.raises(TransferError, match=re.escape("layer 0) sent twice")) as ei:
        s.chunk_buffer(Frame(FrameType.CHUNK, 8, 1, 0, 0, CHUNK, checksum(data[0, 0]), keys[0]))
    assert ei.value.status is TransferStatus.PROTOCOL_ERROR
    s.fail(ei.value)
    assert sink.reserved_slots == 0
