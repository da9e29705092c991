"""Python client for inference workers.

The daemon's API over its unix socket (gRPC, and a query channel for Lookups and Acquires),
with the arena it hands over as an fd. ``put`` and ``get`` copy exactly once, between the
caller's tensor and that arena (:mod:`kvstore.clients.blocks_io`).

Not thread-safe: use one client per thread (they can share a daemon and a namespace). Each
registered client runs one light background thread that keeps its session alive
(:mod:`kvstore.clients.session`); ``close()`` ends the session and every lease under it.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Iterator, Sequence

import grpc
import numpy as np

from kvstore.config import Config
from kvstore.keys import BlockKey, Namespace, chain_keys
from kvstore.layout import HeadShard, KVLayout
from kvstore.tiers.arena import Arena
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc
from kvstore.v1 import peer_pb2 as ppb, peer_pb2_grpc as peer_grpc

from kvstore.clients.leases import (IncomingTransfer, KVStoreError, PullingTransfer, ReadLease, WriteLease, _Future,
                                    pack)
from kvstore.clients import blocks_io
from kvstore.clients.handout import handout, hbm_pool
from kvstore.clients.query_channel import QueryChannel, Unsent
from kvstore.clients.session import NOT_CONNECTED, UNIX_CHANNEL_OPTIONS, SessionKeeper, listening, refusal

log = logging.getLogger("kvstore.client")

# Fields by which a request names something that lives only as long as its session (a lease, a
# prefetch handle): such a request is not sent again under a new session.
_SESSION_BOUND_FIELDS = ("lease_id", "lease_ids", "handle")


def default_socket_path() -> str:
    return os.environ.get("KVSTORE_SERVER_SOCKET_PATH") or Config().resolved_socket_path()


# A daemon older than RegisterResponse.slot_stride_bytes sends 0 there; its DRAM slots are
# block_bytes rounded up to this many bytes.
OLD_DAEMON_SLOT_ALIGN_BYTES = 4096


def empty_aligned(shape, dtype=np.uint8, align_bytes: int = 4096) -> np.ndarray:
    """An uninitialised array whose data starts on a page boundary.

    Reading a slot (page aligned) into a buffer that starts a few bytes past a page boundary
    runs at about half speed on x86 (4K aliasing between loads and stores: measured 7 GB/s
    against 14 GB/s here); pinned and page-aligned buffers avoid it. Use this for ``get``
    destinations that are reused."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape)) * dtype.itemsize
    raw = np.empty(nbytes + align_bytes, np.uint8)
    start = (-raw.ctypes.data) % align_bytes
    return raw[start:start + nbytes].view(dtype).reshape(shape)


@dataclass
class LookupResult:
    hit_blocks: int
    tiers: bytes
    load_blocks: int
    est_load_s: float
    est_recompute_s: float
    reason: str
    # In a cluster (empty / 0 alone): "load", "pull" or "recompute", and the peer holding
    # ``remote_blocks`` blocks after the hit ones (act on it with :meth:`KVStoreClient.advised_blocks`).
    advice: str = ""
    remote_blocks: int = 0
    remote_node_id: str = ""
    est_pull_s: float = 0.0
    found: bytes = b""  # lookup_keys(each=True): one byte per key, 1 where it is committed
    # lookup_keys(pin=True): the read lease on blocks promote_from... (0: none) and their slots.
    lease_id: int = 0
    offsets: tuple = ()


