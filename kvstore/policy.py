"""Load-or-recompute policy: for a matched cached prefix, how many blocks to load and why.

Two models meet here:

* :class:`BandwidthEstimator` learns, per path (a tier such as ``"dram"`` or a link such as
  ``"peer:node-3"``), ``seconds = latency + bytes / bandwidth`` from real transfers: an
  exponentially weighted least-squares fit, so both terms are measured once transfers of more
  than one size have been seen. The newest transfer weighs ``alpha``; older ones also lose half
  their weight every ``half_life_s`` seconds of the injected clock, so after a quiet spell the
  next transfers decide quickly.
* :class:`PrefillCostModel` prices recomputing tokens ``[start, end)``: a linear term
  (about 2 x active params FLOPs per token) and a quadratic attention term (one unit per causal
  query-key pair), converted to seconds by an effective FLOP rate calibrated from the prefill
  throughput a worker reports (tokens/s at a reference prompt length) or a configured default.

:meth:`LoadPolicy.decide` scans every split of the prefix (load the first ``j`` blocks,
recompute the rest; only a prefix can be loaded, since recompute needs the KV before it) and
picks the fastest. Transfers of different tiers are assumed serial (they share the host link),
and an NVMe or peer block also pays the DRAM-to-GPU hop, since it lands in the arena first.
In a cluster, :mod:`kvstore.source_policy` chooses among loading the local prefix, pulling a
peer's extension of it and recomputing, from the split this module prices.
Nothing here is thread-safe: the daemon calls it under its one lock.
"""

from __future__ import annotations

import enum
import math
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator, Mapping, Sequence

import numpy as np

from kvstore.layout import KVLayout
from kvstore.modelcfg import ModelConfig

# Priors used until a path has been measured: (bytes/s, seconds per transfer). Deliberately
# round numbers; the estimator replaces them with the first real transfer.
DEFAULT_PRIORS: dict[str, tuple[float, float]] = {
    "hbm": (1.0e12, 10e-6),     # device-to-device copy
    "dram": (20e9, 20e-6),      # pinned host -> GPU over PCIe
    "nvme": (3e9, 150e-6),      # O_DIRECT read then host -> GPU
    "remote": (5e9, 100e-6),    # another daemon, any "peer:<name>" path
}


class LoadChoice(enum.Enum):
    """Load-or-recompute for one matched prefix (:attr:`Decision.outcome`); values match the
    ``decision`` label of kvstore_policy_decisions."""

    LOAD = "load"            # load every matched block
    PARTIAL = "partial"      # load a leading part, recompute the rest
    RECOMPUTE = "recompute"  # load nothing
    NONE = "none"            # nothing matched: nothing to decide


@dataclass(frozen=True, slots=True)
class LoadPolicyConfig:
    """Estimator and policy settings (bytes, seconds, FLOP/s)."""

    alpha: float = 0.2                    # weight of the newest transfer in the moving average
    half_life_s: float = 60.0             # age at which a measurement's weight halves
    priors: Mapping[str, tuple[float, float]] = field(default_factory=lambda: dict(DEFAULT_PRIORS))
    max_blocks_per_transfer: int = 0      # a run of blocks on one path moves in transfers of at
                                          # most this many blocks; 0 = one transfer per run
    default_prefill_flops_per_s: float = 4.0e14  # ~40% of an H100's dense bf16 peak
    lower_tiers_via_dram: bool = True     # NVMe and peer blocks land in the DRAM arena first,
                                          # so their load also pays the "dram" hop to the GPU

    def __post_init__(self) -> None:
        if not 0.0 < self.alpha <= 1.0:
            raise ValueError(f"alpha: must be in (0, 1], got {self.alpha}")
        if not self.half_life_s > 0:
            raise ValueError(f"half_life_s: must be > 0, got {self.half_life_s}")
        if self.max_blocks_per_transfer < 0:
            raise ValueError(f"max_blocks_per_transfer: must be >= 0, got {self.max_blocks_per_transfer}")
        if not self.default_prefill_flops_per_s > 0:
            raise ValueError(f"default_prefill_flops_per_s: must be > 0, got {self.default_prefill_flops_per_s}")
        for path, (bw, lat) in self.priors.items():
            if not bw > 0 or lat < 0:
                raise ValueError(f"priors[{path!r}]: need bandwidth > 0 and latency >= 0, got {(bw, lat)}")


