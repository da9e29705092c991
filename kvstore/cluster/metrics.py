"""The cluster's Prometheus metrics, in the daemon's registry (:class:`kvstore.daemon.metrics.Metrics`)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

STATES = ("joining", "registered", "unreachable", "lost")
_RENEW_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class ClusterMetrics:
    def __init__(self, r: CollectorRegistry) -> None:
        self.state = Gauge("kvstore_cluster_state", "Membership state: 1 for the current one (registered, "
                           "unreachable = etcd does not answer but the lease may live, lost, joining)", ["state"], registry=r)
        self.epoch = Gauge("kvstore_cluster_epoch", "This daemon's registration epoch (0 while not registered)", registry=r)
        self.members = Gauge("kvstore_cluster_members", "Registered daemons this one sees, itself included", registry=r)
        self.lease_left = Gauge("kvstore_cluster_lease_ttl_seconds", "TTL etcd gave at the last renewal", registry=r)
        self.renew_latency = Histogram("kvstore_cluster_lease_renew_seconds", "Lease renewal round trip",
                                       buckets=_RENEW_BUCKETS, registry=r)
        self.etcd_errors = Counter("kvstore_cluster_etcd_errors", "etcd calls that failed, by call", ["op"], registry=r)
        self.rejoins = Counter("kvstore_cluster_rejoins", "Registrations after a lost lease (each a new epoch)", registry=r)
        self.pulls = Counter("kvstore_cluster_pulls", "Pulls asked of this daemon: ok (blocks came), miss (none "
                             "could: no holder, fenced, evicted, dead or late peer)", ["result"], registry=r)
        self.pull_latency = Histogram("kvstore_cluster_pull_seconds", "A pull from its start to its answer",
                                      buckets=_RENEW_BUCKETS, registry=r)
        self.pushes = Counter("kvstore_cluster_pushes", "Pushes peers asked of this daemon: ok, fenced "
                              "(an epoch is not current), denied (the caller's certificate does not name the requester), "
                              "missing (none of the blocks here), failed (transfer)",
                              ["result"], registry=r)
        self.link_bandwidth = Gauge("kvstore_cluster_link_bandwidth_bytes_per_second", "A peer link's pull bandwidth "
                                    "(moving average, pulls' bytes over their time less a round trip)", ["peer"], registry=r)
        self.link_rtt = Gauge("kvstore_cluster_link_rtt_seconds", "A peer link's control round trip (moving average)",
                              ["peer"], registry=r)
        self.stream_lag = Gauge("kvstore_cluster_stream_lag_seconds", "A peer's KV event stream: this node's wall "
                                "clock less the publish time of the newest batch applied (heartbeats included; "
                                "clock skew included)", ["peer"], registry=r)
        self.stream_held = Gauge("kvstore_cluster_stream_held_batches", "A peer's KV event batches received but not "
                                 "applied yet (behind a gap, a replay or a snapshot)", ["peer"], registry=r)
        self.directory_entries = Gauge("kvstore_cluster_directory_entries", "(node, block) entries in the cluster "
                                       "prefix directory, over every peer", registry=r)
        self.directory_blocks = Gauge("kvstore_cluster_directory_blocks", "Distinct blocks in the cluster prefix "
                                      "directory", registry=r)
        self.directory_store_errors = Counter("kvstore_cluster_directory_store_errors", "Calls to the directory's "
                                              "store (cluster.directory = redis) that failed: reader (a Lookup's "
                                              "read; local hits only for redis_retry_s), writer (this node's "
                                              "entries; rewritten once it answers)", ["side"], registry=r)
        for side in ("reader", "writer"):
            self.directory_store_errors.labels(side=side)
        self.advice = Counter("kvstore_cluster_advice", "Lookup's advice in a cluster: load, pull, recompute",
                              ["advice"], registry=r)
        for advice in ("load", "pull", "recompute"):
            self.advice.labels(advice=advice)
        for result in ("ok", "miss"):
            self.pulls.labels(result=result)
        for result in ("ok", "fenced", "denied", "missing", "failed"):
            self.pushes.labels(result=result)
        for op in ("keepalive", "grant", "watch", "put", "txn", "get", "range"):
            self.etcd_errors.labels(op=op)

    def set_state(self, state: str) -> None:
        for s in STATES:
            self.state.labels(state=s).set(1 if s == state else 0)
