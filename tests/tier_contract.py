"""The contract every tier keeps, through the API the daemon drives (``kvstore.tiers.base``).

Apply it by subclassing with a name pytest collects and providing the factory::

    class TestDramContract(SlotTierContract):
        def make_tier(self, tmp_path, capacity_bytes):
            return DramTier(...)

``TierContract`` runs against every tier; ``SlotTierContract`` adds what slot tiers (DRAM, HBM)
promise about their slots. Blocks move the way the daemon moves them, chosen by the tier's
protocol: DRAM through arena views (:class:`ArenaTier.view`), HBM by ``promote`` (and ``demote``
to read back), NVMe by ``put_many`` / ``get_many`` / ``delete`` with keys.

``make_tier`` must return an empty, enabled tier whose ``stats().capacity_bytes`` is exactly
``capacity_bytes`` and whose allocation unit (extent) is ``4 * SLOT`` (so one namespace can fill
it with exactly ``capacity_bytes // SLOT`` blocks). ``close_tier`` releases it (default:
``tier.close()`` when the tier has one).

What the contract pins down:
- the tier keeps its kind's protocol, and ``stats()`` counts exactly: ``used_bytes`` = blocks
  held x block bytes (for sizes that are a multiple of 4096), ``blocks`` = blocks held;
- a full tier is back-pressure, never an exception (``allocate`` returns None; a put is
  ``NO_SPACE``), and dropping a block makes room, for another namespace and size too;
- blocks round-trip bit-exactly, for any buffer alignment and odd sizes, many at once, and no
  block bleeds into another;
- slot tiers: freeing under another namespace raises ValueError, namespaces get disjoint slots,
  a copy larger than its slot raises ValueError (it would overwrite a neighbour).
"""

from __future__ import annotations

import hashlib
import itertools

import numpy as np
import pytest

from kvstore.tiers.base import (ArenaTier, DevicePoolTier, KeyedTier, SlotTier, Tier, TierKind, TierStats,
                                CopyHandle)
from kvstore.tiers.nvme import IoResult

KiB = 1024
PROTOCOL = {TierKind.DRAM: ArenaTier, TierKind.HBM: DevicePoolTier, TierKind.NVME: KeyedTier}


