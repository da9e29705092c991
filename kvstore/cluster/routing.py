"""Request routers over a fleet's servers, by their kvstore node ids: round-robin, a hit-count
router (the most cached tokens wins, as prefix-cache-aware routers score) and the hint router
(the least modelled time to the prompt's KV wins). The last two read one RouteHints answer
(:mod:`kvstore.daemon.hints`; the gRPC message or the HTTP endpoint's JSON). Where the answer
sets no node apart (nothing cached anywhere), they go round-robin, so new prompts spread.

Used by ``kvstore bench cluster --routers`` and examples/hint_router.py."""

from __future__ import annotations

from typing import Iterable, NamedTuple


class NodeView(NamedTuple):
    node_id: str
    cached_tokens: int
    time_to_kv_s: float


def node_views(hints) -> tuple[list[NodeView], float]:
    """(each listed node, the time at any node not listed: it pulls from a holder or
    recomputes) of a RouteHintsResponse or its JSON form."""
    if isinstance(hints, dict):
        nodes = hints.get("nodes", [])
        elsewhere = float(hints.get("elsewhere_s") or hints.get("recompute_s") or 0.0)
        get = dict.get
    else:
        nodes, elsewhere = hints.nodes, hints.elsewhere_s or hints.recompute_s
        get = getattr
    return [NodeView(get(n, "node_id"), get(n, "hbm_tokens") + get(n, "dram_tokens") + get(n, "nvme_tokens"),
                     get(n, "time_to_kv_s")) for n in nodes], elsewhere


class RoundRobin:
    """Each request to the next server in turn."""

    name = "round-robin"
    needs_hints = False

    def __init__(self, nodes: Iterable[str]) -> None:
        self.nodes = list(nodes)
        if not self.nodes:
            raise ValueError("a router needs at least one node")
        self._next = 0

    def pick(self, hints=None) -> str:
        return self._among(self.nodes)

    def _among(self, ties: list[str]) -> str:
        n = ties[self._next % len(ties)]
        self._next += 1
        return n


class MostCached(RoundRobin):
    """The server whose daemon holds the most of the prompt's leading tokens, in any tier."""

    name = "hit-count"
    needs_hints = True

    def pick(self, hints=None) -> str:
        views, _ = node_views(hints)
        cached = {v.node_id: v.cached_tokens for v in views if v.node_id in self.nodes}
        best = max(cached.values(), default=0)
        if not best:
            return self._among(self.nodes)
        return self._among([n for n in self.nodes if cached.get(n) == best])


class FastestKV(RoundRobin):
    """The server where the prompt's KV is modelled to be ready first (load, pull or recompute,
    as that daemon's Lookup would choose); a server the hints do not list holds none of it
    (the answer's ``elsewhere_s``)."""

    name = "hints"
    needs_hints = True
    tolerance = 1e-6  # relative: times this close are a tie

    def pick(self, hints=None) -> str:
        views, elsewhere = node_views(hints)
        t = {n: elsewhere for n in self.nodes}
        for v in views:
            if v.node_id in t:
                t[v.node_id] = min(t[v.node_id], v.time_to_kv_s)
        best = min(t.values())
        return self._among([n for n in self.nodes if t[n] <= best * (1 + self.tolerance)])


ROUTERS = {r.name: r for r in (RoundRobin, MostCached, FastestKV)}
