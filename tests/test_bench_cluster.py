"""`kvstore bench cluster --policy --routers` runs end to end on a tiny workload, pulls asking the
peers advertising the namespace, pulls directed by the cluster prefix directory, and requests
routed by round-robin, a hit-count router and the hint router (figures go in docs/cluster.md)."""

import json
import shutil
import subprocess
import sys

import pytest

from kvstore.app.bench.cluster import table


@pytest.mark.skipif(shutil.which("etcd") is None, reason="etcd is not installed (make sysdeps installs etcd-server)")
def test_bench_cluster_tiny():
    # 4 conversations over 3 daemons, round-robin: turn t of conversation c goes to daemon
    # (4t + c) mod 3, never the one of its previous turns, so alone nothing hits and with
    # pulls every earlier turn's tokens come from a peer.
    p = subprocess.run([sys.executable, "-m", "kvstore", "bench", "cluster", "--json", "--conversations", "4",
                        "--turns", "3", "--first-tokens", "32", "--turn-tokens", "32", "--layers", "2",
                        "--kv-heads", "2", "--head-dim", "64", "--policy", "--routers"], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr + p.stdout
    r = json.loads(p.stdout)
    alone, pulls = r["alone"], r["with_pulls"]
    assert (alone["requests"], alone["prompt_tokens"]) == (pulls["requests"], pulls["prompt_tokens"]) == (12, 768)
    assert (alone["local_hit_tokens"], alone["pulled_tokens"], alone["hit_rate"]) == (0, 0, 0.0)
    assert (pulls["local_hit_tokens"], pulls["pulled_tokens"], pulls["hit_rate"]) == (0, 4 * (32 + 64), 0.5)
    assert pulls["mean_recompute_s"] == pytest.approx(alone["mean_recompute_s"] / 2)
    assert r["time_to_kv_ratio"] == round(pulls["mean_time_to_kv_s"] / alone["mean_time_to_kv_s"], 4)
    assert "rows" not in alone
    # The second fleet publishes KV events: its pulls go where the cluster prefix directory
    # says the chain is, and find what the first fleet's pulls found by asking every peer.
    directed = r["with_directory"]
    assert (directed["requests"], directed["prompt_tokens"]) == (12, 768)
    assert (directed["local_hit_tokens"], directed["pulled_tokens"], directed["hit_rate"]) == (0, 4 * (32 + 64), 0.5)
    assert r["directory_time_to_kv_ratio"] == round(directed["mean_time_to_kv_s"] / alone["mean_time_to_kv_s"], 4)
    assert r["directory_skipped"] == "" and "w/ directory" in table(r)
    # Where pyzmq or msgspec is missing the bench runs without the second fleet and says why.
    without = dict(r, with_directory=None, directory_skipped="zmq not installed", directory_time_to_kv_ratio=None)
    assert "no run with the cluster prefix directory: zmq not installed" in table(without)
    assert "w/ directory" not in table(without)
    # By policy: Lookup's advice taken per request; the first turns (nothing anywhere) recompute,
    # and what was pulled is what the advice said to pull (the split depends on measured links).
    advised = r["with_policy"]
    assert advised["requests"] == sum(advised["choices"].values()) == 12 and advised["choices"]["recompute"] >= 4
    assert advised["pulled_tokens"] <= pulls["pulled_tokens"] and (advised["choices"]["pull"] or not advised["pulled_tokens"])
    # Routers on the directory fleet: the prefix-aware ones send each later turn to the daemon
    # holding the turn before (all of its tokens load from DRAM there); round-robin never does.
    # A turn may come before the daemon asked has the last one's events (10 ms batches): then it
    # goes round-robin, so at most a few of the 8 later turns miss.
    routers = r["routers"]
    assert set(routers) == {"round-robin", "hit-count", "hints"}
    assert all((x["requests"], x["prompt_tokens"]) == (12, 768) for x in routers.values())
    assert routers["round-robin"]["local_hit_tokens"] == 0 and routers["round-robin"]["mean_route_s"] == 0
    for name in ("hit-count", "hints"):
        assert 3 * (32 + 64) <= routers[name]["local_hit_tokens"] <= 4 * (32 + 64), name
        assert routers[name]["mean_route_s"] > 0
    assert r["routers_vs_round_robin"]["round-robin"] == 1.0 and "routers over the directory fleet" in table(r)
