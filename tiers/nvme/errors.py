"""Errors of the NVMe tier, and how OS and LMDB errors map onto them."""

from __future__ import annotations

import errno

import lmdb

from kvstore.tiers.base import TierError


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
    """The LMDB index reached ``NvmeTierConfig.map_bytes``. Disables the tier; raise map_bytes."""


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
            f"index full {what}: the LMDB map of {map_bytes} bytes is used up; raise NvmeTierConfig.map_bytes")
    elif "No space left" in text or "Disk quota" in text:
        err = NvmeDiskFullError(f"disk full {what} (index): {text}")
    elif isinstance(e, lmdb.ReadonlyError) or "Read-only" in text or "Permission denied" in text:
        err = NvmeUnwritableError(f"directory not writable {what} (index): {text}")
    else:
        err = NvmeIOError(f"index error {what}: {text}")
    err.__cause__ = e
    return err
