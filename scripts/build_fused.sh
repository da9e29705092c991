#!/usr/bin/env bash
# Build the UCX receive that hashes as it copies (transport/_fused.c) for a Python environment
# that has the [ucx] extra:
#   scripts/build_fused.sh .venv/bin/python
# It needs a C compiler, Python's headers and xxhash.h (Debian: libxxhash-dev, which
# `make sysdeps` installs); UCX's headers and libraries come from the libucx wheel that ucxx
# installed. The module lands beside the kvstore.transport package that Python imports (the
# checkout's transport/ for an editable install, site-packages otherwise). Without it the UCX
# receiver hashes each payload once it has landed instead (slower on shared memory, as correct).
set -euo pipefail
PY=${1:?usage: build_fused.sh PYTHON}
CC=${CC:-cc}
SRC="$(cd "$(dirname "$0")/.." && pwd)/transport/_fused.c"
# -P: not the current directory first on sys.path (a source tree is not the installed package)
read -r PYINC EXT PKG UCX < <("$PY" -P - <<'PYEOF'
import os, sysconfig
import libucx, kvstore.transport
print(sysconfig.get_paths()["include"], sysconfig.get_config_var("EXT_SUFFIX"),
      os.path.dirname(kvstore.transport.__file__), os.path.dirname(libucx.__file__))
PYEOF
)
for h in "$UCX/include/ucp/api/ucp.h"; do
  [ -f "$h" ] || { echo "build_fused: $h missing (is the [ucx] extra installed?)" >&2; exit 1; }
done
echo '#include <xxhash.h>' | "$CC" -E -x c - >/dev/null 2>&1 || {
  echo "build_fused: xxhash.h not found: install libxxhash-dev (Debian/Ubuntu) or xxhash-devel (Fedora)" >&2; exit 1; }
OUT="$PKG/_fused$EXT"
# Baseline x86-64 / aarch64 code: the module may be built on one host and run on another. The
# rpath finds libucx's libucp wherever that wheel is installed, also when ucxx has not loaded it.
"$CC" -O3 -shared -fPIC -Wall -Werror -I"$PYINC" -I"$UCX/include" "$SRC" -o "$OUT.tmp" \
  -L"$UCX/lib" -lucp -lucs -Wl,-rpath,"$UCX/lib"
mv -f "$OUT.tmp" "$OUT"
"$PY" -P -c 'import kvstore.transport.ucx_env as e; m, why = e.fused(); assert m is not None, why; print("built", m.__file__)'
