"""What the NVMe tier tests share: keys, block contents, a small config, put/get helpers for
a small tier."""

from __future__ import annotations

import hashlib

import numpy as np

from kvstore.tiers.nvme import NvmeTierConfig

KiB, MiB = 1 << 10, 1 << 20
NS = hashlib.sha256(b"ns-1").digest()
NS2 = hashlib.sha256(b"ns-2").digest()
BLOCK = 64 * KiB
CHUNK = 8 * KiB  # 8 "layers" per block


def key(i: int, ns: bytes = NS) -> bytes:
    return hashlib.sha256(ns + i.to_bytes(8, "little")).digest()


def data(i: int, nbytes: int = BLOCK) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, nbytes, dtype=np.uint8)


def cfg(path, **kw) -> NvmeTierConfig:
    base = dict(dir=str(path), capacity_bytes=4 * MiB, file_bytes=2 * MiB, extent_bytes=512 * KiB,
                io_threads=4, bounce_bytes=64 * KiB, atime_flush_s=3600.0)
    base.update(kw)
    return NvmeTierConfig(**base)


def put(tier, ids, ns=NS, nbytes=BLOCK, chunk=CHUNK, make=data, dtype=None):
    """Blocks ``make(i, nbytes)`` under ``key(i)``, chained; ``dtype``: the element type a tier
    with a codec encodes them as (None: raw)."""
    b = tier.put_many([(ns, key(i, ns), key(i - 1, ns) if i else None, chunk, make(i, nbytes), None, dtype)
                       for i in ids])
    assert b.wait(30)
    return b


def get(tier, ids, ns=NS, nbytes=BLOCK):
    dsts = [np.zeros(nbytes, np.uint8) for _ in ids]
    b = tier.get_many([key(i, ns) for i in ids], dsts)
    assert b.wait(30)
    return b, dsts
