"""``kvstore`` command line: serve, stats, ls, drop, health, plan, bench."""

from __future__ import annotations

import argparse
import json
import logging
import sys

from kvstore import __version__


def _setup_logging(level: str, as_json: bool) -> None:
    handler = logging.StreamHandler(sys.stderr)
    if as_json:
        class JsonFormatter(logging.Formatter):
            def format(self, r: logging.LogRecord) -> str:
                out = {"ts": self.formatTime(r), "level": r.levelname.lower(), "logger": r.name, "msg": r.getMessage()}
                if r.exc_info:
                    out["exc"] = self.formatException(r.exc_info)
                return json.dumps(out)

        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)


def cmd_serve(args, daemon_cls=None) -> int:
    """``kvstore serve``. ``daemon_cls``: the daemon to run (default :class:`kvstore.daemon.Daemon`;
    the tests run subclasses that inject faults)."""
    from kvstore import config as C
    from kvstore.daemon.main import Daemon, StartupError, run

    _setup_logging("info", False)  # until the config says how: loading it warns of deprecated keys
    try:
        cfg = C.load(args.config, overrides=C.cli_overrides(args))
    except C.ConfigError as e:
        print(f"kvstore serve: config error: {e}", file=sys.stderr)
        return 2
    if args.print_config:
        print(C.to_toml(cfg))
        return 0
    _setup_logging(cfg.server.log_level, cfg.server.log_json)
    try:
        return run(cfg, daemon_cls or Daemon, args.config, C.cli_overrides(args))
    except (StartupError, C.ConfigError) as e:
        print(f"kvstore serve: cannot start: {e}", file=sys.stderr)
        return getattr(e, "exit_code", 2)  # a StartupError says which: 2 = something to change first


def _client(args):
    from kvstore.clients.client import KVStoreClient

    return KVStoreClient(args.socket, timeout_s=args.timeout)


def _fail(e: Exception) -> int:
    print(f"kvstore: {e}", file=sys.stderr)
    return 1


def _stats_dict(resp) -> dict:
    from google.protobuf.json_format import MessageToDict

    d = MessageToDict(resp, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
    for ns in d.get("namespaces", []):
        ns["namespace_id"] = resp.namespaces[d["namespaces"].index(ns)].namespace_id.hex()
    return d


def cmd_stats(args) -> int:
    from kvstore.clients.client import KVStoreError

    try:
        with _client(args) as c:
            resp = c.stats()
    except KVStoreError as e:
        return _fail(e)
    if args.json:
        print(json.dumps(_stats_dict(resp), indent=2))
        return 0
    print(f"kvstore {resp.version}  uptime {resp.uptime_s:.0f} s  hbm_emulated={str(resp.hbm_emulated).lower()}")
    print(f"{'tier':<6} {'capacity GiB':>13} {'used GiB':>10} {'usage':>7} {'blocks':>9}  state")
    for t in resp.tiers:
        name = {1: "hbm", 2: "dram", 3: "nvme"}.get(t.tier, str(t.tier))
        usage = t.used_bytes / t.capacity_bytes if t.capacity_bytes else 0.0
        state = ("emulated " if t.emulated else "") + ("enabled" if t.enabled else f"DISABLED {t.detail}")
        print(f"{name:<6} {t.capacity_bytes / 2**30:>13.3f} {t.used_bytes / 2**30:>10.3f} {usage:>7.1%} {t.blocks:>9}  {state}")
        codec = json.loads(t.detail) if t.enabled and t.detail else {}
        for ns, u in codec.get("namespaces", {}).items():  # a tier with a codec: what it achieves
            print(f"       codec {codec['codec']}: namespace {ns[:16]} {u['blocks']} blocks, {u['raw_bytes'] / 2**20:.1f} MiB "
                  f"in {u['slot_bytes'] / 2**20:.1f} MiB of slots: {u['ratio']:.3f}x")
    print("(GiB = 2^30 bytes)")
    for ln in resp.links:  # in a cluster: the measured link to each peer (priors until timed)
        print(f"peer {ln.node_id:<16} {ln.bytes_per_s / 1e9:>8.3f} GB/s  rtt {ln.rtt_s * 1e3:.2f} ms  "
              f"({ln.pulls} pulls, {ln.round_trips} round trips timed)")
    for k in sorted(resp.counters):
        print(f"  {k} = {resp.counters[k]:g}")
    return 0


def cmd_ls(args) -> int:
    from kvstore.clients.client import KVStoreError

    try:
        with _client(args) as c:
            resp = c.stats()
    except KVStoreError as e:
        return _fail(e)
    rows = [{"namespace": ns.namespace_id.hex(), "model_id": ns.model_id, "block_bytes": ns.block_bytes,
             "sessions": ns.sessions, "blocks": dict(ns.blocks_by_tier), "bytes": dict(ns.bytes_by_tier)}
            for ns in resp.namespaces]
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"{'namespace':<18} {'model':<28} {'block B':>10} {'dram blk':>9} {'nvme blk':>9} {'hbm blk':>8} {'MiB':>10}")
    for r in rows:
        total = sum(r["bytes"].values()) / 2**20
        print(f"{r['namespace'][:16]:<18} {r['model_id'][:28]:<28} {r['block_bytes']:>10} "
              f"{r['blocks'].get('dram', 0):>9} {r['blocks'].get('nvme', 0):>9} {r['blocks'].get('hbm', 0):>8} {total:>10.1f}")
    return 0


