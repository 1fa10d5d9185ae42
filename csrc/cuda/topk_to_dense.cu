/*
 * topk_to_dense.cu: compact routing [T, topk] ↔ dense [T, E] probs and routing map, on CUDA.
 *
 * One thread per (token, expert) element of the dense output: it scans the token's topk ids and
 * writes its value or zero, so every element is written exactly once, by a plain store. The sizes
 * are checked on the host by the CPU op's own check (moe_topk_to_dense_check_sizes). The ids live
 * in device memory: checking them would need a host sync, so on CUDA they are the caller's
 * contract, as the header says. Out-of-range ids match no element and are ignored; a row that
 * repeats an id (which the CPU op rejects) gets the value of its last occurrence.
 */
#include "cuda_common.cuh"

/* [T, k] → probs [T, E] (may be NULL), routing_map [T, E] uint8 (may be NULL) */
__global__ void moe_topk_to_dense_fwd_kernel(void *probs, uint8_t *routing_map,
                                             const void *topk_probs, const int64_t *topk_indices,
                                             int64_t num_tokens, int64_t num_experts,
                                             int64_t topk, moe_dtype_t dtype) {
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= num_tokens * num_experts) return;
    const int64_t t = i / num_experts, e = i % num_experts;
    int64_t hit = -1;
    for (int64_t j = 0; j < topk; ++j)
        if (topk_indices[t * topk + j] == e) hit = j;
    if (routing_map) routing_map[i] = hit >= 0;
    if (probs) moe_store(probs, dtype, i, hit >= 0 ? moe_load(topk_probs, dtype, t * topk + hit) : 0.0);
}

/* grad_probs [T, E] → grad_topk_probs [T, k] */
__global__ void moe_topk_to_dense_bwd_kernel(void *grad_topk_probs, const void *grad_probs,
                                             const int64_t *topk_indices, int64_t num_tokens,
                                             int64_t num_experts, int64_t topk, moe_dtype_t dtype) {
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= num_tokens * topk) return;
    const int64_t t = i / topk, e = topk_indices[i];
    const int ok = e >= 0 && e < num_experts;
    moe_store(grad_topk_probs, dtype, i, ok ? moe_load(grad_probs, dtype, t * num_experts + e) : 0.0);
}

extern "C" moe_status_t moe_cuda_topk_to_dense_fwd(void *probs, uint8_t *routing_map,
                                                   const void *topk_probs,
                                                   const int64_t *topk_indices, int64_t num_tokens,
                                                   int64_t num_experts, int64_t topk,
                                                   moe_dtype_t dtype, void *workspace,
                                                   size_t workspace_bytes, void *stream) {
    (void)workspace, (void)workspace_bytes;
    moe_clear_error();
    MOE_TRY(moe_topk_to_dense_check_sizes(num_tokens, num_experts, topk, dtype));
    const int64_t n = num_tokens * num_experts;
    if (n == 0) return MOE_OK;
    moe_topk_to_dense_fwd_kernel<<<moe_blocks_for(n, 256), 256, 0, (cudaStream_t)stream>>>(
        probs, routing_map, topk_probs, topk_indices, num_tokens, num_experts, topk, dtype);
    MOE_CHECK_LAUNCH("moe_topk_to_dense_fwd_kernel");
    return MOE_OK;
}

extern "C" moe_status_t moe_cuda_topk_to_dense_bwd(void *grad_topk_probs, const void *grad_probs,
                                                   const int64_t *topk_indices, int64_t num_tokens,
                                                   int64_t num_experts, int64_t topk,
                                                   moe_dtype_t dtype, void *workspace,
                                                   size_t workspace_bytes, void *stream) {
    (void)workspace, (void)workspace_bytes;
    moe_clear_error();
    MOE_TRY(moe_topk_to_dense_check_sizes(num_tokens, num_experts, topk, dtype));
    const int64_t n = num_tokens * topk;
    if (n == 0) return MOE_OK;
    moe_topk_to_dense_bwd_kernel<<<moe_blocks_for(n, 256), 256, 0, (cudaStream_t)stream>>>(
        grad_topk_probs, grad_probs, topk_indices, num_tokens, num_experts, topk, dtype);
    MOE_CHECK_LAUNCH("moe_topk_to_dense_bwd_kernel");
    return MOE_OK;
}
