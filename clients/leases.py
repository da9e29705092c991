"""Leases a client holds: reserved slots to write, pinned blocks to read, and blocks a peer is
shipping here. Each is a context manager; the data moves through zero-copy arena views. And
:class:`QuietReleases`: read leases' Releases held until an engine is quiet."""

from __future__ import annotations

import concurrent.futures
import queue
import threading
import time
from typing import TYPE_CHECKING, Self

import grpc
import numpy as np

from kvstore import doorbell
from kvstore.layout import AttnKind, KVLayout
from kvstore.v1 import kvstore_pb2 as pb

if TYPE_CHECKING:
    from kvstore.clients.client import KVStoreClient

RESERVED = pb.SLOT_RESERVED  # WriteLease.states[i] of a slot to fill (the others: pb.SlotState)
RELEASE_QUIET_S = 0.005  # a load's Release waits for this much quiet after the engine's last step...
RELEASE_WITHIN_S = 0.5  # ...or this long at most (an engine that never pauses)


class QuietReleases:
    """The Releases of a worker's loads, held until its engine has been quiet for ``quiet_s``
    (``quiet()``: seconds since its last step began, ran a layer or ended), when the step's output is out,
    or until ``within_s`` after the oldest was held. Sent right after the step, a Release in
    flight lengthened the step's tail (sampling, the scheduler's update, the output) from 4-9 ms
    to 15-72 ms (profiled in ``kvstore bench vllm``'s engines on this 2-core VM): the call's
    thread takes the GIL from vLLM's, and the daemon answering takes a core from its OpenMP
    team. The pins last that much longer; nothing waits for them. ``send(items)`` sends
    ``items`` in order; :meth:`flush` sends what is held now (before the client that holds
    them is closed)."""

    def __init__(self, send, quiet, quiet_s: float = RELEASE_QUIET_S, within_s: float = RELEASE_WITHIN_S) -> None:
        self._send, self._quiet = send, quiet
        self.quiet_s, self.within_s = quiet_s, within_s
        self._items: list = []
        self._since = 0.0  # when the oldest item held was
        self._cv = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="kvstore-release", daemon=True)
        self._thread.start()

    def hold(self, items: list) -> None:
        if not items:
            return
        with self._cv:
            if not self._items:
                self._since = time.monotonic()
            self._items += items
            self._cv.notify()

    def flush(self) -> None:
        with self._cv:
            items, self._items = self._items, []
        if items:
            self._send(items)

    def close(self) -> None:
        """Send what is held and stop."""
        with self._cv:
            self._closed = True
            self._cv.notify()
        self._thread.join(5)
        self.flush()

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._items and not self._closed:
                    self._cv.wait()
                if self._closed:
                    return
                since = self._since
            wait = min(self.quiet_s - self._quiet(), since + self.within_s - time.monotonic())
            if wait > 0:
                time.sleep(wait)  # then look again: a step may have begun meanwhile
                continue
            self.flush()


def pack(keys) -> bytes:
    """Keys as a request carries them: back to back, 32 bytes each."""
    return b"".join(keys)


class KVStoreError(RuntimeError):
    """A request the daemon refused; ``code`` is the gRPC status code, ``refusal`` the
    ``pb.Refusal`` the daemon named for clients to act on (0 = none)."""

    def __init__(self, code: grpc.StatusCode, message: str, refusal: int = 0) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message
        self.refusal = refusal


class CommitOnExit:
    """As a context manager: ``commit()`` on success, ``abort()`` on an exception."""

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type, *_):
        if exc_type is None:
            self.commit()
        else:
            self.abort()


class WriteLease(CommitOnExit):
    """Reserved slots; ``views[i]`` is key i's slot (None when already present or busy).
    As a context manager it commits on success and aborts on an exception."""

    def __init__(self, client: "KVStoreClient", keys: list[bytes], resp: pb.ReserveResponse) -> None:
        self.client, self.keys, self.lease_id = client, keys, resp.lease_id
        self.states = resp.states
        self.offsets = list(resp.offsets)
        self.doorbell = resp.doorbell_offset
        self.done = self.lease_id == 0

    def ring(self, layers: int) -> None:
        """Announce that the first ``layers`` layers of every reserved slot are written (a
        shared-memory store: a pipelined Transfer ships them without any RPC)."""
        if not self.doorbell:
            raise RuntimeError("this lease has no doorbell: reserve(..., doorbell=True)")
        doorbell.ring(self.client.arena.buf, self.doorbell, layers)

    def layer_view(self, i: int, layer: int) -> np.ndarray | None:
        """Layer ``layer`` of key i's slot: ``[2, block_tokens, row]`` bytes (MLA: ``[block_tokens, row]``)."""
        v = self.view(i)
        return None if v is None else _layer(v, self.client.layout, layer)

    def view(self, i: int) -> np.ndarray | None:
        if self.states[i] != RESERVED:
            return None
        return self.client.arena.view(self.offsets[i], self.client.layout.block_bytes)

    def commit(self) -> int:
        if self.done:
            return 0
        self.done = True
        return self.client.call("Commit", pb.CommitRequest(session_id=self.client.session_id,
                                                            lease_id=self.lease_id)).committed

    def abort(self) -> None:
        if not self.done:
            self.done = True
            self.client.call("Abort", pb.AbortRequest(session_id=self.client.session_id, lease_id=self.lease_id))

