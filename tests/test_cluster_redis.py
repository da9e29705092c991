"""The prefix directory on a real Redis cluster (Debian's redis-server 7.0, three masters on
loopback with an ACL password, started here): writers of their own blocks, readers of a chain
at the epochs membership has, the sweeps of a registration that ended, and a store that is down
or hung costing a reader no more than its deadline. In process: membership and the core's state
are small stand-ins of their interfaces; the daemons over the store are in test_cluster_redis_fleet.py."""

from __future__ import annotations

import queue
import time
from dataclasses import dataclass, field

import pytest

pytest.importorskip("redis")

from kvstore.app.bench.redis_cluster import LocalRedisCluster, server_binaries  # noqa: E402
from kvstore.cluster.member import Change, Member, MemberEvent  # noqa: E402
from kvstore.cluster.redis_directory import RedisDirectory  # noqa: E402
from kvstore.config import ClusterConfig  # noqa: E402
from kvstore.kv_events import MEDIUM  # noqa: E402
from kvstore.tier_kind import TierKind  # noqa: E402
from tests.wait_util import wait_for  # noqa: E402

if server_binaries() is None:
    pytest.skip("redis-server is not installed (make sysdeps installs Debian's redis-server)", allow_module_level=True)


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    s = LocalRedisCluster(tmp_path_factory.mktemp("redis")).start()
    yield s
    s.stop()


@dataclass
class Fleet:
    """Membership's view shared by the test's nodes: node id -> epoch."""

    epochs: dict[str, int] = field(default_factory=dict)
    queues: list = field(default_factory=list)

    def change(self, node: str, epoch: int | None) -> None:
        old = self.epochs.get(node)
        if epoch is None:
            del self.epochs[node]
            ev = MemberEvent(Change.LEAVE, Member(node, old))
        else:
            self.epochs[node] = epoch
            ev = MemberEvent(Change.EPOCH if old else Change.JOIN, Member(node, epoch))
        for q in self.queues:
            q.put(ev)


class View:
    """One node's :class:`kvstore.cluster.membership.Membership`, as the directory uses it."""

    def __init__(self, fleet: Fleet, node_id: str) -> None:
        self.fleet, self.node_id = fleet, node_id

    @property
    def epoch(self) -> int:
        return self.fleet.epochs.get(self.node_id, 0)

    def peers(self):
        return [Member(n, e) for n, e in self.fleet.epochs.items() if n != self.node_id]

    def member(self, node_id):
        e = self.fleet.epochs.get(node_id)
        return None if e is None else Member(node_id, e)

    def subscribe(self):
        q = queue.SimpleQueue()
        self.fleet.queues.append(q)
        return q


@dataclass
class Blk:
    key: bytes
    parent_key: bytes | None


class Held:
    """The core's state (:class:`kvstore.daemon.events.CoreState`): blocks held at start."""

    def __init__(self, blocks=()) -> None:
        self.items = list(blocks)

    def capture(self, cut):
        return [(MEDIUM[t], b.key, b.parent_key, [], 16, "") for b, t in self.items], cut()


def chain(tag: int, n: int, parent: bytes | None = None) -> list[Blk]:
    out = []
    for i in range(n):
        k = bytes([tag, i]) * 16
        out.append(Blk(k, parent))
        parent = k
    return out


def directory(store, fleet, node, epoch, held=(), prefix="t", **cfg) -> RedisDirectory:
    cfg = {"redis_timeout_s": 1.0, "redis_retry_s": 0.5, **cfg}
    c = ClusterConfig(etcd_endpoints="x:1", directory="redis", redis_nodes=store.nodes, redis_key_prefix=prefix, **cfg)
    d = RedisDirectory(c, password=store.password)
    fleet.change(node, epoch)
    d.start(View(fleet, node), Held(held))
    return d


def keys(blocks):
    return [b.key for b in blocks]


