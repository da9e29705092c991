"""Lossless block codecs: fewer bytes for the same KV, bit-exact when read back.

KV elements are floats, so their bytes are not alike: in bf16 the high byte (sign, 7 exponent
bits, 1 mantissa bit) takes a few dozen values across a block, and the low byte (7 mantissa
bits) is close to random (measured on a trained model's KV: docs/compression.md). Two codecs
use that:

- :data:`Codec.NIBBLE` (C, :file:`kvstore/_kvcodec.c`): each element's top bits (sign and
  exponent) get a 4-bit code from the block's 15 most frequent values, or an escape; the low
  bits are kept as they are. bf16 1.33x at 1.5 GB/s encode and 2.7-3.9 GB/s decode per core.
  It needs the shared library ``scripts/build_kvcodec.sh`` builds; without it, blocks are
  encoded with :data:`Codec.PLANES_ZSTD` and NIBBLE payloads still decode (numpy, slower).
- :data:`Codec.PLANES_ZSTD`: byte planes (byte ``i`` of every element, then byte ``i + 1``),
  each zstd-compressed where that saves at least 1/64, else kept raw. Better ratios (bf16
  1.47x, fp8 1.19x), a fifth of NIBBLE's speed.

A block whose encoding saves less than :data:`MIN_SAVING` is not encoded (:func:`encode`
returns None): it is stored raw. Checksums stay over the raw bytes, checked after each decode,
so a corrupt payload fails exactly as a corrupt raw block does. Both codecs release the GIL
(ctypes calls, numpy's copies, zstd's calls).

Payload of :data:`Codec.PLANES_ZSTD`: ``b"KVZ1"``, the typesize (1 byte), then per plane a
flag byte (1 = zstd, 0 = raw) and the plane's stored length (uint32 LE), then the planes. Of
:data:`Codec.NIBBLE`: see :file:`kvstore/_kvcodec.c`. Each payload names its codec by its magic.
"""

from __future__ import annotations

import ctypes
import enum
import functools
import struct
import threading
from pathlib import Path

import numpy as np

from kvstore import lossy
from kvstore.layout import DType

MAGIC = b"KVZ1"
NIBBLE_MAGIC = b"KVN1"
# Bits of an element's top (sign and exponent) that NIBBLE codes, per KV dtype.
PREFIX_BITS = {DType.BF16: 8, DType.FP32: 8, DType.FP16: 6, DType.FP8_E4M3: 5, DType.FP8_E5M2: 6}
# Where NIBBLE is the codec to use (its ratio within reach of PLANES_ZSTD's at five times the
# speed); the other dtypes take PLANES_ZSTD's better ratio (docs/compression.md).
NIBBLE_FIRST = frozenset({DType.BF16, DType.FP32})
MIN_SAVING = 1 / 64  # encode only what saves at least this fraction of the block
_PLANE = struct.Struct("<BI")


class CodecError(ValueError):
    """A payload that is not a valid encoding of a block of the expected size."""


class Codec(enum.IntEnum):
    """How a stored block's bytes are encoded (recorded with the block, e.g. in the NVMe index)."""

    RAW = 0
    PLANES_ZSTD = 1
    NIBBLE = 2
    INT8 = 3  # lossy (kvstore.lossy), for namespaces that opted in only
    FP8 = 4   # lossy (kvstore.lossy)

    @classmethod
    def parse(cls, text: str) -> "Codec":
        names = {"raw": cls.RAW, "off": cls.RAW, "none": cls.RAW, "planes-zstd": cls.PLANES_ZSTD,
                 "nibble": cls.NIBBLE}
        try:
            return names[str(text).strip().lower()]
        except KeyError:
            raise ValueError(f"codec: expected one of {', '.join(sorted(names))}, got {text!r}") from None


_local = threading.local()


def _zstd(level: int):
    """This thread's zstd compressor and decompressor (neither is safe to share between threads)."""
    import zstandard

    mine = getattr(_local, "zstd", None)
    if mine is None or mine[0] != level:
        mine = _local.zstd = (level, zstandard.ZstdCompressor(level=level), zstandard.ZstdDecompressor())
    return mine[1], mine[2]


