"""The core's index, leases and eviction, driven directly with an injected clock."""

import hashlib

import pytest

from kvstore.daemon.core import Core, CoreConfig, SessionEnd
from kvstore.daemon.seams import DramOnly
from kvstore.errors import Code, KVError
from kvstore.keys import Namespace, chain_keys
from kvstore.layout import KVLayout
from kvstore.tiers.arena import Arena
from kvstore.tiers.dram import DramTier
from kvstore.v1 import kvstore_pb2 as pb

LAYOUT = KVLayout(2, 1, 64, "fp16", block_tokens=16)  # 8 KiB blocks
EXTENT = 16 * 4096


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


class EvictionLog(DramOnly):
    """No lower tiers; records the keys of DRAM evictions for room, oldest first."""

    def __init__(self) -> None:
        self.evicted: list[bytes] = []

    def dram_freed(self, b, reason: str) -> None:
        if reason == "capacity":
            self.evicted.append(b.key)


@pytest.fixture
def env():
    clock = Clock()
    arena = Arena(4 * EXTENT, prefault=False)  # 4 extents x 8 slots of 8 KiB = 32 blocks
    core = Core(DramTier(arena, EXTENT), CoreConfig(lease_ttl_s=5.0, session_ttl_s=60.0, max_keys=1024),
                lower=EvictionLog(), clock=clock)
    s = core.register(Namespace("m", LAYOUT))
    yield core, s, clock
    arena.close()


def chain(seed: int, n: int) -> list[bytes]:
    root = hashlib.sha256(b"test-root").digest()
    return chain_keys(root, [seed] * 16 * n, 16)


def put(core, s, keys, parent=b""):
    lease, offsets, states = core.reserve(s, b"".join(keys), parent)
    if lease:
        core.commit(s, lease.id, b"")
    return offsets


def test_capacity_and_exact_leaves_first_lru_order(env):
    core, s, clock = env
    assert core.dram.max_slots(LAYOUT.block_bytes) == 32
    a = chain(1, 16)  # one chain of 16 blocks: a0 <- a1 <- ... <- a15
    b = chain(2, 16)
    put(core, s, a)
    clock.t += 1
    put(core, s, b)
    clock.t += 1
    # Touch chain a's first 4 blocks: they become the most recent, and their descendants
    # a4..a15 are leaves-first candidates only after their own children go.
    assert len(core.lookup(s, b"".join(a[:4]))[0]) == 4
    # Full: the next 3 blocks evict exactly the 3 least recently used leaves. Chain a was
    # committed first, leaf-first order: a15, a14, a13.
    c = chain(3, 3)
    put(core, s, c)
    assert core.lower.evicted == [a[15], a[14], a[13]]
    # Parents are never evicted before their cached children: a12 is now a leaf and goes next.
    put(core, s, chain(4, 1))
    assert core.lower.evicted[-1] == a[12]
    assert core.lookup(s, b"".join(a)) and len(core.lookup(s, b"".join(a))[0]) == 12


def test_lookup_each_answers_every_key_past_misses(env):
    core, s, _ = env
    a = chain(7, 6)
    put(core, s, [a[1]])          # sparse, as a state group's snapshots are: blocks 1 and 4,
    put(core, s, [a[4]])          # each a chain head of its own
    hits, tiers, found = core.lookup(s, b"".join(a), each=True)
    assert found == bytes([0, 1, 0, 0, 1, 0])
    assert [b.key for b in hits] == [a[1], a[4]] and len(tiers) == 2
    hits, tiers, found = core.lookup(s, b"".join(a))  # a prefix: the first miss ends it
    assert hits == [] and found == b""


def test_pinned_block_is_never_evicted_and_back_pressure_is_clear(env):
    core, s, clock = env
    keys = chain(5, 32)
    put(core, s, keys)
    lease, blocks = core.acquire(s, b"".join(keys), allow_partial=False)
    assert len(blocks) == 32
    with pytest.raises(KVError) as e:
        core.reserve(s, b"".join(chain(6, 1)), b"")
    assert e.value.code is Code.RESOURCE_EXHAUSTED and "pinned" in e.value.message
    core.release(s, lease.id)
    put(core, s, chain(6, 1))
    assert core.lower.evicted == [keys[31]]


def test_reservation_larger_than_tier(env):
    core, s, _ = env
    with pytest.raises(KVError) as e:
        core.reserve(s, b"".join(chain(7, 33)), b"")
    assert e.value.code is Code.RESOURCE_EXHAUSTED and "at most 32" in e.value.message
    assert core.dram.alloc.used_bytes == 0


