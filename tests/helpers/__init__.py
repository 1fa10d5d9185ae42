"""Code the tests share (imported as ``helpers.<module>``; tests/ is on sys.path through the
``pythonpath`` option in pyproject.toml, and tests/conftest.py's folder; the benchmarks, which
run from the repository root, import the Megatron builders as ``tests.helpers.<module>``):

* ``reference_router`` / ``reference_layout``: pure-PyTorch references of the ops, from the spec;
* ``tolerances``: float tolerances derived from the dtype (and the router probs' ulp bound);
* ``megatron_moe``: megatron-core's moe_utils, imported quietly;
* ``megatron_layer`` / ``megatron_ep``: megatron-core's real MoELayer on the CPU, at world size 1
  and at EP > 1 over gloo;
* ``dist``: the multi-process harness (N gloo ranks); ``world_group``: a one-rank gloo group
  fixture;
* ``grouped_gemm``: poisoned outputs, expert offsets, the per-expert matmul reference, CUDA-graph
  capture; ``glu_probs``: torch references of the glu_probs op (scalar and vectorised paths);
* ``op_samples``: sample calls of the ops for torch.library.opcheck (tests/hardening/);
* ``fuzz``: the hypothesis profiles, tensor builders and comparisons of the fuzz tier (tests/fuzz/);
* ``hf_models``: tiny random Hugging Face MoE models and the comparison helpers of tests/hf/;
* ``hf_router_rules``: plain-torch references of the HF families' router math;
* ``scripts``: examples/ scripts imported as modules by path (benchmarks/ and tools/ are
  packages, imported by name);
* ``resume``: the training run of tests/hardening/test_resume.py and its fresh-process resume
  (``python -m helpers.resume CKPT OUT``).
"""
