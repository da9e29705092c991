"""``kvstore bench cluster-sim`` at a tiny size: it runs through the CLI with both backends,
churn included; the replica agrees with the synthetic daemons it was fed by, and so does a
Redis directory's own map fed their block changes as a core reports them."""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys

import msgspec
import pytest

from kvstore import kv_events as ev
from kvstore.app.bench.cluster_sim import SimNode, Workload
from kvstore.app.bench.cluster_sim_redis import Change, Feeds, rebuild_own
from kvstore.app.bench.redis_cluster import server_binaries
from kvstore.cluster.directory import Directory
from kvstore.tier_kind import TierKind


def held_bits(n: SimNode) -> dict[bytes, int]:
    want = {k: 0 for k in [*n.dram, *n.nvme]}
    for k in n.dram:
        want[k] |= 1 << TierKind.DRAM
    for k in n.nvme:
        want[k] |= 1 << TierKind.NVME
    return want


def test_cluster_sim_runs_both_backends_from_the_cli_with_churn():
    both = server_binaries() is not None and shutil.which("etcd") is not None
    if not both:
        pytest.skip("the redis backend needs redis-server and etcd (make sysdeps)")
    # small caches, so that every node fills them at both node counts: a daemon's memory for
    # the Redis directory is its own blocks', whatever the fleet's size
    out = subprocess.run([sys.executable, "-m", "kvstore", "bench", "cluster-sim", "--nodes", "2,4", "--sim-s", "1",
                          "--restarts-per-node-hour", "5000", "--lookups", "10", "--dram-blocks", "64",
                          "--nvme-blocks", "128", "--redis-writers", "2", "--redis-memory-nodes", "2",
                          "--lookup-rpcs", "10", "--lookup-blocks", "8", "--lookup-chains", "1", "--json"],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    r = json.loads(out)
    rows, redis_rows = r["rows"], r["redis_rows"]
    assert [x["nodes"] for x in rows] == [x["nodes"] for x in redis_rows] == [2, 4]
    for x in rows:
        assert x["entries"] > 0 and x["bytes_per_entry"] > 0 and x["block_events_per_s"] > 0
        assert x["restarts"] > 0 and x["snapshot_us_per_entry"] is not None
        assert x["lookup_hit_blocks_mean"] > 0
    for x in redis_rows:
        assert x["writers"] == 2 and 0 < x["own_blocks"] <= 64 + 128 and x["bytes_per_own_block"] > 0
        assert x["block_events_per_node_s"] > 0 and x["writer_us_per_block_event"] > 0
        assert x["store_cmds"] > 0 and sum(x["store_cmds_by_shard"]) >= x["store_cmds"]
        assert x["store_entries"] > 0 and x["store_bytes_per_entry"] > 0 and x["store_fields_per_hash"] >= 1
        assert x["replica_cores"] == next(y["directory_cores"] for y in rows if y["nodes"] == x["nodes"])
    # the replica grows with the fleet; a daemon's part of the Redis directory does not
    assert rows[1]["entries"] > rows[0]["entries"]
    assert redis_rows[1]["daemon_bytes"] <= 1.25 * redis_rows[0]["daemon_bytes"]
    assert redis_rows[1]["memory_vs_replica"] < redis_rows[0]["memory_vs_replica"]
    # each asker's Lookup names the holder for the whole chain, every time
    lk = r["remote_lookup"]
    assert lk["chain_blocks"] == 8 and lk["rpcs"] == 10 and lk["raw_us"]["median"] > 0
    for b in ("replica", "redis"):
        assert lk[b]["named_holder"] == 1.0 and lk[b]["remote_us"]["median"] > 0 and lk[b]["miss_us"]["median"] > 0
    assert lk["redis_vs_replica"] > 0
    assert lk["store_cmds_per_read"] >= 1 + 8 - 0.5  # the script, and its HGETALL of each block
    s = r["store_shards"]
    assert s["fleet_nodes"] == 1024 and s["shards"] == max(s["by_cpu"], s["by_memory"], 1) and s["reads_counted"]


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
        assert handles[n.node_id].held == held_bits(n)


def test_a_redis_directory_fed_a_nodes_block_changes_holds_exactly_its_blocks():
    rng = random.Random(5)
    encode = msgspec.msgpack.Encoder().encode
    nodes = [SimNode(f"n{i}", 20, 60, rng) for i in range(3)]
    work = Workload(rng, prompts=2, prompt_blocks=4, turn_blocks=3, turns=3, live=5)
    feeds = Feeds(nodes, writers=2, seed=1)
    for step in range(40):
        rng.choice(nodes).serve(work.next_chain())
        batches = [(n, out[1]) for n in nodes if (out := n.batch(encode))]
        restarts = [(n, n.restart(encode)) for n in nodes[:2]] if step == 20 else []  # warm: NVMe kept
        feeds.tick(batches, restarts)
    assert len(feeds.names) == 2 and any(op[0] is Change.RESTART for j in range(2) for op in feeds.of(j))
    for j, name in enumerate(feeds.names):
        n = next(x for x in nodes if x.node_id == name)
        size, own = rebuild_own(feeds.of(j))
        assert {k: bits for k, (_, bits, _) in own.items()} == held_bits(n)
        assert size > len(own) * 32  # the keys at least
