"""Operations: the CLI against a real daemon, SIGHUP reload, JSON logs, SIGTERM exit code."""

import json
import signal
import subprocess
import sys
import time

import numpy as np

from kvstore.clients import KVStoreClient
from kvstore.layout import KVLayout


def kv(*args):
    return subprocess.run([sys.executable, "-m", "kvstore", *args], capture_output=True, text=True, timeout=60)


def test_ls_drop_health_stats(daemon):
    c = KVStoreClient(daemon.socket_path)
    layout = KVLayout(2, 2, 64, "fp16")
    c.register(layout, "model-a")
    tokens = list(range(5 * 16))
    c.put(tokens, np.ones(layout.tensor_shape(len(tokens)), np.float16))
    sock = ["--socket", daemon.socket_path]
    h = kv("health", *sock)
    assert h.returncode == 0 and h.stdout.strip() == "SERVING"
    rows = json.loads(kv("ls", *sock, "--json").stdout)
    assert len(rows) == 1 and rows[0]["model_id"] == "model-a" and rows[0]["blocks"] == {"dram": 5}
    assert rows[0]["bytes"]["dram"] == 5 * layout.block_bytes
    assert "model-a" in kv("ls", *sock).stdout
    ns = rows[0]["namespace"]
    bad = kv("drop", *sock, "zz")
    assert bad.returncode == 1 and "INVALID_ARGUMENT" in bad.stderr
    missing = kv("drop", *sock, "00000000")
    assert missing.returncode == 1 and "NOT_FOUND" in missing.stderr
    with c.acquire(c.keys(tokens)[:1]):
        out = kv("drop", *sock, ns[:12])
        assert out.returncode == 0 and "dropped 4 blocks; 1 pinned" in out.stdout
    assert c.lookup(tokens) == 16
    st = json.loads(kv("stats", *sock, "--json").stdout)
    assert st["tiers"][0]["blocks"] == "1" and st["counters"]["kvstore_blocks_committed_total"] == 5
    c.close()
    dead = kv("health", "--socket", daemon.socket_path + ".nope", "--timeout", "1")
    assert dead.returncode == 1 and "NOT SERVING" in dead.stdout


def test_sighup_reloads_live_settings_and_json_logs(tmp_path, daemons):
    cfg = tmp_path / "k.toml"
    cfg.write_text("[server]\nlease_ttl_s = 30\nlog_json = true\n")
    d = daemons("--config", str(cfg))
    c = KVStoreClient(d.socket_path)
    c.register(KVLayout(2, 2, 64, "fp16"), "m")
    assert c.info.lease_ttl_s == 30
    cfg.write_text("[server]\nlease_ttl_s = 2.5\nlog_json = true\ngrpc_workers = 3\n"
                   "[dram]\ndemote_high_watermark = 0.95\n")
    d.proc.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 10
    while "reloaded config" not in d.log() and time.monotonic() < deadline:
        time.sleep(0.05)
    c.register(KVLayout(2, 2, 64, "fp16"), "m")
    assert c.info.lease_ttl_s == 2.5
    lines = [json.loads(x) for x in d.log().splitlines() if x.startswith("{")]
    reload = [x for x in lines if "reloaded config" in x["msg"]]
    assert reload and "server.lease_ttl_s" in reload[0]["msg"] and "server.grpc_workers" in reload[0]["msg"]
    assert "dram.demote_high_watermark" in reload[0]["msg"].split("need a restart")[0]  # changed live
    cfg.write_text("[server]\nlease_ttl_s = -1\n")
    d.proc.send_signal(signal.SIGHUP)
    while "reload refused" not in d.log() and time.monotonic() < deadline + 10:
        time.sleep(0.05)
    assert "server.lease_ttl_s" in d.log().split("reload refused")[1]
    c.register(KVLayout(2, 2, 64, "fp16"), "m")
    assert c.info.lease_ttl_s == 2.5
    c.close()
