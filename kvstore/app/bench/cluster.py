"""``kvstore bench cluster``: one multi-turn workload over a fleet of three daemons, routed
round-robin, once with each daemon alone (a miss is recomputed) and with pulls (a miss asks the
daemon to pull the prefix from the peer that holds it): hit rate and mean time-to-KV per
request. Pulls run on two fleets sharing the etcd: one without KV events, whose daemons ask
every peer advertising the namespace, in turn, and one whose daemons publish their KV events,
so a pull asks the peer the cluster prefix directory says holds the chain (and none when nobody
does). With ``--policy``, a further run acts on each Lookup's advice (load, pull or recompute)
instead of always pulling, and counts how often each was advised.

A fleet: a private etcd (Debian's ``etcd-server``), three ``kvstore serve`` processes on
loopback, each with its transfer listener and a mutual-TLS control listener (a throwaway CA and
one certificate per node, its CN the node id, made here). The workload: ``--conversations``
conversations of ``--turns`` turns; turn ``t`` of a conversation sends its whole history
(``--first-tokens`` + ``t`` x ``--turn-tokens`` tokens), so each turn extends the prefix of
the one before. Requests go turn by turn, conversation by conversation, to daemon
``i mod 3``: a conversation's next turn lands on another daemon than its last one.

Per request, as an engine's connector would: Lookup on the daemon the request was routed to;
with pulls, a Pull of the blocks it lacks (the daemon asks the peers its holder source names);
then Get of every block now local into the worker's buffer (checked bit-exact);
the rest of the prompt is recomputed; then the whole prompt's KV is Put, as the engine writes
it after prefill (not timed: it overlaps decoding). Time-to-KV = the measured Lookup + Pull +
Get (into one worker buffer, faulted in beforehand as an engine's KV cache is; the daemons'
arenas are pre-faulted, as in production), plus the recompute, modelled as
``tokens / --prefill-tokens-per-s`` (linear: a model whose prefill runs at that rate; there is
no model here). The runs on the first fleet use its daemons in namespaces of their own (one
model id each), so none sees another's blocks; the ratios of each run's mean time-to-KV to
alone's are the figures (this host is noisy: absolute times mean little).
"""

from __future__ import annotations

import argparse
import datetime
import ipaddress
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from kvstore.app.local import free_port
from kvstore.config import EVENTS_EXTRA

NODES = ("bench-a", "bench-b", "bench-c")


