"""``tests/gpu/run.sh`` without a GPU, with a python that has numpy and torch but not the kvstore
package (as on a GPU machine's image): the package must come from run.sh's shim. On the first
GPU machine it did not: ``python -m pytest`` from the repository root put the source tree's
``kvstore/`` (without the tiers/transport/clients subpackages) ahead of the shim."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_run_sh_collects_every_gpu_test_through_its_shim(tmp_path):
    # A python that sees site-packages (numpy, torch, pytest) but not the installed kvstore:
    # -S skips site, so the editable install's .pth finder is never loaded.
    site = sysconfig.get_paths()["purelib"]
    wrapper = tmp_path / "python-without-kvstore"
    wrapper.write_text(f'#!/bin/sh\nPYTHONPATH="$PYTHONPATH:{site}" exec {sys.executable} -S "$@"\n')
    wrapper.chmod(0o755)
    probe = subprocess.run([str(wrapper), "-c", "import kvstore.tiers"], capture_output=True, text=True,
                           cwd=tmp_path)
    assert probe.returncode != 0, "the wrapper must not see the installed package"
    env = {**os.environ, "KVSTORE_GPU_PYTHON": str(wrapper), "KVSTORE_GPU_WORK": str(tmp_path / "work"),
           "KVSTORE_GPU_OUT": str(tmp_path / "out")}
    p = subprocess.run(["bash", str(ROOT / "tests/gpu/run.sh")], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=240)
    assert p.returncode == 0, p.stderr[-3000:]
    summary = json.loads((tmp_path / "out" / "gpu_summary.json").read_text())
    tests = summary["tests"]
    assert tests["failed"] == 0 and tests["passed"] + tests["skipped"] >= 29, summary
    assert f"python: {wrapper}" in p.stderr
    # The copy-path table (issue 18) ran and said why it measured nothing; its file is there.
    assert summary["copy_paths"]["skipped"].startswith("no CUDA device"), summary["copy_paths"]
    assert (tmp_path / "out" / "kernels_table.md").read_text().startswith("not measured: no CUDA device")

