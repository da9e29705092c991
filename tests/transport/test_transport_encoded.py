"""Encoded chunks (kvstore.codec's nibble) on the wire: agreed at BEGIN, decoded by the receiver
into place and checked against the raw layers' digests. Over TCP; a UCX receiver (and a
receiver without a decoder, as an older one) agrees to none, so the chunks travel raw.

The blocks are bf16 KV-like values (normally distributed): what the wire carries, not codec
figures (those are on a trained model's KV, ``kvstore bench codec``)."""

from __future__ import annotations

import dataclasses
import hashlib

import numpy as np
import pytest

from kvstore.codec import ChunkEncoder, Codec, decode_buffer, native
from kvstore.transport import Listener, MemorySink, TransferError, TransferStatus
from kvstore.transport.protocol import BEGIN_ENCODED, Frame, FrameType, checksum

pytestmark = pytest.mark.skipif(native() is None, reason="the C codec is built by make test (make codec)")
CHUNK = 16 << 10


def kv_blocks(seed: int, blocks: int, layers: int, chunk: int = CHUNK):
    keys = [hashlib.sha256(f"enc:{seed}:{b}".encode()).digest() for b in range(blocks)]
    x = np.random.default_rng(seed).standard_normal(blocks * layers * chunk // 2).astype(np.float32) * 0.5
    data = (x.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8).reshape(blocks, layers, chunk)
    return keys, data


ENCODER = ChunkEncoder(Codec.NIBBLE, "bf16")


@pytest.fixture
def config(config):
    """conftest's, with a receiver that decodes, as a daemon's (kvstore.codec)."""
    return dataclasses.replace(config, decode=decode_buffer)


@pytest.fixture(params=[True, False], ids=["in-place", "bounced"])
def sink(request):
    return MemorySink(slot_bytes=CHUNK, n_slots=64, runs=request.param)


def test_encoded_runs_and_layers_arrive_bit_exact_in_fewer_bytes(listener, sender, sink, backend):
    keys, data = kv_blocks(1, blocks=3, layers=4)
    tx = sender.open(listener.address, keys, 4, CHUNK, encoder=ENCODER)
    assert tx.codec == (int(Codec.NIBBLE) if backend == "tcp" else None)  # UCX: raw chunks
    sent = [tx.send_run(b, 0, data[b]) for b in range(2)]
    for layer in range(4):  # single layers too (a pipelined transfer's)
        tx.send(2, layer, data[2, layer])
    res = tx.finish()
    assert sink.wait_result(res.transfer_id, 10) == (TransferStatus.OK, "")
    assert sent == [[checksum(data[b, layer]) for layer in range(4)] for b in range(2)]
    assert all(sink.data[(res.transfer_id, keys[b], layer)] == data[b, layer].tobytes()
               for b in range(3) for layer in range(4))
    assert res.bytes == 12 * CHUNK
    if backend == "tcp":
        assert res.wire_bytes < res.bytes / 1.2  # bf16 normal values: about 1.33x
    else:
        assert res.wire_bytes == res.bytes
    assert sink.reserved_slots == 0


def test_what_does_not_shrink_travels_raw(listener, sender, sink, backend):
    keys = [hashlib.sha256(b"random").digest()]
    data = np.random.default_rng(2).integers(0, 256, (1, 4, CHUNK), dtype=np.uint8)  # random bytes
    tx = sender.open(listener.address, keys, 4, CHUNK, encoder=ENCODER)
    tx.send_run(0, 0, data[0])
    res = tx.finish()
    assert sink.wait_result(res.transfer_id, 10) == (TransferStatus.OK, "")
    assert res.wire_bytes == res.bytes
    assert all(sink.data[(res.transfer_id, keys[0], layer)] == data[0, layer].tobytes() for layer in range(4))


@pytest.mark.parametrize("where", ["header", "body"])
def test_a_corrupted_encoded_chunk_fails_the_transfer_and_keeps_nothing(listener, sender, sink, backend, where):
    if backend != "tcp":
        pytest.skip("UCX links carry raw chunks")
    keys, data = kv_blocks(3, blocks=2, layers=4)

    def flip(frame, payload):
        if frame.block != 1:
            return payload
        bad = bytearray(payload)
        bad[6 if where == "header" else len(bad) // 2] ^= 0x10  # a nibble header field, or codes/low bytes
        return bytes(bad)
    sender.tamper = flip
    tx = sender.open(listener.address, keys, 4, CHUNK, encoder=ENCODER)
    with pytest.raises(TransferError) as ei:
        for b in range(2):
            tx.send_run(b, 0, data[b])
        tx.finish()
    assert ei.value.status is TransferStatus.CHECKSUM_MISMATCH, ei.value
    assert ("does not decode" if where == "header" else "arrived with xxh3") in ei.value.detail
    status, _ = sink.wait_result(tx.transfer_id, 10)
    assert status is TransferStatus.CHECKSUM_MISMATCH
    assert not any(k[0] == tx.transfer_id for k in sink.data)
    assert sink.reserved_slots == 0


def test_a_receiver_without_a_decoder_gets_raw_chunks(config, sender):
    sink = MemorySink(slot_bytes=CHUNK, n_slots=16)
    lst = Listener(dataclasses.replace(config, decode=None), sink)  # as a receiver from before the codecs
    lst.start()
    try:
        keys, data = kv_blocks(4, blocks=1, layers=4)
        tx = sender.open(lst.address, keys, 4, CHUNK, encoder=ENCODER)
        assert tx.codec is None
        tx.send_run(0, 0, data[0])
        res = tx.finish()
        assert res.wire_bytes == res.bytes
        assert sink.wait_result(res.transfer_id, 10) == (TransferStatus.OK, "")
    finally:
        lst.stop()


def test_an_encoded_chunk_nobody_agreed_to_is_a_protocol_error(config, sink):
    """A sender that encodes without the receiver's ACCEPT saying so (here: BEGIN without the
    flag) is refused; the session never decodes what it did not agree to."""
    if config.backend.value != "tcp":
        pytest.skip("a raw-socket peer speaks TCP")
    from kvstore.transport.protocol import TransferHeader
    from kvstore.transport.session import InboundSession
    from kvstore.transport.auth import Peer

    s = InboundSession(config, sink, "test", decodes=True)
    s.authenticated(Peer("p", "127.0.0.1", "none"))
    keys, data = kv_blocks(5, blocks=1, layers=2)
    h = TransferHeader(7, tuple(keys), 2, CHUNK, 10.0)
    reply, _ = s.on_control(Frame(FrameType.BEGIN, 7, length=len(h.encode())), h.encode())
    assert reply.type is FrameType.ACCEPT and reply.flags == 0  # no BEGIN_ENCODED: none agreed
    payload = ENCODER(memoryview(data[0, 0]))
    with pytest.raises(TransferError) as ei:
        s.chunk_buffer(Frame(FrameType.CHUNK, 7, 0, 0, 0, len(payload), checksum(data[0, 0]), keys[0],
                             status=int(Codec.NIBBLE)))
    assert ei.value.status is TransferStatus.PROTOCOL_ERROR and "not agreed" in ei.value.detail
    s.fail(ei.value)
    # Agreed, an encoded chunk may not claim more bytes than its layers hold.
    s2 = InboundSession(config, sink, "test", decodes=True)
    s2.authenticated(Peer("p", "127.0.0.1", "none"))
    reply, _ = s2.on_control(Frame(FrameType.BEGIN, 8, length=len(h.encode()), flags=BEGIN_ENCODED), h.encode())
    assert reply.flags & (1 << int(Codec.NIBBLE))
    with pytest.raises(TransferError, match="encoded chunk of"):
        s2.chunk_buffer(Frame(FrameType.CHUNK, 8, 0, 0, 0, 2 * CHUNK + 1, 0, keys[0], status=int(Codec.NIBBLE),
                              flags=2))
    s2.fail(TransferError(TransferStatus.ABORTED, "test over"))
