#!/usr/bin/env bash
# One GPU session for the single-GPU layer: build with CUDA, the GPU tests of the expert path and
# the router (expert_mlp, glu_probs, fc1 + glu_probs, the gating linear, the layer against
# Megatron-Core, CUDA graphs), then benchmarks/bench_layer.py (the whole layer fwd + bwd against
# Megatron's MoELayer and a compiled plain-PyTorch layer), benchmarks/bench_hf.py (a Hugging Face
# decoder layer: HF's grouped_mm against both moe-core routes) and benchmarks/profile_layer.py (the
# kernel table and what is saved for backward); the summary and the tables last.
# Run on any CUDA machine from the repo root: `bash benchmarks/gpu_layer_session.sh`; megatron-core
# from the environment or from a wheel copied into .whl/ (device_env.sh installs it).
# Knobs: SKIP_BUILD, SKIP_TESTS, SKIP_BENCH, SKIP_BY_INDEX (bench_layer without the by-index rows),
# SESSION_S, LAYER_ARGS (default: --rounds 10), HF_ARGS, PROFILE_ARGS (default: --top 12).
set -uo pipefail
source benchmarks/session_lib.sh
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader

if [ -z "${SKIP_BUILD:-}" ]; then
  if ! run_step build 240 env MAX_JOBS=16 MOE_CORE_CUDA=1 \
      python3 -m pip install -q --no-build-isolation -e .; then
    tail -n 40 "$OUT/build.log"
  fi
fi

if [ -z "${SKIP_TESTS:-}" ]; then
  TIMEOUT_ARG=() XDIST_ARG=()
  python3 -c "import pytest_timeout" 2>/dev/null && TIMEOUT_ARG=(--timeout 200)
  python3 -c "import xdist" 2>/dev/null && XDIST_ARG=(-n "${NPROC:-8}")
  run_step test_expert_path 240 env OMP_NUM_THREADS=1 python3 -m pytest \
      tests/experts/test_expert_mlp.py tests/experts/test_glu_probs.py \
      tests/experts/test_grouped_gemm_glu_probs.py tests/experts/test_grouped_gemm_gather.py \
      tests/layer/test_megatron_parity.py \
      tests/hardening/test_cuda_graph.py \
      "tests/balancing/test_cuda_vs_cpu.py::test_gating_linear_cpu_cuda" \
      "tests/balancing/test_cuda_vs_cpu.py::test_gating_linear_bwd_bf16_on_tensor_cores" \
      -q -p no:cacheprovider -rfE --tb=short "${XDIST_ARG[@]}" "${TIMEOUT_ARG[@]}"
  pytest_report "$OUT/test_expert_path.log"
fi

if [ -z "${SKIP_BENCH:-}" ]; then
  # with the rows read by index (opt-in on CUDA) timed beside the default, same rounds
  BY_INDEX=both
  [ -n "${SKIP_BY_INDEX:-}" ] && BY_INDEX=auto
  run_step bench_layer 240 python3 -m benchmarks.bench_layer ${LAYER_ARGS:---rounds 10} \
      --rows-by-index $BY_INDEX
  run_step bench_hf 120 python3 -m benchmarks.bench_hf ${HF_ARGS:-}
  run_step profile_layer 120 python3 -m benchmarks.profile_layer ${PROFILE_ARGS:---top 12}
fi

echo
echo "== session summary ($(( $(date +%s) - T_START )) s)"
for line in "${SUMMARY[@]}"; do echo "$line"; done
[ -f "$OUT/profile_layer.log" ] && grep -E "^==|saved for backward|memory:|GPU time|glu|gating|gg_sm90" "$OUT/profile_layer.log" | cut -c1-150
[ -f "$OUT/bench_hf.log" ] && sed -n '/^| shape/,$p' "$OUT/bench_hf.log"
[ -f "$OUT/bench_layer.log" ] && sed -n '/^| shape/,$p' "$OUT/bench_layer.log"
