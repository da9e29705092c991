"""Tier movement between DRAM and NVMe, driven directly: the real Core, DramTier (a small arena)
and Tiering over an in-memory NVMe tier (tests/fake_tiers.py), with an injected clock. No daemon
process and no background thread: the test runs the demoter's rounds (``Tiering.run_round``) and
decides when NVMe reads complete (``FakeKeyedTier.complete``).

Geometry: 8 KiB blocks (one slot each), a DRAM tier of 32 slots. Demotion starts above the high
watermark (0.9: 29 blocks or more) and stops at the low one (0.75: 24 blocks). Blocks are put as
chains; a commit leaves a chain's tail least recent, so leaves-first LRU takes a chain tail first.
"""

from __future__ import annotations

import hashlib
import inspect
from dataclasses import dataclass

import numpy as np
import pytest

from fake_tiers import FakeKeyedTier
from tier_contract import TierContract
from kvstore.config import DramConfig, NvmeConfig
from kvstore.daemon.core import Core, CoreConfig
from kvstore.daemon.metrics import Metrics
from kvstore.daemon.tiering import NvmeCopies, Tiering
from kvstore.errors import Code, KVError
from kvstore.keys import Namespace, chain_keys
from kvstore.layout import KVLayout
from kvstore.policy import LoadPolicy
from kvstore.tiers.arena import Arena
from kvstore.tiers.base import KeyedTier, Tier, TierKind
from kvstore.tiers.dram import DramTier
from kvstore.tiers.nvme.files import chunk_sums
from kvstore.v1 import kvstore_pb2 as pb

DRAM, NVME = TierKind.DRAM, TierKind.NVME
LAYOUT = KVLayout(2, 1, 64, "fp16", block_tokens=16)  # 8 KiB blocks
BLOCK = LAYOUT.block_bytes
EXTENT = 8 * BLOCK
DRAM_BLOCKS = 32


# --- the fake tier keeps the protocol ---------------------------------------------------------
class TestFakeKeyedTierContract(TierContract):
    def make_tier(self, tmp_path, capacity_bytes):
        return FakeKeyedTier(str(tmp_path), capacity_bytes, 4 * self.SLOT)


def test_fake_tier_has_the_keyed_tier_protocol_and_its_signatures(tmp_path):
    t = FakeKeyedTier(str(tmp_path), EXTENT, EXTENT)
    assert isinstance(t, KeyedTier) and isinstance(t, Tier) and t.kind is NVME
    for name in ("stats", "put_many", "get_many", "delete", "entries", "set_atimes", "close"):
        assert inspect.signature(getattr(FakeKeyedTier, name)).parameters.keys() == \
            inspect.signature(getattr(KeyedTier, name)).parameters.keys(), name


# --- the daemon's parts over the fake tier ----------------------------------------------------
class Clock:
    """Monotonic seconds, moved by the test; ``step`` is added at every reading (a clock that
    runs on by itself, for waits bounded by it)."""

    def __init__(self) -> None:
        self.t, self.step = 1000.0, 0.0

    def __call__(self) -> float:
        self.t += self.step
        return self.t


def content(key: bytes) -> np.ndarray:
    return np.frombuffer(hashlib.shake_128(key).digest(BLOCK), np.uint8)


def chain(seed: int, n: int) -> list[bytes]:
    return chain_keys(hashlib.sha256(b"tiering-root").digest(), [seed] * 16 * n, 16)


def join(keys) -> bytes:
    return b"".join(keys)


