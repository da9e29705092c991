"""``kvstore bench cluster-sim``: the cluster prefix directory for 8 to 1,024 nodes under churn,
fed by many synthetic daemons in-process: the replica every daemon holds (``--backend
replica``), the Redis cluster each daemon writes its own blocks to (``--backend redis``), or
both from the same simulated fleet in one run (the default).

Each synthetic daemon serves multi-turn conversations that share system prompts, routed to a
random node (no prefix-aware routing: the most copies of a prefix), keeps an LRU DRAM tier that
demotes into an LRU NVMe tier, and publishes what a real daemon publishes: ``BlockStored`` (with
token ids) into CPU, ``BlockStored`` STORAGE plus ``BlockRemoved`` CPU on demotion,
``BlockRemoved`` STORAGE on NVMe eviction, one msgpack batch per node and tick, encoded with the
same structs as :mod:`kvstore.daemon.events`. Churn: a node restarts (its DRAM lost, its NVMe
kept, as a warm restart does) at ``--restarts-per-node-hour``; the directory drops it, takes the
new epoch and applies its snapshot.

Replica, per node count: directory entries and distinct blocks; bytes per entry (tracemalloc,
over the final state rebuilt alone); decode + apply cost per block event (the directory's
thread), and its ratio to the same run's raw path, decode + one plain dict store per block
event; lookup cost for a conversation's chain; cost of dropping a node and applying a
snapshot, per entry. Then, for the per-node rate and capacity given, the event rate one daemon
must absorb, the cores that takes, and the directory's memory at full capacity.

Redis (:mod:`.cluster_sim_redis`): a daemon's memory and CPU for its part of the directory, and
the store's commands, CPU and memory per entry, measured with real directory writers on a
local redis-server cluster; the store's shard count for ``--fleet-nodes``. Both backends: the
Lookup RPC with a remote hit through real daemons (:mod:`.cluster_sim_lookup`) against a raw
Lookup. Times are this machine's: they are ratios of the same run's own work, not a target.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
import tracemalloc
from collections import OrderedDict
from pathlib import Path

import msgspec

from kvstore import kv_events as ev
from kvstore.app.bench.cluster_sim_lookup import lookup_table, remote_lookup
from kvstore.app.bench.cluster_sim_redis import (BLOCK_TOKENS, TICK_S, Feeds, StoreMeter, redis_row, redis_table,
                                                 shard_count, shard_line)
from kvstore.app.bench.redis_cluster import LocalRedisCluster, server_binaries
from kvstore.cluster.directory import Directory


class SimNode:
    """A synthetic daemon: DRAM and NVMe LRUs of block keys, and its pending events."""

    def __init__(self, node_id: str, dram_blocks: int, nvme_blocks: int, rng: random.Random) -> None:
        self.node_id, self.epoch = node_id, 1
        self.dram: OrderedDict[bytes, None] = OrderedDict()
        self.nvme: OrderedDict[bytes, None] = OrderedDict()
        self.dram_cap, self.nvme_cap = dram_blocks, nvme_blocks
        self.events: list = []
        self.seq = 0
        self.rng = rng

    def serve(self, chain: list[bytes]) -> None:
        """A request over ``chain``: blocks not in DRAM are stored (computed, or promoted)."""
        new = []
        for k in chain:
            if k in self.dram:
                self.dram.move_to_end(k)
            else:
                self.dram[k] = None
                new.append(k)
        if new:
            parent = None if new[0] == chain[0] else chain[chain.index(new[0]) - 1]
            tokens = [self.rng.getrandbits(31).to_bytes(4, "little") * BLOCK_TOKENS for _ in new]
            items = [(k, parent if i == 0 else new[i - 1], tokens[i], BLOCK_TOKENS, "") for i, k in enumerate(new)]
            self.events.extend(ev.stored_events(items, ev.MEDIUM_CPU))
        demoted, dropped_dram, dropped_nvme = [], [], []
        while len(self.dram) > self.dram_cap:
            k, _ = self.dram.popitem(last=False)
            dropped_dram.append(k)
            if k in self.nvme:
                self.nvme.move_to_end(k)
            else:
                self.nvme[k] = None
                demoted.append(k)
        while len(self.nvme) > self.nvme_cap:
            dropped_nvme.append(self.nvme.popitem(last=False)[0])
        if demoted:
            self.events.extend(ev.stored_events([(k, None, None, BLOCK_TOKENS, "") for k in demoted], ev.MEDIUM_STORAGE))
        if dropped_dram:
            self.events.append(ev.removed_event(dropped_dram, ev.MEDIUM_CPU))
        if dropped_nvme:
            self.events.append(ev.removed_event(dropped_nvme, ev.MEDIUM_STORAGE))

    def batch(self, encode) -> tuple[int, bytes] | None:
        if not self.events:
            return None
        payload = encode(ev.KVEventBatch(ts=time.time(), events=self.events))
        self.events = []
        self.seq += 1
        return self.seq - 1, payload

    def restart(self, encode) -> bytes:
        """Warm restart: DRAM is lost, NVMe kept; returns its snapshot's payload."""
        self.epoch += 1
        self.dram.clear()
        self.events = []
        events = [ev.AllBlocksCleared(), *ev.stored_events([(k, None, None, BLOCK_TOKENS, "") for k in self.nvme],
                                                           ev.MEDIUM_STORAGE)]
        return encode(ev.KVEventBatch(ts=time.time(), events=events))


