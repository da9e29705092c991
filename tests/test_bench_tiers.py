"""`kvstore bench tiers` runs end to end on small sizes (its figures go in notes, not asserts)."""

import json
import subprocess
import sys


def test_bench_tiers_json_small(tmp_path):
    p = subprocess.run([sys.executable, "-m", "kvstore", "bench", "tiers", "--json", "--dir", str(tmp_path),
                        "--block-bytes", "256KiB", "--total-bytes", "16MiB", "--promotions", "5", "--rounds", "2"],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr + p.stdout
    r = json.loads(p.stdout)
    assert r["verified"] is True and r["block_bytes"] == 256 << 10 and r["total_bytes"] == 16 << 20
    assert r["read_blocks"] > 0 and r["promotion_ms"]["samples"] == 10 and len(r["rounds"]) == 2
    for k in ("fio_write_GBps", "fio_read_GBps", "daemon_write_GBps", "daemon_read_GBps"):
        assert r[k] > 0
    for x in r["rounds"]:
        assert x["verified"] is True
        assert abs(x["write_ratio"] - x["daemon_write_GBps"] / x["fio_write_GBps"]) < 0.01
    # the reported ratio is the median of the rounds' ratios (of two rounds: their mean)
    assert abs(r["write_ratio"] - sum(x["write_ratio"] for x in r["rounds"]) / 2) < 0.002
    assert list(tmp_path.iterdir()) == []  # the benchmark cleans up after itself