def _layer(block: np.ndarray, layout: KVLayout, layer: int) -> np.ndarray:
    c = layout.layer_chunk_bytes
    chunk = block[layer * c:(layer + 1) * c]
    if layout.kind is AttnKind.MLA:
        return chunk.reshape(layout.block_tokens, -1)
    return chunk.reshape(2, layout.block_tokens, -1)


class IncomingTransfer:
    """Blocks a peer is shipping here, pinned: ``wait_layer(l)`` returns once layer ``l`` of every
    block has arrived and was verified (polling the transfer's shared-memory doorbell)."""

    def __init__(self, client: "KVStoreClient", resp: pb.AwaitTransferResponse) -> None:
        self.client, self.state = client, resp.state
        self.lease_id, self.offsets, self.doorbell = resp.lease_id, list(resp.offsets), resp.doorbell_offset
        self.detail = resp.detail

    def layers_ready(self) -> int:
        if not self.doorbell:
            return self.client.layout.num_layers if self.state == pb.TRANSFER_DONE else 0
        layers, state = doorbell.read(self.client.arena.buf, self.doorbell)
        if state == doorbell.FAILED:
            raise KVStoreError(grpc.StatusCode.ABORTED, "the incoming transfer failed; recompute")
        return layers

    def wait_layer(self, layer: int, timeout_s: float = 30.0) -> None:
        deadline, pause = time.monotonic() + timeout_s, 20e-6
        while self.layers_ready() <= layer:
            if time.monotonic() > deadline:
                raise KVStoreError(grpc.StatusCode.DEADLINE_EXCEEDED, f"layer {layer} did not arrive in {timeout_s} s")
            time.sleep(pause)
            pause = min(pause * 2, 2e-4)

    def layer_view(self, i: int, layer: int) -> np.ndarray:
        L = self.client.layout
        return _layer(self.client.arena.view(self.offsets[i], L.block_bytes), L, layer)

    def release(self) -> None:
        if self.lease_id:
            lid, self.lease_id = self.lease_id, 0
            self.client.call("Release", pb.ReleaseRequest(session_id=self.client.session_id, lease_id=lid))

    def __enter__(self) -> "IncomingTransfer":
        return self

    def __exit__(self, *_):
        self.release()


class PullingTransfer(IncomingTransfer):
    """The blocks a pull is bringing here (:meth:`KVStoreClient.pull_layers`), followed layer
    by layer like any :class:`IncomingTransfer`: block ``i`` is the pull's ``keys[have + i]``.
    A pull whose transfer could not be followed (it missed, brought fewer blocks than asked, or
    ended before the wait got there) is settled from its answer: the blocks it brought are
    pinned with every layer ready (``blocks`` says how many); with none, :meth:`layers_ready`
    raises NOT_FOUND with the pull's reason, and the worker recomputes."""

    def __init__(self, client: "KVStoreClient", pull: grpc.Future, resp: pb.AwaitTransferResponse | None,
                 keys: list[bytes], have: int) -> None:
        self._pull = pull
        if resp is None or not resp.lease_id:
            r = self.result()
            n = max(0, r.blocks - have)  # leading blocks here now, of those after the ``have``
            resp = pb.AwaitTransferResponse(state=pb.TRANSFER_UNKNOWN, detail=r.detail or "the pull brought nothing")
            if n:
                lease = client.acquire(keys[have:have + n], allow_partial=True)
                resp = pb.AwaitTransferResponse(state=pb.TRANSFER_DONE, lease_id=lease.lease_id,
                                                offsets=lease.offsets[:lease.count], detail=r.detail)
        super().__init__(client, resp)

    @property
    def blocks(self) -> int:
        """Blocks followed (all those asked for, unless the pull brought fewer)."""
        return len(self.offsets)

    def layers_ready(self) -> int:
        if self.state == pb.TRANSFER_UNKNOWN:
            raise KVStoreError(grpc.StatusCode.NOT_FOUND, f"the pull brought no block: {self.detail}; recompute")
        return super().layers_ready()

    def result(self):
        """The pull's answer (a ``peer_pb2.PullResponse``), waiting for it."""
        try:
            return self._pull.result()
        except grpc.RpcError as e:
            raise KVStoreError(e.code(), e.details() or "") from None