@dataclass
class Env:
    core: Core
    tiering: Tiering
    nvme: FakeKeyedTier
    clock: Clock
    metrics: Metrics
    recovered: int
    s: object = None  # the session of model "m"

    def session(self, model: str = "m"):
        s = self.core.register(Namespace(model, LAYOUT))
        self.tiering.remember(s.ns)
        return s

    def put(self, keys: list[bytes], s=None, parent: bytes = b""):
        """Reserve, fill and commit ``keys`` as one chain, then tell tier movement (as the
        Commit RPC does)."""
        s = s or self.s
        with self.core.lock:
            lease, offsets, _ = self.core.reserve(s, join(keys), parent)
            for k, off in zip(keys, offsets):
                self.core.dram.view(off, BLOCK)[:] = content(k)
            blocks = self.core.commit(s, lease.id, b"")
        self.tiering.committed(blocks)
        return blocks

    def block(self, key: bytes, s=None):
        return (s or self.s).ns.blocks.get(key)

    def nvme_keys(self) -> set[bytes]:
        return {e.key for e in self.nvme.entries()}

    def dram_blocks(self) -> int:
        return self.core.dram.used_bytes // BLOCK

    def count(self, name: str, **labels) -> float:
        return self.metrics.registry.get_sample_value(name, labels) or 0.0

    def status(self, pid: int, wait_s: float = 0.0):
        return self.tiering.prefetch_status(self.s, pid, wait_s)


@pytest.fixture
def make(tmp_path):
    arenas = []

    def make(nvme_blocks: int = 64, tier: FakeKeyedTier | None = None, **nvme) -> Env:
        clock = Clock()
        arena = Arena(DRAM_BLOCKS * BLOCK, prefault=False)
        arenas.append(arena)
        tier = tier or FakeKeyedTier(str(tmp_path), nvme_blocks * BLOCK, EXTENT)
        cfg = NvmeConfig(dir=tier.dir, **nvme)
        copies = NvmeCopies(tier, cfg)
        core = Core(DramTier(arena, EXTENT), CoreConfig(max_keys=1024), lower=copies, clock=clock)
        metrics = Metrics()
        tiering = Tiering(core.residency, copies, cfg, DramConfig(), metrics=metrics, policy=LoadPolicy(), clock=clock)
        env = Env(core, tiering, tier, clock, metrics, tiering.recover())  # recovery first, as at start
        env.s = env.session()
        return env

    yield make
    for a in arenas:
        a.close()


def fill(env: Env, n_chains: int = 7, tail: int = 1) -> list[list[bytes]]:
    """``n_chains`` chains of 4 blocks, then one of ``tail`` blocks (default: 29 blocks)."""
    chains = [chain(i, 4) for i in range(n_chains)] + ([chain(99, tail)] if tail else [])
    for c in chains:
        env.put(c)
    return chains


def demoted(env: Env) -> list[list[bytes]]:
    """29 blocks, demoted to 24: chain a and b[3] are on NVMe only."""
    chains = fill(env)
    assert env.tiering.run_round() == 1
    a, b = chains[:2]
    assert env.nvme_keys() == {*a, b[3]}
    return chains


# --- demotion ---------------------------------------------------------------------------------
def test_demotion_starts_above_the_high_watermark_stops_at_the_low_one_leaves_first(make):
    env = make()
    a, b, c, *_ = fill(env, tail=0)                      # 28 blocks: not above 0.9 x 32
    assert env.tiering.run_round() == 0 and env.nvme_keys() == set()
    env.put(chain(99, 1))                                # 29: above it
    assert env.tiering.run_round() == 1
    assert env.nvme_keys() == {*a, b[3]}                 # least recent leaves first: a3 a2 a1 a0, then b3
    assert env.dram_blocks() == 24 and not env.tiering.draining
    for k in a + [b[3]]:
        blk = env.block(k)
        assert (blk.tier, blk.on_nvme, blk.busy, blk.offset) == (NVME, True, False, -1)
    assert len(env.core.lru(NVME, env.s.ns.id)) == 5
    assert env.count("kvstore_demotions_total", src="dram", dst="nvme") == 5
    env.put(chain(100, 4))                               # 28: between the watermarks, not draining
    assert env.tiering.run_round() == 0 and env.dram_blocks() == 28
    env.put(chain(101, 1))                               # 29 again: down to 24
    assert env.tiering.run_round() == 1
    assert env.nvme_keys() == {*a, *b, c[3], c[2]} and env.dram_blocks() == 24
    with env.core.lock:                                  # chain b: all on NVMe now, still found
        assert env.core.lookup(env.s, join(b))[1] == bytes([NVME] * 4)


