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


def race_reads_with_churn(tier, ids, others, put, get, make, readers: int = 1, reads: int = 400):
    """Delete and put again the even keys of ``ids`` (storing ``others``' blocks into the slots
    just freed, then deleting them) while ``readers`` threads read every key of ``ids``, until
    ``reads`` reads ended. ``put(tier, ids)``, ``get(tier, ids) -> (batch, dsts)``; ``make(i)``
    is block ``i``'s bytes. Returns ``(seen, bad)``: every read's result, and ``(i, result)`` of
    each read that ended neither MISSING nor OK with block ``i``'s bytes."""
    import threading

    from kvstore.tiers.nvme import IoResult
    from wait_util import wait_for

    stop = threading.Event()
    seen: list = []
    bad: list = []

    def churn() -> None:
        while not stop.is_set():
            tier.delete([key(i) for i in ids[::2]])
            put(tier, others)
            tier.delete([key(i) for i in others])
            put(tier, ids[::2])

    def read() -> None:
        while not stop.is_set():
            g, dsts = get(tier, ids)
            for i, d in zip(ids, dsts):
                r = g.results[key(i)]
                seen.append(r)
                if r not in (IoResult.OK, IoResult.MISSING) or (r is IoResult.OK and not np.array_equal(d, make(i))):
                    bad.append((i, r))

    put(tier, ids)
    threads = [threading.Thread(target=churn)] + [threading.Thread(target=read) for _ in range(readers)]
    for t in threads:
        t.start()
    wait_for(lambda: len(seen) >= reads or not all(t.is_alive() for t in threads), 60, "reads racing the churn")
    stop.set()
    for t in threads:
        t.join(30)
    return seen, bad