def test_a_peer_reads_the_writers_chain_with_its_tier_steps_and_never_its_own(store):
    fleet = Fleet()
    ca = chain(1, 6)
    a = directory(store, fleet, "a", 1, held=[(b, TierKind.DRAM) for b in ca[:4]])  # 4 held at start
    b = directory(store, fleet, "b", 3)
    try:
        for blk in ca[4:]:
            a.stored(blk, None, TierKind.NVME)  # 2 more, NVMe only
        hits = wait_for(lambda: (h := b.longest_prefix("ns", keys(ca))) and h[0].n_blocks == 6 and h,
                        what="b reads a's chain")
        assert [(h.node_id, h.epoch, h.tier, h.n_blocks) for h in hits] == [("a", 1, TierKind.NVME, 6),
                                                                             ("a", 1, TierKind.DRAM, 4)]
        # the keys after 2 local hits (the head names the stretch's tag)
        assert b.longest_prefix("ns", keys(ca)[2:], head=keys(ca)[:2])[0].n_blocks == 4
        assert a.longest_prefix("ns", keys(ca)) == []  # its own blocks are local hits, not remote
        # b holds the first 3 too: both are offered, the longest first
        for blk in ca[:3]:
            b.stored(blk, None, TierKind.HBM)
        wait_for(lambda: len({h.node_id for h in a.longest_prefix("ns", keys(ca))}) == 1, what="a reads b")
        assert [(h.node_id, h.n_blocks) for h in a.longest_prefix("ns", keys(ca))] == [("b", 3)]
        # a block leaves DRAM but stays on NVMe; then block 3 leaves both: a's prefix ends at 3
        a.removed(ca[0], TierKind.DRAM)
        a.stored(ca[0], None, TierKind.NVME)
        a.removed(ca[3], TierKind.DRAM)
        wait_for(lambda: b.longest_prefix("ns", keys(ca))[0].n_blocks == 3, what="a's removal reaches the store")
        assert [(h.tier, h.n_blocks) for h in b.longest_prefix("ns", keys(ca))] == [(TierKind.NVME, 3)]
        # a block whose parent is not held here is never written: no prefix of a's reaches it
        orphan = chain(9, 2, parent=b"\xee" * 32)
        a.stored(orphan[0], None, TierKind.DRAM)
        a.stored(orphan[1], None, TierKind.DRAM)
        time.sleep(0.3)
        assert a.size()["entries"] == 6 - 1
    finally:
        a.stop()
        b.stop()


def test_a_long_chain_is_read_stretch_by_stretch_from_several_shards(store):
    fleet = Fleet()
    long = chain(7, 150)  # stretches of 64: blocks 0-63, 64-127, 128-149
    a = directory(store, fleet, "a", 1, held=[(b, TierKind.DRAM) for b in long[:100]])
    c = directory(store, fleet, "c", 1, held=[(b, TierKind.NVME) for b in long[:64]])
    b = directory(store, fleet, "b", 1)
    try:
        for blk in long[100:]:
            a.stored(blk, None, TierKind.NVME)
        want = [("a", TierKind.NVME, 150), ("a", TierKind.DRAM, 100), ("c", TierKind.NVME, 64)]
        wait_for(lambda: [(h.node_id, h.tier, h.n_blocks) for h in b.longest_prefix("ns", keys(long))] == want,
                 what="a's whole chain and c's first stretch")
        # after 70 local hits: the rest, read from the second stretch on (its tag is block 64, in the head)
        rest = b.longest_prefix("ns", keys(long)[70:], head=keys(long)[:70])
        assert [(h.node_id, h.n_blocks) for h in rest] == [("a", 80), ("a", 30)]
        # the three stretches are three hash tags, so not one shard for the whole chain
        w = b._writer_client()
        slots = {w.keyslot(b.entry_name(long[s].key, long[s].key)) for s in (0, 64, 128)}
        assert len(slots) == 3
        assert w.hget(b.entry_name(long[64].key, long[100].key), "a") == b"1:%d" % (1 << TierKind.NVME)
    finally:
        for d in (a, b, c):
            d.stop()


def test_entries_that_are_not_a_writers_are_no_entries(store):
    fleet = Fleet()
    c1 = chain(6, 3)
    a = directory(store, fleet, "a", 1, held=[(b, TierKind.DRAM) for b in c1])
    b = directory(store, fleet, "b", 1)
    fleet.change("x", 1)
    try:
        wait_for(lambda: b.longest_prefix("ns", keys(c1)), what="a's entries")
        w = b._writer_client()
        first = b.entry_name(c1[0].key, c1[0].key)
        for field, value in ((b"x", b"1:999"), (b"x", b"1:-1"), (b"x", b"garbage"), (b"\xff\xfe", b"1:4"),
                             (b"x", b"1:0"), (b"x", b"")):
            w.hset(first, field, value)
            assert [(h.node_id, h.n_blocks) for h in b.longest_prefix("ns", keys(c1))] == [("a", 3)], value
            w.hdel(first, field)
    finally:
        a.stop()
        b.stop()


