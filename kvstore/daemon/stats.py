"""What the daemon reports about itself: the Stats RPC's answer and the Prometheus gauges,
gathered from the core and each tier."""

from __future__ import annotations

import json
import time

from kvstore import __version__
from kvstore.daemon.core import Core, NsState
from kvstore.daemon.index import BlockState
from kvstore.daemon.leases import LeaseKind
from kvstore.daemon.metrics import Metrics
from kvstore.policy import LoadPolicy
from kvstore.tiers.base import TierKind, TierStats
from kvstore.v1 import kvstore_pb2 as pb


class Reporter:
    def __init__(self, core: Core, *, metrics: Metrics, policy: LoadPolicy, hbm=None, nvme=None,
                 nvme_wanted: bool = False, nvme_error: str = "", links=None, directory=None) -> None:
        self.core = core
        self.metrics = metrics
        self.policy = policy
        self.hbm = hbm  # kvstore.tiers.hbm.HbmTier or None
        self.nvme = nvme  # kvstore.tiers.nvme.NvmeTier or None
        self.nvme_wanted = nvme_wanted  # nvme.dir is set (a missing tier is then reported, disabled)
        self.nvme_error = nvme_error  # why the NVMe tier could not start
        self.links = links  # kvstore.daemon.remote.LinkMeter in a cluster, else None
        self.directory = directory  # kvstore.cluster.report.DirectoryReport with a prefix directory, else None
        self.started = time.monotonic()

    @property
    def hbm_emulated(self) -> bool:
        return self.hbm is not None and self.hbm.emulated

    def tier_stats(self) -> list[TierStats]:
        out = [self.core.dram.stats()]
        if self.hbm is not None:
            st = self.hbm.stats()
            st.extra = {"reason": st.extra.get("reason", "")} if st.emulated else {}
            out.insert(0, st)
        if self.nvme is not None:
            st = self.nvme.stats()
            codec = st.extra.get("codec", "off")
            st.extra = ({"codec": codec, "namespaces": st.extra.get("namespaces", {})} if codec != "off" else {}) \
                if st.enabled else {"reason": st.extra.get("disabled_reason", "")}
            out.append(st)
        elif self.nvme_wanted:
            out.append(TierStats(TierKind.NVME, 0, 0, 0, enabled=False, extra={"reason": self.nvme_error}))
        return out

    def refresh_gauges(self) -> None:
        m, core = self.metrics, self.core
        with core.lock:
            reads = sum(1 for lease in core.leases.values() if lease.kind == LeaseKind.READ)
            m.leases_active.labels(kind="read").set(reads)
            m.leases_active.labels(kind="write").set(len(core.leases) - reads)
            m.sessions.set(len(core.sessions))
            tiers = self.tier_stats()  # the slot allocators change under the lock: read them under it
        m.codec_ratio.clear()  # namespaces whose blocks all left a tier drop out
        for st in tiers:
            name = st.kind.name.lower()
            m.tier_capacity.labels(tier=name).set(st.capacity_bytes)
            m.tier_used.labels(tier=name).set(st.used_bytes)
            m.tier_usage.labels(tier=name).set(st.used_bytes / st.capacity_bytes if st.capacity_bytes else 0)
            m.tier_blocks.labels(tier=name).set(st.blocks)
            m.tier_enabled.labels(tier=name).set(1 if st.enabled else 0)
            for ns, use in st.extra.get("namespaces", {}).items():  # a tier with a codec on
                m.codec_ratio.labels(tier=name, namespace=ns[:16]).set(use["ratio"])
        m.hbm_emulated.set(1 if self.hbm_emulated else 0)
        for path, est in self.policy.bandwidth.snapshot().items():
            m.tier_bandwidth.labels(path=path).set(est.bytes_per_s)
        if self.directory is not None:
            self.directory.refresh_gauges()

    def stats_pb(self) -> pb.StatsResponse:
        core = self.core
        with core.lock:
            tiers = self.tier_stats()
            nss = []
            for st in core.namespaces.values():
                usage = _ns_usage(st)
                nss.append(pb.NamespaceStats(
                    namespace_id=st.id, model_id=st.ns.model_id, block_bytes=st.block_bytes,
                    blocks_by_tier={k: v[0] for k, v in usage.items()},
                    bytes_by_tier={k: v[1] for k, v in usage.items()}, sessions=st.sessions))
            counters = {"sessions": float(len(core.sessions)), "leases": float(len(core.leases))}
        self.refresh_gauges()
        for metric in self.metrics.registry.collect():
            if metric.type == "counter":
                for sample in metric.samples:
                    if sample.name.endswith("_total"):
                        counters[sample.name] = counters.get(sample.name, 0.0) + sample.value
        resp = pb.StatsResponse(
            version=__version__, uptime_s=time.monotonic() - self.started, hbm_emulated=self.hbm_emulated,
            tiers=[pb.TierStats(tier=int(t.kind), capacity_bytes=t.capacity_bytes, used_bytes=t.used_bytes,
                                blocks=t.blocks, emulated=t.emulated, enabled=t.enabled,
                                detail=json.dumps(t.extra) if t.extra else "") for t in tiers],
            namespaces=nss, counters=counters, links=self.links.links_pb() if self.links is not None else ())
        if self.directory is not None:
            resp.streams.extend(self.directory.streams_pb())
            resp.directory.CopyFrom(self.directory.size_pb())
        return resp


def _ns_usage(st: NsState) -> dict[str, tuple[int, int]]:
    """(blocks, bytes) per tier of one namespace's committed blocks."""
    out: dict[str, list[int]] = {}
    for b in st.blocks.values():
        if b.state is BlockState.COMMITTED:
            c = out.setdefault(b.tier.name.lower(), [0, 0])
            c[0] += 1
            c[1] += st.block_bytes
    return {k: (v[0], v[1]) for k, v in out.items()}