class Workload:
    """Conversations over shared system prompts: each request is the conversation so far plus
    one new turn."""

    def __init__(self, rng: random.Random, prompts: int, prompt_blocks: int, turn_blocks: int, turns: int,
                 live: int) -> None:
        self.rng = rng
        self.prompts = [[rng.randbytes(32) for _ in range(prompt_blocks)] for _ in range(prompts)]
        self.turn_blocks, self.turns = turn_blocks, turns
        self.live = [self._new() for _ in range(live)]

    def _new(self) -> list:
        return [list(self.rng.choice(self.prompts)), 0]

    def next_chain(self) -> list[bytes]:
        i = self.rng.randrange(len(self.live))
        conv = self.live[i]
        conv[0] = conv[0] + [self.rng.randbytes(32) for _ in range(self.turn_blocks)]
        conv[1] += 1
        chain = conv[0]
        if conv[1] >= self.turns:
            self.live[i] = self._new()
        return chain


def block_events(payload_batches) -> int:
    return sum(len(e.block_hashes) for b in payload_batches for e in b.events if hasattr(e, "block_hashes"))


class SimFleet:
    """``n_nodes`` synthetic daemons under the workload, with the seed of that node count: every
    backend measured in a run sees the same requests, events and restarts."""

    def __init__(self, n_nodes: int, a) -> None:
        self.a = a
        self.rng = random.Random(a.seed + n_nodes)
        self.encode = msgspec.msgpack.Encoder().encode
        self.nodes = [SimNode(f"n{i}", a.dram_blocks, a.nvme_blocks, self.rng) for i in range(n_nodes)]
        self.work = Workload(self.rng, a.prompts, a.prompt_blocks, a.turn_blocks, a.turns, live=max(64, 8 * n_nodes))

    def ticks(self):
        """Per tick of :data:`TICK_S`: ``(batches, restarts)``, each node's batch payload (if it
        has events) and then the nodes that restarted (warm) with their snapshot payloads."""
        a, rng, nodes = self.a, self.rng, self.nodes
        per_tick = a.requests_per_node_s * TICK_S
        restart_p = a.restarts_per_node_hour * TICK_S / 3600
        carry = 0.0
        for _ in range(int(a.sim_s / TICK_S)):
            carry += per_tick * len(nodes)
            for _ in range(int(carry)):
                rng.choice(nodes).serve(self.work.next_chain())
            carry -= int(carry)
            batches = [(n, out[1]) for n in nodes if (out := n.batch(self.encode)) is not None]
            restarts = [(n, n.restart(self.encode)) for n in nodes if rng.random() < restart_p]
            yield batches, restarts