def test_demotion_skips_pinned_and_busy_blocks(make):
    env = make()
    a, b, *pinned = fill(env)
    with env.core.lock:
        for c in pinned:
            env.core.acquire(env.s, join(c), allow_partial=False)
    env.block(b[3]).busy = True                          # as while an HBM copy or a transfer reads its slot
    # Only chain a can go: b3 is busy and b2..b0 are not leaves while it stays; the rest is pinned.
    assert env.tiering.run_round() == 1
    assert env.nvme_keys() == set(a)
    assert env.dram_blocks() == 25 and env.tiering.draining  # still wants one more block
    env.block(b[3]).busy = False
    assert env.tiering.run_round() == 1 and env.nvme_keys() == {*a, b[3]} and env.dram_blocks() == 24


def test_admission_demotes_only_blocks_looked_up_often_enough(make):
    env = make(admit_after_hits=1)
    chains = fill(env)
    with env.core.lock:
        for c in chains[:7]:                             # every chain but the last single block
            env.core.lookup(env.s, join(c))
    # The least recent: h0 (never looked up: dropped), then chain a (admitted: to NVMe).
    assert env.tiering.run_round() == 1
    assert env.nvme_keys() == set(chains[0]) and env.block(chains[7][0]) is None
    assert env.dram_blocks() == 24


def test_admission_lets_a_writer_evict_blocks_never_admitted(make):
    env = make(admit_after_hits=1)
    first = fill(env, n_chains=8, tail=0)[0]             # DRAM full, nothing looked up
    env.put(chain(50, 1))                                # served at once: a3 is dropped, not demoted
    assert env.block(first[3]) is None and env.nvme_keys() == set()


def test_writer_is_refused_as_transient_while_demotion_runs_then_served(make):
    env = make()
    fill(env, n_chains=8, tail=0)                        # DRAM full: 32 blocks, none on NVMe
    new = chain(50, 1)

    def refused() -> KVError:
        with pytest.raises(KVError) as e, env.core.lock:
            env.core.reserve(env.s, join(new), b"")
        return e.value

    err = refused()
    assert (err.code, err.transient, err.refusal) == (Code.RESOURCE_EXHAUSTED, True, pb.REFUSAL_DRAM_DEMOTING)
    assert env.core.pressure.waiting and env.core.pressure.demand_bytes == BLOCK
    seen = []
    env.nvme.during_next_put(lambda keys: seen.append((len(keys), env.core.pressure.moving, refused().refusal)))
    assert env.tiering.run_round() == 1
    assert seen == [(8, 8, pb.REFUSAL_DRAM_DEMOTING)]   # 32 - 24 in flight; the writer still refused
    assert env.dram_blocks() == 24 and env.core.pressure.moving == 0
    env.put(new)                                         # served
    assert env.dram_blocks() == 25 and not env.core.pressure.waiting


def test_a_waiting_writer_drives_demotion_below_the_high_watermark(make):
    env = make()
    a = fill(env, n_chains=6, tail=2)[0]                 # 26 blocks: under the high watermark
    want = chain(50, 8)
    with pytest.raises(KVError) as e, env.core.lock:
        env.core.reserve(env.s, join(want), b"")
    assert e.value.transient and env.core.pressure.demand_bytes == 8 * BLOCK
    assert env.tiering.run_round() == 1                  # room for 8: two blocks go
    assert env.nvme_keys() == {a[3], a[2]} and env.dram_blocks() == 24
    env.put(want)
    assert env.dram_blocks() == 32


