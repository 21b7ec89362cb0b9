#!/usr/bin/env bash
# make test-nouring: the NVMe tier without liburing (C++ Note [IoQueue backends]).
#   1. A build configured with ZERORT_WITH_LIBURING=OFF in its own directory (build-nouring/),
#      as on a machine without liburing: only the I/O and NVMe C++ tests are built, checked to
#      link no liburing, and run there (every io_uring case skips, saying why).
#   2. The NVMe pytest tests on the main build with the thread backend forced
#      (ZERORT_IO_BACKEND=threads); make test's test_offload_nvme_threads.py compares the two
#      backends' bits.
set -euo pipefail
BUILD=${NOURING_BUILD:-build-nouring}
PY=${PY:-.venv/bin/python}
JOBS=${JOBS:-$(nproc)}

mkdir -p "$BUILD"
cmake -S . -B "$BUILD" -DPython3_EXECUTABLE="$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY")" \
  -DZERORT_WITH_LIBURING=OFF -DZERORT_BUILD_PYTHON=OFF -DZERORT_BUILD_EXAMPLES=OFF >"$BUILD/configure.log" \
  || { cat "$BUILD/configure.log"; exit 1; }
grep "zerort: ZERORT_WITH_LIBURING=OFF" "$BUILD/configure.log"
cmake --build "$BUILD" -j "$JOBS" --target zerort_io_tests zerort_nvme_state_tests
for t in zerort_io_tests zerort_nvme_state_tests; do
  if ldd "$BUILD/tests/$t" | grep -q liburing; then echo "test-nouring: $t links liburing" >&2; exit 1; fi
  "$BUILD/tests/$t" --gtest_brief=1
done

ZERORT_IO_BACKEND=threads "$PY" -m pytest -q -rs tests/python/test_offload_nvme.py
echo "test-nouring: the I/O and NVMe tests passed without liburing ($BUILD) and with ZERORT_IO_BACKEND=threads"
