"""Route hints: for a request router, where a prompt's prefix is cheapest to serve.

A router asks any daemon of the fleet (RouteHints over gRPC, or ``POST /v1/route-hints`` on the
hints listener, :mod:`kvstore.daemon.hints_http`) with the prompt's block keys or token ids. The
candidates are this daemon and the peers the cluster directory (replica or store) names as
holding a prefix of the prompt. For each, the answer gives its cached tokens by tier and the
modelled time until the whole prompt's KV is on its GPU if the request goes there: its Lookup's
choice among loading its prefix, pulling a longer one from another candidate, and recomputing
(:func:`kvstore.source_policy.choose_source`, the function Lookup's advice uses), plus recomputing
what nobody holds. A node that is not listed holds nothing: the response's ``recompute_s``.

What is modelled, not measured: a candidate's tiers are priced by this daemon's measured tier
bandwidths, and a link between two peers by this daemon's link to the holder (the fleet's
nodes are alike, and no daemon measures links it does not use). Read-only: no block's recency
changes, and no decision is counted in the policy's metrics.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvstore.cluster.directory import DEFAULT_LIMIT
from kvstore.daemon.index import BlockState
from kvstore.keys import chain_keys
from kvstore.policy import DEFAULT_PRIORS, Decision, LoadPolicy, normalize_path
from kvstore.source_policy import RemoteHit, choose_source
from kvstore.tier_kind import TierKind
from kvstore.v1 import kvstore_pb2 as pb

KEY_BYTES = 32
MAX_KEYS = 65536  # a 1M-token prompt of 16-token blocks
MAX_NODES = 64  # candidates priced (each against the others) and answered at most
_ADVICE = {"load": pb.ADVICE_LOAD, "pull": pb.ADVICE_PULL, "recompute": pb.ADVICE_RECOMPUTE}
_TIER_FIELD = {TierKind.HBM: "hbm_tokens", TierKind.DRAM: "dram_tokens", TierKind.NVME: "nvme_tokens"}


class HintError(ValueError):
    """A request that cannot be answered: ``code`` is ``invalid`` or ``not_found``."""

    def __init__(self, code: str, why: str) -> None:
        super().__init__(why)
        self.code = code


@dataclass
class _Candidate:
    node_id: str
    epoch: int
    local: bool
    tiers: list[TierKind]  # the fastest tier of each leading block it holds


class RouteHints:
    """``core``: the daemon's core (its namespaces, under its lock); ``advisor``: Lookup's
    policy and cost models; ``fleet``: membership, the directory and the link meter (None
    outside a cluster)."""

    def __init__(self, core, advisor, fleet=None, link_meter=None) -> None:
        self.core = core
        self.advisor = advisor
        self.fleet = fleet
        self.meter = link_meter

    def answer(self, namespace_id: bytes, keys: bytes = b"", token_ids=(), max_nodes: int = 0) -> pb.RouteHintsResponse:
        if len(namespace_id) != KEY_BYTES:
            raise HintError("invalid", f"namespace_id: {len(namespace_id)} bytes; it is 32 (RegisterResponse.namespace_id)")
        if keys and len(token_ids):
            raise HintError("invalid", "give keys or token_ids, not both")
        if len(keys) % KEY_BYTES or len(keys) // KEY_BYTES > MAX_KEYS:
            raise HintError("invalid", f"keys: {len(keys)} bytes; 32 per block, at most {MAX_KEYS} blocks")
        limit = max_nodes or DEFAULT_LIMIT
        if limit > MAX_NODES:
            raise HintError("invalid", f"max_nodes: {max_nodes}; at most {MAX_NODES}")
        with self.core.lock:
            st = self.core.namespaces.get(namespace_id)
            if st is None:
                raise HintError("not_found", f"namespace {namespace_id.hex()} is not held by this daemon "
                                "(an engine registers it; ask a daemon its engines use)")
            if st.cost is None:
                self.advisor.price(st)
        bt = st.ns.layout.block_tokens
        if len(token_ids):  # hashed outside the lock: one SHA-256 per block
            if len(token_ids) // bt > MAX_KEYS:
                raise HintError("invalid", f"token_ids: {len(token_ids)}; at most {MAX_KEYS * bt}")
            try:
                chain = chain_keys(st.id, token_ids, bt)
            except ValueError as e:
                raise HintError("invalid", f"token_ids: {e}") from None
        else:
            chain = [keys[i:i + KEY_BYTES] for i in range(0, len(keys), KEY_BYTES)]
        local = []
        with self.core.lock:
            get = st.blocks.get
            for k in chain:  # read-only: a router's question is no use of the blocks
                b = get(k)
                if b is None or b.state is not BlockState.COMMITTED:
                    break
                local.append(TierKind(b.tier))
        prompt = len(chain) * bt
        out = pb.RouteHintsResponse(prompt_tokens=prompt, recompute_s=st.cost.seconds(0, prompt))
        if not chain:
            return out
        cands, out.reason = self._candidates(st, chain, local, limit)
        policy = self.advisor.policy
        with self.core.lock:  # the tier estimator is not thread-safe: its estimates, taken once
            est = {p: policy.bandwidth.estimate(p) for p in DEFAULT_PRIORS}
        priced = LoadPolicy(policy.config)
        priced.bandwidth = _Estimates(est)  # priced outside the lock
        hints = [self._hint(st, priced, c, cands, prompt) for c in cands]
        out.elsewhere_s = self._hint(st, priced, _Candidate("", 0, False, []), cands, prompt).time_to_kv_s
        hints.sort(key=lambda h: (h.time_to_kv_s, not h.local, h.node_id))
        out.nodes.extend(hints[:limit])
        return out

    def _candidates(self, st, chain: list[bytes], local: list[TierKind], limit: int) -> tuple[list[_Candidate], str]:
        f = self.fleet
        me = _Candidate(f.membership.node_id if f is not None else "", f.membership.epoch if f is not None else 0,
                        True, local)
        if f is None:
            return [me], "not in a cluster: this daemon only"
        if f.directory is None:
            return [me], "no cluster prefix directory: peers' holdings unknown"
        peers = {m.node_id: m for m in f.membership.peers()}
        steps: dict[str, list] = {}
        # the directory ranks by length, the hints by time: more candidates than answered
        for h in f.directory.longest_prefix(st.id.hex(), chain, MAX_NODES):
            m = peers.get(h.node_id)
            if m is None or m.epoch != h.epoch or (self.meter is not None and self.meter.set_aside(m.node_id, m.epoch)):
                continue
            steps.setdefault(h.node_id, [h.epoch]).append((h.n_blocks, h.tier))
        cands = [me]
        for node, (epoch, *tier_steps) in list(steps.items())[:MAX_NODES]:
            tiers: list[TierKind] = []
            for n, tier in sorted(tier_steps):  # (DRAM, 3) then (NVME, 5): blocks 3-4 reach NVMe only
                tiers += [tier] * (n - len(tiers))
            cands.append(_Candidate(node, epoch, False, tiers))
        return cands, ""

    def _hint(self, st, policy: LoadPolicy, c: _Candidate, cands: list[_Candidate], prompt: int) -> pb.NodeHint:
        """Candidate ``c``'s answer, ``policy`` pricing its tiers (this daemon's estimates)."""
        bt = st.ns.layout.block_tokens
        runs = []
        for t in c.tiers:
            name = t.name.lower()
            if runs and runs[-1][0] == name:
                runs[-1][1] += 1
            else:
                runs.append([name, 1])
        local: Decision = policy.decide([tuple(r) for r in runs], block_tokens=bt, block_bytes=st.block_bytes,
                                        cost=st.cost, count=False)
        remotes = []
        mine = len(c.tiers)
        for o in cands:
            if o is c or len(o.tiers) <= mine or not o.node_id:
                continue
            slowest = max(o.tiers[mine:], key=lambda t: _SLOWNESS[t])
            remotes.append(RemoteHit(o.node_id, o.epoch, len(o.tiers) - mine,
                                     "nvme" if slowest is TierKind.NVME else "dram"))
        link = self.meter.estimate if self.meter is not None else None  # its own lock
        d = choose_source(local, remotes, block_tokens=bt, block_bytes=st.block_bytes, cost=st.cost,
                          link=link or (lambda peer: policy.bandwidth.estimate("remote")),
                          tier=policy.bandwidth.estimate, lower_tiers_via_dram=policy.config.lower_tiers_via_dram)
        known = (mine + max((r.blocks for r in remotes), default=0)) * bt
        chosen = {"load": d.load_total_s, "pull": d.pull_total_s, "recompute": d.recompute_total_s}[d.choice.value]
        h = pb.NodeHint(node_id=c.node_id, epoch=c.epoch, local=c.local, advice=_ADVICE[d.choice.value],
                        time_to_kv_s=chosen + st.cost.seconds(known, prompt))
        if d.choice.value == "pull" and d.remote is not None:
            h.pull_from = d.remote.peer
        for t in c.tiers:
            setattr(h, _TIER_FIELD[t], getattr(h, _TIER_FIELD[t]) + bt)
        return h


_SLOWNESS = {TierKind.HBM: 0, TierKind.DRAM: 1, TierKind.NVME: 2}


class _Estimates:
    """A :class:`kvstore.policy.BandwidthEstimator`'s estimates, taken at one moment (read-only)."""

    def __init__(self, est: dict) -> None:
        self.est = est

    def estimate(self, path):
        key = normalize_path(path)
        return self.est.get(key) or self.est["remote"]  # a peer's path: the remote prior
