#!/usr/bin/env bash
# Build the C block codec (kvstore/_kvcodec.c, kvstore.codec's Codec.NIBBLE) as a plain shared
# library beside the kvstore package Python imports (the checkout's kvstore/ for an editable
# install, site-packages otherwise), loaded through ctypes:
#   scripts/build_kvcodec.sh .venv/bin/python
# It needs only a C compiler. Without it kvstore.codec encodes with PLANES_ZSTD (a fifth of the
# speed) and still decodes NIBBLE payloads (in numpy).
set -euo pipefail
PY=${1:?usage: build_kvcodec.sh PYTHON}
CC=${CC:-cc}
SRC="$(cd "$(dirname "$0")/.." && pwd)/kvstore/_kvcodec.c"
PKG=$("$PY" -P -c 'import os, kvstore; print(os.path.dirname(kvstore.__file__))')
OUT="$PKG/_kvcodec.so"
# Baseline x86-64 / aarch64 code: the library may be built on one host and run on another.
"$CC" -O3 -shared -fPIC -Wall -Werror "$SRC" -o "$OUT.tmp"
mv -f "$OUT.tmp" "$OUT"
"$PY" -P -c 'from kvstore.codec import native; assert native() is not None; print("built kvstore/_kvcodec.so")'
