"""The contract every tier keeps (``kvstore.tiers.base.Tier``), as a test mixin.

Apply it by subclassing with a name pytest collects and providing the factory::

    class TestDramContract(TierContract):
        def make_tier(self, tmp_path, capacity_bytes):
            return DramTier(...)

``make_tier`` must return an empty, enabled tier whose ``stats().capacity_bytes`` is exactly
``capacity_bytes`` and whose allocation unit (extent) is a multiple of ``SLOT`` that divides
``capacity_bytes`` (so one namespace can fill it with exactly ``capacity_bytes // SLOT`` slots).
``close_tier`` releases it (default: ``tier.close()`` when the tier has one).

What the contract pins down:
- ``allocate`` returns None when full (back-pressure), never raises for it;
- ``stats()`` counts exactly: ``used_bytes`` = allocated slots x slot bytes (for slot sizes that
  are a multiple of 4096), ``blocks`` = allocated slots;
- ``write`` then ``read`` round-trips bit-exactly, for any buffer alignment and odd sizes,
  and the async variants return a :class:`Transfer` that does the same;
- ``free`` makes room; freeing a slot under another namespace raises ValueError;
- a ``src`` larger than the slot raises ValueError (it would overwrite a neighbour).
"""

from __future__ import annotations

import numpy as np
import pytest

from kvstore.tiers.base import TierKind, TierStats, Transfer

KiB = 1024


def _pattern(seed: int, nbytes: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


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

    # --- helpers --------------------------------------------------------------------------

    def fill(self, tier, ns: bytes, slot_bytes: int) -> list[int]:
        slots = []
        while (s := tier.allocate(ns, slot_bytes)) is not None:
            slots.append(s)
            assert len(slots) <= self.CAPACITY // slot_bytes, "allocated past capacity"
        return slots

    # --- allocation and stats ---------------------------------------------------------------

    def test_kind_and_empty_stats(self, tier):
        st = tier.stats()
        assert isinstance(tier.kind, TierKind)
        assert isinstance(st, TierStats) and st.kind == tier.kind
        assert (st.capacity_bytes, st.used_bytes, st.blocks, st.enabled) == (self.CAPACITY, 0, 0, True)

    def test_allocate_until_full_returns_none(self, tier):
        slots = self.fill(tier, self.NS_A, self.SLOT)
        assert len(slots) == self.CAPACITY // self.SLOT
        assert len(set(slots)) == len(slots)
        assert tier.allocate(self.NS_A, self.SLOT) is None  # still None, still no exception
        assert tier.allocate(self.NS_B, self.SLOT) is None
        st = tier.stats()
        assert (st.used_bytes, st.blocks) == (self.CAPACITY, len(slots))

    def test_exact_byte_counts(self, tier):
        a = [tier.allocate(self.NS_A, self.SLOT) for _ in range(3)]
        b = [tier.allocate(self.NS_B, 2 * self.SLOT) for _ in range(2)]
        st = tier.stats()
        assert (st.used_bytes, st.blocks) == (3 * self.SLOT + 4 * self.SLOT, 5)
        tier.free(self.NS_A, a[1])
        tier.free(self.NS_B, b[0])
        st = tier.stats()
        assert (st.used_bytes, st.blocks) == (2 * self.SLOT + 2 * self.SLOT, 3)

    def test_free_makes_room(self, tier):
        slots = self.fill(tier, self.NS_A, self.SLOT)
        tier.free(self.NS_A, slots[5])
        again = tier.allocate(self.NS_A, self.SLOT)
        assert again is not None
        assert tier.allocate(self.NS_A, self.SLOT) is None
        for s in slots[:5] + slots[6:] + [again]:
            tier.free(self.NS_A, s)
        assert (tier.stats().used_bytes, tier.stats().blocks) == (0, 0)
        # Everything freed: another namespace (another slot size) can take the whole tier.
        assert len(self.fill(tier, self.NS_B, 2 * self.SLOT)) == self.CAPACITY // (2 * self.SLOT)

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

    # --- data -----------------------------------------------------------------------------

    def test_round_trip_bit_exact(self, tier):
        slots = self.fill(tier, self.NS_A, self.SLOT)
        for i, s in enumerate(slots):
            tier.write(s, _pattern(i, self.SLOT))
        for i, s in enumerate(slots):  # no slot bleeds into another
            dst = np.zeros(self.SLOT, np.uint8)
            tier.read(s, dst)
            assert np.array_equal(dst, _pattern(i, self.SLOT)), f"slot {i}"

    @pytest.mark.parametrize("nbytes", [1, 4095, 4097, 12345, 64 * KiB - 1])
    def test_round_trip_odd_sizes(self, tier, nbytes):
        s = tier.allocate(self.NS_A, nbytes)
        src = _pattern(nbytes, nbytes)
        tier.write(s, src)
        dst = np.zeros(nbytes, np.uint8)
        tier.read(s, dst)
        assert np.array_equal(dst, src)

    def test_round_trip_unaligned_buffers(self, tier):
        s = tier.allocate(self.NS_A, self.SLOT)
        raw = bytearray(self.SLOT + 3)
        raw[1:self.SLOT + 1] = _pattern(7, self.SLOT).tobytes()
        tier.write(s, memoryview(raw)[1:self.SLOT + 1])  # address off by one byte
        out = bytearray(self.SLOT + 5)
        tier.read(s, memoryview(out)[3:self.SLOT + 3])
        assert out[3:self.SLOT + 3] == raw[1:self.SLOT + 1]

    def test_rewrite_replaces_content(self, tier):
        s = tier.allocate(self.NS_A, self.SLOT)
        tier.write(s, _pattern(1, self.SLOT))
        tier.write(s, _pattern(2, self.SLOT))
        dst = np.zeros(self.SLOT, np.uint8)
        tier.read(s, dst)
        assert np.array_equal(dst, _pattern(2, self.SLOT))

    def test_src_larger_than_slot_raises(self, tier):
        s = tier.allocate(self.NS_A, self.SLOT)
        with pytest.raises(ValueError):
            tier.write(s, np.zeros(self.SLOT + 4096, np.uint8))

    def test_async_round_trip_many_in_flight(self, tier):
        slots = self.fill(tier, self.NS_A, self.SLOT)
        writes = [tier.write_async(s, _pattern(100 + i, self.SLOT)) for i, s in enumerate(slots)]
        assert all(isinstance(t, Transfer) for t in writes)
        for t in writes:
            t.result(self.TIMEOUT_S)
            assert t.done() and t.error is None
        dsts = [np.zeros(self.SLOT, np.uint8) for _ in slots]
        reads = [tier.read_async(s, d) for s, d in zip(slots, dsts)]
        for t in reads:
            assert t.wait(self.TIMEOUT_S)
            assert t.error is None
        for i, d in enumerate(dsts):
            assert np.array_equal(d, _pattern(100 + i, self.SLOT)), f"slot {i}"

    def test_async_then_sync_read_agree(self, tier):
        s = tier.allocate(self.NS_A, 3 * 4096 + 100)
        src = _pattern(5, 3 * 4096 + 100)
        tier.write_async(s, src).result(self.TIMEOUT_S)
        dst = np.zeros(src.nbytes, np.uint8)
        tier.read(s, dst)
        assert np.array_equal(dst, src)
