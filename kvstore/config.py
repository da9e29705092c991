"""The daemon's one typed config: embedded defaults < TOML file < ``KVSTORE_*`` env < CLI flags.

Every knob is a dataclass field whose name carries its unit (``_bytes``, ``_s``). Sizes are
bytes: a bare number is bytes, or ``4GiB`` / ``512MB`` style strings (GiB = 2^30, GB = 10^9; see
:func:`parse_size`). A bad value is a :class:`ConfigError` naming the key
(``dram.capacity_bytes``) before anything starts.

Environment: ``KVSTORE_<SECTION>_<KEY>``, e.g. ``KVSTORE_DRAM_CAPACITY_BYTES=8GiB``.
CLI: ``--<section>-<key>`` with dashes, e.g. ``--dram-capacity-bytes 8GiB``.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import re
import tempfile
import tomllib
from dataclasses import dataclass, field, fields  # noqa: F401 - fields is used by daemon.reload
from pathlib import Path
from typing import Any


log = logging.getLogger("kvstore.config")


class ConfigError(ValueError):
    """A config value is invalid; the message starts with the dotted key."""


# Keys that moved, old -> new (section, key): the old one still loads, as the new one, with a
# deprecation warning. The watermarks are DRAM usage, so they left [nvme] for [dram].
MOVED = {("nvme", "high_watermark"): ("dram", "demote_high_watermark"),
         ("nvme", "low_watermark"): ("dram", "demote_low_watermark")}


GB = 10**9
UNIX_PATH_MAX = 107  # bytes of a unix socket's path (sun_path is 108, with its NUL)
ARENA_SUFFIX = ".arena"  # the arena handout's socket: server.socket_path + this
_SIZE_RE = re.compile(r"^\s*([+-]?(?:\d+\.?\d*|\.\d+)(?:e[+-]?\d+)?)\s*([a-z]*)\s*$", re.I)
# KiB = 2^10 bytes, KB = 10^3; a lone k/m/g/t (as in "4g") is binary.
_UNITS = {"b": 1, "kb": 1000, "mb": 1000**2, "gb": GB, "tb": 1000**4,
          "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
          "k": 1024, "m": 1024**2, "g": 1024**3, "t": 1024**4, "ki": 1024, "mi": 1024**2, "gi": 1024**3, "ti": 1024**4}


def parse_size(text: str | int, *, bare: int = 1) -> int:
    """Bytes from ``123``, ``64KiB``, ``4GiB``, ``1.5GB`` (GiB = 2^30 bytes, GB = 10^9 bytes).

    A bare number counts units of ``bare`` bytes: bytes (1) in the daemon's config, its flags
    and the benchmarks; ``kvstore plan`` passes ``bare=GB``, as GPU memory is quoted in GB.
    A negative size comes back negative: each caller states the range it accepts. Raises
    ValueError for text that is not a size."""
    if isinstance(text, bool):
        raise ValueError(f"not a size: {text!r}")
    if isinstance(text, int):
        return text * bare
    m = _SIZE_RE.match(str(text))
    unit = m and (_UNITS.get(m.group(2).lower()) if m.group(2) else bare)
    if not unit:
        raise ValueError(f"not a size: {text!r} (use bytes or a unit: KiB, MiB, GiB, KB, MB, GB)")
    return round(float(m.group(1)) * unit)


def _default_runtime_dir() -> str:
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg and os.path.isdir(xdg) and os.access(xdg, os.W_OK):
        return os.path.join(xdg, "kvstore")
    return os.path.join(tempfile.gettempdir(), f"kvstore-{os.getuid()}")


def total_ram_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


@dataclass
class ServerConfig:
    socket_path: str = field(default="", metadata={"help": "gRPC unix socket; empty = $XDG_RUNTIME_DIR/kvstore/kvstore.sock, else a private dir under /tmp"})
    socket_mode: int = field(default=0o660, metadata={"help": "permission bits of the unix sockets (octal in TOML as a string, e.g. \"0660\")"})
    tcp_listen: str = field(default="", metadata={"help": "host:port of a TLS gRPC listener for cross-node control; empty = off"})
    tls_cert_file: str = field(default="", metadata={"help": "PEM server certificate (required with tcp_listen)"})
    tls_key_file: str = field(default="", metadata={"help": "PEM server private key (required with tcp_listen)"})
    tls_client_ca_file: str = field(default="", metadata={"help": "PEM CA bundle; set to require client certificates (mutual TLS)"})
    hints_listen: str = field(default="", metadata={"help": "host:port of the HTTP/JSON route-hints listener for request routers (POST /v1/route-hints); TLS with tls_cert_file, and a client certificate (tls_client_ca_file) or the bearer token (auth_token) required; empty = off (RouteHints is also a gRPC call)"})
    auth_token: str = field(default="", metadata={"help": "bearer token TCP clients must send; empty = none", "secret": True})
    grpc_workers: int = field(default=64, metadata={"help": "gRPC server threads (durable Commits hold one each while NVMe writes)"})
    max_keys_per_request: int = field(default=65536, metadata={"help": "most keys one RPC may carry (blocks)"})
    lease_ttl_s: float = field(default=30.0, metadata={"help": "lifetime of a write reservation or read pin without renewal (seconds)"})
    session_ttl_s: float = field(default=60.0, metadata={"help": "a client session the daemon has heard no call of for this long is ended with its leases, so a killed worker leaks nothing; clients send KeepAlive every third of it (seconds, >= 1)"})
    reaper_interval_s: float = field(default=0.5, metadata={"help": "how often expired leases and sessions are reclaimed (seconds)"})
    reserve_wait_s: float = field(default=0.5, metadata={"help": "longest a Reserve waits in the daemon for demotion to free DRAM before RESOURCE_EXHAUSTED (seconds; 0 = refuse at once)"})
    shutdown_grace_s: float = field(default=10.0, metadata={"help": "at SIGTERM, bound on finishing in-flight calls and writing what only DRAM holds to NVMe for a warm restart (seconds)"})
    max_waits: int = field(default=0, metadata={"help": "most calls waiting in the daemon at once (AwaitTransfer, PrefetchStatus and Acquire with wait_s, Reserve waiting for demotion), so the other gRPC workers stay free; over it a wait is refused with RESOURCE_EXHAUSTED (0 = half of grpc_workers)"})
    max_waits_per_session: int = field(default=4, metadata={"help": "most calls one session may have waiting in the daemon at once; over it RESOURCE_EXHAUSTED"})
    handout_timeout_s: float = field(default=0.5, metadata={"help": "an arena-socket connection that has not sent its 17-byte request within this is closed (seconds)"})
    handout_per_user: int = field(default=8, metadata={"help": "most arena-socket connections one uid may have open at once; more are closed at once"})
    log_json: bool = field(default=False, metadata={"help": "log one JSON object per line"})
    log_level: str = field(default="info", metadata={"help": "debug, info, warning or error"})

    def resolved_max_waits(self) -> int:
        """Half the workers wait at most, the other half answer Stats, Lookup, Register..."""
        return self.max_waits or max(1, self.grpc_workers // 2)


@dataclass
class DramConfig:
    capacity_bytes: int = field(default=0, metadata={"help": "shared-memory arena size (bytes; 0 = 1/8 of RAM capped at max_auto_bytes)"})
    max_auto_bytes: int = field(default=4 * 1024**3, metadata={"help": "cap on the automatic arena size (bytes)"})
    extent_bytes: int = field(default=64 * 1024**2, metadata={"help": "arena is carved into extents of this size; largest block a namespace may have (bytes)"})
    prefault: bool = field(default=True, metadata={"help": "touch every arena page at start (first-touch faults are ~50x slower than copies)"})
    namespace_quota_bytes: int = field(default=0, metadata={"help": "most DRAM one namespace may hold; over it, it evicts its own blocks (bytes; 0 = no quota)"})
    demote_high_watermark: float = field(default=0.90, metadata={"help": "DRAM usage ratio that starts demotion to NVMe (with nvme.dir set)"})
    demote_low_watermark: float = field(default=0.75, metadata={"help": "DRAM usage ratio demotion stops at"})


@dataclass
class MetricsConfig:
    host: str = field(default="127.0.0.1", metadata={"help": "address of the Prometheus /metrics endpoint"})
    port: int = field(default=9464, metadata={"help": "port of /metrics; 0 = off"})


@dataclass
class NvmeConfig:
    dir: str = field(default="", metadata={"help": "directory for data files and the LMDB index; empty = NVMe tier off"})
    capacity_bytes: int = field(default=16 * 1024**3, metadata={"help": "total size of the preallocated data files (bytes)"})
    admit_after_hits: int = field(default=0, metadata={"help": "admission: demote only blocks looked up at least this many times (0 = all)"})
    namespace_quota_bytes: int = field(default=0, metadata={"help": "most NVMe space one namespace may hold; over it, its own least recent blocks go (bytes; 0 = no quota)"})
    durable_commit: bool = field(default=False, metadata={"help": "Commit returns only once the blocks are on NVMe (survive a crash); else they reach NVMe by demotion"})
    file_bytes: int = field(default=16 * 1024**3, metadata={"help": "size of each preallocated data file (bytes)"})
    io_threads: int = field(default=8, metadata={"help": "NVMe I/Os in flight (threads doing O_DIRECT reads and writes)"})
    coalesce_bytes: int = field(default=1024**2, metadata={"help": "blocks in neighbouring slots move in one vectored I/O up to this size (bytes; 0 = off)"})
    promote_piece_bytes: int = field(default=4 * 1024**2, metadata={"help": "a promotion's reads land in DRAM in pieces of about this size, in order: a client can Acquire and copy the first piece while the rest is read (bytes; 0 = the whole promotion at once)"})
    io_timeout_s: float = field(default=120.0, metadata={"help": "a batch of NVMe writes still running after this long is logged as stuck (its slots stay reserved until it ends) (seconds)"})
    prefetch_deadline_s: float = field(default=30.0, metadata={"help": "deadline of a Prefetch that names none (seconds)"})
    codec: str = field(default="off", metadata={"help": "lossless codec of NVMe blocks, in slots sized by the encoded length (more blocks in the same capacity; every read decoded and verified against the raw bytes' checksums): off, auto (nibble for bf16, fp32 and fp8 KV where the C codec is built), nibble or planes-zstd (docs/compression.md)"})
    codec_namespaces: str = field(default="", metadata={"help": "comma-separated model ids or 64-hex namespace ids whose blocks nvme.codec encodes; empty = every namespace"})

    def encodes(self, model_id: str, ns_id: bytes) -> bool:
        """Whether nvme.codec applies to this namespace's blocks."""
        if self.codec == "off":
            return False
        names = _name_set(self.codec_namespaces)
        return not names or model_id in names or ns_id.hex() in names


