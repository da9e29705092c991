"""Wire format and configuration, without sockets: exact sizes, bounds and error texts."""

from __future__ import annotations

import os

import pytest

from kvstore.transport import Backend, TransferConfig, TransferHeader, TransferStatus, parse_peer
from kvstore.transport.protocol import (FRAME_BYTES, Frame, FrameType, ProtocolError, checksum, parse_status,
                                        status_frame)


def test_frame_roundtrip_and_size():
    key = os.urandom(32)
    f = Frame(FrameType.CHUNK, transfer_id=2**63 + 5, seq=7, block=3, layer=31, length=1 << 20,
              checksum=0xDEADBEEFCAFEF00D, key=key)
    raw = f.pack()
    assert len(raw) == FRAME_BYTES == 80
    assert Frame.unpack(raw) == f
    assert Frame.unpack(f.pack(checksum=1)).checksum == 1


@pytest.mark.parametrize("mutate, message", [
    (lambda b: b"XXXX" + b[4:], "bad magic"),
    (lambda b: b[:4] + bytes([9]) + b[5:], "protocol version 9"),
    (lambda b: b[:5] + bytes([99]) + b[6:], "unknown frame type 99"),
    (lambda b: b[:-1], "expected 80 bytes"),
])
def test_malformed_frames_are_protocol_errors(mutate, message):
    with pytest.raises(ProtocolError, match=message):
        Frame.unpack(mutate(Frame(FrameType.END).pack()))


def test_manifest_roundtrip_and_bounds():
    keys = tuple(os.urandom(32) for _ in range(3))
    h = TransferHeader(9, keys, n_layers=4, chunk_bytes=65536, deadline_s=2.5, meta=b"ns")
    assert (h.n_chunks, h.total_bytes) == (12, 12 * 65536)
    assert TransferHeader.decode(9, h.encode(), 16, 1 << 20, 64) == h
    with pytest.raises(ProtocolError, match="3 keys, allowed 1..2"):
        TransferHeader.decode(9, h.encode(), 2, 1 << 20, 64)
    with pytest.raises(ProtocolError, match="chunk of 65536 bytes, allowed 1..4096"):
        TransferHeader.decode(9, h.encode(), 16, 4096, 64)
    with pytest.raises(ProtocolError, match="length does not match"):
        TransferHeader.decode(9, h.encode() + b"x", 16, 1 << 20, 64)
    # meta: max_meta_bytes plus 64 bytes (16 token ids) per key
    big = TransferHeader(9, keys, n_layers=4, chunk_bytes=65536, deadline_s=2.5, meta=bytes(1 + 3 * 64))
    assert TransferHeader.decode(9, big.encode(), 16, 1 << 20, 1) == big
    with pytest.raises(ProtocolError, match=r"194 bytes of meta, allowed 193 \(1 \+ 64 per key\)"):
        TransferHeader.decode(9, TransferHeader(9, keys, 4, 65536, 2.5, bytes(2 + 3 * 64)).encode(), 16, 1 << 20, 1)


def test_status_frames_carry_status_and_reason():
    frame, text = status_frame(FrameType.ERROR, 4, TransferStatus.CHECKSUM_MISMATCH, "chunk 3 bad")
    err = parse_status(Frame.unpack(frame.pack()), text)
    assert err.status is TransferStatus.CHECKSUM_MISMATCH and err.transfer_id == 4
    assert "chunk 3 bad" in str(err)
    ok, text = status_frame(FrameType.RESULT, 4, TransferStatus.OK)
    assert parse_status(ok, text) is None
    # An ERROR frame that claims OK is still a failure.
    assert parse_status(Frame(FrameType.ERROR), b"").status is TransferStatus.PROTOCOL_ERROR


def test_checksum_is_xxh3_64_of_the_bytes():
    import xxhash
    data = os.urandom(100_000)
    assert checksum(memoryview(data)) == xxhash.xxh3_64_intdigest(data)


def test_every_status_maps_to_a_grpc_code():
    assert {s.grpc_code for s in TransferStatus} <= {
        "OK", "RESOURCE_EXHAUSTED", "DATA_LOSS", "UNAVAILABLE", "DEADLINE_EXCEEDED", "INTERNAL", "ABORTED", "PERMISSION_DENIED"}


def test_config_validation_and_peer_parsing():
    assert TransferConfig(backend="UCX").backend is Backend.UCX
    with pytest.raises(ValueError, match="unknown transport backend 'rdma'"):
        TransferConfig(backend="rdma")
    with pytest.raises(ValueError, match="port"):
        TransferConfig(port=70000)
    with pytest.raises(ValueError, match="connect_timeout_s"):
        TransferConfig(connect_timeout_s=0)
    for bad in (-2, 65):
        with pytest.raises(ValueError, match="verify_threads"):
            TransferConfig(verify_threads=bad)
    with pytest.raises(ValueError, match="verify_min_bytes"):
        TransferConfig(verify_min_bytes=-1)


def test_verify_threads_auto_leaves_small_hosts_inline():
    auto = TransferConfig()
    assert [auto.resolved_verify_threads(cpus) for cpus in (1, 2, 3, 4, 8, 16, 64)] == [0, 0, 0, 1, 2, 4, 4]
    assert TransferConfig(verify_threads=3).resolved_verify_threads(2) == 3
    assert TransferConfig(verify_threads=0).resolved_verify_threads(64) == 0
    assert parse_peer("10.0.0.2:7400") == ("10.0.0.2", 7400)
    assert parse_peer("[fe80::1]:7400") == ("fe80::1", 7400)
    for bad in ("10.0.0.2", "host:", ":80", "h:99999"):
        with pytest.raises(ValueError, match="host:port"):
            parse_peer(bad)


@pytest.mark.parametrize("nbytes", [1, 4096, (512 << 10) + 7, 3 << 20])
def test_tcp_receiver_hashes_in_pieces_to_the_senders_checksum(nbytes):
    """The TCP receiver hashes each piece as it lands; the digest is the one-shot xxh3 the
    sender put in the frame, and a flipped byte changes it."""
    import socket
    import threading

    from kvstore.transport.tcp import recv_hashed

    payload = os.urandom(nbytes)
    a, b = socket.socketpair()
    try:
        t = threading.Thread(target=a.sendall, args=(payload,))
        t.start()
        buf = bytearray(nbytes)
        got = recv_hashed(b, memoryview(buf), None)
        t.join()
        assert bytes(buf) == payload and got == checksum(payload)
        bad = bytearray(payload)
        bad[nbytes // 2] ^= 1
        t = threading.Thread(target=a.sendall, args=(bytes(bad),))
        t.start()
        assert recv_hashed(b, memoryview(buf), None) != checksum(payload)
        t.join()
    finally:
        a.close()
        b.close()
