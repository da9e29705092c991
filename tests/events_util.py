"""Reading a daemon's KV event stream in tests, decoded with vLLM's own classes
(``vllm.distributed.kv_events``), as a router would."""

from __future__ import annotations

import msgspec
import zmq
from vllm.distributed.kv_events import KVEventBatch

END = (-1).to_bytes(8, "big", signed=True)
_decode = msgspec.msgpack.Decoder(type=KVEventBatch).decode


def ask(replay_addr: str, body: bytes, timeout_s: float = 10.0) -> list[tuple[int, KVEventBatch]]:
    """One request on the replay socket (an 8-byte start number, or b"kvstore-snapshot"):
    the numbered batches answered, until the end marker."""
    ctx = zmq.Context.instance()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.RCVTIMEO, int(timeout_s * 1000))
    s.connect(replay_addr)
    try:
        s.send_multipart((b"", body))
        out = []
        while True:
            _, topic, seq, payload = s.recv_multipart()
            if seq == END:
                return out
            out.append((int.from_bytes(seq, "big"), _decode(payload)))
    finally:
        s.close(0)


def replay(replay_addr: str, start: int = 0) -> list[tuple[int, KVEventBatch]]:
    return ask(replay_addr, start.to_bytes(8, "big"))


def events_of(batches) -> list:
    return [e for _, b in batches for e in b.events]


class Live:
    """A SUB socket on the PUB endpoint: what it has received, decoded."""

    def __init__(self, addr: str) -> None:
        self.sock = zmq.Context.instance().socket(zmq.SUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.connect(addr)
        self.got: list[tuple[int, KVEventBatch]] = []

    def read(self) -> list[tuple[int, KVEventBatch]]:
        while self.sock.poll(0):
            topic, seq, payload = self.sock.recv_multipart()
            self.got.append((int.from_bytes(seq, "big"), _decode(payload)))
        return self.got

    def close(self) -> None:
        self.sock.close(0)