@dataclass
class HbmConfig:
    capacity_bytes: int = field(default=0, metadata={"help": "HBM pool size (bytes); 0 = HBM tier off"})
    device: str = field(default="auto", metadata={"help": "cuda device index, 'auto' (GPU if present, else emulated) or 'emulated'"})
    streams: int = field(default=2, metadata={"help": "copy streams of the HBM pool (half promote, half demote; >= 2)"})
    admit_reads: int = field(default=2, metadata={"help": "a DRAM block read (acquired) this many times gets an HBM copy"})


@dataclass
class TransportConfig:
    backend: str = field(default="tcp", metadata={"help": "daemon-to-daemon transport: tcp or ucx"})
    listen: str = field(default="", metadata={"help": "host:port of the transfer listener; empty = off"})
    timeout_s: float = field(default=30.0, metadata={"help": "default transfer deadline (seconds)"})
    ucx_progress: str = field(default="adaptive", metadata={"help": "UCX engines: adaptive (poll while a transfer is open, else sleep), blocking (sleep whenever idle) or polling (always spin one core each)"})
    verify_threads: int = field(default=-1, metadata={"help": "UCX receiver: threads that verify arrived chunks' xxh3 beside the engine thread; -1 = auto (a quarter of the CPUs, at most 4; none under 4 CPUs), 0 = on the engine thread"})
    verify_min_bytes: int = field(default=1024**2, metadata={"help": "UCX receiver: only payloads of at least this size (bytes) go to the verify threads; smaller ones cost more to hand over than to hash"})
    ucx_fused_verify: bool = field(default=True, metadata={"help": "UCX receiver without verify threads: over shared memory, hash each payload as UCX copies it in (the module scripts/build_fused.sh builds; without it, or off, payloads are hashed once landed)"})
    secret_file: str = field(default="", metadata={"help": "file holding the cluster secret (16-4096 bytes, mode 0600, owned by the daemon's user): both ends of a transfer prove they hold it (HMAC-SHA256 challenge-response) before any block is accepted; tcp and ucx"})
    node_name: str = field(default="", metadata={"help": "this daemon's name in the secret-based handshake (what a peer's transport.accept names); empty = the host name"})
    tls_cert_file: str = field(default="", metadata={"help": "tcp: PEM certificate of this daemon for mutual TLS (its subject CN, or first DNS name, is its name in peers' transport.accept)"})
    tls_key_file: str = field(default="", metadata={"help": "tcp: PEM private key of tls_cert_file (a file only the daemon's user can read)"})
    tls_ca_file: str = field(default="", metadata={"help": "tcp: PEM CA bundle that peers' certificates must chain to (both directions)"})
    allow_unauthenticated: bool = field(default=False, metadata={"help": "let a transfer listener without TLS or a secret listen beyond loopback (UCX always listens on every interface): any host that reaches it may write blocks. Only on a fabric nobody else can reach"})
    compress: str = field(default="off", metadata={"help": "tcp: send blocks losslessly encoded (kvstore.codec's nibble, bf16/fp32/fp8 KV) where the receiving daemon decodes: off, on, or auto (when the link to that peer, as its last raw transfer measured it, is slower than compress_below_bytes_per_s; every 16th transfer goes raw to measure it again); ucx links carry raw blocks"})
    compress_below_bytes_per_s: float = field(default=1.0e9, metadata={"help": "compress auto: encode for links measured slower than this (bytes/second; about what one core encodes)"})
    accept: dict = field(default_factory=dict, metadata={"help": "which namespaces (model ids, or 64-hex namespace ids, or \"*\") each peer may send, by peer name (\"*\" = every peer); a TOML table, or peer=ns1,ns2;*=ns3 on the command line; empty = every namespace from every peer that authenticated"})


