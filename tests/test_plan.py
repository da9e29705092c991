"""KV sizing from model configs, capacity planning and the ``kvstore plan`` CLI.

Units throughout: GB = 10^9 bytes, GiB = 2^30 bytes.
"""

from __future__ import annotations

import json
import math

import pytest

from kvstore.layout import DType, LayoutError
from kvstore.modelcfg import ModelConfigError, from_hf, load_config, load_preset, preset_names
from kvstore.app.plan import (GB, GIB, PlanError, PlanOptions, build_plan, main, parse_plan_size, parse_rate,
                          parse_tokens)
from kvstore.policy import PrefillCostModel

LLAMA3_70B_FP8_TP2 = dict(kv_dtype=DType.FP8_E4M3, weight_dtype=DType.FP8_E4M3, tp=2,
                          gpu_mem_bytes=80 * GB, overhead_bytes=5 * GB, context_tokens=4096)


def run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


# -- exact KV sizes ------------------------------------------------------------------------------

def test_llama3_70b_sizes():
    m = load_preset("llama-3-70b")
    bf16, fp8 = m.layout("bf16"), m.layout("fp8")
    assert (bf16.bytes_per_token_layer, bf16.bytes_per_token, bf16.block_bytes) == (4096, 327_680, 5_242_880)
    assert fp8.bytes_per_token == 163_840
    assert m.layout("int4").bytes_per_token == 81_920
    assert bf16.bytes_per_token * 4096 == 1_342_177_280
    sizes = {s["dtype"]: s for s in build_plan(m, PlanOptions())["kv_sizes"]}
    assert sizes["bf16"]["bytes_per_request"] == 1_342_177_280
    assert sizes["fp8_e4m3"]["bytes_per_request"] == 671_088_640


def test_llama2_70b_is_gqa_and_its_mha_equivalent():
    # The issue quotes 2,621,440 B/token for Llama-2 70B bf16. Its published config has
    # num_key_value_heads = 8 (GQA), so the real figure is 327,680; 2,621,440 is what the same
    # model would store as full MHA (64 heads), which the plan reports as the GQA saving.
    m = load_preset("llama-2-70b")
    assert m.num_kv_heads == 8 and m.kind.value == "gqa"
    assert m.layout("bf16").bytes_per_token == 327_680
    assert m.mha_bytes_per_token("bf16") == 2_621_440
    mha = build_plan(m, PlanOptions())["mha_equivalent"]
    assert (mha["bytes_per_token"], mha["saving_factor"]) == (2_621_440, 8.0)


def test_deepseek_v3_mla_sizes():
    m = load_preset("deepseek-v3")
    lay = m.layout("bf16")
    assert m.kind.value == "mla" and m.num_layers == 61
    assert lay.bytes_per_token_layer == 1_152            # (512 latent + 64 rope) x 2 B
    assert lay.bytes_per_token == 1_152 * 61 == 70_272
    # Full MHA: 128 heads x (K 192 + V 128) x 61 layers x 2 B.
    assert m.mha_bytes_per_token("bf16") == 4_997_120
    # MLA's latent is replicated on every GPU of the TP group, not split.
    assert m.gpu_layout("bf16", 8).bytes_per_token == 70_272


def test_mha_model_has_no_saving_and_tp_splits_heads():
    m = load_preset("llama-2-7b")
    assert m.kind.value == "mha" and m.layout("bf16").bytes_per_token == 524_288
    assert m.mha_bytes_per_token("bf16") == 524_288
    assert m.gpu_layout("bf16", 4).bytes_per_token == 131_072
    l3 = load_preset("llama-3-8b")
    assert l3.kv_heads_per_gpu(16) == 1                  # more GPUs than KV heads: replicated


def test_scale_overhead():
    m = load_preset("llama-3-70b")
    assert m.scale_bytes_per_token("fp8") == 0           # per-tensor scales
    assert m.scale_bytes_per_token("int8") == 2 * 8 * 2 * 80 == 2_560
    assert m.scale_bytes_per_token("int4", kv_heads=4) == 1_280
    assert load_preset("deepseek-v3").scale_bytes_per_token("int8") == 2 * 61


