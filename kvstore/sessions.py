"""Sessions of the core: one per registered client, ended by CloseSession or, for a client that
died or hangs, by the reaper once the daemon has heard no call of it for ``session_ttl_s``.

A mixin of :class:`kvstore.core.Core` (same single-threaded contract: call with ``Core.lock``
held). ``Core.sessions`` is kept in order of last use (every call naming a session moves it to
the end), so finding the expired ones looks at no live session but the first.
"""

from __future__ import annotations

import enum
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvstore.errors import Code, KVError, session_unknown

if TYPE_CHECKING:
    from kvstore.core import NsState
    from kvstore.leases import Lease

MAX_SESSIONS = 65536
ENDED_REMEMBERED = 4096  # ids of recently ended sessions, kept to say why one is unknown


class SessionEnd(enum.Enum):
    CLOSED = "closed"    # its client sent CloseSession
    EXPIRED = "expired"  # no call for session_ttl_s: the client died or hangs


@dataclass(slots=True, eq=False)
class Session:
    id: bytes
    ns: "NsState"
    leases: dict[int, "Lease"] = field(default_factory=dict)
    seen: float = 0.0     # clock() of the last call naming this session (seconds)
    closed: bool = False  # ended: no lease may be opened under it any more


class SessionOps:
    def _check_room(self) -> None:
        if len(self.sessions) >= MAX_SESSIONS:
            raise KVError(Code.RESOURCE_EXHAUSTED,
                          f"too many sessions ({MAX_SESSIONS}); close idle clients (KVStoreClient.close) "
                          f"or wait for dead ones to expire (server.session_ttl_s = {self.session_ttl_s:g} s)")

    def _open_session(self, st: "NsState") -> Session:
        s = Session(os.urandom(16), st, seen=self.clock())
        st.sessions += 1
        self.sessions[s.id] = s
        return s

    def session(self, sid: bytes) -> Session:
        """The open session ``sid``, renewed: this call counts as hearing from its client."""
        s = self.sessions.get(sid)
        if s is None:
            raise session_unknown(self._why_unknown(sid))
        s.seen = self.clock()
        self.sessions.move_to_end(sid)
        return s

    def _check_open(self, s: Session) -> None:
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
        return (f"session: expired {ago:.1f} s ago after {self.session_ttl_s:g} s without a call "
                "(server.session_ttl_s; clients send KeepAlive every third of it), and its leases with it; "
                "call Register again")

    def close_session(self, s: Session, how: SessionEnd) -> int:
        """End ``s`` and every lease it holds: write leases are aborted (their uncommitted slots
        freed), read leases released (their blocks evictable again). Returns leases ended."""
        leases = list(s.leases.values())
        for lease in leases:
            self._drop_lease(lease)
        del self.sessions[s.id]
        s.closed = True
        s.ns.sessions -= 1
        self._ended[s.id] = (how, self.clock())
        while len(self._ended) > ENDED_REMEMBERED:
            self._ended.popitem(last=False)
        if self.metrics:
            self.metrics.session_ends.labels(reason=how.value).inc()
        return len(leases)

    def expire_sessions(self, limit: int) -> int:
        """End at most ``limit`` sessions not heard from for ``session_ttl_s`` seconds, oldest
        first; returns how many (``limit`` means there may be more: call again, having let go of
        the lock in between so that RPCs are not held up behind a mass expiry)."""
        cutoff = self.clock() - self.session_ttl_s
        n = 0
        while n < limit and self.sessions:
            s = next(iter(self.sessions.values()))
            if s.seen > cutoff:
                break
            self.close_session(s, SessionEnd.EXPIRED)
            n += 1
        return n
