"""Failures that must fail fast and cleanly: a corrupted chunk, a peer killed mid-transfer (by
SIGKILL, in its own process), and a peer that restarts on the same port."""

from __future__ import annotations

import signal
import time

import numpy as np
import pytest

from conftest import Peer, make_payload, wait_for
from kvstore.transport import TransferError, TransferStatus

POOL_VERIFY = True  # UCX tests run again with the receiver's verify pool (conftest)

DEADLINE_S = 15.0


def flip_one_bit(seq: int):
    """Sender test hook: corrupt the wire bytes of chunk ``seq`` only; the source stays intact
    and the header still carries the checksum of the source."""
    def tamper(frame, payload):
        if frame.seq != seq:
            return payload
        bad = bytearray(payload)
        bad[len(bad) // 2] ^= 0x10
        return bytes(bad)
    return tamper


def test_corrupted_chunk_is_detected_and_nothing_is_stored(listener, sender, sink):
    keys, data = make_payload(11, blocks=4, layers=2, chunk=64 << 10)
    sender.tamper = flip_one_bit(5)
    tx = sender.open(listener.address, keys, 2, 64 << 10)
    with pytest.raises(TransferError) as ei:
        for layer in range(2):
            tx.send_layer(layer, [data[b, layer] for b in range(4)])
        tx.finish()
    assert ei.value.status is TransferStatus.CHECKSUM_MISMATCH
    assert ei.value.status.grpc_code == "DATA_LOSS"
    assert "chunk 5 (block 1, layer 1" in ei.value.detail
    status, detail = sink.wait_result(tx.transfer_id, 10)
    assert status is TransferStatus.CHECKSUM_MISMATCH and "nothing of the transfer was kept" in detail
    assert not any(k[0] == tx.transfer_id for k in sink.data)
    assert sink.reserved_slots == 0
    # The chunks before the bad one did arrive (and were verified), and were still not kept.
    assert len(sink.arrivals[tx.transfer_id]) == 5
    # The next transfer, without corruption, goes through on a fresh connection.
    sender.tamper = None
    tx = sender.open(listener.address, keys, 2, 64 << 10)
    for layer in range(2):
        tx.send_layer(layer, [data[b, layer] for b in range(4)])
    tx.finish()
    assert sink.data[(tx.transfer_id, keys[3], 1)] == data[3, 1].tobytes()


@pytest.mark.parametrize("runs", [False, True], ids=["chunks", "runs"])
def test_sender_killed_mid_transfer_fails_the_receiver_within_its_deadline(backend, listener, sink, runs):
    peer = Peer("send", "--backend", backend, "--peer", listener.address, "--blocks", "4", "--layers", "4",
                "--chunk", str(64 << 10), "--stop-after", "2" if runs else "6", "--deadline", str(DEADLINE_S),
                *(["--runs"] if runs else []))
    try:
        tid = int(peer.expect("TID "))
        peer.expect("HALF")
        landed = 8 if runs else 6  # two runs of 4 layers, or 6 single chunks
        wait_for(lambda: len(sink.arrivals.get(tid, ())) == landed, what=f"{landed} chunks at the receiver")
        assert sink.reserved_slots == 16
        t_kill = time.monotonic()
        peer.kill()
        result = sink.wait_result(tid, DEADLINE_S)
        elapsed = time.monotonic() - t_kill
    finally:
        peer.kill()
    assert result is not None, "receiver did not notice the dead sender"
    assert result[0] is TransferStatus.PEER_LOST, result
    assert elapsed < DEADLINE_S  # noticed through the connection, not by waiting out the deadline
    assert sink.reserved_slots == 0
    assert not any(k[0] == tid for k in sink.data)


@pytest.mark.parametrize("runs", [False, True], ids=["chunks", "runs"])
def test_receiver_killed_mid_transfer_fails_the_sender_within_its_deadline(backend, sender, runs):
    peer = Peer("recv", "--backend", backend)
    try:
        address = peer.expect("LISTEN ")
        keys, data = make_payload(12, blocks=4, layers=4, chunk=64 << 10)
        tx = sender.open(address, keys, 4, 64 << 10, deadline_s=DEADLINE_S)
        if runs:
            tx.send_run(0, 0, data[0])
        else:
            tx.send_layer(0, [data[b, 0] for b in range(4)])
        time.sleep(0.2)
        t_kill = time.monotonic()
        peer.kill()
        with pytest.raises(TransferError) as ei:
            if runs:
                for b in range(1, 4):
                    tx.send_run(b, 0, data[b])
            else:
                for layer in range(1, 4):
                    tx.send_layer(layer, [data[b, layer] for b in range(4)])
            tx.finish()
        elapsed = time.monotonic() - t_kill
    finally:
        peer.kill()
    assert ei.value.status is TransferStatus.PEER_LOST, ei.value
    assert elapsed < DEADLINE_S


def test_transfers_work_again_after_the_receiver_restarts(backend, sender):
    keys, data = make_payload(13, blocks=2, layers=2, chunk=16 << 10)

    def ship(address: str) -> int:
        tx = sender.open(address, keys, 2, 16 << 10, deadline_s=DEADLINE_S)
        for layer in range(2):
            tx.send_layer(layer, [data[0, layer], data[1, layer]])
        return tx.finish().transfer_id

    first = Peer("recv", "--backend", backend)
    try:
        address = first.expect("LISTEN ")
        tid = ship(address)
        assert first.expect(f"RESULT {tid} ").startswith("OK reserved=0")
    finally:
        first.kill()
    port = address.rsplit(":", 1)[1]
    second = Peer("recv", "--backend", backend, "--port", port)  # same port, new process
    try:
        assert second.expect("LISTEN ") == address
        tid = ship(address)  # the pooled connection is dead: the sender reconnects by itself
        assert second.expect(f"RESULT {tid} ").startswith("OK reserved=0")
    finally:
        second.kill()


def test_hung_receiver_fails_the_sender_at_its_deadline(backend, sender):
    """A peer that stops answering without closing anything (SIGSTOP: a hung process, a
    partitioned host) is caught by the deadline, with DEADLINE_EXCEEDED."""
    deadline_s = 2.0
    peer = Peer("recv", "--backend", backend, "--slot-bytes", str(4 << 20), "--slots", "32")
    try:
        address = peer.expect("LISTEN ")
        keys, _ = make_payload(14, blocks=32, layers=1, chunk=8)
        chunk = np.zeros(4 << 20, dtype=np.uint8)
        t0 = time.monotonic()  # the deadline runs from before the connect
        tx = sender.open(address, keys, 1, 4 << 20, deadline_s=deadline_s)
        peer.proc.send_signal(signal.SIGSTOP)
        with pytest.raises(TransferError) as ei:
            for b in range(32):  # 128 MiB: more than any socket buffer or UCX window absorbs
                tx.send(b, 0, chunk)
            tx.finish()
        elapsed = time.monotonic() - t0
    finally:
        peer.kill()
    assert ei.value.status is TransferStatus.DEADLINE_EXCEEDED, ei.value
    assert deadline_s - 0.5 < elapsed < deadline_s + 5.0


def test_hung_sender_fails_the_receiver_at_its_deadline(backend, listener, sink):
    peer = Peer("send", "--backend", backend, "--peer", listener.address, "--blocks", "2", "--layers", "2",
                "--chunk", "4096", "--stop-after", "1", "--deadline", "1.5")
    try:
        tid = int(peer.expect("TID "))
        peer.expect("HALF")
        peer.proc.send_signal(signal.SIGSTOP)  # holds its connection open, sends nothing more
        result = sink.wait_result(tid, 10.0)
    finally:
        peer.kill()
    assert result is not None and result[0] is TransferStatus.DEADLINE_EXCEEDED, result
    assert sink.reserved_slots == 0


def test_large_chunks_are_verified_too(config, sender):
    """Chunks >= 1 MiB take the UCX receiver's off-thread verification path."""
    from kvstore.transport import Listener, MemorySink
    sink = MemorySink(slot_bytes=1 << 20, n_slots=8)
    lst = Listener(config, sink)
    lst.start()
    try:
        keys, data = make_payload(15, blocks=2, layers=2, chunk=1 << 20)
        sender.tamper = flip_one_bit(2)
        tx = sender.open(lst.address, keys, 2, 1 << 20)
        with pytest.raises(TransferError) as ei:
            for layer in range(2):
                tx.send_layer(layer, [data[0, layer], data[1, layer]])
            tx.finish()
        assert ei.value.status is TransferStatus.CHECKSUM_MISMATCH
        assert sink.wait_result(tx.transfer_id, 10)[0] is TransferStatus.CHECKSUM_MISMATCH
        sender.tamper = None
        tx = sender.open(lst.address, keys, 2, 1 << 20)
        for layer in range(2):
            tx.send_layer(layer, [data[0, layer], data[1, layer]])
        tx.finish()
        assert all(sink.data[(tx.transfer_id, keys[b], layer)] == data[b, layer].tobytes()
                   for b in range(2) for layer in range(2))
    finally:
        lst.stop()
    assert sink.reserved_slots == 0
