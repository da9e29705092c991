"""Disaggregated prefill and decode through two kvstore daemons.

A prefill process runs the prompt against daemon A (the prompt's full blocks are stored there),
then asks A to ship them to daemon B's transfer listener (the ``Transfer`` RPC). A decode
process, which talks only to daemon B, loads that prefix from B, recomputes the partial last
block and generates. The tokens must equal a single-process plain HF generation.

    python examples/disaggregated.py                  # starts A and B, runs both roles, compares
    python examples/disaggregated.py prefill --socket A.sock --peer 127.0.0.1:7070 --prompt-json '[...]'
    python examples/disaggregated.py decode  --socket B.sock --prompt-json '[...]'

Each role prints one JSON line per dtype. Exit status: 0 identical, 1 different, 3 the daemon's
Transfer RPC is not available (transfer listener off or not implemented).

The ship here runs after the prefill committed its blocks (``pipelined=False``): the client's
store commits whole blocks, so per-layer pipelining would need a per-layer commit in the API.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import grpc  # noqa: E402

from common import build_llama, free_port, model_id, plain_generate, random_tokens, start_daemon  # noqa: E402

TRANSFER_UNAVAILABLE = 3


def _adapter(socket_path: str, size: str, dtype: str, seed: int, block_tokens: int):
    from kvstore.clients import KVStoreClient
    from kvstore.clients.hf import HFAdapter, HFAdapterConfig

    model = build_llama(size, dtype, seed)
    client = KVStoreClient(socket_path)
    return HFAdapter(client, model, HFAdapterConfig(model_id(size, seed), block_tokens=block_tokens))


def run_prefill(args) -> int:
    """Prefill against daemon A, then ship the prompt's full blocks to ``--peer``."""
    from kvstore.clients import KVStoreError
    from kvstore.clients.client import pack
    from kvstore.v1 import kvstore_pb2 as pb

    prompt = json.loads(args.prompt_json)
    for dtype in args.dtypes.split(","):
        a = _adapter(args.socket, args.size, dtype, args.seed, args.block_tokens)
        try:
            t0 = time.perf_counter()
            logits, cache = a.prefill(prompt)
            first = int(logits.argmax())
            ttft = time.perf_counter() - t0
            stored = cache.wait_stored()
            keys = a.client.keys(prompt)
            try:
                r = a.client.call("Transfer", pb.TransferRequest(
                    session_id=a.client.session_id, keys=pack(keys), peer=args.peer, deadline_s=args.deadline_s),
                    timeout_s=args.deadline_s + 10)
            except KVStoreError as e:
                if e.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNIMPLEMENTED):
                    print(f"transfer unavailable: {e}", file=sys.stderr)
                    return TRANSFER_UNAVAILABLE
                raise
            print(json.dumps({"role": "prefill", "dtype": dtype, "first_token": first, "ttft_s": ttft,
                              "stored_blocks": stored, "transferred_blocks": r.blocks, "bytes": r.bytes,
                              "transfer_s": r.seconds}), flush=True)
        finally:
            a.close()
            a.client.close()
    return 0


def run_decode(args) -> int:
    """Register on daemon B (the decode worker is up before the prefill ships); with
    ``--wait-stdin``, say so and wait for a line on stdin; then load the shipped prefix from B
    and generate."""
    prompt = json.loads(args.prompt_json)
    adapters = {dtype: _adapter(args.socket, args.size, dtype, args.seed, args.block_tokens)
                for dtype in args.dtypes.split(",")}
    try:
        if args.wait_stdin:
            print(json.dumps({"role": "decode", "ready": True}), flush=True)
            sys.stdin.readline()
        for dtype, a in adapters.items():
            cache = a.cache_for(prompt, store=False)
            tokens, cache = a.generate(prompt, args.new_tokens, cache=cache)
            print(json.dumps({"role": "decode", "dtype": dtype, "tokens": tokens, "loaded_tokens": cache.loaded_tokens,
                              "tiers": list(cache.plan.tiers), "policy": cache.plan.outcome}), flush=True)
    finally:
        for a in adapters.values():
            a.close()
            a.client.close()
    return 0


def _role_cmd(role: str, socket_path: str, args, prompt) -> list[str]:
    return [sys.executable, __file__, role, "--socket", socket_path, "--size", args.size, "--dtypes", args.dtypes,
            "--seed", str(args.seed), "--block-tokens", str(args.block_tokens), "--prompt-json", json.dumps(prompt),
            "--new-tokens", str(args.new_tokens)]


