"""NVMe tier bandwidth next to fio, measured in the same run on the same filesystem.

    python -m kvstore.app.bench.nvme_tier --dir /var/tmp --block-bytes 1MiB --total-bytes 512MiB [--json]

Writes ``total`` bytes as ``block``-sized blocks through :class:`NvmeTier` (put_many from a
page-aligned shared arena, every put durable: data fdatasync'ed and index committed) and reads
them back (get_many, every chunk verified), then runs fio with O_DIRECT, the same block size,
total bytes and filesystem, and ``iodepth`` equal to the tier's ``io_threads``. Rounds alternate
fio and tier so drift on a shared machine hits both. Reports bandwidths and tier / reference
ratios; only the ratios are meant to be compared across machines.

The reference is the better of two fio runs per direction: one libaio job at iodepth N and N
psync jobs (the tier's own pattern: N threads doing positional I/O), N = ``io_threads``. On a
virtio disk either can be the faster one, so taking the better keeps the ratio conservative.
If fio is missing (``apt-get install -y fio``), the reference is a plain Python O_DIRECT
pwrite/pread loop on N threads, and the report says so.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

from kvstore.tiers.arena import Arena
from kvstore.tiers.nvme import NvmeTier, NvmeTierConfig, SyncMode
from kvstore.tiers.nvme.files import aligned_buffer

_UNITS = {"k": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mib": 1 << 20, "g": 1 << 30, "gib": 1 << 30,
          "kb": 1000, "mb": 1000 ** 2, "gb": 1000 ** 3, "": 1, "b": 1}


def parse_bytes(text: str) -> int:
    t = text.strip().lower()
    num = t.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = t[len(num):]
    if unit not in _UNITS or not num:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 4096, 1MiB, 512MiB)")
    return int(float(num) * _UNITS[unit])


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else 0.0


FIO_ENGINES = ("libaio", "psync")


def run_fio(path: str, rw: str, block: int, total: int, depth: int, engine: str) -> float:
    """fio bandwidth in GB/s, O_DIRECT, ``depth`` I/Os in flight: one libaio job at iodepth
    ``depth``, or ``depth`` psync jobs on their own slices of the file (the tier's own pattern)."""
    cmd = ["fio", "--name=ref", f"--filename={path}", f"--rw={rw}", f"--bs={block}", "--direct=1",
           f"--ioengine={engine}", "--fallocate=native", "--group_reporting", "--output-format=json"]
    if engine == "psync":
        share = total // depth // block * block
        cmd += [f"--numjobs={depth}", f"--size={share}", f"--offset_increment={share}"]
    else:
        cmd += [f"--iodepth={depth}", "--numjobs=1", f"--size={total}"]
    if rw == "write":
        cmd.append("--end_fsync=1")
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=600).stdout
    job = json.loads(out[out.index("{"):])["jobs"][0]
    return job["write" if rw == "write" else "read"]["bw_bytes"] / 1e9


