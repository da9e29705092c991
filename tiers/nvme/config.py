"""Settings of the NVMe tier (:class:`NvmeTierConfig`) and what a completed put survives."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from kvstore.tiers.nvme.files import ALIGN, IoMode

GiB = 1 << 30
MiB = 1 << 20


class SyncMode(enum.Enum):
    """What a completed put survives."""

    DURABLE = "durable"  # fdatasync data files, then a synced LMDB commit: survives power loss
    PROCESS = "process"  # no fsync anywhere: survives a daemon crash (SIGKILL), not a host crash


@dataclass(frozen=True, slots=True)
class NvmeTierConfig:
    """NVMe tier settings. Sizes are bytes. ``capacity_bytes`` is rounded down to whole extents.

    ``io_threads`` is the number of I/Os in flight (queue depth). ``coalesce_bytes``: blocks of
    one batch whose slots are adjacent in a file move in one vectored I/O of up to this many
    bytes (0: one I/O per block); it cuts the per-I/O cost of small blocks. ``extent_bytes`` is the
    allocation unit a namespace takes at a time; it must divide ``file_bytes``. ``map_bytes``
    bounds the LMDB index (address space, not disk: the file grows as records are added; about
    0.5 KiB per block for 32 layers). ``atime_flush_s``: dirty access times are written at
    most this long after :meth:`NvmeTier.touch` (seconds). ``codec``: ``off``, ``auto``,
    ``nibble`` or ``planes-zstd`` (:class:`kvstore.tiers.nvme.coded.BlockCoder`): puts that
    name their element type are stored encoded, in slots sized by the payload.
    """

    dir: str
    capacity_bytes: int
    file_bytes: int = 16 * GiB
    extent_bytes: int = 64 * MiB
    io_threads: int = 8
    coalesce_bytes: int = 1 * MiB
    bounce_bytes: int = 4 * MiB
    map_bytes: int = 4 * GiB
    sync: SyncMode = SyncMode.DURABLE
    io_mode: IoMode = IoMode.AUTO
    preallocate: bool = True  # fallocate the data files; False leaves them sparse (tests, thin disks)
    atime_flush_s: float = 5.0
    close_timeout_s: float = 30.0
    codec: str = "off"

    def __post_init__(self) -> None:
        if self.extent_bytes <= 0 or self.extent_bytes % ALIGN:
            raise ValueError(f"extent_bytes: must be a positive multiple of {ALIGN}, got {self.extent_bytes}")
        if self.capacity_bytes < self.extent_bytes:
            raise ValueError(f"capacity_bytes: must hold at least one extent of {self.extent_bytes} bytes, "
                             f"got {self.capacity_bytes}")
        if self.file_bytes <= 0 or self.file_bytes % self.extent_bytes:
            raise ValueError(f"file_bytes: must be a positive multiple of extent_bytes={self.extent_bytes}, "
                             f"got {self.file_bytes}")
        if self.coalesce_bytes < 0:
            raise ValueError(f"coalesce_bytes: must be >= 0, got {self.coalesce_bytes}")
        if self.io_threads < 1:
            raise ValueError(f"io_threads: must be >= 1, got {self.io_threads}")
        if self.bounce_bytes < ALIGN or self.bounce_bytes % ALIGN:
            raise ValueError(f"bounce_bytes: must be a positive multiple of {ALIGN}, got {self.bounce_bytes}")
        if str(self.codec).strip().lower() not in ("off", "auto", "nibble", "planes-zstd"):
            raise ValueError(f"codec: expected off, auto, nibble or planes-zstd, got {self.codec!r}")
        if self.map_bytes < 64 * 1024:
            raise ValueError(f"map_bytes: must be at least 64 KiB, got {self.map_bytes}")

    @property
    def usable_bytes(self) -> int:
        return self.capacity_bytes // self.extent_bytes * self.extent_bytes