@dataclass
class PolicyConfig:
    prefill_tokens_per_s: float = field(default=10000.0, metadata={"help": "default prefill throughput when the worker reports none (tokens/second)"})
    model_params: float = field(default=0.0, metadata={"help": "default model parameter count for the cost model (0 = derive from layout)"})


@dataclass
class ClusterConfig:
    etcd_endpoints: str = field(default="", metadata={"help": "comma-separated host:port of etcd members; empty = no cluster (this daemon alone)"})
    prefix: str = field(default="/kvstore", metadata={"help": "etcd key prefix of this fleet's records (one per fleet sharing an etcd)"})
    node_id: str = field(default="", metadata={"help": "this daemon's name in the fleet; empty = the host name"})
    lease_ttl_s: int = field(default=10, metadata={"help": "etcd lease of the registration: a node silent this long is out of the fleet (seconds, >= 2; renewed every third of it)"})
    etcd_timeout_s: float = field(default=2.0, metadata={"help": "deadline of one etcd call (seconds)"})
    advertise_transfer: str = field(default="", metadata={"help": "host:port peers reach the transfer listener at; empty = transport.listen's address"})
    advertise_control: str = field(default="", metadata={"help": "host:port peers reach the TLS control listener at, for pulls; empty = server.tcp_listen"})
    etcd_ca_file: str = field(default="", metadata={"help": "PEM CA bundle of etcd's server certificate; set for an etcd that serves TLS"})
    etcd_cert_file: str = field(default="", metadata={"help": "PEM client certificate for etcd (mutual TLS)"})
    etcd_key_file: str = field(default="", metadata={"help": "PEM private key of etcd_cert_file"})
    link_prior_bytes_per_s: float = field(default=1.25e9, metadata={"help": "a peer link's bandwidth assumed before its first pull is timed (bytes/second; 10 Gb/s)"})
    link_prior_rtt_s: float = field(default=0.0005, metadata={"help": "a peer link's round trip assumed before one is timed (seconds)"})
    link_alpha: float = field(default=0.3, metadata={"help": "weight of the newest pull or round trip in a link's moving averages, in (0, 1]"})
    peer_lookup_timeout_s: float = field(default=0.05, metadata={"help": "deadline of asking peers, in parallel, for the blocks after a Lookup's local hits (seconds; 0 = ask no one)"})
    peer_lookup_max_peers: int = field(default=8, metadata={"help": "at most this many peers advertising the namespace are asked per Lookup"})
    peer_cooldown_s: float = field(default=10.0, metadata={"help": "a peer whose Push failed on the wire (unreachable, late) is not advised or asked to push for this long, unless named (seconds; 0 = never set aside)"})
    directory: str = field(default="replica", metadata={"help": "where the fleet's prefix directory lives: replica (every daemon reads every peer's KV event stream into memory; up to about 64 nodes) or redis (a Redis/Valkey cluster holds it, sharded by chain; each daemon writes its own blocks there and reads per Lookup)"})
    redis_nodes: str = field(default="", metadata={"help": "redis: comma-separated host:port of some of the Redis/Valkey cluster's nodes (the rest are discovered)"})
    redis_username: str = field(default="", metadata={"help": "redis: ACL user; empty = the default user"})
    redis_password_file: str = field(default="", metadata={"help": "redis: file holding the ACL password (mode 0600 or 0400, owned by the daemon's user; never printed)"})
    redis_tls: bool = field(default=False, metadata={"help": "redis: connect with TLS: the servers' certificates are checked against redis_ca_file (a private CA; their names are not checked, nodes are dialled by address), or without it against the system's CAs, names checked"})
    redis_ca_file: str = field(default="", metadata={"help": "redis: PEM CA bundle of the servers' certificates (implies redis_tls)"})
    redis_cert_file: str = field(default="", metadata={"help": "redis: PEM client certificate, for servers that require one (tls-auth-clients)"})
    redis_key_file: str = field(default="", metadata={"help": "redis: PEM private key of redis_cert_file"})
    redis_timeout_s: float = field(default=0.05, metadata={"help": "redis: deadline of one directory read on a Lookup's path (seconds); a store slower than this or down gives local hits only"})
    redis_retry_s: float = field(default=2.0, metadata={"help": "redis: after a failed call, Lookups skip the store this long before trying again (seconds)"})
    redis_key_prefix: str = field(default="kvd", metadata={"help": "redis: prefix of this fleet's keys (one per fleet sharing a store)"})

    def endpoints(self) -> list[str]:
        return [e.strip() for e in self.etcd_endpoints.split(",") if e.strip()]

    def redis_nodes_list(self) -> list[str]:
        return [e.strip() for e in self.redis_nodes.split(",") if e.strip()]


