/*
 * tokens_per_expert.cu: how many unpadded tokens each expert receives, on CUDA.
 *
 * A thread counts one expert column over a chunk of tokens (coalesced across experts) and adds
 * its count with one integer atomic: integer sums are the same in any order, so the result is
 * exact and deterministic.
 */
#include "cuda_common.cuh"

#define MOE_TPE_CHUNK 256

/* Grid (ceil(T / MOE_TPE_CHUNK), ceil(E / 128)). */
__global__ void moe_tokens_per_expert_kernel(int64_t *counts, const uint8_t *routing_map,
                                             const uint8_t *padding_mask, int64_t T, int64_t E) {
    const int64_t e = (int64_t)blockIdx.y * blockDim.x + threadIdx.x;
    if (e >= E) return;
    const int64_t t0 = (int64_t)blockIdx.x * MOE_TPE_CHUNK;
    const int64_t t1 = t0 + MOE_TPE_CHUNK < T ? t0 + MOE_TPE_CHUNK : T;
    unsigned long long n = 0;
    for (int64_t t = t0; t < t1; ++t)
        n += routing_map[t * E + e] != 0 && !(padding_mask && padding_mask[t]);
    if (n) atomicAdd((unsigned long long *)&counts[e], n);
}

extern "C" moe_status_t moe_cuda_tokens_per_expert_fwd(int64_t *counts,
                                                       const uint8_t *routing_map,
                                                       const uint8_t *padding_mask,
                                                       int64_t num_tokens, int64_t num_experts,
                                                       void *workspace, size_t workspace_bytes,
                                                       void *stream) {
    (void)workspace, (void)workspace_bytes;
    moe_clear_error();
    MOE_TRY(moe_tokens_per_expert_check(counts, routing_map, num_tokens, num_experts));
    cudaStream_t st = (cudaStream_t)stream;
    cudaError_t err = cudaMemsetAsync(counts, 0, (size_t)num_experts * sizeof(int64_t), st);
    if (err != cudaSuccess)
        return moe_fail(MOE_ERR_CUDA, "tokens_per_expert: cudaMemsetAsync failed: %s",
                        cudaGetErrorString(err));
    if (num_tokens == 0) return MOE_OK;
    const dim3 grid(moe_blocks_for(num_tokens, MOE_TPE_CHUNK), moe_blocks_for(num_experts, 128));
    moe_tokens_per_expert_kernel<<<grid, 128, 0, st>>>(counts, routing_map, padding_mask,
                                                       num_tokens, num_experts);
    MOE_CHECK_LAUNCH("moe_tokens_per_expert_kernel");
    return MOE_OK;
}
