"""``kvstore serve``: builds the tiers and the core from a Config, serves gRPC on the unix socket,
hands the arena out over ``<socket>.arena``, runs the lease and session reaper and exports /metrics.

Threads: gRPC workers (each RPC takes ``Core.lock`` for its metadata step), the arena handout
thread, the reaper, and the tier-movement workers once those tiers are enabled.
"""

from __future__ import annotations

import hmac
import itertools
import json
import logging
import os
import signal
import socket
import stat
import threading
import time
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvstore import __version__, doorbell
from kvstore.config import Config
from kvstore.core import Core
from kvstore.errors import Code, KVError
from kvstore.index import BlockState
from kvstore.metrics import Metrics
from kvstore.policy import LoadPolicy, PrefillCostModel
from kvstore.service import KVStoreService
from kvstore.tiers.arena import SHMEM_THP, Arena, send_fd, shmem_thp_mode
from kvstore.tiers.base import TierKind
from kvstore.tiers.dram import DramTier
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc

log = logging.getLogger("kvstore.daemon")
SERVICE_NAME = "kvstore.v1.KVStore"
SESSION_EXPIRY_BATCH = 64  # sessions ended per hold of the core lock by the reaper


class StartupError(RuntimeError):
    """The daemon cannot start; the message says why and what to change."""


def _prepare_socket_path(path: str) -> None:
    d = os.path.dirname(path) or "."
    if not os.path.isdir(d):
        os.makedirs(d, mode=0o700, exist_ok=True)
    st = os.stat(d)
    if st.st_uid != os.getuid():
        raise StartupError(f"server.socket_path: directory {d} belongs to uid {st.st_uid}, not us; choose another path")
    if os.path.exists(path):
        if not stat.S_ISSOCK(os.stat(path).st_mode):
            raise StartupError(f"server.socket_path: {path} exists and is not a socket")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(path)
        except OSError:
            os.unlink(path)  # stale socket of a dead daemon
        else:
            raise StartupError(f"server.socket_path: another daemon is serving on {path}")
        finally:
            probe.close()


class TokenInterceptor(grpc.ServerInterceptor):
    """Refuses calls without ``authorization: Bearer <token>`` (health checks included)."""

    def __init__(self, token: str) -> None:
        self.expected = f"Bearer {token}"

        def deny(request, context):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token (authorization metadata)")

        self._deny = grpc.unary_unary_rpc_method_handler(deny)

    def intercept_service(self, continuation, details):
        md = dict(details.invocation_metadata or ())
        if hmac.compare_digest(md.get("authorization", ""), self.expected):
            return continuation(details)
        return self._deny


