"""``kvstore serve``: the composition root. :class:`Daemon` builds every part from a Config,
each given only its own config section and the collaborators it uses, and starts and stops
them in order; :func:`run` is the process around it (signals, reload).

Parts, in the order a block meets them (docs/architecture.md has the picture): the gRPC
servicer (:mod:`kvstore.daemon.service`) over the core (:mod:`kvstore.daemon.core`: index, leases, DRAM
eviction), the DRAM tier in the shared arena, tier movement to NVMe (:mod:`kvstore.daemon.tiering`),
HBM copies (:mod:`kvstore.daemon.hbm_cache`), daemon-to-daemon transfer (:mod:`kvstore.daemon.outbound`, :mod:`kvstore.daemon.inbound`), the
arena handout (:mod:`kvstore.daemon.handout`), the reporter behind Stats and /metrics
(:mod:`kvstore.daemon.stats`) and, in a fleet, membership, the prefix directory and pulls
(:mod:`kvstore.daemon.fleet`).

Threads: gRPC workers (each RPC takes ``Core.lock`` for its metadata step), the arena handout
thread and one per handout connection being served, the reaper, the demoter and HBM promoter
when those tiers are on, and the transport's.
"""

from __future__ import annotations

import hmac
import logging
import os
import signal
import socket
import stat
import sys
import threading
import time
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvstore import __version__
from kvstore import doorbell
from kvstore.cluster.metrics import ClusterMetrics
from kvstore.daemon.advice import Advisor
from kvstore.config import ARENA_SUFFIX, EVENTS_EXTRA, Config
from kvstore.daemon.core import Core, CoreConfig
from kvstore.daemon.fleet import Fleet
from kvstore.daemon.handout import ArenaHandout
from kvstore.daemon.query_channel import QueryChannels
from kvstore.daemon.hints import RouteHints
from kvstore.daemon.peer_watch import PeerWatch
from kvstore.daemon.metrics import Metrics
from kvstore.daemon.preflight import StartupError, check_data_dir, check_port_free, prepare_socket_path, split_host_port
from kvstore.daemon.remote import LinkMeter
from kvstore.daemon.seams import BothEvents
from kvstore.policy import LoadPolicy
from kvstore.daemon.service import KVStoreService
from kvstore.daemon.stats import Reporter
from kvstore.tiers.arena import HUGE_SHMEM, SHMEM_THP, Arena, PrefaultStopped, shmem_thp_mode
from kvstore.tiers.base import TierError
from kvstore.tiers.dram import DramTier
from kvstore.transport import Sender, TransferConfig
from kvstore.transport.auth import open_regular, read_regular
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc
from kvstore.v1 import peer_pb2_grpc as peer_grpc

log = logging.getLogger("kvstore.daemon")
SERVICE_NAME = "kvstore.v1.KVStore"
PEER_SERVICE = "kvstore.v1.Peer"
CLUSTER_HEALTH = "kvstore.v1.Cluster"  # SERVING while registered in etcd; the daemon serves locally either way
SESSION_EXPIRY_BATCH = 64  # sessions ended per hold of the core lock by the reaper
RPC_DRAIN_S = 1.0  # at shutdown, how long in-flight calls may hold up the write-out of DRAM
# A connection to a gRPC listener that has not finished its TLS handshake this long after
# accept is closed by gRPC itself (its default is 120 s), as the transfer listeners do at 5 s.
HANDSHAKE_TIMEOUT_S = 5.0
HANDSHAKE_OPTION = ("grpc.server_handshake_timeout_ms", int(HANDSHAKE_TIMEOUT_S * 1000))


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


def _transfer_credentials(t) -> TransferConfig:
    """The transport's settings with its credentials read and tried: a secret file others could
    read, or TLS files that do not load, stop the start (exit 2) before the arena is built."""
    from kvstore.daemon.outbound import wire_config

    try:
        wire = wire_config(t)
        if wire.tls is not None:
            wire.tls.context(server=True)
            wire.tls.context(server=False)
            if os.stat(wire.tls.key_file).st_mode & stat.S_IROTH:  # a Secret volume may be 0440 for fsGroup
                log.warning("transport.tls_key_file: %s is readable by every local user; chmod o-r it",
                            wire.tls.key_file)
    except (ValueError, OSError) as e:  # ssl.SSLError is an OSError
        raise StartupError(str(e) if str(e).startswith("transport.") else f"transport.tls_*: {e}") from None
    return wire


