"""Load-or-recompute advice for Lookup: each namespace's prefill cost model and the daemon's
measured bandwidths (:class:`kvstore.policy.LoadPolicy`) turned into a LookupResponse's fields."""

from __future__ import annotations

import itertools

from kvstore.config import PolicyConfig
from kvstore.daemon.core import NsState
from kvstore.daemon.metrics import Metrics
from kvstore.policy import Decision, LoadPolicy, PrefillCostModel
from kvstore.tier_kind import TierKind


class Advisor:
    def __init__(self, policy: LoadPolicy, cfg: PolicyConfig, metrics: Metrics | None = None) -> None:
        self.policy = policy
        self.cfg = cfg  # SIGHUP may change prefill_tokens_per_s
        self.metrics = metrics

    def price(self, st: NsState) -> None:
        """(Re)build ``st``'s prefill cost model after a Register. Without a parameter count it
        prices recompute as tokens / throughput (no quadratic attention term)."""
        params = st.model_params or self.cfg.model_params
        st.cost = PrefillCostModel.for_layout(
            st.ns.layout, params=params, tokens_per_s=st.prefill_tokens_per_s or self.cfg.prefill_tokens_per_s)

    def decide(self, st: NsState, tiers: bytes) -> Decision:
        """The load-or-recompute split of the matched prefix (called under the core lock)."""
        runs = [(TierKind(t).name.lower(), len(list(g))) for t, g in itertools.groupby(tiers)]
        d = self.policy.decide(runs, block_tokens=st.ns.layout.block_tokens, block_bytes=st.block_bytes, cost=st.cost)
        if self.metrics and d.outcome.value in ("load", "recompute", "partial"):
            self.metrics.policy_decisions.labels(decision=d.outcome.value).inc()
        return d

    @staticmethod
    def fields(d: Decision) -> dict:
        """LookupResponse fields of a decision."""
        if not d.matched_tokens:
            return {"load_blocks": 0, "reason": "no cached prefix"}
        return {"load_blocks": d.load_blocks, "est_load_s": d.load_s, "est_recompute_s": d.all_recompute_s,
                "reason": d.reason}
