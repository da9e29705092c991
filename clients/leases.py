"""Leases a client holds: reserved slots to write, pinned blocks to read, and blocks a peer is
shipping here. Each is a context manager; the data moves through zero-copy arena views."""

from __future__ import annotations

import concurrent.futures
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
    """One chain's blocks (``keys``) pinned in pieces of ``per`` keys, one Acquire after the
    other on ``executor`` (each may wait ``wait_s`` for the daemon's promotions), so a caller
    copies piece k while the daemon still reads the later ones: iterating yields ``(keys asked,
    ReadLease)`` in order as each answers. Leases not taken by :meth:`close` (the caller
    stopped early, or failed) are released as soon as they answer. One piece: a plain Acquire
    on the caller's thread."""

    def __init__(self, client: "KVStoreClient", keys, per: int, wait_s: float, executor) -> None:
        starts = range(0, len(keys), max(1, per))
        self.sizes = [min(per, len(keys) - i) for i in starts]
        self._executor = executor
        if len(self.sizes) == 1:
            self._leases = [_done(client.acquire(keys, allow_partial=True, wait_s=wait_s))]
        else:
            # One deadline for all the pieces: together they wait no longer than one Acquire would.
            deadline = time.monotonic() + wait_s

            def acquire(piece):
                return client.acquire(piece, allow_partial=True, wait_s=max(0.0, deadline - time.monotonic()))

            self._leases = [executor.submit(acquire, keys[i:i + per]) for i in starts]
        self._taken = 0

    def __iter__(self):
        for want, f in zip(self.sizes, self._leases):
            self._taken += 1
            yield want, f.result()

    def close(self) -> None:
        for f in self._leases[self._taken:]:
            if f.cancel():
                continue
            if f.done():  # answered already: released on the executor, not on the caller's thread
                self._executor.submit(_release_answered, f)
            else:
                f.add_done_callback(_release_answered)  # runs on the executor's thread
        self._taken = len(self._leases)

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
    if f.exception() is None:
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