@pytest.mark.parametrize("name,total,active", [
    ("llama-2-7b", 6_738_415_616, 6_738_415_616),
    ("llama-2-70b", 68_976_648_192, 68_976_648_192),
    ("llama-3-8b", 8_030_261_248, 8_030_261_248),
    ("llama-3-70b", 70_553_706_496, 70_553_706_496),
    ("llama-3-405b", 405_853_388_800, 405_853_388_800),
    ("llama-3.2-1b", 1_235_814_400, 1_235_814_400),
    ("mistral-7b", 7_248_023_552, 7_248_023_552),
    ("mixtral-8x7b", 46_702_792_704, 12_879_925_248),
    ("qwen2.5-7b", 7_615_616_512, 7_615_616_512),
    ("qwen2.5-32b", 32_763_876_352, 32_763_876_352),
    ("qwen2.5-72b", 72_706_203_648, 72_706_203_648),
    ("deepseek-v3", 671_026_404_352, 37_552_282_624),
])
def test_param_counts_match_published_checkpoints(name, total, active):
    m = load_preset(name)
    assert (m.params(), m.params(active=True)) == (total, active)


def test_deepseek_v3_counts_against_its_model_card():
    m = load_preset("deepseek-v3")
    # Model card: 671B total; 36.6B activated excluding the 0.9B input embedding.
    assert abs(m.params() / 671e9 - 1) < 1e-3
    assert abs((m.params(active=True) - m.vocab_size * m.hidden_size) / 36.6e9 - 1) < 2e-3
    assert m.weight_dtype is DType.FP8_E4M3               # from quantization_config


def test_every_preset_parses_and_lists():
    names = preset_names()
    assert {"llama-3-8b", "llama-3-70b", "llama-3-405b", "llama-2-70b", "mistral-7b",
            "qwen2.5-7b", "qwen2.5-72b", "deepseek-v3"} <= set(names)
    for name in names:
        m = load_preset(name)
        assert m.layout("bf16").bytes_per_token > 0 and m.params() > 0
    assert load_preset("LLAMA-3-70B").num_layers == 80


def test_prefill_flops_of_llama3_70b():
    m = load_preset("llama-3-70b")
    assert m.linear_flops_per_token() == 2 * (70_553_706_496 - 2 * 128_256 * 8192) == 136_904_720_384
    assert m.attn_flops_per_pair() == 4 * 64 * 128 * 80 == 2_621_440


# -- config reading and bad input -----------------------------------------------------------------

BASE = {"num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 32,
        "num_key_value_heads": 8, "vocab_size": 32000, "intermediate_size": 14336}


def test_missing_kv_heads_means_mha_and_text_config_is_read():
    cfg = {k: v for k, v in BASE.items() if k != "num_key_value_heads"}
    assert from_hf(cfg).num_kv_heads == 32
    nested = from_hf({"architectures": ["LlavaForConditionalGeneration"], "text_config": BASE,
                      "torch_dtype": "float16"})
    assert (nested.num_kv_heads, nested.weight_dtype) == (8, DType.FP16)


@pytest.mark.parametrize("field", ["num_hidden_layers", "num_attention_heads", "hidden_size"])
def test_config_missing_field_is_named(field):
    cfg = {k: v for k, v in BASE.items() if k != field}
    with pytest.raises(ModelConfigError, match=rf"^{field}: missing"):
        from_hf(cfg)


@pytest.mark.parametrize("field,value", [("num_key_value_heads", 0), ("num_key_value_heads", -8),
                                         ("num_hidden_layers", 0), ("hidden_size", "4096"),
                                         ("head_dim", -128), ("num_attention_heads", True)])
def test_config_bad_value_is_named(field, value):
    with pytest.raises(ModelConfigError, match=rf"^{field}: must be a positive integer, got {value!r}"):
        from_hf({**BASE, field: value})


def test_config_inconsistent_fields_are_named():
    with pytest.raises(ModelConfigError, match=r"^num_key_value_heads: 5 does not divide num_attention_heads=32"):
        from_hf({**BASE, "num_key_value_heads": 5})
    with pytest.raises(ModelConfigError, match=r"^head_dim: missing .* hidden_size=4100 is not a multiple"):
        from_hf({**BASE, "hidden_size": 4100})
    mla = {**BASE, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "v_head_dim": 128}
    with pytest.raises(ModelConfigError, match=r"^qk_rope_head_dim: missing"):
        from_hf(mla)
    with pytest.raises(ModelConfigError, match=r"^torch_dtype: unknown weight dtype 'float7'"):
        from_hf({**BASE, "torch_dtype": "float7"})
    with pytest.raises(ModelConfigError, match=r"^tp: 3 does not divide num_key_value_heads=8"):
        from_hf(BASE).kv_heads_per_gpu(3)


