"""The NVMe tier's calls as the tier movers make them: a failure of the tier (it disables
itself) is logged and the daemon keeps serving from DRAM; a batch's wait is bounded, and a
batch past its bound is still waited for, because its DRAM slots are under I/O."""

from __future__ import annotations

import logging
from collections.abc import Callable

from kvstore.tiers.base import KeyedTier

log = logging.getLogger("kvstore.daemon.tiering")


class NvmeIo:
    """``encodes(model_id, ns_id)``: whether a namespace's blocks go to the tier's codec
    (``NvmeConfig.encodes``)."""

    def __init__(self, nvme: KeyedTier, io_timeout_s: float,
                 encodes: Callable[[str, bytes], bool] = lambda model_id, ns_id: False) -> None:
        self.nvme = nvme
        self.io_timeout_s = io_timeout_s
        self.encodes = encodes

    def items(self, moves: list) -> list[tuple]:
        """The ``put_many`` tuples of :class:`~kvstore.daemon.residency.Move` s."""
        return [m.nvme_item(m.ns is not None and self.encodes(m.ns.model_id, m.ns_id)) for m in moves]

    def submit(self, items: list[tuple]):
        """Start writing ``items`` (``KeyedTier.put_many`` tuples); None when the tier is off."""
        try:
            return self.nvme.put_many(items)
        except Exception as e:  # noqa: BLE001 - disabled tier: DRAM keeps serving
            log.error("NVMe put failed: %s", e)
            return None

    def wait(self, batch, n: int) -> None:
        if not batch.wait(self.io_timeout_s):
            log.error("NVMe put of %d blocks still running after its bound", n)
            batch.wait()  # the slots are under I/O: they must not be reused until it ends

    def put(self, items: list[tuple]):
        """Write ``items`` and wait; the batch, or None when the tier is off."""
        batch = self.submit(items)
        if batch is not None:
            self.wait(batch, len(items))
        return batch

    def delete(self, keys: list[bytes]) -> None:
        if keys:
            try:
                self.nvme.delete(keys)
            except Exception as e:  # noqa: BLE001 - the tier disables itself; DRAM keeps serving
                log.error("NVMe delete failed: %s", e)


def outcome(batch) -> tuple[dict, dict]:
    """(key -> IoResult, key -> digests) of a finished batch; both empty for no batch (the tier
    was off: every block failed)."""
    if batch is None:
        return {}, {}
    return batch.results, batch.digests()
