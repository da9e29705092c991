"""Leases: a session's hold on blocks, to write them (Reserve, until the last Commit or an
Abort) or to read them (Acquire, or ``Core.pin`` for AwaitTransfer). A lease lapses
``ttl_s`` seconds after it was opened or last renewed (KeepAlive), so a client that died
mid-write or mid-read gives its slots and pins back.

Plain and single-threaded, like the core that owns the table (called with ``Core.lock``
held). What a lease does to its blocks (reserved slots, read pins) is the core's business:
the table only knows leases, their owners, their doorbells and their deadlines.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterator

from kvstore.doorbell import Doorbells
from kvstore.errors import Code, KVError, not_found

if TYPE_CHECKING:
    from kvstore.daemon.index import Block
    from kvstore.daemon.sessions import Session


class LeaseKind:
    WRITE = "write"
    READ = "read"


@dataclass(slots=True, eq=False)
class Lease:
    id: int
    kind: str
    session: "Session"
    blocks: list["Block"]
    expires: float
    doorbell: int = 0  # arena offset of the lease's layer doorbell (write leases that asked)
    # Write leases committed in pieces: a committed block whose chain parent is still reserved
    # under this lease, by that parent's key; linked when the parent commits (pieces of one
    # lease may commit in any order).
    orphans: dict = field(default_factory=dict)
    part: int = -1  # the part of its blocks this write lease fills (Reserve's part), -1 = whole blocks


class LeaseTable:
    """The open leases by id (ids count up from 1 and are never reused), each also listed in
    its session's ``leases``. ``doorbells``: where a lease's doorbell goes back when it ends."""

    def __init__(self, ttl_s: float, clock: Callable[[], float], doorbells: Doorbells | None = None) -> None:
        self.ttl_s = ttl_s
        self.clock = clock
        self.doorbells = doorbells
        self._open: dict[int, Lease] = {}
        self._ids = itertools.count(1)

    def __len__(self) -> int:
        return len(self._open)

    def __contains__(self, lease_id: int) -> bool:
        return lease_id in self._open

    def values(self) -> Iterator[Lease]:
        return iter(self._open.values())

    def new(self, kind: str, s: "Session", blocks: list["Block"]) -> Lease:
        """A lease with its id and deadline, not open yet (:meth:`add` opens it): a
        reservation fills it in first and drops it if that fails."""
        return Lease(next(self._ids), kind, s, blocks, self.clock() + self.ttl_s)

    def add(self, lease: Lease) -> Lease:
        self._open[lease.id] = lease
        lease.session.leases[lease.id] = lease
        return lease

    def open(self, kind: str, s: "Session", blocks: list["Block"]) -> Lease:
        return self.add(self.new(kind, s, blocks))

    def get(self, s: "Session", lease_id: int, kind: str) -> Lease:
        """``s``'s open lease ``lease_id`` of ``kind`` (NOT_FOUND, PERMISSION_DENIED or
        FAILED_PRECONDITION otherwise)."""
        lease = self._open.get(lease_id)
        if lease is None:
            raise not_found(f"lease {lease_id}: unknown or expired (TTL {self.ttl_s} s); reserve or acquire again")
        if lease.session is not s:
            raise KVError(Code.PERMISSION_DENIED, f"lease {lease_id}: belongs to another session")
        if lease.kind != kind:
            raise KVError(Code.FAILED_PRECONDITION, f"lease {lease_id}: is a {lease.kind} lease, not a {kind} lease")
        return lease

    def end(self, lease: Lease) -> None:
        """Close ``lease`` (idempotent); its doorbell goes back if it was open."""
        if lease.doorbell and self._open.get(lease.id) is lease:
            self.doorbells.release(lease.doorbell)
        self._open.pop(lease.id, None)
        lease.session.leases.pop(lease.id, None)

    def renew(self, s: "Session", lease_ids: list[int]) -> list[int]:
        """Push the deadline of ``s``'s leases ``lease_ids`` to ``ttl_s`` from now; returns the
        ids that are not ``s``'s open leases (expired, ended, or another session's)."""
        gone = []
        until = self.clock() + self.ttl_s
        for lid in lease_ids:
            lease = self._open.get(lid)
            if lease is None or lease.session is not s:
                gone.append(lid)
            else:
                lease.expires = until
        return gone

    def expired(self) -> list[Lease]:
        """The open leases past their deadline (still open: ending them is the caller's)."""
        now = self.clock()
        return [lease for lease in self._open.values() if lease.expires <= now]
