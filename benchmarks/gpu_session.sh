#!/usr/bin/env bash
# One device session: build with CUDA, run the C tests, the GPU test suite (CUDA parity, CPU-vs-CUDA
# equality), compute-sanitizer on the CUDA kernels, and the benchmarks; the table comes last.
# Run on the lent GPU machine from the repo root, with megatron-core carried as a wheel in .whl/.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"
t0=$(date +%s)
if [ -z "${SKIP_BUILD:-}" ]; then
  MAX_JOBS=16 MOE_CORE_CUDA=1 python3 -m pip install -q --no-build-isolation -e . > "$OUT/build.log" 2>&1 \
      || { tail -n 40 "$OUT/build.log"; exit 1; }
  echo "build: $(( $(date +%s) - t0 )) s"
fi
make -s ctest 2>&1 | tail -n 2
# xdist workers: a test that crashes its process is reported as failed instead of ending the run
python3 -m pytest ${TESTS:-tests} -q -n 8 -p no:cacheprovider ${PYTEST_ARGS:-} 2>&1 | tee "$OUT/pytest.log" \
    | grep -E "^(FAILED|ERROR)|crashed|passed|failed" | tail -n 25
if [ -z "${SKIP_SANITIZER:-}" ] && command -v compute-sanitizer >/dev/null; then
  for tool in memcheck racecheck; do
    compute-sanitizer --tool $tool --error-exitcode 9 python3 -m pytest -q -p no:cacheprovider \
        tests/test_router.py -k "cuda and (deterministic or cpu_cuda or nan)" > "$OUT/sanitizer_$tool.log" 2>&1
    echo "compute-sanitizer $tool: exit $? ($(grep -c 'ERROR SUMMARY: 0 errors' "$OUT/sanitizer_$tool.log") clean summaries)"
  done
fi
for b in ${BENCHES:-benchmarks/bench_router.py benchmarks/bench_ops.py}; do
  python3 $b 2>&1 | tee -a "$OUT/bench.log"
done
