"""Expert tests: grouped GEMM, glu_probs, grouped_gemm_glu_probs (fc1 with the activation fused)
and expert_mlp, on the CPU and on CUDA."""
