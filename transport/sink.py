"""Where received chunks land: the interface the daemon implements, and a small in-memory
reference implementation used by the tests and the benchmark.

Contract (the receiving side of one transfer):

1. ``sink.begin(header, peer)`` reserves room for every chunk of the transfer, all or nothing,
   and returns a :class:`Target`; ``None`` refuses (back-pressure: REFUSED goes back to the
   sender). Raising :class:`TransferError` refuses with that status and text (FORBIDDEN: not
   from this peer). ``peer`` (:class:`~kvstore.transport.auth.Peer`) is who the handshake proved
   the sender to be.
2. ``target.buffer(block, layer)`` gives the writable destination of one chunk, exactly
   ``header.chunk_bytes`` bytes (a memoryview or uint8 numpy view of an arena slot). The
   transport writes the payload straight into it: no intermediate copy.
3. ``target.arrived(block, layer)`` says that chunk's bytes are in place and their checksum
   matched. Before this call the buffer's contents mean nothing.
4. ``target.end(status, detail)`` is called exactly once. ``OK`` means every chunk arrived
   verified: commit. Anything else: release every reserved slot; nothing may be served from them.

Threading: the listener calls these from its I/O thread(s), one transfer's calls from one thread
in the order above; different transfers may be served concurrently by different threads (TCP:
one thread per connection), so ``sink.begin`` must be thread-safe.
"""

from __future__ import annotations

import threading
import time
from typing import Protocol

import numpy as np

from .auth import Peer
from .protocol import TransferHeader, TransferStatus


class Target(Protocol):
    """One accepted transfer's destination. Optionally it has ``digests``: a writable sequence of
    ``n_chunks`` ints, where the session stores each chunk's verified xxh3-64 (index
    ``block * n_layers + layer``) before calling ``arrived`` (a daemon keeps them with the blocks).

    Optionally it has ``run(block, layer, k)``: one writable buffer for layers ``layer .. layer +
    k - 1`` of a block, where they lie back to back (or None where they do not). A run the target
    cannot take in one piece lands in a bounce buffer and is copied into ``buffer``s after it is
    verified; ``arrived`` is called per layer either way."""

    def buffer(self, block: int, layer: int) -> memoryview | np.ndarray: ...
    def arrived(self, block: int, layer: int) -> None: ...
    def end(self, status: TransferStatus, detail: str) -> None: ...


class Sink(Protocol):
    def begin(self, header: TransferHeader, peer: Peer) -> Target | None: ...
    # Optional: ``peer_refused(address, reason, detail)``, told of each peer whose handshake
    # failed (it never reached ``begin``); ``reason`` is AuthError.reason.


class LayerProgress:
    """Counts verified chunks per layer of one transfer; ``arrived`` returns True exactly once
    per layer, when its last block lands: the moment to ring that layer's doorbell for the
    decode worker. Not thread-safe (one transfer's calls come from one thread)."""

    def __init__(self, n_blocks: int, n_layers: int) -> None:
        self.n_blocks = n_blocks
        self.counts = [0] * n_layers
        self.ready_layers = 0  # layers complete so far, in any order

    def arrived(self, layer: int) -> bool:
        self.counts[layer] += 1
        if self.counts[layer] == self.n_blocks:
            self.ready_layers += 1
            return True
        return False


