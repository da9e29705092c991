"""Lookup with a remote hit through real daemons, for ``kvstore bench cluster-sim``: per directory
backend, two ``kvstore serve`` on one etcd (and, for redis, the bench's Redis cluster), a holder
that put ``--lookup-chains`` chains of ``--lookup-blocks`` blocks and an asker. The asker's
Lookup RPC (no ``ask_peers``: the directory alone answers) must name the holder for every block.

Timed in one loop, interleaved: the raw reference, the same Lookup RPC on a daemon alone (no
cluster, nothing held: no remote hit, no directory); per backend, the asker's Lookup with a
remote hit, and its Lookup of a chain nobody holds. What each directory adds to a Lookup (its
advice included) is its remote hit less the raw one. Then the store's cost of the redis
asker's reads: the servers' main-thread CPU and commands over its remote hits alone."""

from __future__ import annotations

import shutil
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from kvstore.app.bench.cluster import LocalEtcd, daemon_flags, fleet_certificates
from kvstore.app.bench.cluster_sim_redis import StoreMeter
from kvstore.app.bench.redis_cluster import LocalRedisCluster
from kvstore.layout import KVLayout

LAYOUT = KVLayout(2, 2, 64, "fp16")  # 16 KiB blocks: the chains cost little to write
MODEL = "bench-cluster-sim"
ALONE = "sim-alone"  # the raw reference: a daemon in no cluster


def _flags(backend: str, etcd: str, pki: Path, name: str, store: LocalRedisCluster | None) -> tuple[str, ...]:
    opts = SimpleNamespace(pull_deadline_s=5.0, prefill_tokens_per_s=10_000.0)  # no pulls here
    flags = daemon_flags(opts, etcd, pki, name, 64 << 20, prefix=f"/sim-{backend}", events=backend == "replica")
    if backend == "redis":
        # the store's deadline on a Lookup's path: 0.5 s on this shared host, as the fleet test has it
        flags += ("--cluster-directory", "redis", "--cluster-redis-nodes", store.nodes,
                  "--cluster-redis-password-file", str(store.password_file),
                  "--cluster-redis-timeout-s", "0.5", "--cluster-redis-retry-s", "1")
    return flags


def _us(xs: list[float]) -> dict:
    """Median and 90th percentile of ``xs`` (seconds), in µs."""
    p90 = statistics.quantiles(xs, n=10)[8] if len(xs) > 1 else xs[0]
    return {"median": round(statistics.median(xs) * 1e6, 1), "p90": round(p90 * 1e6, 1)}