def test_a_waiting_writer_is_given_room_in_slots_it_can_use(make):
    """Free bytes in another namespace's extent are no room for this one (an extent holds one
    namespace's slots of one size): the demoter makes room the writer can use. It counted all
    free bytes, found enough, demoted nothing, and the writer was refused until it gave up."""
    env = make()
    other = env.session("m2")
    env.put(chain(70, 1), s=other)                       # an extent of its own: 7 free slots only m2 can use
    fill(env, n_chains=5, tail=3)                        # 23 blocks of m: 24 used, under the high watermark
    want = chain(50, 8)
    with pytest.raises(KVError) as e, env.core.lock:
        env.core.reserve(env.s, join(want), b"")
    assert e.value.transient and env.core.pressure.demand_bytes == 8 * BLOCK
    assert env.tiering.run_round() >= 1
    env.put(want)                                        # served
    assert all(env.block(k).tier is DRAM for k in want)


def test_no_space_on_nvme_drops_its_least_recent_leaves(make):
    env = make(nvme_blocks=8)
    a, b, c, *_ = demoted(env)                           # NVMe: a0..a3, b3 (5 of 8)
    env.put(chain(100, 4))
    env.put(chain(101, 1))                               # 29: b2 b1 b0 c3 c2 to go, room for three
    assert env.tiering.run_round() == 2
    # c3, c2 got NO_SPACE: five NVMe leaves went (a3 a2 a1 a0 b3, forgotten), then c3, c2 moved.
    assert env.nvme_keys() == {b[0], b[1], b[2], c[3], c[2]}
    assert all(env.block(k) is None for k in a + [b[3]])
    assert env.count("kvstore_evictions_total", tier="nvme", reason="capacity") == 5
    assert env.dram_blocks() == 24
    with env.core.lock:
        assert len(env.core.lookup(env.s, join(b))[0]) == 3


def test_nvme_namespace_quota_drops_the_namespaces_own_leaves(make):
    env = make(namespace_quota_bytes=2 * BLOCK)
    s2 = env.session("m2")
    a, x = chain(0, 4), chain(30, 8)                     # a the least recent; m2 fills one DRAM extent
    env.put(a)
    env.put(x, s=s2)
    for c in [chain(i, 4) for i in range(1, 5)] + [chain(99, 1)]:
        env.put(c)                                       # 29 blocks in all
    assert env.tiering.run_round() == 1                  # a3 a2 a1 a0 x7 demoted
    assert env.nvme_keys() == {a[1], a[0], x[7]}         # m kept its quota of 2; m2 (1 block) untouched
    assert env.block(a[3]) is None and env.block(a[2]) is None
    assert env.count("kvstore_evictions_total", tier="nvme", reason="capacity") == 2


def test_delete_and_read_while_a_demotion_is_in_flight(make):
    env = make()
    a, b, c, *_ = fill(env)
    seen = []

    def meanwhile(keys):
        with env.core.lock:
            seen.append(env.core.delete(env.s, join(a)))
            seen.append(env.core.acquire(env.s, b[3], allow_partial=False)[0])  # a reader pins b3

    env.nvme.during_next_put(meanwhile)
    assert env.tiering.run_round() == 2
    deleted, lease = seen
    assert deleted == (0, 4)                             # under I/O: kept, reported busy
    b3 = env.block(b[3])
    assert (b3.tier, b3.on_nvme, b3.ref_cnt) == (DRAM, True, 1)  # copied, but its reader keeps DRAM
    # The second round made up for the pinned block with the next leaf, c3 (b2 is no leaf: b3 is in DRAM).
    assert env.nvme_keys() == {*a, b[3], c[3]} and env.dram_blocks() == 24
    assert env.count("kvstore_demotions_total", src="dram", dst="nvme") == 5
    with env.core.lock:
        assert env.core.delete(env.s, join(a)) == (4, 0)
        env.core.release(env.s, lease.id)
        assert env.core.delete(env.s, b[3]) == (1, 0)
    assert env.nvme_keys() == {c[3]}                     # deleting drops the NVMe copies too


