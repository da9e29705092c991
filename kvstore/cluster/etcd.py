"""A small client for etcd's v3 gRPC API (KV, Lease, Watch, Maintenance), over stubs generated
from etcd v3.4's own proto files (``proto/kvstore/cluster/etcdpb/``, ``scripts/gen_proto.sh``).

Why not a PyPI client: ``etcd3`` is unmaintained and pins an old protobuf; the forks are thin
copies of it. The daemon needs six calls, each with a deadline, so it talks to etcd's API
directly through grpcio, which it already depends on.

Every call takes ``timeout_s`` and raises :class:`EtcdError` (with the gRPC code) on failure,
after trying each endpoint once: a dead member of a three-node etcd costs one timeout, not
an outage. Thread-safe: grpc channels are, and the current endpoint is one atomic index.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import grpc

from kvstore.cluster.etcdpb import kv_pb2, rpc_pb2 as epb, rpc_pb2_grpc as egrpc
from kvstore.transport.auth import read_regular

KeyValue = kv_pb2.KeyValue
Event = kv_pb2.Event


class EtcdError(RuntimeError):
    """An etcd call failed on every endpoint; ``code`` is the last gRPC status code."""

    def __init__(self, what: str, code: grpc.StatusCode | None, detail: str) -> None:
        super().__init__(f"etcd {what}: {code.name if code else 'error'}: {detail}")
        self.what = what  # the call, as the etcd_errors metric labels it
        self.code = code


@dataclass(frozen=True)
class EtcdTls:
    """PEM files for an etcd that requires TLS; ``cert_file``/``key_file`` for client certificates."""

    ca_file: str = ""
    cert_file: str = ""
    key_file: str = ""

    def credentials(self) -> grpc.ChannelCredentials:
        def read(path: str, key: str) -> bytes | None:
            return read_regular(path, f"cluster.{key}") if path else None

        return grpc.ssl_channel_credentials(read(self.ca_file, "etcd_ca_file"), read(self.key_file, "etcd_key_file"),
                                            read(self.cert_file, "etcd_cert_file"))


# HTTP/2 pings find a silently dead etcd (a partition, not a reset) under a watch stream. etcd
# refuses pings more often than its --grpc-keepalive-min-time (5 s by default).
CHANNEL_OPTIONS = [("grpc.keepalive_time_ms", 10_000), ("grpc.keepalive_timeout_ms", 5_000),
                   ("grpc.keepalive_permit_without_calls", 1)]


def prefix_end(prefix: bytes) -> bytes:
    """etcd's range_end for every key starting with ``prefix``."""
    end = bytearray(prefix)
    while end:
        if end[-1] < 0xFF:
            end[-1] += 1
            return bytes(end)
        end.pop()
    return b"\0"