# Where a part needs pyzmq and msgspec and they are missing: what to install (said by the
# daemon, its cluster wiring and the cluster bench).
EVENTS_EXTRA = "the [events] extra: pip install '.[events]' in the kvstore checkout"


@dataclass
class EventsConfig:
    publish: str = field(default="", metadata={"help": "ZMQ PUB endpoint the daemon binds for its KV events in vLLM's format (tcp://host:port or ipc://path); empty = off"})
    replay: str = field(default="", metadata={"help": "ZMQ ROUTER endpoint for replay by sequence number and snapshots (tcp://host:port or ipc://path); empty = none"})
    topic: str = field(default="", metadata={"help": "topic frame of every message (llm-d reads kv@<pod>@<model>)"})
    buffer_steps: int = field(default=10000, metadata={"help": "batches kept for replay"})
    max_pending_events: int = field(default=100000, metadata={"help": "events queued for the publisher thread; more are dropped (counted), and subscribers resync"})
    batch_interval_s: float = field(default=0.01, metadata={"help": "the publisher sends what is queued this often (seconds)"})
    hwm: int = field(default=100000, metadata={"help": "ZMQ high-water mark of the PUB socket (messages per subscriber)"})
    heartbeat_s: float = field(default=2.0, metadata={"help": "an idle publisher sends an empty batch this often, so a subscriber that lost the last batch finds out (seconds)"})


