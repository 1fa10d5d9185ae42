#!/usr/bin/env bash
# One GPU session: build with CUDA, run the C tests, the GPU test suite (CUDA parity, CPU-vs-CUDA
# equality), compute-sanitizer on the CUDA kernels, and the benchmarks; the table comes last.
# Run on any CUDA machine from the repo root: `bash benchmarks/gpu_session.sh`. megatron-core
# comes from the environment, or from a wheel copied into .whl/ (device_env.sh installs it).
# Logs go to $OUT (default /tmp/out).
# Durations on one H200: build 62-70 s; each default test group (-n 16) 20-40 s,
# bench_ops 60 s (--graph 45 s),
# bench_grouped_gemm 60 s (--fused only 25 s); compute-sanitizer on the default selection (239
# tests) memcheck 20 s, racecheck 76 s. The whole suite + bench_ops --graph + profiles: ~275 s.
# Knobs: TESTS='g1|g2' (pytest groups), TCAP / PT_TIMEOUT (group / per-test caps, s), NFAIL,
# SKIP_BUILD, SKIP_SANITIZER, SAN_TOOLS / SAN_TESTS / SAN_K / SCAP, PROFILE, BENCHES, BENCH_ARGS.
set -uo pipefail
# $OUT, unbuffered Python, NCCL without NVLink multicast, megatron-core from .whl/ if carried
source benchmarks/session_lib.sh
# 16 pytest workers on 16 cores: one intra-op thread each, or the CPU references oversubscribe
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"
t0=$(date +%s)
if [ -z "${SKIP_BUILD:-}" ]; then
  MAX_JOBS=16 MOE_CORE_CUDA=1 python3 -m pip install -q --no-build-isolation -e . > "$OUT/build.log" 2>&1 \
      || { tail -n 40 "$OUT/build.log"; exit 1; }
  echo "build: $(( $(date +%s) - t0 )) s"
fi
make -s ctest 2>&1 | tail -n 2
# xdist workers: a test that crashes its process is reported as failed instead of ending the run.
# One pytest per group, each under its own time cap, so a summary (with the failures' messages)
# prints for every group even when one runs long.
# the default groups cover every folder of tests/ but fuzz (CPU only: `make test-fuzz`)
TEST_GROUPS=${TESTS:-"tests/router tests/hardening|tests/layout tests/balancing|tests/experts|tests/layer tests/hf tests/ep"}
IFS='|' read -ra GROUP_LIST <<< "$TEST_GROUPS"
for g in "${GROUP_LIST[@]}"; do
  # SIGINT at the cap: pytest still prints its summary; per-test timeouts name a hanging test.
  timeout -s INT -k 20 ${TCAP:-240} python3 -m pytest $g -q -n ${NPROC:-16} -p no:cacheprovider \
      -rfE --tb=line --timeout ${PT_TIMEOUT:-120} --durations=5 ${PYTEST_ARGS:-} \
      > "$OUT/pytest_group.log" 2>&1
  cat "$OUT/pytest_group.log" >> "$OUT/pytest.log"
  echo "== $g: $(grep -E '(passed|failed|error)' "$OUT/pytest_group.log" | tail -n 1)"
  grep -E "^(FAILED|ERROR)|Timeout|s (call|setup) " "$OUT/pytest_group.log" | cut -c1-260 | head -n ${NFAIL:-15}
done
if [ -z "${SKIP_SANITIZER:-}" ] && command -v compute-sanitizer >/dev/null; then
  for tool in ${SAN_TOOLS:-memcheck racecheck}; do
    timeout -s INT ${SCAP:-300} compute-sanitizer --tool $tool --error-exitcode 9 \
        python3 -m pytest -q -p no:cacheprovider ${SAN_TESTS:-tests/router/test_ops.py \
        tests/layout/test_cuda_vs_cpu.py tests/balancing/test_cuda_vs_cpu.py \
        tests/experts/test_grouped_gemm_cuda.py} \
        -k "${SAN_K:-cuda and (deterministic or cpu_cuda or nan or small)}" \
        > "$OUT/sanitizer_$tool.log" 2>&1
    echo "compute-sanitizer $tool: exit $? ($(grep -c 'ERROR SUMMARY: 0 errors' "$OUT/sanitizer_$tool.log") clean summaries, $(grep -c 'ERROR SUMMARY: [1-9]' "$OUT/sanitizer_$tool.log") with errors; $(tail -n 1 "$OUT/sanitizer_$tool.log" | cut -c1-120))"
    # cuBLAS's split-K kernels (nvjet_*, run by the tests' reference matmuls) report shared-memory
    # hazards under racecheck (CUDA 13.0). Excluding them with --kernel-name-exclude
    # made the sanitizer itself fail ("failed to handle a hardware exception"), so they run and
    # are counted apart: the hazards that matter are the others.
    [ "$tool" = racecheck ] && echo "  racecheck hazards in cuBLAS nvjet kernels: $(grep 'Race reported' "$OUT/sanitizer_$tool.log" | grep -c nvjet), in any other kernel: $(grep 'Race reported' "$OUT/sanitizer_$tool.log" | grep -vc nvjet)"
  done
fi
if [ -n "${PROFILE:-}" ]; then
  for shape in dsv3 mixtral; do python3 -m benchmarks.profile_routing --shape $shape 2>&1 | tail -n 20; done
fi
# BENCHES: module names (benchmarks.<script>), run with python3 -m from the repo root
for b in ${BENCHES-benchmarks.bench_ops benchmarks.bench_grouped_gemm}; do
  python3 -m $b ${BENCH_ARGS:-} 2>&1 | tee -a "$OUT/bench.log"
done
