"""``kvstore bench cluster-sim`` at a tiny size: it runs through the CLI, churn included, and
its directory agrees with the synthetic daemons it was fed by."""

from __future__ import annotations

import json
import random
import subprocess
import sys

import msgspec

from kvstore import kv_events as ev
from kvstore.app.bench.cluster_sim import SimNode, Workload
from kvstore.cluster.directory import Directory
from kvstore.tier_kind import TierKind


def test_cluster_sim_runs_from_the_cli_with_churn():
    out = subprocess.run([sys.executable, "-m", "kvstore", "bench", "cluster-sim", "--nodes", "2,4", "--sim-s", "1",
                          "--restarts-per-node-hour", "20000", "--lookups", "10", "--json"],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    rows = json.loads(out)["rows"]
    assert [r["nodes"] for r in rows] == [2, 4]
    for r in rows:
        assert r["entries"] > 0 and r["bytes_per_entry"] > 0 and r["block_events_per_s"] > 0
        assert r["restarts"] > 0 and r["snapshot_us_per_entry"] is not None
        assert r["lookup_hit_blocks_mean"] > 0


def test_the_directory_fed_by_synthetic_nodes_is_exactly_their_state():
    rng = random.Random(3)
    encode, decode = msgspec.msgpack.Encoder().encode, ev.decoder().decode
    nodes = [SimNode(f"n{i}", 20, 60, rng) for i in range(3)]
    work = Workload(rng, prompts=2, prompt_blocks=4, turn_blocks=3, turns=3, live=5)
    d = Directory()
    handles = {n.node_id: d.add_node(n.node_id, 1) for n in nodes}
    for step in range(40):
        rng.choice(nodes).serve(work.next_chain())
        for n in nodes:
            out = n.batch(encode)
            if out:
                d.apply(handles[n.node_id], decode(out[1]).events)
        if step == 20:  # a warm restart: a new epoch, its snapshot
            n = nodes[1]
            d.drop_node(n.node_id)
            payload = n.restart(encode)
            handles[n.node_id] = d.add_node(n.node_id, n.epoch)
            d.apply(handles[n.node_id], decode(payload).events)
    for n in nodes:
        want = {k: 0 for k in [*n.dram, *n.nvme]}
        for k in n.dram:
            want[k] |= 1 << TierKind.DRAM
        for k in n.nvme:
            want[k] |= 1 << TierKind.NVME
        assert handles[n.node_id].held == want
