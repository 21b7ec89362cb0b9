#!/usr/bin/env bash
# Runs every test: CTest (GoogleTest, MPI multi-process) then pytest (casts vs torch, gloo
# under torchrun, MPI under mpirun). Both always run; the script ends with both summary
# lines and fails if either failed.
set -uo pipefail
BUILD=${BUILD:-build}
PY=${PY:-.venv/bin/python}
log=$(mktemp -d)
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1

ctest --test-dir "$BUILD" --output-on-failure -j 2 2>&1 | tee "$log/ctest.txt"
ctest_rc=${PIPESTATUS[0]}
"$PY" -m pytest -q -rs tests/python tests/gpu 2>&1 | tee "$log/pytest.txt"
pytest_rc=${PIPESTATUS[0]}
# A run where every test skipped is a broken run (a hook or an import gone wrong), not a pass.
grep -qE "[0-9]+ passed" "$log/pytest.txt" || { echo "pytest: no test passed"; pytest_rc=1; }

echo
echo "================ summary ================"
grep -ah "^\[accuracy" "$BUILD/Testing/Temporary/LastTest.log" 2>/dev/null | sort -u
echo "CTest:  $(grep -E 'tests passed|tests failed' "$log/ctest.txt" | tail -1)"
echo "pytest: $(tail -1 "$log/pytest.txt")"
rm -rf "$log"
[[ $ctest_rc -eq 0 && $pytest_rc -eq 0 ]]
