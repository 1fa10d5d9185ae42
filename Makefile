# moe-core: `make test` and `make demo` set everything up on a fresh machine (a virtual
# environment with torch, megatron-core and the test tools; the extension built in place).
#
#   make test    every test tier: the C tests (no torch), pytest (CPU; GPU tests where a GPU is;
#                the hypothesis fuzz tier tests/fuzz/ included) and the sanitizer tier
#   make test-sanitize  the C core, its C tests and the CPU extension built with
#                -fsanitize=address,undefined (into build/sanitize/, beside the normal build), then
#                the C tests and the op-level pytest files against that extension
#   make test-fuzz  the property-based tier alone (MOE_CORE_FUZZ_PROFILE=thorough for many more)
#   make demo    the main job (examples/)
#   make ctest   the C core alone: static library + C test program, no Python or torch
#   make build   (re)build the extension into the virtual environment
#   make bench   the benchmarks (on a GPU machine: benchmarks/gpu_session.sh does it all)
#
# Variables: PYTHON (the interpreter that makes the venv), VENV, TORCH_VERSION, MEGATRON_VERSION,
# TORCHTITAN_VERSION, MOE_CORE_CUDA.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# A CUDA 13.0 build of torch, matching the toolkit's nvcc, so the CUDA kernels compile in CI.
# The code itself needs only torch >= 2.6.
TORCH_VERSION ?= 2.14.1
MEGATRON_VERSION ?= 0.19.2
TORCHTITAN_VERSION ?= 0.3.0
CC ?= cc
CFLAGS_CORE := -std=c11 -O2 -Wall -Wextra -Werror -fopenmp -Icsrc
BUILD := build