def cmd_drop(args) -> int:
    from kvstore.clients.client import KVStoreError
    from kvstore.v1 import kvstore_pb2 as pb

    try:
        with _client(args) as c:
            r = c.call("DropNamespace", pb.DropNamespaceRequest(namespace_id_hex=args.namespace))
    except KVStoreError as e:
        return _fail(e)
    print(f"dropped {r.dropped} blocks; {r.busy} pinned blocks kept (drop again once released)")
    return 0


def cmd_health(args) -> int:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from kvstore.clients.client import default_socket_path

    path = args.socket or default_socket_path()
    try:
        with grpc.insecure_channel(f"unix:{path}") as ch:
            r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=args.timeout)
    except grpc.RpcError as e:
        print(f"NOT SERVING: {path}: {e.code().name}: {e.details()}")
        return 1
    name = health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)
    print(name)
    return 0 if r.status == health_pb2.HealthCheckResponse.SERVING else 1


def _delegate(module: str):
    def run(args) -> int:
        import importlib

        return importlib.import_module(module).main(args.rest)
    return run


def build_parser() -> argparse.ArgumentParser:
    from kvstore import config as C

    p = argparse.ArgumentParser(prog="kvstore", description="Tiered KV-cache daemon for LLM serving")
    p.add_argument("--version", action="version", version=f"kvstore {__version__}")
    sub = p.add_subparsers(dest="cmd", required=True)

    s = sub.add_parser("serve", help="run the daemon", description=(
        "Run the kvstore daemon. Settings come from embedded defaults, then --config FILE (TOML), then "
        "KVSTORE_<SECTION>_<KEY> environment variables, then these flags. Sizes are bytes: a bare number "
        "is bytes, or give a unit (KiB/MiB/GiB = 2^10/2^20/2^30 bytes, KB/MB/GB = 10^3/10^6/10^9 bytes; "
        "unlike kvstore plan, where a bare size is GB); times are seconds."))
    s.add_argument("--config", help="TOML config file", default=None)
    s.add_argument("--print-config", action="store_true", help="print the resolved config as TOML and exit")
    C.add_cli_flags(s)
    s.set_defaults(fn=cmd_serve)

    def client_cmd(name: str, fn, help_: str):
        c = sub.add_parser(name, help=help_)
        c.add_argument("--socket", default=None, help="daemon socket (default: as `kvstore serve` would pick)")
        c.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for the daemon")
        c.set_defaults(fn=fn)
        return c

    client_cmd("stats", cmd_stats, "daemon figures: tiers, counters").add_argument("--json", action="store_true")
    client_cmd("ls", cmd_ls, "namespaces with block counts and bytes per tier").add_argument("--json", action="store_true")
    client_cmd("drop", cmd_drop, "drop every block of a namespace").add_argument("namespace", help="hex id or >= 8-digit prefix")
    client_cmd("health", cmd_health, "exit 0 when the daemon is SERVING")

    pl = sub.add_parser("plan", help="KV sizing and capacity planning from a model config", add_help=False)
    pl.add_argument("rest", nargs=argparse.REMAINDER)
    pl.set_defaults(fn=_delegate(DELEGATED[("plan",)]))

    cl = sub.add_parser("cluster", help="the fleet: members, epochs, lease TTL left, etcd health, event stream lag, "
                       "directory size", add_help=False)
    cl.add_argument("rest", nargs=argparse.REMAINDER)
    cl.set_defaults(fn=_delegate(DELEGATED[("cluster",)]))

    b = sub.add_parser("bench", help="benchmarks against same-run references (raw paths, plain vLLM)")
    bsub = b.add_subparsers(dest="bench", required=True)
    for name, help_ in (("store", "put/get through the daemon vs memcpy; Lookup latency"),
                        ("tiers", "NVMe through the daemon vs fio; promotion latency"),
                        ("transfer", "daemon-to-daemon transfer vs raw socket / ucx"),
                        ("cluster", "3 daemons, multi-turn round-robin workload: hit rate, time-to-KV alone vs pulling"),
                        ("cluster-sim", "the cluster prefix directory for 8-1,024 synthetic daemons: replica vs Redis backend"),
                        ("vllm", "TTFT in real vLLM: no cache, vLLM's prefix cache, kvstore DRAM / NVMe"),
                        ("vllm-offload", "TTFT in real vLLM: kvstore's connector vs OffloadingConnector + kvstore tier"),
                        ("vllm-hybrid", "TTFT of a hybrid model in real vLLM: no cache, vLLM's prefix cache, kvstore"),
                        ("codec", "the block codecs on a trained model's KV: ratio, GB/s per core vs memcpy, lossy error"),
                        ("vllm-lossy", "what a lossy namespace (kv_codec int8 / fp8) does to real vLLM's outputs")):
        bb = bsub.add_parser(name, help=help_, add_help=False)
        bb.add_argument("rest", nargs=argparse.REMAINDER)
        bb.set_defaults(fn=_delegate(DELEGATED[("bench", name)]))
    return p


