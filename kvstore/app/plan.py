"""``kvstore plan``: KV sizing and capacity planning from a model config.

Units: sizes are bytes (B); GB = 10^9 bytes and GiB = 2^30 bytes; GB/s = 10^9 bytes/s and
Gbit/s = 10^9 bits/s. A bare number given for a size is GB, for a rate GB/s; token counts
accept a ``k`` suffix meaning 1024 tokens (``4k`` = 4096), as context lengths are quoted.

The assumptions behind the figures are listed in ``ASSUMPTIONS`` and printed with them.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
from dataclasses import dataclass, field

from kvstore.config import GB, parse_size
from kvstore.layout import DType, LayoutError
from kvstore.modelcfg import SCALE_NOTE, ModelConfig, load_config, load_preset, preset_names
from kvstore.policy import LoadPolicyConfig, PrefillCostModel

GIB = 2**30
UNITS = "B = bytes; GB = 10^9 B; GiB = 2^30 B; GB/s = 10^9 B/s; Gbit/s = 10^9 bit/s"
SIZE_DTYPES = (DType.BF16, DType.FP16, DType.FP8_E4M3, DType.INT8, DType.INT4)
ASSUMPTIONS = (
    "weights are all at one dtype and split evenly over the tensor-parallel (TP) group",
    "KV heads are split over the TP group; MLA's one latent is replicated on every GPU",
    "paged allocation wastes (block_tokens - 1) / 2 tokens per request on average in its last "
    "block (lengths uniform modulo the block size), never more than a full context",
    "a shared prefix is cached and shared in whole blocks only",
    "to load a prefix, every GPU loads its own KV shard over its own link; load and recompute "
    "are not overlapped; per-transfer latency is left out (the daemon's policy measures it)",
    "disaggregated serving ships each prompt's KV once, minus the shared prefix the decode side caches",
)
# Nominal one-direction speeds; pass --link NAME=RATE with measured figures instead.
DEFAULT_LINKS = (("pcie4-x16", 25e9), ("pcie5-x16", 50e9), ("nvme-gen4", 7e9),
                 ("ib-ndr-400g", 50e9), ("eth-100g", 12.5e9))

_RATE_UNITS = {"": GB, "B/s": 1, "KB/s": 1e3, "MB/s": 1e6, "GB/s": 1e9, "TB/s": 1e12,
               "KiB/s": 2**10, "MiB/s": 2**20, "GiB/s": 2**30,
               "Mbit/s": 1e6 / 8, "Gbit/s": 1e9 / 8, "Tbit/s": 1e12 / 8,
               "Mb/s": 1e6 / 8, "Gb/s": 1e9 / 8, "Tb/s": 1e12 / 8, "Mbps": 1e6 / 8, "Gbps": 1e9 / 8}
_NUMBER = re.compile(r"^\s*(-?[0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z/]*)\s*$")


class PlanError(ValueError):
    """A plan input is out of range; the message names the option."""


def parse_plan_size(text: str, name: str = "size", *, allow_zero: bool = False) -> int:
    """Bytes from a size option: ``80``, ``80GB``, ``80GiB``, ``512MiB``. Unlike the daemon's
    config, where a bare number is bytes, a bare number here is GB (10^9 B): GPU memory is
    quoted in GB. The grammar is :func:`kvstore.config.parse_size`'s."""
    try:
        value = parse_size(text, bare=GB)
    except ValueError:
        raise PlanError(f"{name}: cannot read size {text!r}; use e.g. 80GB (10^9 B) or 80GiB (2^30 B)") from None
    if value < 0 or (value == 0 and not allow_zero):
        raise PlanError(f"{name}: must be > 0, got {text!r}")
    return value


def parse_rate(text: str, name: str = "rate") -> float:
    """Bytes/s from ``25GB/s``, ``400Gbit/s``, ``400Gbps``, ``24GiB/s`` (bare number: GB/s)."""
    m = _NUMBER.match(str(text))
    unit = _RATE_UNITS.get(m.group(2)) if m else None
    if unit is None:
        raise PlanError(f"{name}: cannot read rate {text!r}; use e.g. 25GB/s or 400Gbit/s")
    value = float(m.group(1)) * unit
    if value <= 0:
        raise PlanError(f"{name}: must be > 0, got {text!r}")
    return value


