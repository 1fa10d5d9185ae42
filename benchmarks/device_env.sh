# Source from the repo root on the GPU machine: installs a megatron-core wheel copied into .whl/
# (if there is one) into /tmp/site and puts it on PYTHONPATH; likewise the pinned transformers
# and what it needs, from wheels in .whl/hf/ (for the Hugging Face tests and bench_hf.py, where
# the machine's transformers is older), into /tmp/site_hf. The gpu_*session.sh scripts source
# it (through session_lib.sh); a benchmark run alone in a fresh shell or on a fresh machine must
# source it too, or bench_ops.py and bench_layer.py fail to import megatron.
# .whl/ may hold the wheel for several Python versions: pip picks the one this interpreter takes.
if ls .whl/megatron_core-*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --find-links .whl --target /tmp/site megatron-core && export PYTHONPATH=/tmp/site
fi
# each package by name, so pip picks the wheel of this Python version where there are several
HF_PKGS=$(ls .whl/hf/*.whl 2>/dev/null | xargs -rn1 basename | cut -d- -f1 | sort -u)
if [ -n "$HF_PKGS" ] && python3 -m pip install -q --no-index --no-deps --no-compile \
    --no-cache-dir --find-links .whl/hf --target /tmp/site_hf $HF_PKGS; then
  export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}/tmp/site_hf
fi