def test_leases_expire_on_the_injected_clock(env):
    core, s, clock = env
    keys = chain(8, 4)
    wl, _, _ = core.reserve(s, b"".join(keys[:2]), b"")
    put(core, s, keys[2:], parent=keys[1])
    rl, _ = core.acquire(s, b"".join(keys[2:]), allow_partial=False)
    used = core.dram.alloc.used_bytes
    clock.t += 4.9
    assert core.expire() == 0
    clock.t += 0.2
    assert core.expire() == 2
    assert core.dram.alloc.used_bytes == used - 2 * 8192  # reservation freed, committed blocks kept
    assert all(b.ref_cnt == 0 for b in core.lookup(s, b"".join(keys[2:]))[0])
    with pytest.raises(KVError) as e:
        core.commit(s, wl.id, b"")
    assert e.value.code is Code.NOT_FOUND


def test_second_writer_of_a_key_gets_busy_and_cannot_commit_it(env):
    core, _, _ = env
    s1 = core.register(Namespace("m", LAYOUT))
    s2 = core.register(Namespace("m", LAYOUT))
    k = chain(9, 1)
    l1, _, st1 = core.reserve(s1, k[0], b"")
    l2, _, st2 = core.reserve(s2, k[0], b"")
    assert st1 == b"\x00" and st2 == b"\x02" and l2 is None
    assert core.lookup(s2, k[0])[0] == []  # reserved, not committed: a miss, not an error
    with pytest.raises(KVError) as e:
        core.acquire(s2, k[0], allow_partial=False)
    assert e.value.code is Code.FAILED_PRECONDITION and "not committed" in e.value.message
    assert len(core.commit(s1, l1.id, b"")) == 1
    assert core.reserve(s2, k[0], b"")[2] == b"\x01"


def test_namespaces_are_isolated(env):
    core, s, _ = env
    other = core.register(Namespace("m", LAYOUT, tenant_salt="tenant-b"))
    keys = chain(10, 2)
    put(core, s, keys)
    assert core.lookup(other, b"".join(keys))[0] == []
    with pytest.raises(KVError) as e:
        core.acquire(other, b"".join(keys), allow_partial=False)
    assert e.value.code is Code.NOT_FOUND
    assert core.delete(other, b"".join(keys)) == (0, 0)
    assert len(core.lookup(s, b"".join(keys))[0]) == 2


def test_namespace_quota_evicts_its_own_blocks_first(env):
    core, s, clock = env
    other = core.register(Namespace("other-model", LAYOUT))
    b_keys = chain(20, 8)
    put(core, other, b_keys)
    core.cfg.ns_quota_bytes = 8 * LAYOUT.block_bytes  # 8 blocks of 8 KiB
    a_keys = chain(21, 12)
    for k in range(12):  # one block at a time, as a chain
        put(core, s, [a_keys[k]], parent=a_keys[k - 1] if k else b"")
    assert core.dram.ns_bytes[s.ns.id] == 8 * 8192
    assert len(core.lookup(other, b"".join(b_keys))[0]) == 8  # the other namespace kept everything
    # Leaves first: when a8 arrives the only leaf of the chain is its tip a7; a8 then commits as
    # a root, and each later arrival finds the older leaf a6 (then a5, a4) less recent than a8+.
    assert [a_keys.index(k) for k in core.lower.evicted] == [7, 6, 5, 4]
    lease, _ = core.acquire(s, b"".join(a_keys[:4] + a_keys[8:]), allow_partial=False)
    with pytest.raises(KVError) as e:
        core.reserve(s, b"".join(chain(22, 1)), b"")
    assert e.value.code is Code.RESOURCE_EXHAUSTED and "namespace quota" in e.value.message
    assert len(core.reserve(other, b"".join(chain(23, 1)), b"")[1]) == 1  # others are unaffected


