"""Lookup's remote hits from the cluster prefix directory (``DirectoryRemoteHits``), in memory:
each node's tier steps as offers, at the epoch membership has the node at. No sockets."""

from __future__ import annotations

import pytest

pytest.importorskip("zmq")  # the directory's stream module (the [events] extra)

from kvstore.cluster.directory import Directory  # noqa: E402
from kvstore.cluster.holders import DirectoryRemoteHits  # noqa: E402
from kvstore.cluster.member import Member  # noqa: E402
from kvstore.kv_events import stored_events  # noqa: E402
from kvstore.tier_kind import TierKind  # noqa: E402

K = [bytes([i]) * 32 for i in range(8)]


class Peers:
    """Membership's view, as :class:`kvstore.cluster.membership.Membership.peers` gives it."""

    def __init__(self, *members: Member) -> None:
        self.members = list(members)

    def peers(self) -> list[Member]:
        return list(self.members)


def stored(keys, medium="CPU"):
    return stored_events([(k, None, None, 16, "") for k in keys], medium)


def test_offers_per_tier_step_at_the_registered_epoch_only():
    d = Directory()
    a, b, g = d.add_node("a", 1), d.add_node("b", 7), d.add_node("g", 2)
    d.apply(a, stored(K[:3]) + stored(K[3:5], "STORAGE"))  # 3 in DRAM, 5 reaching NVMe
    d.apply(b, stored(K[:6]))                              # announced under epoch 7
    d.apply(g, stored(K[:2], "GPU"))                        # HBM: shipped from its DRAM copy
    ma, mb, mg = Member("a", 1), Member("b", 8), Member("g", 2)  # b came back: epoch 7 is stale
    hits = DirectoryRemoteHits(d, Peers(ma, mb, mg)).remote_prefix("ns", K[:6])
    assert hits == [(ma, 5, TierKind.NVME), (ma, 3, TierKind.DRAM), (mg, 2, TierKind.DRAM)]
    assert DirectoryRemoteHits(d, Peers(mb)).remote_prefix("ns", K[:6]) == []
    assert DirectoryRemoteHits(d, Peers(ma)).remote_prefix("ns", K[6:]) == []  # nobody holds these
