"""Configuration, errors and result types of the NVMe tier (:mod:`kvstore.tiers.nvme`)."""

from __future__ import annotations

import enum
import errno
import threading
from dataclasses import dataclass
from typing import Callable, NamedTuple

import lmdb

from kvstore.tiers.base import TierError, Transfer
from kvstore.tiers.nvme_io import ALIGN, IoMode

GiB = 1 << 30
MiB = 1 << 20


class SyncMode(enum.Enum):
    """What a completed put survives."""

    DURABLE = "durable"  # fdatasync data files, then a synced LMDB commit: survives power loss
    PROCESS = "process"  # no fsync anywhere: survives a daemon crash (SIGKILL), not a host crash


@dataclass(frozen=True, slots=True)
class NvmeConfig:
    """NVMe tier settings. Sizes are bytes. ``capacity_bytes`` is rounded down to whole extents.

    ``io_threads`` is the number of I/Os in flight (queue depth). ``coalesce_bytes``: blocks of
    one batch whose slots are adjacent in a file move in one vectored I/O of up to this many
    bytes (0: one I/O per block); it cuts the per-I/O cost of small blocks. ``extent_bytes`` is the
    allocation unit a namespace takes at a time; it must divide ``file_bytes``. ``map_bytes``
    bounds the LMDB index (address space, not disk: the file grows as records are added; about
    0.5 KiB per block for 32 layers). ``atime_flush_s``: dirty access times are written at
    most this long after :meth:`NvmeTier.touch` (seconds).
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
        if self.map_bytes < 64 * 1024:
            raise ValueError(f"map_bytes: must be at least 64 KiB, got {self.map_bytes}")

    @property
    def usable_bytes(self) -> int:
        return self.capacity_bytes // self.extent_bytes * self.extent_bytes


# --- errors -----------------------------------------------------------------------------------

class NvmeError(TierError):
    """Base of every NVMe tier failure."""


class NvmeDisabledError(NvmeError):
    """The tier disabled itself after an earlier failure (``__cause__``) or was closed; serve
    from the other tiers. Data already committed stays on disk for the next start."""


class NvmeDiskFullError(NvmeError):
    """ENOSPC / EDQUOT writing the data files or the index. Disables the tier."""


class NvmeUnwritableError(NvmeError):
    """The directory cannot be created or written (read-only filesystem, permissions, a path
    under a regular file). Disables the tier."""


class NvmeIndexFullError(NvmeError):
    """The LMDB index reached ``NvmeConfig.map_bytes``. Disables the tier; raise map_bytes."""


class NvmeIOError(NvmeError):
    """Any other I/O failure (EIO, ...). Disables the tier."""


class NvmeBusyError(NvmeError):
    """Another process holds the directory (its LOCK file is flocked)."""


class NvmeGeometryError(NvmeError):
    """The directory was laid out with a different file_bytes / extent_bytes / alignment."""


class NvmeChecksumError(NvmeError):
    """A layer chunk read back does not match its checksum. The block was dropped from the index
    and its slot freed; the destination buffer holds no valid data. Does not disable the tier."""

    def __init__(self, msg: str, key: bytes | None = None, chunk: int = -1, offset: int = -1) -> None:
        super().__init__(msg)
        self.key, self.chunk, self.offset = key, chunk, offset


class NvmeBatchError(NvmeError):
    """``NvmeBatch.error`` when some keys did not succeed; per-key detail in ``batch.results``
    and ``batch.errors``."""


#: Errors after which the tier disables itself.
DISABLING = (NvmeDiskFullError, NvmeUnwritableError, NvmeIndexFullError, NvmeIOError)


def classify_os_error(e: OSError, what: str) -> NvmeError:
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        cls, hint = NvmeDiskFullError, "disk full"
    elif e.errno in (errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOTDIR, errno.EEXIST):
        cls, hint = NvmeUnwritableError, "directory not writable"
    else:
        cls, hint = NvmeIOError, "I/O error"
    err = cls(f"{hint} {what}: {e.strerror or e} (errno {e.errno})")
    err.__cause__ = e
    return err


def classify_lmdb_error(e: lmdb.Error, what: str, map_bytes: int) -> NvmeError:
    text = str(e)
    if isinstance(e, lmdb.MapFullError):
        err: NvmeError = NvmeIndexFullError(
            f"index full {what}: the LMDB map of {map_bytes} bytes is used up; raise NvmeConfig.map_bytes")
    elif "No space left" in text or "Disk quota" in text:
        err = NvmeDiskFullError(f"disk full {what} (index): {text}")
    elif isinstance(e, lmdb.ReadonlyError) or "Read-only" in text or "Permission denied" in text:
        err = NvmeUnwritableError(f"directory not writable {what} (index): {text}")
    else:
        err = NvmeIOError(f"index error {what}: {text}")
    err.__cause__ = e
    return err


# --- results ----------------------------------------------------------------------------------

class Outcome(enum.Enum):
    """How one key of a batch ended."""

    OK = "ok"                # put: data on disk and index committed; get: read and verified
    PRESENT = "present"      # put: already stored, or being stored by an earlier put; nothing written
    CANCELLED = "cancelled"  # put: deleted while in flight; not stored
    MISSING = "missing"      # get: not in the index (a normal miss); dst untouched
    NO_SPACE = "no_space"    # put: no free slot (back-pressure: delete something and retry)
    CORRUPT = "corrupt"      # get: checksum mismatch; block dropped, slot freed; dst is garbage
    FAILED = "failed"        # I/O or index error (batch.errors); the tier may now be disabled

    @property
    def success(self) -> bool:
        return self in (Outcome.OK, Outcome.PRESENT, Outcome.CANCELLED)


class PutItem(NamedTuple):
    """One block to store. ``src`` (``nbytes`` of data, any contiguous buffer) must not change
    until the batch is done. ``chunk_bytes``: bytes per checksummed chunk (one layer; 0 = one
    checksum for the block). ``parent``: the chain parent's key, or None for a root block.
    ``sums``: the chunks' xxh3-64 when the caller already holds them (recorded when the block
    was first hashed): stored as given instead of hashing ``src`` again, so bytes that changed
    since are caught on the first read, not written under a fresh checksum."""

    ns_id: bytes
    key: bytes
    parent: bytes | None
    chunk_bytes: int
    src: object
    sums: object = None


@dataclass(frozen=True, slots=True)
class NvmeEntry:
    """One committed block, as recovered from the index. Sizes bytes, times Unix seconds."""

    key: bytes
    ns_id: bytes
    parent: bytes | None
    nbytes: int
    chunk_bytes: int
    atime: float
    ctime: float
    slot: int


@dataclass(frozen=True, slots=True)
class RecoveryReport:
    """What opening an existing directory found: ``blocks`` / ``bytes`` recovered, ``dropped``
    index records that could not be trusted (unreadable, overlapping, outside the files)."""

    blocks: int
    bytes: int
    dropped: int
    seconds: float


class NvmeBatch(Transfer):
    """Handle of one batched put or get. ``wait``/``result`` as for :class:`Transfer`.

    When done, ``results[key]`` holds an :class:`Outcome` for every key and ``errors[key]`` the
    error of each FAILED / CORRUPT key. ``error`` is None only if every key
    succeeded (OK, PRESENT, CANCELLED): a get's destination buffer is valid only for a key
    whose outcome is OK. ``nbytes`` is the bytes of the blocks that ended OK.
    NO_SPACE / PRESENT / MISSING outcomes are already set when put_many/get_many returns.
    """

    def __init__(self, op: str, keys: list[bytes], on_done: Callable[["NvmeBatch"], None] | None) -> None:
        super().__init__(0)
        self.op = op
        self.keys = keys
        self.results: dict[bytes, Outcome] = {}
        self.errors: dict[bytes, NvmeError] = {}
        self._on_done = on_done
        self._jobs: list = []
        self._left = 0
        self._mu = threading.Lock()

    def ok_keys(self) -> list[bytes]:
        return [k for k in self.keys if self.results.get(k) is Outcome.OK]

    def digests(self) -> dict:
        """``key -> array('Q')``: the per-chunk xxh3 of every block that ended OK, as written
        (put) or as read back and verified against the index (get). Valid once done."""
        return {j.key: j.sums for j in self._jobs if j.sums is not None and self.results.get(j.key) is Outcome.OK}

    def set(self, key: bytes, outcome: Outcome, error: NvmeError | None = None) -> None:
        self.results[key] = outcome
        if error is not None:
            self.errors[key] = error

    def job_done(self, n: int = 1) -> bool:
        """Count ``n`` jobs finished; True when that was the last of them."""
        with self._mu:
            self._left -= n
            return self._left == 0

    def close(self, nbytes: int) -> None:
        self.nbytes = nbytes
        bad = [k for k in self.keys if not self.results[k].success]
        error = None
        if bad:
            counts: dict[str, int] = {}
            for k in bad:
                counts[self.results[k].value] = counts.get(self.results[k].value, 0) + 1
            first = next((self.errors[k] for k in bad if k in self.errors), None)
            summary = ", ".join(f"{n} {o}" for o, n in sorted(counts.items()))
            error = NvmeBatchError(f"NVMe {self.op}: {len(bad)} of {len(self.keys)} blocks did not succeed "
                                   f"({summary})" + (f"; first error: {first}" if first else ""))
            error.__cause__ = first
        self.finish(error)
        if self._on_done is not None:
            self._on_done(self)
