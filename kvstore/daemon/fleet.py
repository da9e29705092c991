"""The daemon's part in a fleet, when ``[cluster]`` names etcd endpoints: its registration in
etcd (:class:`~kvstore.cluster.membership.Membership`), the cluster prefix directory fed by
the peers' KV events (where the ``[events]`` extra is installed), pulls from the peer that
holds a prefix (:class:`~kvstore.daemon.pull.Pulls`) and the Lookup advice that weighs them
(:class:`~kvstore.daemon.remote.ClusterAdvisor`). docs/cluster.md has the design.

:class:`Fleet` is built by the daemon before its listeners, joins (:meth:`Fleet.join`) once
the daemon serves, and leaves first at shutdown (:meth:`Fleet.leave`), so that peers stop
sending here at once; :meth:`Fleet.close` then lets go of the peer channels and the streams.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable

from kvstore.cluster.metrics import ClusterMetrics
from kvstore.config import EVENTS_EXTRA, Config
from kvstore.daemon.core import Core
from kvstore.daemon.preflight import StartupError, split_host_port
from kvstore.daemon.remote import LinkMeter
from kvstore.policy import LoadPolicy

log = logging.getLogger("kvstore.daemon")


class Fleet:
    """Membership, and with a transfer listener (``outbound``) the directory, pulls and the
    cluster advice. ``on_registered(bool)``: told each time the registration in etcd starts or
    stops holding (the daemon's cluster health)."""

    def __init__(self, cfg: Config, core: Core, policy: LoadPolicy, outbound, tiering, *,
                 metrics: ClusterMetrics, meter: LinkMeter | None, on_registered: Callable[[bool], None],
                 store_directory=None) -> None:
        """``store_directory``: with ``cluster.directory = redis``, the directory in the store
        (:class:`~kvstore.cluster.redis_directory.RedisDirectory`, the core's block events
        already feed it); otherwise the peers' streams are read into a replica here."""
        self.cfg = cfg
        self.core = core
        self.membership = self._membership(on_registered, metrics)
        self.store_directory = store_directory
        self.directory = None  # the cluster prefix directory (kvstore.cluster.stream or the store's), with pulls
        self.pulls = None
        self.advisor = None
        if outbound is None:
            return
        from kvstore.daemon.pull import PeerLinks, Pulls
        from kvstore.daemon.remote import AskedRemoteHits, ClusterAdvisor

        links, holders = PeerLinks(cfg.server), self._holders()
        self.pulls = Pulls(core, self.membership, outbound, links, cfg.transport, holders=holders, tiering=tiering,
                           metrics=metrics, meter=meter)
        sources = [AskedRemoteHits(self.membership, holders, links, meter, cfg.cluster)]
        if self.directory is not None:  # answers from memory: first, and on every Lookup
            from kvstore.cluster.holders import DirectoryRemoteHits
            sources.insert(0, DirectoryRemoteHits(self.directory, self.membership))
        self.advisor = ClusterAdvisor(core, policy, sources, meter, metrics)

    def _membership(self, on_registered: Callable[[bool], None], metrics: ClusterMetrics):
        """This daemon's registration in etcd; it registers at :meth:`join`."""
        from kvstore.cluster.etcd import Etcd, EtcdTls
        from kvstore.cluster.membership import Membership, State

        c = self.cfg.cluster
        try:  # each file read once, never blocking (a FIFO is refused at once)
            etcd = Etcd(c.endpoints(), EtcdTls(c.etcd_ca_file, c.etcd_cert_file, c.etcd_key_file))
        except ValueError as e:
            raise StartupError(str(e)) from None
        return Membership(c, etcd, c.node_id or socket.gethostname(), metrics=metrics,
                          on_state=lambda st: on_registered(st is State.REGISTERED))

    def _holders(self):
        """Where a pull looks for a chain: the cluster prefix directory, fed by the peers' KV
        events, where pyzmq is installed (peers that publish no events are asked after the
        ones the directory names); otherwise every peer advertising the namespace."""
        from kvstore.daemon.pull import AdvertisedHolders

        if self.store_directory is not None:
            from kvstore.cluster.holders import DirectoryHolders

            self.directory = self.store_directory
            return DirectoryHolders(self.directory, self.membership,
                                    covers=lambda m: m.capabilities.get("directory") == "redis")
        try:
            from kvstore.cluster.holders import DirectoryHolders
            from kvstore.cluster.stream import ClusterDirectory, DirectoryConfig
        except ImportError as e:
            log.info("cluster: no prefix directory (%s; %s): pulls ask every peer advertising the namespace",
                     e, EVENTS_EXTRA)
            return AdvertisedHolders(self.membership)
        self.directory = ClusterDirectory(DirectoryConfig(self_id=self.membership.node_id), self.membership.peers)
        return DirectoryHolders(self.directory, self.membership)

    def join(self, transfer_address: str, tiers: list[str]) -> None:
        """Register in etcd with what peers learn of this daemon, and start reading the peers'
        streams. ``transfer_address``: where the transfer listener listens ("" without one);
        ``tiers``: the tiers this daemon runs."""
        self.membership.start(self._advert(transfer_address, tiers))
        if self.directory is not None and self.directory is self.store_directory:
            from kvstore.daemon.events import CoreState

            self.directory.start(self.membership, CoreState(self.core))
        elif self.directory is not None:
            self.directory.start()

    def _advert(self, transfer_address: str, tiers: list[str]):
        """Where this daemon's transfer listener and its TLS control listener (for Push) are,
        and what it runs."""
        from kvstore import __version__
        from kvstore.cluster.member import Member

        c = self.cfg.cluster
        caps = {"version": __version__, "transport": self.cfg.transport.backend if transfer_address else "",
                "tiers": tiers, "control_addr": c.advertise_control or self.cfg.server.tcp_listen,
                "directory": "redis" if self.store_directory is not None else "replica"}
        transfer = c.advertise_transfer or transfer_address
        events, replay = (reachable_url(self.cfg.events.publish, transfer),
                          reachable_url(self.cfg.events.replay, transfer))
        return Member(self.membership.node_id, 0, transfer_addr=transfer, events_addr=events, replay_addr=replay,
                      capabilities=caps)

    def advertise(self, core: Core) -> None:
        """Advertise the namespaces held here (the membership thread publishes a change)."""
        with core.lock:
            held = [ns_id.hex() for ns_id in core.namespaces]
        self.membership.set_namespaces(held)

    def leave(self, timeout_s: float) -> None:
        """Leave etcd (revoking the lease, within ``timeout_s`` seconds): peers stop sending here.
        A store-backed directory's writer stops first (what it queued written): nothing is
        written under this registration once peers may have swept it."""
        if self.store_directory is not None:
            self.store_directory.stop()
        self.membership.stop(timeout_s)

    def close(self) -> None:
        """After :meth:`leave`, once the daemon's RPCs are done: the channels to peers (a pull
        still running ends as a miss) and the peers' streams."""
        if self.pulls is not None:
            self.pulls.close()
        if self.directory is not None:
            self.directory.stop()


def reachable_url(url: str, advertised: str) -> str:
    """``url`` (an events socket, ``tcp://host:port`` or ``ipc://path``) as peers reach it: a
    wildcard bind host is replaced by the advertised transfer address's host; ipc:// is this
    node's only and is not advertised."""
    if not url.startswith("tcp://"):
        return ""
    host, port = split_host_port(url[len("tcp://"):])
    host = host.strip("[]")
    if host in ("0.0.0.0", "::", "*", "") and advertised:
        host = split_host_port(advertised)[0].strip("[]")
    return f"tcp://{host}:{port}" if ":" not in host else f"tcp://[{host}]:{port}"
