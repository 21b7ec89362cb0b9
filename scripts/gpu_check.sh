#!/usr/bin/env bash
# The one GPU check, for a machine with an NVIDIA GPU, nvcc and PyTorch with CUDA (about 4
# minutes on an H200, builds included). It builds zerort with CUDA and NCCL, runs the CUDA
# kernel tests (C++ and Python) against the CPU kernels, the CUDA engine tests at W = 1 on NCCL
# and at W = 2 and 4 on one GPU (mpi with CUDA buffers staged through pinned host memory), the
# optimizer states in host memory (offload_optimizer "cpu") against the GPU-resident run, and
# the GPU benchmarks, then ends with one table. Every step runs even if an earlier one failed;
# the exit status is non-zero if any failed. A step whose tool is missing is skipped, with the
# reason in the table; it never fails for that.
#
# It runs on the machine as it is, without network (docs/GPU.md says what travels with the tree):
#   bash scripts/gpu_check.sh
#   GTEST_SOURCE=deps/gtest/usr/src/googletest LIBURING_ROOT=deps/uring bash scripts/gpu_check.sh
# PY=python3, BUILD=$TMPDIR/zerort-gpu-check (outside the tree: a second run only rebuilds what
# changed), CUDA_ARCHS=90. GTEST_SOURCE: GoogleTest's source (or a `dpkg -x` of Debian's
# googletest package), built when the machine has no GoogleTest. LIBURING_ROOT: a `dpkg -x` of
# liburing2 + liburing-dev (optional: without it the NVMe tier uses its thread pool).
# CXX/CUDAHOSTCXX: the machine's own; a compiler that links libstdc++ statically is handled by
# the configure (cmake/ZerortLibstdcxx.cmake), and if the configure refuses it, the check says so
# and configures again with /usr/bin/g++.
# GPU_CHECK_ONLY: an extended regex of step names to run (the machine, configure and build steps
# always run); the others are skipped and say so. All steps together take longer than one
# 10-minute call on the device machine, so split them, for example:
#   GPU_CHECK_ONLY='^(gtest|cpp_cuda|int8|nccl|engine_smoke|py_cuda|cuda_engine|offload_cpu|staged|streams)' bash scripts/gpu_check.sh
#   GPU_CHECK_ONLY='^(bench|offload)' bash scripts/gpu_check.sh
# GPU_CHECK_CMAKE_ARGS: more configure arguments. The whole log goes to $GPU_CHECK_LOG (default
# $BUILD/gpu_check.log) as it runs.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
BUILD=${BUILD:-${TMPDIR:-/tmp}/zerort-gpu-check}
CUDA_ARCHS=${CUDA_ARCHS:-90}
LOGS=${GPU_CHECK_LOGS:-$BUILD/logs}
mkdir -p "$LOGS"
LOG=${GPU_CHECK_LOG:-$BUILD/gpu_check.log}
mkdir -p "$(dirname "$LOG")"
exec > >(tee "$LOG") 2>&1
export PYTHONUNBUFFERED=1
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
results=()
t_start=$SECONDS

step() {  # step NAME COMMAND...: runs it, logs it, records status and seconds
  local name=$1
  shift
  if [[ -n ${GPU_CHECK_ONLY:-} && ! $name =~ ^(machine|configure|configure_usr_gxx|build)$ && ! $name =~ $GPU_CHECK_ONLY ]]; then
    skip "$name" "not in GPU_CHECK_ONLY"
    return 0
  fi
  echo
  echo "=================== $name"
  local t0=$SECONDS
  "$@" 2>&1 | tee "$LOGS/$name.log"
  local rc=${PIPESTATUS[0]}
  results+=("$name|$rc|$((SECONDS - t0))|")
  return 0
}
skip() {  # skip NAME REASON: recorded in the table, not a failure
  echo
  echo "=================== $1: skipped: $2"
  results+=("$1|skip|0|$2")
}
passed() {  # passed NAME: whether step NAME ran and passed
  local r
  for r in "${results[@]}"; do [[ $r == "$1|0|"* ]] && return 0; done
  return 1
}

