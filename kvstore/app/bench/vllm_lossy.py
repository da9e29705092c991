"""``kvstore bench vllm-lossy``: what a lossy namespace (the connector's ``kv_codec``: int8 or
fp8, kvstore.lossy) does to the real vLLM engine's outputs. A plain engine's greedy tokens and
top-5 log-probabilities are the reference. For each codec (and the exact namespace, as a
control), one engine with the KVStoreConnector stores the prompts (durable commits: on NVMe,
quantized, when they return), the daemon restarts (DRAM empty), and a fresh engine loads the
prompts' prefixes from NVMe, dequantized, and generates; its outputs are compared with the
reference: tokens equal up to where they first differ, top-1 log-probability deltas and top-5
overlap at the steps before that.

The model is a seeded random tiny Llama (``--size``): no trained causal LM installs from the
registries here, so these engine figures are a random-weight model's and are kept apart from
the element error on a trained model's KV (``kvstore bench codec``).
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

from kvstore.app.bench.vllm_engine import MODEL_SIZES, EngineProc, EngineSpec, save_llama
from kvstore.app.local import start_daemon

CODECS = ("", "int8", "fp8")  # "": the exact namespace, the control


def compare(ref: list[dict], got: list[dict]) -> dict:
    """Per prompt: generated tokens equal before the first difference; over the steps up to
    there (the first differing step included), top-1 log-probability deltas and top-5 overlap."""
    same, lengths, deltas, overlaps, cached = 0, [], [], [], []
    for r, g in zip(ref, got):
        n = next((i for i, (a, b) in enumerate(zip(r["tokens"], g["tokens"])) if a != b), len(r["tokens"]))
        same += n == len(r["tokens"])
        lengths.append(n)
        cached.append(g["cached_tokens"])
        for step in range(min(n + 1, len(r["logprobs"]), len(g["logprobs"]))):
            a, b = r["logprobs"][step], g["logprobs"][step]
            deltas.append(abs(a[0][1] - b[0][1]))
            overlaps.append(len({t for t, _ in a} & {t for t, _ in b}) / max(1, len(a)))
    return {"prompts_identical": same, "prompts": len(ref), "mean_tokens_before_first_difference": statistics.mean(lengths),
            "top1_logprob_delta_max": max(deltas), "top1_logprob_delta_mean": statistics.mean(deltas),
            "top5_overlap_mean": statistics.mean(overlaps), "cached_tokens_min": min(cached)}


def run(a) -> dict:
    rnd = random.Random(0)
    vocab = MODEL_SIZES[a.size]["vocab_size"]
    prompts = [[rnd.randrange(vocab) for _ in range(a.tokens)] for _ in range(a.prompts)]
    work = Path(tempfile.mkdtemp(prefix="kvstore-bench-lossy-", dir=a.dir))
    flags = ("--dram-capacity-bytes", "1GiB", "--dram-extent-bytes", "4MiB", "--nvme-dir", str(work / "nvme"),
             "--nvme-capacity-bytes", "2GiB", "--nvme-file-bytes", "1GiB", "--nvme-durable-commit", "true")
    d, rows = None, {}
    try:
        model = str(save_llama(work / "model", a.size, dtype=a.dtype, max_positions=a.tokens + 64))
        spec = dict(model=model, dtype=a.dtype, block_size=32, max_model_len=a.tokens + a.max_tokens + 32)
        with EngineProc.start(EngineSpec(**spec), work / "plain.log") as plain:
            ref = plain.generate(prompts, max_tokens=a.max_tokens, logprobs=5)["results"]
        d = start_daemon(work, "kvstore", *flags)
        for codec in CODECS:
            extra = {"kvstore_socket": d.socket_path, "follow_policy": False, **({"kv_codec": codec} if codec else {})}
            ktc = {"kv_connector": "KVStoreConnector", "kv_connector_module_path": "kvstore.clients.vllm_connector",
                   "kv_role": "kv_both", "kv_connector_extra_config": extra}
            with EngineProc.start(EngineSpec(**spec, kv_transfer=ktc), work / f"store-{codec or 'exact'}.log") as w:
                w.generate(prompts, max_tokens=1, logprobs=0)
            d.stop()
            d = start_daemon(work, "kvstore", *flags)  # DRAM empty: every load reads NVMe
            extra["kvstore_socket"] = d.socket_path
            with EngineProc.start(EngineSpec(**spec, kv_transfer=ktc), work / f"load-{codec or 'exact'}.log") as r:
                got = r.generate(prompts, max_tokens=a.max_tokens, logprobs=5)["results"]
            rows[codec or "exact"] = compare(ref, got)
    finally:
        if d is not None:
            d.stop()
        shutil.rmtree(work, ignore_errors=True)
    exact = rows["exact"]
    return {"bench": "vllm-lossy", "model": f"random-weight Llama ({a.size}), {a.dtype}", "tokens": a.tokens,
            "max_tokens": a.max_tokens, "rows": rows,
            # the control: loaded from NVMe exact, the outputs must be the plain engine's
            "verified": exact["prompts_identical"] == exact["prompts"] and exact["top1_logprob_delta_max"] < 1e-3
            and all(x["cached_tokens_min"] > 0 for x in rows.values())}


def table(r: dict) -> str:
    lines = [f"kvstore bench vllm-lossy: {r['model']}; prompts of {r['tokens']} tokens loaded from NVMe after a "
             f"daemon restart, then {r['max_tokens']} greedy tokens, against a plain engine's",
             f"{'namespace':>10}{'identical':>11}{'tokens before diff':>20}{'top-1 dlogp max':>17}{'mean':>9}"
             f"{'top-5 overlap':>15}{'cached min':>12}"]
    for name, x in r["rows"].items():
        lines.append(f"{name:>10}{x['prompts_identical']:>6}/{x['prompts']:<4}{x['mean_tokens_before_first_difference']:>20.2f}"
                     f"{x['top1_logprob_delta_max']:>17.4f}{x['top1_logprob_delta_mean']:>9.4f}"
                     f"{x['top5_overlap_mean']:>15.3f}{x['cached_tokens_min']:>12}")
    lines.append("control (exact namespace equal to the plain engine, every run loaded): "
                 + ("verified" if r["verified"] else "NOT VERIFIED"))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvstore bench vllm-lossy", description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", choices=sorted(MODEL_SIZES), default="small", help="random-weight Llama size")
    ap.add_argument("--dtype", default="float32", help="the model's (and KV's) dtype: float32 or bfloat16")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=512, help="prompt length")
    ap.add_argument("--max-tokens", type=int, default=16, help="greedy tokens generated per prompt")
    ap.add_argument("--dir", default="/var/tmp", help="where the temporary model and daemon files go")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(sys.argv[1:] if argv is None else argv)
    r = run(a)
    print(json.dumps(r, indent=2) if a.json else table(r))
    return 0 if r["verified"] else 1


if __name__ == "__main__":
    sys.exit(main())