C_SOURCES := $(wildcard csrc/*.c)
C_OBJECTS := $(patsubst csrc/%.c,$(BUILD)/core/%.o,$(C_SOURCES))
C_TESTS := $(wildcard tests/c/test_*.c)

# The sanitizer tier: ASan + UBSan, any report fatal (-fno-sanitize-recover=all), CPU kernels only.
SAN := $(BUILD)/sanitize
SAN_FLAGS := -fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer
CFLAGS_SAN := -std=c11 -O1 -g $(SAN_FLAGS) -Wall -Wextra -Werror -fopenmp -Icsrc
SAN_OBJECTS := $(patsubst csrc/%.c,$(SAN)/core/%.o,$(C_SOURCES))
# The Python process is not instrumented: the sanitizer runtimes are preloaded (libasan first).
# Leak checking is off there (CPython and torch keep allocations alive by design); the C tests
# keep it on. pytest captures sys.stdout/err only (--capture=sys): the report the runtime writes to
# fd 2 right before it aborts the process must not be lost in pytest's capture file. The op-level
# pytest files exercise every C entry point of the CPU build; megatron-marked parity tests repeat
# the same calls against the oracle and are left out. The overflow and contract cases run here
# too: each bad input must be refused before the core touches a pointer.
SAN_PRELOAD = $(shell $(CC) -print-file-name=libasan.so) $(shell $(CC) -print-file-name=libubsan.so)
SAN_ENV = LD_PRELOAD="$(SAN_PRELOAD)" ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 \
	UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 PYTHONPATH=$(CURDIR)/$(SAN)/lib
SAN_PYTESTS := tests/layout/test_ops.py tests/layout/test_permute_layout.py tests/router/test_ops.py \
	tests/router/test_errors.py tests/router/test_fused_losses.py tests/balancing/test_losses.py \
	tests/balancing/test_errors.py tests/balancing/test_expert_bias.py tests/balancing/test_sinkhorn.py \
	tests/balancing/test_metrics.py tests/experts/test_glu_probs.py \
	tests/experts/test_grouped_gemm.py tests/experts/test_grouped_gemm_gather.py \
	tests/experts/test_grouped_gemm_glu_probs.py \
	tests/experts/test_expert_mlp.py tests/hardening/test_overflow_and_contracts.py tests/fuzz

.PHONY: all venv build test ctest pytest demo bench clean test-sanitize ctest-sanitize \
	pytest-sanitize test-fuzz

all: build

$(VENV)/.stamp: requirements-dev.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade "setuptools>=77" wheel
	$(PY) -m pip install "torch==$(TORCH_VERSION)"
	$(PY) -m pip install -r requirements-dev.txt
	# megatron-core's wheel metadata asks for Python >= 3.12, but it publishes cp311 wheels that
	# import and run here (its own code has no 3.12-only syntax in the parts we use).
	$(PY) -m pip install --ignore-requires-python "megatron-core==$(MEGATRON_VERSION)"
	# torchtitan (moe_core.torchtitan's tests): its metadata also asks for its trainer's
	# dependencies (datasets, torchdata, wandb, tensorboard, ...), which the model code does not
	# import and which could move torch; the modules it imports are pinned in requirements-dev.txt.
	$(PY) -m pip install --no-deps "torchtitan==$(TORCHTITAN_VERSION)"
	touch $@

venv: $(VENV)/.stamp

$(BUILD)/.ext_stamp: $(VENV)/.stamp setup.py $(wildcard csrc/*.c csrc/*.h csrc/torch/* csrc/cuda/*.cu csrc/cuda/*.cuh)
	@mkdir -p $(BUILD)
	$(PY) -m pip install --no-build-isolation -e . -v > $(BUILD)/pip-build.log 2>&1 || \
	    { tail -n 60 $(BUILD)/pip-build.log; exit 1; }
	@grep -q "cuda/" $(BUILD)/pip-build.log && echo "built moe_core._C with CUDA kernels" || \
	    echo "built moe_core._C (CPU only)"
	@touch $@

build: $(BUILD)/.ext_stamp

$(BUILD)/core/%.o: csrc/%.c csrc/moe_core.h csrc/common.h $(wildcard csrc/*.h)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS_CORE) -c $< -o $@

$(BUILD)/libmoe_core.a: $(C_OBJECTS)
	ar rcs $@ $^

$(BUILD)/test_core: $(C_TESTS) $(BUILD)/libmoe_core.a tests/c/ctest.h
	$(CC) $(CFLAGS_CORE) -Itests/c $(C_TESTS) $(BUILD)/libmoe_core.a -lm -o $@

ctest: $(BUILD)/test_core
	@# every public header compiles on its own, as plain C11
	for h in csrc/moe_*.h csrc/tuning.h; do \
	    $(CC) -std=c11 -Wall -Wextra -Werror -fsyntax-only -x c $$h || exit 1; done
	$(BUILD)/test_core

pytest: build
	$(PY) -m pytest tests -q -ra

test: ctest pytest test-sanitize

test-fuzz: build
	$(PY) -m pytest tests/fuzz -q -ra

# --- sanitizer tier --------------------------------------------------------------------------

$(SAN)/core/%.o: csrc/%.c csrc/moe_core.h csrc/common.h $(wildcard csrc/*.h)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS_SAN) -c $< -o $@

$(SAN)/libmoe_core.a: $(SAN_OBJECTS)
	ar rcs $@ $^

$(SAN)/test_core: $(C_TESTS) $(SAN)/libmoe_core.a tests/c/ctest.h
	$(CC) $(CFLAGS_SAN) -Itests/c $(C_TESTS) $(SAN)/libmoe_core.a -lm -o $@

ctest-sanitize: $(SAN)/test_core
	ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1 $(SAN)/test_core

# moe_core._C with the sanitizers, CPU only, built outside the tree (the in-place .so stays as
# it is); build/sanitize/lib/moe_core/ links the package's Python files beside it.
$(SAN)/.ext_stamp: $(VENV)/.stamp setup.py $(wildcard csrc/*.c csrc/*.h csrc/torch/*)
	@mkdir -p $(SAN)/lib/moe_core
	MOE_CORE_CUDA=0 MOE_CORE_SANITIZE=1 $(PY) setup.py -q build_ext -b $(SAN)/lib \
	    -t $(SAN)/tmp > $(SAN)/build.log 2>&1 || { tail -n 60 $(SAN)/build.log; exit 1; }
	@touch $@

pytest-sanitize: $(SAN)/.ext_stamp
	@cd $(SAN)/lib/moe_core && for f in ../../../../moe_core/*.py ../../../../moe_core/ops; do \
	    ln -sfn $$f .; done
	@# -P: the checkout's own moe_core/ (the uninstrumented .so) must not come first on sys.path
	$(SAN_ENV) $(PY) -P -c "import moe_core._C as c, sys; \
	    sys.exit(0 if '/$(SAN)/lib/' in c.__file__ else 'wrong moe_core._C: ' + c.__file__)"
	@# -o pythonpath=tests: pyproject's pythonpath would put the repository root, and with it the
	@# checkout's moe_core/, ahead of the sanitizer build; these tests import only helpers/
	$(SAN_ENV) $(PY) -P -m pytest $(SAN_PYTESTS) -q -ra -m "not megatron" -p no:cacheprovider \
	    --capture=sys -o pythonpath=tests

test-sanitize: ctest-sanitize pytest-sanitize

demo: build
	$(PY) examples/train_tiny_moe.py

bench: build
	$(PY) -m benchmarks.bench_router
	$(PY) -m benchmarks.bench_grouped_gemm_cpu
	@if $(PY) -c "import sys, torch; sys.exit(not torch.cuda.is_available())"; then \
	    $(PY) -m benchmarks.bench_ops && $(PY) -m benchmarks.bench_grouped_gemm; \
	else echo "no GPU: bench_ops.py and bench_grouped_gemm.py skipped"; fi

clean:
	rm -rf $(BUILD) moe_core/*.so *.egg-info