# Which C++ compiler links libstdc++ how (the machine's preset may link it statically).
links_static() {  # links_static COMPILER: true if a shared object it builds has no libstdc++.so in NEEDED
  local d
  d=$(mktemp -d)
  printf '#include <sstream>\nstd::string f(int n) { std::ostringstream os; os << n; return os.str(); }\n' >"$d/p.cpp"
  "$1" -shared -fPIC "$d/p.cpp" -o "$d/p.so" >/dev/null 2>&1 && ! readelf -d "$d/p.so" | grep -q 'NEEDED.*libstdc++\.so'
  local rc=$?
  rm -rf "$d"
  return $rc
}
cxx=${CXX:-c++}
echo "gpu_check: CXX=${CXX:-<unset>} CUDAHOSTCXX=${CUDAHOSTCXX:-<unset>} CC=${CC:-<unset>}"
if links_static "$cxx"; then
  echo "gpu_check: $cxx links libstdc++ statically into shared objects; the configure links the shared" \
    "libstdc++.so instead (cmake/ZerortLibstdcxx.cmake), or refuses it, and then this check uses /usr/bin/g++"
fi

# GoogleTest: the machine's, else built from GTEST_SOURCE (a source tree or a dpkg -x of googletest),
# else the C++ CUDA kernel test is skipped.
gtest_args=(-DZERORT_BUILD_TESTS=ON)
have_gtest=0
for d in /usr/lib/x86_64-linux-gnu/cmake/GTest /usr/lib/cmake/GTest /usr/local/lib/cmake/GTest /usr/lib64/cmake/GTest; do
  [[ -f $d/GTestConfig.cmake ]] && have_gtest=1
done
if [[ $have_gtest == 0 ]]; then
  src=${GTEST_SOURCE:-}
  [[ -z $src && -d /usr/src/googletest ]] && src=/usr/src/googletest
  [[ -n $src && ! -f $src/CMakeLists.txt && -f $src/usr/src/googletest/CMakeLists.txt ]] && src=$src/usr/src/googletest
  if [[ -n $src && -f $src/CMakeLists.txt ]]; then
    if [[ -f $BUILD/gtest/lib/cmake/GTest/GTestConfig.cmake ]]; then
      echo "gpu_check: GoogleTest already built from $src in $BUILD/gtest"
    else
      step gtest bash -c "cmake -S '$src' -B '$BUILD/gtest-build' -DCMAKE_INSTALL_PREFIX='$BUILD/gtest' \
        -DCMAKE_POSITION_INDEPENDENT_CODE=ON -DBUILD_GMOCK=OFF >/dev/null && cmake --build '$BUILD/gtest-build' \
        -j $(nproc) >/dev/null && cmake --install '$BUILD/gtest-build' >/dev/null && echo built GoogleTest from $src"
    fi
    gtest_args+=(-DGTest_DIR="$BUILD/gtest/lib/cmake/GTest")
  else
    gtest_args=(-DZERORT_BUILD_TESTS=OFF)
    skip gtest "no GoogleTest on this machine and no GTEST_SOURCE (docs/GPU.md: dpkg -x googletest)"
  fi
fi
uring_args=()
if [[ -n ${LIBURING_ROOT:-} ]]; then
  uring_args=(-DCMAKE_PREFIX_PATH="$(realpath "$LIBURING_ROOT")/usr")
  echo "gpu_check: liburing from $LIBURING_ROOT"
fi

step machine bash -c "nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; nvcc --version | tail -1; \
  $PY -c 'import torch; print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda, torch.cuda.get_device_name())'"

