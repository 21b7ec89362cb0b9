#!/usr/bin/env bash
# make bench: the reduce-scatter table at W = 2 and W = 4.
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/python -m pip install -q -r bench/requirements.txt
for np in 2 4; do
  bash scripts/mpirun.sh -np "$np" .venv/bin/python bench/reduce_scatter.py "$@"
done