class Daemon:
    transfer_sender = Sender  # the Sender class of the transfer service (a test subclass may corrupt frames)

    def __init__(self, cfg: Config, config_path: str | None = None, cli_overrides: dict | None = None,
                 interrupt: "SignalFlag | None" = None) -> None:
        """``interrupt``: set by a signal handler; it stops the arena's pre-fault
        (:class:`~kvstore.tiers.arena.PrefaultStopped`)."""
        self.cfg = cfg
        self.config_path = config_path
        self.cli_overrides = cli_overrides or {}
        self.metrics = Metrics()
        self.cluster_metrics = ClusterMetrics(self.metrics.registry)
        self.socket_path = cfg.resolved_socket_path()
        self.arena_socket = self.socket_path + ARENA_SUFFIX
        self.stopping = threading.Event()
        # Every path and port conflict before the arena: building it can take minutes.
        prepare_socket_path(self.socket_path)
        if cfg.nvme.dir:
            check_data_dir(cfg.nvme.dir)
        self._check_ports()
        dram_bytes = cfg.resolved_dram_bytes()
        thp = shmem_thp_mode()
        log.info("creating %.2f GiB DRAM arena (prefault=%s, shared-memory huge pages: %s%s)", dram_bytes / 2**30,
                 cfg.dram.prefault, thp, "" if thp in HUGE_SHMEM else
                 "; the arena is on 4 KiB pages: set advise in " + SHMEM_THP + " (docs/deploy.md, host tuning)")
        try:  # the doorbell cells live just past the slots
            self.arena = Arena(dram_bytes + doorbell.REGION_BYTES, prefault=cfg.dram.prefault, stop=interrupt)
        except OSError as e:
            raise StartupError(f"dram.capacity_bytes: cannot create a {dram_bytes}-byte arena: {e}") from None
        self.dram = DramTier(self.arena, cfg.dram.extent_bytes, dram_bytes)
        self.hbm = self.nvme = None
        try:
            self.hbm = self._open_hbm()
            self.nvme, nvme_copies, nvme_error = self._open_nvme()
            self.events = self._open_events()
            self.store_directory = self._open_store_directory()
            block_events = self.events
            if self.store_directory is not None:
                block_events = self.store_directory if self.events is None else BothEvents(self.events,
                                                                                           self.store_directory)
            self.core = Core(self.dram, CoreConfig.from_config(cfg), lower=nvme_copies, hbm=self.hbm,
                             doorbells=doorbell.Doorbells(self.arena.buf, dram_bytes), metrics=self.metrics,
                             events=block_events)
            self.policy = LoadPolicy()
            self.tiering = None
            if nvme_copies is not None:
                from kvstore.daemon.tiering import Tiering

                self.tiering = Tiering(self.core.residency, nvme_copies, cfg.nvme, cfg.dram, metrics=self.metrics, policy=self.policy)
            self.hbm_cache = None
            if self.hbm is not None:
                from kvstore.daemon.hbm_cache import HbmCache

                self.hbm_cache = HbmCache(self.core.residency, self.hbm, metrics=self.metrics)
            self.outbound, self.inbound = self._transfer_sides() if cfg.transport.listen else (None, None)
            self.link_meter = LinkMeter(cfg.cluster, self.cluster_metrics) if cfg.cluster.etcd_endpoints else None
            self.nvme_error = nvme_error
            self.peers = PeerWatch(self.core)
            self.handout = ArenaHandout(self.arena_socket, cfg.server, self.arena, self.core, self.hbm_cache,
                                        self.peers)
        except BaseException:  # a part that opened (NVMe's lock and LMDB, the pinned arena) is let go
            self._close_tiers()
            raise
        self.server: grpc.Server | None = None
        self.tcp_server: grpc.Server | None = None
        self.hints_listener = None  # server.hints_listen: the route-hints HTTP/JSON listener
        self.metrics_server = None
        self.transfer_address = ""
        self.fleet: Fleet | None = None  # with [cluster]: membership, the prefix directory, pulls
        self.reporter: Reporter | None = None  # Stats and the gauges: built in _start, after the directory
        self._threads: list[threading.Thread] = []

    # --- parts ------------------------------------------------------------------------------
    def _check_ports(self) -> None:
        """Each listener's port, with the message its own failure to bind would give."""
        cfg = self.cfg
        if cfg.metrics.port:
            check_port_free("metrics.port", cfg.metrics.host, cfg.metrics.port, "listen")
        if cfg.transport.listen:
            check_port_free("transport.listen", *split_host_port(cfg.transport.listen),
                             f"start the {cfg.transport.backend} listener")
            self.transfer_wire = _transfer_credentials(cfg.transport)
        for key in ("publish", "replay"):
            url = getattr(cfg.events, key)
            if url.startswith("tcp://"):
                check_port_free(f"events.{key}", *split_host_port(url[len("tcp://"):]), "bind")
        if cfg.server.hints_listen:
            check_port_free("server.hints_listen", *split_host_port(cfg.server.hints_listen), "listen")
        if cfg.server.tcp_listen:
            check_port_free("server.tcp_listen", *split_host_port(cfg.server.tcp_listen), "listen")
            s = cfg.server
            for key in ("tls_key_file", "tls_cert_file", "tls_client_ca_file"):
                if getattr(s, key):
                    try:
                        os.close(open_regular(getattr(s, key), f"server.{key}"))
                    except ValueError as e:
                        raise StartupError(str(e)) from None

    def _open_hbm(self):
        """The HBM pool (its copies live as long as their DRAM copy); None when off."""
        if not self.cfg.hbm.capacity_bytes:
            return None
        from kvstore.tiers.hbm import HbmTier, HbmTierConfig

        try:
            hbm = HbmTier(HbmTierConfig.from_config(self.cfg))
        except (TierError, RuntimeError, ValueError) as e:
            raise StartupError(f"hbm: {e}") from None
        hbm.register_host(self.arena)
        st = hbm.stats()
        log.info("HBM tier: %.2f GiB on %s", st.capacity_bytes / 2**30,
                 "an EMULATED device (" + st.extra.get("reason", "") + ")" if hbm.emulated else "the GPU")
        return hbm

    def _open_nvme(self):
        """(tier, its copies, error): the tier's failure to open leaves the daemon serving from
        DRAM, with stats and metrics showing the tier disabled and why."""
        n = self.cfg.nvme
        if not n.dir:
            return None, None, ""
        from kvstore.daemon.demoter import NvmeCopies
        from kvstore.tiers.nvme import NvmeError, NvmeTier, NvmeTierConfig

        extent = self.cfg.dram.extent_bytes
        cap = n.capacity_bytes // extent * extent
        file_bytes = max(extent, min(n.file_bytes, cap) // extent * extent)
        try:
            tier = NvmeTier(NvmeTierConfig(dir=n.dir, capacity_bytes=cap, file_bytes=file_bytes, extent_bytes=extent,
                                       io_threads=n.io_threads, coalesce_bytes=n.coalesce_bytes, codec=n.codec),
                            metrics=self.metrics)
        except (NvmeError, OSError, ValueError) as e:
            log.error("NVMe tier disabled: nvme.dir: %s", e)
            return None, None, f"nvme.dir: {e}"
        return tier, NvmeCopies(tier, n), ""

    def _open_events(self):
        """The KV event publisher (:mod:`kvstore.daemon.events`); None when events.publish is off."""
        if not self.cfg.events.publish:
            return None
        try:
            from kvstore.daemon.events import EventPublisher

            return EventPublisher(self.cfg.events, metrics=self.metrics)
        except ImportError as e:
            raise StartupError(f"events.publish: needs pyzmq and msgspec ({EVENTS_EXTRA}): {e}") from None

    def _open_store_directory(self):
        """With ``cluster.directory = redis`` (and a transfer listener to serve pulls from): the
        directory in the store (:mod:`kvstore.cluster.redis_directory`), this daemon's writer into
        it and its reader. It connects on its own thread: a store down at start is a directory
        down (local hits only), not a daemon that cannot start."""
        c = self.cfg.cluster
        if c.directory != "redis" or not c.etcd_endpoints:
            return None
        if not self.cfg.transport.listen:
            log.warning("cluster.directory = redis: no transport.listen, so no pulls; the store is not used")
            return None
        try:
            from kvstore.cluster.redis_directory import RedisDirectory
            from kvstore.cluster.redis_store import read_password

            password = read_password(c)
        except ImportError as e:
            raise StartupError(f"cluster.directory = redis: needs the redis client (the [redis] extra: "
                               f"pip install '.[redis]' in the kvstore checkout): {e}") from None
        except ValueError as e:
            raise StartupError(str(e)) from None
        return RedisDirectory(c, password=password, metrics=self.cluster_metrics)

    def _close_tiers(self) -> None:
        if self.nvme is not None:
            self.nvme.close()
        if self.hbm is not None:
            self.hbm.close()
        self.arena.close()

    def _transfer_sides(self):
        """(outbound, inbound): the sender and the listener of daemon-to-daemon transfer."""
        from kvstore.daemon.inbound import Inbound
        from kvstore.daemon.outbound import Outbound

        t = self.cfg.transport
        try:
            return (Outbound(self.core, t, self.transfer_wire, metrics=self.metrics, policy=self.policy,
                             sender_cls=self.transfer_sender),
                    Inbound(self.core, t, self.transfer_wire, metrics=self.metrics, tiering=self.tiering))
        except Exception as e:  # noqa: BLE001 - a bad listen address or missing UCX stops start-up
            raise StartupError(f"transport.listen: cannot start the {self.cfg.transport.backend} "
                               f"listener on {self.cfg.transport.listen}: {e}") from None

    def _service(self) -> KVStoreService:
        advisor = Advisor(self.policy, self.cfg.policy, self.metrics)
        self.hints = RouteHints(self.core, advisor, self.fleet, self.link_meter)
        return KVStoreService(self.core, self.cfg.server, advisor=advisor,
                              reporter=self.reporter, metrics=self.metrics, tiering=self.tiering,
                              outbound=self.outbound, inbound=self.inbound, arena_socket=self.arena_socket,
                              cluster=self.fleet.advisor if self.fleet is not None else None, hints=self.hints)

    # --- lifecycle --------------------------------------------------------------------------
    def start(self) -> None:
        try:
            self._start()
        except BaseException:  # a listener that cannot start: leave no socket file behind
            if self.server is not None:
                self.server.stop(0)
            self._remove_sockets()
            raise

    def _remove_sockets(self) -> None:
        self.handout.stop()
        self.peers.stop()
        try:
            os.unlink(self.socket_path)
        except OSError:
            pass

    def _start(self) -> None:
        cfg = self.cfg
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=cfg.server.grpc_workers,
                                                             thread_name_prefix="grpc"),
                                  options=[("grpc.max_receive_message_length", 64 << 20),
                                           ("grpc.max_send_message_length", 64 << 20), HANDSHAKE_OPTION])
        self.health = health.HealthServicer()
        if cfg.cluster.etcd_endpoints:
            self.health.set(CLUSTER_HEALTH, health_pb2.HealthCheckResponse.NOT_SERVING)
            self.fleet = self._fleet()  # the prefix directory, pulls: before the reporter and the services
        peer = self._peer_service()
        self.reporter = self._reporter()
        service = self._service()  # its Lookup asks peers through the fleet
        self.handout.channels = QueryChannels(service, self.core.sessions, self.core.lock)
        pb_grpc.add_KVStoreServicer_to_server(service, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        peer_grpc.add_PeerServicer_to_server(peer, self.server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, PEER_SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME), self.server)
        old_umask = os.umask(0o777 & ~cfg.server.socket_mode)
        try:
            if not self.server.add_insecure_port(f"unix:{self.socket_path}"):
                raise StartupError(f"server.socket_path: cannot bind {self.socket_path}")
            self.handout.start()
            self.peers.start()
        finally:
            os.umask(old_umask)
        os.chmod(self.socket_path, cfg.server.socket_mode)
        if self.hbm_cache is not None:
            self.hbm_cache.start()
        if self.tiering is not None:
            blocks = self.tiering.recover()
            log.info("NVMe tier at %s: %d blocks recovered (%s I/O)", cfg.nvme.dir, blocks, self.nvme.io_mode.value)
            self.tiering.start()
        if self.events is not None:
            from kvstore.daemon.events import CoreState

            try:
                self.events.start(CoreState(self.core))
            except Exception as e:  # noqa: BLE001 - zmq.ZMQError: a taken or bad address stops start-up
                raise StartupError(f"events.publish/replay: cannot bind {cfg.events.publish} / "
                                   f"{cfg.events.replay or '-'}: {e}") from None
        if self.inbound is not None:
            try:
                self.transfer_address = self.inbound.start()
            except Exception as e:  # noqa: BLE001 - a port in use stops start-up
                raise StartupError(f"transport.listen: cannot start the {cfg.transport.backend} "
                                   f"listener on {cfg.transport.listen}: {e}") from None
        # Remote clients only once recovery is done: a Register must not race it.
        self.tcp_server = self._start_tcp(service, peer) if cfg.server.tcp_listen else None
        self.hints_listener = self._start_hints() if cfg.server.hints_listen else None
        self.server.start()
        if cfg.metrics.port:
            try:
                self.metrics_server = self.metrics.serve(cfg.metrics.host, cfg.metrics.port)
            except OSError as e:
                self.server.stop(0)
                raise StartupError(f"metrics.port: cannot listen on {cfg.metrics.host}:{cfg.metrics.port}: {e}") from None
        self.metrics.info.labels(version=__version__, hbm_emulated=str(self.reporter.hbm_emulated).lower()).set(1)
        self.reporter.refresh_gauges()
        if self.fleet is not None:
            tiers = ["dram"] + (["nvme"] if self.nvme is not None else []) + (["hbm"] if self.hbm is not None else [])
            self.fleet.join(self.transfer_address, tiers)
        self._spawn("reaper", self._reaper)
        for name in ("", SERVICE_NAME):
            self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        log.info("serving on unix:%s (arena %s, %.2f GiB DRAM, metrics %s:%s)", self.socket_path,
                 self.arena_socket, self.dram.capacity_bytes / 2**30, cfg.metrics.host, cfg.metrics.port)
        _sd_notify("READY=1")

    def _reporter(self) -> Reporter:
        directory = None
        if self.fleet is not None and self.fleet.directory is not None:
            from kvstore.cluster.report import DirectoryReport

            directory = DirectoryReport(self.fleet.directory, self.cluster_metrics)
        return Reporter(self.core, metrics=self.metrics, policy=self.policy, hbm=self.hbm, nvme=self.nvme,
                        nvme_wanted=bool(self.cfg.nvme.dir), nvme_error=self.nvme_error, links=self.link_meter,
                        directory=directory)

    def _fleet(self) -> Fleet:
        H = health_pb2.HealthCheckResponse
        return Fleet(self.cfg, self.core, self.policy, self.outbound, self.tiering, metrics=self.cluster_metrics,
                     meter=self.link_meter, store_directory=self.store_directory,
                     on_registered=lambda ok: self.health.set(CLUSTER_HEALTH, H.SERVING if ok else H.NOT_SERVING))

    def _peer_service(self):
        """kvstore.v1.Peer: Pull (a worker's) and Push (a peer daemon's); with no cluster, or no
        transfer listener, both answer UNAVAILABLE saying what to set."""
        from kvstore.daemon.pull import PeerService

        return PeerService(self.core, self.fleet.pulls if self.fleet is not None else None, metrics=self.metrics)

    def _start_tcp(self, service: KVStoreService, peer) -> grpc.Server:
        """The cross-node control listener: TLS always, client certificates when a CA is set,
        and a bearer token when one is configured. It serves the same servicer."""
        s = self.cfg.server
        try:
            key, cert = read_regular(s.tls_key_file, "server.tls_key_file"), read_regular(s.tls_cert_file, "server.tls_cert_file")
            ca = read_regular(s.tls_client_ca_file, "server.tls_client_ca_file") if s.tls_client_ca_file else None
        except ValueError as e:
            raise StartupError(str(e)) from None
        creds = grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=ca is not None)
        interceptors = [TokenInterceptor(s.auth_token)] if s.auth_token else []
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=s.grpc_workers, thread_name_prefix="grpc-tcp"),
                             interceptors=interceptors, options=[HANDSHAKE_OPTION])
        pb_grpc.add_KVStoreServicer_to_server(service, server)
        peer_grpc.add_PeerServicer_to_server(peer, server)
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

    def _start_hints(self):
        """The HTTP/JSON route-hints listener (:mod:`kvstore.daemon.hints_http`)."""
        from kvstore.daemon.hints_http import HintsListener

        s = self.cfg.server
        try:
            for key in ("tls_key_file", "tls_cert_file", "tls_client_ca_file"):
                if getattr(s, key):  # each a regular file, opened without blocking, before ssl opens it
                    read_regular(getattr(s, key), f"server.{key}")
            listener = HintsListener(s.hints_listen, self.hints, key_file=s.tls_key_file, cert_file=s.tls_cert_file,
                                     ca_file=s.tls_client_ca_file, token=s.auth_token)
            self.hints_port = listener.start()
        except (ValueError, OSError) as e:
            raise StartupError(f"server.hints_listen: cannot listen on {s.hints_listen}: {e}") from None
        log.info("route hints (HTTP/JSON) on %s (client certificates: %s, token: %s)", s.hints_listen,
                 bool(s.tls_client_ca_file), bool(s.auth_token))
        return listener

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
                ("nvme", "io_timeout_s"), ("nvme", "prefetch_deadline_s"),
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
            self.core.configure(CoreConfig.from_config(self.cfg))
        logging.getLogger().setLevel(self.cfg.server.log_level.upper())
        log.info("reloaded config: changed %s; need a restart: %s", changed or "nothing", frozen or "nothing")

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
            self.reporter.refresh_gauges()
            if self.fleet is not None:
                self.fleet.advertise(self.core)

    def drain(self) -> None:
        """SIGUSR1 (the Kubernetes preStop hook): stop taking new blocks (Reserve and incoming
        transfers get UNAVAILABLE) while reads go on, and start writing what only DRAM holds to
        NVMe, so the SIGTERM that follows has less left to write in its grace."""
        with self.core.lock:
            self.core.writes_refused = "the daemon is draining before a shutdown: it takes no new blocks"
        log.info("draining: new writes refused%s", ", writing DRAM out to NVMe" if self.tiering else "")
        if self.tiering is not None:
            self.tiering.start_write_out()

    def stop(self, grace_s: float | None = None) -> None:
        """Stop within ``grace_s`` (``server.shutdown_grace_s``), one budget for all of it, in
        the order that keeps the cache: refuse new RPCs and transfers (nothing new is written),
        let in-flight calls finish, then write what only DRAM holds to NVMe and commit the index
        (warm restart), then close the tiers."""
        grace = self.cfg.server.shutdown_grace_s if grace_s is None else grace_s
        if self.stopping.is_set():
            return
        self.stopping.set()
        deadline = time.monotonic() + grace
        log.info("shutting down (grace %.1f s)", grace)
        _sd_notify("STOPPING=1")
        for name in ("", SERVICE_NAME):
            self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        if self.fleet is not None:  # leave first: peers stop sending here at once
            self.fleet.leave(min(2.0, grace))
        done = self.server.stop(grace)
        if self.hints_listener is not None:
            self.hints_listener.stop()
        tcp_done = self.tcp_server.stop(grace) if self.tcp_server is not None else None
        if self.inbound is not None:
            self.inbound.stop(max(0.0, deadline - time.monotonic()))
            self.outbound.stop()
        # Calls already running are mostly sub-millisecond: the write-out starts once they are
        # done or after a second (a long poll such as AwaitTransfer must not use up the grace;
        # the servers cancel whatever still runs at the deadline).
        for ev in (done, tcp_done):
            if ev is not None:
                ev.wait(min(RPC_DRAIN_S, max(0.0, deadline - time.monotonic())))
        if self.fleet is not None:  # the channels to peers (a pull still running ends as a miss), the streams
            self.fleet.close()
        if self.tiering is not None:
            self.tiering.close(deadline)
        for ev in (done, tcp_done):
            if ev is not None:
                ev.wait(max(0.0, deadline - time.monotonic()) + 1)
        if self.hbm_cache is not None:
            self.hbm_cache.close()
            self.hbm.close()
        if self.events is not None:
            self.events.stop()
        self._remove_sockets()


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


