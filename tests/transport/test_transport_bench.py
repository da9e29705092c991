"""`kvstore bench transfer` runs end to end (tiny sizes: a smoke test, not a measurement)."""

from __future__ import annotations

import json

from kvstore.transport import bench


def test_bench_runs_and_reports_json(backend, capsys):
    rc = bench.main(["--backend", backend, "--sizes", "64KiB", "--total-mib", "1", "--latency-samples", "5",
                     "--layers", "4", "--blocks", "2", "--pipeline-chunk", "64KiB", "--compute-ratio", "1.0",
                     "--verify", "--json"] + (["--no-raw"] if backend == "ucx" else []))
    assert rc == 0
    doc = json.loads(capsys.readouterr().out)
    (point,) = doc["points"]
    assert point["backend"] == backend and point["chunk_bytes"] == 65536 and point["gbps"] > 0
    assert point["lat_p50_us"] <= point["lat_p99_us"]
    if backend == "tcp":
        assert point["raw"]["gbps"] > 0 and point["ratio"] > 0
    (pipe,) = doc["pipelined"]
    assert pipe["layers"] == 4 and 0 <= pipe["hidden_fraction"] <= 1


def test_bench_with_known_digests_still_verifies_every_chunk(backend, capsys):
    rc = bench.main(["--backend", backend, "--sizes", "64KiB", "--total-mib", "1", "--latency-samples", "5",
                     "--layers", "0", "--no-raw", "--verify", "--known-digests", "--json"])
    assert rc == 0  # --verify exits non-zero if any chunk landed different from what was sent
    doc = json.loads(capsys.readouterr().out)
    assert doc["known_digests"] is True and doc["points"][0]["gbps"] > 0
