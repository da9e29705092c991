"""What the daemon reports of its cluster prefix directory: each peer stream's state and lag,
and the directory's size, for the Stats RPC (``kvstore cluster``, ``kvstore stats``) and the
cluster gauges."""

from __future__ import annotations

import threading

from kvstore.cluster.metrics import ClusterMetrics
from kvstore.cluster.stream import ClusterDirectory, SyncState
from kvstore.v1 import kvstore_pb2 as pb

_STATE_PB = {SyncState.LIVE: pb.STREAM_LIVE, SyncState.SNAPSHOT: pb.STREAM_SNAPSHOT,
             SyncState.REPLAY: pb.STREAM_REPLAY}


class DirectoryReport:
    def __init__(self, directory: ClusterDirectory, metrics: ClusterMetrics) -> None:
        self.directory = directory
        self.metrics = metrics
        self._peers: set[str] = set()  # peers with gauges: a peer gone has its series removed
        self._lock = threading.Lock()

    def streams_pb(self) -> list[pb.EventStream]:
        """Stats' view of every peer stream."""
        out = []
        for s in self.directory.status():
            out.append(pb.EventStream(
                node_id=s["node_id"], epoch=s["epoch"], state=_STATE_PB[SyncState(s["state"])],
                next_seq=-1 if s["next_seq"] is None else s["next_seq"], entries=s["entries"], batches=s["batches"],
                last_batch_age_s=-1.0 if s["last_batch_age_s"] is None else s["last_batch_age_s"],
                lag_s=-1.0 if s["lag_s"] is None else s["lag_s"], held_batches=s["held_batches"],
                replays=s["replay"], snapshots=s["snapshot"], drops=s["dropped"]))
        return out

    def size_pb(self) -> pb.DirectorySize:
        return pb.DirectorySize(**self.directory.size())

    def refresh_gauges(self) -> None:
        """Set the stream and directory gauges (from the reaper thread and Stats' gRPC threads)."""
        m = self.metrics
        status = self.directory.status()
        size = self.directory.size()
        with self._lock:
            m.directory_entries.set(size["entries"])
            m.directory_blocks.set(size["blocks"])
            peers = set()
            for s in status:
                if s["lag_s"] is None:  # nothing applied yet (the first snapshot is under way): no lag to show
                    continue
                peers.add(s["node_id"])
                m.stream_lag.labels(peer=s["node_id"]).set(s["lag_s"])
                m.stream_held.labels(peer=s["node_id"]).set(s["held_batches"])
            for gone in self._peers - peers:
                m.stream_lag.remove(gone)
                m.stream_held.remove(gone)
            self._peers = peers
