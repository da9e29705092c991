"""Load-or-recompute policy: online bandwidth estimation, prefill cost model, decisions.

Transfers are synthetic (bytes, seconds) pairs and time comes from an injected clock, so every
expected figure is computed from the stated bandwidths, not measured.
"""

from __future__ import annotations

import enum
import math

import pytest

from kvstore.modelcfg import load_preset
from kvstore.policy import (BandwidthEstimator, LoadPolicy, LoadPolicyConfig, LoadChoice, PrefillCostModel,
                            normalize_path, runs_of)

MIB = 2**20
NO_LATENCY = {"hbm": (1e12, 0.0), "dram": (20e9, 0.0), "nvme": (3e9, 0.0), "remote": (5e9, 0.0)}


class FakeClock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def policy(clock: FakeClock | None = None, **cfg) -> LoadPolicy:
    """A policy whose paths start with zero latency and, unless asked, price each path alone
    (no DRAM hop under NVMe), so crossovers are exact functions of one measured bandwidth."""
    cfg = {"priors": NO_LATENCY, "lower_tiers_via_dram": False, **cfg}
    return LoadPolicy(LoadPolicyConfig(**cfg), clock=clock or FakeClock())


def per_block_cost(tokens_per_s: float) -> PrefillCostModel:
    """Linear-only cost: recompute takes tokens / tokens_per_s seconds."""
    return PrefillCostModel.calibrated(1.0, 0.0, tokens_per_s=tokens_per_s, ref_tokens=2048)


# -- bandwidth estimator ----------------------------------------------------------------------------

def test_prior_until_measured():
    est = BandwidthEstimator(clock=FakeClock())
    e = est.estimate("nvme")
    assert (e.bytes_per_s, e.latency_s, e.measured) == (3e9, 150e-6, False)
    assert est.estimate("peer:node-3").bytes_per_s == 5e9   # peers use the remote prior
    assert est.snapshot() == {}


def test_fit_separates_latency_and_bandwidth():
    est = BandwidthEstimator(clock=FakeClock())
    for n in (MIB, 4 * MIB, 16 * MIB, 2 * MIB):
        est.observe("dram", n, 50e-6 + n / 8e9)
    e = est.estimate("dram")
    assert e.measured
    assert e.bytes_per_s == pytest.approx(8e9, rel=1e-9)
    assert e.latency_s == pytest.approx(50e-6, rel=1e-6)
    assert e.seconds(8 * MIB, transfers=2) == pytest.approx(100e-6 + 8 * MIB / 8e9, rel=1e-9)


def test_one_size_predicts_that_size_exactly():
    est = BandwidthEstimator(clock=FakeClock())
    est.observe("dram", MIB, 1e-3)
    e = est.estimate("dram")
    assert e.latency_s == 20e-6                                 # the prior latency is kept
    assert e.bytes_per_s == pytest.approx(MIB / (1e-3 - 20e-6), rel=1e-12)
    assert e.seconds(MIB) == pytest.approx(1e-3, rel=1e-12)
    est.observe("nvme", MIB, 100e-6)                            # faster than the prior latency
    assert est.estimate("nvme").latency_s == 50e-6              # at most half a transfer


def test_negative_intercept_refits_through_origin():
    est = BandwidthEstimator(LoadPolicyConfig(alpha=0.2), clock=FakeClock())
    est.observe("nvme", 1_000_000, 1e-4)
    est.observe("nvme", 2_000_000, 3e-4)                        # line would cross below zero
    e = est.estimate("nvme")
    # Weights 0.8 and 1: sum w x^2 = 4.8e12, sum w x y = 680.
    assert e.latency_s == 0.0 and e.bytes_per_s == pytest.approx(4.8e12 / 680, rel=1e-12)


def test_moving_average_weights_the_newest_transfer_by_alpha():
    est = BandwidthEstimator(LoadPolicyConfig(alpha=0.2, priors=NO_LATENCY), clock=FakeClock())
    n = 1_000_000
    est.observe("dram", n, n / 10e9)
    est.observe("dram", n, n / 2e9)
    # Bytes over time with weights 0.8 (old) and 1 (new): 1.8 n / (0.8 n/10e9 + n/2e9).
    assert est.estimate("dram").bytes_per_s == pytest.approx(1.8 / (0.8 / 10e9 + 1 / 2e9), rel=1e-12)
    assert est.estimate("dram").weight == pytest.approx(1.8)


