"""The lease table on its own (kvstore/daemon/leases.py): ids, owners, deadlines on an injected
clock, doorbells. What leases do to blocks is tested through the core (tests/test_core.py)."""

from __future__ import annotations

import pytest

from kvstore.daemon.leases import LeaseKind, LeaseTable
from kvstore.daemon.sessions import Session
from kvstore.errors import Code, KVError


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Bells:
    def __init__(self) -> None:
        self.released: list[int] = []

    def release(self, offset: int) -> None:
        self.released.append(offset)


def test_a_lease_is_open_once_added_and_listed_with_its_session():
    clock = Clock()
    t = LeaseTable(30.0, clock)
    s = Session(b"s1", None)
    pending = t.new(LeaseKind.WRITE, s, [])
    assert (pending.id, pending.expires) == (1, 130.0)
    assert pending.id not in t and not s.leases  # a reservation still being filled in
    t.add(pending)
    read = t.open(LeaseKind.READ, s, [])
    assert read.id == 2 and len(t) == 2 and set(s.leases) == {1, 2}
    assert t.get(s, 2, LeaseKind.READ) is read


@pytest.mark.parametrize("lease_id, owner, kind, code", [
    (9, "mine", LeaseKind.READ, Code.NOT_FOUND),
    (1, "other", LeaseKind.READ, Code.PERMISSION_DENIED),
    (1, "mine", LeaseKind.WRITE, Code.FAILED_PRECONDITION),
])
def test_get_says_why_a_lease_cannot_be_used(lease_id, owner, kind, code):
    t = LeaseTable(30.0, Clock())
    mine, other = Session(b"a", None), Session(b"b", None)
    t.open(LeaseKind.READ, mine, [])
    with pytest.raises(KVError) as e:
        t.get(mine if owner == "mine" else other, lease_id, kind)
    assert e.value.code is code
    if code is Code.NOT_FOUND:
        assert "TTL 30.0 s" in str(e.value)


def test_renewal_moves_the_deadline_and_names_what_is_not_the_callers():
    clock = Clock()
    t = LeaseTable(30.0, clock)
    a, b = Session(b"a", None), Session(b"b", None)
    la, lb = t.open(LeaseKind.READ, a, []), t.open(LeaseKind.READ, b, [])
    clock.now = 125.0
    assert t.renew(a, [la.id, lb.id, 77]) == [lb.id, 77]
    assert (la.expires, lb.expires) == (155.0, 130.0)
    clock.now = 130.0
    assert t.expired() == [lb]  # due exactly at its deadline; still open until ended
    assert lb.id in t
    t.end(lb)
    assert lb.id not in t and not b.leases


def test_a_doorbell_goes_back_once_when_its_lease_ends():
    bells = Bells()
    t = LeaseTable(30.0, Clock(), bells)
    s = Session(b"s", None)
    lease = t.new(LeaseKind.WRITE, s, [])
    lease.doorbell = 4096
    t.end(lease)  # not open: the table gives back only the bells of its open leases
    assert bells.released == []
    t.add(lease)
    t.end(lease)
    t.end(lease)
    assert bells.released == [4096] and len(t) == 0
