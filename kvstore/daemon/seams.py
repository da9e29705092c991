"""The seams the residency calls out through, under the daemon's lock: what it asks of the tier
below DRAM (:class:`LowerTiers`) and where it reports each block entering or leaving a tier
(:class:`BlockEvents`), with the implementations of a daemon that has neither."""

from __future__ import annotations

from typing import Protocol

from kvstore.daemon.index import Block
from kvstore.keys import Namespace
from kvstore.tier_kind import TierKind


class LowerTiers(Protocol):
    """What the residency asks of the tier below DRAM (:class:`kvstore.daemon.demoter.NvmeCopies`;
    :class:`DramOnly` when there is none). Called under the daemon's lock; it never calls back."""

    def holds_copy(self, b: Block) -> bool:
        """``b`` (``on_nvme``) is being evicted from DRAM: True if its NVMe copy is usable, so
        the block stays, on NVMe."""

    def must_demote(self, b: Block) -> bool:
        """True if ``b``'s data exists only in DRAM and must reach NVMe before DRAM drops it;
        the answer True also asks the demoter to move it (back-pressure, not loss)."""

    def delete_copy(self, b: Block) -> None:
        """``b`` is deleted: drop its NVMe copy."""

    def dram_freed(self, b: Block, reason: str) -> None:
        """``b``'s DRAM slot is about to be freed (``reason``: capacity, delete, abort, dropped).
        A notice only (the residency drops the HBM copy itself)."""


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


class BothEvents:
    """:class:`BlockEvents` to two consumers (the KV event stream and the store-backed cluster
    directory), in that order."""

    def __init__(self, first: BlockEvents, second: BlockEvents) -> None:
        self.first, self.second = first, second

    def stored(self, b: Block, ns: Namespace, tier: TierKind) -> None:
        self.first.stored(b, ns, tier)
        self.second.stored(b, ns, tier)

    def removed(self, b: Block, tier: TierKind) -> None:
        self.first.removed(b, tier)
        self.second.removed(b, tier)
