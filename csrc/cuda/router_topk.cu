/*
 * router_topk.cu: the router's score function, (group-limited) top-k and probs on CUDA.
 *
 * One thread per token runs exactly the per-row function of the C kernel
 * (../router_topk_math.h), so CPU and GPU routing agree by construction: the same selection
 * order, tie-breaking and rounding points. Each thread's O(topk + num_groups) scratch lives in the
 * caller's workspace; nothing is allocated and nothing waits on the host.
 *
 * This is the reference-exact CUDA path. It is correct at every size but not bandwidth-bound
 * (one thread walks a whole row); the fused warp-per-token router is the optimisation on top.
 */
#include "cuda_common.cuh"
#include "../router_topk_math.h"

static int64_t row_words(const moe_router_topk_params_t *p) {
    return moe_topk_scratch_words(p->topk, p->num_groups) + p->topk;
}

/* logits [T, E] → topk_probs [T, k] (logits dtype), topk_indices [T, k] int64 */
__global__ void moe_router_topk_fwd_kernel(void *topk_probs, int64_t *topk_indices,
                                           const void *logits, const float *expert_bias,
                                           int64_t num_tokens, moe_topk_ctx_t ctx,
                                           double *workspace, int64_t words) {
    const int64_t t = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= num_tokens) return;
    const int64_t k = ctx.topk;
    double *scratch = workspace + t * words;
    double *probs = scratch + words - k;
    moe_topk_row_fwd(&ctx, logits, t, expert_bias, scratch, topk_indices + t * k, probs);
    for (int64_t j = 0; j < k; ++j) moe_store(topk_probs, ctx.dtype, t * k + j, probs[j]);
}

/* grad_probs [T, k] → grad_logits [T, E]; out-of-range indices are skipped, not followed */
__global__ void moe_router_topk_bwd_kernel(void *grad_logits, const void *grad_probs,
                                           const void *logits, const int64_t *topk_indices,
                                           int64_t num_tokens, moe_topk_ctx_t ctx,
                                           double *workspace, int64_t words) {
    const int64_t t = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= num_tokens) return;
    const int64_t *idx = topk_indices + t * ctx.topk;
    for (int64_t j = 0; j < ctx.topk; ++j)
        if (idx[j] < 0 || idx[j] >= ctx.num_experts) return;
    moe_topk_row_bwd(&ctx, logits, grad_probs, t, idx, workspace + t * words, grad_logits);
}

extern "C" size_t moe_cuda_router_topk_workspace_size(int64_t num_tokens, int64_t num_experts,
                                                      const moe_router_topk_params_t *params) {
    (void)num_experts;
    if (!params || num_tokens <= 0) return 0;
    return (size_t)num_tokens * (size_t)row_words(params) * sizeof(double);
}

static moe_status_t check_common(int64_t num_tokens, int64_t num_experts, moe_dtype_t dt,
                                 const moe_router_topk_params_t *p, int has_bias,
                                 size_t workspace_bytes) {
    MOE_CHECK(num_tokens >= 0, "num_tokens must be >= 0, got %lld", (long long)num_tokens);
    MOE_CHECK(moe_is_float_dtype(dt), "logits must be a float dtype, got %s", moe_dtype_name(dt));
    MOE_TRY(moe_router_topk_check(p, num_experts, has_bias));
    const size_t need = moe_cuda_router_topk_workspace_size(num_tokens, num_experts, p);
    MOE_CHECK(workspace_bytes >= need, "workspace too small: %zu bytes, need %zu", workspace_bytes,
              need);
    return MOE_OK;
}

extern "C" moe_status_t moe_cuda_router_topk_fwd(void *topk_probs, int64_t *topk_indices,
                                                 const void *logits, const float *expert_bias,
                                                 int64_t num_tokens, int64_t num_experts,
                                                 moe_dtype_t logits_dtype,
                                                 const moe_router_topk_params_t *params,
                                                 void *workspace, size_t workspace_bytes,
                                                 void *stream) {
    moe_clear_error();
    MOE_TRY(check_common(num_tokens, num_experts, logits_dtype, params, expert_bias != NULL,
                         workspace_bytes));
    if (num_tokens == 0) return MOE_OK;
    const moe_topk_ctx_t ctx = moe_topk_ctx_make(params, num_experts, logits_dtype);
    moe_router_topk_fwd_kernel<<<moe_blocks_for(num_tokens, MOE_CUDA_THREADS), MOE_CUDA_THREADS, 0,
                                 (cudaStream_t)stream>>>(topk_probs, topk_indices, logits,
                                                         expert_bias, num_tokens, ctx,
                                                         (double *)workspace, row_words(params));
    MOE_CHECK_LAUNCH("moe_router_topk_fwd_kernel");
    return MOE_OK;
}

extern "C" moe_status_t moe_cuda_router_topk_bwd(void *grad_logits, const void *grad_probs,
                                                 const void *logits, const int64_t *topk_indices,
                                                 int64_t num_tokens, int64_t num_experts,
                                                 moe_dtype_t logits_dtype,
                                                 const moe_router_topk_params_t *params,
                                                 void *workspace, size_t workspace_bytes,
                                                 void *stream) {
    moe_clear_error();
    MOE_TRY(check_common(num_tokens, num_experts, logits_dtype, params, 0, workspace_bytes));
    if (num_tokens == 0) return MOE_OK;
    const moe_topk_ctx_t ctx = moe_topk_ctx_make(params, num_experts, logits_dtype);
    moe_router_topk_bwd_kernel<<<moe_blocks_for(num_tokens, MOE_CUDA_THREADS), MOE_CUDA_THREADS, 0,
                                 (cudaStream_t)stream>>>(grad_logits, grad_probs, logits,
                                                         topk_indices, num_tokens, ctx,
                                                         (double *)workspace, row_words(params));
    MOE_CHECK_LAUNCH("moe_router_topk_bwd_kernel");
    return MOE_OK;
}
