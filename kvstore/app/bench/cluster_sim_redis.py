"""The Redis backend in ``kvstore bench cluster-sim`` (``cluster.directory = "redis"``): at each
simulated node count, what one daemon and the store spend on the directory, measured with real
:class:`RedisDirectory` writers over a real Redis cluster (:class:`LocalRedisCluster`, loopback).

The simulated fleet is the replica's (same seed, same run). ``--redis-writers`` of its nodes,
picked at random (all of them at small node counts), each get a daemon's directory: their block
changes, as the core reports them (``stored`` / ``removed`` per block and tier, a warm restart
as a new epoch over the NVMe blocks kept), are replayed tick by tick into it, and its writer
thread writes them to the store as in a daemon.

- Daemon memory: the own map of a writer rebuilt alone under tracemalloc (allocations of the
  directory's module, plus the key objects, counted as the replica counts its copies).
- Daemon CPU: this process's CPU time over the replay (the core's queueing and the writer
  thread: apply, pipelined writes) per block change, after a warm-up that leaves out the
  clients' connection set-up.
- Store: each server's main-thread CPU (``INFO cpu``) and commands (``INFO stats``) over the same
  replay, and its memory (``INFO memory``) per entry (a node's field of a block's hash, with its
  line in the node's set) at the end.
"""

from __future__ import annotations

import gc
import math
import queue
import random
import time
import tracemalloc
from collections import Counter
from dataclasses import dataclass
from enum import Enum

from kvstore import kv_events as ev
from kvstore.app.bench.redis_cluster import LocalRedisCluster
from kvstore.cluster import redis_directory
from kvstore.cluster.redis_directory import RedisDirectory
from kvstore.cluster.redis_store import connect
from kvstore.config import ClusterConfig

TICK_S = 0.1  # a synthetic daemon publishes one batch per tick (kvstore.app.bench.cluster_sim)
BLOCK_TOKENS = 16
WARM_TICKS = 5  # replayed before the clock starts: the writers' clients connect then


class Change(Enum):
    """What a core reports to its directory, one block and tier at a time; or a warm restart."""

    STORED = 1
    REMOVED = 2
    RESTART = 3


@dataclass(slots=True)
class Blk:
    """What the core hands the directory: a block's key and its parent's."""

    key: bytes
    parent_key: bytes | None


class _Membership:
    """A writer's view of membership: its id and epoch. No peers: the bench's writers never read."""

    def __init__(self, node_id: str) -> None:
        self.node_id, self.epoch = node_id, 0

    def peers(self) -> list:
        return []

    def member(self, node_id: str):
        return None

    def subscribe(self) -> queue.SimpleQueue:
        return queue.SimpleQueue()


class _CoreState:
    """The core's blocks at a (re)start: ``(medium, key, parent, tokens, block_tokens, salt)``."""

    def __init__(self, items: list) -> None:
        self.items = items

    def capture(self, cut):
        items, self.items = self.items, []  # the core builds them per call: none kept here
        return items, cut()


class Feeds:
    """The block changes of ``writers`` nodes of a simulated fleet, per tick: ``(writer, op)``,
    op ``(Change.STORED or REMOVED, Blk, tier)`` or ``(Change.RESTART, items, None)``, a warm
    restart over ``items`` (the core's state: its NVMe blocks)."""

    def __init__(self, nodes: list, writers: int, seed: int) -> None:
        pick = sorted(random.Random(seed).sample(range(len(nodes)), min(writers, len(nodes))))  # not the fleet's rng
        self.names = [nodes[i].node_id for i in pick]
        self.index = {name: j for j, name in enumerate(self.names)}
        self.ticks: list[list[tuple]] = []
        self.decode = ev.decoder().decode

    def tick(self, batches, restarts) -> None:
        ops: list[tuple] = []
        for node, payload in batches:
            j = self.index.get(node.node_id)
            if j is None:
                continue
            for e in self.decode(payload).events:
                tier = ev.TIER_OF_MEDIUM.get(getattr(e, "medium", None))
                if isinstance(e, ev.BlockStored):
                    parent = e.parent_block_hash
                    for k in e.block_hashes:
                        ops.append((j, (Change.STORED, Blk(k, parent), tier)))
                        parent = k
                elif isinstance(e, ev.BlockRemoved):
                    ops.extend((j, (Change.REMOVED, Blk(k, None), tier)) for k in e.block_hashes)
        for node, _ in restarts:
            j = self.index.get(node.node_id)
            if j is not None:
                items = [(ev.MEDIUM_STORAGE, k, None, None, BLOCK_TOKENS, "") for k in node.nvme]
                ops.append((j, (Change.RESTART, items, None)))
        self.ticks.append(ops)

    def of(self, j: int) -> list[tuple]:
        """Writer ``j``'s ops, in order."""
        return [op for ops in self.ticks for w, op in ops if w == j]


