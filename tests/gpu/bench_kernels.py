"""Bandwidth of the client copy paths (issue 18) against same-run pinned ``cudaMemcpy``.

For 8B- and 70B-shaped layouts (Llama-3: 32 / 80 layers, 8 KV heads of 128, bf16) and blocks of
16 and 128 tokens, each path (``legacy``: the per-(block, layer) copies before issue 18;
``zerocopy`` and ``staged``: the batched kernels) moves the same blocks between a paged CUDA cache
and registered arena slots: layer-wise load and store (one op per layer, as
``wait_for_layer_load`` / ``save_kv_layer`` see them), bulk load and store. Each figure is a
ratio to one ``cudaMemcpyAsync`` of the same bytes from ``torch.empty(pin_memory=True)``
(H2D for loads, D2H for stores), measured in this run. D2D: the HBM pool's ``copy_many`` (one
launch) and the old per-slot ``copy_async`` against one device copy of the same bytes.

Prints one JSON object (also a markdown table under ``"table_md"``); never compare absolute
figures across runs.

    python tests/gpu/bench_kernels.py [--mib 256] [--reps 3] [--quick]
    TRITON_INTERPRET=1 python tests/gpu/bench_kernels.py --emulated   # CI's dry run: CPU, tiny

``--emulated`` runs the same code on CPU tensors (Triton's interpreter; a tiny 2-layer layout)
so CI checks the script end to end; its figures say nothing about a GPU (``"emulated": true``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from bench_bw import on_stream, timed  # same folder: run as a script, its folder is on the path

MiB = 1 << 20
PATHS = ("legacy", "zerocopy", "staged")
OPS = ("load_layerwise", "store_layerwise", "load_bulk", "store_bulk")
SHAPES = {"8B": (32, 8, 128), "70B": (80, 8, 128), "tiny": (2, 2, 64)}  # layers, kv heads, head dim (per TP rank)


def one_layout(torch, Arena, KVLayout, KVMover, PagedKV, shape: str, bt: int, budget: int, reps: int,
               device: str = "cuda") -> dict:
    L, H, D = SHAPES[shape]
    lay = KVLayout(L, H, D, "bf16", block_tokens=bt)
    n = max(2, budget // lay.block_bytes)
    nbytes = n * lay.block_bytes
    nb = n + 4
    kv = [torch.randn((2, nb, bt, H, D), device=device).to(torch.bfloat16) for _ in range(L)]
    arena = Arena(nbytes + lay.block_bytes, prefault=True)
    offsets = [j * lay.block_bytes for j in range(n)]
    cuda = device == "cuda"
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)

    def ref_op(fn):
        return on_stream(torch, torch.cuda.Stream(), fn) if cuda else fn

    ref = {"h2d": timed(ref_op(lambda: dev.copy_(pinned, non_blocking=True)), reps),
           "d2h": timed(ref_op(lambda: pinned.copy_(dev, non_blocking=True)), reps)}
    out = {"layout": f"{shape} ({L} layers, {H}x{D} bf16)", "block_tokens": bt, "blocks": n, "bytes": nbytes,
           "pinned_memcpy_gbps": {k: round(nbytes / 1e9 / v, 2) for k, v in ref.items()}, "gbps": {}, "ratio": {}}
    table = torch.randperm(nb)[:n]
    try:
        for path in PATHS:
            m = KVMover(PagedKV(kv, lay), lay, arena.buf, path)
            try:
                if m.copy_path.value != path:
                    out.setdefault("skipped", {})[path] = m.copy_reason
                    continue
                rows = m.device_rows(m.paged.token_rows(table, n * bt))

                def layerwise(op):
                    def run():
                        for l in range(L):
                            getattr(m, op)(l, rows, offsets)
                        m.stream.synchronize()
                    return run

                s = {"load_layerwise": timed(layerwise("load_layer"), reps),
                     "store_layerwise": timed(layerwise("store_layer"), reps),
                     "load_bulk": timed(lambda: m.load_all(rows, offsets)[-1].synchronize(), reps),
                     "store_bulk": timed(lambda: m.store_all(rows, offsets).synchronize(), reps)}
            finally:
                m.close()
            out["gbps"][path] = {op: round(nbytes / 1e9 / s[op], 2) for op in OPS}
            out["ratio"][path] = {op: round(ref["h2d" if op.startswith("load") else "d2h"] / s[op], 3) for op in OPS}
    finally:
        arena.close()
    return out


def d2d(torch, HbmTier, HbmTierConfig, budget: int, reps: int, device: str = "cuda") -> dict:
    slot = 4 * MiB if device == "cuda" else 64 << 10
    n = max(2, budget // slot)
    tier = HbmTier(HbmTierConfig(2 * n * slot, extent_bytes=n * slot, device="0" if device == "cuda" else "emulated",
                                 prefault=False))
    try:
        ns = b"D" * 32
        src = [tier.allocate(ns, slot) for _ in range(n)]
        dst = [tier.allocate(ns, slot) for _ in range(n)]
        # Every other destination: no two neighbours merge, so the launch really does n spans.
        pairs = [(d, s, slot) for s, d in zip(src, dst[::2] + dst[1::2])]
        a = torch.empty(n * slot, dtype=torch.uint8, device=device)
        b = torch.empty_like(a)
        plain = lambda: b.copy_(a)  # noqa: E731
        if device == "cuda":
            plain = on_stream(torch, torch.cuda.Stream(), lambda: b.copy_(a, non_blocking=True))

        def per_slot():
            for t in [tier.copy_async(d, s, k) for d, s, k in pairs]:
                t.result(60)

        s = {"one_device_copy": timed(plain, reps), "copy_many": timed(lambda: tier.copy_many(pairs).result(60), reps),
             "copy_async_per_slot": timed(per_slot, reps)}
        return {"slots": n, "slot_bytes": slot, "kernels": getattr(tier.pool, "kernels", False),
                "gbps": {k: round(n * slot / 1e9 / v, 2) for k, v in s.items()},
                "ratio": {k: round(s["one_device_copy"] / v, 3) for k, v in s.items() if k != "one_device_copy"}}
    finally:
        tier.close()


def markdown(res: dict) -> str:
    head = "| layout | block tokens | path | " + " | ".join(OPS) + " |\n|---|---|---|" + "---|" * len(OPS) + "\n"
    rows = []
    for r in res["layouts"]:
        for path in PATHS:
            if path in r["ratio"]:
                rows.append(f"| {r['layout']} | {r['block_tokens']} | {path} | " +
                            " | ".join(f"{r['ratio'][path][op]:.3f}" for op in OPS) + " |")
    d = res.get("d2d", {})
    tail = ""
    if "ratio" in d:
        tail = (f"\nD2D ({d['slots']} slots of {d['slot_bytes'] >> 10} KiB) vs one device copy: "
                f"copy_many {d['ratio']['copy_many']:.3f}, "
                f"per-slot copy_async {d['ratio']['copy_async_per_slot']:.3f}\n")
    return head + "\n".join(rows) + "\n" + tail


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mib", type=int, default=256, help="bytes moved per op (MiB)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="one layout only")
    ap.add_argument("--emulated", action="store_true", help="CPU tensors, Triton's interpreter, tiny sizes (CI)")
    args = ap.parse_args(argv)
    import torch

    device = "cpu" if args.emulated else "cuda"
    if not args.emulated and not torch.cuda.is_available():
        print(json.dumps({"skipped": f"no CUDA device: torch.cuda.is_available() is False (torch {torch.__version__})"}))
        return 0
    from kvstore.layout import KVLayout
    from kvstore.tiers.arena import Arena
    from kvstore.tiers.hbm import HbmTier, HbmTierConfig
    from kvstore.clients.hbm_paged import KVMover, PagedKV

    budget = (256 << 10) if args.emulated else args.mib * MiB
    res = {"device": "emulated (CPU, Triton interpreter)" if args.emulated else torch.cuda.get_device_name(0),
           "emulated": args.emulated, "torch": torch.__version__, "reps": args.reps, "layouts": []}
    t0 = time.perf_counter()
    if args.emulated:
        combos = [("tiny", 16)]
    else:
        combos = [("8B", 16)] if args.quick else [(s, bt) for s in ("8B", "70B") for bt in (16, 128)]
    for shape, bt in combos:
        res["layouts"].append(one_layout(torch, Arena, KVLayout, KVMover, PagedKV, shape, bt, budget, args.reps, device))
        print(f"[bench_kernels +{time.perf_counter() - t0:.0f}s] {shape} block {bt} done", file=sys.stderr)
    res["d2d"] = d2d(torch, HbmTier, HbmTierConfig, budget, args.reps, device)
    res["wall_s"] = round(time.perf_counter() - t0, 1)
    res["table_md"] = markdown(res)
    # The bar: layer-wise load/store >= 0.8, bulk >= 0.9 of pinned cudaMemcpy, D2D >= 0.5.
    best = {}
    for r in res["layouts"]:
        for path in ("zerocopy", "staged"):
            for op in OPS:
                if path in r["ratio"]:
                    key = (r["layout"], r["block_tokens"], op)
                    best[key] = max(best.get(key, 0.0), r["ratio"][path][op])
    res["meets_bar"] = bool(best) and all(v >= (0.8 if op.endswith("layerwise") else 0.9) for (_, _, op), v in best.items()) \
        and res["d2d"]["ratio"]["copy_many"] >= 0.5
    faster = {}
    for r in res["layouts"]:
        for op in OPS:
            cand = {p: r["ratio"][p][op] for p in ("zerocopy", "staged") if p in r["ratio"]}
            if cand:
                w = max(cand, key=cand.get)
                faster[w] = faster.get(w, 0) + 1
    res["faster_path_counts"] = faster  # which default docs/gpu.md should name
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
