# zerort: `make demo` runs the main job, `make test` the newcomer's check, `make test-all` every
# test. Each installs what is missing first (Debian packages, the .venv with torch==2.13.0) and
# only redoes what changed.
SHELL := /bin/bash
VENV  ?= .venv
PY    := $(VENV)/bin/python
BUILD ?= build
JOBS  ?= $(shell nproc)
STAMPS := .stamps

.PHONY: all deps venv configure build test test-all test-asan test-nouring lint demo demo-cpp bench bench-e2e bench-ds clean

all: build

$(STAMPS)/deps: scripts/install_deps.sh
	bash scripts/install_deps.sh
	@mkdir -p $(STAMPS) && touch $@

$(VENV)/.installed: requirements.txt requirements-cuda.txt
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q -r requirements.txt
	# nvcc on the machine means the CUDA target and the NCCL communicator are built: NCCL comes from its wheel.
	if command -v nvcc >/dev/null || [ -x /usr/local/cuda/bin/nvcc ]; then $(PY) -m pip install -q -r requirements-cuda.txt; fi
	$(PY) -c "import site; open(site.getsitepackages()[0] + '/zerort.pth', 'w').write('$(abspath python)\n')"
	touch $@

deps: $(STAMPS)/deps
venv: $(VENV)/.installed

$(BUILD)/CMakeCache.txt: $(STAMPS)/deps $(VENV)/.installed
	cmake -S . -B $(BUILD) -DPython3_EXECUTABLE=$(abspath $(PY))

configure: $(BUILD)/CMakeCache.txt

build: $(BUILD)/CMakeCache.txt
	cmake --build $(BUILD) -j $(JOBS)

# make test: the newcomer's check, at least one case of every part (tests/quick.txt says which and
# why); make test-all: every test, as .ci/run runs it.
test: build
	BUILD=$(BUILD) PY=$(PY) bash scripts/run_tests.sh quick

test-all: build
	BUILD=$(BUILD) PY=$(PY) bash scripts/run_tests.sh all

# The torch-free C++ tests under AddressSanitizer + UBSan, in their own build directory.
test-asan: $(STAMPS)/deps $(VENV)/.installed
	ASAN_BUILD=build-asan PY=$(PY) JOBS=$(JOBS) bash scripts/run_asan_tests.sh

# The NVMe tier without liburing: the I/O and NVMe C++ tests in a build without it
# (build-nouring/), then the NVMe pytest tests with the thread backend forced.
test-nouring: build
	NOURING_BUILD=build-nouring PY=$(PY) JOBS=$(JOBS) bash scripts/run_nouring_tests.sh

# ruff over the Python (pyproject.toml's [tool.ruff]) and clang-format over the C++ (.clang-format),
# both checking only: nothing is rewritten.
CXX_SOURCES = $(shell find core io comm partition optim runtime python tests examples bench \
                -name '*.cpp' -o -name '*.h' -o -name '*.cu' -o -name '*.cuh' | sort)
lint: $(STAMPS)/deps $(VENV)/.installed
	$(VENV)/bin/ruff check python tests bench examples scripts
	clang-format --dry-run -Werror $(CXX_SOURCES)

# The main job: the byte-level GPT on 2 ranks, ZeRO stage 3, bf16.
demo: build
	OMP_NUM_THREADS=1 bash scripts/mpirun.sh -np 2 $(PY) examples/train_gpt.py --stage 3 --precision bf16 --steps 40

# The C++ API: a 2-rank reduce-scatter, then an MLP trained through the C++ Engine.
demo-cpp: build
	bash scripts/mpirun.sh -np 2 $(BUILD)/examples/reduce_scatter_demo
	OMP_NUM_THREADS=1 bash scripts/mpirun.sh -np 2 $(BUILD)/examples/train_mlp 30

bench: build
	bash bench/run_benchmarks.sh

# zerort stages 1-3 vs PyTorch DDP, FSDP2 and DeepSpeed ZeRO-2/3: same GPT, data and steps,
# W=2 (about 15 minutes).
bench-e2e: build bench-ds
	$(PY) bench/e2e.py

# DeepSpeed for the benchmarks only, in a venv of its own against the pinned CPU torch: no
# compiled ops (DS_BUILD_OPS=0), no build isolation (pip would fetch another torch).
DS_VENV := .venv-ds
bench-ds: $(DS_VENV)/.installed
$(DS_VENV)/.installed: bench/requirements-ds.txt
	test -x $(DS_VENV)/bin/python || python3 -m venv $(DS_VENV)
	$(DS_VENV)/bin/python -m pip install -q torch==2.13.0 setuptools wheel
	DS_BUILD_OPS=0 $(DS_VENV)/bin/python -m pip install -q --no-build-isolation -r bench/requirements-ds.txt
	touch $@

clean:
	rm -rf $(BUILD) $(STAMPS)
