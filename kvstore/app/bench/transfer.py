"""``kvstore bench transfer``: the transport alone (``kvstore.app.bench.transport_loopback``: chunk sweep,
per-chunk latency, raw TCP / ucxx / ucx_perftest references, pipelined overlap), or with
``--daemons`` the whole path: two real daemons, blocks put into daemon A, the Transfer RPC
timed until daemon B has verified and committed them, against a raw socket (or raw ucxx) of
the same chunk size measured in the same run.

The raw reference sends from and receives into shared memory, as the daemons' DRAM arenas
are (handed to their workers, they cannot be private memory); where the host's
``shmem_enabled`` gives shared memory no huge pages (this VM: never) that memory copies slower
than private memory with THP, so the same raw path over private memory is measured too
(``raw_private_GBps``, ``ratio_private``): the gap between the two is the host's setting, not
the daemon (its start-up log names the setting: advise). Raw does not verify what it moves, a
daemon's receiver takes the xxh3 of every layer chunk; the same raw path with its receiver doing
that too (``raw_verified_GBps``, ``ratio_verified``) separates what the integrity check costs
from what the daemon adds.

Each timed round ships blocks put just before it (fresh keys), so daemon A hashes every layer
as it sends, as for a request that has just been prefilled; a raw run follows each round, and
the ratio is the median of the per-round ratios (this host is noisy). A committed block's layers
lie back to back in its slot and travel in runs of up to 4 MiB (``kvstore.daemon.outbound.run_layers``),
so the raw reference moves the same bytes in messages of that size, not of one chunk, from and
into buffers as large as the transfer (the daemons read and write every block once; a raw
sender cycling four 4 MiB buffers would send out of the L3 cache).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from kvstore.app.local import free_port, start_daemon
from kvstore.daemon.outbound import run_layers
from kvstore.config import parse_size
from kvstore.transport import TransferConfig, ucx_env


def _cpu_s(pid: int) -> float:
    """CPU seconds of every thread of process ``pid`` so far (ns resolution, from schedstat; a
    thread that exited since is not counted, and the daemons' threads live as long as they do)."""
    total = 0
    for t in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{t}/schedstat") as f:
                total += int(f.read().split()[0])
        except (FileNotFoundError, ProcessLookupError):
            pass
    return total / 1e9


def daemons(a) -> dict:
    from kvstore.clients import KVStoreClient
    from kvstore.layout import KVLayout
    from kvstore.app.bench import transport_raw as bench_raw

    sizes = [parse_size(s) for s in a.chunk_sizes.split(",")]
    total = parse_size(a.total_bytes)
    work = tempfile.mkdtemp(prefix="kvstore-bench-transfer-")
    port_b = free_port()
    procs = []
    rows = []
    try:
        extent = max(64 << 20, -(-a.layers * max(sizes) // (64 << 20)) * (64 << 20))
        dram = 2 * total + 2 * extent
        secret = os.path.join(work, "transfer.secret")  # the daemons authenticate as deployed ones do
        fd = os.open(secret, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.write(fd, os.urandom(32).hex().encode())
        os.close(fd)
        common = ("--dram-capacity-bytes", str(dram), "--dram-extent-bytes", str(extent), "--transport-backend", a.backend,
                  "--transport-ucx-progress", a.ucx_progress, "--transport-secret-file", secret,
                  "--transport-verify-threads", str(a.verify_threads),
                  "--transport-ucx-fused-verify", "false" if a.no_fused_verify else "true")
        da = start_daemon(work, "a", *common, "--transport-listen", f"127.0.0.1:{free_port()}")
        procs.append(da)
        db = start_daemon(work, "b", *common, "--transport-listen", f"127.0.0.1:{port_b}")
        procs.append(db)
        sa, sb = da.socket_path, db.socket_path
        ctx = multiprocessing.get_context("spawn")
        raw_fn = bench_raw.raw_tcp if a.backend == "tcp" else bench_raw.raw_ucxx
        for chunk in sizes:
            heads = chunk // (2 * 16 * 128 * 2)
            layout = KVLayout(a.layers, heads, 128, "fp16", "mha", block_tokens=16)  # one chunk per layer
            n = max(1, total // layout.block_bytes)
            ca, cb = KVStoreClient(sa, timeout_s=120), KVStoreClient(sb, timeout_s=120)
            ca.register(layout, f"bench-{chunk}")
            cb.register(layout, f"bench-{chunk}")
            tokens = np.arange(n * 16)
            kv = np.random.default_rng(chunk).integers(0, 2**16, layout.tensor_shape(len(tokens)), dtype=np.uint16).view(np.float16)
            times, raws, privs, checked, cpu = [], [], [], [], []
            nbytes = n * layout.block_bytes
            message = run_layers(chunk, layout.num_layers) * chunk  # what the daemon puts in one message

            def run_raw(**kw) -> dict:  # the raw path moving the same bytes in messages of that size
                return raw_fn(ctx, message, max(8, nbytes // message), 5, ring_bytes=nbytes, src_bytes=nbytes, **kw)
            for r in range(a.repeat + 1):  # the first round warms the connection up
                toks = tokens + r * 10_000_000  # fresh keys every round: nothing recorded for them yet
                ca.put(toks, kv)
                keys = ca.keys(toks)
                c0 = (_cpu_s(da.proc.pid), _cpu_s(db.proc.pid))
                t0 = time.perf_counter()
                ca.transfer(keys, f"127.0.0.1:{port_b}", deadline_s=120)
                seconds = time.perf_counter() - t0
                c1 = (_cpu_s(da.proc.pid), _cpu_s(db.proc.pid))
                if a.verify and r == a.repeat:
                    out = np.zeros_like(kv)
                    if cb.get(toks, out) != len(toks) or out.tobytes() != kv.tobytes():
                        raise SystemExit(f"bench: --verify: daemon B's copy differs at chunk {chunk}")
                cb.delete(keys)
                ca.delete(keys)
                if r:
                    times.append(seconds)
                    # the same footprint as the daemons': each of A's blocks is read from its
                    # arena once and each lands in a slot of B's, none of them in the L3 cache;
                    # and the same kind of memory (shared, as an arena is), then private memory
                    raw = run_raw(shared=True)
                    raws.append(raw["gbps"])
                    privs.append(run_raw()["gbps"])
                    # ... and with its receiver taking every message's xxh3 as the daemon's does
                    rawv = run_raw(shared=True, verify=True)
                    checked.append(rawv["gbps"])
                    gb = nbytes / 1e9  # CPU s per GB: (daemon A, daemon B, raw sender, raw receiver)
                    cpu.append(((c1[0] - c0[0]) / gb, (c1[1] - c0[1]) / gb, raw["cpu_tx_s_per_gb"], raw["cpu_rx_s_per_gb"],
                                rawv["cpu_tx_s_per_gb"], rawv["cpu_rx_s_per_gb"]))
            hidden = None
            if a.pipelined:  # the median of --repeat tries, by hidden fraction
                tries = sorted((_pipelined(ca, cb, tokens, kv, f"127.0.0.1:{port_b}", a.compute_ratio)
                                for _ in range(a.repeat)), key=lambda t: t["hidden_fraction"])
                hidden = dict(tries[len(tries) // 2], hidden_runs=[t["hidden_fraction"] for t in tries])
            ca.close()
            cb.close()
            ratios, ratios_priv, ratios_checked = ([nbytes / t / 1e9 / g for t, g in zip(times, ref)]
                                                   for ref in (raws, privs, checked))
            rows.append({"chunk_bytes": chunk, "message_bytes": message, "blocks": n, "bytes": nbytes,
                         "daemon_GBps": round(nbytes / statistics.median(times) / 1e9, 3),
                         "raw_GBps": round(statistics.median(raws), 3), "ratio": round(statistics.median(ratios), 3),
                         "ratio_runs": [round(x, 3) for x in ratios],
                         "raw_private_GBps": round(statistics.median(privs), 3),
                         "ratio_private": round(statistics.median(ratios_priv), 3),
                         "raw_verified_GBps": round(statistics.median(checked), 3),
                         "ratio_verified": round(statistics.median(ratios_checked), 3),
                         # medians per column: what each side spends per GB, and the same for raw
                         "cpu_s_per_gb": dict(zip(("tx", "rx", "raw_tx", "raw_rx", "raw_verified_tx", "raw_verified_rx"),
                                                  (round(statistics.median(c), 3) for c in zip(*cpu)))),
                         "cpu_ratio_runs": {"tx": [round(c[0] / c[2], 2) for c in cpu],
                                            "rx": [round(c[1] / c[3], 2) for c in cpu]},
                         "verified": bool(a.verify), "pipelined": hidden})
    finally:
        for d in procs:
            d.stop(30)
        shutil.rmtree(work, ignore_errors=True)
    return {"bench": "transfer-daemons", "backend": a.backend, "unit": "GB/s with GB = 10^9 bytes",
            "reference": "raw TCP socket" if a.backend == "tcp" else "raw ucxx send/recv",
            "ucx_progress": a.ucx_progress, "verify_threads": a.verify_threads,
            # what the daemons' receive path is: fused where it is on, built, and no verify pool runs
            "ucx_fused_verify": (not a.no_fused_verify and ucx_env.fused()[0] is not None and
                                 TransferConfig(verify_threads=a.verify_threads).resolved_verify_threads() == 0)
            if a.backend == "ucx" else None,
            "cpus": os.cpu_count(), "load_average": os.getloadavg(), "rows": rows}


def _pipelined(ca, cb, tokens, kv, peer: str, ratio: float) -> dict:
    """Layer-pipelined: the "prefill" spends ``ratio`` x (per-layer transfer time) computing each
    layer, then rings the doorbell. On a GPU node the KV of a layer reaches the arena by DMA, so
    the bench writes every layer's bytes into the reserved slots before the clock starts and the
    compute is a sleep: neither takes a CPU from the transfer, as on a real node. The transfer
    alone is the same layer-by-layer transfer with every layer rung at once (a pipelined transfer
    ships layer chunks, not the whole-block runs of a committed one), measured before and after.
    Hidden = 1 - (wall - compute) / transfer-alone; at best 1 - 1/layers (the last layer's
    transfer has nothing left to overlap)."""
    layout = ca.layout
    src = kv.view(np.uint8).reshape(layout.num_layers, 2, len(tokens), -1)

    def run(n: int, per_layer: float) -> tuple[float, float]:
        toks = tokens + 7_000_000 + n * 1_000_000  # fresh keys: not on either daemon yet
        keys = ca.keys(toks)
        w = ca.reserve(keys, doorbell=True)
        for layer in range(layout.num_layers):
            for i in range(len(keys)):
                w.layer_view(i, layer)[...] = src[layer, :, i * 16:(i + 1) * 16]
        t0 = time.perf_counter()
        fut = ca.transfer(keys, peer, deadline_s=120, lease=w, wait=False)
        inc = cb.await_transfer(keys, wait_s=30)  # running: ringing can no longer beat the request
        compute = 0.0
        for layer in range(layout.num_layers):
            if per_layer:
                c0 = time.perf_counter()
                time.sleep(per_layer)
                compute += time.perf_counter() - c0
            w.ring(layer + 1)
        w.commit()
        fut.result()
        wall = time.perf_counter() - t0
        inc.release()
        out = np.zeros_like(kv)
        if cb.get(toks, out) != len(tokens) or out.tobytes() != kv.tobytes():
            raise SystemExit("bench: the pipelined transfer delivered different bytes")
        cb.delete(keys)
        ca.delete(keys)
        return wall, compute

    before = min(run(0, 0.0)[0], run(1, 0.0)[0])
    per_layer = ratio * before / layout.num_layers
    wall, compute = run(2, per_layer)
    alone = (before + run(3, 0.0)[0]) / 2  # bracket the pipelined run: this host is noisy
    hidden = 1 - max(0.0, wall - compute) / alone
    return {"compute_per_layer_s": round(per_layer, 6), "transfer_alone_s": round(alone, 6),
            "wall_s": round(wall, 6), "hidden_fraction": round(hidden, 3),
            "best_possible": round(1 - 1 / layout.num_layers, 3)}


def compress_main(argv: list[str]) -> int:
    """``kvstore bench transfer --compress``: see :mod:`kvstore.app.bench.transfer_codec`."""
    from kvstore.app.bench import transfer_codec
    from kvstore.app.bench.codec import as_blocks, minilm_kv

    ap = argparse.ArgumentParser(prog="kvstore bench transfer --compress",
                                 description=transfer_codec.__doc__.split("\n\n")[0])
    ap.add_argument("--link-rate", default="200MB", help="the relay's bytes/s per direction (e.g. 200MB, 1.25GB)")
    ap.add_argument("--tokens", type=int, default=8192, help="tokens of the trained model's KV per transfer")
    ap.add_argument("--block-tokens", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3, help="timed rounds")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    import torch

    text = " ".join(p.read_text() for p in sorted((Path(__file__).resolve().parents[3] / "docs").glob("*.md")))
    with torch.no_grad():
        kv, layout = as_blocks(minilm_kv(text, a.tokens), a.block_tokens)
    r = transfer_codec.run(kv, layout, a)
    print(json.dumps(r, indent=2) if a.json else transfer_codec.table(r))
    return 0 if r["verified"] else 1


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--compress" in argv:
        return compress_main([x for x in argv if x != "--compress"])
    if "--daemons" not in argv:
        from kvstore.app.bench.transport_loopback import main as transport_main

        return transport_main(argv)
    ap = argparse.ArgumentParser(prog="kvstore bench transfer --daemons", description=__doc__.split("\n\n")[0])
    ap.add_argument("--daemons", action="store_true", help="measure through two real daemons")
    ap.add_argument("--backend", choices=("tcp", "ucx"), default="tcp")
    ap.add_argument("--ucx-progress", choices=("adaptive", "blocking", "polling"), default="adaptive",
                    help="both daemons' transport.ucx_progress")
    ap.add_argument("--verify-threads", type=int, default=-1,
                    help="both daemons' transport.verify_threads (-1 = auto, 0 = on the UCX engine thread)")
    ap.add_argument("--no-fused-verify", action="store_true",
                    help="both daemons' transport.ucx_fused_verify off: payloads hashed once landed")
    ap.add_argument("--chunk-sizes", default="256KiB,1MiB,4MiB", help="layer chunk sizes (multiples of 16 KiB)")
    ap.add_argument("--total-bytes", default="512MiB", help="bytes per Transfer")
    ap.add_argument("--layers", type=int, default=32, help="layers per block (chunks per block)")
    ap.add_argument("--repeat", type=int, default=5, help="timed rounds, each followed by a raw run")
    ap.add_argument("--verify", action="store_true", help="compare daemon B's blocks with what A sent")
    ap.add_argument("--pipelined", action="store_true", help="also run the layer-pipelined mode with simulated compute")
    ap.add_argument("--compute-ratio", type=float, default=1.0, help="per-layer compute / per-layer transfer time")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    r = daemons(a)
    if a.json:
        print(json.dumps(r, indent=2))
        return 0
    print(f"Transfer RPC daemon A -> daemon B over {a.backend}, against a {r['reference']} in the same run (GB = 10^9 bytes)")
    print(f"{'chunk':>10} {'message':>10} {'blocks':>7} {'daemon GB/s':>12} {'raw GB/s':>9} {'ratio':>6} "
          f"{'(min-max)':>11} {'CPU s/GB tx/rx':>15} {'raw tx/rx':>11}  (medians; raw sends messages of the daemon's size)")
    for x in r["rows"]:
        pl = x["pipelined"]
        extra = (f"   pipelined: {pl['hidden_fraction']:.0%} of transfer hidden (median; {min(pl['hidden_runs']):.0%}-"
                 f"{max(pl['hidden_runs']):.0%}; best possible {pl['best_possible']:.0%})") if pl else ""
        lo, hi = min(x["ratio_runs"]), max(x["ratio_runs"])
        c = x["cpu_s_per_gb"]
        print(f"{x['chunk_bytes'] >> 10:>6} KiB {x['message_bytes'] >> 10:>6} KiB {x['blocks']:>7} "
              f"{x['daemon_GBps']:>12.2f} {x['raw_GBps']:>9.2f} "
              f"{x['ratio']:>6.2f} ({lo:.2f}-{hi:.2f}) {c['tx']:>7.2f}/{c['rx']:.2f} {c['raw_tx']:>6.2f}/{c['raw_rx']:.2f}{extra}")
    for x in r["rows"]:
        print(f"{x['chunk_bytes'] >> 10:>6} KiB: raw over private memory {x['raw_private_GBps']:.2f} GB/s, "
              f"daemon / that {x['ratio_private']:.2f} (the ratio above is against raw over shared memory, as an arena is)")
        print(f"{x['chunk_bytes'] >> 10:>6} KiB: raw with its receiver hashing every message as the daemon's does "
              f"{x['raw_verified_GBps']:.2f} GB/s, daemon / that {x['ratio_verified']:.2f}, its CPU s/GB "
              f"{x['cpu_s_per_gb']['raw_verified_tx']:.2f}/{x['cpu_s_per_gb']['raw_verified_rx']:.2f} (what the "
              f"integrity check costs is in both; the rest is the daemon's)")
    if r["ucx_fused_verify"] is not None:
        print("UCX receiver: " + ("payloads over shared memory hashed as UCX copies them in (the fused receive)"
                                  if r["ucx_fused_verify"] else "payloads hashed once landed"))
    print(f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 0