def test_old_measurements_fade_with_the_clock():
    clock = FakeClock()
    est = BandwidthEstimator(LoadPolicyConfig(alpha=0.2, half_life_s=60.0, priors=NO_LATENCY), clock=clock)
    n = 1_000_000
    est.observe("dram", n, n / 10e9)
    clock.advance(600.0)                                       # ten half-lives of silence
    est.observe("dram", n, n / 2e9)
    keep = 0.8 * 2.0**-10
    expected = (1 + keep) / (keep / 10e9 + 1 / 2e9)
    assert est.estimate("dram").bytes_per_s == pytest.approx(expected, rel=1e-12)
    assert abs(expected / 2e9 - 1) < 1e-2                      # the old 10 GB/s barely counts


def test_timed_uses_the_clock_and_skips_failed_transfers():
    clock = FakeClock()
    est = BandwidthEstimator(clock=clock)
    with est.timed("dram", 4 * MIB):
        clock.advance(1e-3)
    assert est.estimate("dram").seconds(4 * MIB) == pytest.approx(1e-3, rel=1e-12)
    with pytest.raises(RuntimeError):
        with est.timed("nvme", MIB):
            clock.advance(5.0)
            raise RuntimeError("read failed")
    assert not est.estimate("nvme").measured
    with est.timed("hbm", MIB):
        pass                                                   # zero elapsed: not a sample
    assert list(est.snapshot()) == ["dram"]


def test_bad_observations_name_the_field():
    est = BandwidthEstimator(clock=FakeClock())
    for nbytes in (0, -5, 1.5, True):
        with pytest.raises(ValueError, match=r"^nbytes: must be a positive integer"):
            est.observe("dram", nbytes, 1e-3)
    for seconds in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match=r"^seconds: must be a finite number > 0"):
            est.observe("dram", MIB, seconds)
    with pytest.raises(ValueError, match=r"^path: unknown transfer path 'disk'"):
        est.observe("disk", MIB, 1e-3)


def test_paths():
    class Tier(enum.IntEnum):
        DRAM = 2
        NVME = 3

    assert normalize_path("DRAM") == "dram" and normalize_path(Tier.NVME) == "nvme"
    assert normalize_path("peer:node-3") == "peer:node-3"
    for bad in ("peer:", "", 3, None):
        with pytest.raises(ValueError, match=r"^path: "):
            normalize_path(bad)
    assert runs_of(["dram", "dram", Tier.NVME, "dram"]) == [("dram", 2), ("nvme", 1), ("dram", 1)]


def test_bad_config_names_the_field():
    for kw, field in ((dict(alpha=0.0), "alpha"), (dict(half_life_s=0.0), "half_life_s"),
                      (dict(max_blocks_per_transfer=-1), "max_blocks_per_transfer"),
                      (dict(default_prefill_flops_per_s=0.0), "default_prefill_flops_per_s"),
                      (dict(priors={"dram": (0.0, 0.0)}), r"priors\['dram'\]")):
        with pytest.raises(ValueError, match=rf"^{field}: "):
            LoadPolicyConfig(**kw)


# -- prefill cost model --------------------------------------------------------------------------------

def test_cost_model_terms_and_calibration():
    m = load_preset("llama-3-70b")
    cost = PrefillCostModel.for_model(m, tokens_per_s=5000.0, ref_tokens=2048)
    a, c = 136_904_720_384, 2_621_440
    assert (cost.linear_flops_per_token, cost.attn_flops_per_pair) == (a, c)
    assert cost.flops(0, 4) == 4 * a + 10 * c                 # 4 tokens: 1+2+3+4 causal pairs
    assert cost.flops(2, 4) == 2 * a + 7 * c                  # tokens 2, 3 attend to 3 and 4 keys
    assert cost.seconds(0, 2048) == pytest.approx(2048 / 5000, rel=1e-12)
    assert cost.tokens_per_s(2048) == pytest.approx(5000.0, rel=1e-12)
    assert cost.seconds(0, 1000) + cost.seconds(1000, 3000) == pytest.approx(cost.seconds(0, 3000), rel=1e-12)
    # The quadratic term makes long prompts slower per token than the calibration point.
    assert cost.tokens_per_s(32768) < 5000.0 < cost.tokens_per_s(512)
    default = PrefillCostModel.for_model(m)
    assert default.flops_per_s == LoadPolicyConfig().default_prefill_flops_per_s