def test_a_block_pinned_while_its_demotion_writes_joins_the_nvme_lru(make):
    """A reader pins a block while its NVMe write is in flight: the block keeps its DRAM copy and
    gains an NVMe copy, which NVMe eviction and the namespace quota must see (the demoter once set
    ``on_nvme`` by hand and left such a block out of the NVMe LRU, so a quota of 5 blocks let 6
    stay on NVMe)."""
    env = make(namespace_quota_bytes=5 * BLOCK)
    a, b, c, *_ = fill(env)
    seen = []

    def meanwhile(keys):
        with env.core.lock:
            seen.append(env.core.acquire(env.s, b[3], allow_partial=False)[0])

    env.nvme.during_next_put(meanwhile)
    assert env.tiering.run_round() == 2
    b3 = env.block(b[3])
    assert (b3.tier, b3.ref_cnt) == (DRAM, 1)
    on_nvme = {blk.key for blk in env.s.ns.blocks.values() if blk.on_nvme}
    lru = env.core.lru(NVME, env.s.ns.id)
    assert len(lru) == len(on_nvme) == len(env.nvme_keys()) == 5
    assert on_nvme == env.nvme_keys()
    if b3.on_nvme:
        assert b3 in lru


def test_a_send_that_starts_while_a_demotion_writes_keeps_the_slot_it_reads(make):
    """A transfer (or a digest) that starts reading a block whose demotion write is in flight
    holds it by a read pin: when the write lands the block keeps its DRAM copy until the read
    ends. (With a ``busy`` flag, the demotion's landing cleared it and freed the slot under the
    send.)"""
    env = make()
    a, *_ = fill(env)
    res = env.core.residency
    held = []

    def meanwhile(keys):
        blk = env.block(a[3])
        assert blk.busy                                  # being written to NVMe right now
        held.extend(res.prepare_read([blk]))

    env.nvme.during_next_put(meanwhile)
    env.tiering.run_round()
    a3 = env.block(a[3])
    assert (a3.tier, a3.on_nvme, a3.ref_cnt) == (DRAM, True, 1) and a3.offset >= 0
    assert bytes(env.core.dram.view(a3.offset, BLOCK)) == content(a[3]).tobytes()
    with env.core.lock:
        assert env.core.delete(env.s, a[3]) == (0, 1)      # read by the send: kept
    res.complete_read(held)
    assert a3.ref_cnt == 0 and a3 in env.core.lru(DRAM, env.s.ns.id)
    with env.core.lock:
        assert env.core.delete(env.s, a[3]) == (1, 0)


# --- promotion and prefetch -------------------------------------------------------------------
def test_prefetch_promotes_and_is_done_when_every_block_is_resident(make):
    env = make()
    a = demoted(env)[0]
    pid = env.tiering.prefetch(env.s, a, deadline_s=5.0)
    assert env.nvme.in_flight() == 1 and all(env.block(k).busy for k in a)
    assert env.status(pid) == (pb.PREFETCH_RUNNING, 0, 4, "0 of 4 leading blocks resident")
    env.clock.t += 0.25
    assert env.nvme.complete() == 1
    assert env.status(pid) == (pb.PREFETCH_DONE, 4, 4, "all blocks resident in DRAM")
    for k in a:
        blk = env.block(k)
        assert (blk.tier, blk.on_nvme, blk.busy) == (DRAM, True, False)
        assert np.array_equal(env.core.dram.view(blk.offset, BLOCK), content(k))
        assert blk.digests == chunk_sums(content(k), BLOCK, LAYOUT.layer_chunk_bytes)
    assert env.dram_blocks() == 28
    assert env.count("kvstore_promotions_total", src="nvme", dst="dram") == 4
    assert env.count("kvstore_prefetch_latency_seconds_sum") == 0.25
    with env.core.lock:
        assert len(env.core.acquire(env.s, join(a), allow_partial=False)[1]) == 4


