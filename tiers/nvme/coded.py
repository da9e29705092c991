"""Blocks the NVMe tier stores encoded (:mod:`kvstore.codec`), and the room they take.

A block is encoded when the tier's codec is on and the put names the block's element type
(``PutItem.dtype``). Its slot is then sized by the payload, not by the block: the payload's
length rounded up to a *size class*, a multiple of 1/32 of the block (at least one ALIGN unit).
The slot allocator keeps slots of one size per extent, so each class of a namespace takes
extents of its own, and space freed in one class serves that class until its extent is empty
and goes back to the shared pool. A block whose class would not be smaller than its raw slot is
stored raw, as before.

Fragmentation: a block whose class has no free slot and no free extent left takes the smallest
free slot of a larger class of its namespace (up to a raw block's slot) before the tier reports
it full (:meth:`~kvstore.tiers.base.ExtentAllocator.allocate_fit`), so no extent of the
namespace is left with free slots while its blocks are refused. What stays unused is the
difference between a block's class and the slot it took, and free slots of other namespaces'
extents. The extents of classes nobody writes any more empty as their blocks are evicted (least
recent first, and the blocks of one extent were written together), so there is no compaction
pass; :func:`size_class` keeps the number of classes small (a few in practice, since a
namespace's blocks compress alike).

Thread-safety: :class:`BlockCoder` is stateless past construction (the codecs keep their state
per thread); :class:`CodecUse` is guarded by the tier's lock.
"""

from __future__ import annotations

import numpy as np

from kvstore import lossy
from kvstore.codec import PREFIX_BITS, Codec, CodecError, encode_into, fast_codec, native
from kvstore.layout import DType, LayoutError
from kvstore.tiers.nvme.errors import NvmeError
from kvstore.tiers.nvme.files import ALIGN, aligned_buffer, chunk_sums, round_up

CLASSES = 32  # size classes are multiples of 1/CLASSES of the block
SETTINGS = ("off", "auto", "nibble", "planes-zstd")