def test_param_count_needs_its_fields():
    m = from_hf({k: v for k, v in BASE.items() if k != "intermediate_size"})
    assert m.layout("bf16").bytes_per_token == 131_072   # KV sizing still works
    with pytest.raises(ModelConfigError, match=r"^intermediate_size: missing"):
        m.params()


def test_unknown_preset_and_dtype():
    with pytest.raises(ModelConfigError, match=r"^preset: unknown preset 'llama-9'; known: .*llama-3-70b"):
        load_preset("llama-9")
    with pytest.raises(LayoutError, match=r"^dtype: unknown KV dtype 'fp6'"):
        load_preset("llama-3-70b").layout("fp6")


def test_config_file_errors(tmp_path):
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    with pytest.raises(ModelConfigError, match=r"^config: .* is not valid JSON"):
        load_config(bad)
    with pytest.raises(ModelConfigError, match=r"^config: cannot read"):
        load_config(tmp_path / "absent.json")
    bad.write_text(json.dumps({**BASE, "num_hidden_layers": None}))
    with pytest.raises(ModelConfigError, match=rf"^num_hidden_layers: missing from {bad}"):
        load_config(bad)


# -- capacity ----------------------------------------------------------------------------------------

def test_capacity_llama3_70b_fp8_tp2_decimal_gb():
    c = build_plan(load_preset("llama-3-70b"), PlanOptions(**LLAMA3_70B_FP8_TP2))["capacity"]
    assert c["weight_bytes"] == 70_553_706_496 and c["weight_bytes_per_gpu"] == 35_276_853_248
    assert c["kv_headroom_bytes_per_gpu"] == 80 * GB - 5 * GB - 35_276_853_248 == 39_723_146_752
    # KV is split over the pair: each GPU holds 4 of the 8 KV heads of every request.
    assert c["kv_bytes_per_request_per_gpu"] == 4096 * 163_840 // 2 == 335_544_320
    assert c["max_requests_contiguous"] == 39_723_146_752 // 335_544_320 == 118
    # The "about 62" is one GPU's headroom divided by a whole unsharded request with
    # 640 MiB read as 0.640 GB: 39.72e9 / 640e6 = 62.07. Counted consistently it is 59 for an
    # unsharded request and 118 for the TP pair that splits it.
    assert 39_723_146_752 // (4096 * 163_840) == 59
    # Every request fills its 4,096-token context (256 whole blocks): paging wastes nothing.
    assert (c["max_requests_paged"], c["mean_last_block_waste_tokens"]) == (118, 0)


def test_capacity_llama3_70b_fp8_tp2_binary_gib():
    opts = PlanOptions(**{**LLAMA3_70B_FP8_TP2, "gpu_mem_bytes": 80 * GIB, "overhead_bytes": 5 * GIB})
    c = build_plan(load_preset("llama-3-70b"), opts)["capacity"]
    assert c["kv_headroom_bytes_per_gpu"] == 45_253_783_552
    assert c["max_requests_contiguous"] == 134


def test_capacity_paged_and_shared_prefix():
    opts = PlanOptions(**LLAMA3_70B_FP8_TP2, mean_tokens=2048, shared_prefix_tokens=1024)
    c = build_plan(load_preset("llama-3-70b"), opts)["capacity"]
    assert c["kv_blocks_per_gpu"] == 39_723_146_752 // (16 * 81_920) == 30_306
    # Mean 2048 tokens + 7.5 tokens of last-block waste = 128.46875 blocks per request.
    assert c["max_requests_paged"] == math.floor(30_306 / 128.46875) == 235
    # The 64 shared blocks are stored once; each request owns 64.46875 blocks.
    assert c["max_requests_paged_shared_prefix"] == math.floor((30_306 - 64) / 64.46875) == 469


def test_weights_that_do_not_fit():
    r = build_plan(load_preset("llama-3-405b"), PlanOptions(tp=1))
    c = r["capacity"]
    assert not c["fits"] and c["max_requests_contiguous"] == 0 and c["max_requests_paged"] == 0
    assert "exceed --gpu-mem" in r["warnings"][0]
    r = build_plan(load_preset("llama-2-7b"), PlanOptions(context_tokens=8192))
    assert r["warnings"] == ["--context 8,192 exceeds the model's max_position_embeddings 4,096"]