def test_a_promotion_lands_piece_by_piece_in_key_order(make):
    """Pieces of ``promote_piece_bytes``: the first piece's blocks can be acquired (and copied
    by the client) while the rest is still being read."""
    env = make(promote_piece_bytes=2 * BLOCK)
    a = demoted(env)[0]
    env.tiering.prefetch(env.s, a, deadline_s=5.0)
    assert env.nvme.in_flight() == 2
    assert env.nvme.complete(batches=1) == 1
    assert [(env.block(k).tier, env.block(k).busy) for k in a] == [(DRAM, False)] * 2 + [(NVME, True)] * 2
    with env.core.lock:
        lease, blocks = env.core.acquire(env.s, join(a), allow_partial=True)
        assert [b.offset for b in blocks] == [env.block(k).offset for k in a[:2]]
        env.core.release(env.s, lease.id)
    assert env.nvme.complete() == 1
    assert all(env.block(k).tier is DRAM for k in a)
    assert env.count("kvstore_promotions_total", src="nvme", dst="dram") == 4


def test_prefetch_is_partial_at_its_deadline_on_the_injected_clock(make):
    env = make()
    a = demoted(env)[0]
    pid = env.tiering.prefetch(env.s, a, deadline_s=2.0)
    env.clock.t += 1.9
    assert env.status(pid)[0] == pb.PREFETCH_RUNNING
    env.clock.t += 0.1
    partial = (pb.PREFETCH_PARTIAL, 0, 4, "deadline passed: 0 of 4 leading blocks usable; recompute the rest")
    assert env.status(pid) == partial
    assert env.status(pid, wait_s=60.0) == partial       # the wait ends at the deadline, not 60 s on
    assert env.count("kvstore_prefetch_deadline_misses_total") == 1
    env.nvme.complete()                                  # the reads land late: the blocks are still good
    assert env.status(pid)[:2] == (pb.PREFETCH_DONE, 4)


def test_make_resident_waits_no_longer_than_its_deadline(make):
    env = make()
    a = demoted(env)[0]
    env.clock.step = 0.02                                # the reads never land while it waits
    t0 = env.clock.t
    env.tiering.make_resident(env.s, a, wait_s=0.1)
    assert 0.1 <= env.clock.t - t0 < 0.2
    assert all(env.block(k).tier is NVME and env.block(k).busy for k in a)
    env.nvme.complete()
    env.tiering.make_resident(env.s, a, wait_s=0.0)
    assert all(env.block(k).tier is DRAM for k in a)


def test_make_resident_with_enough_answers_once_that_many_leading_blocks_landed(make):
    """``enough`` (AcquireRequest.min_blocks): the wait ends once that many leading blocks are in
    DRAM, the rest still being read; asked for one more, it waits to its deadline."""
    env = make(promote_piece_bytes=2 * BLOCK)
    a = demoted(env)[0]
    env.tiering.prefetch(env.s, a, deadline_s=5.0)
    assert env.nvme.complete(batches=1) == 1             # the first piece landed, the second never does
    env.clock.step = 0.02
    t0 = env.clock.t
    env.tiering.make_resident(env.s, a, wait_s=1.0, enough=2)
    assert env.clock.t - t0 < 0.1
    assert [(env.block(k).tier, env.block(k).busy) for k in a] == [(DRAM, False)] * 2 + [(NVME, True)] * 2
    t0 = env.clock.t
    env.tiering.make_resident(env.s, a, wait_s=1.0, enough=3)
    assert env.clock.t - t0 >= 1.0
    with env.core.lock:                                  # what an Acquire pins then: the two
        lease, blocks = env.core.acquire(env.s, join(a), allow_partial=True)
        assert [b.key for b in blocks] == a[:2]
        env.core.release(env.s, lease.id)


