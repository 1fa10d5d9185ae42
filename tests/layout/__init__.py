"""Token layout tests: capacity, token dropping, permute / unpermute, sort_chunks_by_idxs (vs the
reference and megatron-core), and the CUDA kernels against the CPU."""
