"""A transport peer in its own process, for tests that kill one side or run it in another
network namespace. Speaks line-oriented stdout so the test can follow it.

    transport_peer.py recv --backend tcp --host 127.0.0.1 --port 0
        prints "LISTEN host:port", then per finished transfer
        "RESULT <tid> <status> reserved=<slots still reserved> digest=<xxh3 of the data>"
    transport_peer.py send --backend tcp --peer host:port --blocks 4 --layers 3 --chunk 65536 --seed 1
        prints "TID <tid>", then "DONE OK digest=<...>" or "FAIL <status> <detail>";
        with --stop-after K: after queueing K chunks prints "HALF" and waits to be killed;
        with --runs: each block's layers go as one run (send_run), K counts runs
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import threading
import time

import numpy as np
import xxhash

from kvstore.transport import Listener, MemorySink, Sender, TransferConfig, TransferError


def payload(seed: int, blocks: int, layers: int, chunk: int) -> tuple[list[bytes], np.ndarray]:
    """Deterministic keys and chunk data, the same in every process."""
    keys = [hashlib.sha256(f"{seed}:{b}".encode()).digest() for b in range(blocks)]
    data = np.random.default_rng(seed).integers(0, 256, (blocks, layers, chunk), dtype=np.uint8)
    return keys, data


def digest_of(chunks) -> str:
    h = xxhash.xxh3_64()
    for c in chunks:
        h.update(c)
    return h.hexdigest()


def out(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def recv(a) -> None:
    sink = MemorySink(a.slot_bytes, a.slots)
    listener = Listener(TransferConfig(backend=a.backend, host=a.host, port=a.port), sink)
    listener.start()
    out(f"LISTEN {listener.address}")
    seen = set()
    while True:
        with sink.done:
            sink.done.wait_for(lambda: set(sink.results) - seen, 0.5)
            new = [(t, sink.results[t]) for t in sink.results if t not in seen]
        for tid, (status, _detail) in new:
            seen.add(tid)
            order = sorted(((k, layer), v) for (t, k, layer), v in sink.data.items() if t == tid)
            out(f"RESULT {tid} {status.name} reserved={sink.reserved_slots} "
                f"digest={digest_of(v for _, v in order) if order else '-'}")


def send(a) -> None:
    keys, data = payload(a.seed, a.blocks, a.layers, a.chunk)
    sender = Sender(TransferConfig(backend=a.backend))
    try:
        tx = sender.open(a.peer, keys, a.layers, a.chunk, deadline_s=a.deadline)
        out(f"TID {tx.transfer_id}")
        items = [(b, None) for b in range(a.blocks)] if a.runs else \
            [(b, layer) for layer in range(a.layers) for b in range(a.blocks)]
        for n, (b, layer) in enumerate(items):
            if a.stop_after is not None and n == a.stop_after:
                out("HALF")
                threading.Event().wait()  # until SIGKILL
            if layer is None:
                tx.send_run(b, 0, data[b])
            else:
                tx.send(b, layer, data[b, layer])
        tx.finish()
    except TransferError as exc:
        out(f"FAIL {exc.status.name} {exc.detail}")
        return
    order = sorted((keys[b], layer) for b in range(a.blocks) for layer in range(a.layers))
    index = {k: i for i, k in enumerate(keys)}
    out(f"DONE OK digest={digest_of(data[index[k], layer].tobytes() for k, layer in order)}")
    sender.close()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("role", choices=["send", "recv"])
    p.add_argument("--backend", default="tcp")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--slots", type=int, default=64)
    p.add_argument("--slot-bytes", type=int, default=1 << 20)
    p.add_argument("--peer")
    p.add_argument("--blocks", type=int, default=4)
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--chunk", type=int, default=64 << 10)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--deadline", type=float, default=20.0)
    p.add_argument("--stop-after", type=int)
    p.add_argument("--runs", action="store_true")
    a = p.parse_args()
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    (send if a.role == "send" else recv)(a)
    time.sleep(0.1)


if __name__ == "__main__":
    main()
