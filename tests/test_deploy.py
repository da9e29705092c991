"""The deployment artefacts in deploy/ parse and agree with the code: every YAML/JSON/TOML file
parses; every example config loads through kvstore.config; the systemd unit passes
`systemd-analyze verify` and `security` where systemd-analyze exists; the container file and
docs/deploy.md name what exists. Monitoring: test_deploy_monitoring.py; Kubernetes and Helm:
test_deploy_k8s.py."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

from deploy_util import CHART, DEPLOY, K8S, ROOT, UNIT, load_config


# --- files parse, configs load ------------------------------------------------------------

def test_every_yaml_json_and_toml_file_parses():
    templates = CHART / "templates"
    for p in sorted(DEPLOY.rglob("*")):
        if templates in p.parents or not p.is_file():
            continue
        if p.suffix in (".yaml", ".yml"):
            assert list(yaml.safe_load_all(p.read_text())), p
        elif p.suffix == ".json":
            json.loads(p.read_text())
        elif p.suffix == ".toml":
            tomllib.loads(p.read_text())


@pytest.mark.parametrize("path", ["systemd/kvstore.toml", "container.toml"])
def test_example_configs_load(path, tmp_path):
    load_config((DEPLOY / path).read_text(), tmp_path)


# --- systemd ------------------------------------------------------------------------------

def unit_directives(text: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith(("#", ";", "[")):
            k, _, v = line.partition("=")
            out.setdefault(k.strip(), []).append(v.strip())
    return out


def test_unit_file_has_the_production_settings(tmp_path):
    d = unit_directives(UNIT.read_text())
    one = {k: v[-1] for k, v in d.items()}
    assert one["Type"] == "notify" and one["NotifyAccess"] == "main"
    assert one["Restart"] == "on-failure" and one["LimitMEMLOCK"] == "infinity"
    assert one["ProtectSystem"] == "strict" and one["PrivateTmp"] == "yes" and one["NoNewPrivileges"] == "yes"
    assert "HUP" in one["ExecReload"] and "$MAINPID" in one["ExecReload"]
    argv = one["ExecStart"].split()
    assert argv[1:3] == ["serve", "--config"]
    assert argv[3] == "/etc/kvstore/kvstore.toml"
    cfg = load_config((DEPLOY / "systemd" / "kvstore.toml").read_text(), tmp_path)
    assert cfg.server.socket_path == f"/run/{one['RuntimeDirectory']}/kvstore.sock"
    writable = d.get("ReadWritePaths", []) + [f"/var/lib/{s}" for s in d.get("StateDirectory", [])]
    assert any(cfg.nvme.dir == w or cfg.nvme.dir.startswith(w + "/") for w in writable), \
        "nvme.dir must be writable under ProtectSystem=strict"
    stop = one["TimeoutStopSec"]
    assert stop.endswith("s") and int(stop[:-1]) > cfg.server.shutdown_grace_s
    # Warm restart: room to write the whole DRAM tier out to NVMe at 1 GB/s at SIGTERM.
    if cfg.nvme.dir:
        assert cfg.server.shutdown_grace_s >= cfg.resolved_dram_bytes() / 1e9


def _verifiable_unit(tmp_path: Path) -> Path:
    """verify insists the ExecStart binary exists: point it at this interpreter in a copy."""
    unit = tmp_path / "kvstore.service"
    unit.write_text(UNIT.read_text().replace("/opt/kvstore/bin/kvstore", sys.executable))
    return unit


@pytest.mark.skipif(not shutil.which("systemd-analyze"), reason="systemd-analyze not installed")
def test_unit_file_passes_systemd_analyze_verify(tmp_path):
    unit = _verifiable_unit(tmp_path)
    out = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=60)
    # verify exits 0 on unknown keys and bad values, only warning about them: any line naming
    # our unit is a failure.
    ours = [line for line in (out.stdout + out.stderr).splitlines() if "kvstore" in line]
    assert out.returncode == 0 and not ours, out.stdout + out.stderr


@pytest.mark.skipif(not shutil.which("systemd-analyze"), reason="systemd-analyze not installed")
def test_unit_file_sandboxing_exposure(tmp_path):
    unit = _verifiable_unit(tmp_path)
    # --threshold is exposure x 10: 30 means "OK" or better (3.0 of 10).
    out = subprocess.run(["systemd-analyze", "security", "--offline=yes", "--threshold=30", str(unit)],
                         capture_output=True, text=True, timeout=60)
    if "Unknown option" in out.stderr or "unrecognized option" in out.stderr:
        pytest.skip("this systemd-analyze has no offline security analysis (systemd < 250)")
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr


@pytest.mark.skipif(not shutil.which("systemd-sysusers"), reason="systemd-sysusers not installed")
def test_sysusers_creates_the_service_account(tmp_path):
    (tmp_path / "etc").mkdir()
    out = subprocess.run(["systemd-sysusers", f"--root={tmp_path}", str(DEPLOY / "systemd" / "kvstore.sysusers")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    passwd = (tmp_path / "etc" / "passwd").read_text()
    user = unit_directives(UNIT.read_text())["User"][-1]
    assert re.search(rf"^{user}:x:\d+:\d+:.*:/usr/sbin/nologin$", passwd, re.M), passwd


@pytest.mark.skipif(not shutil.which("systemd-tmpfiles"), reason="systemd-tmpfiles not installed")
def test_tmpfiles_drop_in_turns_on_shared_memory_huge_pages(tmp_path):
    """The drop-in writes "advise" into shmem_enabled (here a file under --root, as the kernel's
    sysfs file would take it), and nothing else."""
    thp = tmp_path / "sys" / "kernel" / "mm" / "transparent_hugepage"
    thp.mkdir(parents=True)
    (thp / "shmem_enabled").write_text("never\n")
    out = subprocess.run(["systemd-tmpfiles", f"--root={tmp_path}", "--create",
                          str(DEPLOY / "systemd" / "kvstore-thp.conf")], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert (thp / "shmem_enabled").read_text().strip() == "advise"
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["kernel", "mm", "shmem_enabled", "sys",
                                                            "transparent_hugepage"]


# --- container build and docs ---------------------------------------------------------------

def test_containerfile(tmp_path):
    text = (DEPLOY / "Containerfile").read_text()
    froms = re.findall(r"^FROM\s+(\S+)", text, re.M)
    assert froms and all(f == "python:3.11-slim" or f.startswith("python:3.11-slim") for f in froms)
    assert re.search(r"pip install \S*\.", text), "installs the project with pip install ."
    user = re.findall(r"^USER\s+(\S+)", text, re.M)
    assert user and user[-1].split(":")[0] not in ("0", "root"), "runs as non-root"
    uid = int(user[-1].split(":")[0])
    ds = yaml.safe_load((K8S / "daemonset.yaml").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert uid == ds["spec"]["template"]["spec"]["securityContext"]["runAsUser"] == \
        values["podSecurityContext"]["runAsUser"], "the image user is the one the manifests run as"
    for src in re.findall(r"^COPY\s+(?!--from)(\S+)\s", text, re.M):
        assert src == "." or (ROOT / src).exists(), src
    exposed = {int(p) for p in re.findall(r"^EXPOSE\s+(.+)$", text, re.M)[0].split()}
    cfg = load_config((DEPLOY / "container.toml").read_text(), tmp_path)
    assert {int(cfg.transport.listen.rsplit(":", 1)[1]), cfg.metrics.port} <= exposed


def test_docs_reference_existing_files():
    text = (ROOT / "docs" / "deploy.md").read_text()
    paths = set(re.findall(r"\b(deploy/[\w./-]+[\w/])", text))
    assert paths, "docs/deploy.md names no deploy/ files"
    missing = sorted(p for p in paths if not (ROOT / p).exists())
    assert not missing, f"docs/deploy.md names missing files: {missing}"