# Subcommands with parsers of their own, by the words that name them: main() hands them the rest
# of the line; build_parser() lists them for --help.
DELEGATED = {("plan",): "kvstore.app.plan", ("cluster",): "kvstore.cluster.cli", ("bench", "store"): "kvstore.app.bench.store",
             ("bench", "tiers"): "kvstore.app.bench.tiers", ("bench", "transfer"): "kvstore.app.bench.transfer",
             ("bench", "vllm"): "kvstore.app.bench.vllm", ("bench", "cluster"): "kvstore.app.bench.cluster",
             ("bench", "cluster-sim"): "kvstore.app.bench.cluster_sim", ("bench", "vllm-offload"): "kvstore.app.bench.vllm_offload",
             ("bench", "vllm-hybrid"): "kvstore.app.bench.vllm_hybrid", ("bench", "codec"): "kvstore.app.bench.codec",
             ("bench", "vllm-lossy"): "kvstore.app.bench.vllm_lossy"}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # Subcommands with their own parsers get the rest of the line untouched (argparse's
    # REMAINDER drops leading options).
    for prefix, module in DELEGATED.items():
        if tuple(argv[:len(prefix)]) == prefix:
            import importlib

            return importlib.import_module(module).main(argv[len(prefix):])
    args = build_parser().parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
