#!/usr/bin/env bash
# Regenerates the committed gRPC stubs from proto/ (tests/test_proto_fresh.py checks they match).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
out=${1:-.}
"$PY" -m grpc_tools.protoc -Iproto --python_out="$out" --pyi_out="$out" --grpc_python_out="$out" proto/kvstore/v1/kvstore.proto proto/kvstore/v1/peer.proto
"$PY" -m grpc_tools.protoc -Iproto --python_out="$out" --pyi_out="$out" --grpc_python_out="$out" proto/kvstore/cluster/etcdpb/kv.proto proto/kvstore/cluster/etcdpb/rpc.proto
