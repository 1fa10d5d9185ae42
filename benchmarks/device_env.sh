# Source from the repo root on the GPU machine: installs a megatron-core wheel copied into .whl/
# (if there is one) into /tmp/site and puts it on PYTHONPATH. The gpu_*session.sh scripts source
# it (through session_lib.sh); a benchmark run alone in a fresh shell or on a fresh machine must
# source it too, or bench_ops.py and bench_layer.py fail to import megatron.
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