def size_class(raw_bytes: int, payload_bytes: int) -> int:
    """The slot size of a ``payload_bytes`` payload of a ``raw_bytes`` block: the payload
    rounded up to whole ALIGN units of at least 1/:data:`CLASSES` of the block; 0 when that would
    not be smaller than the raw block's slot (the block is then stored raw)."""
    if payload_bytes <= 0:
        return 0
    g = round_up(-(-raw_bytes // CLASSES))
    cls = -(-payload_bytes // g) * g
    return cls if cls < round_up(raw_bytes) else 0


class BlockCoder:
    """The NVMe tier's codec setting: ``off``; ``nibble`` or ``planes-zstd`` for every element
    type that codec codes; ``auto``: nibble where the C codec is built and codes the type (the
    fast one: the tier encodes on its I/O threads, on the demotion path), else raw.

    Raises ValueError for an unknown setting, and for ``nibble`` where the C codec is not built.
    """

    def __init__(self, setting: str = "off") -> None:
        setting = str(setting).strip().lower()
        if setting not in SETTINGS:
            raise ValueError(f"codec: expected one of {', '.join(SETTINGS)}, got {setting!r}")
        if setting == "nibble" and native() is None:
            raise ValueError("codec: nibble needs the C codec, which is not built here (make codec, or "
                             "scripts/build_kvcodec.sh); use planes-zstd, auto or off")
        self.setting = setting

    @property
    def on(self) -> bool:
        return self.setting != "off"

    def codec_for(self, dtype) -> Codec | None:
        """The codec a block of ``dtype`` elements (a DType or its label) is encoded with, or
        None (stored raw)."""
        if not self.on or dtype is None:
            return None
        try:
            dt = dtype if isinstance(dtype, DType) else DType.parse(dtype)
        except (LayoutError, ValueError):
            return None
        if self.setting == "planes-zstd":
            return Codec.PLANES_ZSTD if dt.bits % 8 == 0 and dt.bits // 8 in (1, 2, 4) else None
        if self.setting == "auto":
            return fast_codec(dt)
        return Codec.NIBBLE if dt in PREFIX_BITS and native() is not None else None

    @staticmethod
    def check_lossy(kind: str, dtype, nbytes: int) -> None:
        """ValueError unless ``kind`` quantizes blocks of ``dtype`` (a put's validation)."""
        if kind not in lossy.KINDS:
            raise ValueError(f"lossy: expected one of {', '.join(lossy.KINDS)}, got {kind!r}")
        size = {"bf16": 2, "fp16": 2, "fp32": 4}[lossy.dtype_label(dtype)]
        if nbytes % size:
            raise ValueError(f"lossy: a block of {nbytes} bytes is not whole {lossy.dtype_label(dtype)} elements")

    def _quantize(self, job, bounce: np.ndarray) -> np.ndarray:
        """A lossy namespace's block: quantized, its checksums taken over what it decodes to
        (what every later read checks), its slot sized by the payload."""
        # Bytes that changed since their checksums were recorded keep those checksums, which
        # what they decode to will not match: the first read finds the block corrupt, as it would
        # a raw one (quantized under fresh checksums, the change would be served).
        stale = job.sums is not None and chunk_sums(job.buf, job.nbytes, job.chunk_bytes) != job.sums
        payload = lossy.quantize(job.buf[:job.nbytes], job.dtype, job.lossy)
        n = len(payload)
        out = bounce if round_up(job.nbytes) <= bounce.nbytes else aligned_buffer(job.nbytes)
        back = out[:job.nbytes]
        lossy.dequantize(payload, back)
        if not stale:
            job.sums = chunk_sums(back, job.nbytes, job.chunk_bytes)
        out[:n] = np.frombuffer(payload, np.uint8)
        job.codec = int(Codec.INT8 if job.lossy == "int8" else Codec.FP8)
        job.stored, job.slot_bytes = n, size_class(job.nbytes, n) or round_up(n)
        padded = round_up(n)
        out[n:padded] = 0
        return out[:padded]

    def encode(self, job, bounce: np.ndarray) -> np.ndarray | None:
        """:meth:`encode_block`, never failing the tier: a lossless encode that fails leaves the
        block raw; a lossy one fails that block alone (NvmeError, which disables nothing)."""
        try:
            return self.encode_block(job, bounce)
        except NvmeError:
            raise
        except Exception as e:  # noqa: BLE001 - numpy, zstd, memory: this block only
            if job.lossy:
                raise NvmeError(f"NVMe block {job.key.hex()[:16]}: quantizing it failed ({e!r}); not stored") from e
            job.codec, job.stored, job.slot_bytes = 0, job.nbytes, job.nbytes
            return None

    def encode_block(self, job, bounce: np.ndarray) -> np.ndarray | None:
        """Encode ``job``'s block (an :class:`~.engine.Job` of a put; its checksums are taken
        over the raw bytes first, if the caller gave none) into ``bounce`` (or a buffer of its
        own when the block is larger) and size its slot. Returns the payload padded with zeros
        to whole ALIGN units and sets ``job.codec``, ``job.stored`` and ``job.slot_bytes``; or
        returns None, with the job left raw, when the block does not shrink by a size class."""
        if job.lossy:
            return self._quantize(job, bounce)
        raw = job.buf[:job.nbytes]
        if job.sums is None:
            job.sums = chunk_sums(job.buf, job.nbytes, job.chunk_bytes)
        codec = self.codec_for(job.dtype)
        if codec is None:
            return None
        out = bounce if round_up(job.nbytes) <= bounce.nbytes else aligned_buffer(job.nbytes)
        try:
            n = encode_into(raw, job.dtype, out[:job.nbytes], codec)
        except (CodecError, ValueError):  # a block its element type does not divide: raw
            return None
        cls = size_class(job.nbytes, n)
        if not cls:
            return None
        job.codec, job.stored, job.slot_bytes = int(codec), n, cls
        padded = round_up(n)
        out[n:padded] = 0
        return out[:padded]


class CodecUse:
    """Per namespace: blocks stored, their raw bytes, the bytes stored (payloads, or the raw
    block) and the slot bytes they take; what ``stats()`` reports as the achieved ratios."""

    def __init__(self, stride) -> None:
        self._stride = stride  # the allocator's slot_stride
        self.by_ns: dict[bytes, list[int]] = {}

    def add(self, ns_id: bytes, nbytes: int, stored: int, slot_bytes: int, sign: int = 1) -> None:
        u = self.by_ns.setdefault(ns_id, [0, 0, 0, 0])
        u[0] += sign
        u[1] += sign * nbytes
        u[2] += sign * stored
        u[3] += sign * self._stride(slot_bytes)
        if not u[0]:
            del self.by_ns[ns_id]

    def remove(self, ns_id: bytes, nbytes: int, stored: int, slot_bytes: int) -> None:
        self.add(ns_id, nbytes, stored, slot_bytes, -1)

    def report(self) -> dict:
        """``{ns hex: {blocks, raw_bytes, stored_bytes, slot_bytes, ratio}}``; ``ratio`` is raw
        bytes over slot bytes, the capacity the codec gives (a raw tier's is its blocks over
        their ALIGN-rounded slots, about 1)."""
        return {ns.hex(): {"blocks": b, "raw_bytes": r, "stored_bytes": s, "slot_bytes": sl,
                           "ratio": round(r / sl, 4) if sl else 0.0}
                for ns, (b, r, s, sl) in sorted(self.by_ns.items())}


__all__ = ["ALIGN", "BlockCoder", "CLASSES", "CodecUse", "SETTINGS", "size_class"]
