"""The DRAM tier keeps the slot tier contract."""

import os

from tier_contract import SlotTierContract

from kvstore.tiers.arena import Arena
from kvstore.tiers.dram import DramTier


class TestDramContract(SlotTierContract):
    def make_tier(self, tmp_path, capacity_bytes):
        self._arena = Arena(capacity_bytes, prefault=False)
        return DramTier(self._arena, 4 * self.SLOT)

    def close_tier(self, tier):
        tier.arena.close()


def test_map_in_background_fills_a_second_mapping_and_keeps_data():
    """A client-side mapping of the daemon's arena is filled in a background thread; writes
    through either mapping are seen by the other, before and after it finishes."""
    from kvstore.tiers.arena import Arena

    owner = Arena(64 << 20, prefault=True)
    owner.buf[:4096] = 7
    mine = Arena(64 << 20, fd=os.dup(owner.fd), prefault=False)
    done = mine.map_in_background(chunk_bytes=8 << 20)
    mine.buf[-4096:] = 9  # while mapping: faults as usual
    assert done.wait(30)
    assert (mine.buf[:4096] == 7).all() and (owner.buf[-4096:] == 9).all()
    mine.close()
    owner.close()