def test_prefix_saving_disaggregated_links_and_crossover():
    m = load_preset("llama-3-70b")
    opts = PlanOptions(context_tokens=4096, mean_tokens=2048, shared_prefix_tokens=1000, hit_rate=0.5,
                       request_rate=10, links=(("ib", parse_rate("400Gbit/s")), ("eth10", parse_rate("10Gbit/s"))),
                       prefill_tokens_per_s=5000, prefill_ref_tokens=2048)
    r = build_plan(m, opts)
    p, d = r["prefix_cache"], r["disaggregated"]
    assert p["cached_tokens_per_block_boundary"] == 992   # 62 whole blocks of 16
    assert p["prefill_tokens_saved_per_request"] == 496.0 and p["prefill_tokens_saved_per_s"] == 4960.0
    assert p["prefill_s_per_request"] == pytest.approx(2048 / 5000, rel=1e-12)   # calibration point
    assert d["bytes_per_s"] == 10 * (2048 - 496) * 327_680 == 5_085_593_600
    assert d["links_needed"] == {"ib": 1, "eth10": math.ceil(5_085_593_600 / 1.25e9)} == {"ib": 1, "eth10": 5}
    cost = PrefillCostModel.for_model(m, tokens_per_s=5000, ref_tokens=2048)
    for x in r["crossover"]:
        assert x["prefix_tokens"] == 992 and x["recompute_s"] == pytest.approx(cost.seconds(0, 992), rel=1e-12)
        assert x["load_s"] == pytest.approx(992 * 327_680 / x["bytes_per_s"], rel=1e-12)
    eth = r["crossover"][1]
    assert eth["faster"] == "recompute"
    n = eth["load_wins_from_tokens"]                       # the computed crossover length
    per_token = 327_680 / 1.25e9
    assert n * per_token <= cost.seconds(0, n) and (n - 1) * per_token > cost.seconds(0, n - 1)


def test_options_errors_name_the_option():
    cases = {"--gpu-mem": dict(gpu_mem_bytes=0), "--tp": dict(tp=0), "--block-tokens": dict(block_tokens=0),
             "--hit-rate": dict(hit_rate=1.5), "--overhead": dict(overhead_bytes=-1),
             "--mean-len": dict(mean_tokens=5000), "--shared-prefix": dict(shared_prefix_tokens=4097),
             "--prefill-tps": dict(prefill_tokens_per_s=0.0), "--params": dict(params=-1)}
    for flag, kw in cases.items():
        with pytest.raises(PlanError, match=rf"^{flag}: "):
            PlanOptions(**kw)


def test_unit_parsing():
    assert parse_plan_size("80GB") == parse_plan_size("80") == 80_000_000_000
    assert parse_plan_size("80GiB") == 85_899_345_920 and parse_plan_size("512MiB") == 536_870_912
    assert parse_rate("400Gbit/s") == parse_rate("400Gbps") == 50e9
    assert parse_rate("25GB/s") == parse_rate("25") == 25e9 and parse_rate("1GiB/s") == 2**30
    assert parse_tokens("4k") == 4096 and parse_tokens("131072") == 131_072
    with pytest.raises(PlanError, match=r"^--gpu-mem: cannot read size '80 parsecs'"):
        parse_plan_size("80 parsecs", "--gpu-mem")
    with pytest.raises(PlanError, match=r"^--link: cannot read rate '10Gb'"):
        parse_rate("10Gb", "--link")


# -- CLI ------------------------------------------------------------------------------------------------

def test_cli_table_states_units_and_figures(capsys):
    rc, out, _ = run(capsys, "--preset", "llama-3-70b", "--weight-dtype", "fp8", "--tp", "2",
                     "--gpu-mem", "80GB", "--overhead", "5GB", "--kv-dtype", "fp8", "--context", "4k")
    assert rc == 0
    assert "GB = 10^9 B; GiB = 2^30 B" in out
    assert "39.723 GB per GPU" in out and "335,544,320 B" in out
    assert [ln for ln in out.splitlines() if "contiguous (4,096 tokens reserved)" in ln][0].split()[-1] == "118"


def test_cli_json(capsys):
    rc, out, _ = run(capsys, "--preset", "deepseek-v3", "--tp", "8", "--gpu-mem", "141GB", "--json")
    assert rc == 0
    r = json.loads(out)
    assert "10^9" in r["units"] and r["model"]["kind"] == "mla"
    assert {s["dtype"]: s["bytes_per_token"] for s in r["kv_sizes"]}["bf16"] == 70_272
    assert r["capacity"]["weight_dtype"] == "fp8_e4m3"


