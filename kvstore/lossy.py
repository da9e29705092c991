"""Lossy block codecs, for namespaces that opt in (``Namespace.kv_codec``): bf16, fp16 or fp32
KV stored as 8-bit codes with one scale per group of :data:`GROUP` elements.

- ``int8``: ``round(x / s)`` with ``s = absmax / 127`` of the group.
- ``fp8``: e4m3 (4 exponent bits, 3 mantissa bits, at most 448) of ``x / s`` with
  ``s = absmax / 448``, rounded to the nearest e4m3 value.

Read back, a block holds the dequantized values in its own dtype (bf16 rounded to nearest
even), so the engine gets a block of the layout it registered. The element error this costs on
a trained model's KV is in docs/compression.md (``kvstore bench codec``). Payload: ``b"KVQ1"``,
the kind (1 int8, 2 fp8), the element type (2 bf16, 3 fp16, 4 fp32), 2 bytes of zero, the
element count (uint32 LE), then one float32 scale per group, then one code byte per element.
Encoding and decoding run in numpy (which releases the GIL in its loops).
"""

from __future__ import annotations

import struct

import numpy as np

MAGIC = b"KVQ1"
GROUP = 64  # elements per scale: 4 bytes of scale per 64 bytes of codes (a bf16 block: 1.88x)
KINDS = {"int8": 1, "fp8": 2}
_TYPES = {"bf16": 2, "fp16": 3, "fp32": 4}
_HEAD = struct.Struct("<4sBBHI")


class LossyError(ValueError):
    """A payload that is not a valid lossy encoding of a block of the expected size."""


def _e4m3_values() -> np.ndarray:
    """The 127 non-negative finite e4m3 values, ascending (code = index)."""
    v = []
    for code in range(127):
        e, m = code >> 3, code & 7
        v.append(m / 8 * 2.0 ** -6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))
    return np.array(v, np.float32)


_E4M3 = _e4m3_values()
_E4M3_SIGNED = np.concatenate([_E4M3, [0], -_E4M3, [0]]).astype(np.float32)  # by code; 127, 255: NaN (refused)


def _e4m3_codes(y: np.ndarray) -> np.ndarray:
    """The e4m3 codes of ``y`` (|y| <= 448), rounded to nearest (ties to even steps). A value
    in binade ``2^E`` (subnormal below ``2^-6``) is ``q`` steps of ``2^(max(E, -6) - 3)``; its
    code is ``q + 8 * (max(E, -6) + 6)``, which also holds when rounding carries ``q`` to the
    next binade."""
    a = np.abs(y).astype(np.float32)
    big = np.maximum((a.view(np.uint32) >> 23).astype(np.int32) - 127, -6)  # float32 exponent bits
    q = np.rint(a * ((130 - big).astype(np.uint32) << 23).view(np.float32))  # a * 2^(3 - big)
    codes = np.minimum(q + 8 * (big + 6), 126).astype(np.uint8)
    return codes | (np.signbit(y).astype(np.uint8) << 7)


def _as_float(raw: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "bf16":
        return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    if dtype == "fp16":
        return raw.view(np.float16).astype(np.float32)
    return raw.view(np.float32)


def _from_float(x: np.ndarray, dtype: str, out: np.ndarray) -> None:
    if dtype == "bf16":
        u = x.view(np.uint32)
        out.view(np.uint16)[:] = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)  # nearest even
    elif dtype == "fp16":
        out.view(np.float16)[:] = x.astype(np.float16)
    else:
        out.view(np.float32)[:] = x


def dtype_label(dtype) -> str:
    """``bf16``, ``fp16`` or ``fp32`` for a DType or its label; ValueError for any other type."""
    label = getattr(dtype, "label", dtype)
    if label not in _TYPES:
        raise ValueError(f"lossy codecs take bf16, fp16 or fp32 KV, not {label}")
    return label


