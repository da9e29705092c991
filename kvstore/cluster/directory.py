"""The cluster prefix directory: which node holds which block, in which tiers, built from the
peers' KV event streams (:mod:`kvstore.cluster.stream` feeds it).

Keys are kvstore's 32-byte chain keys, rooted in the namespace, so one map over every namespace
holds them apart; a prefix is found by walking a request's chain keys from the root and stopping
where no node holds the next one.

Per block and node the directory keeps one entry: ``Node.held[key]`` (the tier bits) and, in
``Directory.where[key]``, the node's small index among the key's holders (an int while one node
holds the key, a tuple of up to :data:`TUPLE_MAX`, a set past that: a system prompt's blocks are
held by every node, and a tuple would make each of their updates cost the node count). A store,
a removal or a tier move is two dict operations; dropping a node (it left, or came back under a
new epoch, or its stream lost more than the peer could replay) is one pass over that node's own
entries. docs/cluster.md has the measured bytes and microseconds per entry.

Single-threaded and plain: :class:`kvstore.cluster.stream.ClusterDirectory` holds the lock.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple, Sequence

from kvstore.kv_events import TIER_OF_MEDIUM, AllBlocksCleared, BlockRemoved, BlockStored
from kvstore.tier_kind import TierKind

# Fastest first: the order a prefix's blocks are best read from.
_SPEED = (TierKind.HBM, TierKind.DRAM, TierKind.NVME)
_BIT = {t: 1 << t for t in _SPEED}
_MEDIUM_BIT = {m: _BIT[t] for m, t in TIER_OF_MEDIUM.items()}
# Tier bits -> rank in _SPEED of the fastest tier among them (index 0, no tier, is never asked).
_BEST = [next((r for r, t in enumerate(_SPEED) if bits & _BIT[t]), 0) for bits in range(1 << (max(_SPEED) + 1))]
TUPLE_MAX = 8  # holders kept as a tuple; more as a set
DEFAULT_LIMIT = 8  # nodes a lookup answers with
# Memory per (node, block) entry, both dicts' share: 133-146 bytes measured with tracemalloc by
# `kvstore bench cluster-sim` (docs/cluster.md); ops' size estimate, not a measurement.
BYTES_PER_ENTRY = 140


class PrefixHit(NamedTuple):
    """``node_id`` (registered under ``epoch``) holds the first ``n_blocks`` blocks of the chain,
    none of them only in a tier slower than ``tier``."""

    node_id: str
    epoch: int
    tier: TierKind
    n_blocks: int


@dataclass(slots=True, eq=False)
class Node:
    node_id: str
    epoch: int
    idx: int
    namespaces: frozenset[str] = frozenset()  # hex namespace ids it announced; empty = any
    held: dict[bytes, int] = field(default_factory=dict)  # key -> tier bits (1 << TierKind)


class Directory:
    def __init__(self) -> None:
        self.nodes: dict[str, Node] = {}
        self.by_idx: dict[int, Node] = {}
        self.where: dict[bytes, int | tuple[int, ...] | set[int]] = {}
        self._free: list[int] = []
        self._next_idx = 0

    # --- nodes ------------------------------------------------------------------------------
    def add_node(self, node_id: str, epoch: int, namespaces=()) -> Node:
        """The node as membership lists it. A new epoch is a new registration (a restart, or a
        return after its lease expired): what the old one announced is dropped."""
        n = self.nodes.get(node_id)
        if n is not None and n.epoch != epoch:
            self.drop_node(node_id)
            n = None
        if n is None:
            idx = self._free.pop() if self._free else self._take_idx()
            n = self.nodes[node_id] = self.by_idx[idx] = Node(node_id, epoch, idx)
        n.namespaces = frozenset(namespaces)
        return n

    def _take_idx(self) -> int:
        self._next_idx += 1
        return self._next_idx - 1

    def drop_node(self, node_id: str) -> None:
        """The node left (or its epoch ended): forget everything it announced."""
        n = self.nodes.pop(node_id, None)
        if n is None:
            return
        self.clear(n)
        del self.by_idx[n.idx]
        self._free.append(n.idx)

    def clear(self, n: Node) -> None:
        """Forget ``n``'s blocks (AllBlocksCleared, or a resync from a snapshot)."""
        for key in n.held:
            self._unlink(key, n.idx)
        n.held = {}

    # --- events -----------------------------------------------------------------------------
    def apply(self, n: Node, events) -> None:
        """Apply one batch's events (vLLM's ``BlockStored`` / ``BlockRemoved`` /
        ``AllBlocksCleared``) from node ``n``, in order."""
        for e in events:
            if isinstance(e, BlockStored):
                bit = _MEDIUM_BIT.get(e.medium)
                if bit is not None:
                    for key in e.block_hashes:
                        self.stored(n, key, bit)
            elif isinstance(e, BlockRemoved):
                bit = _MEDIUM_BIT.get(e.medium)
                if bit is not None:
                    for key in e.block_hashes:
                        self.removed(n, key, bit)
            elif isinstance(e, AllBlocksCleared):
                self.clear(n)

    def stored(self, n: Node, key: bytes, bit: int) -> None:
        had = n.held.get(key, 0)
        n.held[key] = had | bit
        if not had:
            cur = self.where.get(key)
            if cur is None:
                self.where[key] = n.idx
            elif isinstance(cur, int):
                self.where[key] = (cur, n.idx)
            elif isinstance(cur, set):
                cur.add(n.idx)
            elif len(cur) < TUPLE_MAX:
                self.where[key] = cur + (n.idx,)
            else:
                self.where[key] = {*cur, n.idx}

    def removed(self, n: Node, key: bytes, bit: int) -> None:
        had = n.held.get(key)
        if had is None:
            return
        left = had & ~bit
        if left:
            n.held[key] = left
        else:
            del n.held[key]
            self._unlink(key, n.idx)

    def _unlink(self, key: bytes, idx: int) -> None:
        cur = self.where.get(key)
        if cur is None:
            return
        if isinstance(cur, int):
            if cur == idx:
                del self.where[key]
            return
        if isinstance(cur, set):
            cur.discard(idx)
            if len(cur) <= TUPLE_MAX:
                self.where[key] = tuple(cur)
            return
        rest = tuple(i for i in cur if i != idx)
        self.where[key] = rest[0] if len(rest) == 1 else rest

    # --- lookup -----------------------------------------------------------------------------
    def longest_prefix(self, namespace: bytes | str, chain: list[bytes], limit: int = DEFAULT_LIMIT, *,
                       head: Sequence[bytes] = ()) -> list[PrefixHit]:
        """The ``limit`` nodes holding the longest prefixes of ``chain``: how many leading blocks
        each holds, as one :class:`PrefixHit` per tier step (a node with blocks 0-2 in DRAM and
        block 3 only on NVMe gives ``(DRAM, 3)`` and ``(NVME, 4)``), longest first.
        ``namespace`` (the 32-byte namespace id or its hex) leaves out nodes whose registration
        lists other namespaces only. ``head`` (the request's keys before ``chain``: a Lookup's local
        hits) is for the store-backed directory, which finds a chain's shards by them.

        Cost: one dict lookup per block to find how deep any node goes, then, from the deepest
        block back, the holders of each block until ``limit`` nodes are found, each walked from
        the root (one dict lookup per block). A system prompt held by every node costs its
        holders only when fewer than ``limit`` nodes go deeper."""
        if not chain or limit < 1:
            return []
        ns_hex = namespace.hex() if isinstance(namespace, (bytes, bytearray)) else namespace
        where = self.where
        depth = 0
        while depth < len(chain) and chain[depth] in where:
            depth += 1
        hits: list[PrefixHit] = []
        seen: set[int] = set()
        found = 0
        for j in range(depth - 1, -1, -1):
            cur = where[chain[j]]
            for idx in (cur,) if isinstance(cur, int) else cur:
                if idx in seen:
                    continue
                seen.add(idx)
                n = self.by_idx[idx]
                if not n.namespaces or ns_hex in n.namespaces:
                    found += self._walk(n, chain, hits)
                    if found >= limit:  # the others hold no more than these: as far as block j
                        break
            if found >= limit:
                break
        hits.sort(key=lambda h: (-h.n_blocks, _SPEED.index(h.tier), h.node_id))
        keep: set[str] = set()
        out = []
        for h in hits:  # the limit counts nodes, each with all of its tier steps
            if h.node_id not in keep and len(keep) >= limit:
                continue
            keep.add(h.node_id)
            out.append(h)
        return out

    @staticmethod
    def _walk(n: Node, chain: list[bytes], hits: list[PrefixHit]) -> bool:
        """Append ``n``'s tier steps along ``chain``; whether it holds the root at all."""
        held = n.held.get
        worst = count = 0
        for key in chain:
            bits = held(key)
            if not bits:
                break
            rank = _BEST[bits]
            if rank > worst and count:
                hits.append(PrefixHit(n.node_id, n.epoch, _SPEED[worst], count))
                worst = rank
            elif rank > worst:
                worst = rank
            count += 1
        if count:
            hits.append(PrefixHit(n.node_id, n.epoch, _SPEED[worst], count))
        return count > 0

    # --- size -------------------------------------------------------------------------------
    def entries(self) -> int:
        """(node, block) entries held."""
        return sum(len(n.held) for n in self.nodes.values())

    def blocks(self) -> int:
        """Distinct blocks held by any node."""
        return len(self.where)