def _json_lines(text: str) -> list[dict]:
    return [json.loads(x) for x in text.splitlines() if x.startswith("{")]


def run_all(args) -> int:
    """Start daemons A and B, run the prefill and decode roles as two processes, compare."""
    vocab = build_llama(args.size, "fp32", args.seed).config.vocab_size
    prompt = random_tokens(args.system_tokens, 1, vocab) + random_tokens(args.turn_tokens, 2, vocab)
    work = Path(tempfile.mkdtemp(prefix="kvstore-disagg-"))
    port = free_port()
    da = start_daemon(work / "a", "--transport-listen", f"127.0.0.1:{free_port()}", "--transport-backend",
                      args.backend, name="prefill")
    db = start_daemon(work / "b", "--transport-listen", f"127.0.0.1:{port}", "--transport-backend", args.backend,
                      name="decode")
    decode = None
    try:
        # The decode process starts first and registers on B, then waits for the prefill.
        decode = subprocess.Popen(_role_cmd("decode", db.socket_path, args, prompt) + ["--wait-stdin"],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        ready = decode.stdout.readline()
        if not ready.startswith("{"):
            print(f"decode process did not start: {ready}{decode.stderr.read()}", file=sys.stderr)
            return 1
        p = subprocess.run(_role_cmd("prefill", da.socket_path, args, prompt) + ["--peer", f"127.0.0.1:{port}"],
                           capture_output=True, text=True, timeout=600)
        if p.returncode == TRANSFER_UNAVAILABLE:
            print(f"Transfer RPC not available on daemon A: {p.stderr.strip()}")
            return TRANSFER_UNAVAILABLE
        if p.returncode:
            print(p.stderr, file=sys.stderr)
            return p.returncode
        pre = _json_lines(p.stdout)
        out, err = decode.communicate("go\n", timeout=600)
        if decode.returncode:
            print(err, file=sys.stderr)
            return decode.returncode
        dec = _json_lines(out)
    finally:
        if decode is not None and decode.poll() is None:
            decode.kill()
            decode.wait()
        da.stop()
        db.stop()
    ok = True
    print(f"prompt {len(prompt)} tokens, {args.block_tokens}-token blocks, model llama-{args.size}")
    for p, d in zip(pre, dec):
        ref = plain_generate(build_llama(args.size, p["dtype"], args.seed), prompt, args.new_tokens)
        same = d["tokens"] == ref and d["tokens"][0] == p["first_token"]
        ok &= same
        print(f"{p['dtype']}: prefill TTFT {p['ttft_s'] * 1e3:.1f} ms, stored {p['stored_blocks']} blocks, "
              f"shipped {p['transferred_blocks']} blocks ({p['bytes']} bytes) in {p['transfer_s'] * 1e3:.1f} ms; "
              f"decode loaded {d['loaded_tokens']} tokens ({d['policy']}); tokens identical to single-process: {same}")
    return 0 if ok else 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("role", nargs="?", default="all", choices=["all", "prefill", "decode"])
    ap.add_argument("--socket", help="daemon socket for the prefill / decode role")
    ap.add_argument("--peer", default="", help="host:port of daemon B's transfer listener (prefill role)")
    ap.add_argument("--size", default="tiny", choices=["tiny", "small"])
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--block-tokens", type=int, default=16)
    ap.add_argument("--prompt-json", default="", help="prompt token ids as a JSON list (roles)")
    ap.add_argument("--system-tokens", type=int, default=200)
    ap.add_argument("--turn-tokens", type=int, default=37)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--deadline-s", type=float, default=30.0)
    ap.add_argument("--backend", default="tcp", choices=["tcp", "ucx"])
    ap.add_argument("--wait-stdin", action="store_true", help="decode role: register, then wait for a line on stdin")
    args = ap.parse_args(argv)
    if args.role == "all":
        return run_all(args)
    if not args.socket or not args.prompt_json:
        ap.error(f"{args.role}: --socket and --prompt-json are required")
    if args.role == "prefill" and not args.peer:
        ap.error("prefill: --peer is required")
    return run_prefill(args) if args.role == "prefill" else run_decode(args)


if __name__ == "__main__":
    sys.exit(main())