def test_cli_config_file(capsys, tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(BASE))
    rc, out, _ = run(capsys, "--config", str(path), "--json")
    assert rc == 0 and json.loads(out)["kv_sizes"][0]["bytes_per_token"] == 131_072


@pytest.mark.parametrize("argv,message", [
    (["--preset", "llama-9"], "preset: unknown preset 'llama-9'"),
    (["--preset", "llama-3-70b", "--kv-dtype", "fp6"], "--kv-dtype: unknown dtype 'fp6'"),
    (["--preset", "llama-3-70b", "--weight-dtype", "fp7"], "--weight-dtype: unknown dtype 'fp7'"),
    (["--preset", "llama-3-70b", "--gpu-mem", "0"], "--gpu-mem: must be > 0"),
    (["--preset", "llama-3-70b", "--gpu-mem=-5GB"], "--gpu-mem: must be > 0"),
    (["--preset", "llama-3-70b", "--tp", "0"], "--tp: must be > 0"),
    (["--preset", "llama-3-70b", "--context", "0"], "--context: must be > 0"),
    (["--preset", "llama-3-70b", "--link", "pcie"], "--link: expected NAME=RATE"),
    (["--preset", "llama-3-70b", "--params", "0"], "--params: must be > 0"),
    ([], "--preset or --config: one is required"),
])
def test_cli_bad_input(capsys, argv, message):
    rc, out, err = run(capsys, *argv)
    assert rc == 2 and out == ""
    assert err.startswith(f"kvstore plan: error: {message}")


def test_cli_list_presets_and_help(capsys):
    rc, out, _ = run(capsys, "--list-presets")
    assert rc == 0 and out.split() == preset_names()
    rc, out, _ = run(capsys, "--help")
    assert rc == 0 and "usage: kvstore plan" in out
    rc, _, err = run(capsys, "--bogus")
    assert rc == 2 and "unrecognized arguments: --bogus" in err


# -- hybrid models: windowed and linear-attention layers -----------------------------------------

GEMMA3 = dict(model_type="gemma3_text", num_hidden_layers=6, hidden_size=128, num_attention_heads=4,
              num_key_value_heads=2, head_dim=32, sliding_window=128, vocab_size=512, intermediate_size=256,
              layer_types=["sliding_attention"] * 5 + ["full_attention"])
QWEN3_NEXT = dict(model_type="qwen3_next", num_hidden_layers=4, hidden_size=128, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=32, vocab_size=512, intermediate_size=256, torch_dtype="bfloat16",
                  layer_types=["linear_attention"] * 3 + ["full_attention"], linear_num_key_heads=2,
                  linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32, linear_conv_kernel_dim=4)


def test_layer_kinds_from_layer_types_and_the_older_patterns():
    g = from_hf(GEMMA3)
    assert g.layer_kinds == ("sliding",) * 5 + ("full",) and g.sliding_window == 128 and g.kv_layers == 6
    older = {k: v for k, v in GEMMA3.items() if k != "layer_types"} | {"sliding_window_pattern": 3}
    assert from_hf(older).layer_kinds == ("sliding", "sliding", "full") * 2
    q = from_hf(QWEN3_NEXT)
    assert q.layers_of("linear") == 3 and q.kv_layers == 1
    # the KV layout holds the attention layers only: 1 layer x 2 heads x 32 x K,V x 2 bytes
    assert q.layout("bf16", 32).bytes_per_token == 1 * 2 * 32 * 2 * 2
    interval = {k: v for k, v in QWEN3_NEXT.items() if k != "layer_types"} | {"full_attention_interval": 2}
    assert from_hf(interval).layer_kinds == ("linear", "full") * 2
    assert from_hf(dict(GEMMA3, layer_types=["full_attention"] * 6)).layer_kinds == ()  # not hybrid
    # the gated delta net state as vLLM 0.32 sizes it (MambaSpec shapes ((3, 256), (4, 32, 32)),
    # both in the model's dtype with mamba_ssm_cache_dtype 'auto'): conv window 3 x (2*2*32 +
    # 4*32) and state 4 x 32 x 32, bf16 (an earlier reading took the state as fp32: vLLM's
    # gated_delta_net_state_dtype keeps the conv dtype unless mamba_ssm_cache_dtype is set)
    assert q.state_bytes_per_layer() == 3 * 256 * 2 + 4 * 32 * 32 * 2
    assert q.state_bytes_per_layer(tp=2) == 3 * (2 * 1 * 32 + 2 * 32) * 2 + 2 * 32 * 32 * 2


