"""`kvstore bench transfer --daemons` runs end to end on small sizes (figures go in notes)."""

import json
import subprocess
import sys


def test_bench_transfer_through_daemons_small():
    p = subprocess.run([sys.executable, "-m", "kvstore", "bench", "transfer", "--daemons", "--json", "--verify",
                        "--chunk-sizes", "64KiB", "--total-bytes", "8MiB", "--repeat", "1", "--pipelined"],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr + p.stdout
    r = json.loads(p.stdout)
    assert r["backend"] == "tcp" and r["reference"] == "raw TCP socket"
    (row,) = r["rows"]
    assert row["chunk_bytes"] == 65536 and row["bytes"] == 8 << 20 and row["verified"] is True
    assert row["daemon_GBps"] > 0 and row["raw_GBps"] > 0 and row["raw_verified_GBps"] > 0
    # raw again with its receiver hashing every message: the ratio against it is reported apart
    assert abs(row["ratio_verified"] - row["daemon_GBps"] / row["raw_verified_GBps"]) < 0.01
    assert abs(row["ratio"] - row["daemon_GBps"] / row["raw_GBps"]) < 0.01  # one round: the pair's ratio
    assert len(row["ratio_runs"]) == 1
    cpu = row["cpu_s_per_gb"]  # each daemon's CPU per GB beside raw's sender and receiver
    assert set(cpu) == {"tx", "rx", "raw_tx", "raw_rx", "raw_verified_tx", "raw_verified_rx"}
    assert all(v >= 0 for v in cpu.values())
    assert len(r["load_average"]) == 3
    pl = row["pipelined"]
    assert pl["best_possible"] == round(1 - 1 / 32, 3) and pl["hidden_fraction"] <= pl["best_possible"] + 0.01
    assert pl["wall_s"] > 0 and pl["transfer_alone_s"] > 0


def test_bench_transfer_compressed_through_a_held_link_small():
    """`kvstore bench transfer --compress`: a trained model's bf16 KV between daemons with
    transport.compress off and on, through a relay held to a link rate, read back exact."""
    from kvstore.codec import native

    if native() is None:
        import pytest
        pytest.skip("the C codec is built by make test (make codec)")
    p = subprocess.run([sys.executable, "-m", "kvstore", "bench", "transfer", "--compress", "--json", "--tokens", "256",
                        "--repeat", "1", "--link-rate", "100MB"], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:] + p.stdout
    r = json.loads(p.stdout)
    assert r["verified"] is True and len(r["rounds"]) == 1 and r["link_rate_GBps"] == 0.1
    assert r["wire_fraction"]["off"] == 1.0 and r["wire_fraction"]["on"] < 0.8  # bf16 trained KV: 1.33x
    assert r["raw_link_GBps"] > 0 and r["off_GBps"] > 0 and r["on_GBps"] > 0  # no speed asserted here
