"""``kvstore cluster``: the fleet as etcd holds it (members, their epochs and the TTL left on
their leases) and the health of each etcd endpoint, then, from the local daemon's Stats, the
peer event streams its prefix directory reads (state, lag) and the directory's size. The etcd
part reads etcd, not a daemon, so it works while daemons are down (the daemon part then says it
got no answer); the endpoints, prefix and TLS files come from ``--config`` ([cluster]),
``KVSTORE_CLUSTER_*`` or the flags, as for ``kvstore serve``, and the daemon's socket from
``--socket`` or the same config's ``server.socket_path``."""

from __future__ import annotations

import argparse
import json
import sys

from kvstore.cluster.etcd import Etcd, EtcdError, EtcdTls
from kvstore.cluster.member import Member


def collect(etcd: Etcd, prefix: str, timeout_s: float) -> dict:
    """``{"members": [...], "etcd": [...]}``; a member's ``lease_ttl_s`` is -1 once its lease is gone."""
    health = []
    for endpoint, st in etcd.status(timeout_s):
        if isinstance(st, EtcdError):
            health.append({"endpoint": endpoint, "healthy": False, "error": str(st)})
        else:
            health.append({"endpoint": endpoint, "healthy": True, "version": st.version, "leader": st.leader == st.header.member_id,
                           "db_bytes": st.dbSize, "raft_index": st.raftIndex, "errors": list(st.errors)})
    members = []
    if any(h["healthy"] for h in health):
        kvs, _ = etcd.get_prefix(prefix.encode() + b"/members/", timeout_s)
        for kv in kvs:
            try:
                m = Member.from_json(kv.value)
            except ValueError:
                continue
            members.append({"node_id": m.node_id, "epoch": m.epoch, "lease_ttl_s": etcd.time_to_live(kv.lease, timeout_s),
                            "transfer_addr": m.transfer_addr, "events_addr": m.events_addr,
                            "namespaces": len(m.namespaces), "capabilities": m.capabilities})
    return {"members": members, "etcd": health}


def daemon_view(socket_path: str, timeout_s: float) -> dict:
    """The local daemon's view from its Stats: ``{"socket", "streams": [...], "directory": {...}}``
    (``directory`` None when it keeps no prefix directory), or ``{"socket", "error"}`` when it
    does not answer. A stream's ``lag_s``/``next_seq``/``last_batch_age_s`` are None until known."""
    import grpc

    from kvstore.v1 import kvstore_pb2 as pb
    from kvstore.v1 import kvstore_pb2_grpc as pb_grpc

    try:
        with grpc.insecure_channel(f"unix:{socket_path}") as ch:
            r = pb_grpc.KVStoreStub(ch).Stats(pb.StatsRequest(), timeout=timeout_s)
    except grpc.RpcError as e:
        return {"socket": socket_path, "error": f"{e.code().name}: {e.details()}"}
    streams = [{"node_id": s.node_id, "epoch": s.epoch, "state": pb.StreamState.Name(s.state)[len("STREAM_"):].lower(),
                "next_seq": s.next_seq if s.next_seq >= 0 else None, "entries": s.entries, "batches": s.batches,
                "lag_s": s.lag_s if s.lag_s >= 0 else None, "held_batches": s.held_batches,
                "last_batch_age_s": s.last_batch_age_s if s.last_batch_age_s >= 0 else None,
                "replays": s.replays, "snapshots": s.snapshots, "drops": s.drops} for s in r.streams]
    directory = ({"entries": r.directory.entries, "blocks": r.directory.blocks,
                  "approx_bytes": r.directory.approx_bytes, "backend": r.directory.backend or "replica"}
                 if r.HasField("directory") else None)
    return {"socket": socket_path, "streams": streams, "directory": directory}


