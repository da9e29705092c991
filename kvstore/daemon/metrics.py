"""Prometheus metrics the daemon exports on ``/metrics``. One registry per daemon.

Every name here is part of the operator contract: the Grafana dashboard and the alert rules in
``deploy/`` use them, and a test scrapes a real daemon to check each one is exported.
Sizes are bytes, times are seconds (Prometheus base units).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

TIER_LABELS = ("hbm", "dram", "nvme")

_LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                    0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.info = Gauge("kvstore_info", "Daemon build and mode (value 1)", ["version", "hbm_emulated"], registry=r)
        # Tiers
        self.tier_capacity = Gauge("kvstore_tier_capacity_bytes", "Capacity of a tier", ["tier"], registry=r)
        self.tier_used = Gauge("kvstore_tier_used_bytes", "Bytes held in a tier", ["tier"], registry=r)
        self.tier_usage = Gauge("kvstore_tier_usage_ratio", "used / capacity of a tier", ["tier"], registry=r)
        self.tier_blocks = Gauge("kvstore_tier_blocks", "Blocks held in a tier", ["tier"], registry=r)
        self.tier_enabled = Gauge("kvstore_tier_enabled", "1 when the tier is serving", ["tier"], registry=r)
        self.codec_ratio = Gauge("kvstore_tier_codec_ratio", "Raw block bytes per slot byte a tier's codec achieves, "
                                 "per namespace (first 16 hex digits of its id)", ["tier", "namespace"], registry=r)
        self.hbm_emulated = Gauge("kvstore_hbm_emulated", "1 when the HBM tier runs on an emulated device", registry=r)
        # Lookups
        self.lookups = Counter("kvstore_lookups", "Lookup requests", registry=r)
        self.lookup_query_tokens = Counter("kvstore_lookup_query_tokens", "Tokens (full blocks) asked for in lookups", registry=r)
        self.lookup_hit_tokens = Counter("kvstore_lookup_hit_tokens", "Tokens of the leading cached prefix found", ["tier"], registry=r)
        self.prefix_caching = Gauge("kvstore_prefix_caching_enabled", "1 when prefix lookup is served", registry=r)
        # Blocks
        self.blocks_committed = Counter("kvstore_blocks_committed", "Blocks committed", registry=r)
        self.bytes_written = Counter("kvstore_written_bytes", "Bytes committed by clients", registry=r)
        self.evictions = Counter("kvstore_evictions", "Blocks evicted", ["tier", "reason"], registry=r)
        self.lease_expiries = Counter("kvstore_lease_expiries", "Leases reclaimed after their TTL", ["kind"], registry=r)
        self.leases_active = Gauge("kvstore_leases_active", "Open leases", ["kind"], registry=r)
        self.sessions = Gauge("kvstore_sessions", "Registered client sessions", registry=r)
        self.session_ends = Counter("kvstore_session_ends", "Sessions ended: closed by their client, exited with "
                                    "their client's process, or expired after server.session_ttl_s without a call "
                                    "(a worker that hangs or cannot be watched)", ["reason"], registry=r)
        self.namespaces = Gauge("kvstore_namespaces", "Namespaces with state in the daemon", registry=r)
        self.rejections = Counter("kvstore_rejected_requests", "Requests refused, by gRPC status", ["method", "code"], registry=r)
        self.rpc_latency = Histogram("kvstore_rpc_latency_seconds", "Server-side RPC latency", ["method"],
                                     buckets=_LATENCY_BUCKETS, registry=r)
        # Tier movement and NVMe
        self.demotions = Counter("kvstore_demotions", "Blocks moved down a tier", ["src", "dst"], registry=r)
        self.promotions = Counter("kvstore_promotions", "Blocks moved up a tier", ["src", "dst"], registry=r)
        self.nvme_bytes = Counter("kvstore_nvme_io_bytes", "Bytes moved to/from NVMe", ["op"], registry=r)
        self.nvme_ops = Counter("kvstore_nvme_io_ops", "NVMe block reads and writes", ["op"], registry=r)
        self.checksum_failures = Counter("kvstore_checksum_failures", "Blocks or chunks whose checksum did not match", ["source"], registry=r)
        self.prefetch_latency = Histogram("kvstore_prefetch_latency_seconds", "Prefetch start to done", buckets=_LATENCY_BUCKETS, registry=r)
        self.prefetch_deadline_misses = Counter("kvstore_prefetch_deadline_misses", "Prefetches that passed their deadline", registry=r)
        self.prefetch_blocks = Counter("kvstore_prefetch_blocks", "Blocks made resident by prefetch", registry=r)
        # Policy
        self.policy_decisions = Counter("kvstore_policy_decisions", "Load-or-recompute answers", ["decision"], registry=r)
        self.tier_bandwidth = Gauge("kvstore_tier_bandwidth_bytes_per_second", "Measured moving-average bandwidth", ["path"], registry=r)
        # Transfer
        self.events_published = Counter("kvstore_events_published_batches", "KV event batches published", registry=r)
        self.events_dropped = Counter("kvstore_events_dropped", "KV events dropped: the publisher's queue was full "
                                      "(events.max_pending_events); subscribers resync", registry=r)
        self.events_resyncs = Counter("kvstore_events_resyncs", "Replay and snapshot requests served", ["kind"], registry=r)
        self.transfer_bytes = Counter("kvstore_transfer_bytes", "Bytes shipped between daemons", ["direction", "backend"], registry=r)
        self.transfer_wire_bytes = Counter("kvstore_transfer_wire_bytes", "Bytes of block payload sent on the wire to daemons "
                                           "(encoded blocks at their encoded size: transport.compress)", ["direction", "backend"], registry=r)
        self.transfer_chunks = Counter("kvstore_transfer_chunks", "Layer chunks shipped", ["direction", "backend"], registry=r)
        self.transfer_failures = Counter("kvstore_transfer_failures", "Transfers failed", ["reason"], registry=r)
        self.transfer_auth_failures = Counter("kvstore_transfer_auth_failures", "Peers the transfer listener dropped "
                                              "in the handshake (tls, hmac, mode, deadline, admission, protocol)", ["reason"], registry=r)
        self.transfer_latency = Histogram("kvstore_transfer_latency_seconds", "Whole transfer latency", ["backend"],
                                          buckets=_LATENCY_BUCKETS, registry=r)

        self.hbm_emulated.set(0)
        self.prefix_caching.set(1)
        for t in TIER_LABELS:
            for g in (self.tier_capacity, self.tier_used, self.tier_usage, self.tier_blocks, self.tier_enabled):
                g.labels(tier=t).set(0)
        for kind in ("read", "write"):
            self.lease_expiries.labels(kind=kind)
        for reason in ("closed", "expired"):
            self.session_ends.labels(reason=reason)
            self.leases_active.labels(kind=kind).set(0)
        for reason in ("capacity", "delete", "drop"):
            self.evictions.labels(tier="dram", reason=reason)
        self.demotions.labels(src="dram", dst="nvme")
        self.promotions.labels(src="nvme", dst="dram")
        for op in ("read", "write"):
            self.nvme_bytes.labels(op=op)
            self.nvme_ops.labels(op=op)
        for src in ("nvme", "transfer"):
            self.checksum_failures.labels(source=src)
        for d in ("load", "recompute", "partial"):
            self.policy_decisions.labels(decision=d)
        for reason in ("peer", "timeout", "checksum", "auth", "forbidden", "other"):
            self.transfer_failures.labels(reason=reason)
        for reason in ("tls", "hmac", "mode", "deadline", "admission", "protocol"):
            self.transfer_auth_failures.labels(reason=reason)
        for d in ("send", "recv"):
            for b in ("ucx", "tcp"):
                self.transfer_bytes.labels(direction=d, backend=b)
                self.transfer_chunks.labels(direction=d, backend=b)
            self.transfer_wire_bytes.labels(direction="send", backend="tcp")
        for t in TIER_LABELS:
            self.lookup_hit_tokens.labels(tier=t)

    def serve(self, host: str, port: int):
        """Start the /metrics HTTP endpoint; returns ``(server, thread)``."""
        return start_http_server(port, addr=host, registry=self.registry)
