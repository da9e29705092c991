"""The metrics cross-check against a real daemon: start `kvstore serve`, scrape /metrics, and
check that every series the Grafana dashboard and the alert rules in deploy/ use is exported.

The same daemon also checks the contracts the deploy files rely on:
- READY=1 on $NOTIFY_SOCKET (systemd unit: Type=notify, NotifyAccess=main);
- `kvstore health` exits 0 finding the socket through KVSTORE_SERVER_SOCKET_PATH (Kubernetes
  probes and the container HEALTHCHECK run exactly that);
- SIGTERM ends the daemon cleanly well within the unit's TimeoutStopSec (30 s).

tests/test_deploy.py checks the same names against kvstore/daemon/metrics.py without a daemon.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parent.parent
READY_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 25.0  # the unit's TimeoutStopSec is 30 s
PROMETHEUS_BUILTINS = {"up"}


def _promql_tool():
    name = "deploy_tools_promql"  # tests/test_deploy.py loads the same module under this name
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, ROOT / "deploy" / "tools" / "promql.py")
    mod = sys.modules[name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


promql = _promql_tool()


@pytest.fixture(scope="module")
def notify(tmp_path_factory):
    """A datagram socket in place of systemd's $NOTIFY_SOCKET."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.bind(str(tmp_path_factory.mktemp("notify") / "notify"))
        yield s


@pytest.fixture(scope="module")
def daemon(module_daemons, notify):
    return module_daemons(env={"NOTIFY_SOCKET": notify.getsockname()})


def exported_series(text: str) -> tuple[set[str], dict[str, int]]:
    """Series names a scrape declares (from its TYPE lines and its samples), and the number of
    samples per series name."""
    names: set[str] = set()
    samples: dict[str, int] = {}
    for fam in text_string_to_metric_families(text):
        suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"],
                    "summary": ["", "_sum", "_count"]}.get(fam.type, [""])
        names |= {fam.name + s for s in suffixes}
        for s in fam.samples:
            names.add(s.name)
            samples[s.name] = samples.get(s.name, 0) + 1
    return names, samples


def test_every_metric_the_dashboard_and_rules_use_is_exported(daemon):
    with urllib.request.urlopen(daemon.metrics_url, timeout=5) as r:
        text = r.read().decode()
    names, samples = exported_series(text)
    used = promql.used_metric_names() - PROMETHEUS_BUILTINS
    missing = sorted(used - names)
    assert not missing, (f"deploy/grafana/kvstore-dashboard.json or deploy/prometheus/kvstore-rules.yaml use "
                         f"series the daemon does not export: {missing}")
    # The dashboard's instance picker is label_values(kvstore_info, instance): it needs a sample.
    assert samples.get("kvstore_info"), "kvstore_info has no sample: the dashboard's instance list would be empty"
    assert samples.get("kvstore_prefix_caching_enabled"), "KvstoreLowHitRate needs kvstore_prefix_caching_enabled"


def test_daemon_tells_systemd_it_is_ready(daemon, notify):
    deadline = time.monotonic() + READY_TIMEOUT_S  # it serves already: READY=1 is sent or on its way
    seen = []
    while time.monotonic() < deadline:
        notify.settimeout(max(0.1, deadline - time.monotonic()))
        try:
            msg = notify.recv(4096).decode(errors="replace")
        except TimeoutError:
            break
        seen.append(msg)
        if "READY=1" in msg.split("\n"):
            return
    pytest.fail(f"no READY=1 on $NOTIFY_SOCKET within {READY_TIMEOUT_S:.0f} s (got {seen}); "
                "deploy/systemd/kvstore.service is Type=notify")


@pytest.mark.parametrize("how", ["--socket", "environment"])
def test_health_command_exits_zero(daemon, how):
    """The Kubernetes probes run `kvstore health --socket PATH`; `kubectl exec` and the image's
    HEALTHCHECK rely on KVSTORE_SERVER_SOCKET_PATH."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    argv = [sys.executable, "-m", "kvstore", "health"]
    if how == "--socket":
        argv += ["--socket", daemon.socket_path]
    else:
        env["KVSTORE_SERVER_SOCKET_PATH"] = daemon.socket_path
    out = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, f"`kvstore health` ({how}) exited {out.returncode}:\n{out.stdout}{out.stderr}"


def test_sigterm_stops_the_daemon_cleanly(daemon):
    # Last in this module: it stops the shared daemon.
    daemon.proc.send_signal(signal.SIGTERM)
    try:
        rc = daemon.proc.wait(timeout=STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"daemon still running {STOP_TIMEOUT_S:.0f} s after SIGTERM (systemd would SIGKILL it at 30 s)")
    assert rc in (0, -signal.SIGTERM), f"exit status {rc} after SIGTERM:\n{daemon.log()[-4000:]}"
    assert "Traceback" not in daemon.log(), daemon.log()[-4000:]
