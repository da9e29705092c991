"""Which peers a pull asks, from the cluster prefix directory (:mod:`.stream`): the peers whose
KV events say they hold the chain's longest prefix, at the epoch membership has them at, best
first; then the peers that publish no events but advertise the namespace (the directory cannot
know what they hold, so they are asked last). A peer whose events say it lacks the chain is
never asked: a miss costs no round trip to it. The same directory answers Lookup's remote hits
(:class:`DirectoryRemoteHits`), from memory."""

from __future__ import annotations

from collections.abc import Sequence

from kvstore.cluster.member import Member
from kvstore.cluster.stream import ClusterDirectory
from kvstore.tier_kind import TierKind


class DirectoryHolders:
    """A :class:`kvstore.daemon.pull.Holders` over :meth:`ClusterDirectory.longest_prefix`."""

    def __init__(self, directory: ClusterDirectory, membership, covers=lambda m: bool(m.events_addr)) -> None:
        """``covers(member)``: whether the directory knows what that peer holds (the replica: it
        publishes KV events; the store's: it writes there); peers it does not cover are asked last."""
        self.directory = directory
        self.membership = membership
        self.covers = covers

    def candidates(self, ns_hex: str, keys: list[bytes], head: Sequence[bytes] = ()) -> list[Member]:
        peers = {m.node_id: m for m in self.membership.peers()}
        out: list[Member] = []
        # longest_prefix gives one hit per tier step per node, longest first: a node's first
        # hit is its longest, and an entry at another epoch than membership's is stale.
        for hit in self.directory.longest_prefix(ns_hex, keys, head=head):
            m = peers.get(hit.node_id)
            if m is not None and m.epoch == hit.epoch and m not in out:
                out.append(m)
        out += sorted((m for m in peers.values() if not self.covers(m) and ns_hex in m.namespaces and m not in out),
                      key=lambda m: m.node_id)
        return out


class DirectoryRemoteHits:
    """A :class:`kvstore.daemon.remote.RemoteHits` source over the same directory: which peers
    hold the blocks after a Lookup's local hits, answered from memory (no round trip, so a
    Lookup consults it without ``ask_peers``: an engine's scheduler gets PULL advice at no
    network cost). Each node's tier steps are offers of their own (a short prefix in DRAM
    against a longer one reaching NVMe), at the epoch membership has the node at; an entry at
    another epoch is stale and left out. An entry may still be stale (evicted since its last
    event): the pull then misses cleanly and the worker recomputes."""

    def __init__(self, directory: ClusterDirectory, membership) -> None:
        self.directory = directory
        self.membership = membership

    def remote_prefix(self, ns_hex: str, keys: list[bytes], head: Sequence[bytes] = ()
                      ) -> list[tuple[Member, int, TierKind]]:
        peers = {m.node_id: m for m in self.membership.peers()}
        out = []
        for hit in self.directory.longest_prefix(ns_hex, keys, head=head):
            m = peers.get(hit.node_id)
            if m is not None and m.epoch == hit.epoch:
                # A holder ships from DRAM (HBM blocks have their DRAM copy); NVMe-only ones are read first.
                out.append((m, hit.n_blocks, TierKind.NVME if hit.tier is TierKind.NVME else TierKind.DRAM))
        return out
