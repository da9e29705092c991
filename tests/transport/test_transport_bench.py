"""`kvstore bench transfer` runs end to end (tiny sizes: a smoke test, not a measurement)."""

from __future__ import annotations

import json
import statistics

import pytest

from kvstore.app.bench import transport_loopback as bench


def test_bench_runs_and_reports_json(backend, capsys):
    rc = bench.main(["--backend", backend, "--sizes", "64KiB", "--total-mib", "1", "--latency-samples", "5",
                     "--layers", "4", "--blocks", "2", "--pipeline-chunk", "64KiB", "--compute-ratio", "1.0",
                     "--verify", "--json"] + (["--no-raw"] if backend == "ucx" else []))
    assert rc == 0
    doc = json.loads(capsys.readouterr().out)
    (point,) = doc["points"]
    assert point["backend"] == backend and point["chunk_bytes"] == 65536 and point["gbps"] > 0
    assert point["lat_p50_us"] <= point["lat_p99_us"]
    assert point["cpu_tx_s_per_gb"] > 0 and point["cpu_rx_s_per_gb"] > 0  # both processes measured
    if backend == "tcp":
        raw = point["raw"]
        assert raw["gbps"] > 0 and raw["cpu_tx_s_per_gb"] > 0 and raw["cpu_rx_s_per_gb"] > 0
        assert point["ratio"] == pytest.approx(statistics.median(point["ratio_runs"]))
    (pipe,) = doc["pipelined"]
    assert pipe["layers"] == 4 and 0 <= pipe["hidden_fraction"] <= 1


def test_bench_ratio_is_the_median_of_interleaved_pairs(capsys):
    rc = bench.main(["--backend", "tcp", "--sizes", "64KiB", "--total-mib", "2", "--latency-samples", "5",
                     "--repeat", "3", "--layers", "0", "--json"])
    assert rc == 0
    (point,) = json.loads(capsys.readouterr().out)["points"]
    ours, raw = point["runs_gbps"], point["raw"]["runs_gbps"]
    assert len(ours) == len(raw) == len(point["ratio_runs"]) == 3
    assert point["ratio_runs"] == pytest.approx([o / r for o, r in zip(ours, raw)])
    assert point["ratio"] == pytest.approx(statistics.median(point["ratio_runs"]))
    assert point["gbps"] == pytest.approx(statistics.median(ours))


def test_bench_with_known_digests_still_verifies_every_chunk(backend, capsys):
    rc = bench.main(["--backend", backend, "--sizes", "64KiB", "--total-mib", "1", "--latency-samples", "5",
                     "--layers", "0", "--no-raw", "--verify", "--known-digests", "--json"])
    assert rc == 0  # --verify exits non-zero if any chunk landed different from what was sent
    doc = json.loads(capsys.readouterr().out)
    assert doc["known_digests"] is True and doc["points"][0]["gbps"] > 0


def test_bench_over_mutual_tls_verifies_every_chunk(capsys):
    rc = bench.main(["--backend", "tcp", "--tls", "--sizes", "64KiB", "--total-mib", "1", "--latency-samples", "5",
                     "--repeat", "1", "--layers", "0", "--no-raw", "--verify", "--json"])
    assert rc == 0  # --verify: every chunk arrived as sent, through TLS
    doc = json.loads(capsys.readouterr().out)
    assert doc["tls"] is True and doc["points"][0]["gbps"] > 0
