"""kvstore as SGLang's HiCache storage backend, driven by SGLang 0.5.23's own HiCacheController
against a real daemon. The controller runs in a process of its own (tests/sglang_hicache_run.py
says why and what it runs); each test here checks one of its findings."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("sglang.srt.mem_cache.hicache_storage", reason="SGLang is installed by scripts/install_vllm.sh")

PAGE = 4
RUNNER = Path(__file__).with_name("sglang_hicache_run.py")


@pytest.fixture(scope="module")
def run(module_daemon, tmp_path_factory):
    work = tmp_path_factory.mktemp("sglang")
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    p = subprocess.run([sys.executable, str(RUNNER), module_daemon.socket_path, str(work)], capture_output=True,
                       text=True, timeout=240, env=env)
    lines = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
    assert p.returncode == 0 and lines, f"runner failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-6000:]}"
    return json.loads(lines[-1][len("RESULT "):])


def test_loaded_by_sglangs_dynamic_factory_with_zero_copy(run):
    assert run["backend_class"] == "kvstore.clients.sglang_hicache.KVStoreHiCache"
    assert run["zero_copy"] == "_page_get_zero_copy"  # interface_v1: batch_get_v1 / batch_set_v1


def test_round_trip_through_the_controller_is_bit_exact(run):
    assert run["written"] == 6 * PAGE and run["rewritten"] == 6 * PAGE
    assert (run["found"], run["loaded"]) == (6 * PAGE, 6 * PAGE)
    assert run["same_pool_exact"]


def test_pages_are_canonical_across_host_layouts(run):
    # written from a page_first host pool, read into a layer_first one: same bytes per layer, K, V
    assert run["other_layout_loaded"] == 6 * PAGE and run["other_layout_exact"]


def test_hybrid_pool_group_is_refused_naming_it(run):
    # a hybrid model's HostPoolGroup (KV + sliding-window pools) is refused at attach, not stored in part
    assert "HostPoolGroup" in run["hybrid_refused"] and "refused" in run["hybrid_refused"]


def test_mla_pages_round_trip(run):
    assert run["mla_layout"]["kind"] == "mla" and run["mla_layout"]["kv_lora_rank"] == 16
    assert run["mla"] == {"written": 3 * PAGE, "found": 3 * PAGE, "loaded": 3 * PAGE, "exact": True}


def test_generic_interface_without_interface_v1(run):
    assert run["generic_path"] == "_generic_page_get"  # batch_get / batch_set with flat pages
    assert run["generic"] == {"written": 3 * PAGE, "found": 3 * PAGE, "loaded": 3 * PAGE, "exact": True}


def test_load_policy_advice_never_exceeds_the_hits(run):
    assert 0 <= run["advice_found"] <= 6 * PAGE and run["advice_found"] % PAGE == 0


def test_prefix_count_stops_at_the_first_missing_page(run):
    assert (run["longer_found"], run["longer_loaded"]) == (6 * PAGE, 6 * PAGE)


def test_block_evicted_between_exists_and_get_is_a_clean_miss(run):
    assert run["exists_before_evict"] == 3
    assert run["evicted_get"] == [True, False, False]
    assert run["evicted_pages_untouched"] == [True, True] and run["evicted_first_exact"]


def test_failed_set_is_never_visible(run):
    assert run["failed_set"] == [False, False]
    assert run["failed_set_exists"] == 0


def test_tenant_salt_and_model_keep_namespaces_apart(run):
    assert run["other_tenant_found"] == 0 and run["other_tenant_written"] == 6 * PAGE
    assert run["first_tenant_still_exact"]
    assert run["other_model_found"] == 0


def test_bad_config_fails_the_attach_clearly_and_in_time(run):
    e = run["errors"]
    assert e["unreachable"]["type"] == "DaemonUnreachable" and "nobody.sock" in e["unreachable"]["message"]
    assert "is `kvstore serve` running" in e["unreachable"]["message"] and e["unreachable"]["s"] < 10
    assert e["salt_missing"]["type"] == "EngineTierConfigError" and "tenant_salt_file" in e["salt_missing"]["message"]
    assert e["bad_dtype"]["type"] == "EngineTierConfigError" and "kv_dtype" in e["bad_dtype"]["message"]
    assert e["bad_policy"]["type"] == "EngineTierConfigError" and "load_policy" in e["bad_policy"]["message"]
