"""`kvstore bench vllm` runs end to end on the tiny model (its figures go in notes, not asserts).

The commands run in this process, through the CLI's entry point (``kvstore.app.cli.main``, what
``python -m kvstore`` calls), so their engines fork from this test process's vLLM fork server
(kvstore.app.bench.vllm_engine.context) instead of a new process importing vLLM again."""

import json

import pytest

pytest.importorskip("vllm")

from kvstore.app.cli import main  # noqa: E402
from kvstore.tiers.arena import shmem_thp_mode  # noqa: E402

CASES = ("no_cache", "vllm_hit", "kvstore_dram", "kvstore_nvme")


def bench(capsys, *argv: str) -> dict:
    """``kvstore bench ARGV --json``: exit status 0 (every row verified) and its JSON."""
    rc = main(["bench", *argv, "--json"])
    out = capsys.readouterr().out
    assert rc == 0, out
    return json.loads(out)


def test_bench_vllm_json_tiny(tmp_path, capsys):
    r = bench(capsys, "vllm", "--lengths", "256", "--reps", "2", "--size", "tiny", "--new-tokens", "4",
              "--dir", str(tmp_path))
    assert r["follow_policy"] is False and r["model"]["size"] == "tiny" and r["new_tokens"] == 4
    # Every engine runs its forward on as many OpenMP threads as the plain one (vLLM's CPU
    # backend reserves a core more for an engine with a kv_transfer_config where it binds them).
    threads = r["engine_threads"]
    assert set(threads) == {"plain", "writer", "reader-dram", "reader-nvme"} and len(set(threads.values())) == 1, threads
    assert r["verified"] is True and r["target"]["measured"] is False  # no 2048-token row
    [row] = r["rows"]
    assert row["tokens"] == 256 and row["loadable_tokens"] == 224
    assert row["verified"] is True and row["problems"] == []
    assert row["cached_tokens_min"] == {"kvstore_dram": 224, "kvstore_nvme": 224}  # whole prefix, both tiers
    assert set(row["ttft_ms"]) == {*CASES, "vllm_hit_hot", "kvstore_store"}
    assert set(row["request_ms"]) == {*CASES, "vllm_hit_hot"}
    for v in (*row["ttft_ms"].values(), *row["request_ms"].values(), *row["ratios"].values()):
        assert v > 0
    t = row["ttft_ms"]
    assert abs(row["ratios"]["ttft_kvstore_dram_over_vllm_hit"] - t["kvstore_dram"] / t["vllm_hit"]) < 0.01
    assert abs(row["ratios"]["ttft_no_cache_over_kvstore_nvme"] - t["no_cache"] / t["kvstore_nvme"]) < 0.01
    for c in ("kvstore_dram", "kvstore_nvme"):  # vLLM's hit repeated at once, beside the one after other misses
        ratio = row["ttft_steady_ms"][c] / row["ttft_steady_ms"]["vllm_hit_hot"]
        assert abs(row["ratios"][f"steady_{c}_over_vllm_hot_steady"] - ratio) < 0.01
    for c, v in row["ttft_ms_samples"].items():  # first hit apart from the steady ones, and the spread
        assert len(v) == 2 and row["ttft_first_ms"][c] == v[0] and row["ttft_steady_ms"][c] == v[1]
        assert row["ttft_spread_ms"][c] == [min(v), row["ttft_ms"][c], max(v)]
    raw = r["raw"]  # the raw paths of the same run, and the floors made of them
    assert raw["memcpy_gbps"] > 0 and raw["disk_read_gbps"] > 0 and raw["bytes"] == 224 * r["model"]["kv_bytes_per_token"]
    for c, gbps in (("kvstore_dram", raw["memcpy_gbps"]), ("kvstore_nvme", raw["disk_read_gbps"])):
        assert abs(row["floor_ms"][c] - (row["ttft_steady_ms"]["vllm_hit"] + raw["bytes"] / gbps / 1e6)) < 0.02
        # The JSON rounds milliseconds to 0.01: a ratio over a floor of a few ms carries that error.
        ratio = row["ttft_steady_ms"][c] / row["floor_ms"][c]
        assert abs(row["ratios"][f"steady_{c}_over_floor"] - ratio) < 0.01 + ratio * 0.006 / row["floor_ms"][c]
    # The memcpy after idle: arena-like memory into torch memory, each copy after both sat
    # untouched; vLLM's hit plus that copy is the reference the DRAM hit is set against.
    assert raw["memcpy_idle_gbps"] > 0 and raw["idle_s"] > 0
    idle = row["ttft_steady_ms"]["vllm_hit"] + raw["bytes"] / raw["memcpy_idle_gbps"] / 1e6
    assert abs(row["vllm_hit_plus_idle_copy_ms"] - idle) < 0.02
    ratio = row["ttft_steady_ms"]["kvstore_dram"] / row["vllm_hit_plus_idle_copy_ms"]
    assert abs(row["ratios"]["steady_kvstore_dram_over_idle_copy"] - ratio) < 0.01 + ratio * 0.006 / idle
    assert list(tmp_path.iterdir()) == []  # the benchmark cleans up after itself
    from kvstore.app.bench.vllm import table

    text = table(r)  # the default output, from the same figures
    assert "follow_policy: false" in text and "same-run ratios" in text and text.count("verified") >= 1
    assert "first hit" in text and "floors" in text and "raw paths, same run" in text and "repeated at once" in text
    assert f"{raw['memcpy_idle_gbps']:.1f} GB/s after {raw['idle_s']:g} s untouched" in text
    # The figures say which pages the arena was on (this host's setting, read as the daemon reads it).
    assert r["shmem_thp"] == shmem_thp_mode() and f"shared-memory huge pages: {r['shmem_thp']} " in text


def test_bench_vllm_hybrid_json_qwen3_next(tmp_path, capsys):
    r = bench(capsys, "vllm-hybrid", "--lengths", "300", "--reps", "1", "--dir", str(tmp_path))
    assert r["family"] == "qwen3-next" and r["hma"] is True and r["verified"] is True
    [row] = r["rows"]
    # vLLM's Mamba checkpoint at the last block boundary before the prompt's last token (blocks
    # of 128 or 192 tokens, as vLLM chose on this CPU): vLLM's own hit and kvstore's both hold
    # it, the state snapshot with it.
    bs = r["block_size"]
    assert bs in (128, 192) and row["tokens"] == 300 and row["problems"] == []
    assert row["cached_tokens"] == 299 // bs * bs
    t = row["ttft_ms"]
    assert set(t) == {"no_cache", "vllm_hit", "kvstore_dram"} and all(v > 0 for v in t.values())
    assert abs(row["kvstore_over_vllm_hit"] - t["kvstore_dram"] / t["vllm_hit"]) < 1e-9
    assert list(tmp_path.iterdir()) == []  # the benchmark cleans up after itself