def test_cost_model_from_layout_only():
    m = load_preset("llama-3-70b")
    lay = m.layout("bf16")
    linear = PrefillCostModel.for_layout(lay, params=0, tokens_per_s=8000.0)
    assert linear.seconds(0, 1000) == pytest.approx(1000 / 8000, rel=1e-12)
    est = PrefillCostModel.for_layout(lay, params=m.params(), tokens_per_s=5000.0, ref_tokens=2048)
    full = PrefillCostModel.for_model(m, tokens_per_s=5000.0, ref_tokens=2048)
    assert est.attn_flops_per_pair == pytest.approx(4 * 80 * math.sqrt(m.params() / (12 * 80)), rel=1e-12)
    assert est.seconds(0, 2048) == pytest.approx(2048 / 5000, rel=1e-12)
    assert abs(est.seconds(0, 8192) / full.seconds(0, 8192) - 1) < 5e-3


def test_cost_model_bad_input():
    with pytest.raises(ValueError, match=r"^linear_flops_per_token: must be > 0"):
        PrefillCostModel(0.0, 1.0, 1e12)
    with pytest.raises(ValueError, match=r"^tokens_per_s: must be > 0"):
        PrefillCostModel.calibrated(1.0, 0.0, tokens_per_s=0.0, ref_tokens=2048)
    with pytest.raises(ValueError, match=r"^ref_tokens: must be a positive integer"):
        PrefillCostModel.calibrated(1.0, 0.0, tokens_per_s=100.0, ref_tokens=0)
    with pytest.raises(ValueError, match=r"^start, end: need 0 <= start <= end"):
        per_block_cost(100.0).flops(5, 3)


# -- decisions -------------------------------------------------------------------------------------------

def test_decision_flips_at_the_bandwidth_crossover():
    # Recomputing a 16-token block at 10,000 tokens/s takes 1.6 ms, so a 1 MiB block loads
    # faster exactly when the path beats 1 MiB / 1.6 ms = 655,360,000 B/s.
    cost = per_block_cost(10_000.0)
    crossover = MIB / (16 / 10_000)
    assert crossover == 655_360_000.0
    answers = {}
    for factor in (0.999, 1.001):
        p = policy()
        p.observe("nvme", MIB, MIB / (crossover * factor))
        answers[factor] = p.decide([("nvme", 8)], block_tokens=16, block_bytes=MIB, cost=cost)
    slow, fast = answers[0.999], answers[1.001]
    assert (slow.outcome, slow.load_blocks, slow.load_tokens) == (LoadChoice.RECOMPUTE, 0, 0)
    assert (fast.outcome, fast.load_blocks, fast.load_tokens) == (LoadChoice.LOAD, 8, 128)
    assert fast.load_s == pytest.approx(8 * 16 / 10_000 / 1.001, rel=1e-9)
    assert fast.recompute_s == 0.0 and fast.all_recompute_s == pytest.approx(128 / 10_000, rel=1e-12)
    assert slow.recompute_s == pytest.approx(128 / 10_000, rel=1e-12) and slow.load_s == 0.0
    assert "measured" in slow.reason and "nvme" in slow.reason


def test_decision_flips_at_the_prefix_length_crossover():
    # Per token, loading (65,536 B at 0.5 GB/s = 131 us) costs more than the linear recompute
    # term (100 us), but the attention term grows with the prefix: loading wins from the
    # smallest B with B * bb / bw <= F(16 B) / R, i.e. B >= (bb R / bw - 16 a - 8 c) / (128 c).
    a, c, rate, bw = 1e9, 1e6, 1e13, 0.5e9
    cost = PrefillCostModel(a, c, rate)
    b_star = math.ceil((MIB * rate / bw - 16 * a - 8 * c) / (128 * c))
    assert b_star == 39
    p = policy()
    p.observe("nvme", MIB, MIB / bw)
    below = p.decide({"nvme": b_star - 1}, block_tokens=16, block_bytes=MIB, cost=cost)
    at = p.decide({"nvme": b_star}, block_tokens=16, block_bytes=MIB, cost=cost)
    assert (below.outcome, below.load_blocks) == (LoadChoice.RECOMPUTE, 0)
    assert (at.outcome, at.load_blocks, at.matched_tokens) == (LoadChoice.LOAD, 39, 624)
    assert at.all_load_s <= at.all_recompute_s and below.all_load_s > below.all_recompute_s