def fleet_certificates(d: Path, names, ips=("127.0.0.1",)) -> Path:
    """A throwaway CA (``ca.crt``) and, per name, ``<name>.crt`` / ``<name>.key``: CN and a DNS
    SAN the name (a daemon's node id: what a holder checks a Push's requester against), IP SANs
    ``ips`` (the addresses peers dial). Needs the ``cryptography`` package. Keys are 0600."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    d.mkdir(mode=0o700, parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc)

    def cert(name, issuer=None, issuer_key=None):
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        b = (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer.subject if issuer else subject)
             .public_key(key.public_key()).serial_number(x509.random_serial_number())
             .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
             .add_extension(x509.BasicConstraints(ca=issuer is None, path_length=None), critical=True))
        if issuer is not None:
            sans = [x509.DNSName(name)] + [x509.IPAddress(ipaddress.ip_address(a)) for a in sorted(set(ips))]
            b = b.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        return b.sign(issuer_key or key, hashes.SHA256()), key

    def write(name, c, k):
        (d / f"{name}.crt").write_bytes(c.public_bytes(serialization.Encoding.PEM))
        fd = os.open(d / f"{name}.key", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(k.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                    serialization.NoEncryption()))

    ca, ca_key = cert("kvstore-fleet-ca")
    write("ca", ca, ca_key)
    for name in names:
        write(name, *cert(name, ca, ca_key))
    return d


class LocalEtcd:
    """A one-member etcd on a private data directory and free loopback ports."""

    def __init__(self, work: Path) -> None:
        binary = shutil.which("etcd")
        if binary is None:
            raise SystemExit("kvstore bench: needs etcd on PATH (Debian: apt-get install etcd-server)")
        self.endpoint = f"127.0.0.1:{free_port()}"
        client, peer = f"http://{self.endpoint}", f"http://127.0.0.1:{free_port()}"
        (work / "etcd").mkdir(mode=0o700)
        with open(work / "etcd.log", "wb") as log:
            self.proc = subprocess.Popen([binary, "--name", "b", "--data-dir", str(work / "etcd"),
                                          "--listen-client-urls", client, "--advertise-client-urls", client,
                                          "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                                          "--initial-cluster", f"b={peer}", "--log-level", "warn"],
                                         stdout=log, stderr=subprocess.STDOUT)
        from kvstore.cluster.etcd import Etcd, EtcdError

        c = Etcd([self.endpoint])
        try:
            deadline = time.monotonic() + 30
            while True:
                try:
                    c.put(b"/bench-ready", b"1", timeout_s=1.0)  # a write needs a leader, not just a socket
                    return
                except EtcdError:
                    if self.proc.poll() is not None or time.monotonic() > deadline:
                        self.stop()
                        raise SystemExit("kvstore bench: etcd did not start:\n"
                                         + (work / "etcd.log").read_text(errors="replace")[-2000:]) from None
                    time.sleep(0.05)
        finally:
            c.close()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def daemon_flags(a, etcd: str, pki: Path, name: str, dram: int, prefix: str = "/kvstore",
                 events: bool = False) -> tuple[str, ...]:
    """``prefix``: the fleet's etcd key prefix (two fleets share the bench's etcd); ``events``:
    the daemon publishes its KV events, so its peers' directories know what it holds."""
    pub = ("--events-publish", f"tcp://127.0.0.1:{free_port()}",
           "--events-replay", f"tcp://127.0.0.1:{free_port()}") if events else ()
    return (*pub, "--cluster-prefix", prefix,
            "--cluster-etcd-endpoints", etcd, "--cluster-node-id", name, "--cluster-lease-ttl-s", "6",
            "--cluster-etcd-timeout-s", "1", "--server-reaper-interval-s", "0.2",
            "--server-tcp-listen", f"127.0.0.1:{free_port()}", "--server-tls-cert-file", str(pki / f"{name}.crt"),
            "--server-tls-key-file", str(pki / f"{name}.key"), "--server-tls-client-ca-file", str(pki / "ca.crt"),
            "--transport-listen", f"127.0.0.1:{free_port()}", "--transport-timeout-s", str(a.pull_deadline_s),
            "--dram-capacity-bytes", str(dram), "--dram-extent-bytes", "4MiB",  # pre-faulted, as in production
            # the daemons' recompute price is the one modelled here (linear: no parameter count)
            "--policy-prefill-tokens-per-s", str(a.prefill_tokens_per_s))


def _wait_advertised(etcd: str, names, n_namespaces: int, prefix: str = "/kvstore", timeout_s: float = 30.0) -> None:
    """Until every daemon's record in etcd (under ``prefix``) lists ``n_namespaces`` namespaces
    (their workers registered): a pull asks only peers that advertise the namespace."""
    from kvstore.cluster.cli import collect
    from kvstore.cluster.etcd import Etcd

    c = Etcd([etcd])
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            seen = {m["node_id"]: m["namespaces"] for m in collect(c, prefix, 2.0)["members"]}
            if all(seen.get(n, 0) >= n_namespaces for n in names):
                return
            if time.monotonic() > deadline:
                raise SystemExit(f"kvstore bench cluster: daemons not all registered with their namespaces: {seen}")
            time.sleep(0.1)
    finally:
        c.close()


def _wait_streams(sockets: list[str], timeout_s: float = 30.0) -> None:
    """Until every daemon's directory reads each of its peers' event streams live (its first
    snapshot applied): before that a Lookup or a pull would not know what the peers hold."""
    from kvstore.clients import KVStoreClient
    from kvstore.v1 import kvstore_pb2 as pb

    clients = [KVStoreClient(s) for s in sockets]
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            live = [sum(x.state == pb.STREAM_LIVE and x.lag_s >= 0 for x in c.stats().streams) for c in clients]
            if all(n == len(sockets) - 1 for n in live):
                return
            if time.monotonic() > deadline:
                raise SystemExit(f"kvstore bench cluster: the directories do not read every peer's events: {live}")
            time.sleep(0.1)
    finally:
        for c in clients:
            c.close()


