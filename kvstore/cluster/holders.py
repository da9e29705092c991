"""Which peers a pull asks, from the cluster prefix directory (:mod:`.stream`): the peers whose
KV events say they hold the chain's longest prefix, at the epoch membership has them at, best
first; then the peers that publish no events but advertise the namespace (the directory cannot
know what they hold, so they are asked last). A peer whose events say it lacks the chain is
never asked: a miss costs no round trip to it."""

from __future__ import annotations

from kvstore.cluster.member import Member
from kvstore.cluster.stream import ClusterDirectory


class DirectoryHolders:
    """A :class:`kvstore.daemon.pull.Holders` over :meth:`ClusterDirectory.longest_prefix`."""

    def __init__(self, directory: ClusterDirectory, membership) -> None:
        self.directory = directory
        self.membership = membership

    def candidates(self, ns_hex: str, keys: list[bytes]) -> list[Member]:
        peers = {m.node_id: m for m in self.membership.peers()}
        out: list[Member] = []
        # longest_prefix gives one hit per tier step per node, longest first: a node's first
        # hit is its longest, and an entry at another epoch than membership's is stale.
        for hit in self.directory.longest_prefix(ns_hex, keys):
            m = peers.get(hit.node_id)
            if m is not None and m.epoch == hit.epoch and m not in out:
                out.append(m)
        out += sorted((m for m in peers.values() if not m.events_addr and ns_hex in m.namespaces and m not in out),
                      key=lambda m: m.node_id)
        return out