def test_a_new_epoch_is_never_advised_from_the_old_ones_entries_and_they_are_swept(store):
    fleet = Fleet()
    c1 = chain(2, 5)
    a = directory(store, fleet, "a", 1, held=[(b, TierKind.DRAM) for b in c1])
    b = directory(store, fleet, "b", 1)
    try:
        wait_for(lambda: b.longest_prefix("ns", keys(c1)), what="a's entries")
        a.stop()  # a dies; it comes back at epoch 2 holding only the first 2 blocks (say, from NVMe)
        fleet.change("a", 2)
        # at once: membership says epoch 2 and the store still has epoch 1's entries: none advised
        assert b.longest_prefix("ns", keys(c1)) == []
        a2 = directory(store, fleet, "a", 2, held=[(blk, TierKind.NVME) for blk in c1[:2]])
        try:
            hits = wait_for(lambda: b.longest_prefix("ns", keys(c1)), what="a's epoch 2 entries")
            assert [(h.epoch, h.n_blocks, h.tier) for h in hits] == [(2, 2, TierKind.NVME)]
            # the old epoch's set and its 3 entries beyond are gone from the store
            name = a2.entry_name(c1[0].key, c1[4].key)
            wait_for(lambda: not a2._writer_client().exists(name), what="epoch 1's entries swept")
            assert not a2._writer_client().exists(a2._owned("a", 1))
        finally:
            a2.stop()
    finally:
        b.stop()


def test_a_node_that_leaves_is_swept_by_one_peer(store):
    fleet = Fleet()
    c1 = chain(3, 4)
    a = directory(store, fleet, "a", 5, held=[(b, TierKind.DRAM) for b in c1], prefix="leave")
    b = directory(store, fleet, "b", 1, prefix="leave")
    c = directory(store, fleet, "c", 1, prefix="leave")
    try:
        wait_for(lambda: b.longest_prefix("ns", keys(c1)), what="a's entries")
        a.stop()
        fleet.change("a", None)  # its lease ran out
        assert b.longest_prefix("ns", keys(c1)) == []
        w = b._writer_client()
        # the sweep deletes the entries, then a's set of them, then the epoch from a's list: wait
        # for the last step, so that the checks below do not race the sweeper's final two calls
        wait_for(lambda: not w.smembers(b._epochs("a")), what="a's sweep finished")
        assert not list(w.scan_iter(match=b"leave{*", count=1000))  # no entry of anyone's left
        assert not w.exists(b._owned("a", 5))
        assert len(list(w.scan_iter(match=b"leave:l{a}*", count=1000))) == 1  # one sweeper took the lock
    finally:
        b.stop()
        c.stop()


def test_a_hung_store_costs_a_reader_its_deadline_once_then_nothing_until_retry(store):
    fleet = Fleet()
    c1 = chain(4, 8)
    a = directory(store, fleet, "a", 1, held=[(b, TierKind.DRAM) for b in c1])
    b = directory(store, fleet, "b", 1, redis_timeout_s=0.2, redis_retry_s=1.0)
    try:
        wait_for(lambda: b.longest_prefix("ns", keys(c1)), what="a's entries")
        shard = int(b._reader.keyslot(b.entry_name(c1[0].key, c1[0].key)))
        port = next(p for p in store.ports if any(lo <= shard <= hi for lo, hi in _slots(store, p)))
        store.pause_node(port)  # the chain's shard hangs
        try:
            t = time.monotonic()
            assert b.longest_prefix("ns", keys(c1)) == []
            first = time.monotonic() - t
            t = time.monotonic()
            assert b.longest_prefix("ns", keys(c1)) == []
            second = time.monotonic() - t
            assert first < 0.2 + 1.5 and second < first / 4  # one deadline (plus a loaded host's slack), then skipped
        finally:
            store.resume_node(port)
        hits = wait_for(lambda: b.longest_prefix("ns", keys(c1)), what="reads again after retry_s")
        assert hits[0].n_blocks == 8
    finally:
        a.stop()
        b.stop()