class ReplicaSim:
    """One daemon's replica directory (:class:`Directory`) fed every node's batches, timed."""

    def __init__(self, fleet: SimFleet) -> None:
        self.decode = ev.decoder().decode
        self.d = Directory()
        self.handles = {n.node_id: self.d.add_node(n.node_id, n.epoch) for n in fleet.nodes}
        self.apply_s = self.ref_s = self.drop_s = self.snap_s = 0.0
        self.applied = self.restarts = self.dropped_entries = self.snap_entries = 0
        self.raw: dict[bytes, int] = {}

    def tick(self, batches, restarts) -> None:
        d, decode, raw = self.d, self.decode, self.raw
        for n, payload in batches:
            t0 = time.perf_counter()
            batch = decode(payload)
            t1 = time.perf_counter()
            d.apply(self.handles[n.node_id], batch.events)
            t2 = time.perf_counter()
            for e in batch.events:  # the reference: one plain dict store or pop per block event
                if isinstance(e, ev.BlockStored):
                    for k in e.block_hashes:
                        raw[k] = 1
                elif isinstance(e, ev.BlockRemoved):
                    for k in e.block_hashes:
                        raw.pop(k, None)
            self.ref_s += (t1 - t0) + (time.perf_counter() - t2)
            self.apply_s += t2 - t0
            self.applied += block_events([batch])
        for n, payload in restarts:
            self.restarts += 1
            entries = len(self.handles[n.node_id].held)
            t0 = time.perf_counter()
            d.drop_node(n.node_id)
            self.drop_s += time.perf_counter() - t0
            self.dropped_entries += entries
            t0 = time.perf_counter()
            h = self.handles[n.node_id] = d.add_node(n.node_id, n.epoch)
            d.apply(h, decode(payload).events)
            self.snap_s += time.perf_counter() - t0
            self.snap_entries += len(h.held)

    def row(self, fleet: SimFleet) -> dict:
        a, d, n_nodes = fleet.a, self.d, len(fleet.nodes)
        # Lookups: chains of conversations under way, as a router or a missing daemon asks.
        chains = [c[0] for c in fleet.work.live[:a.lookups]] or [fleet.work.prompts[0]]
        times, hits, holders = [], [], []
        for c in chains:
            t0 = time.perf_counter()
            r = d.longest_prefix(b"", c)
            times.append(time.perf_counter() - t0)
            hits.append(max((h.n_blocks for h in r), default=0))
            holders.append(len({h.node_id for h in r}))
        entries, blocks = d.entries(), d.blocks()
        bytes_per_entry = _bytes_per_entry(fleet.nodes, fleet.encode, self.decode) if entries else 0.0
        events_s = self.applied / a.sim_s  # block events per simulated second, cluster-wide
        cost_us = self.apply_s / self.applied * 1e6 if self.applied else 0.0
        full_entries = n_nodes * a.full_blocks_per_node
        return {
            "nodes": n_nodes, "sim_s": a.sim_s, "entries": entries, "blocks": blocks,
            "copies_per_block": round(entries / blocks, 2) if blocks else 0,
            "bytes_per_entry": round(bytes_per_entry, 1),
            "block_events_per_s": round(events_s), "apply_us_per_block_event": round(cost_us, 3),
            "apply_vs_dict_store": round(self.apply_s / self.ref_s, 2) if self.ref_s else None,
            "directory_cores": round(events_s * cost_us / 1e6, 3),
            "lookup_us_median": round(statistics.median(times) * 1e6, 1),
            "lookup_chain_blocks": round(statistics.mean(map(len, chains)), 1),
            "lookup_hit_blocks_mean": round(statistics.mean(hits), 1),
            "lookup_holders_mean": round(statistics.mean(holders), 2),
            "restarts": self.restarts,
            "drop_us_per_entry": round(self.drop_s / self.dropped_entries * 1e6, 3) if self.dropped_entries else None,
            "snapshot_us_per_entry": round(self.snap_s / self.snap_entries * 1e6, 3) if self.snap_entries else None,
            "full_capacity_entries": full_entries,
            "full_capacity_gib": round(full_entries * bytes_per_entry / 2**30, 2),
        }