def _print(out: dict) -> None:
    for h in out["etcd"]:
        print(f"etcd {h['endpoint']}: " + (f"healthy, v{h['version']}{', leader' if h['leader'] else ''}, "
                                          f"{h['db_bytes'] / 2**20:.1f} MiB" if h["healthy"] else f"UNHEALTHY: {h['error']}"))
    print(f"{'NODE':<20} {'EPOCH':>5} {'TTL LEFT':>8}  {'TRANSFER':<22} {'NAMESPACES':>10} {'DIRECTORY':>9}")
    for m in out["members"]:
        print(f"{m['node_id']:<20} {m['epoch']:>5} {str(m['lease_ttl_s']) + ' s':>8}  {m['transfer_addr'] or '-':<22} "
              f"{m['namespaces']:>10} {m['capabilities'].get('directory', 'replica'):>9}")
    d = out["daemon"]
    if "error" in d:
        print(f"daemon at {d['socket']}: no answer ({d['error']}); streams and directory size not shown")
        return
    if d["directory"] is None:
        print(f"daemon at {d['socket']}: keeps no cluster prefix directory (no [cluster], or no pyzmq)")
        return
    size = d["directory"]
    approx = size["approx_bytes"]
    approx_s = f"~{approx / 2**20:.1f} MiB (2^20 bytes)" if approx >= 2**20 else f"~{approx / 2**10:.1f} KiB (2^10 bytes)"
    if size["backend"] == "redis":
        print(f"daemon at {d['socket']}: directory in the Redis/Valkey store; this node's {size['entries']} entries, "
              f"{approx_s} here for them (cluster.redis_nodes; the store holds the fleet's)")
        return
    print(f"daemon at {d['socket']}: directory {size['entries']} entries, {size['blocks']} blocks, {approx_s}")
    print(f"{'STREAM FROM':<20} {'EPOCH':>5} {'STATE':<8} {'LAG':>8} {'HELD':>5} {'ENTRIES':>9} {'BATCHES':>9} "
          f"{'REPLAYS':>7} {'SNAPSHOTS':>9} {'DROPS':>5}")
    for s in d["streams"]:
        lag = "-" if s["lag_s"] is None else f"{s['lag_s']:.2f} s"
        print(f"{s['node_id']:<20} {s['epoch']:>5} {s['state']:<8} {lag:>8} {s['held_batches']:>5} {s['entries']:>9} "
              f"{s['batches']:>9} {s['replays']:>7} {s['snapshots']:>9} {s['drops']:>5}")


def main(argv: list[str]) -> int:
    from kvstore import config as C

    p = argparse.ArgumentParser(prog="kvstore cluster", description=__doc__)
    p.add_argument("--config", default=None, help="TOML config file (its [cluster] and server.socket_path)")
    p.add_argument("--etcd-endpoints", default=None, help="comma-separated host:port (default: cluster.etcd_endpoints)")
    p.add_argument("--prefix", default=None, help="etcd key prefix (default: cluster.prefix)")
    p.add_argument("--socket", default=None, help="the local daemon's socket (default: server.socket_path)")
    p.add_argument("--timeout", type=float, default=3.0, help="seconds per etcd call, and for the daemon's answer")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    over = {k: v for k, v in (("cluster.etcd_endpoints", args.etcd_endpoints), ("cluster.prefix", args.prefix),
                              ("server.socket_path", args.socket)) if v}
    try:
        full = C.load(args.config, overrides=over)
    except C.ConfigError as e:
        print(f"kvstore cluster: {e}", file=sys.stderr)
        return 2
    cfg = full.cluster
    if not cfg.endpoints():
        print("kvstore cluster: no etcd endpoints: set --etcd-endpoints or cluster.etcd_endpoints", file=sys.stderr)
        return 2
    try:
        etcd = Etcd(cfg.endpoints(), EtcdTls(cfg.etcd_ca_file, cfg.etcd_cert_file, cfg.etcd_key_file))
    except ValueError as e:  # a TLS file that is not a regular file, or cannot be read
        print(f"kvstore cluster: {e}", file=sys.stderr)
        return 2
    try:
        out = collect(etcd, cfg.prefix, args.timeout)
    except EtcdError as e:
        print(f"kvstore cluster: {e}", file=sys.stderr)
        return 1
    finally:
        etcd.close()
    out["daemon"] = daemon_view(full.resolved_socket_path(), args.timeout)
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        _print(out)
    return 0 if all(h["healthy"] for h in out["etcd"]) else 1
