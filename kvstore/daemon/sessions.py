"""Client sessions: one per registered client, ended by CloseSession, by the exit of the process
that mapped the arena for it (:mod:`kvstore.daemon.peer_watch`) or, for a client that hangs or
cannot be watched, by the reaper once the daemon has heard no call of it for ``session_ttl_s``.

:class:`SessionTable` is the core's table of them (single-threaded: called with the core lock
held). It is kept in order of last use (every call naming a session moves it to the end), so
finding the expired ones looks at no live session but the first. Ending a session's leases is
the core's work (:meth:`kvstore.daemon.core.Core.close_session`); the table only keeps the books.
"""

from __future__ import annotations

import enum
import os
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from kvstore.errors import Code, KVError, session_unknown

if TYPE_CHECKING:
    from kvstore.daemon.core import NsState
    from kvstore.daemon.leases import Lease

MAX_SESSIONS = 65536
ENDED_REMEMBERED = 4096  # ids of recently ended sessions, kept to say why one is unknown


class SessionEnd(enum.Enum):
    CLOSED = "closed"    # its client sent CloseSession
    EXITED = "exited"    # the process that mapped the arena for it exited
    EXPIRED = "expired"  # no call for session_ttl_s: the client died or hangs


@dataclass(slots=True, eq=False)
class Session:
    id: bytes
    ns: "NsState"
    leases: dict[int, "Lease"] = field(default_factory=dict)
    seen: float = 0.0     # clock() of the last call naming this session (seconds)
    closed: bool = False  # ended: no lease may be opened under it any more


class SessionTable:
    def __init__(self, ttl_s: float, clock: Callable[[], float]) -> None:
        self.ttl_s = ttl_s  # SIGHUP may change it
        self.clock = clock
        self._open: OrderedDict[bytes, Session] = OrderedDict()  # least recently heard from first
        self._ended: OrderedDict[bytes, tuple[SessionEnd, float]] = OrderedDict()  # recently ended: how, when

    def __len__(self) -> int:
        return len(self._open)

    def __contains__(self, sid: bytes) -> bool:
        return sid in self._open

    def __iter__(self):
        """Open session ids, least recently heard from first."""
        return iter(self._open)

    def find(self, sid: bytes) -> Session | None:
        """The open session ``sid`` or None, without renewing it."""
        return self._open.get(sid)

    def open(self, st: "NsState") -> Session:
        if len(self._open) >= MAX_SESSIONS:
            raise KVError(Code.RESOURCE_EXHAUSTED,
                          f"too many sessions ({MAX_SESSIONS}); close idle clients (KVStoreClient.close) "
                          f"or wait for dead ones to expire (server.session_ttl_s = {self.ttl_s:g} s)")
        s = Session(os.urandom(16), st, seen=self.clock())
        st.sessions += 1
        self._open[s.id] = s
        return s

    def get(self, sid: bytes) -> Session:
        """The open session ``sid``, renewed: this call counts as hearing from its client."""
        s = self._open.get(sid)
        if s is None:
            raise session_unknown(self._why_unknown(sid))
        s.seen = self.clock()
        self._open.move_to_end(sid)
        return s

    def check_open(self, s: Session) -> None:
        """Before a lease is opened under ``s``: a handler that let go of the lock after looking
        the session up must not give a lease to a session that ended meanwhile (nothing would
        ever end that lease but its TTL)."""
        if s.closed:
            raise session_unknown(self._why_unknown(s.id))

    def _why_unknown(self, sid: bytes) -> str:
        ended = self._ended.get(sid)
        if ended is None:
            return ("session: unknown session id (never registered with this daemon, or the daemon restarted); "
                    "call Register again")
        how, when = ended
        ago = self.clock() - when
        if how is SessionEnd.CLOSED:
            return f"session: closed by its client {ago:.1f} s ago (CloseSession); call Register again"
        if how is SessionEnd.EXITED:
            return f"session: ended {ago:.1f} s ago when its client's process exited; call Register again"
        return (f"session: expired {ago:.1f} s ago after {self.ttl_s:g} s without a call "
                "(server.session_ttl_s; clients send KeepAlive every third of it), and its leases with it; "
                "call Register again")

    def end(self, s: Session, how: SessionEnd) -> None:
        """Take ``s`` out of the table (its leases already ended)."""
        del self._open[s.id]
        s.closed = True
        s.ns.sessions -= 1
        self._ended[s.id] = (how, self.clock())
        while len(self._ended) > ENDED_REMEMBERED:
            self._ended.popitem(last=False)

    def oldest_expired(self) -> Session | None:
        """The least recently heard-from session if it is past ``ttl_s``, else None."""
        if not self._open:
            return None
        s = next(iter(self._open.values()))
        return s if s.seen <= self.clock() - self.ttl_s else None