def test_a_writer_whose_store_went_away_writes_everything_again_once_it_is_back(store, tmp_path):
    fleet = Fleet()
    one = LocalRedisCluster(tmp_path / "r", masters=3).start()
    c1 = chain(5, 3)
    a = directory(one, fleet, "a", 1, held=[(b, TierKind.DRAM) for b in c1[:1]])
    b = directory(one, fleet, "b", 1)
    try:
        wait_for(lambda: b.longest_prefix("ns", keys(c1)), what="a's first block")
        for p in one.ports:
            one.stop_node(p)
        a.stored(c1[1], None, TierKind.DRAM)  # written while the store is down: refused
        a.stored(c1[2], None, TierKind.DRAM)
        time.sleep(0.5)
        for p in one.ports:  # back, empty (no persistence): every entry must be written again
            one.start_node(p)
        one.wait_ok()
        hits = wait_for(lambda: (h := b.longest_prefix("ns", keys(c1))) and h[0].n_blocks == 3 and h,
                        what="a's blocks written again", timeout_s=30)
        assert hits[0].node_id == "a"
        assert a.errors >= 1
    finally:
        a.stop()
        b.stop()
        one.stop()


def _slots(store, port):
    """The slot ranges the server on ``port`` serves (from its CLUSTER NODES line)."""
    out = []
    for line in store.cli(port, "CLUSTER", "NODES").splitlines():
        parts = line.split()
        if "myself" in parts[2]:
            for r in parts[8:]:
                lo, _, hi = r.partition("-")
                out.append((int(lo), int(hi or lo)))
    return out


def test_the_writer_state_holds_through_failures_lost_events_orphans_and_loops(store):
    """The own map against the store: a deletion whose write failed is written again; blocks
    gone while events were lost are deleted; a block committed before its parent is written
    once the parent is; a parents loop (a client's doing) is no entry, and no hang."""
    fleet = Fleet()
    c1 = chain(8, 4)
    fails = {"n": 0}

    class Flaky(RedisDirectory):
        def _flush(self, pipe, *args):
            if fails["n"]:
                fails["n"] -= 1
                raise ConnectionError("the store went away mid-write")
            return super()._flush(pipe, *args)

    cfg = ClusterConfig(etcd_endpoints="x:1", directory="redis", redis_nodes=store.nodes, redis_timeout_s=1.0,
                        redis_retry_s=0.2, redis_key_prefix="own")
    loop_a, loop_b = Blk(b"\xa1" * 32, b"\xb1" * 32), Blk(b"\xb1" * 32, b"\xa1" * 32)
    held = Held([(b, TierKind.DRAM) for b in c1[:2]] + [(loop_a, TierKind.DRAM), (loop_b, TierKind.DRAM)])
    a = Flaky(cfg, password=store.password)
    fleet.change("a", 1)
    a.start(View(fleet, "a"), held)  # the loop neither hangs this nor gets an entry
    b = directory(store, fleet, "b", 1, prefix="own")
    w = b._writer_client()
    try:
        wait_for(lambda: [h.n_blocks for h in b.longest_prefix("ns", keys(c1))] == [2], what="a's first two")
        assert a.own[loop_a.key][0] is None and a.own[loop_b.key][0] is None
        # a removal whose write fails: the entry goes once the store takes writes again
        fails["n"] = 1
        a.removed(c1[1], TierKind.DRAM)
        wait_for(lambda: w.hget(a.entry_name(c1[0].key, c1[1].key), "a") is None, what="the removal written again")
        # block 3 committed before block 2: written once 2 is
        a.stored(c1[3], None, TierKind.DRAM)
        time.sleep(0.2)
        assert w.hget(a.entry_name(c1[0].key, c1[3].key), "a") is None
        a.stored(c1[1], None, TierKind.DRAM)
        a.stored(c1[2], None, TierKind.DRAM)
        wait_for(lambda: [h.n_blocks for h in b.longest_prefix("ns", keys(c1))] == [4], what="the orphan adopted")
        # events lost (the queue full): the state is taken again, and blocks gone meanwhile deleted
        held.items = [(blk, TierKind.DRAM) for blk in c1[:2]]
        a.max_pending = 0
        a.removed(c1[2], TierKind.DRAM)  # dropped
        wait_for(lambda: [h.n_blocks for h in b.longest_prefix("ns", keys(c1))] == [2], what="the lost removals")
        assert w.hget(a.entry_name(c1[0].key, c1[3].key), "a") is None
    finally:
        a.stop()
        b.stop()
