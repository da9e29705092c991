"""choose_source: load the local prefix, pull a peer's extension, or recompute (pure; no daemon)."""

from __future__ import annotations

import math

import pytest

from kvstore.policy import LoadPolicy, LoadPolicyConfig, PathEstimate, PrefillCostModel
from kvstore.source_policy import LinkEstimator, RemoteHit, SourceChoice, choose_source

BT, BB = 16, 1 << 20  # tokens and bytes per block
COST = PrefillCostModel.calibrated(1.0, 0.0, tokens_per_s=10_000.0, ref_tokens=2048)  # 1.6 ms a block


def decide(local_runs, remotes, *, link=(10e9, 100e-6), nvme=(3e9, 150e-6)):
    policy = LoadPolicy(LoadPolicyConfig(priors={"hbm": (1e12, 1e-5), "dram": (20e9, 20e-6),
                                                 "nvme": nvme, "remote": (5e9, 1e-4)}))
    local = policy.decide(local_runs, block_tokens=BT, block_bytes=BB, cost=COST)
    links = link if isinstance(link, dict) else {}

    def link_of(peer):
        bw, rtt = links.get(peer, link if not isinstance(link, dict) else (1e9, 1e-3))
        return PathEstimate(f"peer:{peer}", bw, rtt, True, 1.0)

    return choose_source(local, remotes, block_tokens=BT, block_bytes=BB, cost=COST, link=link_of,
                         tier=policy.bandwidth.estimate)


def test_fast_link_pulls_the_extension():
    d = decide([("dram", 4)], [RemoteHit("b", 3, 20)])
    assert d.choice is SourceChoice.PULL and d.remote.peer == "b"
    assert d.pull_total_s < d.load_total_s < d.recompute_total_s


def test_slow_link_recomputes_the_extension_but_loads_the_local_prefix():
    d = decide([("dram", 4)], [RemoteHit("b", 3, 20)], link=(50e6, 1e-3))  # 50 MB/s: 21 ms a block
    assert d.choice is SourceChoice.LOAD and d.local.load_blocks == 4
    assert d.load_total_s < d.pull_total_s


def test_slow_link_and_nothing_local_recomputes():
    d = decide([], [RemoteHit("b", 3, 20)], link=(50e6, 1e-3))
    assert d.choice is SourceChoice.RECOMPUTE and d.remote.peer == "b"
    assert d.recompute_total_s < d.pull_total_s


def test_latency_dominates_a_tiny_extension():
    # One block to gain (1.6 ms to recompute) over a fast link with a 5 ms round trip.
    d = decide([], [RemoteHit("b", 3, 1)], link=(100e9, 5e-3))
    assert d.choice is SourceChoice.RECOMPUTE
    big = decide([], [RemoteHit("b", 3, 64)], link=(100e9, 5e-3))
    assert big.choice is SourceChoice.PULL  # the same link pays off for a long one


def test_peer_dram_beats_peer_nvme_and_a_longer_offer_wins_when_it_pays():
    d = decide([("dram", 2)], [RemoteHit("slow-disk", 1, 20, "nvme"), RemoteHit("ram", 2, 20, "dram")],
               nvme=(200e6, 1e-3))
    assert d.choice is SourceChoice.PULL and d.remote.peer == "ram"
    d = decide([("dram", 2)], [RemoteHit("short", 1, 4), RemoteHit("long", 2, 30)])
    assert d.remote.peer == "long"


def test_slow_local_nvme_prefix_makes_the_pull_useless():
    # A pull needs the whole local prefix first; read off a 100 MB/s disk, recomputing is faster.
    slow = decide([("nvme", 30)], [RemoteHit("b", 3, 2)], nvme=(100e6, 1e-3))
    assert slow.local.load_blocks == 0 and slow.choice is SourceChoice.RECOMPUTE
    fast = decide([("nvme", 30)], [RemoteHit("b", 3, 2)], nvme=(6e9, 100e-6))
    assert fast.choice is SourceChoice.PULL


def test_no_remote_offer_is_the_local_decision():
    d = decide([("dram", 8)], [])
    assert d.choice is SourceChoice.LOAD and d.remote is None and math.isinf(d.pull_total_s)
    assert decide([], []).choice is SourceChoice.RECOMPUTE


def test_link_estimator_prior_then_moving_averages():
    e = LinkEstimator(1.25e9, 5e-4, alpha=0.5)
    assert e.estimate("b") == PathEstimate("peer:b", 1.25e9, 5e-4, False, 0.0)
    e.rtt("b", 1e-3)
    assert e.estimate("b").latency_s == pytest.approx(1e-3)  # the first sample replaces the prior
    e.rtt("b", 3e-3)
    assert e.estimate("b").latency_s == pytest.approx(2e-3)
    e.pull("b", 10 << 20, 2e-3 + (10 << 20) / 1e9)           # 1 GB/s once the round trip is off
    est = e.estimate("b")
    assert est.measured and est.bytes_per_s == pytest.approx(1e9)
    e.pull("b", 10 << 20, 2e-3 + (10 << 20) / 3e9)
    assert e.estimate("b").bytes_per_s == pytest.approx(2e9)
    e.pull("b", 1, 1e-3)  # a pull quicker than the round trip: capped, never negative or infinite
    assert 0 < e.estimate("b").bytes_per_s < math.inf
    assert set(e.snapshot()) == {"b"} and e.snapshot()["b"][1] == 2
    with pytest.raises(ValueError):
        LinkEstimator(0, 1e-3)