class KVStoreClient:
    def __init__(self, socket_path: str | None = None, timeout_s: float = 30.0, *, target: str | None = None,
                 root_ca: bytes | None = None, client_cert: bytes | None = None, client_key: bytes | None = None,
                 token: str | None = None, prefault: bool = True, map_arena: bool = True,
                 query_channel: bool = True) -> None:
        """Connect over the daemon's unix socket (default), or to ``target`` ("host:port") over
        TLS for cross-node control (``root_ca`` PEM; ``client_cert``/``client_key`` for mutual
        TLS; ``token`` for the bearer token). Over TCP there is no arena: put/get need the socket.
        ``prefault``: after register, map the arena's page tables in a background thread
        (``arena_mapped`` is set when done) so the first copies into each slot do not fault
        on every page (they run at a third of their speed when they do). ``map_arena=False``: a
        client of control calls only (lookups, deletes, transfers) that never maps the arena; its
        session still ends with its process, like one that maps it. ``query_channel``: send the
        session's Lookups and Acquires over its own unix connection (one raw round trip, see
        :mod:`kvstore.daemon.query_channel`) rather than gRPC, where the daemon grants one."""
        self.socket_path = socket_path or default_socket_path()
        self.timeout_s = timeout_s
        self.prefault = prefault
        self.map_arena = map_arena
        self.query_channel = query_channel
        self._fast: QueryChannel | None = None  # the session's query channel
        self.arena_mapped = threading.Event()  # the arena's page tables are filled (prefault)
        self.remote = bool(target)
        opts = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)]
        if target:
            creds = grpc.ssl_channel_credentials(root_ca, client_key, client_cert)
            if token:
                creds = grpc.composite_channel_credentials(creds, grpc.access_token_call_credentials(token))
            self.channel = grpc.secure_channel(target, creds, options=opts)
        else:
            self.channel = grpc.insecure_channel(f"unix:{self.socket_path}", options=opts + UNIX_CHANNEL_OPTIONS)
        self.stub = pb_grpc.KVStoreStub(self.channel)
        self.peer_stub = peer_grpc.PeerStub(self.channel)
        self.session_id = b""
        self.arena: Arena | None = None
        self.layout: KVLayout | None = None
        self.namespace: Namespace | None = None
        self.info: pb.RegisterResponse | None = None
        # Distance between neighbouring slots of the namespace in the arena (bytes), as the
        # daemon told it at Register: a run of neighbouring slots moves in one copy.
        self.slot_stride_bytes = 0
        self._registration: pb.RegisterRequest | None = None  # to register again after the session ended
        self._keeper: SessionKeeper | None = None
        self._pending: list[grpc.Future] = []  # fire-and-forget releases still in flight
        self._copier = blocks_io.Copier()  # put's and get's copies (a second thread for large runs)
        # What a TP rank writes of blocks that hold the whole model's KV: its KV heads
        # (kvstore.layout.HeadShard; GpuKVPath copies those columns) or its share of a recurrent
        # state (vllm_state.StateShard). Its Reserves send its part / parts. None: whole blocks.
        self.shard: HeadShard | None = None

    def release_later(self, req: pb.ReleaseRequest) -> None:
        """Send a Release without waiting for it (finished ones are forgotten as we go)."""
        self._pending.append(self.stub.Release.future(req, timeout=self.timeout_s))
        while self._pending and self._pending[0].done():
            self._pending.pop(0)

    def flush_releases(self) -> None:
        """Wait for the Releases :meth:`release_later` sent (one the daemon refused, or lost,
        is left to the lease TTL, as it would have been)."""
        while self._pending:
            try:
                self._pending.pop(0).result()
            except grpc.RpcError:
                pass

    # --- plumbing ---------------------------------------------------------------------------
    def call(self, method: str, request, timeout_s: float | None = None):
        """One RPC of the daemon's API by name (for the adapters and the CLI); a refusal raises KVStoreError. A request that names only this client's
        session (no lease, no prefetch handle) and finds that session ended in the daemon
        (expired while this process was stopped, or the daemon restarted) registers again with
        the same arguments and is sent once more under the new session."""
        for again in (False, True):
            if self._keeper is not None and getattr(request, "session_id", None) == self.session_id:
                self._keeper.used = time.monotonic()  # the daemon renews the session on arrival
            try:
                fast = self._fast
                if fast is not None and fast.serves(method, request):
                    try:
                        return fast.call(method, request, timeout_s or self.timeout_s)
                    except Unsent:
                        pass  # busy or closed: gRPC
                return self._grpc(method, request, timeout_s or self.timeout_s)
            except grpc.RpcError as e:
                err = KVStoreError(e.code(), e.details() or "", refusal(e))
            except KVStoreError as e:  # from the query channel
                err = e
            if again or not self._may_resend(err, request):
                raise err
            log.warning("%s: %s; registering again", method, err.message)
            self._keeper.abandon()
            self._open(self._registration)
            request.session_id = self.session_id

    def _grpc(self, method: str, request, timeout_s: float):
        stub = getattr(self.stub, method)
        try:
            return stub(request, timeout=timeout_s)
        except grpc.RpcError as e:
            if (e.code() != grpc.StatusCode.UNAVAILABLE or NOT_CONNECTED not in (e.details() or "") or self.remote
                    or not listening(self.socket_path)):
                raise
        # Never sent: the channel met the daemon away (a call while it restarted) and fails every
        # call until its reconnect backoff ends, though the daemon is back. Wait for the
        # connection. A restarted daemon knows no session of ours: the caller registers again.
        return stub(request, timeout=timeout_s, wait_for_ready=True)

    def _may_resend(self, err: KVStoreError, request) -> bool:
        return (err.refusal == pb.REFUSAL_SESSION_UNKNOWN and self._keeper is not None
                and getattr(request, "session_id", b"") == self.session_id
                and not any(getattr(request, f, 0) for f in _SESSION_BOUND_FIELDS))

    def _end_session(self, end: bool = True) -> None:
        """Close the session, if any, once the releases in flight have landed (``end`` False:
        leave it to the daemon's session TTL)."""
        self.flush_releases()
        if self._fast is not None:
            self._fast.close()
            self._fast = None
        if self._keeper is not None:
            self._keeper.close() if end else self._keeper.abandon()
            self._keeper = None
        self.session_id = b""

    def close(self, end_session: bool = True) -> None:
        """End the session (CloseSession: its reserved, uncommitted slots are freed and its pins
        released at once) and the connection. Safe to call twice. ``end_session`` False: drop
        the connection only, and leave the session to the daemon's session TTL and its leases to
        theirs: for a session whose pins another process may still copy from (a scheduler's
        Lookup pins, released by its worker naming the session)."""
        self._end_session(end_session)
        self._copier.close()
        if self.arena is not None:
            self.arena.close()
            self.arena = None
        self.channel.close()

    def __enter__(self) -> "KVStoreClient":
        return self

    def __exit__(self, *_):
        self.close()

    # --- session ----------------------------------------------------------------------------
    def register(self, layout: KVLayout, model_id: str, tp_rank: int = 0, tp_world: int = 1,
                 tenant_salt: str = "", prefill_tokens_per_s: float = 0.0, model_params: float = 0.0,
                 kv_codec: str = "") -> None:
        """Open a session for one namespace and map the daemon's arena. A session this client
        already has is closed first, and its leases with it (commit or release them before).
        ``kv_codec``: ``int8`` or ``fp8`` opts into lossy storage on NVMe (kvstore.lossy)."""
        namespace = Namespace(model_id, layout, tp_rank, tp_world, tenant_salt, kv_codec)
        req = pb.RegisterRequest(model_id=model_id, tp_rank=tp_rank, tp_world=tp_world, tenant_salt=tenant_salt,
                                 prefill_tokens_per_s=prefill_tokens_per_s, model_params=model_params, kv_codec=kv_codec,
                                 layout=pb.Layout(**layout.to_dict()), client_name=f"pid{os.getpid()}")
        self._end_session()
        self.namespace, self.layout = namespace, layout
        self._open(req)

    def _open(self, req: pb.RegisterRequest) -> None:
        resp = self.call("Register", req)
        if resp.namespace_id != self.namespace.root:
            raise KVStoreError(grpc.StatusCode.INTERNAL, "daemon and client disagree on the namespace id; versions differ")
        a = OLD_DAEMON_SLOT_ALIGN_BYTES
        stride = resp.slot_stride_bytes or -(-self.layout.block_bytes // a) * a
        if stride < self.layout.block_bytes:
            raise KVStoreError(grpc.StatusCode.INTERNAL, f"daemon's slot stride of {stride} bytes is less than a block "
                               f"({self.layout.block_bytes} bytes); versions differ")
        self.info, self.session_id, self._registration, self.slot_stride_bytes = resp, resp.session_id, req, stride
        self._keeper = SessionKeeper(self, resp.session_id, resp.session_ttl_s)
        if self.remote:  # no shared memory across nodes: control calls only
            return
        if self.map_arena:
            self._map_arena(resp)
        if self._fast is not None:  # the last session's
            self._fast.close()
            self._fast = None
        if self.query_channel:  # the watch that ends the session with this process comes with it
            try:
                _, _, s = handout(resp.arena_socket, resp.session_id + b"Q", False, self.timeout_s)
                self._fast = QueryChannel(s, resp.session_id)
            except KVStoreError as e:
                log.debug("no query channel (%s): Lookups and Acquires go over gRPC", e.message)
        if not self.map_arena and self._fast is None:  # no memory, only the watch
            _, _, s = handout(resp.arena_socket, resp.session_id + b"W", False, self.timeout_s)
            s.close()

    def _map_arena(self, resp: pb.RegisterResponse) -> None:
        fd, size, s = handout(resp.arena_socket, resp.session_id, True, self.timeout_s)
        s.close()
        if self.arena is not None:
            old, new = os.fstat(self.arena.fd), os.fstat(fd)
            if size == self.arena.size_bytes and (old.st_dev, old.st_ino) == (new.st_dev, new.st_ino):
                # The same arena (a new session with the same daemon): keep the mapping, whose
                # page tables are filled, and the views callers hold into it.
                os.close(fd)
                return
            # Another daemon's arena (it restarted): unmapped off this thread, which is vLLM's
            # scheduler or worker in the middle of a request.
            self.arena.close(background=True)
            self.arena = None
        self.arena = Arena(size, fd=fd, prefault=False)
        if self.prefault:
            self.arena_mapped = self.arena.map_in_background()

    def map_hbm_pool(self):
        """Map the daemon's HBM pool in this process (``kvstore.tiers.hbm.PoolMapping``; its
        ``mem`` is a uint8 tensor). ReadLease.hbm_offsets says where each pinned block's HBM copy
        is. Raises KVStoreError when the daemon has no HBM tier."""
        self.require_data_session()
        return hbm_pool(self.info.arena_socket, self.session_id, self.timeout_s)

    def keys(self, token_ids) -> list[BlockKey]:
        if self.namespace is None:
            raise RuntimeError("call register(layout, model_id) first")
        return chain_keys(self.namespace.root, token_ids, self.layout.block_tokens)

    def require_data_session(self) -> None:
        if not self.session_id:
            raise RuntimeError("call register(layout, model_id) first")
        if self.arena is None:
            raise RuntimeError("no arena: data calls need the daemon's unix socket, not a TCP control connection")

    # --- lookup -----------------------------------------------------------------------------
    def warm_up(self) -> None:
        """One harmless round trip for each call on a hit's path (Lookup; with an arena,
        Acquire) naming a key no token chain yields: on a new client the first of each costs
        2-6 ms more than the next (measured here), which then lands at connect, not on the
        first hit."""
        key = hashlib.sha256(b"kvstore warm-up " + self.session_id).digest()
        self.lookup_keys([key])
        if self.arena is not None:
            self.acquire([key], allow_partial=True).release(wait=True)

    def lookup_keys(self, keys: Sequence[bytes], ask_peers: bool = False, each: bool = False,
                    promote_from: int | None = None, promote_to: int = 0, pin: bool = False) -> LookupResult:
        """``ask_peers``: in a cluster, also learn which peer holds the blocks after the local
        hits (a round trip) and whether pulling them pays (act on it with :meth:`advised_blocks`).
        ``each``: every key on its own, not a prefix (``found`` says which are committed).
        ``promote_from``: the caller Acquires the hit next, from this block on: the daemon
        starts reading its NVMe blocks (as far as ``load_blocks``, and not past ``promote_to``
        when set) into DRAM at once. ``pin`` (with ``promote_from``): where those blocks are all
        in DRAM, the daemon pins them now (``lease_id``, ``offsets``), in place of that Acquire;
        the lease is this session's: a :class:`ReadLease` naming it releases it, from any client."""
        r = self.call("Lookup", pb.LookupRequest(session_id=self.session_id, keys=pack(keys), ask_peers=ask_peers,
                                                 each=each, promote=promote_from is not None,
                                                 promote_from=promote_from or 0, promote_to=promote_to, pin=pin))
        advice = pb.Advice.Name(r.advice).removeprefix("ADVICE_").lower() if r.advice else ""
        return LookupResult(r.hit_blocks, r.tiers, r.load_blocks, r.est_load_s, r.est_recompute_s, r.reason,
                            advice, r.remote_blocks, r.remote_node_id, r.est_pull_s, bytes(r.found), r.lease_id,
                            tuple(r.offsets))

    def route_hints(self, keys: Sequence[bytes] = (), token_ids: Sequence[int] = (),
                    max_nodes: int = 0) -> pb.RouteHintsResponse:
        """Where the prompt (its block keys, or its token ids) is cheapest to serve in this
        client's namespace: per candidate node, its cached tokens by tier and the modelled
        time to first KV, fastest first (:mod:`kvstore.daemon.hints`)."""
        return self.call("RouteHints", pb.RouteHintsRequest(namespace_id=self.namespace.root, keys=pack(keys),
                                                            token_ids=list(token_ids), max_nodes=max_nodes))

    def pull(self, keys: Sequence[bytes], holder: str = "", deadline_s: float = 0.0) -> ppb.PullResponse:
        """Have this client's daemon fetch the blocks of ``keys`` it lacks from a peer (``holder``,
        or the peers it knows to hold the namespace); a miss is an answer, not an error."""
        req = ppb.PullRequest(session_id=self.session_id, keys=pack(keys), holder=holder, deadline_s=deadline_s)
        try:
            return self.peer_stub.Pull(req, timeout=max(self.timeout_s, deadline_s + 5))
        except grpc.RpcError as e:
            raise KVStoreError(e.code(), e.details() or "", refusal(e)) from None

    def pull_layers(self, keys: Sequence[bytes], have: int = 0, holder: str = "",
                    deadline_s: float = 0.0) -> PullingTransfer:
        """Pull ``keys`` (one chain) and follow the blocks it brings layer by layer as they
        land: the holder ships layer 0 of every block first, then layer 1..., so a worker can
        load layer 0 to the GPU while the later ones are on the wire. ``have``: how many leading
        keys this daemon holds already (a Lookup's ``hit_blocks``); the pull brings the rest,
        which the returned :class:`PullingTransfer` follows (``wait_layer``, ``layer_view``;
        ``result()`` is the pull's answer). Release it when done."""
        self.require_data_session()
        keys = list(keys)
        if not 0 <= have < len(keys):
            raise ValueError(f"have={have}: must leave some of the {len(keys)} keys to pull")
        wait_s = deadline_s or 10.0
        pull = self.peer_stub.Pull.future(
            ppb.PullRequest(session_id=self.session_id, keys=pack(keys), holder=holder, deadline_s=deadline_s,
                            layer_major=True), timeout=max(self.timeout_s, deadline_s + 5))
        follow = self.stub.AwaitTransfer.future(
            pb.AwaitTransferRequest(session_id=self.session_id, keys=pack(keys[have:]), wait_s=wait_s),
            timeout=wait_s + self.timeout_s)
        pull.add_done_callback(lambda _: follow.cancel())  # no transfer to wait for once the pull answered
        try:
            resp = follow.result()
        except grpc.FutureCancelledError:
            resp = None
        except grpc.RpcError as e:
            if e.code() is not grpc.StatusCode.CANCELLED:
                raise KVStoreError(e.code(), e.details() or "", refusal(e)) from None
            resp = None
        return PullingTransfer(self, pull, resp, keys, have)

    def advised_blocks(self, result: LookupResult, keys: Sequence[bytes], deadline_s: float = 0.0) -> int:
        """How many leading blocks of ``keys`` to load now, acting on ``result`` (their Lookup):
        for a PULL advice the daemon pulls the remote extension first (a miss falls back to
        what is local then), for RECOMPUTE none, else the policy's ``load_blocks``."""
        if result.advice == "pull":
            want = keys[:result.hit_blocks + result.remote_blocks]
            return self.pull(want, result.remote_node_id, deadline_s).blocks
        return 0 if result.advice == "recompute" else result.load_blocks

    def lookup(self, token_ids) -> int:
        """Number of leading tokens of ``token_ids`` cached (a multiple of ``block_tokens``)."""
        return self.lookup_keys(self.keys(token_ids)).hit_blocks * self.layout.block_tokens

    # --- leases -----------------------------------------------------------------------------
    def reserve(self, keys: Sequence[bytes], parent: bytes = b"", retry_s: float = 10.0,
                doorbell: bool = False, token_ids=None) -> WriteLease:
        """Reserve slots for ``keys``. While the daemon refuses with ``REFUSAL_DRAM_DEMOTING``
        (DRAM full of blocks still being demoted to NVMe), retry with backoff for at most
        ``retry_s`` seconds. (The daemon itself first waits up to ``server.reserve_wait_s`` for
        a demotion to land; a daemon too old to name the refusal is not retried.)
        ``token_ids``: the tokens of ``keys``' blocks (``block_tokens`` each), when known: the
        daemon's KV events carry them to routers."""
        self.require_data_session()
        tokens = b"" if token_ids is None else np.asarray(token_ids).astype("<i4", copy=False).tobytes()
        req = pb.ReserveRequest(session_id=self.session_id, keys=pack(keys), parent=parent, doorbell=doorbell,
                                token_ids=tokens)
        if self.shard is not None and self.shard.parts > 1:
            req.part, req.parts = self.shard.part, self.shard.parts
        deadline, pause = time.monotonic() + retry_s, 0.002
        while True:
            try:
                return WriteLease(self, list(keys), self.call("Reserve", req))
            except KVStoreError as e:
                if e.refusal != pb.REFUSAL_DRAM_DEMOTING or time.monotonic() + pause > deadline:
                    raise
            time.sleep(pause)
            pause = min(pause * 2, 0.05)

    def reserve_chain(self, keys: Sequence[bytes], *, start: int = 0, parent: bytes = b"", token_ids=None,
                      retry_s: float = 10.0, batch_blocks: int = 0) -> Iterator[tuple[int, WriteLease]]:
        """Reserve ``keys[start:]`` in the batches one request may carry (``batch_blocks``, by
        default :meth:`max_batch_blocks`), each chained to the key before it (``parent`` before
        ``keys[0]``). Yields ``(index of the batch's first key, its lease)`` as each batch is
        reserved, so a caller copies batch k while k+1 is not yet asked for. ``token_ids``: the
        tokens of ``keys`` from ``keys[0]`` (``block_tokens`` per key), or None. The leases
        yielded are the caller's to commit or abort."""
        step = batch_blocks or self.max_batch_blocks()
        bt = self.layout.block_tokens
        for i in range(start, len(keys), step):
            chunk = keys[i:i + step]
            # Sliced before any conversion: a step saves a few blocks of a long prompt, and this
            # runs on a worker's Reserve thread beside the engine's own.
            yield i, self.reserve(chunk, parent=keys[i - 1] if i else parent, retry_s=retry_s,
                                  token_ids=None if token_ids is None else token_ids[i * bt:(i + len(chunk)) * bt])

    def reserve_all(self, keys: Sequence[bytes], **kw) -> list[WriteLease]:
        """:meth:`reserve_chain`'s leases, all or none: when a batch is refused the ones before
        it are aborted and the error raised."""
        leases: list[WriteLease] = []
        try:
            for _, w in self.reserve_chain(keys, **kw):
                leases.append(w)
        except BaseException:
            for w in leases:
                try:
                    w.abort()
                except KVStoreError:  # the reservation ends with its lease TTL
                    pass
            raise
        return leases

    def acquire(self, keys: Sequence[bytes], allow_partial: bool = False, wait_s: float = 0.0,
                min_blocks: int = 0) -> ReadLease:
        """Pin ``keys`` (``allow_partial``: as many leading ones as are in DRAM), waiting up to
        ``wait_s`` for the daemon to promote them from NVMe; ``min_blocks`` (with
        ``allow_partial``): answer once that many leading keys are in DRAM."""
        self.require_data_session()
        resp = self.call("Acquire", pb.AcquireRequest(session_id=self.session_id, keys=pack(keys),
                                                       allow_partial=allow_partial, wait_s=wait_s,
                                                       min_blocks=min_blocks),
                          timeout_s=self.timeout_s + wait_s)  # the daemon may wait wait_s for promotions
        return ReadLease(self, resp)

    def keepalive(self, lease_ids: Sequence[int] = ()) -> list[int]:
        """Renew the session and extend ``lease_ids`` by the lease TTL (``info.lease_ttl_s``
        seconds); returns those that had already expired. The session renews itself in the
        background; call this for leases held longer than the lease TTL."""
        r = self.call("KeepAlive", pb.KeepAliveRequest(session_id=self.session_id, lease_ids=list(lease_ids)))
        return list(r.expired)

    def delete(self, keys: Sequence[bytes]) -> int:
        return self.call("Delete", pb.DeleteRequest(session_id=self.session_id, keys=pack(keys))).deleted

    def max_batch_blocks(self) -> int:
        """Most blocks one request may name: the daemon's key limit, and half the arena."""
        per_tier = max(1, self.info.arena_bytes // (2 * self.layout.block_bytes))
        return int(min(self.info.max_keys_per_request, per_tier))

    # --- data (kvstore.clients.blocks_io) ------------------------------------------------------
    def put(self, token_ids, kv) -> int:
        """Store the full blocks of ``token_ids`` from ``kv``; returns blocks newly stored
        (blocks already cached or being written by another client are skipped)."""
        return blocks_io.put(self, token_ids, kv, self._copier)

    def get(self, token_ids, out, wait_s: float = 10.0) -> int:
        """Read the longest cached prefix of ``token_ids`` into ``out``; returns tokens read.
        Blocks on a lower tier are promoted first, waiting at most ``wait_s`` seconds."""
        return blocks_io.get(self, token_ids, out, wait_s, self._copier)

    def transfer(self, keys: Sequence[bytes], peer: str, deadline_s: float = 0.0, lease: WriteLease | None = None,
                 wait: bool = True):
        """Ship blocks to the daemon at ``peer`` (its transport listener, host:port). With
        ``lease`` (reserved with ``doorbell=True``) the transfer is pipelined: layer l goes as
        soon as :meth:`WriteLease.ring` announces it. ``wait=False`` returns a future (needed for
        pipelining: ring the layers, then call ``.result()``)."""
        req = pb.TransferRequest(session_id=self.session_id, keys=pack(keys), peer=peer, deadline_s=deadline_s,
                                 pipelined=lease is not None, lease_id=lease.lease_id if lease else 0)
        timeout = (deadline_s or 60.0) + self.timeout_s
        if wait:
            return self.call("Transfer", req, timeout_s=timeout)
        return _Future(self.stub.Transfer.future(req, timeout=timeout))

    def await_transfer(self, keys: Sequence[bytes], wait_s: float = 10.0) -> IncomingTransfer:
        """On the receiving node: pin the blocks a peer is shipping here and follow their layers."""
        r = self.call("AwaitTransfer", pb.AwaitTransferRequest(session_id=self.session_id, keys=pack(keys),
                                                               wait_s=wait_s), timeout_s=wait_s + self.timeout_s)
        return IncomingTransfer(self, r)

    def prefetch(self, keys: Sequence[bytes], deadline_s: float = 0.0) -> int:
        """Start promoting ``keys`` into DRAM; returns a handle for :meth:`prefetch_status`."""
        return self.call("Prefetch", pb.PrefetchRequest(session_id=self.session_id, keys=pack(keys),
                                                         target=pb.TIER_DRAM, deadline_s=deadline_s)).handle

    def prefetch_status(self, handle: int, wait_s: float = 0.0) -> pb.PrefetchStatusResponse:
        return self.call("PrefetchStatus", pb.PrefetchStatusRequest(session_id=self.session_id, handle=handle,
                                                                     wait_s=wait_s), timeout_s=wait_s + self.timeout_s)

    def stats(self) -> pb.StatsResponse:
        return self.call("Stats", pb.StatsRequest())