def parse_tokens(text: str, name: str = "tokens") -> int:
    """Token count from ``4096`` or ``4k`` (k = 1024 tokens)."""
    s = str(text).strip().lower()
    try:
        value = int(s[:-1]) * 1024 if s.endswith("k") else int(s)
    except ValueError:
        raise PlanError(f"{name}: cannot read token count {text!r}; use e.g. 4096 or 4k") from None
    if value < 0:
        raise PlanError(f"{name}: must be >= 0, got {text!r}")
    return value


@dataclass(frozen=True, slots=True)
class PlanOptions:
    """Deployment inputs. Sizes in bytes, rates in bytes/s, lengths in tokens."""

    kv_dtype: DType = DType.BF16
    weight_dtype: DType | None = None        # None: the config's (torch_dtype / quantization)
    block_tokens: int = 16
    gpu_mem_bytes: int = 80 * GB
    tp: int = 1
    overhead_bytes: int = 5 * GB             # per GPU: CUDA context, activations, graphs, NCCL
    context_tokens: int = 4096               # reserved per request by contiguous allocation
    mean_tokens: int | None = None           # mean actual length (prompt + output); None: context
    mean_prompt_tokens: int | None = None    # mean prompt length; None: mean_tokens
    shared_prefix_tokens: int = 0
    hit_rate: float = 1.0
    params: int | None = None                # overrides the counted parameters
    prefill_tokens_per_s: float | None = None  # measured, whole TP group, at prefill_ref_tokens
    prefill_ref_tokens: int = 2048
    gpu_flops_per_s: float = LoadPolicyConfig().default_prefill_flops_per_s  # effective, per GPU
    links: tuple[tuple[str, float], ...] = field(default=DEFAULT_LINKS)
    request_rate: float = 0.0                # requests/s for the disaggregated section; 0: skip
    dram_bytes: int = 0                      # kvstore's DRAM tier on a node; 0 with nvme_bytes 0: skip
    nvme_bytes: int = 0                      # kvstore's NVMe tier on a node
    codec_ratio: float = 1.0                 # raw bytes per NVMe slot byte with nvme.codec (kvstore bench codec)

    def __post_init__(self) -> None:
        for flag, value in (("--block-tokens", self.block_tokens), ("--gpu-mem", self.gpu_mem_bytes),
                            ("--tp", self.tp), ("--context", self.context_tokens),
                            ("--prefill-ref", self.prefill_ref_tokens)):
            if value <= 0:
                raise PlanError(f"{flag}: must be > 0, got {value}")
        for flag, value in (("--overhead", self.overhead_bytes), ("--shared-prefix", self.shared_prefix_tokens),
                            ("--rate", self.request_rate)):
            if value < 0:
                raise PlanError(f"{flag}: must be >= 0, got {value}")
        for flag, value in (("--params", self.params), ("--prefill-tps", self.prefill_tokens_per_s),
                            ("--mean-len", self.mean_tokens), ("--mean-prompt", self.mean_prompt_tokens)):
            if value is not None and value <= 0:
                raise PlanError(f"{flag}: must be > 0, got {value}")
        for flag, value in (("--dram", self.dram_bytes), ("--nvme", self.nvme_bytes)):
            if value < 0:
                raise PlanError(f"{flag}: must be >= 0, got {value}")
        if not 1.0 <= self.codec_ratio <= 8.0:
            raise PlanError(f"--codec-ratio: must be in [1, 8] (raw bytes per stored byte), got {self.codec_ratio}")
        if not self.gpu_flops_per_s > 0:
            raise PlanError(f"--gpu-tflops: must be > 0, got {self.gpu_flops_per_s / 1e12}")
        if not 0.0 <= self.hit_rate <= 1.0:
            raise PlanError(f"--hit-rate: must be in [0, 1], got {self.hit_rate}")
        if self.mean > self.context_tokens:
            raise PlanError(f"--mean-len: {self.mean} exceeds --context {self.context_tokens}")
        if self.prompt > self.mean:
            raise PlanError(f"--mean-prompt: {self.prompt} exceeds the mean length {self.mean}")
        if self.shared_prefix_tokens > self.prompt:
            raise PlanError(f"--shared-prefix: {self.shared_prefix_tokens} exceeds the mean prompt {self.prompt}")

    @property
    def mean(self) -> int:
        return self.context_tokens if self.mean_tokens is None else self.mean_tokens

    @property
    def prompt(self) -> int:
        return self.mean if self.mean_prompt_tokens is None else self.mean_prompt_tokens


