"""The engine harness itself (kvstore.app.bench.vllm_engine), where the benches and the real-engine
tests depend on it beyond what they check: a script that starts a vLLM engine and exits without
stopping it must still exit, and leave no engine behind. (multiprocessing's own exit hook waits
without a timeout for every child still running, and an engine waits for its next command.)"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
import time

import pytest

# find_spec, not importorskip: the script imports vLLM itself (an import here would cost 15 s)
pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")

SCRIPT = textwrap.dedent("""
    import sys
    from pathlib import Path
    from kvstore.app.bench.vllm_engine import EngineProc, EngineSpec

    if __name__ == "__main__":
        work, model = Path(sys.argv[1]), sys.argv[2]
        e = EngineProc.start(EngineSpec(model, max_model_len=256), work / "engine.log")
        assert e.generate([[1, 2, 3] * 11], max_tokens=2)["results"][0]["tokens"]
        print(e.proc.pid, flush=True)
        # ends here, the engine still running
""")


def test_a_script_that_leaves_its_engine_running_still_exits_and_leaves_none(tmp_path):
    from kvstore.app.bench.vllm_engine import save_llama  # torch and transformers, not vLLM

    model = save_llama(tmp_path / "model", "tiny", max_positions=256)  # here: the script imports less
    script = tmp_path / "leave_it_running.py"
    script.write_text(SCRIPT)
    p = subprocess.run([sys.executable, str(script), str(tmp_path), str(model)], capture_output=True, text=True,
                       timeout=240)
    assert p.returncode == 0, p.stderr[-4000:]
    pid = int(p.stdout.split()[-1])
    deadline = time.monotonic() + 10  # it was reaped by the script's exit; give the kernel a moment
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        os.kill(pid, 9)
        pytest.fail(f"engine {pid} still running after its parent exited")
    assert "Traceback" not in p.stderr, p.stderr[-4000:]
