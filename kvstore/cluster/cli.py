"""``kvstore cluster``: the fleet as etcd holds it (members, their epochs and the TTL left on
their leases) and the health of each etcd endpoint. It reads etcd, not a daemon, so it works
while daemons are down; the endpoints, prefix and TLS files come from ``--config`` ([cluster]),
``KVSTORE_CLUSTER_*`` or the flags, as for ``kvstore serve``."""

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


def main(argv: list[str]) -> int:
    from kvstore import config as C

    p = argparse.ArgumentParser(prog="kvstore cluster", description=__doc__)
    p.add_argument("--config", default=None, help="TOML config file (its [cluster] section)")
    p.add_argument("--etcd-endpoints", default=None, help="comma-separated host:port (default: cluster.etcd_endpoints)")
    p.add_argument("--prefix", default=None, help="etcd key prefix (default: cluster.prefix)")
    p.add_argument("--timeout", type=float, default=3.0, help="seconds per etcd call")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    over = {k: v for k, v in (("cluster.etcd_endpoints", args.etcd_endpoints), ("cluster.prefix", args.prefix)) if v}
    try:
        cfg = C.load(args.config, overrides=over).cluster
    except C.ConfigError as e:
        print(f"kvstore cluster: {e}", file=sys.stderr)
        return 2
    if not cfg.endpoints():
        print("kvstore cluster: no etcd endpoints: set --etcd-endpoints or cluster.etcd_endpoints", file=sys.stderr)
        return 2
    etcd = Etcd(cfg.endpoints(), EtcdTls(cfg.etcd_ca_file, cfg.etcd_cert_file, cfg.etcd_key_file))
    try:
        out = collect(etcd, cfg.prefix, args.timeout)
    except EtcdError as e:
        print(f"kvstore cluster: {e}", file=sys.stderr)
        return 1
    finally:
        etcd.close()
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        for h in out["etcd"]:
            print(f"etcd {h['endpoint']}: " + (f"healthy, v{h['version']}{', leader' if h['leader'] else ''}, "
                                              f"{h['db_bytes'] / 2**20:.1f} MiB" if h["healthy"] else f"UNHEALTHY: {h['error']}"))
        print(f"{'NODE':<20} {'EPOCH':>5} {'TTL LEFT':>8}  {'TRANSFER':<22} {'NAMESPACES':>10}")
        for m in out["members"]:
            print(f"{m['node_id']:<20} {m['epoch']:>5} {str(m['lease_ttl_s']) + ' s':>8}  {m['transfer_addr'] or '-':<22} "
                  f"{m['namespaces']:>10}")
    return 0 if all(h["healthy"] for h in out["etcd"]) else 1