class _Daemon:
    """One writer node's directory, restarted at a new epoch when the node restarts."""

    def __init__(self, cfg: ClusterConfig, password: str, node_id: str, connect_fn=None) -> None:
        self.cfg, self.password, self.connect_fn = cfg, password, connect_fn
        self.membership = _Membership(node_id)
        self._start([])

    def _start(self, items: list) -> None:
        self.membership.epoch += 1
        self.d = RedisDirectory(self.cfg, password=self.password, connect_fn=self.connect_fn)
        self.d.start(self.membership, _CoreState(items))

    def apply(self, op: tuple) -> None:
        change, b, tier = op
        if change is Change.STORED:
            self.d.stored(b, None, tier)
        elif change is Change.REMOVED:
            self.d.removed(b, tier)
        else:
            self.d.stop()
            self._start(b)


class StoreMeter:
    """The servers' counters: main-thread CPU seconds (``INFO cpu``), commands processed (those a
    script runs included: a chain read counts its HGETALLs), memory used, keys. What reading
    them costs, and the servers' CPU when idle (cron, cluster bus), are measured once
    (:meth:`calibrate`) and taken off each interval (:meth:`spent`)."""

    def __init__(self, store: LocalRedisCluster) -> None:
        import redis

        self.store = store
        self.clients = [redis.Redis(host="127.0.0.1", port=p, password=store.password) for p in store.ports]
        self.read_cpu_s = self.read_cmds = self.idle_cpu_per_s = 0.0

    def read(self) -> list[dict]:
        out = []
        for c in self.clients:
            i = c.info("default")
            out.append({"cpu_s": float(i["used_cpu_sys_main_thread"]) + float(i["used_cpu_user_main_thread"]),
                        "cmds": int(i["total_commands_processed"]), "used_memory": int(i["used_memory"]),
                        "keys": i.get("db0", {}).get("keys", 0), "t": time.monotonic()})
        return out

    @staticmethod
    def _delta(before: list[dict], after: list[dict], key: str) -> float:
        return sum(a[key] - b[key] for a, b in zip(after, before))

    def calibrate(self, idle_s: float = 0.3) -> None:
        a, b = self.read(), self.read()
        self.read_cpu_s, self.read_cmds = self._delta(a, b, "cpu_s"), self._delta(a, b, "cmds")
        time.sleep(idle_s)
        c = self.read()
        self.idle_cpu_per_s = max(0.0, (self._delta(b, c, "cpu_s") - self.read_cpu_s) / (c[0]["t"] - b[0]["t"]))

    def spent(self, before: list[dict], after: list[dict]) -> tuple[float, int, list[int]]:
        """(CPU seconds, commands, commands per shard) between two reads, less the second
        read's cost and the idle CPU over the interval."""
        idle = self.idle_cpu_per_s * (after[0]["t"] - before[0]["t"])
        cpu = max(0.0, self._delta(before, after, "cpu_s") - self.read_cpu_s - idle)
        cmds = round(self._delta(before, after, "cmds") - self.read_cmds)
        return cpu, cmds, [a["cmds"] - b["cmds"] for a, b in zip(after, before)]

    def flush(self) -> None:
        for c in self.clients:
            c.flushall(asynchronous=False)

    def close(self) -> None:
        for c in self.clients:
            c.close()


def _config(store: LocalRedisCluster, prefix: str) -> ClusterConfig:
    # a generous deadline: this host is shared, and a failed write would be retried in full
    return ClusterConfig(etcd_endpoints="bench:1", directory="redis", redis_nodes=store.nodes,
                         redis_key_prefix=prefix, redis_timeout_s=2.0, redis_retry_s=0.5)


