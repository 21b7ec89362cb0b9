#!/usr/bin/env bash
# make bench: every benchmark table (docs/BENCHMARKS.md records them).
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/python -m pip install -q -r bench/requirements.txt
for np in 2 4; do
  bash scripts/mpirun.sh -np "$np" .venv/bin/python bench/reduce_scatter.py
done
.venv/bin/python bench/optimizer.py
.venv/bin/python bench/optimizer_states.py
.venv/bin/python bench/e2e.py