class ReadLease:
    """Pinned blocks; ``view(i)`` reads block i in place. Released on context exit.
    ``session_id``: the session that holds the lease, where it is not ``client``'s (a lease an
    engine's scheduler took in its Lookup, copied and released by its worker)."""

    def __init__(self, client: "KVStoreClient", resp: pb.AcquireResponse, session_id: bytes = b"") -> None:
        self.client, self.lease_id = client, resp.lease_id
        self.session_id = session_id
        # The arena its offsets name: the client's when the answer came (another thread's call
        # may register the client anew, with a restarted daemon's arena, before this is used).
        self.arena = client.arena
        self.offsets = list(resp.offsets)
        self.count = resp.acquired
        self.hbm_offsets = list(resp.hbm_offsets)  # per block: its copy in the HBM pool, or -1

    def view(self, i: int) -> np.ndarray:
        return self.client.arena.view(self.offsets[i], self.client.layout.block_bytes)

    def release(self, wait: bool = False) -> None:
        """End the lease. By default the Release RPC is not waited for (it cannot fail in a way
        the reader could act on; a lost release is reclaimed at the lease TTL)."""
        if self.lease_id:
            lid, self.lease_id = self.lease_id, 0
            req = pb.ReleaseRequest(session_id=self.session_id or self.client.session_id, lease_id=lid)
            if wait:
                self.client.call("Release", req)
            else:
                self.client.release_later(req)

    def __enter__(self) -> "ReadLease":
        return self

    def __exit__(self, *_):
        self.release()


class PinnedPieces:
    """One chain's blocks (``keys``) pinned in pieces of at least ``per`` keys, one Acquire after
    the other on ``executor`` (together waiting no longer than ``wait_s`` for the daemon's
    promotions), so a caller copies piece k while the daemon still reads the later ones. Each
    Acquire names every key left and is answered once ``per`` more are in DRAM, pinning all that
    are by then: pieces that landed together come as one lease, one copy. Iterating yields
    ``(keys wanted, ReadLease)`` in order as each answers; a lease that pins fewer than wanted
    is the last (the rest is not there). Leases not taken by :meth:`close` (the caller stopped
    early, or failed) are released as soon as they answer. ``per`` covering every key: a plain
    Acquire on the caller's thread."""

    def __init__(self, client: "KVStoreClient", keys, per: int, wait_s: float, executor) -> None:
        self._client, self._keys, self._per, self._executor = client, list(keys), max(1, per), executor
        self._answers: queue.SimpleQueue = queue.SimpleQueue()  # (wanted, Future of a ReadLease), None: no more
        self._lock = threading.Lock()
        self._closed = False
        if not self._keys:
            self._answers.put(None)
            return
        if self._per >= len(self._keys):
            self._answers.put((len(self._keys), _done(client.acquire(self._keys, allow_partial=True, wait_s=wait_s))))
            self._answers.put(None)
            return
        task = executor.submit(self._acquire_all, time.monotonic() + wait_s)
        task.add_done_callback(self._cancelled)

    def _acquire_all(self, deadline: float) -> None:
        """On the executor's thread: the Acquires, each from where the last one's lease ended."""
        start, n = 0, len(self._keys)
        try:
            while start < n:
                want, answer = min(self._per, n - start), concurrent.futures.Future()
                try:
                    answer.set_result(self._client.acquire(self._keys[start:], allow_partial=True, min_blocks=want,
                                                           wait_s=max(0.0, deadline - time.monotonic())))
                except Exception as e:  # noqa: BLE001 - the caller meets it where it takes this piece
                    answer.set_exception(e)
                with self._lock:
                    closed = self._closed
                    if not closed:
                        self._answers.put((want, answer))
                if closed:
                    _release_answered(answer)  # on this thread, as every release of an untaken lease
                    return
                if answer.exception() is not None or answer.result().count < want:
                    return
                start += answer.result().count
        finally:
            self._answers.put(None)

    def _cancelled(self, task: concurrent.futures.Future) -> None:
        """The executor was shut down before the Acquires started: the caller's wait ends."""
        if task.cancelled():
            gone: concurrent.futures.Future = concurrent.futures.Future()
            gone.cancel()
            self._answers.put((0, gone))
            self._answers.put(None)

    def __iter__(self):
        while (answer := self._answers.get()) is not None:
            want, lease = answer
            yield want, lease.result()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            untaken = []
            while True:
                try:
                    answer = self._answers.get_nowait()
                except queue.Empty:
                    break
                if answer is not None:
                    untaken.append(answer[1])
            self._answers.put(None)  # an iteration after this ends at once
        for f in untaken:  # answered already: released on the executor, not on the caller's thread
            try:
                self._executor.submit(_release_answered, f)
            except RuntimeError:  # the executor is shut down: here, then
                _release_answered(f)

    def __enter__(self) -> "PinnedPieces":
        return self

    def __exit__(self, *_):
        self.close()


def _done(value) -> concurrent.futures.Future:
    f: concurrent.futures.Future = concurrent.futures.Future()
    f.set_result(value)
    return f


def _release_answered(f: concurrent.futures.Future) -> None:
    """On the executor's thread: waited for there, so releases from several threads never share
    the client's list of releases in flight."""
    if not f.cancelled() and f.exception() is None:
        try:
            f.result().release(wait=True)
        except KVStoreError:
            pass  # the lease TTL reclaims the pins


class _Future:
    def __init__(self, f: grpc.Future) -> None:
        self._f = f

    def result(self):
        try:
            return self._f.result()
        except grpc.RpcError as e:
            raise KVStoreError(e.code(), e.details() or "") from None


