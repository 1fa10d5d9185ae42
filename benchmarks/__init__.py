"""The benchmarks: our MoE layer and its ops timed against Megatron-Core (the parity oracle),
``torch._grouped_mm`` and the hardware's own limits, at the reference shapes of ``shapes`` with the
timing harness of ``timing``. Each script runs from the repository root as
``python -m benchmarks.<script>``; README.md lists them and RESULTS.md holds today's numbers."""
