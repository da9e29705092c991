"""Prefix reuse: a shared system prompt served with different user turns, with and without kvstore.

Builds a small Llama-architecture model locally (seeded random weights from a ``LlamaConfig``,
no hub download), measures its prefill throughput and reports it (with its parameter count) at
Register so the daemon's load-or-recompute cost model is calibrated to this worker, starts a
private daemon (or uses ``--socket``), then:

* default: serves ``--turns`` user turns after one system prompt and prints, per turn, TTFT
  without kvstore (plain HF prefill) and with it, what the policy chose and why, and whether
  greedy generation gave exactly the tokens of plain generation;
* ``--table``: for system prompts of 256 to 4,096 tokens, TTFT with the prefix loaded from
  kvstore against full recompute (medians of ``--reps`` runs), the policy's choice at each, and
  whether it was the faster option.

    python examples/prefix_reuse.py
    python examples/prefix_reuse.py --table
    python examples/prefix_reuse.py --table --size tiny --dtype bf16

TTFT here is the time from the request to the logits of its last prompt token, including the
kvstore RPCs (Lookup, and Acquire when loading) and the copies out of the shared arena. Storing
the prompt's new blocks overlaps decoding and is not part of it. Timings on a shared machine are
noisy: compare the columns of one run, not numbers across runs.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from transformers import DynamicCache  # noqa: E402

from common import build_llama, model_id, plain_generate, random_tokens, start_daemon  # noqa: E402
from kvstore.clients import KVStoreClient  # noqa: E402
from kvstore.clients.hf import HFAdapter, HFAdapterConfig, measure_prefill_tokens_per_s, non_embedding_params  # noqa: E402

TIER_NAMES = {1: "hbm", 2: "dram", 3: "nvme", 4: "remote"}


@torch.no_grad()
def plain_ttft(model, ids: list[int]) -> tuple[float, int]:
    """Seconds to the last prompt token's logits with HF's own cache, and the first token."""
    t0 = time.perf_counter()
    out = model(torch.tensor([ids]), past_key_values=DynamicCache(), use_cache=True, logits_to_keep=1)
    first = int(out.logits[0, -1].argmax())
    return time.perf_counter() - t0, first


def kv_ttft(adapter: HFAdapter, ids: list[int], **cache_kw):
    """Seconds to the last prompt token's logits through kvstore, the first token, the cache."""
    t0 = time.perf_counter()
    cache = adapter.cache_for(ids, **cache_kw)
    logits, cache = adapter.prefill(ids, cache)
    first = int(logits.argmax())
    return time.perf_counter() - t0, first, cache


def tiers(plan) -> str:
    names = sorted({TIER_NAMES.get(t, str(t)) for t in plan.tiers})
    return "+".join(names) or "-"


def serve_turns(adapter: HFAdapter, model, args) -> int:
    vocab = model.config.vocab_size
    system = random_tokens(args.system_tokens, 1, vocab)
    lengths = [17, 40, 64, 23, 90, 5][: args.turns]
    print(f"system prompt {len(system)} tokens; {adapter.layout.block_tokens}-token blocks\n")
    print(f"{'turn':>4} {'prompt':>6} {'policy':>9} {'loaded':>6} {'tier':>5} {'TTFT plain ms':>13} "
          f"{'TTFT kvstore ms':>15} {'speedup':>7} {'identical':>9} {'copy/wait ms':>12}")
    ok = True
    for i, n in enumerate(lengths):
        ids = system + random_tokens(n, 100 + i, vocab)
        t_plain, first_plain = plain_ttft(model, ids)
        t_kv, first_kv, cache = kv_ttft(adapter, ids)
        cache.wait_stored()
        same = first_kv == first_plain
        if args.new_tokens:
            toks, _ = adapter.generate(ids, args.new_tokens, cache=adapter.cache_for(ids, store=False))
            same &= toks == plain_generate(model, ids, args.new_tokens)
        ok &= same
        p = cache.plan
        print(f"{i:>4} {len(ids):>6} {p.outcome:>9} {p.load_tokens:>6} {tiers(p):>5} {t_plain * 1e3:>13.1f} "
              f"{t_kv * 1e3:>15.1f} {t_plain / t_kv:>6.1f}x {str(same):>9} "
              f"{cache.timings['load_copy_s'] * 1e3:>6.2f}/{cache.timings['load_wait_s'] * 1e3:.2f}")
        if i < 2 or p.outcome not in ("load", "none"):
            print(f"     policy: {p.reason}")
    print("copy/wait: the side thread's layer copies out of the arena / the time the model blocked on them")
    print(f"\ngreedy tokens identical to plain generation for every turn: {ok}")
    return 0 if ok else 1


