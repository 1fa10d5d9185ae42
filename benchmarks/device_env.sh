# Source from the repo root on the device machine: installs the carried megatron-core wheel
# (.whl/) into /tmp/site and puts it on PYTHONPATH. gpu_session.sh sources it; a later call that
# runs a benchmark alone must source it too (an idle machine is released after about 30 s, and a
# fresh one has no /tmp/site: bench_ops then fails to import megatron).
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
