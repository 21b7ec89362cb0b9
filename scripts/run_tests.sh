#!/usr/bin/env bash
# Runs the tests: CTest (GoogleTest, MPI multi-process) then pytest (casts vs torch, gloo under
# torchrun, MPI under mpirun). Both always run; the script ends with both summary lines and
# fails if either failed.
#
#   bash scripts/run_tests.sh quick   # make test: the cases tests/quick.txt lists, at least one of every part
#   bash scripts/run_tests.sh all     # make test-all: every test
set -uo pipefail
MODE=${1:-all}
BUILD=${BUILD:-build}
PY=${PY:-.venv/bin/python}
QUICK=tests/quick.txt
log=$(mktemp -d)
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1

ctest_args=() pytest_args=(tests/python tests/gpu)
case $MODE in
  all) ;;
  quick)
    # tests/quick.txt: "ctest REGEX" or "pytest NODE_ID" a line, each followed by what it proves.
    regexes=() pytest_args=()
    while read -r kind what _; do
      case $kind in
        ctest) regexes+=("$what") ;;
        pytest) pytest_args+=("$what") ;;
        "" | "#"*) ;;
        *) echo "run_tests.sh: $QUICK: a line starts with '$kind'; expected ctest, pytest or #" >&2; exit 2 ;;
      esac
    done <"$QUICK"
    ctest_args=(-R "$(IFS='|'; echo "${regexes[*]}")") ;;
  *) echo "run_tests.sh: mode '$MODE'; expected quick or all" >&2; exit 2 ;;
esac

ctest --test-dir "$BUILD" --output-on-failure -j 2 "${ctest_args[@]}" 2>&1 | tee "$log/ctest.txt"
ctest_rc=${PIPESTATUS[0]}
"$PY" -m pytest -q -rs --durations=30 "${pytest_args[@]}" 2>&1 | tee "$log/pytest.txt"
pytest_rc=${PIPESTATUS[0]}
# A run where every test skipped is a broken run (a hook or an import gone wrong), not a pass.
grep -qE "[0-9]+ passed" "$log/pytest.txt" || { echo "pytest: no test passed"; pytest_rc=1; }

echo
echo "================ summary ($MODE) ================"
grep -ah "^\[accuracy" "$BUILD/Testing/Temporary/LastTest.log" 2>/dev/null | sort -u
echo "CTest:  $(grep -E 'tests passed|tests failed' "$log/ctest.txt" | tail -1)"
echo "pytest: $(tail -1 "$log/pytest.txt")"
rm -rf "$log"
[[ $ctest_rc -eq 0 && $pytest_rc -eq 0 ]]