configure() {  # configure DIR [env assignments...]
  local dir=$1
  shift
  env "$@" cmake -S . -B "$dir" -DPython3_EXECUTABLE="$(command -v "$PY")" -DCMAKE_CUDA_ARCHITECTURES="$CUDA_ARCHS" \
    -DZERORT_BUILD_EXAMPLES=OFF "${gtest_args[@]}" "${uring_args[@]}" ${GPU_CHECK_CMAKE_ARGS:-}
}
step configure configure "$BUILD/main"
if ! passed configure && grep -q "CXX=/usr/bin/g++" "$LOGS/configure.log" && [[ -x /usr/bin/g++ ]] &&
  ! links_static /usr/bin/g++; then
  echo "gpu_check: the configure refused $cxx (libstdc++ linked statically, above); configuring again with" \
    "CC=/usr/bin/gcc CXX=/usr/bin/g++ CUDAHOSTCXX=/usr/bin/g++ in $BUILD/usr-gxx"
  BUILD_DIR=$BUILD/usr-gxx
  step configure_usr_gxx configure "$BUILD_DIR" CC=/usr/bin/gcc CXX=/usr/bin/g++ CUDAHOSTCXX=/usr/bin/g++
  if passed configure_usr_gxx; then  # the refusal is the configure's answer, not a failure of the check
    for i in "${!results[@]}"; do
      IFS='|' read -r name _ secs _ <<<"${results[$i]}"
      [[ $name == configure ]] && results[i]="configure|refused|$secs|$cxx links libstdc++ statically; /usr/bin/g++ used"
    done
  fi
else
  BUILD_DIR=$BUILD/main
fi
targets=(_C)
[[ ${gtest_args[0]} == -DZERORT_BUILD_TESTS=ON ]] && targets+=(zerort_cuda_tests zerort_cuda_comm_tests)
# _C's link is checked after it is built: libstdc++.so in NEEDED, no copy of its own.
step build cmake --build "$BUILD_DIR" -j "$(nproc)" --target "${targets[@]}"
# Each run is bounded, so one stuck step cannot eat the others' time.
if [[ -x $BUILD_DIR/tests/zerort_cuda_tests ]]; then
  step cpp_cuda_kernels timeout 120 "$BUILD_DIR/tests/zerort_cuda_tests"
elif [[ ${gtest_args[0]} == -DZERORT_BUILD_TESTS=OFF ]]; then
  skip cpp_cuda_kernels "no GoogleTest (set GTEST_SOURCE)"
else
  step cpp_cuda_kernels false  # the build failed to produce it
fi
# Issue 47: the two-hop communicator's hops on CUDA buffers against the host hops, at W = 4 on
# one GPU (in-process ranks staged for CUDA), every inter-node wire.
if [[ -x $BUILD_DIR/tests/zerort_cuda_comm_tests ]]; then
  step cpp_cuda_two_hop timeout 120 "$BUILD_DIR/tests/zerort_cuda_comm_tests"
elif [[ ${gtest_args[0]} == -DZERORT_BUILD_TESTS=OFF ]]; then
  skip cpp_cuda_two_hop "no GoogleTest (set GTEST_SOURCE)"
else
  step cpp_cuda_two_hop false
fi
# The int8/fp8_e4m3 block kernels against the CPU codes, byte for byte; the NCCL split at W = 1.
step int8_fp8_kernels timeout 120 "$PY" -m pytest -q -rs tests/gpu/test_gpu_int8_wire.py
step nccl_split_w1 timeout 120 "$PY" -m pytest -q -rs tests/gpu/test_gpu_nccl_parts.py
step nccl_split_timeout timeout 60 "$PY" -m pytest -q -rs tests/gpu/test_gpu_nccl_split_timeout.py
step engine_smoke timeout 120 "$PY" -X faulthandler tests/gpu/gpu_engine_worker.py "$BUILD/smoke" mlp:1:bf16:1:3 \
  mlp:2:fp16:1:3 mlp:3:bf16:1:3