@functools.cache
def native():
    """The C codec (``kvstore/_kvcodec.so``), or None where it was not built."""
    path = Path(__file__).with_name("_kvcodec.so")
    if not path.exists():
        return None
    lib = ctypes.CDLL(str(path))
    lib.kvn_encode.restype = ctypes.c_size_t
    lib.kvn_encode.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_void_p,
                               ctypes.c_size_t, ctypes.c_size_t]
    lib.kvn_decode.restype = ctypes.c_int
    lib.kvn_decode.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t]
    return lib


def encode(src: np.ndarray, dtype: DType | str, codec: Codec | None = None, level: int = 1) -> bytes | None:
    """``src`` (uint8, one block of ``dtype`` elements) encoded, or None when that would not save
    :data:`MIN_SAVING` of it. ``codec``: NIBBLE or PLANES_ZSTD; by default NIBBLE for the dtypes
    of :data:`NIBBLE_FIRST` where the C codec is built, else PLANES_ZSTD."""
    dtype = dtype if isinstance(dtype, DType) else DType.parse(dtype)
    raw = np.ascontiguousarray(src).reshape(-1).view(np.uint8)
    if codec is None:
        codec = Codec.NIBBLE if dtype in NIBBLE_FIRST and native() is not None else Codec.PLANES_ZSTD
    if codec is Codec.NIBBLE:
        return _encode_nibble(raw, dtype)
    if codec is not Codec.PLANES_ZSTD:
        raise ValueError(f"codec: {codec.name} does not encode")
    return _encode_planes(raw, max(1, dtype.bits // 8), level)


def _encode_nibble(raw: np.ndarray, dtype: DType) -> bytes | None:
    out = np.empty(raw.nbytes, np.uint8)
    n = _nibble_into(raw, dtype, out)
    return out[:n].tobytes() if n else None


def _nibble_into(raw: np.ndarray, dtype: DType, out: np.ndarray) -> int:
    lib = native()
    if lib is None:
        raise ValueError("codec: nibble needs the C codec (scripts/build_kvcodec.sh)")
    if dtype not in PREFIX_BITS:
        raise ValueError(f"codec: nibble does not code {dtype.label} elements")
    ts = dtype.bits // 8
    if raw.nbytes % ts:
        raise ValueError(f"typesize: {ts} does not divide a block of {raw.nbytes} bytes")
    return lib.kvn_encode(raw.ctypes.data, raw.nbytes // ts, ts, PREFIX_BITS[dtype], out.ctypes.data, out.nbytes,
                          int(raw.nbytes * (1 - MIN_SAVING)))


def encode_into(src: np.ndarray, dtype: DType | str, out: np.ndarray, codec: Codec | None = None) -> int:
    """:func:`encode` into ``out`` (uint8, writable): the payload's length, or 0 when the block
    is better stored raw (it would not save :data:`MIN_SAVING`, or the payload does not fit
    ``out``; a buffer of the block's size always fits a payload worth storing). NIBBLE writes
    straight into ``out``; PLANES_ZSTD copies its payload there."""
    dtype = dtype if isinstance(dtype, DType) else DType.parse(dtype)
    raw = np.ascontiguousarray(src).reshape(-1).view(np.uint8)
    if codec is None:
        codec = Codec.NIBBLE if dtype in NIBBLE_FIRST and native() is not None else Codec.PLANES_ZSTD
    if codec is Codec.NIBBLE:
        return _nibble_into(raw, dtype, out)
    payload = encode(raw, dtype, codec)
    if payload is None or len(payload) > out.nbytes:
        return 0
    out[:len(payload)] = np.frombuffer(payload, np.uint8)
    return len(payload)


def fast_codec(dtype) -> Codec | None:
    """The codec for blocks of ``dtype`` (a DType or its label) on a hot path (the NVMe tier's
    ``auto``, the wire): NIBBLE for bf16, fp32 and fp8 where the C codec is built (1.1-1.33x at
    about 1.2 GB/s encode and 3.3-3.8 GB/s decode per core); None for the rest (stored or sent
    raw)."""
    try:
        dt = dtype if isinstance(dtype, DType) else DType.parse(dtype)
    except ValueError:
        return None
    if native() is None or dt not in PREFIX_BITS or not (dt in NIBBLE_FIRST or dt.bits == 8):
        return None
    return Codec.NIBBLE


class ChunkEncoder:
    """Encodes a transfer's chunks (what :meth:`kvstore.transport.Sender.open` takes): a call
    returns the payload of ``codec`` for a buffer of ``dtype`` elements, or None where the chunk
    does not shrink (it then travels raw)."""

    def __init__(self, codec: Codec, dtype) -> None:
        self.codec = int(codec)
        self._codec, self._dtype = codec, dtype

    def __call__(self, buf) -> bytes | None:
        return encode(np.frombuffer(buf, np.uint8), self._dtype, self._codec)


def decode_buffer(payload, dst) -> None:
    """:func:`decode` into any writable buffer (a transport's destination memoryview)."""
    decode(payload, np.frombuffer(dst, np.uint8))


def codec_of(payload) -> Codec:
    """The codec a payload names by its magic (RAW for none)."""
    mv = memoryview(payload)
    head = bytes(mv[:4])
    if head == lossy.MAGIC:
        return Codec.INT8 if mv[4] == lossy.KINDS["int8"] else Codec.FP8
    return Codec.NIBBLE if head == NIBBLE_MAGIC else Codec.PLANES_ZSTD if head == MAGIC else Codec.RAW


def _encode_planes(raw: np.ndarray, typesize: int, level: int) -> bytes | None:
    if typesize not in (1, 2, 4) or raw.nbytes % typesize:
        raise ValueError(f"typesize: {typesize} does not divide a block of {raw.nbytes} bytes into 1-, 2- or 4-byte elements")
    comp, _ = _zstd(level)
    planes = raw.reshape(-1, typesize).T  # [typesize, elements]: plane i is byte i of every element
    heads, bodies = [MAGIC, bytes([typesize])], []
    for i in range(typesize):
        plane = np.ascontiguousarray(planes[i])
        packed = comp.compress(plane)
        if len(packed) <= plane.nbytes * (1 - MIN_SAVING):
            heads.append(_PLANE.pack(1, len(packed)))
            bodies.append(packed)
        else:
            heads.append(_PLANE.pack(0, plane.nbytes))
            bodies.append(plane)
    size = sum(map(len, heads)) + sum(len(b) if isinstance(b, bytes) else b.nbytes for b in bodies)
    if size > raw.nbytes * (1 - MIN_SAVING):
        return None
    return b"".join(heads + [b if isinstance(b, bytes) else b.data for b in bodies])


def decode(payload, dst: np.ndarray) -> None:
    """Decode ``payload`` (:func:`encode`'s, either codec) into ``dst`` (uint8, the block's raw
    size). Raises :class:`CodecError` when the payload is not a valid encoding of a block of
    that size."""
    out = dst.reshape(-1).view(np.uint8)
    mv = memoryview(payload)
    if bytes(mv[:4]) == NIBBLE_MAGIC:
        return _decode_nibble(mv, out)
    if bytes(mv[:4]) == lossy.MAGIC:
        try:
            return lossy.dequantize(mv, out)
        except lossy.LossyError as e:
            raise CodecError(str(e)) from None
    if len(mv) < 5 or bytes(mv[:4]) != MAGIC:
        raise CodecError("not a kvstore codec payload (bad magic)")
    typesize = mv[4]
    if typesize not in (1, 2, 4) or out.nbytes % typesize:
        raise CodecError(f"typesize {typesize} does not fit a block of {out.nbytes} bytes")
    n = out.nbytes // typesize
    pos = 5 + typesize * _PLANE.size
    if len(mv) < pos:
        raise CodecError("truncated plane table")
    _, dec = _zstd(1)
    planes = out.reshape(n, typesize)
    for i in range(typesize):
        flag, length = _PLANE.unpack_from(mv, 5 + i * _PLANE.size)
        body = mv[pos:pos + length]
        if len(body) != length:
            raise CodecError(f"plane {i}: {length} bytes announced, {len(body)} present")
        pos += length
        if flag == 0:
            if length != n:
                raise CodecError(f"plane {i}: raw plane of {length} bytes, expected {n}")
            plane = np.frombuffer(body, np.uint8)
        elif flag == 1:
            try:
                plane = np.frombuffer(dec.decompress(body, max_output_size=n), np.uint8)
            except Exception as e:  # zstd.ZstdError: corrupt frame
                raise CodecError(f"plane {i}: {e}") from None
            if plane.size != n:
                raise CodecError(f"plane {i}: decodes to {plane.size} bytes, expected {n}")
        else:
            raise CodecError(f"plane {i}: unknown flag {flag}")
        if typesize == 1:
            out[:] = plane
        else:
            planes[:, i] = plane
    if pos != len(mv):
        raise CodecError(f"{len(mv) - pos} trailing bytes")


_NIBBLE_ERRORS = {-1: "bad magic", -2: "bad header", -3: "does not fit", -4: "length does not match",
                  -6: "escape count does not match", -7: "a prefix wider than its bits"}
_HEAD, _DICT, _ESC = 32, 15, 15


def _decode_nibble(mv: memoryview, out: np.ndarray) -> None:
    lib = native()
    if lib is not None:
        src = np.frombuffer(mv, np.uint8)
        rc = lib.kvn_decode(src.ctypes.data, src.nbytes, out.ctypes.data, out.nbytes)
        if rc:
            raise CodecError(f"nibble payload: {_NIBBLE_ERRORS.get(rc, rc)}")
        return
    _decode_nibble_numpy(np.frombuffer(mv, np.uint8), out)


def _decode_nibble_numpy(src: np.ndarray, out: np.ndarray) -> None:
    """:func:`_decode_nibble` without the C codec (a daemon built without it reads what one
    built with it stored): the same checks, in numpy."""
    if src.nbytes < _HEAD + _DICT or bytes(src[:4]) != NIBBLE_MAGIC:
        raise CodecError("nibble payload: bad magic")
    ts, pbits, nd = int(src[4]), int(src[5]), int(src[6])
    n, esc = (int(x) for x in src[8:16].view("<u4"))
    if ts not in (1, 2, 4) or not 1 <= pbits <= 8 or nd > _DICT:
        raise CodecError("nibble payload: bad header")
    if n * ts != out.nbytes or esc > n:
        raise CodecError("nibble payload: does not fit")
    q = ts * 8 - pbits
    suffix = n * (ts - 1) if pbits == 8 else (n * q + 7) // 8
    codes_end = _HEAD + _DICT + (n + 1) // 2
    if codes_end + suffix + esc != src.nbytes:
        raise CodecError("nibble payload: length does not match")
    dictionary = np.zeros(16, np.uint32)
    dictionary[:_DICT] = src[_HEAD:_HEAD + _DICT]
    if pbits < 8 and (dictionary >> pbits).any():  # every entry, used or not, as the C decoder checks
        raise CodecError("nibble payload: a prefix wider than its bits")
    packed = src[_HEAD + _DICT:codes_end]
    codes = np.empty(2 * packed.size, np.uint8)
    codes[0::2], codes[1::2] = packed & 15, packed >> 4
    codes = codes[:n]
    prefix = dictionary[codes]
    escaped = codes == _ESC
    if int(escaped.sum()) != esc:
        raise CodecError("nibble payload: escape count does not match")
    prefix[escaped] = src[codes_end + suffix:]
    if pbits < 8 and (prefix >> pbits).any():
        raise CodecError("nibble payload: a prefix wider than its bits")
    low = src[codes_end:codes_end + suffix]
    if pbits == 8:
        elems = out.reshape(n, ts)
        elems[:, :ts - 1] = low.reshape(n, ts - 1)
        elems[:, ts - 1] = prefix
        return
    bits = np.unpackbits(low, bitorder="little")[:n * q].reshape(n, q).astype(np.uint32)
    value = (bits << np.arange(q, dtype=np.uint32)).sum(axis=1, dtype=np.uint32) | (prefix << q)
    out[:] = value.astype("<u4").view(np.uint8).reshape(n, 4)[:, :ts].reshape(-1)


__all__ = ["ChunkEncoder", "Codec", "CodecError", "MIN_SAVING", "NIBBLE_FIRST", "PREFIX_BITS", "codec_of", "decode", "decode_buffer", "encode",
           "encode_into", "fast_codec", "native"]