def remote_lookup(a, backends: tuple[str, ...], meter: StoreMeter | None, work: Path) -> dict:
    """The timings, per backend; ``redis_vs_replica``: the ratio of the remote hits' medians;
    ``meter``: the bench's Redis cluster's, for the redis backend."""
    from kvstore.app.local import start_daemon
    from kvstore.clients import KVStoreClient

    work = work / "lookup"
    work.mkdir()
    store = meter.store if meter is not None else None
    names = {b: (f"sim-{b}-holder", f"sim-{b}-asker") for b in backends}
    pki = fleet_certificates(work / "pki", [n for pair in names.values() for n in pair])
    etcd, daemons, clients = LocalEtcd(work), {}, []
    n_blocks, bt = a.lookup_blocks, LAYOUT.block_tokens
    try:
        flags = {n: _flags(b, etcd.endpoint, pki, n, store) for b in backends for n in names[b]}
        flags[ALONE] = ("--dram-capacity-bytes", str(64 << 20), "--dram-extent-bytes", "4MiB")
        with ThreadPoolExecutor(len(flags)) as ex:
            futs = {n: ex.submit(start_daemon, work, n, *f) for n, f in flags.items()}
            failed = []
            for n, f in futs.items():  # every one collected, so that those that started are stopped
                try:
                    daemons[n] = f.result()
                except RuntimeError as e:
                    failed.append(str(e))
        if failed:
            raise SystemExit(f"kvstore bench cluster-sim: a daemon did not start: {failed[0]}")

        def client(name: str):
            c = KVStoreClient(daemons[name].socket_path, timeout_s=10)
            c.register(LAYOUT, MODEL)
            clients.append(c)
            return c
        alone = client(ALONE)
        pairs = {b: (client(names[b][0]), client(names[b][1])) for b in backends}
        rng = np.random.default_rng(7)
        chains = [rng.integers(0, 32000, n_blocks * bt).tolist() for _ in range(a.lookup_chains)]
        kv = np.zeros(LAYOUT.tensor_shape(n_blocks * bt), np.float16)
        for holder, _ in pairs.values():
            for t in chains:
                holder.put(t, kv)
        keys = [alone.keys(t) for t in chains]  # one namespace: the same keys on every daemon
        nowhere = alone.keys(rng.integers(0, 32000, n_blocks * bt).tolist())

        def names_holder(b: str, k) -> bool:
            r = pairs[b][1].lookup_keys(k)
            return r.remote_node_id == names[b][0] and r.remote_blocks == n_blocks
        deadline = time.monotonic() + 60
        while not all(names_holder(b, k) for b in backends for k in keys):  # the askers' directories know
            if time.monotonic() > deadline:
                raise SystemExit("kvstore bench cluster-sim: the askers' Lookups never named the holders")
            time.sleep(0.1)

        raw: list[float] = []
        times = {(b, kind): [] for b in backends for kind in ("remote", "miss")}
        named = dict.fromkeys(backends, 0)
        for i in range(a.lookup_rpcs):
            k = keys[i % len(keys)]
            t0 = time.perf_counter()
            alone.lookup_keys(k)
            raw.append(time.perf_counter() - t0)
            for b in backends:
                asker = pairs[b][1]
                for kind, ks in (("remote", k), ("miss", nowhere)):
                    t0 = time.perf_counter()
                    r = asker.lookup_keys(ks)
                    times[(b, kind)].append(time.perf_counter() - t0)
                    if kind == "remote":
                        named[b] += r.remote_node_id == names[b][0] and r.remote_blocks == n_blocks
        out: dict = {"chain_blocks": n_blocks, "rpcs": a.lookup_rpcs, "raw_us": _us(raw)}
        for b in backends:
            remote = _us(times[(b, "remote")])
            out[b] = {"remote_us": remote, "miss_us": _us(times[(b, "miss")]),
                      "added_us": round(remote["median"] - out["raw_us"]["median"], 1),
                      "named_holder": round(named[b] / a.lookup_rpcs, 4)}
        if "replica" in out and "redis" in out:
            medians = [out[b]["remote_us"]["median"] for b in ("redis", "replica")]
            out["redis_vs_replica"] = round(medians[0] / medians[1], 2)
        if "redis" in backends:
            asker = pairs["redis"][1]
            before = meter.read()
            for i in range(a.lookup_rpcs):
                asker.lookup_keys(keys[i % len(keys)])
            cpu, cmds, _ = meter.spent(before, meter.read())
            out.update(store_us_per_read=round(cpu / a.lookup_rpcs * 1e6, 1),
                       store_cmds_per_read=round(cmds / a.lookup_rpcs, 2))
        return out
    finally:
        for c in clients:
            c.close()
        with ThreadPoolExecutor(max(1, len(daemons))) as ex:
            list(ex.map(lambda d: d.stop(30), daemons.values()))
        etcd.stop()
        shutil.rmtree(work, ignore_errors=True)


def lookup_table(lk: dict) -> list[str]:
    """:func:`remote_lookup`'s answer as text."""
    raw = lk["raw_us"]
    out = [f"Lookup RPC of a {lk['chain_blocks']}-block chain, {lk['rpcs']} each, median / p90 µs: "
           f"raw (a daemon alone, no remote hit) {raw['median']:.0f} / {raw['p90']:.0f}"]
    for b in ("replica", "redis"):
        if b in lk:
            x = lk[b]
            out.append(f"  {b:<8} remote hit {x['remote_us']['median']:.0f} / {x['remote_us']['p90']:.0f} "
                       f"({x['added_us']:+.0f} over raw; the holder named {x['named_holder']:.0%}); "
                       f"nobody holds it {x['miss_us']['median']:.0f} / {x['miss_us']['p90']:.0f}")
    if "redis_vs_replica" in lk:
        out.append(f"  remote hit, redis / replica: {lk['redis_vs_replica']:.2f}x")
    if "store_us_per_read" in lk:
        out.append(f"  the store per Lookup read: {lk['store_us_per_read']:.0f} µs of a server's main thread, "
                   f"{lk['store_cmds_per_read']:.2f} commands (a script's HGETALLs counted)")
    return out
