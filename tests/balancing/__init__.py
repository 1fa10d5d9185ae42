"""Load-balancing tests: aux / z losses and the autoscaler, the expert bias, Sinkhorn, routing
metrics, bad input, and the CUDA kernels against the CPU."""
