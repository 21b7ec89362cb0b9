#!/usr/bin/env bash
# CI check of cmake/ZerortLibstdcxx.cmake: a compiler that links libstdc++ statically into
# shared objects (here /usr/bin/g++ behind a wrapper that adds -static-libstdc++, as the H200
# machine's /opt/gcc does in its specs) must give either a configure error that names the
# compiler and what to set, or a zerort._C whose every shared library has libstdc++.so among
# its NEEDED entries and whose messages are whole. Never a module with its own copy: that one
# says "world_size must be >= 1, got " without the 0, or segfaults.
#
# nvcc is taken off PATH: with CUDA on, CMake's CUDA implicit link libraries add -lstdc++ and
# hide the static copy on this machine. Only _C is built, in its own directory (default
# /tmp/zerort-static-libstdcxx), and written there, not into python/zerort.
#
#   bash scripts/check_static_libstdcxx.sh      # PY=.venv/bin/python WORK=/tmp/zerort-static-libstdcxx
set -euo pipefail
cd "$(dirname "$0")/.."
SRC=$PWD
PY=${PY:-.venv/bin/python}
[[ $PY == /* ]] || PY=$PWD/$PY  # absolute, but not resolved: a venv's python is a link to its base
WORK=${WORK:-/tmp/zerort-static-libstdcxx}
REAL_CXX=${REAL_CXX:-/usr/bin/g++}
REAL_CC=${REAL_CC:-/usr/bin/gcc}
JOBS=${JOBS:-2}
fail() {
  echo "check_static_libstdcxx: FAIL: $*" >&2
  exit 1
}
lock() {  # the build lock shared by the builds on this machine, when flock exists
  if command -v flock >/dev/null; then flock /tmp/zerort-build.lock "$@"; else "$@"; fi
}

rm -rf "$WORK"
mkdir -p "$WORK/bin" "$WORK/py"
printf '#!/bin/sh\nexec %s "$@" -static-libstdc++\n' "$REAL_CXX" >"$WORK/bin/g++"
printf '#!/bin/sh\nexec %s "$@" -static-libstdc++\n' "$REAL_CC" >"$WORK/bin/gcc"
chmod +x "$WORK/bin/g++" "$WORK/bin/gcc"

# The wrapper must really link libstdc++ statically, or this check proves nothing.
printf '#include <sstream>\nstd::string f(int n) { std::ostringstream os; os << n; return os.str(); }\n' >"$WORK/probe.cpp"
"$WORK/bin/g++" -shared -fPIC "$WORK/probe.cpp" -o "$WORK/probe.so"
if readelf -d "$WORK/probe.so" | grep -q 'NEEDED.*libstdc++\.so'; then
  fail "the wrapper's probe still has libstdc++.so in NEEDED: $REAL_CXX ignores -static-libstdc++"
fi
echo "wrapper $WORK/bin/g++: a probe it links has no libstdc++.so in NEEDED (static copy)"

# PATH without nvcc.
path=""
IFS=: read -ra dirs <<<"$PATH"
for d in "${dirs[@]}"; do [[ -x "$d/nvcc" ]] || path+="${path:+:}$d"; done
cc_env=(env -u CUDACXX -u CUDAHOSTCXX PATH="$path" CC="$WORK/bin/gcc" CXX="$WORK/bin/g++"
  CCACHE_COMPILERCHECK="string:$("$REAL_CXX" -dumpfullversion)-static-libstdcxx-wrapper")
"${cc_env[@]}" sh -c '! command -v nvcc >/dev/null' || fail "nvcc is still on PATH"
configure() {  # configure DIR [cmake args...]: its log in DIR.log
  local dir=$1
  shift
  "${cc_env[@]}" cmake -S "$SRC" -B "$dir" -DPython3_EXECUTABLE="$PY" -DZERORT_BUILD_TESTS=OFF \
    -DZERORT_BUILD_EXAMPLES=OFF -DZERORT_PYTHON_OUTPUT_DIR="$WORK/py/zerort" "$@" >"$dir.log" 2>&1
}

# 1. The refusal: ZERORT_SHARE_LIBSTDCXX=OFF must stop the configure, naming the compiler and the way out.
if configure "$WORK/refuse" -DZERORT_SHARE_LIBSTDCXX=OFF; then
  fail "with ZERORT_SHARE_LIBSTDCXX=OFF the configure passed under the static wrapper (log: $WORK/refuse.log)"
fi
grep -q "C++ compiler $WORK/bin/g++" "$WORK/refuse.log" && grep -q "CXX=/usr/bin/g++" "$WORK/refuse.log" ||
  fail "the configure failed, but not with the libstdc++ error naming the compiler (log: $WORK/refuse.log)"
echo "ZERORT_SHARE_LIBSTDCXX=OFF: the configure stops:"
sed -n '/CMake Error/,/^$/p' "$WORK/refuse.log" | sed 's/^/  /'

# 2. The default: the fix, or the configure error.
if ! configure "$WORK/build"; then
  grep -q "CXX=/usr/bin/g++" "$WORK/build.log" ||
    fail "the configure failed, but not with the libstdc++ error (log: $WORK/build.log)"
  echo "default: the configure stops (the fix could not be verified for this compiler):"
  sed -n '/CMake Error/,/^$/p' "$WORK/build.log" | sed 's/^/  /'
  echo "check_static_libstdcxx: pass (refused)"
  exit 0
fi
grep -q "nvcc not found" "$WORK/build.log" || fail "CUDA was found; this check needs the build without it"
echo "default: the configure passes with the fix:"
sed -n '/CMake Warning at .*ZerortLibstdcxx/,/^$/p' "$WORK/build.log" | sed 's/^/  /'

# Only _C, with the package's Python files beside it (the .venv's zerort.pth comes after PYTHONPATH).
tar -C python --exclude='_C*.so' --exclude=__pycache__ -cf - zerort | tar -C "$WORK/py" -xf -
lock "${cc_env[@]}" cmake --build "$WORK/build" -j "$JOBS" --target _C >"$WORK/build-C.log" 2>&1 ||
  fail "the build of _C failed (log: $WORK/build-C.log)"

mapfile -t libs < <(find "$WORK/build" "$WORK/py" -name '*.so' -o -name '*.so.*' | grep -v CMakeFiles)
[[ ${#libs[@]} -ge 1 ]] || fail "no shared object was built"
for lib in "${libs[@]}"; do
  readelf -d "$lib" | grep -q 'NEEDED.*\[libstdc++\.so' || fail "$lib has no libstdc++.so in NEEDED (readelf -d)"
  if nm -D --defined-only "$lib" | grep -qE ' _ZNSt6locale7classicEv($|@)'; then
    fail "$lib defines std::locale::classic(): it carries its own libstdc++"
  fi
  echo "$lib: NEEDED $(readelf -d "$lib" | grep -o 'libstdc++\.so[^]]*'), no copy of libstdc++'s symbols"
done

PYTHONPATH="$WORK/py" "$PY" - "$WORK" <<'EOF'
import sys

import torch  # noqa: F401  LibTorch's libstdc++ first, as in every zerort process
import zerort

assert zerort._C.__file__.startswith(sys.argv[1]), zerort._C.__file__
try:
    zerort._C.ShardLayout([4], 0)
except Exception as e:  # noqa: BLE001
    msg = f"{type(e).__name__}: {e}"
else:
    sys.exit("ShardLayout([4], 0) raised nothing")
print(f"ShardLayout([4], 0) raised {msg}")
if "got 0" not in msg:
    sys.exit(f"the message lost its number (a second libstdc++ in the process): {msg!r}")
EOF
echo "check_static_libstdcxx: pass (fixed: _C shares libstdc++ and its messages are whole)"
