# moe-core: `make test` and `make demo` set everything up on a fresh machine (a virtual
# environment with torch, megatron-core and the test tools; the extension built in place).
#
#   make test    every test tier: the C tests (no torch) and pytest (CPU; GPU tests where a GPU is)
#   make demo    the main job (examples/)
#   make ctest   the C core alone: static library + C test program, no Python or torch
#   make build   (re)build the extension into the virtual environment
#   make bench   the benchmarks (on a GPU machine: benchmarks/gpu_session.sh does it all)
#
# Variables: PYTHON (the interpreter that makes the venv), VENV, TORCH_VERSION, MOE_CORE_CUDA.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# A CUDA 13.0 build of torch, matching the toolkit's nvcc, so the CUDA kernels compile in CI.
# The code itself needs only torch >= 2.6.
TORCH_VERSION ?= 2.14.1
MEGATRON_VERSION ?= 0.19.2
CC ?= cc
CFLAGS_CORE := -std=c11 -O2 -Wall -Wextra -Werror -fopenmp -Icsrc
BUILD := build

C_SOURCES := $(wildcard csrc/*.c)
C_OBJECTS := $(patsubst csrc/%.c,$(BUILD)/core/%.o,$(C_SOURCES))
C_TESTS := $(wildcard tests/c/test_*.c)

.PHONY: all venv build test ctest pytest demo bench clean

all: build

$(VENV)/.stamp: requirements-dev.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade "setuptools>=77" wheel
	$(PY) -m pip install "torch==$(TORCH_VERSION)"
	$(PY) -m pip install -r requirements-dev.txt
	# megatron-core's wheel metadata asks for Python >= 3.12, but it publishes cp311 wheels that
	# import and run here (its own code has no 3.12-only syntax in the parts we use).
	$(PY) -m pip install --ignore-requires-python "megatron-core==$(MEGATRON_VERSION)"
	touch $@

venv: $(VENV)/.stamp

$(BUILD)/.ext_stamp: $(VENV)/.stamp setup.py $(wildcard csrc/*.c csrc/*.h csrc/*.cpp csrc/cuda/*.cu csrc/cuda/*.cuh)
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
	$(CC) -std=c11 -Wall -Wextra -Werror -fsyntax-only -x c csrc/moe_core.h
	$(BUILD)/test_core

pytest: build
	$(PY) -m pytest tests -q -ra

test: ctest pytest

demo: build
	$(PY) examples/train_tiny_moe.py

bench: build
	$(PY) benchmarks/bench_router.py
	PYTHONPATH=. $(PY) benchmarks/bench_grouped_gemm_cpu.py
	@if $(PY) -c "import sys, torch; sys.exit(not torch.cuda.is_available())"; then \
	    $(PY) benchmarks/bench_ops.py && $(PY) benchmarks/bench_grouped_gemm.py; \
	else echo "no GPU: bench_ops.py and bench_grouped_gemm.py skipped"; fi

clean:
	rm -rf $(BUILD) moe_core/*.so *.egg-info