def _replay(feeds: Feeds, meter: StoreMeter, pace_s: float) -> dict:
    """Every writer's ops into its directory, tick by tick (``pace_s`` apart, so the writer
    thread takes about a tick per step, as a daemon's would); counters over the ticks after
    :data:`WARM_TICKS`."""
    store = meter.store
    cfg = _config(store, "sim")
    daemons = [_Daemon(cfg, store.password, name) for name in feeds.names]
    c = connect(cfg, store.password, 5.0)
    try:
        # each writer has registered its epoch in the store (``P:e{<node>}``): connected
        deadline = time.monotonic() + 30
        while not all(c.exists(b"sim:e{%s}" % n.encode()) for n in feeds.names):
            if time.monotonic() > deadline:
                raise SystemExit("kvstore bench cluster-sim: the directory writers did not reach the store")
            time.sleep(0.02)
        time.sleep(0.1)  # the reader's client connects in the same step
        warm = min(WARM_TICKS, len(feeds.ticks) // 2)
        events, before, cpu0 = 0, None, 0.0
        for t, ops in enumerate(feeds.ticks):
            if t == warm:
                events, before, cpu0 = 0, meter.read(), time.process_time()
            for j, op in ops:
                daemons[j].apply(op)
            events += sum(1 for _, op in ops if op[0] is not Change.RESTART)
            time.sleep(pace_s)
        if before is None:  # no ticks
            before, cpu0 = meter.read(), time.process_time()
        for d in daemons:
            d.d.stop()  # what is queued is written first
        cpu = time.process_time() - cpu0
        after = meter.read()
        store_cpu, store_cmds, by_shard = meter.spent(before, after)
        sets = sum(1 for _ in c.scan_iter(match=b"sim:*", count=1000))
        tags = _entries_by_tag(c, b"sim{*")
    finally:
        c.close()
    return {"events": events, "window_s": (len(feeds.ticks) - warm) * TICK_S, "cpu_s": cpu,
            "store_cpu_s": store_cpu, "store_cmds": store_cmds, "store_cmds_by_shard": by_shard,
            "used_memory": sum(a["used_memory"] for a in after), "keys": sum(a["keys"] for a in after),
            "sets": sets, "hottest_tag_entries": max(tags.values(), default=0),
            "entries": sum(d.d.size()["entries"] for d in daemons)}


def _entries_by_tag(c, match: bytes) -> Counter:
    """Entries (fields: one per node holding the block) of the hashes ``match`` names, by hash
    tag: the share a tag's shard carries, whatever how many nodes each of its blocks has."""
    names = list(c.scan_iter(match=match, count=1000))
    pipe = c.pipeline(transaction=False)
    for name in names:
        pipe.hlen(name)
    out: Counter = Counter()
    for name, n in zip(names, pipe.execute()):
        out[name[name.index(b"{") + 1:name.index(b"}")]] += n
    return out


class _NoStore:
    """A client that takes every write and keeps nothing, for the traced rebuild: the own map
    is the same whatever the store answers, and a real client's set-up would be traced slowly."""

    def pipeline(self, transaction: bool = False) -> "_NoStore":
        return self

    def execute(self, raise_on_error: bool = True) -> list:
        return []

    def smembers(self, name) -> set:
        return set()

    def register_script(self, script):
        return lambda keys=(), args=(): []

    def __getattr__(self, command):  # hset, hdel, sadd, srem, close, ...
        return lambda *args, **kw: None


def rebuild_own(ops: list[tuple]) -> tuple[int, dict]:
    """A writer's own map once ``ops`` are applied (:meth:`Feeds.of`), rebuilt alone under
    tracemalloc, and its bytes: what the directory's module allocated and still holds, plus the
    key objects (copied here, as the replica holds copies of its keys)."""
    cfg = ClusterConfig(etcd_endpoints="bench:1", directory="redis", redis_nodes="127.0.0.1:1")
    gc.collect()
    tracemalloc.start()
    try:
        daemon = _Daemon(cfg, "", "mem", connect_fn=lambda timeout_s: _NoStore())
        for change, b, tier in ops:
            if change is Change.RESTART:
                b = [(m, bytes(memoryview(k)), *rest) for m, k, *rest in b]
            else:
                b = Blk(bytes(memoryview(b.key)), b.parent_key)
            daemon.apply((change, b, tier))
        daemon.d.stop()
        gc.collect()
        snap = tracemalloc.take_snapshot().filter_traces(
            [tracemalloc.Filter(True, redis_directory.__file__), tracemalloc.Filter(True, __file__)])
    finally:
        tracemalloc.stop()
    return sum(t.size for t in snap.traces), daemon.d.own


def redis_row(feeds: Feeds, n_nodes: int, meter: StoreMeter, a, replica: dict | None) -> dict:
    """One node count's figures for the Redis backend (``replica``: the same run's replica row)."""
    meter.flush()
    base = sum(s["used_memory"] for s in meter.read())
    r = _replay(feeds, meter, a.redis_pace_s)
    mem = [rebuild_own(feeds.of(j)) for j in range(min(a.redis_memory_nodes, len(feeds.names)))]
    own_bytes, own_blocks = sum(m[0] for m in mem) / len(mem), sum(len(m[1]) for m in mem) / len(mem)
    b_own = own_bytes / own_blocks if own_blocks else 0.0
    writers, window = len(feeds.names), r["window_s"]
    rate = r["events"] / (writers * window) if window else 0.0  # block changes a second, one node
    us = r["cpu_s"] / r["events"] * 1e6 if r["events"] else 0.0
    hashes = r["keys"] - r["sets"]
    cmds_node_s = r["store_cmds"] / (writers * window) if window else 0.0
    row = {
        "nodes": n_nodes, "writers": writers, "own_blocks": round(own_blocks), "bytes_per_own_block": round(b_own, 1),
        "daemon_bytes": round(own_bytes), "full_capacity_gib": round(b_own * a.full_blocks_per_node / 2**30, 3),
        "memory_vs_replica": None, "block_events_per_node_s": round(rate),
        "writer_us_per_block_event": round(us, 2), "daemon_cores": round(rate * us / 1e6, 4), "replica_cores": None,
        "store_cmds": r["store_cmds"], "store_cmds_by_shard": r["store_cmds_by_shard"],
        "store_cmds_per_block_event": round(r["store_cmds"] / r["events"], 3) if r["events"] else None,
        "store_cmds_per_node_s": round(cmds_node_s),
        "store_us_per_cmd": round(r["store_cpu_s"] / r["store_cmds"] * 1e6, 3) if r["store_cmds"] else None,
        "store_ops_per_core_s": round(r["store_cmds"] / r["store_cpu_s"]) if r["store_cpu_s"] > 0 else None,
        "store_entries": r["entries"], "store_fields_per_hash": round(r["entries"] / hashes, 2) if hashes else None,
        "store_bytes_per_entry": round((r["used_memory"] - base) / r["entries"], 1) if r["entries"] else None,
        "hottest_tag_share": round(r["hottest_tag_entries"] / r["entries"], 4) if r["entries"] else None,
        "fleet_write_ops_s": round(cmds_node_s * n_nodes),
    }
    if replica is not None:
        replica_bytes = replica["entries"] * replica["bytes_per_entry"]
        row["memory_vs_replica"] = round(own_bytes / replica_bytes, 6) if replica_bytes else None
        row["replica_cores"] = replica["directory_cores"]
    return row


def shard_count(a, rows: list[dict], lookup: dict | None) -> dict:
    """The shards a fleet of ``a.fleet_nodes`` needs: by CPU (writes at the largest node count's
    per-node rate, and ``a.reads_per_request`` chain reads per request, at the largest measured
    server costs, each shard's main thread at most ``a.shard_cpu`` busy), by memory (every node
    at ``--full-blocks-per-node``, at the largest bytes per entry measured), and whether the
    hottest hash tag (a 64-block stretch of a chain, which one shard holds whole), at its share
    of the entries, fits one shard."""
    row, n = rows[-1], a.fleet_nodes
    us_cmd = max(r["store_us_per_cmd"] or 0.0 for r in rows)
    b_entry = max(r["store_bytes_per_entry"] or 0.0 for r in rows)
    share = row["hottest_tag_share"] or 0.0  # the most conversations: the share closest to the prompts' popularity
    read_us = lookup["store_us_per_read"] if lookup and lookup.get("store_us_per_read") else None
    writes_s = row["store_cmds_per_node_s"] * n
    reads_s = a.reads_per_request * a.requests_per_node_s * n
    cores = writes_s * us_cmd / 1e6 + (reads_s * read_us / 1e6 if read_us else 0.0)
    mem = n * a.full_blocks_per_node * b_entry
    shard_mem = a.shard_memory_gib * 2**30
    by_cpu, by_mem = math.ceil(cores / a.shard_cpu), math.ceil(mem / shard_mem)
    return {"fleet_nodes": n, "write_ops_s": round(writes_s), "reads_s": round(reads_s),
            "store_us_per_cmd": us_cmd, "store_us_per_read": read_us, "reads_counted": read_us is not None,
            "cores": round(cores, 2), "shard_cpu": a.shard_cpu, "by_cpu": by_cpu,
            "bytes_per_entry": b_entry, "memory_gib": round(mem / 2**30, 1), "shard_memory_gib": a.shard_memory_gib,
            "by_memory": by_mem, "shards": max(by_cpu, by_mem, 1),
            "hottest_tag_share": share, "hottest_tag_cores": round(cores * share, 3),
            "hottest_tag_gib": round(mem * share / 2**30, 1),
            "hottest_tag_fits": cores * share <= a.shard_cpu and mem * share <= shard_mem}


def redis_table(rows: list[dict], masters: int, columns) -> list[str]:
    """The Redis rows as text (``columns``: the bench's column formatter)."""
    rows = [{**x, "memory_vs_replica": f"1/{1 / x['memory_vs_replica']:.0f}" if x["memory_vs_replica"] else "-"}
            for x in rows]
    return [f"redis: each daemon holds its own blocks; the store (measured on {masters} local redis-server "
            "shards) the fleet's"] + columns(rows, [
        ("nodes", "nodes"), ("writers", "writers"), ("own_blocks", "own blks"), ("bytes_per_own_block", "B/own blk"),
        ("full_capacity_gib", "GiB@full"), ("memory_vs_replica", "mem/replica"),
        ("block_events_per_node_s", "blk-ev/s/nd"), ("writer_us_per_block_event", "us/blk-ev"),
        ("daemon_cores", "cores"), ("replica_cores", "replica crs"),
        ("store_cmds_per_block_event", "cmds/blk-ev"), ("store_us_per_cmd", "srv us/cmd"),
        ("store_ops_per_core_s", "ops/s/core"), ("store_bytes_per_entry", "srv B/entry"),
        ("store_fields_per_hash", "fields/hash"), ("hottest_tag_share", "hot tag"),
        ("fleet_write_ops_s", "fleet wr/s")])


def shard_line(s: dict) -> str:
    """:func:`shard_count`'s answer as a sentence."""
    reads = (f" + {s['reads_s']:,} chain reads/s at {s['store_us_per_read']:.0f} µs" if s["reads_counted"]
             else " (chain reads not measured: --lookup-rpcs 0)")
    fits = "fits" if s["hottest_tag_fits"] else "does NOT fit"
    return (f"store for {s['fleet_nodes']:,} nodes: {s['write_ops_s']:,} write ops/s at {s['store_us_per_cmd']:.2f} µs"
            f"{reads} = {s['cores']:.1f} cores -> {s['by_cpu']} shards at {s['shard_cpu']:.0%} of a core; "
            f"{s['memory_gib']:,.0f} GiB at {s['bytes_per_entry']:.0f} B/entry -> {s['by_memory']} shards of "
            f"{s['shard_memory_gib']:g} GiB; needs {s['shards']} shards if the load spreads evenly. The hottest "
            f"hash tag, a chain's stretch ({s['hottest_tag_share']:.1%} of the entries, on one shard whole): "
            f"{s['hottest_tag_cores']:.2f} cores, {s['hottest_tag_gib']:.1f} GiB: {fits} one shard")