def _events_missing() -> str:
    """Why the second fleet's daemons could not publish KV events here ("" if they can)."""
    import importlib.util

    missing = [m for m in ("zmq", "msgspec") if importlib.util.find_spec(m) is None]
    return f"{' and '.join(missing)} not installed ({EVENTS_EXTRA})" if missing else ""


def workload(a) -> list[tuple[int, int]]:
    """The requests in order: (conversation, prompt tokens)."""
    return [(c, a.first_tokens + t * a.turn_tokens) for t in range(a.turns) for c in range(a.conversations)]


def _run(a, layout, model: str, sockets: list[str], mode: str, kv: list[np.ndarray], tokens: list[np.ndarray],
         router=None) -> dict:
    """``mode``: ``alone`` (load what is local), ``pulls`` (always pull what is missing) or
    ``policy`` (act on Lookup's advice: load, pull or recompute). ``router``
    (:mod:`kvstore.cluster.routing`, over the daemons' node ids in :data:`NODES` order) picks
    each request's daemon, from the first daemon's RouteHints where it needs them (its time is
    part of the request's time-to-KV); without one, requests go round-robin."""
    import grpc

    from kvstore.clients import KVStoreClient
    from kvstore.v1 import peer_pb2 as ppb, peer_pb2_grpc as peer_grpc

    clients = []
    for s in sockets:
        c = KVStoreClient(s, timeout_s=60)
        c.register(layout, model)
        clients.append(c)
    channels = [grpc.insecure_channel(f"unix:{s}") for s in sockets]
    peers = [peer_grpc.PeerStub(ch) for ch in channels]
    bt = layout.block_tokens
    per_token = layout.block_bytes // bt
    # The worker's KV buffer, faulted in once, as an engine's is: fresh pages would cost more
    # to touch (0.3 GB/s) than the load itself.
    worker = np.ones(max(n for _, n in workload(a)) * per_token, np.uint8)
    rows = []
    choices = {"load": 0, "pull": 0, "recompute": 0}
    try:
        for i, (conv, n) in enumerate(workload(a)):
            toks = tokens[conv][:n]
            keys = clients[0].keys(toks)  # one namespace on every daemon: the same keys
            r0 = time.perf_counter()
            if router is None:
                d = i % len(sockets)
            else:
                d = NODES.index(router.pick(clients[0].route_hints(keys=keys) if router.needs_hints else None))
            t_route = time.perf_counter() - r0 if router is not None and router.needs_hints else 0.0
            c = clients[d]
            t0 = time.perf_counter()
            res = c.lookup_keys(keys, ask_peers=mode == "policy")  # the others cannot act on remote hits
            local = res.hit_blocks
            have, pulled, t_pull = local, 0, 0.0
            if mode == "policy":
                choices[res.advice] += 1
                p0 = time.perf_counter()
                have = c.advised_blocks(res, keys, a.pull_deadline_s)
                if res.advice == "pull":
                    t_pull, pulled = time.perf_counter() - p0, max(0, have - local)
            elif mode == "pulls" and have < len(keys):
                p0 = time.perf_counter()
                r = peers[d].Pull(ppb.PullRequest(session_id=c.session_id, keys=b"".join(keys),
                                                  deadline_s=a.pull_deadline_s), timeout=a.pull_deadline_s + 5)
                t_pull = time.perf_counter() - p0
                have, pulled = r.blocks, r.pulled
            t_get = 0.0
            if have:
                out = worker[:have * bt * per_token].view(np.float16).reshape(layout.tensor_shape(have * bt))
                g0 = time.perf_counter()
                got = c.get(toks[:have * bt], out)
                t_get = time.perf_counter() - g0
            measured = time.perf_counter() - t0
            if have and (got != have * bt or out.tobytes() != kv[conv][:, :, :have * bt].tobytes()):
                raise SystemExit(f"kvstore bench cluster: request {i}: the blocks read differ from those written")
            recompute = (n - have * bt) / a.prefill_tokens_per_s
            c.put(toks, np.ascontiguousarray(kv[conv][:, :, :n]))  # the engine's KV of the whole prompt, after prefill
            rows.append({"daemon": d, "tokens": n, "local_tokens": local * bt, "pulled_tokens": pulled * bt,
                         "recomputed_tokens": n - have * bt, "pull_s": t_pull, "get_s": t_get,
                         "measured_s": measured, "recompute_s": recompute, "route_s": t_route,
                         "time_to_kv_s": t_route + measured + recompute})
    finally:
        for ch in channels:
            ch.close()
        for c in clients:
            c.close()
    total = sum(r["tokens"] for r in rows)
    local = sum(r["local_tokens"] for r in rows)
    pulled = sum(r["pulled_tokens"] for r in rows)
    pull_rows = [r for r in rows if r["pulled_tokens"]]
    missed = [r["pull_s"] for r in rows if r["pull_s"] and not r["pulled_tokens"]]  # asked, nothing anywhere
    return {"mode": mode, **({"choices": choices} if mode == "policy" else {}), "requests": len(rows), "prompt_tokens": total, "local_hit_tokens": local,
            "pulled_tokens": pulled, "recomputed_tokens": total - local - pulled,
            "hit_rate": round((local + pulled) / total, 4), "local_hit_rate": round(local / total, 4),
            "mean_time_to_kv_s": statistics.fmean(r["time_to_kv_s"] for r in rows),
            "mean_measured_s": statistics.fmean(r["measured_s"] for r in rows),
            "mean_route_s": statistics.fmean(r["route_s"] for r in rows),
            "mean_recompute_s": statistics.fmean(r["recompute_s"] for r in rows),
            "pull_GBps": (pulled * layout.block_bytes / bt / sum(r["pull_s"] for r in pull_rows) / 1e9) if pull_rows else None,
            # what a pull that found nothing cost: asking every peer, or (directory) none
            "missed_pulls": len(missed), "mean_missed_pull_s": statistics.fmean(missed) if missed else None,
            "rows": rows}


