"""The tiers a block can be in, shared by the daemon, the tiers, the clients and the KV events."""

from __future__ import annotations

import enum

from kvstore.v1 import kvstore_pb2 as pb


class TierKind(enum.IntEnum):
    """A tier; its value is the ``kvstore.v1.Tier`` the wire carries (TIER_UNSPECIFIED has none)."""

    HBM = pb.TIER_HBM
    DRAM = pb.TIER_DRAM
    NVME = pb.TIER_NVME
    REMOTE = pb.TIER_REMOTE
