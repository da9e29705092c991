"""``kvstore bench tiers``: NVMe write and read bandwidth through the real daemon next to fio on
the same filesystem in the same run, and the latency of promoting one block NVMe -> DRAM.

Write: ``put`` with durable commits (each Commit returns once its blocks are on NVMe and
indexed), so the figure is the client's view of NVMe writes through the daemon. Read: ``get`` of
blocks that only NVMe holds, so every byte is read, verified and promoted into DRAM.
``kvstore bench tiers nvme`` runs the tier-level benchmark (NvmeTier alone) instead.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import numpy as np

from kvstore.bench import start_daemon
from kvstore.config import parse_size


def _reference(path: str, rw: str, block: int, total: int, depth: int) -> tuple[float, str]:
    from kvstore.tiers.nvme_bench import FIO_ENGINES, run_fio, run_python_reference

    if shutil.which("fio"):
        return max(run_fio(path, rw, block, total, depth, e) for e in FIO_ENGINES), "fio (best of libaio, psync)"
    return run_python_reference(path, rw, block, total, depth), "python O_DIRECT loop (fio not installed)"


def run(a) -> dict:
    from kvstore.clients import KVStoreClient
    from kvstore.clients.client import empty_aligned
    from kvstore.layout import KVLayout

    block = parse_size(a.block_bytes)
    total = parse_size(a.total_bytes)
    heads = block // (32 * 2 * 16 * 128 * 2)
    if heads < 1 or heads * 32 * 2 * 16 * 128 * 2 != block:
        raise SystemExit("--block-bytes: must be a multiple of 256 KiB (32 layers x 16 tokens x 128 dims x fp16 x K,V)")
    layout = KVLayout(32, heads, 128, "fp16", "mha", block_tokens=16)
    n = total // block
    dram = max(8 * block, (total // 2) // block * block)  # the read set is the other half: NVMe only
    extent = max(4 << 20, block)
    os.makedirs(a.dir, exist_ok=True)
    work = tempfile.mkdtemp(prefix="kvstore-bench-tiers-", dir=a.dir)
    proc = None
    try:
        ref_file = os.path.join(work, "fio.dat")
        fio_w, ref_name = _reference(ref_file, "write", block, total, a.depth)
        fio_r, _ = _reference(ref_file, "read", block, total, a.depth)
        os.unlink(ref_file)
        nvme = str(2 * total + 8 * extent)
        proc, sock = start_daemon(work, "bench", "--dram-capacity-bytes", str(dram + 4 * extent),
                                  "--dram-extent-bytes", str(extent), "--nvme-dir", os.path.join(work, "nvme"),
                                  "--nvme-capacity-bytes", nvme, "--nvme-file-bytes", nvme,
                                  "--nvme-durable-commit", "true")
        c = KVStoreClient(sock, timeout_s=120)
        c.register(layout, "bench-tiers")
        tokens = np.arange(n * 16)
        kv = np.random.default_rng(0).integers(0, 2**16, layout.tensor_shape(len(tokens)), dtype=np.uint16).view(np.float16)
        t0 = time.perf_counter()
        stored = c.put(tokens, kv)
        write_s = time.perf_counter() - t0
        if stored != n:
            raise RuntimeError(f"bench: stored {stored} of {n} blocks")
        cold = (n - dram // block - 4) * 16  # leading tokens whose blocks were evicted from DRAM
        out = empty_aligned(layout.tensor_shape(cold), np.float16)
        out.fill(0)
        t0 = time.perf_counter()
        got = c.get(tokens[:cold], out, wait_s=120)
        read_s = time.perf_counter() - t0
        verified = got == cold and out.tobytes() == kv[:, :, :cold].tobytes()
        # Promotion latency: one NVMe-only block at a time (keys near the start are cold again).
        lat = []
        keys = c.keys(tokens)
        for i in range(0, min(a.promotions, cold // 16)):
            k = keys[i]
            t0 = time.perf_counter()
            with c.acquire([k], wait_s=30):
                lat.append(time.perf_counter() - t0)
        lat.sort()
        c.close()
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(60)
        shutil.rmtree(work, ignore_errors=True)
    w_gbps = n * block / write_s / 1e9
    r_gbps = cold // 16 * block / read_s / 1e9
    return {"bench": "tiers", "unit": "GB/s with GB = 10^9 bytes", "block_bytes": block, "total_bytes": n * block,
            "reference": ref_name, "fio_write_GBps": round(fio_w, 3), "fio_read_GBps": round(fio_r, 3),
            "daemon_write_GBps": round(w_gbps, 3), "daemon_read_GBps": round(r_gbps, 3),
            "write_ratio": round(w_gbps / fio_w, 3), "read_ratio": round(r_gbps / fio_r, 3),
            "read_blocks": cold // 16, "verified": verified,
            "promotion_ms": {"p50": round(1e3 * statistics.median(lat), 3) if lat else None,
                             "p99": round(1e3 * lat[min(len(lat) - 1, int(0.99 * len(lat)))], 3) if lat else None,
                             "samples": len(lat)}}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["nvme"]:
        from kvstore.tiers.nvme_bench import main as tier_main

        return tier_main(argv[1:])
    ap = argparse.ArgumentParser(prog="kvstore bench tiers", description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default="/var/tmp", help="filesystem to measure (a temporary folder is made inside)")
    ap.add_argument("--block-bytes", default="1MiB")
    ap.add_argument("--total-bytes", default="1GiB")
    ap.add_argument("--depth", type=int, default=8, help="fio I/Os in flight (the tier's io_threads)")
    ap.add_argument("--promotions", type=int, default=50, help="single-block promotions timed")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    r = run(a)
    if a.json:
        print(json.dumps(r, indent=2))
        return 0 if r["verified"] else 1
    print(f"NVMe through the daemon, {r['block_bytes'] >> 10} KiB blocks, {r['total_bytes'] / 1e9:.2f} GB written "
          f"(GB = 10^9 bytes); reference: {r['reference']}, same filesystem, same run")
    print(f"  write: daemon {r['daemon_write_GBps']:.2f} GB/s, reference {r['fio_write_GBps']:.2f} GB/s, ratio {r['write_ratio']:.2f}")
    print(f"  read:  daemon {r['daemon_read_GBps']:.2f} GB/s, reference {r['fio_read_GBps']:.2f} GB/s, ratio {r['read_ratio']:.2f}"
          f"  ({r['read_blocks']} NVMe-only blocks, verified={r['verified']})")
    p = r["promotion_ms"]
    print(f"  promotion of one block NVMe -> DRAM: p50 {p['p50']} ms, p99 {p['p99']} ms ({p['samples']} samples)")
    return 0 if r["verified"] else 1
