"""Shared by the deployment-artefact tests (tests/test_deploy*.py): paths, deploy/tools
modules loaded by path, and loading a daemon config the way the daemon does."""

from __future__ import annotations

import importlib.util
import sys
import tomllib
from pathlib import Path

from kvstore import config as kvconfig

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
CHART = DEPLOY / "helm" / "kvstore"
K8S = DEPLOY / "k8s"
UNIT = DEPLOY / "systemd" / "kvstore.service"


def _tool(name: str):
    """A module of deploy/tools (not a package: loaded by path, registered for dataclasses)."""
    full = f"deploy_tools_{name}"
    if full in sys.modules:
        return sys.modules[full]
    spec = importlib.util.spec_from_file_location(full, DEPLOY / "tools" / f"{name}.py")
    mod = sys.modules[full] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


promql = _tool("promql")
minihelm = _tool("minihelm")
sync = _tool("sync")


def load_config(toml_text: str, tmp_path: Path) -> kvconfig.Config:
    """Load through kvstore.config (unknown keys and bad values fail), with the DRAM size checked
    for syntax only: validate() refuses an arena larger than this machine's RAM."""
    data = tomllib.loads(toml_text)
    kvconfig.parse_size(data.get("dram", {}).get("capacity_bytes", 0))
    p = tmp_path / "kvstore.toml"
    p.write_text(toml_text)
    return kvconfig.load(p, env={}, overrides={"dram.capacity_bytes": "64MiB"})
