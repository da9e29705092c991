#!/usr/bin/env python3
"""Warm restart figure: fill a daemon with DRAM tier D and an NVMe tier with chains of 1.5 x D,
go idle, SIGTERM, restart, and report the fraction of blocks servable bit-exact (Lookup + get)
and the shutdown time as a ratio to fio writing the same bytes (O_DIRECT, same directory, same
run; kvstore/app/bench/nvme_tier.py's reference).

    .venv/bin/python scripts/bench_warm_restart.py --dir /tmp/warm --dram 1GiB 4GiB

Needs about 2.5 x D of memory and 2 x D of disk per size. Prints one JSON object per size.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import sys
import tempfile
import time

import numpy as np

from kvstore.clients import KVStoreClient
from kvstore.layout import KVLayout
from kvstore.app.local import start_daemon
from kvstore.app.bench.nvme_tier import parse_bytes, run_fio, run_python_reference

LAYOUT = KVLayout(32, 8, 128, "fp16", "mha")  # 2 MiB blocks of 16 tokens
CHAIN = 32  # blocks per sequence (64 MiB)


def seq_kv(s: int, tokens: int) -> np.ndarray:
    """Content that depends on the sequence and the position, cheap to make and to compare."""
    kv = np.empty(LAYOUT.tensor_shape(tokens), np.float16)
    kv[...] = (np.arange(tokens, dtype=np.float32) % 2039 + s * 0.5).astype(np.float16)[None, None, :, None, None]
    return kv


def one(workdir: str, dram: int, io_threads: int, grace_s: float) -> dict:
    nvme = os.path.join(workdir, "nvme")
    n_seqs = int(1.5 * dram) // (CHAIN * LAYOUT.block_bytes)
    tokens = CHAIN * LAYOUT.block_tokens
    flags = ["--dram-capacity-bytes", str(dram), "--dram-prefault", "false", "--nvme-dir", nvme,
             "--nvme-capacity-bytes", str(2 * dram), "--nvme-io-threads", str(io_threads),
             "--server-shutdown-grace-s", str(grace_s)]
    d = start_daemon(workdir, "fill", *flags)
    c = KVStoreClient(d.socket_path)
    c.register(LAYOUT, "warm-restart")
    toks = [list(range(s * 10_000_000, s * 10_000_000 + tokens)) for s in range(n_seqs)]
    for s, t in enumerate(toks):
        assert c.put(t, seq_kv(s, tokens)) == CHAIN
    time.sleep(2.0)  # idle, as in the finding
    c.close()
    t0 = time.monotonic()
    d.proc.send_signal(signal.SIGTERM)
    assert d.proc.wait(grace_s + 60) == 0
    shutdown_s = time.monotonic() - t0
    log = d.log_path.read_text()
    m = re.search(r"(\d+) of (\d+) DRAM-only blocks written to NVMe at shutdown in ([\d.]+) s", log)
    flushed = int(m.group(1)) if m else 0
    write_out_s = float(m.group(3)) if m else 0.0

    d = start_daemon(workdir, "restarted", *flags)
    c = KVStoreClient(d.socket_path)
    c.register(LAYOUT, "warm-restart")
    hit = sum(c.lookup(t) // LAYOUT.block_tokens for t in toks)
    good = 0
    out = np.empty(LAYOUT.tensor_shape(tokens), np.float16)
    for s, t in enumerate(toks):
        n = c.get(t, out) // LAYOUT.block_tokens
        exp = seq_kv(s, tokens)
        good += n if out[:, :, :n * LAYOUT.block_tokens].tobytes() == exp[:, :, :n * LAYOUT.block_tokens].tobytes() else 0
    c.close()
    d.stop()
    restart_log = d.log_path.read_text()
    shutil.rmtree(nvme, ignore_errors=True)

    nbytes = flushed * LAYOUT.block_bytes
    ref_path = os.path.join(workdir, "fio.ref")
    if nbytes:
        ref = run_fio if shutil.which("fio") else run_python_reference
        gbps = ref(ref_path, "write", LAYOUT.block_bytes, nbytes, io_threads, "libaio")
        os.unlink(ref_path)
        fio_s = nbytes / (gbps * 1e9)
    else:
        gbps = fio_s = 0.0
    total = n_seqs * CHAIN
    return {"dram_bytes": dram, "blocks_written": total, "block_bytes": LAYOUT.block_bytes,
            "lookup_hit_blocks": hit, "servable_bit_exact_blocks": good, "servable_fraction": round(good / total, 4),
            "flushed_at_shutdown_blocks": flushed, "flushed_bytes": nbytes,
            "shutdown_s": round(shutdown_s, 3), "write_out_s": write_out_s,
            "fio_write_GBps": round(gbps, 3), "fio_write_s_same_bytes": round(fio_s, 3),
            "shutdown_over_fio": round(shutdown_s / fio_s, 2) if fio_s else None,
            "write_out_over_fio": round(write_out_s / fio_s, 2) if fio_s else None,
            "unreachable_reclaimed": "unreachable" in restart_log}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", default=None, help="work directory (on the NVMe file system to measure)")
    p.add_argument("--dram", nargs="+", default=["1GiB", "4GiB"], help="DRAM tier sizes")
    p.add_argument("--io-threads", type=int, default=8)
    p.add_argument("--grace-s", type=float, default=120.0, help="server.shutdown_grace_s for the run")
    a = p.parse_args(argv)
    for size in a.dram:
        with tempfile.TemporaryDirectory(dir=a.dir) as wd:
            print(json.dumps(one(wd, parse_bytes(size), a.io_threads, a.grace_s)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
