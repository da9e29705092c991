"""The committed gRPC stubs match what protoc generates from proto/ today."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_generated_stubs_are_fresh(tmp_path):
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", f"-I{ROOT / 'proto'}", f"--python_out={tmp_path}",
                    f"--pyi_out={tmp_path}", f"--grpc_python_out={tmp_path}",
                    str(ROOT / "proto/kvstore/v1/kvstore.proto")], check=True)
    for name in ("kvstore_pb2.py", "kvstore_pb2.pyi", "kvstore_pb2_grpc.py"):
        fresh = (tmp_path / "kvstore/v1" / name).read_text()
        committed = (ROOT / "kvstore/v1" / name).read_text()
        assert fresh == committed, f"kvstore/v1/{name} is stale: run `make proto` and commit the result"


def test_every_rpc_is_commented():
    text = (ROOT / "proto/kvstore/v1/kvstore.proto").read_text().splitlines()
    for i, line in enumerate(text):
        if line.strip().startswith("rpc "):
            assert text[i - 1].strip().startswith("//"), f"{line.strip()} has no comment"