def _bytes_per_entry(nodes: list[SimNode], encode, decode) -> float:
    """Bytes the directory holds per (node, block) entry: the final state rebuilt from each
    node's snapshot in a fresh directory, traced alone."""
    snaps = []
    for n in nodes:
        items = [(k, None, None, BLOCK_TOKENS, "") for k in n.dram]
        events = ev.stored_events(items, ev.MEDIUM_CPU) + ev.stored_events(
            [(k, None, None, BLOCK_TOKENS, "") for k in n.nvme], ev.MEDIUM_STORAGE)
        snaps.append(encode(ev.KVEventBatch(ts=0.0, events=events)))
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        d = Directory()
        for n, payload in zip(nodes, snaps):
            d.apply(d.add_node(n.node_id, n.epoch), decode(payload).events)
        used = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    return used / max(1, d.entries())


def simulate(n_nodes: int, a, meter: StoreMeter | None = None) -> tuple[dict | None, dict | None]:
    """One node count: (the replica's row, the Redis backend's row), each None when not asked
    for; both from one simulated fleet. ``meter``: the Redis cluster's, for the Redis backend."""
    fleet = SimFleet(n_nodes, a)
    replica = ReplicaSim(fleet) if a.backend in ("replica", "both") else None
    feeds = Feeds(fleet.nodes, a.redis_writers, a.seed) if meter is not None else None
    for batches, restarts in fleet.ticks():
        if replica is not None:
            replica.tick(batches, restarts)
        if feeds is not None:
            feeds.tick(batches, restarts)
    row = replica.row(fleet) if replica is not None else None
    return row, (redis_row(feeds, n_nodes, meter, a, row) if feeds is not None else None)


def run(a) -> dict:
    backends = ("replica", "redis") if a.backend == "both" else (a.backend,)
    rows, redis_rows, lookup, shards = [], [], None, None
    work = Path(tempfile.mkdtemp(prefix="kvstore-bench-cluster-sim-"))
    store = meter = None
    try:
        if "redis" in backends:
            store = LocalRedisCluster(work / "redis", masters=a.redis_masters).start()
            meter = StoreMeter(store)
            meter.calibrate()
        for n in a.nodes:
            t0 = time.monotonic()
            row, rrow = simulate(n, a, meter)
            rows += [row] if row else []
            redis_rows += [rrow] if rrow else []
            print(f"cluster-sim: {n} nodes done ({time.monotonic() - t0:.0f} s)", file=sys.stderr, flush=True)
        if a.lookup_rpcs:
            lookup = remote_lookup(a, backends, meter, work)
        if redis_rows:
            shards = shard_count(a, redis_rows, lookup)
    finally:
        if meter is not None:
            meter.close()
        if store is not None:
            store.stop()
        shutil.rmtree(work, ignore_errors=True)
    return {"params": {k: v for k, v in vars(a).items() if k != "json"}, "cpus": os.cpu_count(),
            "rows": rows, "redis_rows": redis_rows, "remote_lookup": lookup, "store_shards": shards}


def columns(rows: list[dict], cols) -> list[str]:
    """``rows`` as right-aligned text columns: ``cols`` are (key, heading)."""
    lines = [" ".join(f"{h:>11}" for _, h in cols)]
    for row in rows:
        lines.append(" ".join(f"{str(row[k]):>11}" for k, _ in cols))
    return lines