class Daemon:
    def __init__(self, cfg: Config, config_path: str | None = None, cli_overrides: dict | None = None) -> None:
        self.cfg = cfg
        self.config_path = config_path
        self.cli_overrides = cli_overrides or {}
        self.tcp_server = None
        self.started = time.monotonic()
        self.metrics = Metrics()
        self.socket_path = cfg.resolved_socket_path()
        self.arena_socket = self.socket_path + ".arena"
        self.stopping = threading.Event()
        self.hbm_emulated = False
        _prepare_socket_path(self.socket_path)
        dram_bytes = cfg.resolved_dram_bytes()
        thp = shmem_thp_mode()
        log.info("creating %.2f GiB DRAM arena (prefault=%s, shared-memory huge pages: %s%s)", dram_bytes / 2**30,
                 cfg.dram.prefault, thp, "" if thp in ("advise", "always", "within_size", "force") else
                 "; set advise in " + SHMEM_THP + " for ~25% faster copies")
        try:  # the doorbell cells live just past the slots
            self.arena = Arena(dram_bytes + doorbell.REGION_BYTES, prefault=cfg.dram.prefault)
        except OSError as e:
            raise StartupError(f"dram.capacity_bytes: cannot create a {dram_bytes}-byte arena: {e}") from None
        self.dram = DramTier(self.arena, cfg.dram.extent_bytes, dram_bytes)
        self.core = Core(self.dram, lease_ttl_s=cfg.server.lease_ttl_s, session_ttl_s=cfg.server.session_ttl_s,
                         max_keys=cfg.server.max_keys_per_request, metrics=self.metrics)
        self.core.doorbells = doorbell.Doorbells(self.arena.buf, dram_bytes)
        self.core.ns_quota_bytes = cfg.dram.namespace_quota_bytes
        self.policy = LoadPolicy()
        self.server: grpc.Server | None = None
        self._threads: list[threading.Thread] = []

    # --- hooks the servicer calls; later tiers and the transport extend them --------------
    def on_register(self, session) -> None:
        st = session.ns
        # Without a parameter count the cost model prices recompute as tokens / throughput
        # (no quadratic attention term).
        params = st.model_params or self.cfg.policy.model_params
        st.cost = PrefillCostModel.for_layout(
            st.ns.layout, params=params, tokens_per_s=st.prefill_tokens_per_s or self.cfg.policy.prefill_tokens_per_s)

    def advise(self, session, hits, tiers: bytes) -> dict:
        """Load-or-recompute advice for the matched prefix, from measured bandwidths and the
        namespace's prefill cost model. Called under the core lock."""
        if not hits:
            return {"load_blocks": 0, "reason": "no cached prefix"}
        st = session.ns
        runs = [(TierKind(t).name.lower(), len(list(g))) for t, g in itertools.groupby(tiers)]
        d = self.policy.decide(runs, block_tokens=st.ns.layout.block_tokens, block_bytes=st.block_bytes, cost=st.cost)
        if d.outcome.value in ("load", "recompute", "partial"):
            self.metrics.policy_decisions.labels(decision=d.outcome.value).inc()
        return {"load_blocks": d.load_blocks, "est_load_s": d.load_s, "est_recompute_s": d.all_recompute_s,
                "reason": d.reason}

    def after_commit(self, blocks) -> None:
        pass

    @property
    def durable_commit(self) -> bool:
        """Commits wait for a lower tier (see NodeDaemon)."""
        return False

    def make_resident(self, session, keys: list[bytes], wait_s: float) -> None:
        pass

    def prefetch(self, session, keys: list[bytes], target: TierKind, deadline_s: float) -> int:
        raise KVError(Code.UNAVAILABLE, "prefetch: no lower tier is enabled (set nvme.dir); DRAM blocks are already resident")

    def prefetch_status(self, session, handle: int, wait_s: float):
        raise KVError(Code.NOT_FOUND, f"prefetch {handle}: unknown handle")

    def transfer(self, session, keys, peer: str, deadline_s: float, pipelined: bool, lease_id: int = 0):
        raise KVError(Code.UNAVAILABLE, "transfer: the transfer listener is off (set transport.listen)")

    def await_transfer(self, session, keys, wait_s: float):
        raise KVError(Code.UNAVAILABLE, "transfer: the transfer listener is off (set transport.listen)")

    # --- stats ------------------------------------------------------------------------------
    def tier_stats(self):
        return [self.dram.stats()]

    def refresh_gauges(self) -> None:
        m = self.metrics
        with self.core.lock:
            reads = sum(1 for lease in self.core.leases.values() if lease.kind == "read")
            m.leases_active.labels(kind="read").set(reads)
            m.leases_active.labels(kind="write").set(len(self.core.leases) - reads)
            m.sessions.set(len(self.core.sessions))
        for st in self.tier_stats():
            name = st.kind.name.lower()
            m.tier_capacity.labels(tier=name).set(st.capacity_bytes)
            m.tier_used.labels(tier=name).set(st.used_bytes)
            m.tier_usage.labels(tier=name).set(st.used_bytes / st.capacity_bytes if st.capacity_bytes else 0)
            m.tier_blocks.labels(tier=name).set(st.blocks)
            m.tier_enabled.labels(tier=name).set(1 if st.enabled else 0)
        m.hbm_emulated.set(1 if self.hbm_emulated else 0)
        for path, est in self.policy.bandwidth.snapshot().items():
            m.tier_bandwidth.labels(path=path).set(est.bytes_per_s)

    def stats_pb(self) -> pb.StatsResponse:
        with self.core.lock:
            tiers = self.tier_stats()
            nss = []
            for st in self.core.namespaces.values():
                usage = _ns_usage(st)
                nss.append(pb.NamespaceStats(
                    namespace_id=st.id, model_id=st.ns.model_id, block_bytes=st.block_bytes,
                    blocks_by_tier={k: v[0] for k, v in usage.items()},
                    bytes_by_tier={k: v[1] for k, v in usage.items()}, sessions=st.sessions))
            counters = {"sessions": float(len(self.core.sessions)), "leases": float(len(self.core.leases))}
        self.refresh_gauges()
        for metric in self.metrics.registry.collect():
            if metric.type == "counter":
                for sample in metric.samples:
                    if sample.name.endswith("_total"):
                        counters[sample.name] = counters.get(sample.name, 0.0) + sample.value
        return pb.StatsResponse(
            version=__version__, uptime_s=time.monotonic() - self.started, hbm_emulated=self.hbm_emulated,
            tiers=[pb.TierStats(tier=int(t.kind), capacity_bytes=t.capacity_bytes, used_bytes=t.used_bytes,
                                blocks=t.blocks, emulated=t.emulated, enabled=t.enabled,
                                detail=json.dumps(t.extra) if t.extra else "") for t in tiers],
            namespaces=nss, counters=counters)

    # --- lifecycle --------------------------------------------------------------------------
    def start(self) -> None:
        cfg = self.cfg
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=cfg.server.grpc_workers,
                                                             thread_name_prefix="grpc"),
                                  options=[("grpc.max_receive_message_length", 64 << 20),
                                           ("grpc.max_send_message_length", 64 << 20)])
        pb_grpc.add_KVStoreServicer_to_server(KVStoreService(self), self.server)
        self.health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), self.server)
        old_umask = os.umask(0o777 & ~cfg.server.socket_mode)
        try:
            if not self.server.add_insecure_port(f"unix:{self.socket_path}"):
                raise StartupError(f"server.socket_path: cannot bind {self.socket_path}")
            self._start_arena_handout()
        finally:
            os.umask(old_umask)
        os.chmod(self.socket_path, cfg.server.socket_mode)
        self.tcp_server = self._start_tcp() if cfg.server.tcp_listen else None
        self.start_extras()
        self.server.start()
        if cfg.metrics.port:
            try:
                self.metrics_server = self.metrics.serve(cfg.metrics.host, cfg.metrics.port)
            except OSError as e:
                self.server.stop(0)
                raise StartupError(f"metrics.port: cannot listen on {cfg.metrics.host}:{cfg.metrics.port}: {e}") from None
        self.metrics.info.labels(version=__version__, hbm_emulated=str(self.hbm_emulated).lower()).set(1)
        self.refresh_gauges()
        self._spawn("reaper", self._reaper)
        for name in ("", SERVICE_NAME):
            self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        log.info("serving on unix:%s (arena %s, %.2f GiB DRAM, metrics %s:%s)", self.socket_path,
                 self.arena_socket, self.dram.capacity_bytes / 2**30, cfg.metrics.host, cfg.metrics.port)
        _sd_notify("READY=1")

    def _start_tcp(self) -> grpc.Server:
        """The cross-node control listener: TLS always, client certificates when a CA is set,
        and a bearer token when one is configured. It serves the same servicer."""
        s = self.cfg.server
        try:
            key, cert = open(s.tls_key_file, "rb").read(), open(s.tls_cert_file, "rb").read()
            ca = open(s.tls_client_ca_file, "rb").read() if s.tls_client_ca_file else None
        except OSError as e:
            raise StartupError(f"server.tls_*: cannot read {e.filename}: {e.strerror}") from None
        creds = grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=ca is not None)
        interceptors = [TokenInterceptor(s.auth_token)] if s.auth_token else []
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=s.grpc_workers, thread_name_prefix="grpc-tcp"),
                             interceptors=interceptors)
        pb_grpc.add_KVStoreServicer_to_server(KVStoreService(self), server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        try:
            self.tcp_port = server.add_secure_port(s.tcp_listen, creds)
        except RuntimeError as e:
            raise StartupError(f"server.tcp_listen: cannot listen on {s.tcp_listen}: {e}") from None
        if not self.tcp_port:
            raise StartupError(f"server.tcp_listen: cannot listen on {s.tcp_listen}")
        server.start()
        log.info("TLS control listener on %s (mutual TLS: %s, token: %s)", s.tcp_listen, ca is not None, bool(s.auth_token))
        return server

    def reload(self) -> None:
        """SIGHUP: re-read the config file and environment; apply what can change live."""
        from kvstore import config as C

        try:
            new = C.load(self.config_path, overrides=self.cli_overrides)
        except C.ConfigError as e:
            log.error("reload refused, keeping the running config: %s", e)
            return
        live = {("server", "lease_ttl_s"), ("server", "session_ttl_s"), ("server", "reaper_interval_s"),
                ("server", "reserve_wait_s"), ("server", "max_keys_per_request"), ("server", "log_level"),
                ("server", "shutdown_grace_s"),
                ("dram", "demote_high_watermark"), ("dram", "demote_low_watermark"), ("nvme", "admit_after_hits"),
                ("policy", "prefill_tokens_per_s"), ("transport", "timeout_s")}
        changed, frozen = [], []
        for section, _ in C.sections():
            old_sec, new_sec = getattr(self.cfg, section), getattr(new, section)
            for f in C.fields(old_sec):
                a, b = getattr(old_sec, f.name), getattr(new_sec, f.name)
                if a != b:
                    if (section, f.name) in live:
                        setattr(old_sec, f.name, b)
                        changed.append(f"{section}.{f.name}")
                    else:
                        frozen.append(f"{section}.{f.name}")
        with self.core.lock:
            self.core.lease_ttl_s = self.cfg.server.lease_ttl_s
            self.core.session_ttl_s = self.cfg.server.session_ttl_s
            self.core.max_keys = self.cfg.server.max_keys_per_request
        logging.getLogger().setLevel(self.cfg.server.log_level.upper())
        log.info("reloaded config: changed %s; need a restart: %s", changed or "nothing", frozen or "nothing")

    def start_extras(self) -> None:
        """Extra listeners and tiers (TLS TCP, NVMe, transport); extended as they land."""

    def hbm_handout(self, conn) -> None:
        """Send the HBM pool's handle; without an HBM tier the connection just closes."""

    def _spawn(self, name: str, fn) -> None:
        t = threading.Thread(target=fn, name=name, daemon=True)
        t.start()
        self._threads.append(t)

    def _reaper(self) -> None:
        """Reclaim expired leases and sessions every ``server.reaper_interval_s`` seconds, so a
        killed worker's state goes within ``session_ttl_s + reaper_interval_s``."""
        while not self.stopping.wait(self.cfg.server.reaper_interval_s):  # re-read: SIGHUP may change it
            with self.core.lock:
                self.core.expire()
            # In batches, letting go of the lock in between: a node whose workers all died at
            # once must not hold every RPC up while thousands of sessions end.
            while True:
                with self.core.lock:
                    if self.core.expire_sessions(SESSION_EXPIRY_BATCH) < SESSION_EXPIRY_BATCH:
                        break
            self.refresh_gauges()

    def _start_arena_handout(self) -> None:
        path = self.arena_socket
        if os.path.exists(path):
            os.unlink(path)
        self._arena_listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._arena_listener.bind(path)
        os.chmod(path, self.cfg.server.socket_mode)
        self._arena_listener.listen(64)
        self._spawn("arena-handout", self._handout_loop)

    def _handout_loop(self) -> None:
        while not self.stopping.is_set():
            try:
                conn, _ = self._arena_listener.accept()
            except OSError:
                return
            with conn:
                conn.settimeout(2.0)
                try:
                    req = conn.recv(17)  # session id, then b"H" for the HBM pool's handle
                    sid, what = req[:16], req[16:]
                    with self.core.lock:
                        known = sid in self.core.sessions
                    if known and what == b"H":
                        self.hbm_handout(conn)
                    elif known:
                        send_fd(conn, self.arena.fd, self.arena.size_bytes)
                except OSError as e:
                    log.warning("arena handout failed: %s", e)

    def stop(self, grace_s: float | None = None) -> None:
        grace = self.cfg.server.shutdown_grace_s if grace_s is None else grace_s
        if self.stopping.is_set():
            return
        self.stopping.set()
        log.info("shutting down (grace %.1f s)", grace)
        _sd_notify("STOPPING=1")
        for name in ("", SERVICE_NAME):
            self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        done = self.server.stop(grace)
        if self.tcp_server is not None:
            self.tcp_server.stop(grace).wait(grace + 1)
        done.wait(grace + 1)
        self.stop_extras(grace)
        try:
            self._arena_listener.close()
        except OSError:
            pass
        for p in (self.socket_path, self.arena_socket):
            try:
                os.unlink(p)
            except OSError:
                pass

    def stop_extras(self, grace_s: float) -> None:
        """Flush and stop what start_extras started."""


def _ns_usage(st) -> dict[str, tuple[int, int]]:
    """(blocks, bytes) per tier of one namespace's committed blocks."""
    out: dict[str, list[int]] = {}
    for b in st.blocks.values():
        if b.state is BlockState.COMMITTED:
            c = out.setdefault(b.tier.name.lower(), [0, 0])
            c[0] += 1
            c[1] += st.block_bytes
    return {k: (v[0], v[1]) for k, v in out.items()}


def _sd_notify(state: str) -> None:
    addr = os.environ.get("NOTIFY_SOCKET")
    if not addr:
        return
    if addr.startswith("@"):
        addr = "\0" + addr[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
            s.connect(addr)
            s.sendall(state.encode())
    except OSError as e:
        log.warning("sd_notify failed: %s", e)


def run(cfg: Config, daemon_cls=Daemon, config_path: str | None = None, cli_overrides: dict | None = None) -> int:
    """Run until SIGTERM/SIGINT; returns the process exit code."""
    # Handlers go in before anything serves: a SIGTERM that arrives while starting (the health
    # service already says SERVING) must still mean a clean stop, not the default kill.
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    d = daemon_cls(cfg, config_path, cli_overrides)
    reload_ready = threading.Event()
    signal.signal(signal.SIGHUP, lambda *_: reload_ready.is_set() and threading.Thread(target=d.reload, name="reload").start())
    d.start()
    reload_ready.set()
    while not stop.wait(0.2):
        pass
    d.stop()
    return 0
