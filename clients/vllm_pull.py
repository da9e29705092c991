"""The vLLM connector's pulls, worker side: a prefix that a peer daemon holds, fetched into this
node's daemon off vLLM's threads, while vLLM keeps scheduling (its asynchronous KV load).

The scheduler answered ``(tokens, True)`` for the request (``load_kv_async``), so vLLM gave it
its blocks and parks it in ``WAITING_FOR_REMOTE_KVS`` until the workers report it in
``get_finished``'s ``finished_recving``. Each worker (TP rank) fetches its own namespace's
blocks: a job on one of this module's threads asks the daemon to Pull the span's keys from
the holder the scheduler's Lookup named (``kvstore.v1.Peer/Pull``: the daemon fetches the blocks
it lacks over the authenticated transport into its DRAM, within ``pull_timeout_s``; a miss is an
answer), then pins the span's leading blocks that are here now (Acquire, promoting NVMe ones
within ``load_wait_s``). The connector then copies the pinned blocks into the request's vLLM
blocks on the worker thread and reports the request once the copies have landed; blocks that
did not arrive go to ``get_block_ids_with_load_errors`` in the same pass, so vLLM recomputes
them (never reading what was not loaded).

Threads: a job touches no state of the connector. It makes two calls on the worker's client
that are single calls on its gRPC stubs (thread-safe): ``KVStoreClient.pull`` and an Acquire,
not ``KVStoreClient.acquire``, which goes through ``call``, whose re-registration after a lost
session changes the client (the worker thread's business: a job whose session ended fails, and
its request recomputes).
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import grpc

from kvstore.clients.client import KVStoreClient, KVStoreError, pack
from kvstore.clients.leases import ReadLease
from kvstore.v1 import kvstore_pb2 as pb

PULL_THREADS = 4  # pulls of this many requests at once; each thread mostly waits on its daemon


@dataclass(slots=True)
class Fetched:
    """A finished job: ``lease`` pins the leading blocks of ``keys[start:end]`` that are here
    now (``count`` of them, maybe none; None when the pin itself failed); ``pulled`` blocks came
    from the peer; ``detail`` says why some are missing ("" when none is)."""

    req_id: str
    client: KVStoreClient
    lease: ReadLease | None
    pulled: int
    detail: str


class PullFetcher:
    """Runs each request's pull and pin on a few threads of its own; ``done`` hands back the
    finished ones without waiting. Called from the worker thread only."""

    def __init__(self, pull_timeout_s: float, load_wait_s: float, rpc_timeout_s: float) -> None:
        self.pull_timeout_s, self.load_wait_s, self.rpc_timeout_s = pull_timeout_s, load_wait_s, rpc_timeout_s
        self._pool: ThreadPoolExecutor | None = None
        self._jobs: dict[str, tuple[Future, KVStoreClient]] = {}

    def submit(self, req_id: str, client: KVStoreClient, keys: list[bytes], start: int, holder: str,
               wait_s: float = 0.0) -> None:
        """Pull ``keys`` (a chain from its first block) from ``holder`` and pin ``keys[start:]``;
        ``holder`` "": the blocks are this node's (a hybrid model's asynchronous load), pin only;
        ``wait_s``: a transfer into this daemon was announced, wait up to that for the keys."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(PULL_THREADS, thread_name_prefix="kvstore-pull")
        job = self._pool.submit(self._fetch, req_id, client, client.session_id, keys, start, holder, wait_s)
        self._jobs[req_id] = (job, client)

    def done(self) -> list[Fetched]:
        out = []
        for req_id, (job, client) in list(self._jobs.items()):
            if not job.done():
                continue
            del self._jobs[req_id]
            try:
                out.append(job.result())
            except Exception as e:  # noqa: BLE001 - whatever went wrong is a miss, never vLLM's step failing
                out.append(Fetched(req_id, client, None, 0, f"pull job failed: {type(e).__name__}: {e}"))
        return out

    def _fetch(self, req_id: str, client: KVStoreClient, session: bytes, keys: list[bytes], start: int,
               holder: str, wait_s: float = 0.0) -> Fetched:
        why, pulled = self._pull(client, keys, holder) if holder else ("", 0)
        if wait_s:
            why = self._arrival(client, session, keys, wait_s)
        try:
            resp = client.stub.Acquire(pb.AcquireRequest(session_id=session, keys=pack(keys[start:]), allow_partial=True,
                                                         wait_s=self.load_wait_s),
                                       timeout=self.rpc_timeout_s + self.load_wait_s)
        except (grpc.RpcError, ValueError) as e:
            return Fetched(req_id, client, None, pulled, f"{why}; pin failed: {e}".lstrip("; "))
        return Fetched(req_id, client, ReadLease(client, resp), pulled, why)

    def _arrival(self, client: KVStoreClient, session: bytes, keys: list[bytes], wait_s: float) -> str:
        """Wait (at most ``wait_s``) until every one of ``keys`` is in the daemon: an announced
        transfer landing. "" when they are, else why not (what is here is loaded, vLLM recomputes
        the rest)."""
        deadline, nap, have = time.monotonic() + wait_s, 0.001, 0
        while True:
            try:
                have = client.stub.Lookup(pb.LookupRequest(session_id=session, keys=pack(keys)),
                                          timeout=self.rpc_timeout_s).hit_blocks
            except grpc.RpcError as e:
                return f"lookup while waiting for the announced transfer failed: {e.code().name}"
            if have >= len(keys):
                return ""
            left = deadline - time.monotonic()
            if left <= 0:
                return (f"{have} of {len(keys)} announced blocks arrived within transfer_wait_s ({wait_s:g} s); "
                        "the prefill's transfer failed or is late")
            time.sleep(min(nap, left))
            nap = min(nap * 2, 0.02)

    def _pull(self, client: KVStoreClient, keys: list[bytes], holder: str) -> tuple[str, int]:
        """Pull ``keys`` from ``holder``: why some are missing ("" when none is), blocks pulled."""
        try:
            # The daemon answers a miss within pull_timeout_s (its Pull's gRPC deadline is a
            # little later), so the job ends within that plus the pin.
            r = client.pull(keys, holder, self.pull_timeout_s)
        except (KVStoreError, ValueError) as e:  # ValueError: the worker closed the client (daemon lost)
            return f"pull failed: {e}", 0  # what is here is still loaded, the rest recomputed
        if r.blocks < len(keys):
            return f"{r.blocks} of {len(keys)} blocks here after the pull: {r.detail or 'no holder had more'}", r.pulled
        return "", r.pulled

    def close(self) -> None:
        """Stop taking jobs; those running end within their deadlines (their leases end with
        the session, or at the lease TTL)."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
        self._jobs.clear()


__all__ = ["Fetched", "PullFetcher"]