def test_degrading_a_tier_moves_the_answer_toward_recompute():
    clock = FakeClock()
    p = policy(clock)
    cost = per_block_cost(10_000.0)                      # crossover 655.36 MB/s per 1 MiB block
    runs = [("dram", 32), ("nvme", 32)]
    p.observe("dram", MIB, MIB / 10e9)
    p.observe("nvme", MIB, MIB / 5e9)
    first = p.decide(runs, block_tokens=16, block_bytes=MIB, cost=cost)
    assert (first.outcome, first.load_blocks) == (LoadChoice.LOAD, 64)
    loads = []
    for _ in range(20):                                  # NVMe degrades to 0.5 GB/s
        clock.advance(1.0)
        p.observe("nvme", MIB, MIB / 0.5e9)
        loads.append(p.decide(runs, block_tokens=16, block_bytes=MIB, cost=cost).load_blocks)
    assert loads == sorted(loads, reverse=True) and loads[0] == 64 and loads[-1] == 32
    partial = p.decide(runs, block_tokens=16, block_bytes=MIB, cost=cost)
    assert partial.outcome is LoadChoice.PARTIAL and partial.load_tokens == 512
    assert partial.load_s == pytest.approx(32 * MIB / 10e9, rel=1e-9)
    assert partial.recompute_s == pytest.approx(512 / 10_000, rel=1e-12)
    for _ in range(20):                                  # then DRAM degrades to 0.3 GB/s
        clock.advance(1.0)
        p.observe("dram", MIB, MIB / 0.3e9)
    last = p.decide(runs, block_tokens=16, block_bytes=MIB, cost=cost)
    assert (last.outcome, last.load_blocks) == (LoadChoice.RECOMPUTE, 0)
    assert last.all_load_s > partial.all_load_s > first.all_load_s
    assert p.counts[LoadChoice.LOAD] >= 1 and p.counts[LoadChoice.PARTIAL] >= 1 and p.counts[LoadChoice.RECOMPUTE] == 1
    assert sum(p.counts.values()) == 23


def test_per_transfer_latency_is_paid_per_transfer():
    p = policy(max_blocks_per_transfer=4)
    p.observe("nvme", 1_000_000, 1e-3 + 1_000_000 / 1e9)
    p.observe("nvme", 4_000_000, 1e-3 + 4_000_000 / 1e9)   # latency 1 ms, 1 GB/s
    d = p.decide([("nvme", 10)], block_tokens=16, block_bytes=1_000_000, cost=per_block_cost(100.0))
    assert d.all_load_s == pytest.approx(3 * 1e-3 + 10 * 1e-3, rel=1e-9)  # ceil(10 / 4) transfers


def test_nvme_and_peer_blocks_pay_the_dram_hop():
    p = policy(lower_tiers_via_dram=True)
    p.observe("dram", MIB, MIB / 20e9)
    p.observe("nvme", MIB, MIB / 4e9)
    p.observe("peer:node-2", MIB, MIB / 10e9)
    d = p.decide([("dram", 2), ("nvme", 3), ("peer:node-2", 1)], block_tokens=16, block_bytes=MIB,
                 cost=per_block_cost(100.0))
    expected = 2 * MIB / 20e9 + 3 * (MIB / 4e9 + MIB / 20e9) + (MIB / 10e9 + MIB / 20e9)
    assert d.all_load_s == pytest.approx(expected, rel=1e-12)
    assert "slowest path nvme 4.000 GB/s (measured)" in d.reason


def test_ties_go_to_loading():
    # Powers of two keep every sum exact: each block loads in 2^-10 s and recomputes in 2^-10 s.
    p = policy()
    p.observe("dram", MIB, 2.0**-10)
    d = p.decide([("dram", 8)], block_tokens=16, block_bytes=MIB, cost=per_block_cost(16_384.0))
    assert d.all_load_s == d.all_recompute_s == 8 * 2.0**-10
    assert (d.outcome, d.load_blocks) == (LoadChoice.LOAD, 8)


