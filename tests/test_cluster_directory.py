"""The cluster prefix directory: exact bookkeeping (no sockets), then fed by real daemons'
event streams through membership records: gaps closed by replay, gaps past the replay buffer
closed by a snapshot, nodes that leave or come back under a new epoch forgotten."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import pytest

from kvstore.cluster.directory import BYTES_PER_ENTRY, Directory, PrefixHit
from kvstore.cluster.stream import ClusterDirectory, DirectoryConfig, PeerStream, SyncState
from kvstore.kv_events import AllBlocksCleared, BlockRemoved, stored_events
from kvstore.tier_kind import TierKind
from wait_util import wait_for

DRAM, NVME, HBM = TierKind.DRAM, TierKind.NVME, TierKind.HBM
K = [bytes([i]) * 32 for i in range(8)]


def stored(keys, medium="CPU"):
    return stored_events([(k, None, None, 16, "") for k in keys], medium)


def test_longest_prefix_per_node_and_tier_step():
    d = Directory()
    a, b = d.add_node("a", 1), d.add_node("b", 7)
    d.apply(a, stored(K[:3]) + stored(K[3:4], "STORAGE"))
    d.apply(b, stored(K[:2], "STORAGE") + stored(K[:1], "GPU"))
    assert d.longest_prefix(b"ns", K[:6]) == [
        PrefixHit("a", 1, NVME, 4), PrefixHit("a", 1, DRAM, 3), PrefixHit("b", 7, NVME, 2), PrefixHit("b", 7, HBM, 1)]
    assert d.longest_prefix(b"ns", K[5:]) == [] and d.longest_prefix(b"ns", []) == []
    assert (d.blocks(), d.entries()) == (4, 6)


def test_removal_per_tier_clear_and_drop():
    d = Directory()
    a, b = d.add_node("a", 1), d.add_node("b", 1)
    d.apply(a, stored(K[:2]) + stored(K[:2], "STORAGE"))
    d.apply(b, stored(K[:1]))
    d.apply(a, [BlockRemoved(block_hashes=[K[0]], medium="CPU")])  # demoted: still on NVMe
    assert d.longest_prefix("ns", K[:2])[0] == PrefixHit("a", 1, NVME, 2)
    d.apply(a, [BlockRemoved(block_hashes=[K[0]], medium="STORAGE")])
    assert d.longest_prefix("ns", K[:2]) == [PrefixHit("b", 1, DRAM, 1)]
    assert d.where[K[0]] == b.idx and K[1] in a.held
    d.apply(b, [AllBlocksCleared()])
    assert K[0] not in d.where and d.longest_prefix("ns", K[1:2]) == [PrefixHit("a", 1, DRAM, 1)]
    d.drop_node("a")
    assert not d.where and d.entries() == 0
    c = d.add_node("c", 1)
    assert c.idx == a.idx  # the index is reused: holder tuples stay small


def test_a_new_epoch_drops_what_the_old_registration_announced_and_namespaces_filter():
    d = Directory()
    a = d.add_node("a", 1, ["aa" * 32])
    d.apply(a, stored(K[:2]))
    assert d.add_node("a", 1, ["aa" * 32]) is a and d.entries() == 2
    assert d.longest_prefix(bytes.fromhex("bb" * 32), K[:2]) == []
    assert d.longest_prefix(bytes.fromhex("aa" * 32), K[:2]) == [PrefixHit("a", 1, DRAM, 2)]
    a2 = d.add_node("a", 2)
    assert a2 is not a and d.entries() == 0 and not d.where


def test_a_block_every_node_holds_and_the_lookup_limit():
    d = Directory()
    nodes = [d.add_node(f"n{i:02}", 1) for i in range(20)]
    for i, n in enumerate(nodes):  # all hold the prompt K[0:2]; n19 goes deepest, n18 next
        d.apply(n, stored(K[:2] + (K[2:2 + max(0, i - 17)])))
    assert isinstance(d.where[K[0]], set) and isinstance(d.where[K[3]], int) and d.where[K[2]] == (18, 19)
    hits = d.longest_prefix("ns", K[:6], limit=3)
    assert [(h.node_id, h.n_blocks) for h in hits] == [("n19", 4), ("n18", 3), ("n00", 2)]
    for n in nodes[:15]:
        d.drop_node(n.node_id)
    assert isinstance(d.where[K[0]], tuple) and sorted(d.where[K[0]]) == [15, 16, 17, 18, 19]
    assert d.entries() == 5 * 2 + 2 + 1


# --- fed by real daemons -------------------------------------------------------------------

@dataclass
class Member:
    """A membership record as the etcd side gives it (only the fields the directory reads)."""

    node_id: str
    epoch: int
    events_addr: str
    replay_addr: str
    namespaces: list[str] = field(default_factory=list)


class LossyStream(PeerStream):
    """Loses the live batches numbered in ``lose`` (a subscriber behind a lossy link)."""

    lose: set[int] = set()

    def take_live(self, n: int, payload: bytes) -> None:
        if n not in self.lose:
            super().take_live(n, payload)


class LossyDirectory(ClusterDirectory):
    stream_cls = LossyStream


LAYOUT_ARGS = (2, 2, 16, "fp16")
BT = 4


@pytest.fixture(scope="module")
def peers(module_daemons, tmp_path_factory):
    """A: a plain publisher. B: a publisher whose queue holds 2 events and whose replay buffer
    keeps 2 batches, so it drops events (and its subscribers must resync from a snapshot)."""
    from daemon_util import DaemonSpec

    d = tmp_path_factory.mktemp("cl")
    flags = ("--dram-prefault", "false")
    a, b = module_daemons.start(
        DaemonSpec((*flags, "--events-publish", f"ipc://{d}/a", "--events-replay", f"ipc://{d}/ar"), name="a"),
        DaemonSpec((*flags, "--events-publish", f"ipc://{d}/b", "--events-replay", f"ipc://{d}/br",
                    "--events-max-pending-events", "2", "--events-buffer-steps", "2",
                    "--events-batch-interval-s", "0.2"), name="b"))
    return {"a": (a, Member("a", 1, f"ipc://{d}/a", f"ipc://{d}/ar")),
            "b": (b, Member("b", 1, f"ipc://{d}/b", f"ipc://{d}/br"))}


def client(proc):
    from kvstore.clients import KVStoreClient
    from kvstore.layout import KVLayout

    c = KVStoreClient(proc.socket_path, timeout_s=10)
    c.register(KVLayout(*LAYOUT_ARGS, block_tokens=BT), "cluster-model")
    return c


def put(c, tokens) -> list[bytes]:
    c.put(tokens, np.zeros(c.layout.tensor_shape(len(tokens)), np.float16))
    return c.keys(tokens)


def drive(cd: ClusterDirectory, pred, what: str):
    """Run the directory's two steps on this thread until ``pred()``."""
    def step():
        cd.refresh()
        cd.poll(20)
        return pred()
    return wait_for(step, what=what)


