"""The NVMe tier: blocks by key in preallocated data files, an LMDB index, checksums on every read.

One :class:`NvmeTier` (:mod:`.tier`) built from parts it owns:

- :mod:`.files`: the data files and aligned O_DIRECT I/O between them and a caller's buffer;
- :mod:`.engine`: the worker threads that run block reads and writes (coalesced, checksummed);
- :mod:`.index`: the LMDB index of committed blocks, and recovery from it at start;
- the slot allocator (:class:`kvstore.tiers.base.ExtentAllocator`).

:mod:`.config`, :mod:`.errors` and :mod:`.batch` hold its settings, errors and the types its
batched puts and gets take and report; :mod:`.bench` measures it next to fio.
"""

from kvstore.tiers.nvme.batch import IoResult, NvmeBatch, NvmeEntry, PutItem, RecoveryReport
from kvstore.tiers.nvme.config import NvmeTierConfig, SyncMode
from kvstore.tiers.nvme.errors import (
    NvmeBatchError, NvmeBusyError, NvmeChecksumError, NvmeDisabledError, NvmeDiskFullError, NvmeError,
    NvmeGeometryError, NvmeIndexFullError, NvmeIOError, NvmeUnwritableError)
from kvstore.tiers.nvme.files import IoMode
from kvstore.tiers.nvme.tier import NvmeTier

__all__ = ["NvmeTier", "NvmeTierConfig", "SyncMode", "IoMode", "IoResult", "PutItem", "NvmeBatch", "NvmeEntry",
           "RecoveryReport", "NvmeError", "NvmeBatchError", "NvmeBusyError", "NvmeChecksumError",
           "NvmeDisabledError", "NvmeDiskFullError", "NvmeGeometryError", "NvmeIndexFullError", "NvmeIOError",
           "NvmeUnwritableError"]