class SignalFlag:
    """What a signal handler asks for, recorded without taking a lock. A handler runs in the
    main thread between two bytecodes, possibly while that thread holds a lock of its own:
    inside ``threading.Event.wait()`` it holds the Event's (non-reentrant) lock, and
    ``Event.set()`` from the handler would then wait for it forever. A daemon whose main loop
    waited on that Event once ignored a SIGTERM that way (a CI run under load: no "shutting
    down" line, still running 30 s later). The main thread acts on the flags between sleeps."""

    __slots__ = ("_set",)

    def __init__(self) -> None:
        self._set = False

    def set(self) -> None:
        self._set = True

    def clear(self) -> None:
        self._set = False

    def is_set(self) -> bool:
        return self._set


POLL_S = 0.2  # how often the main thread looks at the signal flags once serving
# How long a thread holds the GIL while another waits for it (CPython's default is 5 ms). A
# handler answering a Lookup waited for the thread planning a promotion, a demotion or a
# checksum; with a CPU-bound Python thread beside it a unix-socket round trip served by another
# thread took 10.5 ms at 5 ms, 2.5 ms at 1 ms and 1.4 ms at 0.5 ms (a scratch script on the 2-core
# host, 2026-12-07), at a few per cent of the bulk threads' throughput.
GIL_SWITCH_S = 0.0005