def test_the_split_is_the_cheapest_of_every_split_with_quadratic_attention():
    """Against every split j priced on its own (the path estimates' seconds for the first j
    blocks, transfers opened by run and by max_blocks_per_transfer, plus the cost model's
    seconds for the rest): the decision is the cheapest, the last of equals."""
    import random

    rnd = random.Random(7)
    for _ in range(300):
        per_transfer = rnd.choice([0, 1, 3])
        p = LoadPolicy(LoadPolicyConfig(max_blocks_per_transfer=per_transfer), clock=FakeClock())
        runs = [(rnd.choice(["dram", "nvme", "peer:n"]), rnd.randrange(0, 9)) for _ in range(rnd.randrange(1, 4))]
        bt, bb = rnd.choice([16, 32]), rnd.choice([4096, MIB, 64 * MIB])
        cost = PrefillCostModel.calibrated(rnd.choice([1e6, 1e9]), rnd.choice([0.0, 1e3, 1e6]),
                                           tokens_per_s=rnd.choice([500.0, 20_000.0]), ref_tokens=2048)
        d = p.decide(runs, block_tokens=bt, block_bytes=bb, cost=cost)
        blocks = sum(n for _, n in runs)
        seconds = []
        for path, n in runs:
            hops = [path] + (["dram"] if path != "dram" else [])
            for k in range(n):
                opens = k % per_transfer == 0 if per_transfer else k == 0
                seconds.append(sum(p.bandwidth.estimate(h).seconds(bb, transfers=int(opens)) for h in hops))
        totals = [sum(seconds[:j]) + cost.seconds(j * bt, blocks * bt) for j in range(blocks + 1)]
        if not blocks:
            assert d.outcome is LoadChoice.NONE
            continue
        best = max(j for j, t in enumerate(totals) if t <= min(totals) * (1 + 1e-9))
        assert d.load_s + d.recompute_s == pytest.approx(min(totals), rel=1e-9)
        assert d.load_blocks == best or totals[d.load_blocks] == pytest.approx(min(totals), rel=1e-9)
        assert d.all_load_s == pytest.approx(sum(seconds), rel=1e-9)
        assert d.all_recompute_s == pytest.approx(totals[0], rel=1e-9)


def test_both_ways_of_pricing_the_splits_give_the_same_floats():
    """``splits`` prices short prefixes in plain Python and long ones in numpy: the same float
    operations in the same order, so the same figures to the bit and the same choice."""
    import random

    from kvstore.policy import _splits_np, _splits_py

    rnd = random.Random(11)
    for _ in range(200):
        k = rnd.randrange(1, 4)
        counts = [rnd.randrange(0, 400) for _ in range(k)]
        per_block = [rnd.choice([1e-6, 3.3e-5, 2.0**-10]) * rnd.random() for _ in range(k)]
        latency = [rnd.choice([0.0, 1e-4, 7e-6]) for _ in range(k)]
        cost = PrefillCostModel.calibrated(rnd.choice([1e6, 1e9]), rnd.choice([0.0, 1e3, 1e6]),
                                           tokens_per_s=rnd.choice([500.0, 20_000.0]), ref_tokens=2048)
        args = (counts, per_block, latency, rnd.choice([0, 1, 3, 64]), rnd.choice([16, 32]), cost)
        (lp, rp, bp), (ln, rn, bn) = _splits_py(*args), _splits_np(*args)
        assert lp == ln.tolist() and rp == rn.tolist() and bp == bn


def test_nothing_matched_is_a_normal_answer():
    p = policy()
    for runs in ([], {"dram": 0}):
        d = p.decide(runs, block_tokens=16, block_bytes=MIB, cost=per_block_cost(100.0))
        assert (d.outcome, d.load_blocks, d.matched_tokens, d.all_recompute_s) == (LoadChoice.NONE, 0, 0, 0.0)
    assert p.counts[LoadChoice.NONE] == 2


def test_bad_decide_input_names_the_field():
    p = policy()
    cost = per_block_cost(100.0)
    with pytest.raises(ValueError, match=r"^block_bytes: must be a positive integer, got 0"):
        p.decide([("dram", 1)], block_tokens=16, block_bytes=0, cost=cost)
    with pytest.raises(ValueError, match=r"^block_tokens: must be a positive integer, got -16"):
        p.decide([("dram", 1)], block_tokens=-16, block_bytes=MIB, cost=cost)
    with pytest.raises(ValueError, match=r"^runs: block count for 'dram' must be an integer >= 0, got -1"):
        p.decide([("dram", -1)], block_tokens=16, block_bytes=MIB, cost=cost)
    with pytest.raises(ValueError, match=r"^path: unknown transfer path 'ssd'"):
        p.decide([("ssd", 1)], block_tokens=16, block_bytes=MIB, cost=cost)
    assert sum(p.counts.values()) == 0