def _crossover_tokens(bytes_per_token: float, link: float, cost: PrefillCostModel) -> int | None:
    """Smallest prefix (tokens) whose load over ``link`` is no slower than its recompute;
    None when recompute always wins. Load n*b/link vs (a*n + c*n(n+1)/2)/R."""
    per_token = bytes_per_token * cost.flops_per_s / link   # load cost in FLOP-equivalents/token
    if per_token <= cost.linear_flops_per_token + cost.attn_flops_per_pair:
        return 1
    if cost.attn_flops_per_pair == 0:
        return None
    return math.ceil(2 * (per_token - cost.linear_flops_per_token) / cost.attn_flops_per_pair - 1)


def build_plan(model: ModelConfig, opts: PlanOptions) -> dict:
    """The whole plan as a JSON-ready dict (bytes, seconds, bytes/s, tokens)."""
    bt, tp, ctx = opts.block_tokens, opts.tp, opts.context_tokens
    heads_gpu = model.kv_heads_per_gpu(tp)
    params = opts.params or model.params()
    active = opts.params or model.params(active=True)
    wdt = opts.weight_dtype or model.weight_dtype
    sizes = []

    def gpu_token_bytes(dt: DType) -> int:   # one GPU's KV shard per token, scales included
        return model.gpu_layout(dt, tp, bt).bytes_per_token + model.scale_bytes_per_token(dt, heads_gpu or None)

    for dt in SIZE_DTYPES:
        lay = model.layout(dt, bt)
        sizes.append({"dtype": dt.label, "bytes_per_token_layer": lay.bytes_per_token_layer,
                      "bytes_per_token": lay.bytes_per_token, "bytes_per_block": lay.block_bytes,
                      "bytes_per_request": lay.bytes_per_token * ctx,
                      "scale_bytes_per_token": model.scale_bytes_per_token(dt),
                      "gpu_bytes_per_request": gpu_token_bytes(dt) * ctx})
    kv = model.layout(opts.kv_dtype, bt)
    mha = model.mha_bytes_per_token(opts.kv_dtype)
    tok_gpu = gpu_token_bytes(opts.kv_dtype)
    tok_all = kv.bytes_per_token + model.scale_bytes_per_token(opts.kv_dtype)

    weights = math.ceil(params * wdt.bits / 8)
    weights_gpu = math.ceil(weights / tp)
    headroom = opts.gpu_mem_bytes - opts.overhead_bytes - weights_gpu
    usable = max(headroom, 0)
    blocks_gpu = usable // (bt * tok_gpu)
    # E[ceil(len / bt)] with lengths uniform modulo bt, but never more than a full context.
    exp_blocks = min((opts.mean + (bt - 1) / 2) / bt, math.ceil(ctx / bt))
    shared_blocks = opts.shared_prefix_tokens // bt
    own_blocks = exp_blocks - opts.hit_rate * shared_blocks
    capacity = {
        "gpu_mem_bytes": opts.gpu_mem_bytes, "tp": tp, "weight_dtype": wdt.label, "params": params,
        "weight_bytes": weights, "weight_bytes_per_gpu": weights_gpu, "overhead_bytes_per_gpu": opts.overhead_bytes,
        "kv_headroom_bytes_per_gpu": headroom, "kv_headroom_bytes_per_group": headroom * tp,
        "fits": headroom > 0, "kv_dtype": opts.kv_dtype.label, "kv_bytes_per_token_per_gpu": tok_gpu,
        "kv_sharding": "replicated (MLA latent)" if model.is_mla else f"{heads_gpu} of {model.num_kv_heads} KV heads per GPU",
        "context_tokens": ctx, "kv_bytes_per_request_per_gpu": ctx * tok_gpu,
        "max_requests_contiguous": usable // (ctx * tok_gpu),
        "kv_blocks_per_gpu": blocks_gpu, "kv_tokens_per_gpu": blocks_gpu * bt,
        "mean_tokens": opts.mean, "mean_last_block_waste_tokens": exp_blocks * bt - opts.mean,
        "max_requests_paged": math.floor(blocks_gpu / exp_blocks),
        "max_requests_paged_shared_prefix": (math.floor((blocks_gpu - shared_blocks) / own_blocks)
                                             if shared_blocks and blocks_gpu > shared_blocks else None),
    }
    cost = PrefillCostModel.for_model(model, tokens_per_s=opts.prefill_tokens_per_s,
                                      ref_tokens=opts.prefill_ref_tokens,
                                      flops_per_s=opts.gpu_flops_per_s * tp, params=opts.params)
    cached = opts.hit_rate * shared_blocks * bt
    full = cost.seconds(0, opts.prompt)
    with_cache = opts.hit_rate * cost.seconds(shared_blocks * bt, opts.prompt) + (1 - opts.hit_rate) * full
    prefix = {"shared_prefix_tokens": opts.shared_prefix_tokens, "cached_tokens_per_block_boundary": shared_blocks * bt,
              "hit_rate": opts.hit_rate, "mean_prompt_tokens": opts.prompt,
              "prefill_tokens_saved_per_request": cached,
              "prefill_tokens_saved_fraction": cached / opts.prompt,
              "prefill_s_per_request": full, "prefill_s_per_request_cached": with_cache,
              "prefill_time_saved_fraction": 1 - with_cache / full,
              "prefill_tokens_saved_per_s": cached * opts.request_rate}
    n = shared_blocks * bt or opts.prompt
    recompute = cost.seconds(0, n)
    crossover = [{"link": name, "bytes_per_s": bw, "prefix_tokens": n, "load_s": n * tok_gpu / bw,
                  "recompute_s": recompute, "faster": "load" if n * tok_gpu / bw <= recompute else "recompute",
                  "crossover_bytes_per_s": n * tok_gpu / recompute,
                  "load_wins_from_tokens": _crossover_tokens(tok_gpu, bw, cost)} for name, bw in opts.links]
    report = {
        "units": UNITS,
        "model": {"name": model.name, "kind": model.kind.value, "layers": model.num_layers,
                  "attention_heads": model.num_heads, "kv_heads": model.num_kv_heads,
                  "head_dim": model.head_dim, "kv_lora_rank": model.kv_lora_rank,
                  "qk_rope_head_dim": model.qk_rope_head_dim, "params": params, "params_active": active},
        "block_tokens": bt, "request_tokens": ctx, "kv_sizes": sizes, "scale_note": SCALE_NOTE,
        "mha_equivalent": {"kv_dtype": opts.kv_dtype.label, "bytes_per_token": mha,
                           "saving_factor": mha / kv.bytes_per_token},
        "capacity": capacity, "prefix_cache": prefix,
        "prefill_model": {"linear_flops_per_token": cost.linear_flops_per_token,
                          "attn_flops_per_pair": cost.attn_flops_per_pair, "flops_per_s": cost.flops_per_s,
                          "calibration": (
                              f"{opts.prefill_tokens_per_s} tokens/s at {opts.prefill_ref_tokens} tokens"
                              if opts.prefill_tokens_per_s else f"{opts.gpu_flops_per_s / 1e12:g} TFLOP/s per GPU x {tp}")},
        "crossover": crossover, "disaggregated": None, "hybrid": _hybrid(model, opts, tok_gpu),
        "kvstore_tiers": _tiers(kv.block_bytes, bt, opts),
        "assumptions": list(ASSUMPTIONS), "warnings": [],
    }
    if headroom <= 0:
        report["warnings"].append(f"weights ({weights_gpu:,} B per GPU) plus overhead exceed --gpu-mem; raise --tp")
    if model.max_position_embeddings and ctx > model.max_position_embeddings:
        report["warnings"].append(f"--context {ctx:,} exceeds the model's max_position_embeddings "
                                  f"{model.max_position_embeddings:,}")
    if opts.request_rate:
        shipped = opts.prompt - cached   # the decode side's cache already holds the shared prefix
        need = opts.request_rate * shipped * tok_all
        report["disaggregated"] = {"request_rate": opts.request_rate, "shipped_tokens_per_request": shipped,
                                   "bytes_per_request": shipped * tok_all, "bytes_per_s": need,
                                   "links_needed": {name: math.ceil(need / bw) for name, bw in opts.links}}
    return report