def quantize(src: np.ndarray, dtype, kind: str) -> bytes:
    """``src`` (uint8, one block of ``dtype`` elements) as a ``kind`` (int8 or fp8) payload."""
    dt = dtype_label(dtype)
    if kind not in KINDS:
        raise ValueError(f"kv_codec: expected one of {', '.join(KINDS)}, got {kind!r}")
    x = _as_float(np.ascontiguousarray(src).reshape(-1).view(np.uint8), dt)
    n = x.size
    groups = -(-n // GROUP)
    padded = np.zeros(groups * GROUP, np.float32)
    padded[:n] = np.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0)  # KV holds no NaN; never code one
    g = padded.reshape(groups, GROUP)
    absmax = np.abs(g).max(axis=1)
    top = 127.0 if kind == "int8" else 448.0
    scale = np.where(absmax > 0, absmax / top, 1.0).astype(np.float32)
    y = g / scale[:, None]
    if kind == "int8":
        codes = np.clip(np.rint(y), -127, 127).astype(np.int8).view(np.uint8)
    else:
        codes = _e4m3_codes(y)
    return b"".join((_HEAD.pack(MAGIC, KINDS[kind], _TYPES[dt], 0, n), scale.tobytes(),
                     codes.reshape(-1)[:n].tobytes()))


def dequantize(payload, dst: np.ndarray) -> None:
    """Decode ``payload`` into ``dst`` (uint8, the block's raw size). Raises LossyError when it
    is not a lossy payload of a block of that size."""
    mv = memoryview(payload)
    if len(mv) < _HEAD.size:
        raise LossyError("lossy payload: truncated")
    magic, kind, t, _, n = _HEAD.unpack_from(mv)
    types = {v: k for k, v in _TYPES.items()}
    if magic != MAGIC or kind not in KINDS.values() or t not in types:
        raise LossyError("lossy payload: bad header")
    dt = types[t]
    out = dst.reshape(-1).view(np.uint8)
    size = {"bf16": 2, "fp16": 2, "fp32": 4}[dt]
    groups = -(-n // GROUP)
    if n * size != out.nbytes or len(mv) != _HEAD.size + 4 * groups + n:
        raise LossyError(f"lossy payload: {len(mv)} bytes do not hold {n} elements for a block of {out.nbytes} bytes")
    scale = np.frombuffer(mv, np.float32, groups, _HEAD.size)
    codes = np.zeros(groups * GROUP, np.uint8)
    codes[:n] = np.frombuffer(mv, np.uint8, n, _HEAD.size + 4 * groups)
    if kind == KINDS["int8"]:
        y = codes.view(np.int8).astype(np.float32)
    else:
        if ((codes & 127) == 127).any():
            raise LossyError("lossy payload: an fp8 code of NaN")
        y = _E4M3_SIGNED[codes]
    x = (y.reshape(groups, GROUP) * scale[:, None]).reshape(-1)[:n].astype(np.float32)
    _from_float(x, dt, out)


def error_stats(raw: np.ndarray, dtype, kind: str) -> dict:
    """What ``kind`` does to ``raw`` (one block, uint8): the payload's ratio, and the element
    error against the original values: RMS over the values' RMS, largest error over the
    block's largest value, and the signal-to-noise ratio in dB."""
    dt = dtype_label(dtype)
    payload = quantize(raw, dt, kind)
    back = np.empty_like(np.ascontiguousarray(raw).reshape(-1).view(np.uint8))
    dequantize(payload, back)
    x, y = _as_float(raw.reshape(-1).view(np.uint8), dt).astype(np.float64), _as_float(back, dt).astype(np.float64)
    err = y - x
    rms = float(np.sqrt(np.mean(x * x)))
    return {"ratio": raw.nbytes / len(payload), "rel_rms_error": float(np.sqrt(np.mean(err * err))) / rms,
            "max_abs_error_rel": float(np.abs(err).max() / np.abs(x).max()),
            "snr_db": float(10 * np.log10(np.mean(x * x) / max(np.mean(err * err), 1e-30)))}


__all__ = ["GROUP", "KINDS", "LossyError", "dequantize", "dtype_label", "error_stats", "quantize"]