@dataclass
class Config:
    server: ServerConfig = field(default_factory=ServerConfig)
    dram: DramConfig = field(default_factory=DramConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    nvme: NvmeConfig = field(default_factory=NvmeConfig)
    hbm: HbmConfig = field(default_factory=HbmConfig)
    transport: TransportConfig = field(default_factory=TransportConfig)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    events: EventsConfig = field(default_factory=EventsConfig)

    # -- derived values ---------------------------------------------------------------------
    def resolved_socket_path(self) -> str:
        return self.server.socket_path or os.path.join(_default_runtime_dir(), "kvstore.sock")

    def resolved_dram_bytes(self) -> int:
        if self.dram.capacity_bytes:
            return self.dram.capacity_bytes
        auto = min(total_ram_bytes() // 8, self.dram.max_auto_bytes)
        return max(self.dram.extent_bytes, auto // self.dram.extent_bytes * self.dram.extent_bytes)

    def validate(self) -> "Config":
        s, d = self.server, self.dram
        _check(s.grpc_workers >= 1, "server.grpc_workers", "must be >= 1")
        longest = len(os.fsencode(self.resolved_socket_path() + ARENA_SUFFIX))  # the arena's socket beside it
        _check(longest <= UNIX_PATH_MAX, "server.socket_path", f"{self.resolved_socket_path()!r}: too long for a unix "
               f"socket ({longest} bytes with its {ARENA_SUFFIX!r} twin, at most {UNIX_PATH_MAX}); choose a shorter path")
        _check(1 <= s.max_keys_per_request <= 1 << 22, "server.max_keys_per_request", "must be in [1, 4194304]")
        _check(s.lease_ttl_s > 0, "server.lease_ttl_s", "must be > 0 seconds")
        # Below a second an idle client's keep-alive (every third of the TTL) would have to win
        # against a busy core lock and a busy worker within a few hundred milliseconds.
        _check(1 <= s.session_ttl_s <= 86400, "server.session_ttl_s", "must be in [1, 86400] seconds")
        _check(s.reaper_interval_s > 0, "server.reaper_interval_s", "must be > 0 seconds")
        _check(0 <= s.reserve_wait_s <= 60, "server.reserve_wait_s", "must be in [0, 60] seconds")
        _check(0 <= s.max_waits < s.grpc_workers, "server.max_waits",
               f"must be in [0, grpc_workers - 1 = {s.grpc_workers - 1}]: waits must leave a worker for other calls")
        _check(s.max_waits_per_session >= 1, "server.max_waits_per_session", "must be >= 1")
        _check(0 < s.handout_timeout_s <= 60, "server.handout_timeout_s", "must be in (0, 60] seconds")
        _check(s.handout_per_user >= 1, "server.handout_per_user", "must be >= 1")
        _check(s.log_level in ("debug", "info", "warning", "error"), "server.log_level", "must be debug, info, warning or error")
        if s.tcp_listen:
            _check(bool(s.tls_cert_file and s.tls_key_file), "server.tcp_listen",
                   "a TCP listener requires TLS: set server.tls_cert_file and server.tls_key_file")
            _host_port("server.tcp_listen", s.tcp_listen)
        if s.hints_listen:
            _check(bool(s.tls_cert_file and s.tls_key_file), "server.hints_listen",
                   "the route-hints listener requires TLS: set server.tls_cert_file and server.tls_key_file")
            _check(bool(s.tls_client_ca_file or s.auth_token), "server.hints_listen",
                   "the route-hints listener requires credentials: set server.tls_client_ca_file (client "
                   "certificates) or server.auth_token (a bearer token)")
            _host_port("server.hints_listen", s.hints_listen)
        _check(d.capacity_bytes >= 0, "dram.capacity_bytes", "must be >= 0")
        _check(d.namespace_quota_bytes >= 0, "dram.namespace_quota_bytes", "must be >= 0")
        _check(self.nvme.namespace_quota_bytes >= 0, "nvme.namespace_quota_bytes", "must be >= 0")
        _check(self.nvme.io_timeout_s > 0, "nvme.io_timeout_s", "must be > 0 seconds")
        _check(self.nvme.prefetch_deadline_s > 0, "nvme.prefetch_deadline_s", "must be > 0 seconds")
        _check(d.extent_bytes >= 4096 and d.extent_bytes % 4096 == 0, "dram.extent_bytes", "must be a positive multiple of 4096")
        _check(d.capacity_bytes == 0 or d.capacity_bytes >= d.extent_bytes, "dram.capacity_bytes",
               f"must be at least one extent ({d.extent_bytes} bytes)")
        _check(d.capacity_bytes <= total_ram_bytes(), "dram.capacity_bytes",
               f"exceeds physical RAM ({total_ram_bytes()} bytes)")
        _check(0 <= self.metrics.port < 65536, "metrics.port", "must be in [0, 65535]")
        _check(0 < d.demote_low_watermark < d.demote_high_watermark <= 1, "dram.demote_low_watermark",
               "need 0 < demote_low_watermark < demote_high_watermark <= 1")
        n = self.nvme
        _check(n.capacity_bytes > 0, "nvme.capacity_bytes", "must be > 0")
        _check(n.admit_after_hits >= 0, "nvme.admit_after_hits", "must be >= 0")
        _check(1 <= n.io_threads <= 256, "nvme.io_threads", "must be in [1, 256]")
        _check(n.coalesce_bytes >= 0, "nvme.coalesce_bytes", "must be >= 0")
        _check(n.promote_piece_bytes >= 0, "nvme.promote_piece_bytes", "must be >= 0")
        _check(n.codec in ("off", "auto", "nibble", "planes-zstd"), "nvme.codec", "must be off, auto, nibble or planes-zstd")
        _check(self.hbm.capacity_bytes >= 0, "hbm.capacity_bytes", "must be >= 0")
        _check(self.hbm.streams >= 2, "hbm.streams", "must be >= 2")
        _check(self.hbm.admit_reads >= 1, "hbm.admit_reads", "must be >= 1")
        _check(self.transport.backend in ("tcp", "ucx"), "transport.backend", "must be tcp or ucx")
        if self.transport.listen:
            _host_port("transport.listen", self.transport.listen)
        _check(self.transport.timeout_s > 0, "transport.timeout_s", "must be > 0 seconds")
        _check(self.transport.ucx_progress in ("adaptive", "blocking", "polling"), "transport.ucx_progress",
               "must be adaptive, blocking or polling")
        _check(-1 <= self.transport.verify_threads <= 64, "transport.verify_threads", "must be -1 (auto) or 0..64")
        _check(self.transport.verify_min_bytes >= 0, "transport.verify_min_bytes", "must be >= 0")
        _check(self.transport.compress in ("off", "on", "auto"), "transport.compress", "must be off, on or auto")
        _check(self.transport.compress_below_bytes_per_s > 0, "transport.compress_below_bytes_per_s", "must be > 0")
        _check_transfer_auth(self.transport)
        _check(self.policy.prefill_tokens_per_s > 0, "policy.prefill_tokens_per_s", "must be > 0")
        c = self.cluster
        for e in c.endpoints():
            _host_port("cluster.etcd_endpoints", e)
        _check(c.link_prior_bytes_per_s > 0 and c.link_prior_rtt_s >= 0, "cluster.link_prior_*",
               "need bandwidth > 0 and round trip >= 0")
        _check(0 < c.link_alpha <= 1, "cluster.link_alpha", "must be in (0, 1]")
        _check(0 <= c.peer_cooldown_s <= 3600, "cluster.peer_cooldown_s", "must be in [0, 3600] seconds")
        _check(0 <= c.peer_lookup_timeout_s <= 5 and c.peer_lookup_max_peers >= 1, "cluster.peer_lookup_*",
               "timeout in [0, 5] seconds (it is on every Lookup's path), at least 1 peer")
        _check(c.lease_ttl_s >= 2, "cluster.lease_ttl_s", "must be >= 2 seconds (etcd's shortest lease)")
        _check(0 < c.etcd_timeout_s <= c.lease_ttl_s / 3, "cluster.etcd_timeout_s",
               "must be in (0, lease_ttl_s / 3]: a renewal that hangs must leave time for the next one")
        _check(c.prefix.startswith("/") and not c.prefix.endswith("/"), "cluster.prefix", "must start with / and not end with /")
        _check(bool(re.fullmatch(r"[A-Za-z0-9._-]{0,128}", c.node_id)), "cluster.node_id", "must be 1-128 of A-Z a-z 0-9 . _ -")
        for key in ("advertise_transfer", "advertise_control"):
            if getattr(c, key):
                _host_port(f"cluster.{key}", getattr(c, key))
        _check(bool(c.etcd_cert_file) == bool(c.etcd_key_file), "cluster.etcd_cert_file",
               "etcd_cert_file and etcd_key_file go together")
        _check(c.directory in ("replica", "redis"), "cluster.directory", "must be replica or redis")
        if c.directory == "redis":
            _check(bool(c.endpoints()), "cluster.directory",
                   "redis is the directory of a fleet: set cluster.etcd_endpoints too (membership and epochs stay in etcd)")
            _check(bool(c.redis_nodes_list()), "cluster.redis_nodes",
                   "cluster.directory = redis needs the store's nodes (host:port, comma-separated)")
            for e in c.redis_nodes_list():
                _host_port("cluster.redis_nodes", e)
            _check(bool(c.redis_cert_file) == bool(c.redis_key_file), "cluster.redis_cert_file",
                   "redis_cert_file and redis_key_file go together")
            _check(not c.redis_cert_file or c.redis_tls or bool(c.redis_ca_file), "cluster.redis_cert_file",
                   "a client certificate is for TLS: set cluster.redis_tls (or redis_ca_file), or the password "
                   "would go in clear")
            _check(0 < c.redis_timeout_s <= 5, "cluster.redis_timeout_s", "must be in (0, 5] seconds")
            _check(0 <= c.redis_retry_s <= 600, "cluster.redis_retry_s", "must be in [0, 600] seconds")
            _check(bool(re.fullmatch(r"[A-Za-z0-9._:-]{1,64}", c.redis_key_prefix)), "cluster.redis_key_prefix",
                   "must be 1-64 of A-Z a-z 0-9 . _ : -")
        self._validate_events()
        return self

    def _validate_events(self) -> None:
        e = self.events
        for key, url in (("events.publish", e.publish), ("events.replay", e.replay)):
            if url and not url.startswith("ipc://"):
                _check(url.startswith("tcp://"), key, f"must be tcp://host:port or ipc://path, got {url!r}")
                _host_port(key, url[len("tcp://"):])
        _check(not e.replay or bool(e.publish), "events.replay", "needs events.publish")
        _check(e.buffer_steps >= 1, "events.buffer_steps", "must be >= 1")
        _check(e.max_pending_events >= 1, "events.max_pending_events", "must be >= 1")
        _check(0 < e.batch_interval_s <= 1, "events.batch_interval_s", "must be in (0, 1] seconds")
        _check(e.hwm >= 0, "events.hwm", "must be >= 0 (0 = no limit)")
        _check(e.heartbeat_s >= e.batch_interval_s, "events.heartbeat_s", "must be >= events.batch_interval_s")


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or "localhost") is loopback-only."""
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a name that might resolve anywhere


def _check_transfer_auth(t: "TransportConfig") -> None:
    """The transfer listener's credentials: their shape here; the files are read at start."""
    from kvstore.transport.auth import check_name

    tls = (t.tls_cert_file, t.tls_key_file, t.tls_ca_file)
    _check(all(tls) or not any(tls), "transport.tls_cert_file",
           "mutual TLS needs all three of transport.tls_cert_file, tls_key_file and tls_ca_file")
    _check(not (any(tls) and t.backend == "ucx"), "transport.tls_cert_file",
           "TLS is for the tcp backend; the ucx backend authenticates with transport.secret_file")
    if t.node_name:
        try:
            check_name(t.node_name, "transport.node_name")
        except ValueError as e:
            raise ConfigError(str(e)) from None
    for peer, names in t.accept.items():
        _check(peer == "*" or _valid_name(peer), "transport.accept",
               f"{peer!r}: a peer name (a node name or certificate name) or \"*\"")
        _check(isinstance(names, list) and all(isinstance(n, str) and 0 < len(n) <= 256 for n in names),
               "transport.accept", f"{peer!r}: must be a list of model ids, namespace ids or \"*\"")
    if not t.listen or any(tls) or t.secret_file or t.allow_unauthenticated:
        return
    host = t.listen.rpartition(":")[0]
    if t.backend == "ucx":
        raise ConfigError("transport.listen: the ucx listener listens on every interface (ucxx takes no bind "
                          "address), and it has no authentication: set transport.secret_file, or "
                          "transport.allow_unauthenticated = true if nobody else can reach this host's network")
    _check(is_loopback(host), "transport.listen",
           f"{t.listen} is reachable beyond this host, and the transfer listener has no authentication: set "
           "transport.secret_file, or transport.tls_cert_file, tls_key_file and tls_ca_file, or "
           "transport.allow_unauthenticated = true on a fabric nobody else can reach")


def _valid_name(name: str) -> bool:
    from kvstore.transport.auth import check_name

    try:
        check_name(name)
        return True
    except ValueError:
        return False


def parse_accept(text: str) -> dict:
    """``peer=ns1,ns2;*=ns3`` (the command line's and the environment's form of transport.accept)."""
    out: dict = {}
    for part in filter(None, (p.strip() for p in text.split(";"))):
        peer, sep, names = part.partition("=")
        if not sep:
            raise ValueError(f"{part!r}: expected peer=namespace,namespace")
        out.setdefault(peer.strip(), []).extend(n.strip() for n in names.split(",") if n.strip())
    return out


@functools.lru_cache(maxsize=8)
def _name_set(text: str) -> frozenset[str]:
    """The names of a comma-separated list (asked once per block demoted: parsed once)."""
    return frozenset(x.strip() for x in text.split(",") if x.strip())


def _check(ok: bool, key: str, why: str) -> None:
    if not ok:
        raise ConfigError(f"{key}: {why}")


def _host_port(key: str, text: str) -> None:
    host, sep, port = text.rpartition(":")
    _check(bool(sep and host and port.isdigit() and 0 < int(port) < 65536), key, f"must be host:port, got {text!r}")


def _coerce(key: str, f: dataclasses.Field, value: Any) -> Any:
    want = f.type if isinstance(f.type, type) else {"int": int, "float": float, "bool": bool, "str": str,
                                                    "dict": dict}[f.type]
    try:
        if want is dict:
            if isinstance(value, str):
                return parse_accept(value)
            if not isinstance(value, dict):
                raise ValueError(f"not a table: {value!r}")
            return {str(k): list(v) if isinstance(v, list) else v for k, v in value.items()}
        if want is bool:
            if isinstance(value, bool):
                return value
            low = str(value).strip().lower()
            if low in ("1", "true", "yes", "on"):
                return True
            if low in ("0", "false", "no", "off"):
                return False
            raise ValueError(f"not a boolean: {value!r}")
        if want is int:
            if f.name.endswith("_bytes"):
                n = parse_size(value)  # a bare number is bytes, as the key's name says
                if n < 0:
                    raise ValueError(f"must be >= 0 bytes, got {value!r}")
                return n
            if f.name.endswith("_mode") and isinstance(value, str):
                return int(value, 8)
            if isinstance(value, float) or isinstance(value, bool):
                raise ValueError(f"not an integer: {value!r}")
            return int(value)
        if want is float:
            if isinstance(value, bool):
                raise ValueError(f"not a number: {value!r}")
            return float(value)
        if not isinstance(value, (str, int, float)):
            raise ValueError(f"not a string: {value!r}")
        return str(value)
    except ValueError as e:
        raise ConfigError(f"{key}: {e}") from None


def sections() -> list[tuple[str, type]]:
    return [(f.name, f.default_factory().__class__) for f in fields(Config)]  # type: ignore[misc]


def _apply(cfg: Config, section: str, key: str, value: Any) -> None:
    sec = getattr(cfg, section, None)
    if sec is None or not dataclasses.is_dataclass(sec):
        raise ConfigError(f"{section}: unknown config section (known: {', '.join(n for n, _ in sections())})")
    by_name = {f.name: f for f in fields(sec)}
    if key not in by_name:
        raise ConfigError(f"{section}.{key}: unknown config key")
    setattr(sec, key, _coerce(f"{section}.{key}", by_name[key], value))


def _apply_source(cfg: Config, items: list[tuple[str, str, Any]], where: str, spell) -> None:
    """Apply one source's ``(section, key, value)`` settings. A moved key (:data:`MOVED`) is
    applied as its new one, with a warning that ``spell(section, key)`` names as the source
    spells it; a source that sets both the old and the new key is refused."""
    given = {(section, key) for section, key, _ in items}
    for section, key, value in items:
        new = MOVED.get((section, key))
        if new is not None:
            if new in given:
                raise ConfigError(f"{section}.{key}: moved to {new[0]}.{new[1]}, which {where} also sets; "
                                  f"remove {spell(section, key)}")
            log.warning("%s: %s is deprecated, use %s (the old name still works for now)",
                        where, spell(section, key), spell(*new))
            section, key = new
        _apply(cfg, section, key, value)


def load(path: str | os.PathLike | None = None, env: dict[str, str] | None = None,
         overrides: dict[str, Any] | None = None) -> Config:
    """Build the config from defaults, then ``path`` (TOML), then ``env``, then ``overrides``
    (``{"dram.capacity_bytes": "1GiB"}``, from the command line); validate it; raise
    ConfigError naming the key. Logs a warning for each deprecated key (:data:`MOVED`)."""
    cfg = Config()
    if path:
        from kvstore.transport.auth import read_regular  # a FIFO or a directory as the file: refused at once

        try:
            data = tomllib.loads(read_regular(str(path), "config", 16 << 20).decode())
        except FileNotFoundError:
            raise ConfigError(f"config: file not found: {path}") from None
        except (ValueError, UnicodeDecodeError) as e:
            if isinstance(e, tomllib.TOMLDecodeError):
                raise ConfigError(f"config: {path} is not valid TOML: {e}") from None
            raise ConfigError(str(e) if str(e).startswith("config:") else f"config: {path}: {e}") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config: {path} is not valid TOML: {e}") from None
        for section, table in data.items():
            if not isinstance(table, dict):
                raise ConfigError(f"{section}: expected a [{section}] table")
        _apply_source(cfg, [(section, key, value) for section, table in data.items() for key, value in table.items()],
                      f"config file {path}", lambda section, key: f"[{section}] {key}")
    names = dict(sections())
    from_env = []
    for var, value in (os.environ if env is None else env).items():
        if not var.startswith("KVSTORE_") or var in ("KVSTORE_CONFIG",):
            continue
        rest = var[len("KVSTORE_"):].lower()
        section = next((s for s in names if rest.startswith(s + "_")), None)
        if section is None:
            continue  # other tools' KVSTORE_* variables are not ours to reject
        from_env.append((section, rest[len(section) + 1:], value))
    _apply_source(cfg, from_env, "the environment", lambda section, key: f"KVSTORE_{section}_{key}".upper())
    from_flags = []
    for dotted, value in (overrides or {}).items():
        section, _, key = dotted.partition(".")
        from_flags.append((section, key, value))
    _apply_source(cfg, from_flags, "the command line", _flag)
    return cfg.validate()


REDACTED = "<redacted>"
_SECRET_NAME = re.compile(r"(^|_)(token|secret|password|passphrase)$")  # a path to one (..._file) is not


def is_secret(f: dataclasses.Field) -> bool:
    """A field whose value is a credential: marked ``"secret": True``, or named like one (so a
    knob added later is hidden even if its author forgets the mark)."""
    return bool(f.metadata.get("secret")) or bool(_SECRET_NAME.search(f.name))


def _flag(section: str, key: str) -> str:
    return f"--{section}-{key}".replace("_", "-")


def add_cli_flags(parser) -> None:
    """One ``--section-key`` flag per knob, documented with its unit and default."""
    for section, cls in sections():
        group = parser.add_argument_group(f"[{section}]")
        for f in fields(cls):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            shown = oct(default) if f.name.endswith("_mode") else default
            if is_secret(f) and default:
                shown = REDACTED
            group.add_argument(_flag(section, f.name), dest=f"cfg__{section}__{f.name}",
                               default=None, metavar=f.name.rsplit("_", 1)[-1].upper() if "_" in f.name else "VALUE",
                               help=f"{f.metadata.get('help', '')} [default: {shown!r}]")
        for (old_section, key), new in MOVED.items():
            if old_section == section:
                group.add_argument(_flag(section, key), dest=f"cfg__{section}__{key}", default=None,
                                   metavar=key.rsplit("_", 1)[-1].upper(), help=f"deprecated: use {_flag(*new)}")


def cli_overrides(args) -> dict[str, Any]:
    out = {}
    for name, value in vars(args).items():
        if name.startswith("cfg__") and value is not None:
            _, section, key = name.split("__", 2)
            out[f"{section}.{key}"] = value
    return out


def to_toml(cfg: Config) -> str:
    """The config as TOML (for `kvstore serve --print-config` and the deploy examples). A secret
    that is set shows as ``<redacted>``; an unset one as empty, so the output says which is set."""
    lines = []
    for section, _ in sections():
        lines.append(f"[{section}]")
        for f in fields(getattr(cfg, section)):
            v = getattr(getattr(cfg, section), f.name)
            if is_secret(f) and v:
                lines.append(f'{f.name} = "{REDACTED}"')
            elif isinstance(v, dict):
                import json

                lines.append(f"{f.name} = {{" + ", ".join(f"{json.dumps(k)} = {json.dumps(n)}" for k, n in v.items()) + "}")
            elif isinstance(v, bool):
                lines.append(f"{f.name} = {'true' if v else 'false'}")
            elif f.name.endswith("_mode"):
                lines.append(f'{f.name} = "{v:04o}"')
            elif isinstance(v, (int, float)):
                lines.append(f"{f.name} = {v}")
            else:
                lines.append(f'{f.name} = "{v}"')
        lines.append("")
    return "\n".join(lines)