step py_cuda_kernels timeout 180 "$PY" -m pytest -q -rs tests/gpu/test_gpu_kernels.py
step cuda_engine_nccl timeout 400 "$PY" -m pytest -q -rs -s tests/gpu/test_gpu_engine.py -k "not host_memory"
step nccl_timeout timeout 60 "$PY" -m pytest -q -rs tests/gpu/test_nccl_timeout.py
if command -v mpirun >/dev/null; then
  step offload_cpu timeout 200 "$PY" -m pytest -q -rs tests/gpu/test_gpu_engine.py -k host_memory
else
  skip offload_cpu "no mpirun (the W = 2 staged runs need Open MPI)"
fi
# The multi-node features at W = 4 on this one GPU (2 x 2 fake nodes, mpi with staged CUDA buffers):
# two_hop, shard_size and hpZ against torch, the int8 wires, hpZ's bits (Note [staging once]).
if command -v mpirun >/dev/null; then
  step staged_grid timeout 300 "$PY" -m pytest -q -rs -s tests/gpu/test_staged_grid_gpu.py
else
  skip staged_grid "no mpirun (the W = 4 staged grid runs under Open MPI)"
fi
step bench_kernels timeout 120 "$PY" bench/gpu_kernels.py
# Issue 45, stream order: no synchronizing torch call and only the named host waits in a steady
# step (Note [allowed syncs in a step]), and a model on a side stream gives the default stream's
# bits, at stages 0-3, W = 1 over NCCL and staged W = 2 (mpirun, both ranks on this GPU).
if command -v mpirun >/dev/null; then
  step streams timeout 240 "$PY" -m pytest -q -rs -s tests/gpu/test_gpu_streams.py
else
  step streams timeout 120 "$PY" -m pytest -q -rs -s tests/gpu/test_gpu_streams.py -k "not staged"
fi
# The 355M GPT table (torch, zerort stages 0-3, FSDP2, staged W = 2; median and p90 of 16 steps),
# with a torch.profiler trace of one more step per row in $BUILD/profile (where the time goes).
step bench_gpt350m timeout 330 "$PY" bench/gpu_gpt.py --steps 16 --warmup 2 --staged-steps 4 \
  --profile "$BUILD/profile" --profile-steps 1
# Issue 46, offload at size (bench/gpu_offload.py, a Llama-shaped model built on the meta device). Capacity:
# the estimator's placement table for this machine (13B, stage 3), then 13B trained with offload.placement
# auto (on paper nvme dev-grad 68% ram: ~50 GB of file, read and written each step) for 3 steps whose losses must fall (it fails, with the numbers, where no placement fits). Speed: one
# table in one run at GPU_CHECK_OFFLOAD_PARAMS (default 3e9, sized to keep the check within 10 minutes
# without DeepSpeed's rows; the issue's 6-7B comparison: GPU_CHECK_OFFLOAD_PARAMS=6.5e9): zerort GPU-resident,
# offload cpu (the FP32 gradient in RAM, and on the GPU: Note [gradient on the device]) and auto, and DeepSpeed ZeRO-2 and ZeRO-3 with CPU offload when its wheels travel in DS_WHEELS
# (default deps/ds-wheels, made by scripts/ds_wheels.sh: deepspeed
# 0.19.8, hjson, pydantic and its dependencies; nothing downloads here), installed into a venv over this
# Python's torch. DeepSpeed builds its CPU Adam on first use with /usr/bin/gcc and g++ (the preset compilers
# link libstdc++ statically: docs GPU_MACHINE.md).
OFFLOAD_NVME=${GPU_CHECK_NVME:-$BUILD/nvme}
mkdir -p "$OFFLOAD_NVME"
# auto on a CUDA model: the device budget measured, auto spilling to cpu, cpu+params and nvme under capped
# budgets, each bit for bit the concrete placement it resolves to
step offload_auto_gpu timeout 180 "$PY" -m pytest -q -rs -s tests/gpu/test_gpu_offload_auto.py
# Every tier on a CUDA model, overlapped step: offload_optimizer cpu and nvme (stage 3 with offload_param
# nvme) equal the GPU-resident run bit for bit at stages 1-3 (bf16 and an fp16 overflow step), and the
# next forward's first unit waits while later units still update (Note [overlapped step]); small model.
step offload_overlap_gpu timeout 180 "$PY" -m pytest -q -rs -s tests/gpu/test_offload_overlap_gpu.py
step offload_capacity bash -c "PYTHONPATH=python '$PY' -m zerort.accounting.placement_auto --llama \
  40,5120,13824,32000 --stage 3 --here --nvme-path '$OFFLOAD_NVME'; timeout 420 '$PY' bench/gpu_offload.py \
  --params 13e9 --stage 3 --rows auto --steps 3 --batch 1 --nvme-path '$OFFLOAD_NVME' --timeout 400 \
  --expect-decreasing"