def ttft_table(adapter: HFAdapter, model, args) -> int:
    vocab = model.config.vocab_size
    rows, right = [], 0
    print(f"prefix-hit TTFT against full recompute; user turn {args.turn_tokens} tokens; median of {args.reps} runs\n")
    head = (f"{'prefix':>6} {'hit':>5} {'tier':>5} {'load ms':>8} {'recompute ms':>12} {'speedup':>7} "
            f"{'policy':>9} {'est load ms':>11} {'est recomp ms':>13} {'faster':>9} {'ok':>3} {'same':>4}")
    print(head)
    for n in args.lengths:
        system = random_tokens(n, 1000 + n, vocab)
        warm, turn = random_tokens(args.turn_tokens, 1, vocab), random_tokens(args.turn_tokens, 2, vocab)
        _, _, c = kv_ttft(adapter, system + warm)  # stores the prefix (and warms this prompt size up)
        c.wait_stored()
        ids = system + turn
        plain_ttft(model, ids)  # first run at a new shape pays one-off costs
        t_load, t_rec, t_pol, firsts = [], [], [], set()
        plan = None
        for _ in range(args.reps):
            t, f, c = kv_ttft(adapter, ids, follow_policy=False, store=False)
            t_load.append(t), firsts.add(f)
            t, f, _ = kv_ttft(adapter, ids, load=False, store=False)
            t_rec.append(t), firsts.add(f)
            t, f, pc = kv_ttft(adapter, ids, store=False)
            t_pol.append(t), firsts.add(f)
            plan = pc.plan
        ml, mr, mp = (statistics.median(x) for x in (t_load, t_rec, t_pol))
        faster = "load" if ml < mr else "recompute"
        choice = plan.outcome
        if choice == "partial":  # neither pure option: right if it beat both of them
            ok = mp <= min(ml, mr)
        else:
            ok = choice == faster
        right += ok
        rows.append(ok)
        print(f"{n:>6} {plan.hit_blocks * plan.block_tokens:>5} {tiers(plan):>5} {ml * 1e3:>8.1f} {mr * 1e3:>12.1f} "
              f"{mr / ml:>6.1f}x {choice:>9} {plan.est_load_s * 1e3:>11.3f} {plan.est_recompute_s * 1e3:>13.1f} "
              f"{faster:>9} {'yes' if ok else 'NO':>3} {str(len(firsts) == 1):>4}")
    share = right / len(rows)
    print(f"\npolicy picked the faster option in {right}/{len(rows)} prefix lengths ({share:.0%}; target >= 90%)")
    print("est load/recomp: the daemon's estimates (recompute of the whole matched prefix) from its measured or "
          "prior path bandwidths and this worker's reported prefill rate")
    return 0 if share >= 0.9 else 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--socket", help="use a running daemon at this socket instead of starting one")
    ap.add_argument("--size", default="small", choices=["tiny", "small"])
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--block-tokens", type=int, default=16)
    ap.add_argument("--system-tokens", type=int, default=1000)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=16, help="greedy tokens compared with plain generation")
    ap.add_argument("--table", action="store_true", help="print the TTFT table instead of serving turns")
    ap.add_argument("--lengths", type=lambda s: [int(x) for x in s.split(",")],
                    default=[256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096])
    ap.add_argument("--turn-tokens", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--calibrate-tokens", type=int, default=2048, help="prompt length of the throughput measurement")
    args = ap.parse_args(argv)

    torch.set_grad_enabled(False)
    model = build_llama(args.size, args.dtype, args.seed, max_positions=max(8192, max(args.lengths) + 256))
    tps = measure_prefill_tokens_per_s(model, args.calibrate_tokens)
    params = non_embedding_params(model)
    print(f"model llama-{args.size} {args.dtype}: {params / 1e6:.2f} M non-embedding parameters, "
          f"prefill {tps:,.0f} tokens/s at {args.calibrate_tokens} tokens (reported at Register)")
    daemon = None
    socket_path = args.socket
    if not socket_path:
        daemon = start_daemon(Path(tempfile.mkdtemp(prefix="kvstore-prefix-")), dram="512MiB")
        socket_path = daemon.socket_path
    client = KVStoreClient(socket_path)
    cfg = HFAdapterConfig(model_id(args.size, args.seed), block_tokens=args.block_tokens,
                          prefill_tokens_per_s=tps, model_params=float(params))
    adapter = HFAdapter(client, model, cfg)
    try:
        return ttft_table(adapter, model, args) if args.table else serve_turns(adapter, model, args)
    finally:
        adapter.close()
        client.close()
        if daemon is not None:
            daemon.stop()


if __name__ == "__main__":
    sys.exit(main())
