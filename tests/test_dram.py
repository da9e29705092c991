"""The DRAM tier keeps the tier contract."""

from tier_contract import TierContract

from kvstore.tiers.arena import Arena
from kvstore.tiers.dram import DramTier


class TestDramContract(TierContract):
    def make_tier(self, tmp_path, capacity_bytes):
        self._arena = Arena(capacity_bytes, prefault=False)
        return DramTier(self._arena, 4 * self.SLOT)

    def close_tier(self, tier):
        tier.arena.close()
