"""Layer doorbells: 64-byte cells in a small region at the end of the shared arena.

A cell holds two little-endian uint32: the number of leading layers that are written (or have
arrived), then a state (0 running, 1 done, 2 failed). The writer side only ever raises the layer
count, so a reader that polls it sees layers appear in order without an RPC per layer. Cells are
reference counted: a write lease and the transfer reading it may both hold one.

Not thread-safe: allocation runs under the core lock; cell reads and writes are single aligned
32-bit stores (atomic on every platform we run on).
"""

from __future__ import annotations

import numpy as np

CELL_BYTES = 64
REGION_BYTES = 1 << 20  # 16,384 cells
RUNNING, DONE, FAILED = 0, 1, 2


class Doorbells:
    def __init__(self, arena_buf: np.ndarray, base: int, region_bytes: int = REGION_BYTES) -> None:
        self.base = base
        self.words = arena_buf[base:base + region_bytes].view("<u4")
        self._free = list(range(region_bytes // CELL_BYTES - 1, 0, -1))  # cell 0 unused: offset 0 means none
        self._refs: dict[int, int] = {}

    def alloc(self) -> int:
        """A zeroed cell's arena offset, or 0 when every cell is taken."""
        if not self._free:
            return 0
        cell = self._free.pop()
        self._refs[cell] = 1
        self.words[cell * CELL_BYTES // 4: cell * CELL_BYTES // 4 + 2] = 0
        return self.base + cell * CELL_BYTES

    def ref(self, offset: int) -> None:
        self._refs[self._cell(offset)] += 1

    def release(self, offset: int) -> None:
        cell = self._cell(offset)
        self._refs[cell] -= 1
        if self._refs[cell] == 0:
            del self._refs[cell]
            self._free.append(cell)

    def _cell(self, offset: int) -> int:
        cell = (offset - self.base) // CELL_BYTES
        if offset <= self.base or (offset - self.base) % CELL_BYTES or cell not in self._refs:
            raise ValueError(f"doorbell at {offset}: not an allocated cell")
        return cell

    def layers(self, offset: int) -> int:
        return int(self.words[(offset - self.base) // 4])

    def state(self, offset: int) -> int:
        return int(self.words[(offset - self.base) // 4 + 1])

    def set(self, offset: int, layers: int, state: int = RUNNING) -> None:
        i = (offset - self.base) // 4
        self.words[i] = layers
        self.words[i + 1] = state


def ring(arena_buf: np.ndarray, offset: int, layers: int) -> None:
    """Client side: announce that ``layers`` leading layers are written."""
    arena_buf[offset:offset + 4].view("<u4")[0] = layers


def read(arena_buf: np.ndarray, offset: int) -> tuple[int, int]:
    """Client side: ``(layers ready, state)`` of a cell."""
    w = arena_buf[offset:offset + 8].view("<u4")
    return int(w[0]), int(w[1])
