#!/usr/bin/env bash
# One GPU session for expert parallelism on one GPU: build with CUDA, the EP GPU tests
# (tests/ep/test_nccl_single_gpu.py: NCCL world of one), the layer GPU tests
# (layer/test_megatron_parity.py, hardening/test_cuda_graph.py), then benchmarks/bench_ep.py at a
# world of one on qwen3_30b_a3b and dsv3_like (ours vs Megatron-Core's alltoall MoELayer, our EP
# path vs the plain layer, dispatch + combine vs a bare all_to_all_single); a summary and the
# benchmark tables last.
# Run on any CUDA machine from the repo root: `bash benchmarks/gpu_ep_session.sh`; megatron-core
# from the environment or from a wheel copied into .whl/ (device_env.sh installs it).
#
# Each step runs under its own time cap, cut to what is left of the session's budget
# (SESSION_S, default 560 s: set it below any limit your machine puts on one command); a step
# that fails or runs out is reported and the later steps still run. Logs: $OUT/<step>.log
# (6 files at most). The steps' durations on one H200 are in docs/perf-history.md. dsv3_like with all 256 experts
# holds two copies of its weights (Megatron's and ours, shared by our variants) plus one set of
# gradients; if the run with Megatron fails, it is retried without Megatron when time is left.
# Knobs: SKIP_BUILD, SKIP_TESTS, SKIP_BENCH, SESSION_S, NPROC (pytest workers for the layer
# tests), BENCH_ARGS (added to every bench_ep.py call), DSV3_ARGS (default: --rounds 10).
set -uo pipefail
source benchmarks/session_lib.sh
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda,
                               torch.cuda.get_device_name())"
MCORE_ARGS=""
if ! python3 -c "import megatron.core" > /dev/null 2>&1; then
  echo "megatron-core does not import (no wheel in .whl/?): benchmarks run without it"
  MCORE_ARGS="--skip-megatron"
fi

# ---- build --------------------------------------------------------------------------------
if [ -z "${SKIP_BUILD:-}" ]; then
  if ! run_step build 240 env MAX_JOBS=16 MOE_CORE_CUDA=1 \
      python3 -m pip install -q --no-build-isolation -e .; then
    tail -n 40 "$OUT/build.log"
  fi
fi
python3 -c "import moe_core; print('moe_core CUDA kernels:', moe_core.has_cuda(),
                                  '; layer on CUDA:', moe_core.layer_runs_on_cuda())" \
  || echo "moe_core does not import"

# ---- tests --------------------------------------------------------------------------------
if [ -z "${SKIP_TESTS:-}" ]; then
  # pytest-timeout names a hanging test; xdist spreads the CPU-side layer parity tests
  TIMEOUT_ARG=() XDIST_ARG=()
  python3 -c "import pytest_timeout" 2>/dev/null && TIMEOUT_ARG=(--timeout 200)
  python3 -c "import xdist" 2>/dev/null && XDIST_ARG=(-n "${NPROC:-16}")
  # one process: the module's NCCL world of one on the one GPU
  run_step test_ep_cuda 240 python3 -m pytest tests/ep/test_nccl_single_gpu.py \
      -q -p no:cacheprovider -rfE --tb=short --durations=5 "${TIMEOUT_ARG[@]}"
  pytest_report "$OUT/test_ep_cuda.log"
  run_step test_layer 180 env OMP_NUM_THREADS=1 python3 -m pytest \
      tests/layer/test_megatron_parity.py tests/hardening/test_cuda_graph.py \
      -q -p no:cacheprovider -rfE --tb=line --durations=5 \
      "${XDIST_ARG[@]}" "${TIMEOUT_ARG[@]}"
  pytest_report "$OUT/test_layer.log"
fi

# ---- benchmarks (world of one) ------------------------------------------------------------
BENCH_LOGS=()
if [ -z "${SKIP_BENCH:-}" ]; then
  export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
  run_step bench_qwen3 200 python3 -m benchmarks.bench_ep --shape qwen3_30b_a3b \
      $MCORE_ARGS ${BENCH_ARGS:-}
  BENCH_LOGS+=("$OUT/bench_qwen3.log")
  tail -n 30 "$OUT/bench_qwen3.log"
  BENCH_LOGS+=("$OUT/bench_dsv3.log")
  if ! run_step bench_dsv3 260 python3 -m benchmarks.bench_ep --shape dsv3_like \
      ${DSV3_ARGS:---rounds 10} $MCORE_ARGS ${BENCH_ARGS:-}; then
    tail -n 12 "$OUT/bench_dsv3.log"
    if [ -z "$MCORE_ARGS" ]; then
      run_step bench_dsv3_no_megatron 200 python3 -m benchmarks.bench_ep --shape dsv3_like \
          ${DSV3_ARGS:---rounds 10} --skip-megatron ${BENCH_ARGS:-}
      BENCH_LOGS+=("$OUT/bench_dsv3_no_megatron.log")
    fi
  fi
fi

# ---- summary, then the tables -----------------------------------------------------------------
echo
echo "== session summary ($(( $(date +%s) - T_START )) s)"
for line in "${SUMMARY[@]}"; do echo "$line"; done
for log in "${BENCH_LOGS[@]}"; do
  [ -f "$log" ] || continue
  echo
  echo "-- $(basename "$log" .log): checks and dispatch + combine"
  grep -E "^(dropless|drop_pad):|^  (ours|megatron) " "$log" | cut -c1-200
  sed -n '/^MoE layer,/,$p' "$log"
done