def test_make_resident_each_promotes_past_a_missing_key(make):
    """``each`` (an engine's lookup of unrelated chunks): a key the daemon lacks does not stop
    the promotion of the NVMe blocks after it; without it the leading miss ends it."""
    env = make()
    a = demoted(env)[0]
    ask = [chain(123, 1)[0], *a]                         # never stored, then a's four blocks on NVMe
    env.tiering.make_resident(env.s, ask, wait_s=0.0)
    assert env.nvme.in_flight() == 0 and all(env.block(k).tier is NVME for k in a)
    env.tiering.make_resident(env.s, ask, wait_s=0.0, each=True)
    assert env.nvme.in_flight() == 1 and env.nvme.complete() == 1
    assert all(env.block(k).tier is DRAM for k in a)
    found = bytearray()
    with env.core.lock:
        lease, blocks = env.core.acquire(env.s, join(ask), True, found)
    assert bytes(found) == bytes([0, 1, 1, 1, 1]) and [b.key for b in blocks] == a


def test_corrupt_read_forgets_the_block_and_it_is_never_served(make):
    env = make()
    a = demoted(env)[0]
    env.nvme.corrupt(a[2])
    pid = env.tiering.prefetch(env.s, a, deadline_s=5.0)
    env.nvme.complete()
    assert env.status(pid) == (pb.PREFETCH_PARTIAL, 2, 4, "a block is missing or failed its checksum: "
                                                          "2 of 4 leading blocks usable; recompute the rest")
    assert env.block(a[2]) is None and a[2] not in env.nvme_keys()
    assert env.dram_blocks() == 27                       # a0, a1 and a3 came in; a2's slot was given back
    with env.core.lock:
        assert len(env.core.lookup(env.s, join(a))[0]) == 2
        with pytest.raises(KVError) as e:
            env.core.acquire(env.s, a[2], allow_partial=False)
    assert e.value.code is Code.NOT_FOUND


# --- durable commit ---------------------------------------------------------------------------
def test_durable_commit_writes_through_and_demotion_then_writes_nothing(make):
    env = make(durable_commit=True)
    a, b, *_ = chains = fill(env)
    for k in a:
        blk = env.block(k)
        assert (blk.tier, blk.on_nvme, blk.busy) == (DRAM, True, False)
        assert blk.digests == chunk_sums(content(k), BLOCK, LAYOUT.layer_chunk_bytes)
    assert env.nvme_keys() == {k for c in chains for k in c} and env.core.pressure.moving == 0
    parents = {e.key: e.parent for e in env.nvme.entries() if e.key in a}
    assert parents == {a[0]: None, a[1]: a[0], a[2]: a[1], a[3]: a[2]}
    puts = env.nvme.puts
    assert env.tiering.run_round() == 1
    assert env.nvme.puts == puts                         # the copies were there: DRAM is just dropped
    assert all(env.block(k).tier is NVME for k in a + [b[3]]) and env.dram_blocks() == 24


def test_durable_commit_that_fails_is_unavailable_and_keeps_serving_dram(make):
    env = make(durable_commit=True)
    c = chain(40, 2)
    env.nvme.fail_writes(len(c))
    with pytest.raises(KVError) as e:
        env.put(c)
    assert e.value.code is Code.UNAVAILABLE and "not durable on NVMe" in e.value.message
    for k in c:
        blk = env.block(k)
        assert (blk.tier, blk.on_nvme, blk.busy) == (DRAM, False, False)
    assert env.core.pressure.moving == 0 and env.nvme_keys() == set() and not env.nvme.enabled
    with pytest.raises(KVError) as e:                    # the tier disabled itself
        env.put(chain(41, 1))
    assert e.value.code is Code.UNAVAILABLE and "NVMe tier disabled" in e.value.message
    with env.core.lock:
        assert len(env.core.lookup(env.s, join(c))[0]) == 2