class MemorySink:
    """Reference sink over one preallocated uint8 array of ``n_slots * slot_bytes`` bytes.

    Each chunk of a transfer takes one slot; ``reserved_slots`` counts slots held by running
    transfers (it must return to 0 whatever happens: the "no leaked slots" check). Finished
    transfers are recorded in ``results``; with ``keep=True`` their bytes are copied out for
    inspection (tests), otherwise slots are reused at once (benchmark). ``on_arrival`` is
    called with ``(transfer_id, block, layer, monotonic time)`` from the I/O thread. With
    ``runs`` a run of layers whose slots happen to be adjacent lands in one piece; otherwise (or
    without ``runs``) the session bounces it.
    """

    def __init__(self, slot_bytes: int, n_slots: int, keep: bool = True, on_arrival=None,
                 runs: bool = True) -> None:
        self.slot_bytes = slot_bytes
        self.arena = np.zeros(slot_bytes * n_slots, dtype=np.uint8)
        self._free = list(range(n_slots - 1, -1, -1))
        self._lock = threading.Lock()
        self.keep = keep
        self.on_arrival = on_arrival
        self.results: dict[int, tuple[TransferStatus, str]] = {}
        self.data: dict[tuple[int, bytes, int], bytes] = {}  # (transfer id, key, layer) -> bytes
        self.arrivals: dict[int, list[tuple[int, int, float]]] = {}
        self.layers_ready: dict[int, list[int]] = {}  # transfer id -> layers in completion order
        self.done = threading.Condition(self._lock)
        self.refuse_next = False
        self.runs = runs
        self.runs_in_place = 0  # runs handed one piece of the arena

    @property
    def reserved_slots(self) -> int:
        with self._lock:
            return self.arena.size // self.slot_bytes - len(self._free)

    def begin(self, header: TransferHeader, peer: Peer | None = None) -> "_MemoryTarget | None":
        if header.chunk_bytes > self.slot_bytes:
            return None
        with self._lock:
            if self.refuse_next or len(self._free) < header.n_chunks:
                self.refuse_next = False
                return None
            slots = [self._free.pop() for _ in range(header.n_chunks)]
            self.arrivals[header.transfer_id] = []
            self.layers_ready[header.transfer_id] = []
        return _MemoryTarget(self, header, slots)

    def wait_result(self, transfer_id: int, timeout_s: float) -> tuple[TransferStatus, str] | None:
        """Block until ``transfer_id`` ended (or ``timeout_s`` passed); its (status, detail)."""
        with self._lock:
            self.done.wait_for(lambda: transfer_id in self.results, timeout_s)
            return self.results.get(transfer_id)

    def _release(self, slots: list[int], transfer_id: int, status: TransferStatus, detail: str) -> None:
        with self._lock:
            self._free.extend(slots)
            self.results[transfer_id] = (status, detail)
            self.done.notify_all()


class _MemoryTarget:
    def __init__(self, sink: MemorySink, header: TransferHeader, slots: list[int]) -> None:
        self.sink, self.header, self.slots = sink, header, slots
        self.progress = LayerProgress(len(header.keys), header.n_layers)
        self.ended = False

    def _slot(self, block: int, layer: int) -> np.ndarray:
        off = self.slots[block * self.header.n_layers + layer] * self.sink.slot_bytes
        return self.sink.arena[off:off + self.header.chunk_bytes]

    def buffer(self, block: int, layer: int) -> np.ndarray:
        return self._slot(block, layer)

    def run(self, block: int, layer: int, k: int) -> np.ndarray | None:
        i = block * self.header.n_layers + layer
        slots, size = self.slots[i:i + k], self.sink.slot_bytes
        if not self.sink.runs or size != self.header.chunk_bytes or slots != list(range(slots[0], slots[0] + k)):
            return None
        self.sink.runs_in_place += 1
        return self.sink.arena[slots[0] * size:(slots[0] + k) * size]

    def arrived(self, block: int, layer: int) -> None:
        now = time.monotonic()
        self.sink.arrivals[self.header.transfer_id].append((block, layer, now))
        if self.progress.arrived(layer):
            self.sink.layers_ready[self.header.transfer_id].append(layer)
        if self.sink.on_arrival is not None:
            self.sink.on_arrival(self.header.transfer_id, block, layer, now)

    def end(self, status: TransferStatus, detail: str) -> None:
        assert not self.ended, "Target.end called twice"
        self.ended = True
        h = self.header
        if status is TransferStatus.OK and self.sink.keep:
            for b, key in enumerate(h.keys):
                for layer in range(h.n_layers):
                    self.sink.data[(h.transfer_id, key, layer)] = self._slot(b, layer).tobytes()
        self.sink._release(self.slots, h.transfer_id, status, detail)
