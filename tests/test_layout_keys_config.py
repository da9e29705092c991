"""Layout sizes, chained keys and config precedence."""

import json
import subprocess
import sys

import pytest

from kvstore import config as C
from kvstore.app.cli import build_parser
from kvstore.keys import Namespace, chain_keys
from kvstore.layout import BLOCK_FORMAT, KVLayout, LayoutError
from kvstore.app.plan import parse_plan_size


def test_exact_sizes():
    llama70 = KVLayout(80, 8, 128, "bf16")
    assert llama70.bytes_per_token == 327_680
    assert llama70.layer_chunk_bytes == 2 * 8 * 128 * 2 * 16  # K+V, 8 heads, 128 dims, 2 B, 16 tokens
    assert llama70.block_bytes == 327_680 * 16
    assert KVLayout(80, 8, 128, "fp8").bytes_per_token == 163_840
    assert KVLayout(80, 8, 128, "int4").bytes_per_token == 81_920
    assert KVLayout(61, dtype="bf16", kind="mla", kv_lora_rank=512, qk_rope_head_dim=64).bytes_per_token_layer == 1152
    assert KVLayout(32, 1, 128, "fp16", "mqa").bytes_per_token == 32 * 2 * 128 * 2


@pytest.mark.parametrize("kw,field", [
    (dict(num_layers=0, num_kv_heads=8, head_dim=128), "num_layers"),
    (dict(num_layers=2, num_kv_heads=-1, head_dim=128), "num_kv_heads"),
    (dict(num_layers=2, num_kv_heads=8, head_dim=128, dtype="fp6"), "dtype"),
    (dict(num_layers=2, num_kv_heads=8, head_dim=128, kind="linear"), "kind"),
    (dict(num_layers=2, kind="mla"), "kv_lora_rank"),
    (dict(num_layers=2, num_kv_heads=2, head_dim=8, kind="mqa"), "num_kv_heads"),
    (dict(num_layers=2, num_kv_heads=8, head_dim=128, block_tokens=0), "block_tokens"),
])
def test_bad_layout_names_the_field(kw, field):
    with pytest.raises(LayoutError, match=field):
        KVLayout(**kw)


def test_keys_chain_only_full_blocks_and_are_stable_across_processes():
    ns = Namespace("llama", KVLayout(2, 2, 64, "bf16"))
    keys = chain_keys(ns.root, list(range(50)), 16)
    assert len(keys) == 3 and all(len(k) == 32 for k in keys)
    assert chain_keys(ns.root, list(range(48)), 16) == keys
    assert chain_keys(ns.root, list(range(32)) + [0] * 16, 16)[:2] == keys[:2]
    assert chain_keys(ns.root, list(range(32)) + [0] * 16, 16)[2] != keys[2]
    # Continuing a chain from a parent gives the same keys as hashing from the root.
    assert chain_keys(ns.root, list(range(16, 48)), 16, parent=keys[0]) == keys[1:]
    code = ("from kvstore.keys import Namespace, chain_keys; from kvstore.layout import KVLayout;"
            "ns = Namespace('llama', KVLayout(2, 2, 64, 'bf16'));"
            "print(chain_keys(ns.root, list(range(50)), 16)[2].hex())")
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={"PYTHONHASHSEED": "12345", "PATH": ""})
    assert other.stdout.strip() == keys[2].hex()


def test_everything_that_namespaces_a_key_is_in_the_hash():
    base = Namespace("llama", KVLayout(2, 2, 64, "bf16"))
    variants = [Namespace("llama-2", base.layout), Namespace("llama", KVLayout(2, 2, 64, "fp16")),
                Namespace("llama", base.layout, tp_rank=1, tp_world=2), Namespace("llama", base.layout, tenant_salt="t"),
                Namespace("llama", KVLayout(2, 2, 64, "bf16", block_tokens=32))]
    roots = {v.root for v in variants} | {base.root}
    assert len(roots) == len(variants) + 1
    assert json.loads(base.canonical())["block_format"] == BLOCK_FORMAT  # another byte order, another root


def test_block_format_changes_the_root(monkeypatch):
    import kvstore.keys as keys

    before = Namespace("llama", KVLayout(2, 2, 64, "bf16")).root
    monkeypatch.setattr(keys, "BLOCK_FORMAT", "some-other-order/v2")
    assert Namespace("llama", KVLayout(2, 2, 64, "bf16")).root != before


