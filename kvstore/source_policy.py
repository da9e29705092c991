"""Where a Lookup's prefix should come from in a cluster: load the local prefix, pull a peer's
longer one, or recompute. :class:`LinkEstimator` keeps each peer link's round trip and pull
bandwidth (moving averages over configured priors); :func:`choose_source` chooses per request,
from the local load-or-recompute split (:meth:`kvstore.policy.LoadPolicy.decide`) and each
peer's hit. docs/cluster.md, "Choosing: load, pull or recompute". Nothing here is thread-safe:
the daemon keeps the links behind a lock (:mod:`kvstore.daemon.remote`)."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Callable, Sequence

from kvstore.policy import Decision, PathEstimate, PrefillCostModel


@dataclass(slots=True)
class _Link:
    rtt_s: float
    bytes_per_s: float
    rtts: int = 0
    pulls: int = 0


class LinkEstimator:
    """Per-peer link model for pulls: a round-trip latency and a bandwidth, each an exponential
    moving average (the newest sample weighs ``alpha``), starting from configured priors.

    Round trips come from small control calls (a peer's Lookup answer); bandwidth from each
    pull's bytes over its time less the current round trip, so the pull's fixed cost beyond one
    round trip (the transfer's connect and handshake) counts against bandwidth: pessimistic for
    small pulls, which is the side to err on. Not thread-safe; the caller holds a lock."""

    def __init__(self, prior_bytes_per_s: float, prior_rtt_s: float, alpha: float = 0.3) -> None:
        if not prior_bytes_per_s > 0 or prior_rtt_s < 0 or not 0.0 < alpha <= 1.0:
            raise ValueError(f"link priors: need bandwidth > 0, rtt >= 0 and alpha in (0, 1], "
                             f"got {prior_bytes_per_s}, {prior_rtt_s}, {alpha}")
        self.prior = (prior_bytes_per_s, prior_rtt_s)
        self.alpha = alpha
        self._links: dict[str, _Link] = {}

    def _link(self, peer: str) -> _Link:
        got = self._links.get(peer)
        if got is None:
            got = self._links[peer] = _Link(self.prior[1], self.prior[0])
        return got

    def rtt(self, peer: str, seconds: float) -> None:
        """One control round trip to ``peer`` took ``seconds``."""
        if not (math.isfinite(seconds) and seconds >= 0):
            raise ValueError(f"seconds: must be a finite number >= 0, got {seconds!r}")
        ln = self._link(peer)
        ln.rtt_s = seconds if not ln.rtts else ln.rtt_s + self.alpha * (seconds - ln.rtt_s)
        ln.rtts += 1

    def pull(self, peer: str, nbytes: int, seconds: float) -> None:
        """A pull of ``nbytes`` from ``peer`` took ``seconds`` (the whole Push call)."""
        if nbytes <= 0 or not (math.isfinite(seconds) and seconds > 0):
            raise ValueError(f"pull: need nbytes > 0 and finite seconds > 0, got {nbytes!r}, {seconds!r}")
        ln = self._link(peer)
        sample = nbytes / max(seconds - ln.rtt_s, 0.1 * seconds)
        ln.bytes_per_s = sample if not ln.pulls else ln.bytes_per_s + self.alpha * (sample - ln.bytes_per_s)
        ln.pulls += 1

    def estimate(self, peer: str) -> PathEstimate:
        """The link's model as a path (``peer:<node id>``): latency = round trip. ``measured``
        once a pull has been timed; ``weight`` = pulls seen."""
        ln = self._links.get(peer)
        if ln is None:
            return PathEstimate(f"peer:{peer}", self.prior[0], self.prior[1], False, 0.0)
        return PathEstimate(f"peer:{peer}", ln.bytes_per_s, ln.rtt_s, ln.pulls > 0, float(ln.pulls))

    def snapshot(self) -> dict[str, tuple[PathEstimate, int]]:
        """Every peer seen: (estimate, round trips seen)."""
        return {p: (self.estimate(p), ln.rtts) for p, ln in sorted(self._links.items())}


class SourceChoice(enum.Enum):
    """Where the KV of a request's known prefix comes from; values match the ``advice`` label of
    kvstore_cluster_advice and the Advice enum's names (ADVICE_LOAD, ...)."""

    LOAD = "load"            # load the local prefix (or its leading part), recompute the rest
    PULL = "pull"            # load the local prefix and pull the remote extension, then load it
    RECOMPUTE = "recompute"  # load nothing


@dataclass(frozen=True, slots=True)
class RemoteHit:
    """A peer holding ``blocks`` blocks right after the local prefix, the slowest of them in
    ``tier`` (``dram`` or ``nvme``: NVMe-only blocks are read there before they are shipped)."""

    peer: str
    epoch: int
    blocks: int
    tier: str = "dram"


@dataclass(frozen=True, slots=True)
class SourceDecision:
    """Per-request choice. The ``*_total_s`` are the expected seconds until the KV of the whole
    known prefix (local hits plus the longest remote extension) is on the GPU, each way."""

    choice: SourceChoice
    local: Decision               # the local load-or-recompute split (LoadPolicy.decide)
    remote: RemoteHit | None      # the peer to pull from (choice PULL), else the best offer seen
    pull_s: float                 # pulling that extension and loading it to the GPU
    load_total_s: float
    pull_total_s: float           # inf without a remote extension
    recompute_total_s: float
    reason: str


def choose_source(local: Decision, remotes: Sequence[RemoteHit], *, block_tokens: int, block_bytes: int,
                  cost: PrefillCostModel, link: Callable[[str], PathEstimate],
                  tier: Callable[[str], PathEstimate], lower_tiers_via_dram: bool = True) -> SourceDecision:
    """Load the local prefix, pull a remote extension from the best peer, or recompute.

    ``local``: the local split's decision; ``remotes``: offers of blocks beyond the local
    prefix; ``link(peer)``: the peer's measured link; ``tier(path)``: this daemon's estimate of
    a tier (``dram``: arena to GPU; ``nvme``: stands for the holder's disk, not measured here).
    A pulled extension is usable only after the whole local prefix (vLLM takes a prefix of
    external tokens), so pulling also loads every local block. Only the whole extension is worth
    pulling or none of it: a pulled block costs the same wherever it sits, while recomputing a
    block costs more the later it sits (attention), so if the first pays off so do the rest.
    Ties go to LOAD, then PULL: neither spends GPU compute, and a load spends no network."""
    L = local.matched_tokens // block_tokens
    longest = max((r.blocks for r in remotes), default=0)
    end = (L + longest) * block_tokens
    tail = cost.seconds(local.matched_tokens, end)   # beyond the local prefix, every way but pull
    recompute_total = cost.seconds(0, end)
    load_total = local.load_s + local.recompute_s + tail if local.load_blocks else recompute_total
    dram = tier("dram")
    best, best_total, best_pull = None, math.inf, math.inf
    for r in remotes:
        if r.blocks <= 0:
            continue
        ln = link(r.peer)
        nbytes = r.blocks * block_bytes
        pull = ln.seconds(nbytes)
        if r.tier == "nvme":  # read off the holder's disk before it ships
            pull += tier("nvme").seconds(nbytes)
        if lower_tiers_via_dram:
            pull += dram.seconds(nbytes)
        total = local.all_load_s + pull + cost.seconds((L + r.blocks) * block_tokens, end)
        if total < best_total:
            best, best_total, best_pull = r, total, pull
    if load_total <= min(best_total, recompute_total) and local.load_blocks:
        choice = SourceChoice.LOAD
    elif best is not None and best_total <= recompute_total:
        choice = SourceChoice.PULL
    else:
        choice = SourceChoice.RECOMPUTE
    offer = (f"pull {best.blocks} blocks ({best.tier}) from {best.peer} in {best_pull * 1e3:.3f} ms"
             if best is not None else "no remote extension")
    reason = (f"{choice.value}: {L} local + {longest} remote blocks; load {load_total * 1e3:.3f} ms, "
              f"pull {best_total * 1e3:.3f} ms, recompute {recompute_total * 1e3:.3f} ms; {offer}")
    return SourceDecision(choice, local, best, best_pull if best is not None else 0.0, load_total,
                          best_total, recompute_total, reason)
