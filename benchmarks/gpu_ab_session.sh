#!/usr/bin/env bash
# One GPU session that compares this tree with another commit's on the same card, in one run:
# both built with CUDA (side by side, in place), this tree's GPU tests of the data path, then
# benchmarks.bench_layer on each tree in turns (base, head, base, head: the card's clock drifts
# under sustained load, so each tree gets an early and a late slot), and the tables last.
#
# Prepare on a machine with git, from the repo root (.base/ must be ignored, e.g. in
# .git/info/exclude, and carried to the GPU machine):
#   rm -rf .base && mkdir .base && git archive <base commit> | tar -x -C .base
# then run there: `bash benchmarks/gpu_ab_session.sh`.
# Knobs: BASE_DIR (default .base), SKIP_TESTS, AB_ROUNDS (turns of each tree, default 2),
# LAYER_ARGS (default: --rounds 8 --rows-by-index both --skip megatron,compiled,plain: ours
# eager, rows made and by index), SESSION_S.
set -uo pipefail
source benchmarks/session_lib.sh
BASE_DIR=${BASE_DIR:-.base}
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader

build() {  # build DIR: the extension in place, with CUDA
  (cd "$1" && env MAX_JOBS=8 MOE_CORE_CUDA=1 python3 setup.py -q build_ext --inplace)
}
export -f build  # run_step runs its command under timeout, which needs a program: bash -c
run_step build_base 300 bash -c 'build "$1"' _ "$BASE_DIR" &
BASE_PID=$!
run_step build_head 300 bash -c 'build "$1"' _ .
wait "$BASE_PID" || SUMMARY+=("build_base: FAILED")

if [ -z "${SKIP_TESTS:-}" ]; then
  XDIST_ARG=()
  python3 -c "import xdist" 2>/dev/null && XDIST_ARG=(-n "${NPROC:-8}")
  run_step test_data_path 200 env OMP_NUM_THREADS=1 python3 -m pytest tests/layout \
      tests/layer tests/router tests/hardening/test_cuda_graph.py \
      tests/experts/test_expert_mlp.py tests/experts/test_grouped_gemm_glu_probs.py \
      -k "cuda or gpu or graph" -q -p no:cacheprovider -rfE --tb=short "${XDIST_ARG[@]}"
  pytest_report "$OUT/test_data_path.log"
fi

# bench_layer moved from a script to a module of the benchmarks package: run whichever the tree has
bench() {  # bench DIR LOG
  local cmd=(python3 -m benchmarks.bench_layer)
  [ -f "$1/benchmarks/__init__.py" ] || cmd=(python3 benchmarks/bench_layer.py)
  (cd "$1" && PYTHONPATH=$PWD "${cmd[@]}" ${LAYER_ARGS:---rounds 8 --rows-by-index both --skip megatron,compiled,plain})
}
export -f bench
for i in $(seq 1 "${AB_ROUNDS:-2}"); do
  run_step "bench_base_$i" 150 bash -c 'bench "$1"' _ "$BASE_DIR"
  run_step "bench_head_$i" 150 bash -c 'bench "$1"' _ .
done

echo
echo "== session summary ($(( $(date +%s) - T_START )) s)"
for line in "${SUMMARY[@]}"; do echo "$line"; done
for f in "$OUT"/bench_*.log; do
  [ -f "$f" ] || continue
  echo "== $(basename "$f" .log)"
  sed -n '/^| shape/,/^$/p' "$f" | cut -c1-160
done