def test_config_precedence_and_units(tmp_path):
    f = tmp_path / "k.toml"
    f.write_text('[dram]\ncapacity_bytes = "1GiB"\n[server]\nlease_ttl_s = 5\n[metrics]\nport = 1234\n')
    cfg = C.load(f, env={"KVSTORE_DRAM_CAPACITY_BYTES": "512MiB", "KVSTORE_METRICS_PORT": "4321"},
                 overrides={"metrics.port": "9999"})
    assert cfg.dram.capacity_bytes == 512 * 2**20
    assert cfg.server.lease_ttl_s == 5.0
    assert cfg.metrics.port == 9999
    assert C.parse_size("1.5GB") == 1_500_000_000 and C.parse_size("64KiB") == 65536
    with pytest.raises(C.ConfigError, match=r"^server\.nope: unknown config key"):
        C.load(env={"KVSTORE_SERVER_NOPE": "1"})
    with pytest.raises(C.ConfigError, match=r"^server\.log_json: not a boolean"):
        C.load(overrides={"server.log_json": "maybe"})
    assert C.load(env={}).resolved_dram_bytes() <= 4 * 2**30


def test_serve_help_documents_every_knob_with_its_unit():
    out = subprocess.run([sys.executable, "-m", "kvstore", "serve", "--help"], capture_output=True, text=True, check=True).stdout
    for section, cls in C.sections():
        for f in __import__("dataclasses").fields(cls):
            assert f"--{section}-{f.name}".replace("_", "-") in out
    assert "(bytes" in out and "(seconds)" in out


def test_a_bare_size_is_bytes_in_the_config_and_gb_only_in_plan():
    assert C.parse_size("4096") == C.parse_size(4096) == 4096
    assert C.parse_size("80", bare=C.GB) == parse_plan_size("80") == 80 * 10**9
    assert C.parse_size("4g") == C.parse_size("4 GiB") == parse_plan_size("4GiB") == 4 * 2**30
    assert C.load(env={}, overrides={"dram.extent_bytes": "8192"}).dram.extent_bytes == 8192
    with pytest.raises(ValueError, match=r"^not a size: '4 parsecs'"):
        C.parse_size("4 parsecs")
    with pytest.raises(C.ConfigError, match=r"^nvme\.file_bytes: must be >= 0 bytes, got '-1'"):
        C.load(env={}, overrides={"nvme.file_bytes": "-1"})


def test_the_demotion_watermarks_are_dram_keys_and_the_old_nvme_ones_still_load(tmp_path, caplog):
    cfg = C.load(env={})
    assert (cfg.dram.demote_high_watermark, cfg.dram.demote_low_watermark) == (0.90, 0.75)
    assert not hasattr(cfg.nvme, "high_watermark") and "demote_high_watermark = 0.9" in C.to_toml(cfg)
    f = tmp_path / "old.toml"
    f.write_text("[nvme]\nhigh_watermark = 0.8\nlow_watermark = 0.5\n")
    with caplog.at_level("WARNING", logger="kvstore.config"):
        cfg = C.load(f, env={"KVSTORE_NVME_LOW_WATERMARK": "0.6"})
    assert (cfg.dram.demote_high_watermark, cfg.dram.demote_low_watermark) == (0.8, 0.6)
    said = [r.getMessage() for r in caplog.records]
    assert said == [f"config file {f}: [nvme] high_watermark is deprecated, use [dram] demote_high_watermark "
                    "(the old name still works for now)",
                    f"config file {f}: [nvme] low_watermark is deprecated, use [dram] demote_low_watermark "
                    "(the old name still works for now)",
                    "the environment: KVSTORE_NVME_LOW_WATERMARK is deprecated, use KVSTORE_DRAM_DEMOTE_LOW_WATERMARK "
                    "(the old name still works for now)"]
    # The command line: old flags parse, and a new key set later wins as any later source does.
    args = C.cli_overrides(build_parser().parse_args(["serve", "--nvme-high-watermark", "0.95"]))
    assert C.load(f, env={}, overrides=args).dram.demote_high_watermark == 0.95
    assert C.load(f, env={}, overrides={"dram.demote_high_watermark": "0.7"}).dram.demote_high_watermark == 0.7
    f.write_text("[nvme]\nhigh_watermark = 0.8\n[dram]\ndemote_high_watermark = 0.85\n")
    with pytest.raises(C.ConfigError, match=r"^nvme\.high_watermark: moved to dram\.demote_high_watermark, which "
                                            r"config file .* also sets; remove \[nvme\] high_watermark"):
        C.load(f, env={})
    with pytest.raises(C.ConfigError, match=r"^dram\.demote_low_watermark: need 0 < demote_low_watermark < "):
        C.load(env={}, overrides={"dram.demote_low_watermark": "0.95"})