def normalize_path(path: object) -> str:
    """Canonical path name: ``hbm``, ``dram``, ``nvme``, ``remote`` or ``peer:<name>``.
    Accepts enum members (``TierKind.DRAM``) by name; raises ValueError naming ``path``."""
    name = path.name if isinstance(path, enum.Enum) else path
    if not isinstance(name, str) or not name:
        raise ValueError(f"path: must be a non-empty string, got {path!r}")
    low = name.lower()
    if low in DEFAULT_PRIORS or (low.startswith("peer:") and len(low) > 5):
        return low
    raise ValueError(f"path: unknown transfer path {path!r}; use hbm, dram, nvme, remote or peer:<name>")


@dataclass(frozen=True, slots=True)
class PathEstimate:
    """Current transfer-time model of one path: ``seconds = latency_s + bytes / bytes_per_s``."""

    path: str
    bytes_per_s: float
    latency_s: float
    measured: bool    # False: still the prior
    weight: float     # effective number of transfers behind the estimate (decayed)

    def seconds(self, nbytes: float, transfers: int = 1) -> float:
        return transfers * self.latency_s + nbytes / self.bytes_per_s


class _Fit:
    """Exponentially weighted sums for the least-squares line t = a + b * bytes."""

    __slots__ = ("w", "x", "y", "xx", "xy", "t_last")

    def __init__(self) -> None:
        self.w = self.x = self.y = self.xx = self.xy = 0.0
        self.t_last = 0.0

    def copy(self) -> "_Fit":
        c = _Fit()
        c.w, c.x, c.y, c.xx, c.xy, c.t_last = self.w, self.x, self.y, self.xx, self.xy, self.t_last
        return c


