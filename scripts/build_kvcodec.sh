#!/usr/bin/env bash
# Build kvstore's two C libraries, plain shared libraries beside the packages Python imports
# (the checkout's kvstore/ and tiers/ for an editable install, site-packages otherwise), loaded
# through ctypes:
#   scripts/build_kvcodec.sh .venv/bin/python
# - kvstore/_kvcodec.c, the block codec (kvstore.codec's Codec.NIBBLE). Without it kvstore.codec
#   encodes with PLANES_ZSTD (a fifth of the speed) and still decodes NIBBLE payloads (in numpy).
# - tiers/_kvcopy.c, the CPU caches' whole-block copies (kvstore.tiers.cpu_copy). Without it the
#   connector copies with torch, a call per layer and run of adjacent slots.
# They need only a C compiler.
set -euo pipefail
PY=${1:?usage: build_kvcodec.sh PYTHON}
CC=${CC:-cc}
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PKG=$("$PY" -P -c 'import os, kvstore; print(os.path.dirname(kvstore.__file__))')
TIERS=$("$PY" -P -c 'import os, kvstore.tiers; print(os.path.dirname(kvstore.tiers.__file__))')
# Baseline x86-64 / aarch64 code: the libraries may be built on one host and run on another.
"$CC" -O3 -shared -fPIC -Wall -Werror "$ROOT/kvstore/_kvcodec.c" -o "$PKG/_kvcodec.so.tmp"
mv -f "$PKG/_kvcodec.so.tmp" "$PKG/_kvcodec.so"
"$CC" -O3 -shared -fPIC -Wall -Werror -pthread "$ROOT/tiers/_kvcopy.c" -o "$TIERS/_kvcopy.so.tmp"
mv -f "$TIERS/_kvcopy.so.tmp" "$TIERS/_kvcopy.so"
"$PY" -P -c 'from kvstore.codec import native; assert native() is not None; print("built kvstore/_kvcodec.so")'
"$PY" -P -c 'from kvstore.tiers.cpu_copy import native; assert native() is not None; print("built tiers/_kvcopy.so")'
