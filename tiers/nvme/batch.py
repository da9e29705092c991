"""What the NVMe tier's batched puts and gets take and report: :class:`PutItem` in,
:class:`NvmeBatch` (an :class:`IoResult` per key) out; :class:`NvmeEntry` and
:class:`RecoveryReport` describe stored blocks and a restart."""

from __future__ import annotations

import enum
from array import array
from dataclasses import dataclass
from typing import Callable, NamedTuple

from kvstore.tiers.base import CopyHandle
from kvstore.tiers.nvme.errors import NvmeBatchError, NvmeError


class IoResult(enum.Enum):
    """How one key of a batched put or get ended."""

    OK = "ok"                # put: data on disk and index committed; get: read and verified
    PRESENT = "present"      # put: already stored, or being stored by an earlier put; nothing written
    CANCELLED = "cancelled"  # put: deleted while in flight; not stored
    MISSING = "missing"      # get: not in the index (a normal miss); dst untouched
    NO_SPACE = "no_space"    # put: no free slot (back-pressure: delete something and retry)
    CORRUPT = "corrupt"      # get: checksum mismatch; block dropped, slot freed; dst is garbage
    FAILED = "failed"        # I/O or index error (batch.errors); the tier may now be disabled

    @property
    def success(self) -> bool:
        return self in (IoResult.OK, IoResult.PRESENT, IoResult.CANCELLED)


class PutItem(NamedTuple):
    """One block to store. ``src`` (``nbytes`` of data, any contiguous buffer) must not change
    until the batch is done. ``chunk_bytes``: bytes per checksummed chunk (one layer; 0 = one
    checksum for the block). ``parent``: the chain parent's key, or None for a root block.
    ``sums``: the chunks' xxh3-64 when the caller already holds them (recorded when the block
    was first hashed): stored as given instead of hashing ``src`` again, so bytes that changed
    since are caught on the first read, not written under a fresh checksum. ``dtype``: the
    block's element type (a :class:`kvstore.layout.DType` or its label); with the tier's codec
    on, a block of a type it codes is stored encoded. None: stored raw. ``lossy``: store it
    quantized (whatever the codec setting); it then reads back as the dequantized values, its
    checksums taken over those."""

    ns_id: bytes
    key: bytes
    parent: bytes | None
    chunk_bytes: int
    src: object
    sums: object = None
    dtype: object = None
    lossy: str = ""  # "int8" / "fp8": the block's namespace opted into kvstore.lossy (needs dtype)


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
    codec: int = 0   # how the slot holds it (kvstore.codec.Codec; 0 = raw)
    stored: int = 0  # bytes in the slot (the payload when encoded, else nbytes)


@dataclass(frozen=True, slots=True)
class RecoveryReport:
    """What opening an existing directory found: ``blocks`` / ``bytes`` recovered, ``dropped``
    index records that could not be trusted (unreadable, overlapping, outside the files)."""

    blocks: int
    bytes: int
    dropped: int
    seconds: float


class NvmeBatch(CopyHandle):
    """Handle of one batched put or get. ``wait``/``result`` as for :class:`CopyHandle`.

    When done, ``results[key]`` holds an :class:`IoResult` for every key and ``errors[key]`` the
    error of each FAILED / CORRUPT key. ``error`` is None only if every key
    succeeded (OK, PRESENT, CANCELLED): a get's destination buffer is valid only for a key
    whose result is OK. ``nbytes`` is the bytes of the blocks that ended OK.
    PRESENT / MISSING results are already set when put_many/get_many returns, and so is
    NO_SPACE for a block stored raw (an encoded one gets its slot once encoded).
    The tier fills the batch (:meth:`set`, :meth:`finish_batch`); callers only read it.
    """

    def __init__(self, op: str, keys: list[bytes], on_done: Callable[["NvmeBatch"], None] | None) -> None:
        super().__init__(0)
        self.op = op
        self.keys = keys
        self.results: dict[bytes, IoResult] = {}
        self.errors: dict[bytes, NvmeError] = {}
        self._on_done = on_done
        self._digests: dict[bytes, array] = {}

    def ok_keys(self) -> list[bytes]:
        return [k for k in self.keys if self.results.get(k) is IoResult.OK]

    def digests(self) -> dict[bytes, array]:
        """``key -> array('Q')``: the per-chunk xxh3 of every block that ended OK, as written
        (put) or as read back and verified against the index (get). Valid once done."""
        return self._digests

    def set(self, key: bytes, result: IoResult, error: NvmeError | None = None) -> None:
        self.results[key] = result
        if error is not None:
            self.errors[key] = error

    def finish_batch(self, nbytes: int, digests: dict[bytes, array] | None = None) -> None:
        """Complete the batch (every key has its result), then run ``on_done``."""
        self.nbytes = nbytes
        self._digests = digests or {}
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