class Etcd:
    """One client over ``endpoints`` (``host:port``); plain gRPC unless ``tls`` is given."""

    def __init__(self, endpoints: list[str], tls: EtcdTls | None = None) -> None:
        if not endpoints:
            raise ValueError("etcd: no endpoints")
        self.endpoints = list(endpoints)
        creds = tls.credentials() if tls is not None and (tls.ca_file or tls.cert_file) else None
        self._channels = [grpc.secure_channel(e, creds, CHANNEL_OPTIONS) if creds else
                          grpc.insecure_channel(e, CHANNEL_OPTIONS) for e in self.endpoints]
        self._stubs = [(egrpc.KVStub(c), egrpc.LeaseStub(c), egrpc.WatchStub(c), egrpc.MaintenanceStub(c))
                       for c in self._channels]
        self._at = 0  # the endpoint that answered last

    def close(self) -> None:
        for c in self._channels:
            c.close()

    def _call(self, what: str, which: int, method: str, request, timeout_s: float):
        """``request`` to ``method`` of stub ``which`` (0 KV, 1 Lease, 2 Watch, 3 Maintenance),
        on the endpoint that answered last, then on each other one."""
        code, detail = None, ""
        n = len(self._stubs)
        for i in range(n):
            at = (self._at + i) % n
            try:
                out = getattr(self._stubs[at][which], method)(request, timeout=timeout_s)
            except grpc.RpcError as e:
                code, detail = e.code(), e.details() or ""
                if code not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    break  # an answer (e.g. lease not found): another endpoint says the same
                continue
            self._at = at
            return out
        raise EtcdError(what, code, detail)

    # --- KV -------------------------------------------------------------------------------
    def get(self, key: bytes, timeout_s: float) -> KeyValue | None:
        r = self._call("get", 0, "Range", epb.RangeRequest(key=key), timeout_s)
        return r.kvs[0] if r.kvs else None

    def get_prefix(self, prefix: bytes, timeout_s: float) -> tuple[list[KeyValue], int]:
        """Every key under ``prefix`` and the store's revision they were read at."""
        r = self._call("range", 0, "Range", epb.RangeRequest(key=prefix, range_end=prefix_end(prefix)), timeout_s)
        return list(r.kvs), r.header.revision

    def put(self, key: bytes, value: bytes, timeout_s: float, lease: int = 0) -> int:
        """Returns the revision of the write."""
        return self._call("put", 0, "Put", epb.PutRequest(key=key, value=value, lease=lease), timeout_s).header.revision

    def delete(self, key: bytes, timeout_s: float) -> int:
        return self._call("delete", 0, "DeleteRange", epb.DeleteRangeRequest(key=key), timeout_s).deleted

    def put_if_unchanged(self, writes: list[tuple[bytes, bytes, int]], guard: bytes, mod_revision: int,
                         timeout_s: float) -> bool:
        """One transaction: every ``(key, value, lease)`` of ``writes`` if ``guard`` was last
        modified at ``mod_revision`` (0: does not exist), else nothing. True if written."""
        cmp = epb.Compare(result=epb.Compare.EQUAL, target=epb.Compare.MOD, key=guard, mod_revision=mod_revision)
        ops = [epb.RequestOp(request_put=epb.PutRequest(key=k, value=v, lease=lease)) for k, v, lease in writes]
        return self._call("txn", 0, "Txn", epb.TxnRequest(compare=[cmp], success=ops), timeout_s).succeeded

    # --- Lease ----------------------------------------------------------------------------
    def grant(self, ttl_s: int, timeout_s: float) -> tuple[int, int]:
        """A new lease: ``(id, ttl_s)`` as etcd granted it (it may raise a TTL below its minimum)."""
        r = self._call("grant", 1, "LeaseGrant", epb.LeaseGrantRequest(TTL=ttl_s), timeout_s)
        if r.error:
            raise EtcdError("grant", None, r.error)
        return r.ID, r.TTL

    def keepalive(self, lease: int, timeout_s: float) -> int:
        """Renew ``lease`` once; returns the TTL it now has (seconds), 0 if it has expired.

        One short keepalive stream per renewal, under a deadline: a long-lived stream's next
        answer cannot be waited for with a timeout, and a renewal that hangs must not let the
        lease run out unnoticed."""
        call = self._stubs[self._at][1].LeaseKeepAlive(iter([epb.LeaseKeepAliveRequest(ID=lease)]), timeout=timeout_s)
        try:
            for r in call:
                return max(0, r.TTL)
            code, detail = None, "the stream ended without an answer (etcd shutting down?)"
        except grpc.RpcError as e:
            code, detail = e.code(), e.details() or ""
        finally:
            call.cancel()
        self._at = (self._at + 1) % len(self._stubs)  # next time, the next endpoint
        raise EtcdError("keepalive", code, detail)

    def time_to_live(self, lease: int, timeout_s: float) -> int:
        """Seconds left on ``lease``; -1 if it has expired or never existed."""
        return self._call("ttl", 1, "LeaseTimeToLive", epb.LeaseTimeToLiveRequest(ID=lease), timeout_s).TTL

    def revoke(self, lease: int, timeout_s: float) -> None:
        """End ``lease`` now, deleting its keys (a lease already gone is not an error)."""
        try:
            self._call("revoke", 1, "LeaseRevoke", epb.LeaseRevokeRequest(ID=lease), timeout_s)
        except EtcdError as e:
            if e.code is not grpc.StatusCode.NOT_FOUND:
                raise

    # --- Watch and status -----------------------------------------------------------------
    def watch_prefix(self, prefix: bytes, start_revision: int) -> "Watch":
        """Events under ``prefix`` from ``start_revision`` on (see :class:`Watch`)."""
        return Watch(self._stubs[self._at][2], prefix, start_revision)

    def status(self, timeout_s: float) -> list[tuple[str, epb.StatusResponse | EtcdError]]:
        """Each endpoint's Maintenance.Status (version, leader, db size), or why it did not answer."""
        out = []
        for e, stubs in zip(self.endpoints, self._stubs):
            try:
                out.append((e, stubs[3].Status(epb.StatusRequest(), timeout=timeout_s)))
            except grpc.RpcError as err:
                out.append((e, EtcdError("status", err.code(), err.details() or "")))
        return out


class WatchLost(Exception):
    """The watch cannot go on from where it was: the stream broke, or etcd compacted past it
    (``compacted``): list the keys again and watch from the revision of that listing."""

    def __init__(self, why: str, compacted: bool = False) -> None:
        super().__init__(why)
        self.compacted = compacted


class Watch:
    """One Watch stream over a prefix. Iterating yields ``(revision, [Event])`` batches and ends
    with :class:`WatchLost`. A dead etcd ends the stream at once (connection reset); a silent
    one through the channel's keepalive pings (:data:`CHANNEL_OPTIONS`)."""

    def __init__(self, stub, prefix: bytes, start_revision: int) -> None:
        import queue
        import threading

        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        self._requests.put(epb.WatchRequest(create_request=epb.WatchCreateRequest(
            key=prefix, range_end=prefix_end(prefix), start_revision=start_revision)))
        self._stopped = threading.Event()
        self._call = stub.Watch(self._requests_iter())

    def _requests_iter(self) -> Iterator:
        import queue

        while not self._stopped.is_set():
            try:
                yield self._requests.get(timeout=0.5)
            except queue.Empty:
                continue

    def cancel(self) -> None:
        self._stopped.set()
        self._call.cancel()

    def __iter__(self) -> Iterator[tuple[int, list[Event]]]:
        try:
            for r in self._call:
                if r.compact_revision:
                    raise WatchLost(f"etcd compacted to revision {r.compact_revision}", compacted=True)
                if r.canceled:
                    raise WatchLost(f"etcd cancelled the watch: {r.cancel_reason or 'no reason given'}")
                if r.events:  # not the answer to the create request, nor a progress notice
                    yield r.header.revision, list(r.events)
        except grpc.RpcError as e:
            raise WatchLost(f"watch stream: {e.code().name}: {e.details() or ''}") from None
        raise WatchLost("watch stream ended")