def _pattern(seed: int, nbytes: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


class _SlotPath:
    """Blocks in a slot tier: the caller allocates and keeps the slot (the block's handle)."""

    def __init__(self, tier: SlotTier, timeout_s: float) -> None:
        self.tier, self.timeout_s = tier, timeout_s

    def store(self, ns: bytes, srcs: list) -> list[int | None]:
        slots = [self.tier.allocate(ns, len(memoryview(s).cast("B"))) for s in srcs]
        self.copy_in([(s, src) for s, src in zip(slots, srcs) if s is not None])
        return slots

    def copy_in(self, pairs: list) -> None:
        if isinstance(self.tier, DevicePoolTier):
            t = self.tier.promote(pairs)
            assert isinstance(t, CopyHandle)
            t.result(self.timeout_s)
        else:
            for slot, src in pairs:
                src = np.frombuffer(src, np.uint8)
                np.copyto(self.tier.view(slot, src.nbytes), src)

    def load(self, slots: list[int], dsts: list) -> None:
        if isinstance(self.tier, DevicePoolTier):
            self.tier.demote(list(zip(slots, dsts))).result(self.timeout_s)
        else:
            for slot, dst in zip(slots, dsts):
                dst = np.frombuffer(dst, np.uint8)
                np.copyto(dst, self.tier.view(slot, dst.nbytes))

    def drop(self, ns: bytes, slots: list[int]) -> None:
        for s in slots:
            self.tier.free(ns, s)


class _KeyPath:
    """Blocks in a keyed tier: the tier keeps the index; the key is the block's handle."""

    def __init__(self, tier: KeyedTier, timeout_s: float) -> None:
        self.tier, self.timeout_s = tier, timeout_s
        self._ids = itertools.count()

    def store(self, ns: bytes, srcs: list) -> list[bytes | None]:
        keys = [hashlib.sha256(ns + next(self._ids).to_bytes(8, "little")).digest() for _ in srcs]
        b = self.tier.put_many([(ns, k, None, 0, src) for k, src in zip(keys, srcs)])
        assert b.wait(self.timeout_s)
        assert set(b.results.values()) <= {IoResult.OK, IoResult.NO_SPACE}, b.error
        return [k if b.results[k] is IoResult.OK else None for k in keys]

    def load(self, keys: list[bytes], dsts: list) -> None:
        b = self.tier.get_many(keys, dsts)
        b.result(self.timeout_s)

    def drop(self, ns: bytes, keys: list[bytes]) -> None:
        assert self.tier.delete(keys) == len(keys)


class TierContract:
    SLOT = 64 * KiB
    CAPACITY = 16 * SLOT
    NS_A = b"A" * 32
    NS_B = b"B" * 32
    TIMEOUT_S = 30.0

    def make_tier(self, tmp_path, capacity_bytes: int):
        raise NotImplementedError

    def close_tier(self, tier) -> None:
        close = getattr(tier, "close", None)
        if close is not None:
            close()

    @pytest.fixture
    def tier(self, tmp_path):
        t = self.make_tier(tmp_path, self.CAPACITY)
        yield t
        self.close_tier(t)

    @pytest.fixture
    def path(self, tier):
        return _KeyPath(tier, self.TIMEOUT_S) if tier.kind is TierKind.NVME else _SlotPath(tier, self.TIMEOUT_S)

    # --- helpers --------------------------------------------------------------------------

    def fill(self, path, ns: bytes, nbytes: int) -> list:
        """Store blocks of ``nbytes`` one at a time until the tier says it is full."""
        handles = []
        while (h := path.store(ns, [_pattern(len(handles), nbytes)])[0]) is not None:
            handles.append(h)
            assert len(handles) <= self.CAPACITY // nbytes, "stored past capacity"
        return handles

    # --- protocol and stats ---------------------------------------------------------------

    def test_keeps_its_protocol_and_starts_empty(self, tier):
        assert isinstance(tier.kind, TierKind)
        assert isinstance(tier, Tier) and isinstance(tier, PROTOCOL[tier.kind])
        st = tier.stats()
        assert isinstance(st, TierStats) and st.kind == tier.kind
        assert (st.capacity_bytes, st.used_bytes, st.blocks, st.enabled) == (self.CAPACITY, 0, 0, True)

    def test_full_tier_is_back_pressure(self, tier, path):
        handles = self.fill(path, self.NS_A, self.SLOT)
        assert len(handles) == self.CAPACITY // self.SLOT
        assert len(set(handles)) == len(handles)
        assert path.store(self.NS_A, [_pattern(0, self.SLOT)]) == [None]  # still no room, no exception
        assert path.store(self.NS_B, [_pattern(0, self.SLOT)]) == [None]
        st = tier.stats()
        assert (st.used_bytes, st.blocks, st.enabled) == (self.CAPACITY, len(handles), True)

    def test_exact_byte_counts(self, tier, path):
        a = path.store(self.NS_A, [_pattern(i, self.SLOT) for i in range(3)])
        b = path.store(self.NS_B, [_pattern(i, 2 * self.SLOT) for i in range(2)])
        st = tier.stats()
        assert (st.used_bytes, st.blocks) == (3 * self.SLOT + 4 * self.SLOT, 5)
        path.drop(self.NS_A, [a[1]])
        path.drop(self.NS_B, [b[0]])
        st = tier.stats()
        assert (st.used_bytes, st.blocks) == (2 * self.SLOT + 2 * self.SLOT, 3)

    def test_drop_makes_room(self, tier, path):
        handles = self.fill(path, self.NS_A, self.SLOT)
        path.drop(self.NS_A, [handles[5]])
        (again,) = path.store(self.NS_A, [_pattern(99, self.SLOT)])
        assert again is not None
        assert path.store(self.NS_A, [_pattern(0, self.SLOT)]) == [None]
        path.drop(self.NS_A, handles[:5] + handles[6:] + [again])
        assert (tier.stats().used_bytes, tier.stats().blocks) == (0, 0)
        # Everything dropped: another namespace (another block size) can take the whole tier.
        assert len(self.fill(path, self.NS_B, 2 * self.SLOT)) == self.CAPACITY // (2 * self.SLOT)

    # --- data -----------------------------------------------------------------------------

    def test_round_trip_bit_exact(self, path):
        handles = self.fill(path, self.NS_A, self.SLOT)
        for i, h in enumerate(handles):  # no block bleeds into another
            dst = np.zeros(self.SLOT, np.uint8)
            path.load([h], [dst])
            assert np.array_equal(dst, _pattern(i, self.SLOT)), f"block {i}"

    @pytest.mark.parametrize("nbytes", [1, 4095, 4097, 12345, 64 * KiB - 1])
    def test_round_trip_odd_sizes(self, path, nbytes):
        src = _pattern(nbytes, nbytes)
        (h,) = path.store(self.NS_A, [src])
        dst = np.zeros(nbytes, np.uint8)
        path.load([h], [dst])
        assert np.array_equal(dst, src)

    def test_round_trip_unaligned_buffers(self, path):
        raw = bytearray(self.SLOT + 3)
        raw[1:self.SLOT + 1] = _pattern(7, self.SLOT).tobytes()
        (h,) = path.store(self.NS_A, [memoryview(raw)[1:self.SLOT + 1]])  # address off by one byte
        out = bytearray(self.SLOT + 5)
        path.load([h], [memoryview(out)[3:self.SLOT + 3]])
        assert out[3:self.SLOT + 3] == raw[1:self.SLOT + 1]

    def test_many_blocks_in_one_batch(self, path):
        n = self.CAPACITY // self.SLOT
        handles = path.store(self.NS_A, [_pattern(100 + i, self.SLOT) for i in range(n)])
        assert None not in handles
        dsts = [np.zeros(self.SLOT, np.uint8) for _ in handles]
        path.load(handles, dsts)
        for i, d in enumerate(dsts):
            assert np.array_equal(d, _pattern(100 + i, self.SLOT)), f"block {i}"


class SlotTierContract(TierContract):
    """What slot tiers (DRAM, HBM) add: the caller's slots, and their bounds."""

    def test_slot_geometry(self, tier):
        assert isinstance(tier, SlotTier)
        assert tier.capacity_bytes == self.CAPACITY
        assert tier.slot_stride(1) == tier.slot_stride(4096) == 4096 and tier.slot_stride(4097) == 8192
        assert tier.fits(4 * self.SLOT) and not tier.fits(4 * self.SLOT + 1)
        assert tier.allocate(self.NS_A, 4 * self.SLOT + 1) is None  # larger than an extent: never

    def test_free_under_wrong_namespace_raises(self, tier):
        s = tier.allocate(self.NS_A, self.SLOT)
        with pytest.raises(ValueError):
            tier.free(self.NS_B, s)
        assert tier.stats().blocks == 1

    def test_namespaces_get_disjoint_slots(self, tier):
        spans = [(s, s + self.SLOT) for s in (tier.allocate(self.NS_A, self.SLOT) for _ in range(3))]
        spans += [(s, s + 3 * self.SLOT) for s in (tier.allocate(self.NS_B, 3 * self.SLOT) for _ in range(2))]
        spans.sort()
        assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:]))

    def test_rewrite_replaces_content(self, tier, path):
        (s,) = path.store(self.NS_A, [_pattern(1, self.SLOT)])
        path.copy_in([(s, _pattern(2, self.SLOT))])
        dst = np.zeros(self.SLOT, np.uint8)
        path.load([s], [dst])
        assert np.array_equal(dst, _pattern(2, self.SLOT))

    def test_copy_larger_than_slot_raises(self, tier, path):
        s = tier.allocate(self.NS_A, self.SLOT)
        with pytest.raises(ValueError):
            path.copy_in([(s, np.zeros(self.SLOT + 4096, np.uint8))])