def _table(r: dict) -> str:
    out = []
    if r["rows"]:
        out += ["replica: every daemon holds the fleet's entries"] + columns(r["rows"], [
            ("nodes", "nodes"), ("entries", "entries"), ("copies_per_block", "copies/blk"),
            ("bytes_per_entry", "B/entry"), ("block_events_per_s", "blk-ev/s"),
            ("apply_us_per_block_event", "us/blk-ev"), ("apply_vs_dict_store", "x dict"), ("directory_cores", "cores"),
            ("lookup_us_median", "lookup us"), ("lookup_holders_mean", "holders"),
            ("drop_us_per_entry", "drop us/e"), ("snapshot_us_per_entry", "snap us/e"),
            ("full_capacity_gib", "GiB@full")])
    if r["redis_rows"]:
        out += redis_table(r["redis_rows"], r["params"]["redis_masters"], columns)
    if r["remote_lookup"]:
        out += lookup_table(r["remote_lookup"])
    if r["store_shards"]:
        out.append(shard_line(r["store_shards"]))
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvstore bench cluster-sim", description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", choices=("replica", "redis", "both"), default="both",
                    help="which directory: the replica in every daemon, the Redis cluster, or both in one run")
    ap.add_argument("--nodes", default="8,64,256,1024", help="node counts, comma-separated")
    ap.add_argument("--sim-s", type=float, default=5.0, help="simulated seconds per node count")
    ap.add_argument("--requests-per-node-s", type=float, default=10.0, help="requests each node serves per second")
    ap.add_argument("--dram-blocks", type=int, default=256, help="DRAM blocks per synthetic node (kept small: the directory is traced)")
    ap.add_argument("--nvme-blocks", type=int, default=1024, help="NVMe blocks per synthetic node")
    ap.add_argument("--full-blocks-per-node", type=int, default=1_000_000,
                    help="blocks a real node holds (DRAM + NVMe), for the memory at full capacity")
    ap.add_argument("--prompts", type=int, default=32, help="shared system prompts")
    ap.add_argument("--prompt-blocks", type=int, default=64, help="blocks of a system prompt (of 16 tokens)")
    ap.add_argument("--turn-blocks", type=int, default=32, help="new blocks per request (a turn)")
    ap.add_argument("--turns", type=int, default=6, help="turns per conversation")
    ap.add_argument("--restarts-per-node-hour", type=float, default=2.0, help="churn: warm restarts per node per hour")
    ap.add_argument("--lookups", type=int, default=200)
    ap.add_argument("--seed", type=int, default=1)
    g = ap.add_argument_group("redis backend")
    g.add_argument("--redis-masters", type=int, default=3, help="redis-server shards of the local store")
    g.add_argument("--redis-writers", type=int, default=8,
                   help="simulated nodes whose directories write to the store (all of them below this count)")
    g.add_argument("--redis-memory-nodes", type=int, default=3, help="writers whose own map is traced (the mean)")
    g.add_argument("--redis-pace-s", type=float, default=0.03,
                   help="wall seconds between replayed ticks (more than the writer's 20 ms step)")
    g.add_argument("--fleet-nodes", type=int, default=1024, help="the fleet the store's shard count is for")
    g.add_argument("--reads-per-request", type=float, default=2.0,
                   help="store chain reads per request in the shard count (a Lookup's, and a pull's holder query)")
    g.add_argument("--shard-cpu", type=float, default=0.5, help="busy share of a shard's main thread allowed")
    g.add_argument("--shard-memory-gib", type=float, default=25.0, help="memory of one shard for the directory")
    lk = ap.add_argument_group("Lookup RPC with a remote hit, through real daemons (each backend run)")
    lk.add_argument("--lookup-rpcs", type=int, default=300, help="Lookups timed per kind (0: none, no daemons started)")
    lk.add_argument("--lookup-blocks", type=int, default=128, help="blocks of a chain the asker looks up")
    lk.add_argument("--lookup-chains", type=int, default=4, help="chains the holder puts")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    a.nodes = [int(x) for x in str(a.nodes).split(",")]
    if a.backend != "replica" and server_binaries() is None:
        raise SystemExit("kvstore bench cluster-sim: the redis backend needs redis-server and redis-cli "
                         "(Debian: apt-get install redis-server); --backend replica runs without")
    r = run(a)
    print(json.dumps(r, indent=2) if a.json else _table(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