class BandwidthEstimator:
    """Online per-path bandwidth and per-transfer latency. Thread-safe: the demoter, the NVMe
    I/O threads, transfers and gRPC threads observe while others read; its own lock guards the
    fits (held for a few float operations)."""

    def __init__(self, config: LoadPolicyConfig | None = None, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config or LoadPolicyConfig()
        self.clock = clock
        self._fits: dict[str, _Fit] = {}
        self._lock = threading.Lock()

    def observe(self, path: object, nbytes: int, seconds: float) -> None:
        """Record one finished transfer of ``nbytes`` bytes that took ``seconds``."""
        key = normalize_path(path)
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0:
            raise ValueError(f"nbytes: must be a positive integer, got {nbytes!r}")
        if not (isinstance(seconds, (int, float)) and math.isfinite(seconds) and seconds > 0):
            raise ValueError(f"seconds: must be a finite number > 0, got {seconds!r}")
        now = self.clock()
        x, y = float(nbytes), float(seconds)
        with self._lock:
            fit = self._fits.get(key)
            if fit is None:
                fit = self._fits[key] = _Fit()
                keep = 0.0
            else:
                age = max(0.0, now - fit.t_last)
                keep = (1.0 - self.config.alpha) * 0.5 ** (age / self.config.half_life_s)
            fit.w = fit.w * keep + 1.0
            fit.x = fit.x * keep + x
            fit.y = fit.y * keep + y
            fit.xx = fit.xx * keep + x * x
            fit.xy = fit.xy * keep + x * y
            fit.t_last = now

    @contextmanager
    def timed(self, path: object, nbytes: int) -> Iterator[None]:
        """Time the enclosed transfer with the injected clock and record it. A transfer that
        raises is not recorded (its time says nothing about the path's bandwidth)."""
        key = normalize_path(path)
        start = self.clock()
        yield
        elapsed = self.clock() - start
        if elapsed > 0:  # a coarse clock can read 0 for a tiny copy; skip rather than divide by it
            self.observe(key, nbytes, elapsed)

    def estimate(self, path: object) -> PathEstimate:
        """The path's current model; the configured prior until its first transfer."""
        key = normalize_path(path)
        prior_bw, prior_lat = self._prior(key)
        with self._lock:  # one consistent set of sums
            fit = self._fits.get(key)
            if fit is not None:
                fit = fit.copy()
        if fit is None:
            return PathEstimate(key, prior_bw, prior_lat, False, 0.0)
        mx, my = fit.x / fit.w, fit.y / fit.w
        var = fit.xx / fit.w - mx * mx
        if var > (0.05 * mx) ** 2:  # sizes vary enough to separate latency from bandwidth
            slope = (fit.xy / fit.w - mx * my) / var
            lat = my - slope * mx
            if slope > 0 and lat >= 0:
                return PathEstimate(key, 1.0 / slope, lat, True, fit.w)
            if fit.xy > 0 and lat < 0:  # noise put the line below the origin: fit through it
                return PathEstimate(key, fit.xx / fit.xy, 0.0, True, fit.w)
        # One transfer size: the split is unknowable, so keep the prior latency (at most half
        # of a transfer) and give the rest to bandwidth; the prediction at this size is exact.
        lat = min(prior_lat, 0.5 * my)
        return PathEstimate(key, mx / (my - lat), lat, True, fit.w)

    def snapshot(self) -> dict[str, PathEstimate]:
        """Estimates of every measured path (for the bandwidth gauge)."""
        with self._lock:
            keys = sorted(self._fits)
        return {key: self.estimate(key) for key in keys}

    def _prior(self, key: str) -> tuple[float, float]:
        priors = self.config.priors
        if key in priors:
            return priors[key]
        if key.startswith("peer:") and "remote" in priors:
            return priors["remote"]
        return DEFAULT_PRIORS["remote" if key.startswith("peer:") else key]


@dataclass(frozen=True, slots=True)
class PrefillCostModel:
    """Seconds to prefill tokens ``[start, end)`` when the KV of ``[0, start)`` is present.

    FLOPs = ``linear_flops_per_token * (end - start) + attn_flops_per_pair * pairs``, with
    ``pairs = (end(end+1) - start(start+1)) / 2`` causal query-key pairs; seconds = FLOPs /
    ``flops_per_s`` (an effective rate for the whole tensor-parallel group).
    """

    linear_flops_per_token: float
    attn_flops_per_pair: float
    flops_per_s: float

    def __post_init__(self) -> None:
        for name in ("linear_flops_per_token", "flops_per_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}: must be > 0, got {getattr(self, name)!r}")
        if self.attn_flops_per_pair < 0:
            raise ValueError(f"attn_flops_per_pair: must be >= 0, got {self.attn_flops_per_pair!r}")

    def flops(self, start: int, end: int) -> float:
        if not 0 <= start <= end:
            raise ValueError(f"start, end: need 0 <= start <= end, got {start}, {end}")
        pairs = (end * (end + 1) - start * (start + 1)) / 2
        return self.linear_flops_per_token * (end - start) + self.attn_flops_per_pair * pairs

    def seconds(self, start: int, end: int) -> float:
        """Seconds to prefill tokens ``[start, end)`` given the KV before ``start``."""
        return self.flops(start, end) / self.flops_per_s

    def tokens_per_s(self, prompt_tokens: int) -> float:
        """Prefill throughput this model predicts for a prompt of ``prompt_tokens`` tokens."""
        return prompt_tokens / self.seconds(0, prompt_tokens)

    @classmethod
    def calibrated(cls, linear_flops_per_token: float, attn_flops_per_pair: float, *,
                   tokens_per_s: float, ref_tokens: int) -> "PrefillCostModel":
        """Model whose prediction for a ``ref_tokens`` prompt is exactly ``tokens_per_s``: the
        throughput a worker measured and reported at Register."""
        if not tokens_per_s > 0:
            raise ValueError(f"tokens_per_s: must be > 0, got {tokens_per_s!r}")
        if isinstance(ref_tokens, bool) or not isinstance(ref_tokens, int) or ref_tokens <= 0:
            raise ValueError(f"ref_tokens: must be a positive integer, got {ref_tokens!r}")
        unit = cls(linear_flops_per_token, attn_flops_per_pair, 1.0)
        return cls(linear_flops_per_token, attn_flops_per_pair,
                   unit.flops(0, ref_tokens) * tokens_per_s / ref_tokens)

    @classmethod
    def for_model(cls, model: ModelConfig, *, tokens_per_s: float | None = None,
                  ref_tokens: int = 2048, flops_per_s: float | None = None,
                  params: int | None = None) -> "PrefillCostModel":
        """Cost model of ``model``: calibrated from a reported throughput when given, else from
        an effective FLOP rate (default :attr:`LoadPolicyConfig.default_prefill_flops_per_s`).
        ``params`` overrides the active parameter count (2 x params FLOPs per token)."""
        linear = 2 * params if params else model.linear_flops_per_token()
        attn = model.attn_flops_per_pair()
        if tokens_per_s is not None:
            return cls.calibrated(linear, attn, tokens_per_s=tokens_per_s, ref_tokens=ref_tokens)
        return cls(linear, attn, flops_per_s or LoadPolicyConfig().default_prefill_flops_per_s)

    @classmethod
    def for_layout(cls, layout: KVLayout, *, params: float, tokens_per_s: float,
                   ref_tokens: int = 2048) -> "PrefillCostModel":
        """Cost model when the daemon knows only the KV layout, the (active) parameter count
        and a throughput. The attention width ``d`` (query heads x head dim) is estimated from
        the dense-transformer rule ``params ~ 12 x layers x d^2``, giving ``4 x layers x d``
        FLOPs per query-key pair. With ``params <= 0`` the quadratic term is left out: seconds
        are then ``tokens / tokens_per_s``, which underprices recomputing long prefixes."""
        if params <= 0:
            return cls.calibrated(1.0, 0.0, tokens_per_s=tokens_per_s, ref_tokens=ref_tokens)
        width = math.sqrt(params / (12 * layout.num_layers))
        return cls.calibrated(2 * params, 4 * layout.num_layers * width,
                              tokens_per_s=tokens_per_s, ref_tokens=ref_tokens)


@dataclass(frozen=True, slots=True)
class Decision:
    """Answer for one matched prefix. Times are estimates in seconds."""

    outcome: LoadChoice
    load_blocks: int
    load_tokens: int
    matched_tokens: int
    load_s: float            # loading the chosen blocks
    recompute_s: float       # recomputing the matched tokens not loaded
    all_load_s: float        # loading every matched block
    all_recompute_s: float   # recomputing the whole matched prefix
    reason: str


Runs = Mapping[object, int] | Sequence[tuple[object, int]]


def runs_of(paths: Iterable[object]) -> list[tuple[str, int]]:
    """Per-block paths in chain order (e.g. a Lookup's tier per hit block) -> ``(path, n)`` runs."""
    runs: list[tuple[str, int]] = []
    for p in paths:
        key = normalize_path(p)
        if runs and runs[-1][0] == key:
            runs[-1] = (key, runs[-1][1] + 1)
        else:
            runs.append((key, 1))
    return runs


PY_SPLIT_BLOCKS = 256  # prefixes up to this many blocks are priced in plain Python, longer ones in numpy


def splits(counts: Sequence[int], per_block_s: Sequence[float], latency_s: Sequence[float], per_transfer: int,
           block_tokens: int, cost: "PrefillCostModel") -> tuple[Sequence[float], Sequence[float], int]:
    """Every split of a matched prefix of runs of ``counts`` blocks (each run's seconds per block
    and per transfer opened): ``load[j]`` and ``recompute[j]`` for loading the first j blocks
    and recomputing the rest, and the cheapest j (the last of equals: ties load more).

    A Lookup's answer waits for this. On a core that has just been idle a dozen small numpy
    calls cost 2.5 ms (0.08 ms warm; a 2-core VM), so a prefix of up to ``PY_SPLIT_BLOCKS``
    blocks is priced in plain Python; a longer one in numpy, where plain Python's per-block cost
    passes numpy's. Both do the same float operations in the same order: the same answers."""
    if sum(counts) > PY_SPLIT_BLOCKS:
        return _splits_np(counts, per_block_s, latency_s, per_transfer, block_tokens, cost)
    return _splits_py(counts, per_block_s, latency_s, per_transfer, block_tokens, cost)


def _splits_py(counts, per_block_s, latency_s, per_transfer, block_tokens, cost):
    load = [0.0]  # each block's seconds, plus the latency where it opens a transfer
    for n, c, lat in zip(counts, per_block_s, latency_s):
        for k in range(n):
            opens = k % per_transfer == 0 if per_transfer else k == 0
            load.append(load[-1] + (c + lat if opens else c))
    blocks = len(load) - 1
    matched = blocks * block_tokens
    lin, attn, rate = cost.linear_flops_per_token, cost.attn_flops_per_pair, cost.flops_per_s
    pairs_all = float(matched * (matched + 1))
    recompute = []
    for j in range(blocks + 1):
        s = float(j * block_tokens)
        recompute.append((lin * (matched - s) + attn * (pairs_all - s * (s + 1)) / 2) / rate)
    best = 0
    for j in range(1, blocks + 1):
        if load[j] + recompute[j] <= load[best] + recompute[best]:
            best = j
    return load, recompute, best


def _splits_np(counts, per_block_s, latency_s, per_transfer, block_tokens, cost):
    n_arr = np.asarray(counts, dtype=np.int64)
    blocks = int(n_arr.sum())
    within = np.arange(blocks) - np.repeat(np.cumsum(n_arr) - n_arr, n_arr)
    opens = within % per_transfer == 0 if per_transfer else within == 0
    step = np.repeat(per_block_s, n_arr) + opens * np.repeat(latency_s, n_arr)
    matched = blocks * block_tokens
    load = np.concatenate([[0.0], np.cumsum(step)])
    starts = np.arange(blocks + 1, dtype=np.float64) * block_tokens
    recompute = (cost.linear_flops_per_token * (matched - starts) + cost.attn_flops_per_pair
                 * (matched * (matched + 1) - starts * (starts + 1)) / 2) / cost.flops_per_s
    total = load + recompute
    return load, recompute, int(blocks - np.argmin(total[::-1]))


class LoadPolicy:
    """Decides load-or-recompute per block from measured paths and a prefill cost model.
    ``counts`` tallies outcomes for the metrics exporter. Thread-safe: the bandwidth estimator
    and the tallies carry their own locks, so movers and RPC threads call it without the
    daemon's lock."""

    def __init__(self, config: LoadPolicyConfig | None = None, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config or LoadPolicyConfig()
        self.bandwidth = BandwidthEstimator(self.config, clock=clock)
        self.counts: dict[LoadChoice, int] = {o: 0 for o in LoadChoice}
        self._count_lock = threading.Lock()

    def observe(self, path: object, nbytes: int, seconds: float) -> None:
        """Record a finished transfer on ``path`` (see :meth:`BandwidthEstimator.observe`)."""
        self.bandwidth.observe(path, nbytes, seconds)

    def decide(self, runs: Runs, *, block_tokens: int, block_bytes: int,
               cost: PrefillCostModel, count: bool = True) -> Decision:
        """Choose how many leading blocks of the matched prefix to load.

        ``runs``: where the matched blocks live, in chain order, as ``(path, blocks)`` pairs or
        an ordered mapping, e.g. ``[("dram", 40), ("nvme", 24)]``. ``block_bytes`` is what one
        block moves on the path (the shard of this worker's namespace). Ties go to loading,
        which spends copy engines instead of GPU compute that other requests could use.
        ``count``: counted among the decisions (a router's question is not a request's decision).
        """
        for name, value in (("block_tokens", block_tokens), ("block_bytes", block_bytes)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name}: must be a positive integer, got {value!r}")
        pairs = list(runs.items()) if hasattr(runs, "items") else list(runs)  # a Mapping (no ABC check: it is slow)
        ests: dict[str, PathEstimate] = {}
        used: set[str] = set()
        counts, per_block_s, latency_s = [], [], []
        for path, n in pairs:
            if isinstance(n, bool) or not isinstance(n, int) or n < 0:
                raise ValueError(f"runs: block count for {path!r} must be an integer >= 0, got {n!r}")
            key = normalize_path(path)
            hops = [key]
            if self.config.lower_tiers_via_dram and key not in ("hbm", "dram"):
                hops.append("dram")
            for hop in hops:
                if hop not in ests:
                    ests[hop] = self.bandwidth.estimate(hop)
            if n:
                used.add(key)
            counts.append(n)
            per_block_s.append(sum(block_bytes / ests[h].bytes_per_s for h in hops))
            latency_s.append(sum(ests[h].latency_s for h in hops))
        blocks = sum(counts)
        if blocks == 0:
            if count:
                with self._count_lock:
                    self.counts[LoadChoice.NONE] += 1
            return Decision(LoadChoice.NONE, 0, 0, 0, 0.0, 0.0, 0.0, 0.0, "no matched blocks")
        matched = blocks * block_tokens
        load, recompute, best = splits(counts, per_block_s, latency_s, self.config.max_blocks_per_transfer,
                                       block_tokens, cost)
        slowest = min((ests[k] for k in used), key=lambda e: e.bytes_per_s)
        outcome = LoadChoice.LOAD if best == blocks else LoadChoice.RECOMPUTE if best == 0 else LoadChoice.PARTIAL
        if count:
            with self._count_lock:
                self.counts[outcome] += 1
        reason = (f"{outcome.value}: load {best}/{blocks} blocks in {load[best] * 1e3:.3f} ms + "
                  f"recompute {matched - best * block_tokens} tokens in {recompute[best] * 1e3:.3f} ms; "
                  f"all-load {load[-1] * 1e3:.3f} ms, all-recompute {recompute[0] * 1e3:.3f} ms; "
                  f"slowest path {slowest.path} {slowest.bytes_per_s / 1e9:.3f} GB/s "
                  f"({'measured' if slowest.measured else 'prior'})")
        return Decision(outcome, best, best * block_tokens, matched, float(load[best]),
                        float(recompute[best]), float(load[-1]), float(recompute[0]), reason)
