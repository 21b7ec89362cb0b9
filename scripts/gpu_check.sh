#!/usr/bin/env bash
# The one GPU check, for a machine with an NVIDIA GPU, nvcc and PyTorch with CUDA (about 5
# minutes on an H100/H200). It builds zerort with CUDA and NCCL, runs the CUDA kernel tests
# (C++ and Python) against the CPU kernels, the CUDA engine tests at W = 1 on NCCL and at
# W = 2 and 4 on one GPU (mpi with CUDA buffers staged through pinned host memory), the
# optimizer states in host memory (offload_optimizer "cpu") against the GPU-resident run, and the
# GPU benchmarks, then ends with one table. Every step runs even if an earlier one failed;
# the exit status is non-zero if any failed.
#
#   bash scripts/gpu_check.sh                # PY=python3 BUILD=build-gpu CUDA_ARCHS=90
#   GTEST_SOURCE=/usr/src/googletest bash scripts/gpu_check.sh   # builds GoogleTest if missing
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
BUILD=${BUILD:-build-gpu}
CUDA_ARCHS=${CUDA_ARCHS:-90}
LOGS=${GPU_CHECK_LOGS:-$BUILD/logs}
mkdir -p "$LOGS"
export PYTHONUNBUFFERED=1
results=()

step() {  # step NAME COMMAND...: runs it, logs it, records status and seconds
  local name=$1
  shift
  echo
  echo "=================== $name"
  local t0=$SECONDS
  "$@" 2>&1 | tee "$LOGS/$name.log"
  local rc=${PIPESTATUS[0]}
  results+=("$name|$rc|$((SECONDS - t0))")
  return 0
}

gtest_args=()
if [[ -n "${GTEST_SOURCE:-}" ]]; then
  step gtest bash -c "cmake -S '$GTEST_SOURCE' -B '$BUILD/gtest-build' -DCMAKE_INSTALL_PREFIX='$BUILD/gtest' \
    -DCMAKE_POSITION_INDEPENDENT_CODE=ON -DBUILD_GMOCK=OFF >/dev/null && cmake --build '$BUILD/gtest-build' -j $(nproc) \
    >/dev/null && cmake --install '$BUILD/gtest-build' >/dev/null && echo built GoogleTest"
  gtest_args=(-DGTest_DIR="$PWD/$BUILD/gtest/lib/cmake/GTest")
fi

step machine bash -c "nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; nvcc --version | tail -1; \
  $PY -c 'import torch; print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda, torch.cuda.get_device_name())'"
step configure cmake -S . -B "$BUILD" -DPython3_EXECUTABLE="$(command -v "$PY")" -DCMAKE_CUDA_ARCHITECTURES="$CUDA_ARCHS" \
  -DZERORT_BUILD_EXAMPLES=OFF "${gtest_args[@]}"
step build cmake --build "$BUILD" -j "$(nproc)" --target _C zerort_cuda_tests
# Each run is bounded, so one stuck step cannot eat the others' time.
step cpp_cuda_kernels timeout 120 "$BUILD/tests/zerort_cuda_tests"
step engine_smoke timeout 120 "$PY" -X faulthandler tests/gpu/gpu_engine_worker.py "$BUILD/smoke" mlp:1:bf16:1:3 \
  mlp:2:fp16:1:3 mlp:3:bf16:1:3
step py_cuda_kernels timeout 180 "$PY" -m pytest -q -rs tests/gpu/test_gpu_kernels.py
step cuda_engine_nccl timeout 400 "$PY" -m pytest -q -rs -s tests/gpu/test_gpu_engine.py -k "not host_memory"
step nccl_timeout timeout 60 "$PY" -m pytest -q -rs tests/gpu/test_nccl_timeout.py
step offload_cpu timeout 200 "$PY" -m pytest -q -rs tests/gpu/test_gpu_engine.py -k host_memory
step bench_kernels timeout 120 "$PY" bench/gpu_kernels.py
step bench_gpt350m timeout 240 "$PY" bench/gpu_gpt.py

echo
echo "=================== gpu_check summary ($(nvidia-smi --query-gpu=name --format=csv,noheader | head -1))"
for f in bench_kernels bench_gpt350m; do grep -h -E '^(\||GPU:)' "$LOGS/$f.log" 2>/dev/null; echo; done
grep -h "gpu parity" "$LOGS/cuda_engine_nccl.log" 2>/dev/null | sed 's/^.*\[gpu parity/[gpu parity/' | sort -u
echo
printf '| %-18s | %-6s | %7s |\n' step result seconds
printf '|%s|%s|%s|\n' "--------------------" "--------" "---------"
failed=0
for r in "${results[@]}"; do
  IFS='|' read -r name rc secs <<<"$r"
  [[ $rc -eq 0 ]] && res=pass || { res="FAIL($rc)"; failed=1; }
  printf '| %-18s | %-6s | %7s |\n' "$name" "$res" "$secs"
done
exit $failed