DS_WHEELS=${DS_WHEELS:-deps/ds-wheels}
offload_rows=gpu,cpu,cpu-dg,auto
ds_args=()
if compgen -G "$DS_WHEELS/deepspeed-0.19.8*" >/dev/null; then
  step ds_install bash -c "'$PY' -m venv --system-site-packages '$BUILD/ds-venv' && '$BUILD/ds-venv/bin/python' \
    -m pip install -q --no-index --find-links '$DS_WHEELS' deepspeed==0.19.8 && \
    '$BUILD/ds-venv/bin/python' -c 'import deepspeed; print(\"deepspeed\", deepspeed.__version__)'"
  if passed ds_install; then
    offload_rows=gpu,cpu,cpu-dg,auto,ds2,ds3
    ds_args=(--ds-python "$BUILD/ds-venv/bin/python")
  fi
else
  skip ds_rows "no DeepSpeed wheels in $DS_WHEELS (bash scripts/ds_wheels.sh makes them, on a machine with network)"
fi
step offload_speed env CC=/usr/bin/gcc CXX=/usr/bin/g++ CUDA_HOME=${CUDA_HOME:-/usr/local/cuda} \
  TORCH_EXTENSIONS_DIR="$BUILD/torch-extensions" timeout 540 "$PY" bench/gpu_offload.py \
  --params "${GPU_CHECK_OFFLOAD_PARAMS:-3e9}" --stage 2 --rows "$offload_rows" --steps 4 --batch 1 \
  --nvme-path "$OFFLOAD_NVME" --timeout 120 "${ds_args[@]}"

echo
echo "=================== gpu_check summary ($(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)," \
  "commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown), $(date -u +%Y-%m-%d), $((SECONDS - t_start)) s)"
for f in bench_kernels bench_gpt350m offload_capacity offload_speed; do
  grep -h -E '^(\||GPU:)' "$LOGS/$f.log" 2>/dev/null
  echo
done
grep -h "gpu parity" "$LOGS/cuda_engine_nccl.log" 2>/dev/null | sed 's/^.*\[gpu parity/[gpu parity/' | sort -u
grep -h "gpu staged grid" "$LOGS/staged_grid.log" 2>/dev/null | sed 's/^.*\[gpu staged grid/[gpu staged grid/' | sort -u
echo
printf '| %-18s | %-9s | %7s |\n' step result seconds
printf '|%s|%s|%s|\n' "--------------------" "-----------" "---------"
failed=0
for r in "${results[@]}"; do
  IFS='|' read -r name rc secs why <<<"$r"
  if [[ $rc == skip || $rc == refused ]]; then
    res=${rc/skip/skipped}
  elif [[ $rc -eq 0 ]]; then
    res=pass
  else
    res="FAIL($rc)"
    failed=1
  fi
  printf '| %-18s | %-9s | %7s |%s\n' "$name" "$res" "$secs" "${why:+ $why}"
done
echo "log: $LOG"
exit $failed