@pytest.mark.parametrize("change, message", [
    ({"layer_types": ["full_attention"] * 5 + ["chunked_attention"]}, "'chunked_attention'"),
    ({"layer_types": ["full_attention"] * 5}, "list of 6"),
    ({"sliding_window": None}, "sliding_window: missing"),
    ({"layer_types": ["linear_attention"] * 6, "linear_num_key_heads": 2, "linear_num_value_heads": 2,
      "linear_key_head_dim": 8, "linear_value_head_dim": 8}, "no KV to store"),
])
def test_bad_layer_kinds_are_named(change, message):
    with pytest.raises(ModelConfigError, match=message):
        from_hf({**GEMMA3, **change})


def test_linear_layers_need_their_state_shape():
    with pytest.raises(ModelConfigError, match="linear_key_head_dim: missing"):
        from_hf({k: v for k, v in QWEN3_NEXT.items() if k != "linear_key_head_dim"})


def test_state_bytes_are_what_vllm_keeps_for_the_tiny_qwen3_next():
    # The engine test (test_vllm_hybrid.py) finds 35,840 B per layer in vLLM 0.32's state pages
    # for this model in bf16: conv 3 x 512 and SSM 4 x 64 x 64.
    from kvstore.app.bench.vllm_engine import FAMILIES

    shape = dict(FAMILIES["qwen3-next"][3], model_type="qwen3_next", torch_dtype="bfloat16",
                 linear_conv_kernel_dim=4)
    assert from_hf(shape).state_bytes_per_layer() == (3 * 512 + 4 * 64 * 64) * 2


def test_plan_sizes_windowed_and_state_layers(capsys, tmp_path):
    opts = PlanOptions(block_tokens=32, context_tokens=2048, params=10**6)
    h = build_plan(from_hf(GEMMA3), opts)["hybrid"]
    per_layer = 2 * 32 * 2 * 2  # B/token of one layer, bf16
    assert (h["full_layers"], h["sliding_layers"], h["linear_layers"]) == (1, 5, 0)
    assert h["windowed_tokens_kept"] == 160  # 128 in whole blocks, plus the block a window straddles
    assert h["bytes_per_request_per_gpu"] == per_layer * 2048 + 5 * per_layer * 160
    assert h["bytes_per_request_per_gpu_every_layer_whole"] == 6 * per_layer * 2048
    assert h["saving_factor"] == pytest.approx(6 * 2048 / (2048 + 5 * 160))
    q = build_plan(from_hf(QWEN3_NEXT), opts)["hybrid"]
    assert q["state_bytes_per_request_per_gpu"] == 3 * from_hf(QWEN3_NEXT).state_bytes_per_layer()
    assert build_plan(load_preset("llama-3-8b"), opts)["hybrid"] is None
    path = tmp_path / "config.json"
    path.write_text(json.dumps(GEMMA3))
    rc, out, _ = run(capsys, "--config", str(path), "--context", "2048", "--block-tokens", "32", "--params", "1000000")
    assert rc == 0 and "5 sliding-window" in out and f"{h['bytes_per_request_per_gpu']:,} B" in out



def test_kvstore_tiers_hold_whole_blocks_and_the_codec_ratio_scales_nvme(capsys):
    rc, out, _ = run(capsys, "--preset", "llama-3-8b", "--dram", "256GiB", "--nvme", "4TB", "--codec-ratio", "1.3",
                     "--shared-prefix", "2048", "--json")
    assert rc == 0
    t = json.loads(out)["kvstore_tiers"]
    block = 32 * 2 * 8 * 128 * 2 * 16  # layers x K,V x KV heads x head_dim x bf16 x 16 tokens: 2 MiB
    assert t["block_bytes"] == block
    assert t["dram_blocks"] == 256 * GIB // block and t["nvme_blocks"] == 4000 * GB // block
    assert t["nvme_blocks_with_codec"] == math.floor(4000 * GB * 1.3 / block)
    assert t["nvme_tokens_with_codec"] == 16 * t["nvme_blocks_with_codec"]
    assert t["prefixes_of_shared_prefix"] == (t["dram_blocks"] + t["nvme_blocks_with_codec"]) // 128
    rc, out, _ = run(capsys, "--preset", "llama-3-8b", "--json")
    assert json.loads(out)["kvstore_tiers"] is None  # no tier sizes: no section
    rc, _, err = run(capsys, "--preset", "llama-3-8b", "--nvme", "1TB", "--codec-ratio", "0.5")
    assert rc == 2 and "--codec-ratio: must be in [1, 8]" in err
