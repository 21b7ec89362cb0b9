#!/usr/bin/env bash
# DeepSpeed 0.19.8 for the H200 machine, which has no network: it and what it needs beyond that machine's
# venv (torch, numpy, ninja are there), as wheels for its Python (3.12, x86_64 manylinux), into
# deps/ds-wheels (DS_WHEELS). scripts/gpu_check.sh installs them there with pip --no-index into a venv
# over the machine's torch and runs DeepSpeed's offload rows of bench/gpu_offload.py. Run it here, with
# the network and make bench-ds's .venv-ds (DeepSpeed's setup imports torch):
#   bash scripts/ds_wheels.sh
# DeepSpeed is pure Python; its CPU Adam builds on first use there (gpu_check gives it /usr/bin/g++).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${DS_WHEELS:-deps/ds-wheels}
PYV=${DS_PYTHON_VERSION:-3.12}
PY=${DS_BUILD_PYTHON:-.venv-ds/bin/python}
mkdir -p "$OUT"
# deepspeed from its source release, without its compiled ops or build isolation
DS_BUILD_OPS=0 "$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$OUT" deepspeed==0.19.8
# its requirements, binary wheels for the machine's Python (pydantic brings pydantic-core and its own)
"$PY" -m pip download -q --only-binary=:all: --python-version "$PYV" --implementation cp \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 -d "$OUT" \
  hjson msgpack psutil py-cpuinfo einops nvidia-ml-py packaging tqdm 'pydantic>=2,<3'
ls "$OUT"