def test_peers_streams_build_the_directory_and_membership_prunes_it(peers):
    (a, ma), (b, mb) = peers["a"], peers["b"]
    members = [ma, mb]
    cd = ClusterDirectory(DirectoryConfig(self_id="me"), lambda: list(members))
    ca, cb = client(a), client(b)
    ns = ca.namespace.root
    try:
        tokens = list(range(100, 100 + 6 * BT))
        keys = put(ca, tokens)
        put(cb, tokens[:2 * BT])
        want = [PrefixHit("a", 1, DRAM, 6), PrefixHit("b", 1, DRAM, 2)]
        drive(cd, lambda: cd.longest_prefix(ns, keys) == want, "both peers' stores")
        # B queues at most 2 events: a put of 8 blocks loses 6 of them, and batch numbers skip.
        more = put(cb, list(range(5000, 5000 + 8 * BT)))
        drive(cd, lambda: cd.longest_prefix(ns, more) == [PrefixHit("b", 1, DRAM, 8)], "B resynced by snapshot")
        st = {s["node_id"]: s for s in cd.status()}
        assert st["b"]["snapshot"] >= 2 and st["b"]["state"] == "live" and st["a"]["snapshot"] == 1
        assert "kvstore_events_dropped_total 6.0" in _metrics(b)
        # B comes back under a new epoch: what the old one announced goes, and is rebuilt.
        members[1] = Member("b", 2, mb.events_addr, mb.replay_addr)
        drive(cd, lambda: cd.longest_prefix(ns, more) == [PrefixHit("b", 2, DRAM, 8)], "B under epoch 2")
        # A leaves membership: its entries go at the next refresh.
        del members[0]
        drive(cd, lambda: cd.longest_prefix(ns, keys) == [PrefixHit("b", 2, DRAM, 2)], "A forgotten")
    finally:
        cd.stop()
        ca.close()
        cb.close()


def test_a_lost_batch_is_replayed_and_nothing_is_rebuilt(peers):
    a, ma = peers["a"]
    wall = time.time() + 100.0  # one instant: lags then compare only the batches' publish times
    cd = LossyDirectory(DirectoryConfig(), lambda: [ma], wall=lambda: wall)
    c = client(a)
    ns = c.namespace.root
    try:
        first = put(c, list(range(9000, 9000 + BT)))
        drive(cd, lambda: cd.longest_prefix(ns, first), "the first store")
        stream = cd.streams["a"]
        LossyStream.lose = {stream.expected}  # the next live batch never arrives
        lost = put(c, list(range(9100, 9100 + BT)))
        after = put(c, list(range(9200, 9200 + BT)))
        # Behind the gap: what came after it is held back, and the lag is the last applied batch's.
        drive(cd, lambda: stream.state is SyncState.REPLAY, "the gap seen")
        (behind,) = cd.status()
        assert behind["state"] == "replay" and behind["held_batches"] >= 1
        assert behind["lag_s"] == round(wall - stream.applied_ts, 3)
        drive(cd, lambda: cd.longest_prefix(ns, lost) and cd.longest_prefix(ns, after), "the lost batch replayed")
        assert (stream.resyncs["replay"], stream.resyncs["snapshot"], stream.resyncs["dropped"]) == (1, 1, 0)
        (caught_up,) = cd.status()
        assert caught_up["held_batches"] == 0 and caught_up["lag_s"] < behind["lag_s"]
        held = sum(ns.blocks_by_tier["dram"] for ns in c.stats().namespaces)  # every block A holds, one tier each
        assert cd.size() == {"entries": held, "blocks": held, "approx_bytes": held * BYTES_PER_ENTRY,
                             "backend": "replica"}
    finally:
        LossyStream.lose = set()
        cd.stop()
        c.close()


def _metrics(proc) -> str:
    import urllib.request

    return urllib.request.urlopen(proc.metrics_url, timeout=5).read().decode()
