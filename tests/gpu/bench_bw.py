"""Bandwidth of the HBM tier's and the client's copy paths against same-run raw copies.

H2D and D2H: through the arena pinned in place (``cudaHostRegister``), as the tier's batched
``promote``/``demote`` and per-slot ``write_async``/``read_async``, next to one ``cudaMemcpy``
of the same size from torch pinned memory. D2D: slot to slot inside the HBM pool next to a
plain device copy. Client path: paged cache <-> arena slots (informational). Prints one JSON
object; ratios are against the raw path measured in this run (noisy machines: never compare
absolute times across runs).

    python tests/gpu/bench_bw.py [--size-mib 512] [--slot-mib 4] [--reps 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

MiB = 1 << 20
NS = b"B" * 32


def timed(fn, reps: int) -> float:
    """Median wall seconds of ``fn`` (which waits for its own copies) after one warm-up."""
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def on_stream(torch, stream, fn):
    """``fn`` run with ``stream`` current, then waited for: one timed op."""
    def run():
        with torch.cuda.stream(stream):
            fn()
        stream.synchronize()
    return run


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size-mib", type=int, default=512)
    ap.add_argument("--slot-mib", type=int, default=4)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args(argv)

    import torch

    if not torch.cuda.is_available():
        print(json.dumps({"skipped": f"no CUDA device: torch.cuda.is_available() is False (torch {torch.__version__})"}))
        return 0

    from kvstore.tiers.arena import Arena
    from kvstore.tiers.hbm import HbmTier, HbmTierConfig

    size, slot = args.size_mib * MiB, args.slot_mib * MiB
    n = size // slot
    size = n * slot
    GB = size / 1e9
    out: dict = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "bytes": size,
                 "slot_bytes": slot, "reps": args.reps}

    arena = Arena(2 * size)  # stands in for the daemon's shared arena (a memfd, pre-faulted)
    tier = HbmTier(HbmTierConfig(2 * size, extent_bytes=64 * slot, device="0", streams=2, prefault=False))
    out["arena_pinned"] = tier.register_host(arena)
    src_slots = [tier.allocate(NS, slot) for _ in range(n)]
    dst_slots = [tier.allocate(NS, slot) for _ in range(n)]
    host_src = [arena.view(i * slot, slot) for i in range(n)]
    host_dst = [arena.view(size + i * slot, slot) for i in range(n)]
    arena.buf[:size] = 7

    pinned = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    dev_a = torch.empty(size, dtype=torch.uint8, device="cuda")
    dev_b = torch.empty(size, dtype=torch.uint8, device="cuda")
    arena_t = torch.from_numpy(arena.buf[:size])
    side = torch.cuda.Stream()

    def on_side(fn):
        return on_stream(torch, side, fn)

    def wait_all(ts):
        for t in ts:
            t.result(60)

    r = args.reps
    s = {
        # references: one cudaMemcpyAsync of the whole size
        "h2d_pinned_memcpy": timed(on_side(lambda: dev_a.copy_(pinned, non_blocking=True)), r),
        "d2h_pinned_memcpy": timed(on_side(lambda: pinned.copy_(dev_a, non_blocking=True)), r),
        "d2d_plain_copy": timed(on_side(lambda: dev_b.copy_(dev_a, non_blocking=True)), r),
        # the registered arena, one copy: what registration alone gives
        "h2d_arena_memcpy": timed(on_side(lambda: dev_a.copy_(arena_t, non_blocking=True)), r),
        "d2h_arena_memcpy": timed(on_side(lambda: arena_t.copy_(dev_a, non_blocking=True)), r),
        # the tier: one batched transfer, and one transfer per slot
        "h2d_tier_promote": timed(lambda: tier.promote(zip(src_slots, host_src)).result(60), r),
        "d2h_tier_demote": timed(lambda: tier.demote(zip(src_slots, host_dst)).result(60), r),
        "h2d_tier_write_async": timed(lambda: wait_all([tier.write_async(a, h) for a, h in zip(src_slots, host_src)]), r),
        "d2h_tier_read_async": timed(lambda: wait_all([tier.read_async(a, h) for a, h in zip(src_slots, host_dst)]), r),
        "d2d_tier_copy_async": timed(lambda: wait_all([tier.copy_async(b, a, slot) for a, b in zip(src_slots, dst_slots)]), r),
    }
    out["seconds"] = {k: round(v, 6) for k, v in s.items()}
    out["gbps"] = {k: round(GB / v, 2) for k, v in s.items()}
    g = out["gbps"]
    out["ratios"] = {
        "h2d_arena_vs_pinned": round(g["h2d_arena_memcpy"] / g["h2d_pinned_memcpy"], 3),
        "d2h_arena_vs_pinned": round(g["d2h_arena_memcpy"] / g["d2h_pinned_memcpy"], 3),
        "h2d_tier_vs_pinned": round(g["h2d_tier_promote"] / g["h2d_pinned_memcpy"], 3),
        "d2h_tier_vs_pinned": round(g["d2h_tier_demote"] / g["d2h_pinned_memcpy"], 3),
        "h2d_tier_per_slot_vs_pinned": round(g["h2d_tier_write_async"] / g["h2d_pinned_memcpy"], 3),
        "d2h_tier_per_slot_vs_pinned": round(g["d2h_tier_read_async"] / g["d2h_pinned_memcpy"], 3),
        "d2d_tier_vs_plain": round(g["d2d_tier_copy_async"] / g["d2d_plain_copy"], 3),
    }
    ok = out["ratios"]["h2d_tier_vs_pinned"] >= 0.8 and out["ratios"]["d2h_tier_vs_pinned"] >= 0.8
    out["pass_h2d_d2h_ge_0.8"] = ok
    out["client_path"] = client_path(arena, size, r, g)
    tier.close()
    arena.close()
    print(json.dumps(out))
    return 0


def client_path(arena, size: int, reps: int, g: dict) -> dict:
    """Paged cache <-> arena slots through :class:`KVMover` for a llama-3-8B-like layout."""
    import torch

    from kvstore.clients.hbm_paged import KVMover, PagedKV
    from kvstore.layout import KVLayout

    L = KVLayout(32, 8, 128, "bf16")  # 2 MiB blocks, 64 KiB layer chunks
    n = min(size // L.block_bytes, 256)
    nb = n + 8
    kv = [torch.randn((2, nb, 16, 8, 128), device="cuda").to(torch.bfloat16) for _ in range(L.num_layers)]
    m = KVMover(PagedKV(kv, L), L, arena.buf)
    try:
        rows = m.device_rows(m.paged.token_rows(torch.randperm(nb)[:n], n * 16))
        offsets = [i * L.block_bytes for i in range(n)]
        nbytes = n * L.block_bytes

        def layerwise_load():
            for l in range(L.num_layers):
                m.load_layer(l, rows, offsets)
            m.stream.synchronize()

        s = {
            "store_bulk": timed(lambda: m.store_all(rows, offsets).synchronize(), reps),
            "load_bulk": timed(lambda: m.load_all(rows, offsets)[-1].synchronize(), reps),
            "load_layerwise": timed(layerwise_load, reps),
        }
        gbps = {k: round(nbytes / 1e9 / v, 2) for k, v in s.items()}
        return {"blocks": n, "block_bytes": L.block_bytes, "gbps": gbps,
                "store_bulk_vs_pinned_d2h": round(gbps["store_bulk"] / g["d2h_pinned_memcpy"], 3),
                "load_bulk_vs_pinned_h2d": round(gbps["load_bulk"] / g["h2d_pinned_memcpy"], 3),
                "load_layerwise_vs_pinned_h2d": round(gbps["load_layerwise"] / g["h2d_pinned_memcpy"], 3)}
    finally:
        m.close()


if __name__ == "__main__":
    sys.exit(main())