# --- the tier disables itself -----------------------------------------------------------------
def test_a_disabled_tier_forgets_the_blocks_only_it_held(make):
    env = make()
    a, b, c, *_ = demoted(env)                           # a and b3 on NVMe only
    pid = env.tiering.prefetch(env.s, a[:2], deadline_s=5.0)
    env.nvme.complete()                                  # a0, a1 back in DRAM, their copies kept
    assert env.status(pid)[0] == pb.PREFETCH_DONE and env.block(a[0]).on_nvme
    env.nvme.disable()
    assert env.tiering.run_round() == 0
    assert all(env.block(k) is None for k in a[2:] + [b[3]])
    assert not any(blk.on_nvme for blk in env.s.ns.blocks.values())
    assert len(env.core.lru(NVME, env.s.ns.id)) == 0
    with env.core.lock:
        assert env.core.lookup(env.s, join(a))[1] == bytes([DRAM] * 2)
        assert env.core.lookup(env.s, join(b))[1] == bytes([DRAM] * 3)
    env.put(chain(60, 4))
    env.put(chain(61, 2))                                # DRAM full: nothing is demoted any more
    assert env.dram_blocks() == 32 and env.tiering.run_round() == 0
    env.put(chain(62, 1))                                # so a writer evicts at once: the least recent
    assert env.block(c[3]) is None and env.dram_blocks() == 32  # leaf (the lookups made a and b recent)


def test_prefetch_from_a_tier_that_disabled_itself_finds_the_blocks_gone(make):
    env = make()
    a = demoted(env)[0]
    env.nvme.disable()
    pid = env.tiering.prefetch(env.s, a, deadline_s=5.0)
    assert all(env.block(k) is None for k in a) and env.dram_blocks() == 24  # slots given back
    assert env.status(pid)[:3] == (pb.PREFETCH_PARTIAL, 0, 4)


# --- restart ----------------------------------------------------------------------------------
def test_recovery_rebuilds_chains_and_lru_order_and_drops_what_it_cannot_describe(make):
    env = make(durable_commit=True)
    a, b = chain(0, 4), chain(1, 4)
    env.put(a)
    env.put(b)
    stray, short = hashlib.sha256(b"stray").digest(), hashlib.sha256(b"short").digest()
    env.nvme.put_many([(b"X" * 32, stray, None, 0, content(stray)),             # unknown namespace
                       (env.s.ns.id, short, None, 0, content(short)[:BLOCK // 2])]).result()  # wrong size
    with env.core.lock:                                  # recency: chain b, then chain a, most recent
        env.core.lookup(env.s, join(b))
        env.core.lookup(env.s, join(a))
    env.tiering.close(0.0)                               # records that recency as access times

    again = make(tier=env.nvme.reopened())
    assert again.recovered == 8 and again.nvme_keys() == {*a, *b}
    for c in (a, b):
        blocks = [again.block(k) for k in c]
        assert all((x.tier, x.on_nvme) == (NVME, True) for x in blocks)
        assert blocks[0].parent is None
        for parent, kid in zip(blocks, blocks[1:]):
            assert kid.parent is parent and parent.kids == {kid}
    with again.core.lock:
        stream = again.core.lrus.victims(NVME, lambda blk: True)
        order = [next(stream).key for _ in range(8)]
        stream.close()
    assert order == b[::-1] + a[::-1]                    # least recent first, as before the restart


def test_recovered_blocks_promote_with_their_data(make):
    env = make(durable_commit=True)
    a = chain(0, 4)
    env.put(a)
    env.tiering.close(0.0)
    again = make(tier=env.nvme.reopened())
    pid = again.tiering.prefetch(again.s, a, deadline_s=5.0)
    again.nvme.complete()
    assert again.status(pid)[:2] == (pb.PREFETCH_DONE, 4)
    for k in a:
        assert np.array_equal(again.core.dram.view(again.block(k).offset, BLOCK), content(k))