def bench(a) -> dict:
    from kvstore.layout import KVLayout
    from kvstore.app.local import start_daemon

    layout = KVLayout(a.layers, a.kv_heads, a.head_dim, "fp16", "mha", block_tokens=16)
    if a.first_tokens % 16 or a.turn_tokens % 16 or a.first_tokens <= 0 or a.turn_tokens <= 0:
        raise SystemExit("kvstore bench cluster: --first-tokens and --turn-tokens must be positive multiples of 16")
    longest = a.first_tokens + (a.turns - 1) * a.turn_tokens
    rng = np.random.default_rng(0)
    tokens = [rng.integers(0, 32000, longest) for _ in range(a.conversations)]
    kv = [rng.integers(0, 2**16, layout.tensor_shape(longest), dtype=np.uint16).view(np.float16)
          for _ in range(a.conversations)]
    # Every conversation's longest prompt, in every run's namespace, fits each daemon's DRAM (with
    # an extent of slack per namespace): nothing is evicted, so the hit rates are the routing's alone.
    per_ns = a.conversations * longest * layout.block_bytes // layout.block_tokens

    def dram(namespaces: int) -> int:
        return max(64 << 20, (-(-namespaces * per_ns // (4 << 20)) + 4) * (4 << 20))
    models = ("bench-cluster-alone", "bench-cluster-pulls", "bench-cluster-policy")[:3 if a.policy else 2]
    from kvstore.cluster.routing import ROUTERS

    route_models = tuple(f"bench-cluster-route-{name}" for name in ROUTERS) if a.routers else ()
    work = Path(tempfile.mkdtemp(prefix="kvstore-bench-cluster-"))
    etcd, daemons = None, []
    try:
        pki = fleet_certificates(work / "pki", NODES)
        etcd = LocalEtcd(work)
        # Two fleets in the one etcd (their own key prefixes): the first without KV events (a
        # pull asks each peer advertising the namespace), the second publishing them, so each
        # daemon's cluster prefix directory names the peer holding a chain (and no peer at all
        # for a chain nobody holds).
        no_directory = _events_missing()
        fleets = [(work, "/kvstore", False, dram(len(models)))]
        if not no_directory:
            fleets.append((work / "directory", "/kvstore-directory", True, dram(1 + len(route_models))))
        with ThreadPoolExecutor(len(fleets) * len(NODES)) as ex:
            futs = [ex.submit(start_daemon, where, n, *daemon_flags(a, etcd.endpoint, pki, n, size, prefix, events))
                    for where, prefix, events, size in fleets for n in NODES]
            failed = None
            for f in futs:  # every one that started is stopped below, whichever did not
                try:
                    daemons.append(f.result())
                except RuntimeError as e:
                    failed = failed or e
            if failed:
                raise SystemExit(f"kvstore bench cluster: a daemon did not start: {failed}") from None
        sockets = [d.socket_path for d in daemons[:len(NODES)]]
        dir_sockets = [d.socket_path for d in daemons[len(NODES):]]
        # Every namespace registered on every daemon before anything is timed, so each is advertised.
        from kvstore.clients import KVStoreClient

        holders = []
        for fleet, names in ((sockets, models), (dir_sockets, ("bench-cluster-directory", *route_models))):
            for s in fleet:
                for model in names:
                    c = KVStoreClient(s)
                    c.register(layout, model)
                    holders.append(c)
        _wait_advertised(etcd.endpoint, NODES, len(models))
        if dir_sockets:
            _wait_advertised(etcd.endpoint, NODES, 1, prefix="/kvstore-directory")
            _wait_streams(dir_sockets)
        alone = _run(a, layout, "bench-cluster-alone", sockets, "alone", kv, tokens)
        pulled = _run(a, layout, "bench-cluster-pulls", sockets, "pulls", kv, tokens)
        advised = _run(a, layout, "bench-cluster-policy", sockets, "policy", kv, tokens) if a.policy else None
        directed = _run(a, layout, "bench-cluster-directory", dir_sockets, "pulls", kv, tokens) if dir_sockets else None
        # Routers on the directory fleet, each in its own namespace, every request acting on its
        # daemon's advice as an engine's connector does.
        routed = {name: _run(a, layout, f"bench-cluster-route-{name}", dir_sockets, "policy", kv, tokens,
                             router=cls(NODES)) for name, cls in ROUTERS.items()} if dir_sockets and a.routers else {}
        for c in holders:
            c.close()
    finally:
        with ThreadPoolExecutor(max(1, len(daemons))) as ex:  # their shutdowns overlap
            list(ex.map(lambda d: d.stop(30), daemons))
        if etcd is not None:
            etcd.stop()
        shutil.rmtree(work, ignore_errors=True)
    if not a.rows:
        for r in (alone, pulled, advised, directed, *routed.values()):
            if r is not None:
                r.pop("rows")
    def vs_alone(run: dict | None) -> float | None:  # a run's mean time-to-KV over alone's
        return round(run["mean_time_to_kv_s"] / alone["mean_time_to_kv_s"], 4) if run else None
    extra = {} if advised is None else {"with_policy": advised, "policy_time_to_kv_ratio": vs_alone(advised)}
    if routed:
        extra["routers"] = routed
        extra["routers_vs_round_robin"] = {n: round(x["mean_time_to_kv_s"] / routed["round-robin"]["mean_time_to_kv_s"], 4)
                                           for n, x in routed.items()}
    return {"bench": "cluster", "daemons": len(NODES), "routing": "round-robin",
            "holder_source": "peers advertising the namespace in etcd (membership)",
            "directory_holder_source": "the cluster prefix directory, from the peers' KV events",
            "conversations": a.conversations, "turns": a.turns, "first_tokens": a.first_tokens,
            "turn_tokens": a.turn_tokens, "block_bytes": layout.block_bytes,
            "layout": {"layers": a.layers, "kv_heads": a.kv_heads, "head_dim": a.head_dim, "dtype": "fp16"},
            "prefill_tokens_per_s": a.prefill_tokens_per_s, "recompute_model": "tokens / prefill_tokens_per_s",
            # a pull beats recomputing when it moves a token's KV faster than prefill makes it
            "break_even_pull_GBps": round(a.prefill_tokens_per_s * layout.block_bytes / 16 / 1e9, 3),
            "transport": "tcp over loopback", "cpus": os.cpu_count(), "alone": alone, "with_pulls": pulled,
            "time_to_kv_ratio": vs_alone(pulled), "with_directory": directed, "directory_skipped": no_directory,
            "directory_time_to_kv_ratio": vs_alone(directed), **extra}


def table(r: dict) -> str:
    """The JSON result as a table."""
    out = [f"{r['conversations']} conversations x {r['turns']} turns ({r['first_tokens']} tokens, then +{r['turn_tokens']} "
           f"a turn) over {r['daemons']} daemons, round-robin; {r['block_bytes'] >> 10} KiB blocks of 16 tokens; "
           f"recompute modelled at {r['prefill_tokens_per_s']:,.0f} tokens/s",
           f"{'':<12} {'hit rate':>9} {'local':>7} {'pulled':>7} {'recomputed':>11} {'time-to-KV':>11} "
           f"{'measured':>9} {'modelled':>9} {'pull GB/s':>10}"]
    runs = [("alone", r["alone"]), ("with pulls", r["with_pulls"])] + \
        ([("w/ directory", r["with_directory"])] if r["with_directory"] else []) + \
        ([("by policy", r["with_policy"])] if "with_policy" in r else [])
    for label, x in runs:
        gbps = f"{x['pull_GBps']:.2f}" if x["pull_GBps"] else "-"
        out.append(f"{label:<12} {x['hit_rate']:>9.1%} {x['local_hit_tokens']:>7} {x['pulled_tokens']:>7} "
                   f"{x['recomputed_tokens']:>11} {x['mean_time_to_kv_s'] * 1e3:>8.1f} ms {x['mean_measured_s'] * 1e3:>6.1f} ms "
                   f"{x['mean_recompute_s'] * 1e3:>6.1f} ms {gbps:>10}")
    out.extend([f"mean time-to-KV with pulls / alone: {r['time_to_kv_ratio']:.2f} (a pull pays off above "
               f"{r['break_even_pull_GBps']:.2f} GB/s: the modelled prefill rate x KV bytes per token)",
               f"mean time-to-KV with pulls directed by the cluster prefix directory / alone: {r['directory_time_to_kv_ratio']:.2f}"
               if r["with_directory"] else f"no run with the cluster prefix directory: {r['directory_skipped']}"])
    for label, x in (("with pulls", r["with_pulls"]), ("w/ directory", r["with_directory"])):
        if x and x["missed_pulls"]:
            out.append(f"{label}: {x['missed_pulls']} pulls found the prefix nowhere, {x['mean_missed_pull_s'] * 1e3:.1f} ms each")
    if "routers" in r:
        out.append("routers over the directory fleet, each request acting on its daemon's advice (hints asked of "
                   "the first daemon; their time is in time-to-KV):")
        out.append(f"{'':<12} {'hit rate':>9} {'local':>7} {'pulled':>7} {'recomputed':>11} {'time-to-KV':>11} "
                   f"{'routing':>9} {'vs r-r':>7}")
        for name, x in r["routers"].items():
            out.append(f"{name:<12} {x['hit_rate']:>9.1%} {x['local_hit_tokens']:>7} {x['pulled_tokens']:>7} "
                       f"{x['recomputed_tokens']:>11} {x['mean_time_to_kv_s'] * 1e3:>8.1f} ms "
                       f"{x['mean_route_s'] * 1e3:>6.2f} ms {r['routers_vs_round_robin'][name]:>7.2f}")
    if "with_policy" in r:
        ch = r["with_policy"]["choices"]
        out.append(f"by policy / alone: {r['policy_time_to_kv_ratio']:.2f}; Lookup advised load {ch['load']}, "
                   f"pull {ch['pull']}, recompute {ch['recompute']} times")
    return "\n".join(out)



def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvstore bench cluster", description=__doc__.split("\n\n")[0])
    ap.add_argument("--conversations", type=int, default=8, help="conversations (not a multiple of 3, "
                    "else round-robin sends each conversation back to the same daemon)")
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--first-tokens", type=int, default=256, help="tokens of a conversation's first prompt")
    ap.add_argument("--turn-tokens", type=int, default=128, help="tokens each later turn adds")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--prefill-tokens-per-s", type=float, default=10_000.0,
                    help="the modelled prefill rate a recomputed token costs")
    ap.add_argument("--pull-deadline-s", type=float, default=5.0)
    ap.add_argument("--policy", action="store_true", help="a third run acting on Lookup's advice (load, pull or "
                    "recompute) instead of always pulling, with how often each was chosen")
    ap.add_argument("--routers", action="store_true", help="runs routed by round-robin, by a hit-count router "
                    "and by the hint router (RouteHints), on the directory fleet, acting on Lookup's advice")
    ap.add_argument("--rows", action="store_true", help="with --json: every request's figures too")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    r = bench(a)
    print(json.dumps(r, indent=2) if a.json else table(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