def run(cfg: Config, daemon_cls=Daemon, config_path: str | None = None, cli_overrides: dict | None = None) -> int:
    """Run until SIGTERM/SIGINT; returns the process exit code."""
    # Handlers go in before anything serves: a SIGTERM that arrives while starting (the health
    # service already says SERVING) must still mean a clean stop, not the default kill. They
    # only set flags (SignalFlag says why); the main thread does the rest.
    stop, drain, reload = SignalFlag(), SignalFlag(), SignalFlag()
    sys.setswitchinterval(GIL_SWITCH_S)
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    signal.signal(signal.SIGUSR1, lambda *_: drain.set())  # stop taking writes (Daemon.drain)
    signal.signal(signal.SIGHUP, lambda *_: reload.set())  # reload the config (Daemon.reload)
    try:
        d = daemon_cls(cfg, config_path, cli_overrides, interrupt=stop)
    except PrefaultStopped as e:  # nothing serves yet: no socket to remove
        log.info("a signal arrived while pre-faulting the DRAM arena (%s); exiting before serving", e)
        return 0
    d.start()
    reload.clear()  # a SIGHUP before serving has nothing to reload: the config was just read
    while not stop.is_set():
        time.sleep(POLL_S)  # a signal ends the sleep early only to run its handler
        if drain.is_set() and not d.core.writes_refused:
            d.drain()
        if reload.is_set():
            reload.clear()
            threading.Thread(target=d.reload, name="reload").start()
    d.stop()
    return 0
