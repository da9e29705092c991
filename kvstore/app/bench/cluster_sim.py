"""``kvstore bench cluster-sim``: the cluster prefix directory of one daemon, fed in-process by
many synthetic daemons' KV event streams, for 8 to 1,024 nodes under churn.

Each synthetic daemon serves multi-turn conversations that share system prompts, routed to a
random node (no prefix-aware routing: the most copies of a prefix), keeps an LRU DRAM tier that
demotes into an LRU NVMe tier, and publishes what a real daemon publishes: ``BlockStored`` (with
token ids) into CPU, ``BlockStored`` STORAGE plus ``BlockRemoved`` CPU on demotion,
``BlockRemoved`` STORAGE on NVMe eviction, one msgpack batch per node and tick, encoded with the
same structs as :mod:`kvstore.daemon.events`. Churn: a node restarts (its DRAM lost, its NVMe
kept, as a warm restart does) at ``--restarts-per-node-hour``; the directory drops it, takes the
new epoch and applies its snapshot.

Measured, per node count: directory entries and distinct blocks; bytes per entry (tracemalloc,
over the final state rebuilt alone); decode + apply cost per block event (the directory's
thread), and its ratio to the same run's raw path, decode + one plain dict store per block
event; lookup cost for a conversation's chain; cost of dropping a node and applying a
snapshot, per entry. Then, for the per-node rate and capacity given, the event rate one daemon
must absorb, the cores that takes, and the directory's memory at full capacity. Times are this
machine's, of this Python process: they are ratios of the same run's own work, not a target.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
import tracemalloc
from collections import OrderedDict

import msgspec

from kvstore import kv_events as ev
from kvstore.cluster.directory import Directory

BLOCK_TOKENS = 16


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


def simulate(n_nodes: int, a) -> dict:
    rng = random.Random(a.seed + n_nodes)
    encode = msgspec.msgpack.Encoder().encode
    decode = ev.decoder().decode
    nodes = [SimNode(f"n{i}", a.dram_blocks, a.nvme_blocks, rng) for i in range(n_nodes)]
    work = Workload(rng, a.prompts, a.prompt_blocks, a.turn_blocks, a.turns, live=max(64, 8 * n_nodes))
    d = Directory()
    handles = {n.node_id: d.add_node(n.node_id, n.epoch) for n in nodes}
    tick_s = 0.1
    per_tick = a.requests_per_node_s * tick_s
    restart_p = a.restarts_per_node_hour * tick_s / 3600
    apply_s = ref_s = 0.0
    raw: dict[bytes, int] = {}
    applied = restarts = 0
    drop_s = snap_s = 0.0
    dropped_entries = snap_entries = 0
    ticks = int(a.sim_s / tick_s)
    carry = 0.0
    for _ in range(ticks):
        carry += per_tick * n_nodes
        for _ in range(int(carry)):
            rng.choice(nodes).serve(work.next_chain())
        carry -= int(carry)
        for n in nodes:
            out = n.batch(encode)
            if out is None:
                continue
            t0 = time.perf_counter()
            batch = decode(out[1])
            t1 = time.perf_counter()
            d.apply(handles[n.node_id], batch.events)
            t2 = time.perf_counter()
            for e in batch.events:  # the reference: one plain dict store or pop per block event
                if isinstance(e, ev.BlockStored):
                    for k in e.block_hashes:
                        raw[k] = 1
                elif isinstance(e, ev.BlockRemoved):
                    for k in e.block_hashes:
                        raw.pop(k, None)
            ref_s += (t1 - t0) + (time.perf_counter() - t2)
            apply_s += t2 - t0
            applied += block_events([batch])
        for n in nodes:
            if rng.random() < restart_p:
                restarts += 1
                entries = len(handles[n.node_id].held)
                t0 = time.perf_counter()
                d.drop_node(n.node_id)
                drop_s += time.perf_counter() - t0
                dropped_entries += entries
                payload = n.restart(encode)
                t0 = time.perf_counter()
                h = handles[n.node_id] = d.add_node(n.node_id, n.epoch)
                d.apply(h, decode(payload).events)
                snap_s += time.perf_counter() - t0
                snap_entries += len(h.held)
    # Lookups: chains of conversations under way, as a router or a missing daemon asks.
    chains = [c[0] for c in work.live[:a.lookups]] or [work.prompts[0]]
    times, hits, holders = [], [], []
    for c in chains:
        t0 = time.perf_counter()
        r = d.longest_prefix(b"", c)
        times.append(time.perf_counter() - t0)
        hits.append(max((h.n_blocks for h in r), default=0))
        holders.append(len({h.node_id for h in r}))
    entries, blocks = d.entries(), d.blocks()
    bytes_per_entry = _bytes_per_entry(nodes, encode, decode) if entries else 0.0
    events_s = applied / a.sim_s  # block events per simulated second, cluster-wide
    cost_us = apply_s / applied * 1e6 if applied else 0.0
    full_entries = n_nodes * a.full_blocks_per_node
    return {
        "nodes": n_nodes, "sim_s": a.sim_s, "entries": entries, "blocks": blocks,
        "copies_per_block": round(entries / blocks, 2) if blocks else 0,
        "bytes_per_entry": round(bytes_per_entry, 1),
        "block_events_per_s": round(events_s), "apply_us_per_block_event": round(cost_us, 3),
        "apply_vs_dict_store": round(apply_s / ref_s, 2) if ref_s else None,
        "directory_cores": round(events_s * cost_us / 1e6, 3),
        "lookup_us_median": round(statistics.median(times) * 1e6, 1), "lookup_chain_blocks": round(statistics.mean(map(len, chains)), 1),
        "lookup_hit_blocks_mean": round(statistics.mean(hits), 1), "lookup_holders_mean": round(statistics.mean(holders), 2),
        "restarts": restarts,
        "drop_us_per_entry": round(drop_s / dropped_entries * 1e6, 3) if dropped_entries else None,
        "snapshot_us_per_entry": round(snap_s / snap_entries * 1e6, 3) if snap_entries else None,
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


def run(a) -> dict:
    rows = []
    for n in a.nodes:
        rows.append(simulate(n, a))
        print(f"cluster-sim: {n} nodes done", file=sys.stderr, flush=True)
    return {"params": {k: v for k, v in vars(a).items() if k != "json"}, "rows": rows}


def _table(r: dict) -> str:
    cols = [("nodes", "nodes"), ("entries", "entries"), ("copies_per_block", "copies/blk"),
            ("bytes_per_entry", "B/entry"), ("block_events_per_s", "blk-ev/s"),
            ("apply_us_per_block_event", "us/blk-ev"), ("apply_vs_dict_store", "x dict"), ("directory_cores", "cores"),
            ("lookup_us_median", "lookup us"), ("lookup_holders_mean", "holders"),
            ("drop_us_per_entry", "drop us/e"), ("snapshot_us_per_entry", "snap us/e"),
            ("full_capacity_gib", "GiB@full")]
    lines = [" ".join(f"{h:>11}" for _, h in cols)]
    for row in r["rows"]:
        lines.append(" ".join(f"{str(row[k]):>11}" for k, _ in cols))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvstore bench cluster-sim", description=__doc__.split("\n\n")[0])
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
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    a.nodes = [int(x) for x in str(a.nodes).split(",")]
    r = run(a)
    print(json.dumps(r, indent=2) if a.json else _table(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