def run_python_reference(path: str, rw: str, block: int, total: int, depth: int, engine: str = "") -> float:
    """Fallback reference: ``depth`` threads, each an O_DIRECT pwrite/pread loop over its share."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
    try:
        if rw == "write":
            os.posix_fallocate(fd, 0, total)
        nblocks = total // block

        def loop(tid: int) -> None:
            buf = aligned_buffer(block)
            buf[:] = tid
            for i in range(tid, nblocks, depth):
                (os.pwritev if rw == "write" else os.preadv)(fd, [buf], i * block)

        threads = [threading.Thread(target=loop, args=(t,)) for t in range(depth)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if rw == "write":
            os.fdatasync(fd)
        return _gbps(nblocks * block, time.perf_counter() - t0)
    finally:
        os.close(fd)


def run_tier(workdir: str, ring: Arena, block: int, total: int, args) -> tuple[float, float, dict]:
    """(write GB/s, read GB/s, tier stats extra) through a fresh NvmeTier."""
    extent = 64 << 20
    while extent > block and extent % block:
        extent //= 2
    cap = -(-total // extent) * extent + extent
    cfg = NvmeTierConfig(dir=os.path.join(workdir, "tier"), capacity_bytes=cap, file_bytes=cap, extent_bytes=max(extent, block),
                     io_threads=args.io_threads, coalesce_bytes=args.coalesce_bytes, sync=SyncMode(args.sync))
    nblocks = total // block
    ring_blocks = ring.size_bytes // block
    keys = [i.to_bytes(8, "little") * 4 for i in range(nblocks)]
    ns = b"bench-namespace".ljust(32, b"\0")
    chunk = block // args.layers if block % args.layers == 0 else 0
    tier = NvmeTier(cfg)
    try:
        def pump(submit) -> float:
            t0 = time.perf_counter()
            inflight: list = []
            for s in range(0, nblocks, args.batch_blocks):
                idx = range(s, min(s + args.batch_blocks, nblocks))
                inflight.append(submit(idx))
                if len(inflight) >= args.batches_in_flight:
                    inflight.pop(0).result(600)
            for b in inflight:
                b.result(600)
            return time.perf_counter() - t0

        def put(idx):
            return tier.put_many([(ns, keys[i], keys[i - 1] if i else None, chunk,
                                   ring.view((i % ring_blocks) * block, block)) for i in idx])

        def get(idx):
            b = tier.get_many([keys[i] for i in idx], [ring.view((i % ring_blocks) * block, block) for i in idx])
            return b

        tw = pump(put)
        tr = pump(get)
        st = tier.stats()
        if st.extra["checksum_failures"] or st.extra["indexed_blocks"] != nblocks:
            raise RuntimeError(f"bench read-back failed: {st}")
        return _gbps(nblocks * block, tw), _gbps(nblocks * block, tr), st.extra
    finally:
        tier.close()
        shutil.rmtree(cfg.dir, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvstore bench tiers nvme", description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", default="/var/tmp", help="filesystem to measure (a temporary folder is made inside)")
    p.add_argument("--block-bytes", type=parse_bytes, default=1 << 20)
    p.add_argument("--total-bytes", type=parse_bytes, default=512 << 20)
    p.add_argument("--io-threads", type=int, default=8, help="tier I/Os in flight; fio iodepth is the same")
    p.add_argument("--batch-blocks", type=int, default=32, help="blocks per put_many / get_many")
    p.add_argument("--coalesce-bytes", type=parse_bytes, default=1 << 20,
                   help="tier merges adjacent blocks into vectored I/Os up to this size (0: off)")
    p.add_argument("--batches-in-flight", type=int, default=4)
    p.add_argument("--layers", type=int, default=32, help="checksummed chunks per block")
    p.add_argument("--sync", choices=[m.value for m in SyncMode], default=SyncMode.DURABLE.value)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--no-fio", action="store_true", help="use the Python O_DIRECT loop as reference")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    block, total = args.block_bytes, args.total_bytes // args.block_bytes * args.block_bytes
    if block % 4096 or total <= 0:
        p.error("--block-bytes must be a multiple of 4096 and --total-bytes at least one block")
    fio = None if args.no_fio else shutil.which("fio")
    engines = FIO_ENGINES if fio else ("python",)
    ref_name = ("best of fio libaio (iodepth=N) and fio psync (numjobs=N), O_DIRECT" if fio
                else "python O_DIRECT pwrite/pread loop on N threads (fio not installed)")
    ref = run_fio if fio else run_python_reference

    workdir = tempfile.mkdtemp(prefix="kvstore-nvme-bench-", dir=args.dir)
    in_flight = args.batch_blocks * args.batches_in_flight
    ring = Arena(max(min(total, 256 << 20), (in_flight + args.batch_blocks) * block))
    ring.buf[:] = np.random.default_rng(0).integers(0, 256, ring.size_bytes, dtype=np.uint8)
    rows = []
    try:
        for r in range(args.rounds):
            path = os.path.join(workdir, "ref.dat")
            refs = {}
            for eng in engines:
                refs[eng] = (ref(path, "write", block, total, args.io_threads, eng),
                             ref(path, "read", block, total, args.io_threads, eng))
                os.unlink(path)
            tw, tr, extra = run_tier(workdir, ring, block, total, args)
            rw_ = max(w for w, _ in refs.values())
            rr_ = max(r_ for _, r_ in refs.values())
            rows.append({"round": r, "ref_write_gbps": rw_, "ref_read_gbps": rr_, "tier_write_gbps": tw,
                         "tier_read_gbps": tr, "write_ratio": tw / rw_ if rw_ else 0.0,
                         "read_ratio": tr / rr_ if rr_ else 0.0,
                         "refs": {e: {"write_gbps": w, "read_gbps": r_} for e, (w, r_) in refs.items()}})
    finally:
        ring.close()
        shutil.rmtree(workdir, ignore_errors=True)

    def med(k: str) -> float:
        return statistics.median(row[k] for row in rows)

    result = {"reference": ref_name, "dir": args.dir, "block_bytes": block, "total_bytes": total,
              "io_threads": args.io_threads, "batch_blocks": args.batch_blocks, "coalesce_bytes": args.coalesce_bytes,
              "batches_in_flight": args.batches_in_flight, "sync": args.sync, "io_mode": extra["io_mode"],
              "rounds": rows, "write_ratio": med("write_ratio"), "read_ratio": med("read_ratio"),
              "tier_write_gbps": med("tier_write_gbps"), "tier_read_gbps": med("tier_read_gbps"),
              "ref_write_gbps": med("ref_write_gbps"), "ref_read_gbps": med("ref_read_gbps"), "target_ratio": 0.7}
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"NVMe tier vs {ref_name} on {args.dir}: block {block} bytes, {total / 2**20:.0f} MiB, "
              f"{args.io_threads} I/Os in flight, coalescing up to {args.coalesce_bytes} bytes, sync={args.sync}, "
              f"io={extra['io_mode']}")
        print(f"{'round':>5} {'ref write':>10} {'tier write':>11} {'ratio':>6} {'ref read':>9} {'tier read':>10} {'ratio':>6}")
        for row in rows:
            print(f"{row['round']:>5} {row['ref_write_gbps']:>7.2f} GB/s {row['tier_write_gbps']:>6.2f} GB/s "
                  f"{row['write_ratio']:>6.2f} {row['ref_read_gbps']:>6.2f} GB/s {row['tier_read_gbps']:>5.2f} GB/s "
                  f"{row['read_ratio']:>6.2f}   ("
                  + ", ".join(f"{e}: w {v['write_gbps']:.2f} r {v['read_gbps']:.2f}" for e, v in row["refs"].items())
                  + ")")
        print(f"median ratio: write {result['write_ratio']:.2f}, read {result['read_ratio']:.2f} (target >= 0.7)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