def _forest(rng, n):
    """``n`` DRAM blocks in random trees with random ticks, all in one Lru."""
    from kvstore.daemon.index import Block, BlockState, Lru
    from kvstore.tier_kind import TierKind

    blocks, lru = [], Lru()
    for i in range(n):
        b = Block(bytes([i % 256, i // 256]), b"ns", TierKind.DRAM, i, state=BlockState.COMMITTED,
                  tick=int(rng.integers(0, 10 * n)))
        if blocks and rng.random() < 0.8:  # mostly chains: a child of a recent block
            b.parent = blocks[int(rng.integers(max(0, i - 3), i))]
            b.parent.kids.add(b)
        b.busy = rng.random() < 0.05
        blocks.append(b)
        lru.add(b)
    return blocks, lru


def _drop(b):
    b.tier = None  # leaves DRAM: no longer a cached child of its parent
    if b.parent is not None:
        b.parent.kids.discard(b)


@pytest.mark.parametrize("seed", range(5))
def test_victim_stream_is_exact_leaves_first_lru_order(seed):
    """Lru.victims yields what repeated brute-force "least recent leaf" picks would, while the
    caller drops each victim; blocks it refused go back to the heap when it closes."""
    import numpy as np

    from kvstore.tier_kind import TierKind

    rng = np.random.default_rng(seed)
    blocks, lru = _forest(rng, 400)
    calls = 0

    def ok(b):
        nonlocal calls
        calls += 1
        return not b.busy and not b.has_kids_in(TierKind.DRAM)

    want_n = 150
    stream = lru.victims(ok)
    got = []
    for _ in range(want_n):
        expect = min((b for b in blocks if b.tier is TierKind.DRAM and b in lru and not b.busy
                      and not b.has_kids_in(TierKind.DRAM)), key=lambda b: b.tick, default=None)
        v = next(stream, None)
        assert v is expect or (v is not None and expect is not None and v.tick == expect.tick)
        if v is None:
            break
        got.append(v)
        _drop(v)
    stream.close()
    assert len(got) == want_n
    # One pass: each block is looked at about once, not once per eviction (400 x 150 = 60000).
    assert calls < 3 * len(blocks)
    # The refused blocks are back: the next plain pop finds the next leaf.
    rest = [b for b in blocks if b.tier is TierKind.DRAM]
    assert len(lru) == len(rest)
    expect = min((b for b in rest if not b.busy and not b.has_kids_in(TierKind.DRAM)), key=lambda b: b.tick)
    assert lru.pop_victim(lambda b: not b.busy and not b.has_kids_in(TierKind.DRAM)).tick == expect.tick


def test_victim_stream_skips_blocks_discarded_meanwhile():
    import numpy as np

    from kvstore.tier_kind import TierKind

    blocks, lru = _forest(np.random.default_rng(7), 50)
    for b in blocks:
        b.busy = False
    ok = lambda b: not b.has_kids_in(TierKind.DRAM)  # noqa: E731
    stream = lru.victims(ok)
    first = next(stream)
    _drop(first)
    gone = [b for b in blocks if b in lru][:10]
    for b in gone:
        lru.discard(b)
    seen = [v for v in stream]
    assert not set(map(id, seen)) & set(map(id, gone))
    assert len(lru) == 0 or all(not ok(b) for b in blocks if b in lru)


def test_reserve_evicts_a_long_chain_tail_first_in_one_pass(env):
    """Making room at the end of one long chain (only its tail is a leaf) evicts the tail
    backwards, exactly as leaves-first LRU says, in one pass over the LRU."""
    core, s, clock = env
    a = chain(5, 32)  # fills the tier: 32 slots
    put(core, s, a[:16])
    put(core, s, a[16:], parent=a[15])
    clock.t += 1
    b = chain(6, 8)
    put(core, s, b)
    assert core.lower.evicted == a[31:23:-1]
    assert core.residency._passes is None  # the pass closed with the reservation
    assert len(core.lookup(s, b"".join(a))[0]) == 24


def test_pieces_of_one_lease_commit_in_any_order_and_keep_the_chain(env):
    """put() commits a reservation in pieces that may reach the daemon out of order: the
    chain links are the same as for one Commit, so eviction stays leaves-first."""
    core, s, clock = env
    a = chain(7, 12)
    lease, offsets, _ = core.reserve(s, b"".join(a), b"")
    core.commit(s, lease.id, b"".join(a[8:]))  # the last piece first
    core.commit(s, lease.id, b"".join(a[:4]))
    assert lease.id in core.leases  # a[4:8] still reserved
    core.commit(s, lease.id, b"".join(a[4:8]))
    assert lease.id not in core.leases  # the last piece ends the lease
    blocks = [s.ns.blocks[k] for k in a]
    for parent, kid in zip(blocks, blocks[1:]):
        assert kid.parent is parent and kid in parent.kids
    assert not lease.orphans
    # Only the tail is a leaf: filling the tier evicts a11, a10, ... in that order.
    clock.t += 1
    put(core, s, chain(8, 24))
    assert core.lower.evicted[:4] == [a[11], a[10], a[9], a[8]]


def test_slots_freed_tail_first_are_handed_out_in_ascending_order(env):
    core, s, clock = env
    a = chain(9, 32)
    put(core, s, a)  # the tier is full
    offsets = put(core, s, chain(10, 8))  # evicts a31..a24, which free their slots highest first
    stride = core.dram.slot_stride(LAYOUT.block_bytes)
    assert offsets == sorted(offsets)
    assert [b - a for a, b in zip(offsets, offsets[1:])] == [stride] * 7


def test_core_victims_merges_namespaces_by_recency(env):
    core, s, clock = env
    from kvstore.tier_kind import TierKind

    s2 = core.register(Namespace("m2", LAYOUT))
    order = []
    for i in range(6):  # alternate single-block chains between the two namespaces
        sess = s if i % 2 == 0 else s2
        k = chain(20 + i, 1)
        put(core, sess, k)
        order.append(k[0])
        clock.t += 1
    ok = lambda b: not b.busy and not b.has_kids_in(TierKind.DRAM)  # noqa: E731
    g = core.lrus.victims(TierKind.DRAM, ok)
    got = [next(g).key for _ in range(3)]
    g.close()
    assert got == order[:3]
    # The ones not taken, and the heads fetched but not taken, are back on their LRUs.
    assert len(core.lru(TierKind.DRAM, s.ns.id)) + len(core.lru(TierKind.DRAM, s2.ns.id)) == 3


def test_sessions_not_heard_from_for_the_ttl_end_oldest_first_with_their_leases(env):
    core, s, clock = env                               # session TTL 60 s
    a, b = core.register(Namespace("m", LAYOUT)), core.register(Namespace("m", LAYOUT))
    keys = chain(7, 2)
    put(core, b, keys[:1])
    core.acquire(b, keys[0], False)                    # b pins keys[0]
    core.reserve(b, keys[1], keys[0])                  # and reserves keys[1], never committed
    used = core.dram.stats().used_bytes
    clock.t += 40
    core.session(a.id)                                 # a call from a renews it
    clock.t += 21                                      # s and b: 61 s without a call
    assert core.expire_sessions(1) == 1 and list(core.sessions) == [b.id, a.id]  # s first: the oldest
    assert core.expire_sessions(5) == 1 and list(core.sessions) == [a.id]        # then b; a is live
    ns = core.namespaces[s.ns.id]
    assert ns.sessions == 1 and not core.leases and b.closed
    assert keys[1] not in ns.blocks and core.dram.stats().used_bytes == used - core.dram.slot_stride(LAYOUT.block_bytes)
    assert ns.blocks[keys[0]].ref_cnt == 0 and core.delete(a, keys[0]) == (1, 0)  # unpinned
    with pytest.raises(KVError) as e:
        core.session(b.id)
    assert e.value.code is Code.NOT_FOUND and e.value.refusal == pb.REFUSAL_SESSION_UNKNOWN
    assert "expired" in e.value.message and "server.session_ttl_s" in e.value.message
    with pytest.raises(KVError) as e:                  # a handler still holding b gets no lease
        core.reserve(b, keys[1], b"")
    assert e.value.code is Code.NOT_FOUND
    core.close_session(a, SessionEnd.CLOSED)
    with pytest.raises(KVError, match="closed by its client"):
        core.session(a.id)
    assert not core.sessions and ns.sessions == 0


def test_dram_only_chains_lists_heads_first_most_recent_first_and_skips_unreachable(env):
    """The shutdown write-out order: every parent before its children, otherwise most recent
    first; a block whose chain parent is gone is left out (no prefix read reaches it)."""
    core, s, _ = env
    a, b, c = chain(1, 4), chain(2, 4), chain(3, 3)
    put(core, s, a)
    put(core, s, b)
    put(core, s, c)
    core.lookup(s, b"".join(a[:2]))  # a's head is now the most recent
    assert core.delete(s, c[0]) == (1, 0)  # c's tail loses its head
    order = [blk.key for blk in core.dram_only_chains()]
    assert set(order) == set(a) | set(b)
    for keys in (a, b):
        assert [order.index(k) for k in keys] == sorted(order.index(k) for k in keys)
    assert order[:2] == a[:2]


def test_a_block_read_while_it_is_written_keeps_its_slot_and_stays_pinned_through_its_commit(env):
    """A reader of slots still being written (a pipelined send, AwaitTransfer): letting go before
    the Commit leaves the slots to the write lease (once, the last unpin freed them), and a block
    still read when it is committed is not evictable until the reader lets go (once, Commit
    filed it on the DRAM LRU under the pin)."""
    core, s, clock = env
    a = chain(40, 4)
    lease, offsets, _ = core.reserve(s, b"".join(a), b"")
    blocks = [s.ns.blocks[k] for k in a]
    used = core.dram.used_bytes
    core.release(s, core.pin(s, blocks).id)              # let go before the Commit
    assert core.dram.used_bytes == used and [b.offset for b in blocks] == offsets
    core.commit(s, lease.id, b"")
    assert core.lookup(s, b"".join(a))[0] == blocks
    b = chain(41, 4)
    lease, _, _ = core.reserve(s, b"".join(b), b"")
    held = core.pin(s, [s.ns.blocks[k] for k in b])     # read through its Commit
    core.commit(s, lease.id, b"")
    clock.t += 1
    for seed in range(42, 50):                           # 32 more blocks: everything unpinned goes
        put(core, s, chain(seed, 4))
    assert all(s.ns.blocks.get(k) is not None for k in b)
    core.release(s, held.id)
    put(core, s, chain(50, 4))                           # now b is evictable, least recent first
    assert all(s.ns.blocks.get(k) is None for k in b)


# --- blocks written in parts (TP ranks each writing their KV heads of one block) ---------------

def _ranks(core, n: int):
    return [core.register(Namespace("m", LAYOUT)) for _ in range(n)]


def _used(core) -> int:
    return core.dram.stats().used_bytes // core.dram.slot_stride(LAYOUT.block_bytes)


def test_a_block_whose_missing_part_never_comes_is_dropped_at_its_deadline(env):
    core, s, clock = env
    r0, _ = _ranks(core, 2)
    keys = chain(41, 1)
    lease, _, _ = core.reserve(r0, b"".join(keys), b"", part=0, parts=2)
    assert core.commit(r0, lease.id, b"") == []      # rank 1 never reserves: nothing is published
    assert _used(core) == 1 and core.reserve(s, b"".join(keys), b"")[2] == bytes([pb.SLOT_BUSY])
    clock.t += 4.0
    core.expire()
    assert _used(core) == 1                          # not before its deadline (the lease TTL)
    clock.t += 2.0
    core.expire()
    assert _used(core) == 0 and not core.lookup(s, b"".join(keys))[0]
    assert core.reserve(s, b"".join(keys), b"")[2] == bytes([pb.SLOT_RESERVED])  # written afresh


def test_a_commit_naming_a_key_twice_is_refused_and_frees_nothing(env):
    core, s, _ = env
    r0, r1 = _ranks(core, 2)
    key = chain(42, 1)[0]
    l0, _, _ = core.reserve(r0, key, b"", part=0, parts=2)
    l1, _, _ = core.reserve(r1, key, b"", part=1, parts=2)
    core.abort(r1, l1.id)                            # the block fails; rank 0 still writes into it
    with pytest.raises(KVError) as e:
        core.commit(r0, l0.id, key + key)
    assert e.value.code is Code.INVALID_ARGUMENT and _used(core) == 1
    core.commit(r0, l0.id, key)
    assert _used(core) == 0                          # freed once, by the last writer


def test_parent_links_hold_when_parts_commit_child_first(env):
    core, s, _ = env
    r0, r1 = _ranks(core, 2)
    a, b = chain(43, 2)
    l0, _, _ = core.reserve(r0, a + b, b"", part=0, parts=2)
    l1, _, _ = core.reserve(r1, a + b, b"", part=1, parts=2)
    for r, l, k in ((r0, l0, b), (r1, l1, b), (r0, l0, a), (r1, l1, a)):
        core.commit(r, l.id, k)
    blocks = s.ns.blocks
    assert blocks[b].parent is blocks[a] and blocks[b] in blocks[a].kids  # leaves-first eviction holds


def test_an_arena_closed_under_a_view_in_a_cycle_is_unmapped_by_unmap():
    """Arena.unmap (the vLLM worker's, for a lost daemon's arena): close() leaves the mapping to
    a live view; once the only view left sits in a reference cycle, unmap collects it and unmaps."""
    a = Arena(1 << 20, prefault=False)
    cycle = {"view": a.buf[:4096]}
    cycle["self"] = cycle
    a.close()
    assert not a.mmap.closed  # the view keeps it mapped
    a.unmap()
    assert not a.mmap.closed  # still referenced from here: nothing to collect
    del cycle
    a.unmap()
    assert a.mmap.closed