def _tiers(block_bytes: int, bt: int, opts: PlanOptions) -> dict | None:
    """Prefix tokens kvstore's tiers on one node hold (whole blocks of the model's whole KV):
    DRAM raw, NVMe raw and with the codec at ``codec_ratio`` (what ``kvstore bench codec --nvme``
    or ``kvstore stats`` measured: raw bytes per slot byte)."""
    if not (opts.dram_bytes or opts.nvme_bytes):
        return None
    dram = opts.dram_bytes // block_bytes
    nvme = opts.nvme_bytes // block_bytes
    coded = math.floor(opts.nvme_bytes * opts.codec_ratio / block_bytes)
    return {"block_bytes": block_bytes, "dram_bytes": opts.dram_bytes, "nvme_bytes": opts.nvme_bytes,
            "codec_ratio": opts.codec_ratio, "dram_blocks": dram, "dram_tokens": dram * bt,
            "nvme_blocks": nvme, "nvme_tokens": nvme * bt, "nvme_blocks_with_codec": coded,
            "nvme_tokens_with_codec": coded * bt,
            "prefixes_of_shared_prefix": (None if not opts.shared_prefix_tokens
                                          else (dram + coded) // max(1, opts.shared_prefix_tokens // bt))}


def _hybrid(model: ModelConfig, opts: PlanOptions, tok_gpu: int) -> dict | None:
    """Per-GPU KV of a hybrid model's request by layer kind: full layers per token, windowed
    layers for at most ``sliding_window`` tokens (rounded up to whole blocks, plus the block a
    window straddles, as vLLM's hybrid manager keeps them), linear-attention layers one state
    per sequence. Against the same request when every windowed layer keeps the whole context
    (vLLM with its hybrid manager off)."""
    if not model.is_hybrid:
        return None
    bt, ctx = opts.block_tokens, opts.context_tokens
    per_layer = tok_gpu // max(model.kv_layers, 1)          # B/token of one attention layer on one GPU
    full, sliding, linear = (model.layers_of(k) for k in ("full", "sliding", "linear"))
    window_tokens = min(ctx, (math.ceil(model.sliding_window / bt) + 1) * bt) if sliding else 0
    state = model.state_bytes_per_layer(opts.tp)
    hma = full * per_layer * ctx + sliding * per_layer * window_tokens + linear * state
    whole = (full + sliding) * per_layer * ctx + linear * state
    return {"full_layers": full, "sliding_layers": sliding, "linear_layers": linear,
            "sliding_window": model.sliding_window, "kv_bytes_per_token_per_layer_per_gpu": per_layer,
            "full_layer_bytes_per_token_per_gpu": full * per_layer,
            "windowed_tokens_kept": window_tokens, "windowed_bytes_per_request_per_gpu": sliding * per_layer * window_tokens,
            "state_bytes_per_layer_per_gpu": state, "state_bytes_per_request_per_gpu": linear * state,
            "bytes_per_request_per_gpu": hma, "bytes_per_request_per_gpu_every_layer_whole": whole,
            "saving_factor": whole / hma if hma else None}


def _gb(n: float) -> str:
    return f"{n / GB:,.3f} GB"


def render(r: dict) -> str:
    """Human-readable tables of a :func:`build_plan` report."""
    m, c, p, pm = r["model"], r["capacity"], r["prefix_cache"], r["prefill_model"]
    shape = (f"MLA latent {m['kv_lora_rank']} + rope {m['qk_rope_head_dim']}" if m["kind"] == "mla"
             else f"{m['kv_heads']} KV heads x {m['head_dim']}")
    out = [f"kvstore plan: {m['name']}  ({m['kind']}, {m['layers']} layers, {shape}; "
           f"{m['params']:,} params, {m['params_active']:,} active)",
           f"units: {r['units']}", "",
           f"KV size ({r['block_tokens']} tokens per block; request = {r['request_tokens']:,} tokens; "
           f"per GPU at TP={c['tp']}: {c['kv_sharding']})",
           f"  {'dtype':<9}{'B/token/layer':>14}{'B/token':>12}{'B/block':>14}{'B/request':>16}"
           f"{'GB/request':>12}{'GB/req/GPU':>12}{'+scales B/tok':>15}"]
    for s in r["kv_sizes"]:
        out.append(f"  {s['dtype']:<9}{s['bytes_per_token_layer']:>14,}{s['bytes_per_token']:>12,}"
                   f"{s['bytes_per_block']:>14,}{s['bytes_per_request']:>16,}{s['bytes_per_request'] / GB:>12.3f}"
                   f"{s['gpu_bytes_per_request'] / GB:>12.3f}{s['scale_bytes_per_token']:>15,}")
    h = r["mha_equivalent"]
    out += [f"  scales: {r['scale_note']}",
            f"  as full MHA ({m['attention_heads']} heads) this model would store {h['bytes_per_token']:,} B/token "
            f"in {h['kv_dtype']}: {m['kind'].upper()} saves {h['saving_factor']:.2f}x", "",
            f"Capacity (TP={c['tp']} x {_gb(c['gpu_mem_bytes'])} GPUs, weights {c['weight_dtype']}, KV {c['kv_dtype']})",
            f"  weights                    {_gb(c['weight_bytes'])} ({c['params']:,} params), "
            f"{_gb(c['weight_bytes_per_gpu'])} per GPU",
            f"  runtime overhead           {_gb(c['overhead_bytes_per_gpu'])} per GPU",
            f"  KV headroom                {_gb(c['kv_headroom_bytes_per_gpu'])} per GPU, "
            f"{_gb(c['kv_headroom_bytes_per_group'])} per TP group" + ("" if c["fits"] else "  (weights do not fit)"),
            f"  KV per request per GPU     {c['kv_bytes_per_request_per_gpu']:,} B ({c['context_tokens']:,} tokens x "
            f"{c['kv_bytes_per_token_per_gpu']:,} B)",
            "  max concurrent requests per TP group:"]
    rows = [(f"contiguous ({c['context_tokens']:,} tokens reserved)", c["max_requests_contiguous"], ""),
            (f"paged (mean {c['mean_tokens']:,} + {c['mean_last_block_waste_tokens']:g} last-block waste)",
             c["max_requests_paged"], f"   ({c['kv_blocks_per_gpu']:,} blocks of {r['block_tokens']} tokens per GPU)"),
            ("paged, shared prefix stored once", c["max_requests_paged_shared_prefix"], "")]
    out += [f"    {label:<48}{n:>8,}{note}" for label, n, note in rows if n is not None]
    hy = r["hybrid"]
    if hy:
        out += ["", f"Hybrid layers per GPU for one {c['context_tokens']:,}-token request "
                    f"({hy['full_layers']} full, {hy['sliding_layers']} sliding-window, {hy['linear_layers']} linear-attention)",
                f"  full attention             {hy['full_layer_bytes_per_token_per_gpu']:,} B/token "
                f"x {c['context_tokens']:,} tokens"]
        if hy["sliding_layers"]:
            out.append(f"  sliding window {hy['sliding_window']:<11,} {hy['windowed_bytes_per_request_per_gpu']:,} B "
                       f"({hy['windowed_tokens_kept']:,} tokens kept x {hy['sliding_layers']} layers)")
        if hy["linear_layers"]:
            out.append(f"  linear-attention state     {hy['state_bytes_per_request_per_gpu']:,} B "
                       f"({hy['state_bytes_per_layer_per_gpu']:,} B per layer, any length)")
            out.append(f"  kvstore per cached prefix  the attention layers' blocks (KV size above, "
                       f"{hy['full_layers'] + hy['sliding_layers']} of {m['layers']} layers) + one state snapshot of "
                       f"{hy['state_bytes_per_request_per_gpu']:,} B per GPU at each boundary vLLM keeps")
        out.append(f"  per request                {hy['bytes_per_request_per_gpu']:,} B; with every windowed layer "
                   f"whole {hy['bytes_per_request_per_gpu_every_layer_whole']:,} B ({hy['saving_factor']:.2f}x)")
    out += ["", f"Prefix caching (shared prefix {p['shared_prefix_tokens']:,} tokens, "
                f"{p['cached_tokens_per_block_boundary']:,} in whole blocks; hit rate {p['hit_rate']:g}; "
                f"mean prompt {p['mean_prompt_tokens']:,})",
            f"  prefill tokens saved       {p['prefill_tokens_saved_per_request']:,.0f} per request "
            f"({p['prefill_tokens_saved_fraction']:.1%} of prompt tokens)",
            f"  prefill time per request   {p['prefill_s_per_request'] * 1e3:.1f} ms -> "
            f"{p['prefill_s_per_request_cached'] * 1e3:.1f} ms ({p['prefill_time_saved_fraction']:.1%} saved)",
            f"  prefill model: {pm['linear_flops_per_token']:.4g} FLOP/token + {pm['attn_flops_per_pair']:.4g} "
            f"FLOP/query-key pair, at {pm['flops_per_s'] / 1e12:,.1f} TFLOP/s ({pm['calibration']})", "",
            f"Load vs recompute for a {r['crossover'][0]['prefix_tokens']:,}-token prefix "
            f"(each GPU loads its shard over its own link)" if r["crossover"] else "",
            f"  {'link':<14}{'GB/s':>8}{'load ms':>10}{'recompute ms':>14}  {'faster':<10}"
            f"{'crossover GB/s':>15}{'load wins from':>16}"]
    for x in r["crossover"]:
        wins = {None: "never", 1: "any length"}.get(x["load_wins_from_tokens"], f"{x['load_wins_from_tokens']:,} tok")
        out.append(f"  {x['link']:<14}{x['bytes_per_s'] / GB:>8.2f}{x['load_s'] * 1e3:>10.2f}"
                   f"{x['recompute_s'] * 1e3:>14.2f}  {x['faster']:<10}{x['crossover_bytes_per_s'] / GB:>15.2f}{wins:>16}")
    t = r.get("kvstore_tiers")
    if t:
        out += ["", f"kvstore tiers on a node (blocks of {t['block_bytes']:,} B, the whole model's KV)",
                f"  DRAM {_gb(t['dram_bytes']):>14}  {t['dram_blocks']:>12,} blocks  {t['dram_tokens']:>14,} tokens",
                f"  NVMe {_gb(t['nvme_bytes']):>14}  {t['nvme_blocks']:>12,} blocks  {t['nvme_tokens']:>14,} tokens (raw)"]
        if t["codec_ratio"] != 1.0:
            out.append(f"  NVMe with nvme.codec at {t['codec_ratio']:g}x  {t['nvme_blocks_with_codec']:>12,} blocks  "
                       f"{t['nvme_tokens_with_codec']:>14,} tokens")
        if t["prefixes_of_shared_prefix"] is not None:
            out.append(f"  distinct {p['shared_prefix_tokens']:,}-token prefixes held: {t['prefixes_of_shared_prefix']:,}")
    d = r["disaggregated"]
    if d:
        out += ["", f"Disaggregated prefill -> decode at {d['request_rate']:g} requests/s "
                    f"({d['shipped_tokens_per_request']:,.0f} tokens shipped per request, {_gb(d['bytes_per_request'])})",
                f"  link bandwidth needed      {d['bytes_per_s'] / GB:,.2f} GB/s = {d['bytes_per_s'] * 8 / 1e9:,.1f} Gbit/s",
                "  links needed at nominal speed: " + ", ".join(f"{k} {v}" for k, v in d["links_needed"].items())]
    out += ["", "assumptions:"] + [f"  - {a}" for a in r["assumptions"]]
    out += [f"warning: {w}" for w in r["warnings"]]
    return "\n".join(out)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="kvstore plan", description=(
        f"KV sizing and capacity planning. {UNITS}. A bare number is GB for a size (unlike kvstore serve, "
        "where it is bytes) and GB/s for a rate; k after a token count is 1024 tokens."))
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--preset", help="shipped model config (see --list-presets)")
    src.add_argument("--config", help="path to a Hugging Face config.json")
    ap.add_argument("--list-presets", action="store_true", help="print preset names and exit")
    ap.add_argument("--kv-dtype", default="bf16", help="KV dtype: bf16, fp16, fp8, int8, int4 (default bf16)")
    ap.add_argument("--weight-dtype", help="weight dtype (default: the config's torch_dtype / quantization)")
    ap.add_argument("--block-tokens", default="16", help="tokens per KV block (default 16)")
    ap.add_argument("--gpu-mem", default="80GB", help="memory per GPU, e.g. 80GB or 80GiB (default 80GB)")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (default 1)")
    ap.add_argument("--overhead", default="5GB", help="runtime overhead per GPU (default 5GB)")
    ap.add_argument("--context", default="4096", help="context length reserved per request (default 4096)")
    ap.add_argument("--mean-len", help="mean actual tokens per request, prompt + output (default: --context)")
    ap.add_argument("--mean-prompt", help="mean prompt tokens (default: --mean-len)")
    ap.add_argument("--shared-prefix", default="0", help="tokens of prefix shared across requests (default 0)")
    ap.add_argument("--hit-rate", type=float, default=1.0, help="fraction of requests that hit the shared prefix (default 1)")
    ap.add_argument("--params", type=float, help="override the parameter count (e.g. 70.6e9)")
    ap.add_argument("--prefill-tps", type=float, help="measured prefill tokens/s of the TP group")
    ap.add_argument("--prefill-ref", default="2048", help="prompt length --prefill-tps was measured at (default 2048)")
    ap.add_argument("--gpu-tflops", type=float, default=LoadPolicyConfig().default_prefill_flops_per_s / 1e12,
                    help="effective prefill TFLOP/s per GPU when --prefill-tps is not given (default %(default)g)")
    ap.add_argument("--link", action="append", metavar="NAME=RATE",
                    help="link for crossover and link counts, e.g. pcie5=50GB/s or ib=400Gbit/s (repeatable)")
    ap.add_argument("--rate", type=float, default=0.0, help="target requests/s for disaggregated serving")
    ap.add_argument("--dram", default="0", help="kvstore DRAM tier per node, for the tier section (default 0: none)")
    ap.add_argument("--nvme", default="0", help="kvstore NVMe tier per node, for the tier section (default 0: none)")
    ap.add_argument("--codec-ratio", type=float, default=1.0,
                    help="NVMe capacity ratio of nvme.codec (raw bytes per slot byte; kvstore bench codec --nvme "
                         "measures it, kvstore stats shows it; default 1: codec off)")
    ap.add_argument("--json", action="store_true", help="print the plan as JSON")
    return ap


def _options(a: argparse.Namespace) -> PlanOptions:
    def dtype(flag: str, text: str) -> DType:
        try:
            return DType.parse(text)
        except LayoutError:
            known = ", ".join(d.label for d in DType)
            raise PlanError(f"{flag}: unknown dtype {text!r}; known: {known} (and fp8)") from None

    links = DEFAULT_LINKS
    if a.link:
        links = []
        for item in a.link:
            name, sep, rate = item.partition("=")
            if not sep or not name:
                raise PlanError(f"--link: expected NAME=RATE, got {item!r}")
            links.append((name, parse_rate(rate, "--link")))
    opt = lambda text, flag: None if text is None else parse_tokens(text, flag)  # noqa: E731
    return PlanOptions(
        kv_dtype=dtype("--kv-dtype", a.kv_dtype),
        weight_dtype=dtype("--weight-dtype", a.weight_dtype) if a.weight_dtype else None,
        block_tokens=parse_tokens(a.block_tokens, "--block-tokens"), gpu_mem_bytes=parse_plan_size(a.gpu_mem, "--gpu-mem"),
        tp=a.tp,
        overhead_bytes=parse_plan_size(a.overhead, "--overhead", allow_zero=True),
        context_tokens=parse_tokens(a.context, "--context"), mean_tokens=opt(a.mean_len, "--mean-len"),
        mean_prompt_tokens=opt(a.mean_prompt, "--mean-prompt"),
        shared_prefix_tokens=parse_tokens(a.shared_prefix, "--shared-prefix"), hit_rate=a.hit_rate,
        params=None if a.params is None else round(a.params),
        prefill_tokens_per_s=a.prefill_tps, prefill_ref_tokens=parse_tokens(a.prefill_ref, "--prefill-ref"),
        gpu_flops_per_s=a.gpu_tflops * 1e12, links=tuple(links), request_rate=a.rate,
        dram_bytes=parse_plan_size(a.dram, "--dram", allow_zero=True),
        nvme_bytes=parse_plan_size(a.nvme, "--nvme", allow_zero=True), codec_ratio=a.codec_ratio)


def main(argv: list[str]) -> int:
    """Entry of ``kvstore plan``; returns the exit status (2 for bad input)."""
    try:
        args = _parser().parse_args(argv)
    except SystemExit as e:  # --help, or argparse's own usage error
        return e.code if isinstance(e.code, int) else 0 if e.code is None else 2
    if args.list_presets:
        print("\n".join(preset_names()))
        return 0
    try:
        if not (args.preset or args.config):
            raise PlanError("--preset or --config: one is required (see --list-presets)")
        model = load_preset(args.preset) if args.preset else load_config(args.config)
        report = build_plan(model, _options(args))
    except ValueError as e:  # LayoutError, ModelConfigError and PlanError are ValueErrors
        print(f"kvstore plan: error: {e}", file=sys.stderr)
        return 2
    try:
        print(json.dumps(report, indent=2) if args.json else render(report), flush=True)
    except BrokenPipeError:  # piped into `head`, which closed early: not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0
