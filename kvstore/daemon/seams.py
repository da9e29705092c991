"""The seams the core calls out through, under its lock: what it asks of the tiers below and
beside DRAM (:class:`LowerTiers`) and where it reports each block entering or leaving a tier
(:class:`BlockEvents`), with the implementations of a daemon that has neither."""

from __future__ import annotations

from typing import Protocol

from kvstore.daemon.index import Block
from kvstore.keys import Namespace
from kvstore.tiers.base import TierKind


class LowerTiers(Protocol):
    """What the core asks of the tiers below and beside DRAM (:class:`kvstore.daemon.tiering.NvmeCopies`,
    :class:`kvstore.daemon.hbm_cache.HbmCopies`; :class:`DramOnly` when there are none). Called under
    the core lock; none of them calls the core."""

    def holds_copy(self, b: Block) -> bool:
        """``b`` (``on_nvme``) is being evicted from DRAM: True if its NVMe copy is usable, so
        the block stays, on NVMe."""

    def must_demote(self, b: Block) -> bool:
        """True if ``b``'s data exists only in DRAM and must reach NVMe before DRAM drops it;
        the answer True also asks the demoter to move it (back-pressure, not loss)."""

    def delete_copy(self, b: Block) -> None:
        """``b`` is deleted: drop its NVMe copy."""

    def dram_freed(self, b: Block, reason: str) -> None:
        """``b``'s DRAM slot is about to be freed (``reason``: capacity, delete, abort, dropped):
        copies that live only as long as it (HBM) go with it."""


class DramOnly:
    """:class:`LowerTiers` of a daemon with nothing below DRAM."""

    def holds_copy(self, b: Block) -> bool:
        return False

    def must_demote(self, b: Block) -> bool:
        return False

    def delete_copy(self, b: Block) -> None:
        pass

    def dram_freed(self, b: Block, reason: str) -> None:
        pass


class TierCopies:
    """:class:`LowerTiers` over an NVMe side and an HBM side, either of which may be absent."""

    def __init__(self, nvme: LowerTiers | None = None, hbm: LowerTiers | None = None) -> None:
        self.nvme = nvme or DramOnly()
        self.hbm = hbm or DramOnly()

    def holds_copy(self, b: Block) -> bool:
        return self.nvme.holds_copy(b)

    def must_demote(self, b: Block) -> bool:
        return self.nvme.must_demote(b)

    def delete_copy(self, b: Block) -> None:
        self.nvme.delete_copy(b)

    def dram_freed(self, b: Block, reason: str) -> None:
        self.hbm.dram_freed(b, reason)


class BlockEvents(Protocol):
    """Where the core reports each committed block entering or leaving a tier, for the KV event
    stream (:class:`kvstore.daemon.events.EventPublisher`; :class:`NoEvents` when off). Called
    under the core lock, in the order the changes happen; it only queues (never blocks, never
    calls the core)."""

    def stored(self, b: Block, ns: Namespace, tier: TierKind) -> None:
        """``b`` (of ``ns``) is now held in ``tier``."""

    def removed(self, b: Block, tier: TierKind) -> None:
        """``b`` is no longer held in ``tier``."""


class NoEvents:
    """:class:`BlockEvents` of a daemon that publishes none."""

    def stored(self, b: Block, ns: Namespace, tier: TierKind) -> None:
        pass

    def removed(self, b: Block, tier: TierKind) -> None:
        pass
