"""`kvstore bench store` runs end to end on small sizes (figures are for the note, not asserted)."""

import json
import subprocess
import sys


def test_bench_store_json_small():
    p = subprocess.run([sys.executable, "-m", "kvstore", "bench", "store", "--json", "--sizes", "64KiB,1MiB",
                        "--total-bytes", "8MiB", "--reps", "1", "--lookup-keys", "1,64", "--lookup-reps", "5"],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    r = json.loads(p.stdout)
    assert [s["block_bytes"] for s in r["sizes"]] == [65536, 1 << 20]
    for s in r["sizes"]:
        assert s["verified"] is True
        assert s["total_bytes"] == 8 << 20
        assert s["put_GBps"] > 0 and s["get_GBps"] > 0 and s["memcpy_GBps"] > 0
        assert abs(s["put_ratio"] - s["put_GBps"] / s["memcpy_GBps"]) < 0.01
    assert [x["keys"] for x in r["lookup"]] == [1, 64]
    assert all(x["p99_ms"] >= x["p50_ms"] > 0 for x in r["lookup"])
