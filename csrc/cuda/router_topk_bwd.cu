/*
 * router_topk_bwd.cu: the router's backward on CUDA: the gradient of the logits from the probs'
 * gradient, compact [T, topk] (router_topk_bwd) or dense [T, E] (router_topk_dense_bwd), and
 * from the fused router's logsumexp (router_lse_bwd: grad_lse[t] times the softmax row).
 *
 * One warp per token, the row's experts strided over the lanes as in the forward's warp kernel
 * (a thread per token past 1024 experts or 32 groups). The clever part is that only the k picked
 * experts need the sequential math: one lane runs the C kernel's own routine for them
 * (moe_topk_bwd_selected, fp64 throughout), and the lanes then write the whole row, the others
 * from its one dot product (softmax-pre: s_e · (−dot), with the row's softmax statistics reduced
 * across the warp; every other score function: zero). So the gradient is the CPU's up to the
 * math library. Nothing is allocated and nothing waits on the host.
 */
#include "router_topk_cuda.cuh"

/* grad_probs [T, k] → grad_logits [T, E]; one warp per token, coalesced row writes.
 * Shared memory: 3·k + 1 words per warp. Rows with an out-of-range index are left unwritten. */
template <int VPL>
__global__ void __launch_bounds__(32 * MOE_ROUTER_WARPS)
moe_router_topk_bwd_warp_kernel(void *grad_logits, const void *grad_probs, const void *logits,
                                const int64_t *topk_indices, int64_t num_tokens,
                                moe_topk_ctx_t ctx) {
    extern __shared__ double moe_router_smem[];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int64_t t = (int64_t)blockIdx.x * MOE_ROUTER_WARPS + warp;
    if (t >= num_tokens) return;
    const int64_t E = ctx.num_experts, k = ctx.topk, base = t * E;
    const int64_t *idx = topk_indices + t * k;
    double *scratch = moe_router_smem + (int64_t)warp * (3 * k + 1);
    double *gsel = scratch + 2 * k, *dot = scratch + 3 * k;
    int bad = 0;
    for (int64_t j = lane; j < k; j += 32) bad |= idx[j] < 0 || idx[j] >= E;
    if (__any_sync(MOE_FULL_MASK, bad)) return;

    moe_topk_ctx_t c64 = ctx;
    c64.fp64 = 1;
    double m = 0.0, inv = 0.0;
    const int pre = ctx.score_function == MOE_SCORE_SOFTMAX && ctx.pre_softmax;
    if (pre) warp_softmax_stats<VPL>(&c64, logits, base, lane, &m, &inv);
    if (lane == 0) moe_topk_bwd_selected(&ctx, logits, grad_probs, t, idx, m, inv, scratch, gsel, dot);
    __syncwarp();
#pragma unroll
    for (int i = 0; i < VPL; ++i) {
        int64_t e = lane + 32 * i;
        if (e >= E) continue;
        int64_t hit = -1;
        for (int64_t j = 0; j < k; ++j) hit = idx[j] == e ? j : hit;
        double gl = hit >= 0 ? gsel[hit] : moe_topk_bwd_unpicked(&c64, logits, base + e, m, inv, *dot);
        moe_store(grad_logits, ctx.dtype, base + e, gl);
    }
}

/* Fallback backward: grad_probs [T, k] → grad_logits [T, E]; rows with an out-of-range index are
 * skipped, not followed */
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

/* grad_lse [T] → grad_logits [T, E] = grad_lse[t] · softmax row (0 on padded rows); one thread
 * per element, grid-stride. */
__global__ void moe_router_lse_bwd_kernel(void *grad_logits, const double *grad_lse,
                                          const void *logits, const double *lse,
                                          const uint8_t *padding_mask, int64_t num_tokens,
                                          int64_t num_experts, moe_dtype_t dt) {
    const int64_t n = num_tokens * num_experts;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x) {
        const int64_t t = i / num_experts;
        const int pad = padding_mask != NULL && padding_mask[t] != 0;
        moe_store(grad_logits, dt, i,
                  moe_router_lse_grad(grad_lse[t], moe_load(logits, dt, i), lse[t], pad));
    }
}

typedef void (*moe_topk_bwd_warp_fn)(void *, const void *, const void *, const int64_t *, int64_t,
                                     moe_topk_ctx_t);
MOE_VPL_SELECTOR(bwd_warp_kernel, moe_topk_bwd_warp_fn, moe_router_topk_bwd_warp_kernel)
#undef MOE_VPL_SELECTOR

extern "C" moe_status_t moe_cuda_router_lse_bwd(void *grad_logits, const double *grad_lse,
                                                const void *logits, const double *lse,
                                                const uint8_t *padding_mask, int64_t num_tokens,
                                                int64_t num_experts, moe_dtype_t logits_dtype,
                                                void *workspace, size_t workspace_bytes,
                                                void *stream) {
    (void)workspace;
    (void)workspace_bytes;
    moe_clear_error();
    MOE_TRY(moe_router_lse_bwd_check(grad_logits, grad_lse, logits, lse, num_tokens, num_experts,
                                     logits_dtype));
    if (num_tokens == 0) return MOE_OK;
    int64_t blocks = (num_tokens * num_experts + 255) / 256;
    if (blocks > (1 << 20)) blocks = 1 << 20; /* grid-stride beyond */
    moe_router_lse_bwd_kernel<<<(unsigned)blocks, 256, 0, (cudaStream_t)stream>>>(
        grad_logits, grad_lse, logits, lse, padding_mask, num_tokens, num_experts, logits_dtype);
    MOE_CHECK_LAUNCH("moe_router_lse_bwd_kernel");
    return MOE_OK;
}

static moe_status_t topk_bwd(void *grad_logits, const void *grad_probs, const void *logits,
                             const int64_t *topk_indices, int64_t num_tokens, int64_t num_experts,
                             moe_dtype_t logits_dtype, const moe_router_topk_params_t *params,
                             int grad_dense, void *workspace, size_t workspace_bytes,
                             void *stream) {
    moe_clear_error();
    MOE_TRY(check_common(num_tokens, num_experts, logits_dtype, params, 0, workspace_bytes));
    if (num_tokens == 0) return MOE_OK;
    moe_topk_ctx_t ctx = moe_topk_ctx_make(params, num_experts, logits_dtype);
    ctx.grad_dense = grad_dense;
    const int vpl = warp_vpl(num_experts, params->num_groups);
    if (vpl > 0) {
        const size_t smem = (size_t)MOE_ROUTER_WARPS * (3 * (size_t)params->topk + 1) * sizeof(double);
        moe_topk_bwd_warp_fn kernel = bwd_warp_kernel(vpl);
        MOE_TRY(warp_smem((const void *)kernel, smem));
        kernel<<<moe_blocks_for(num_tokens, MOE_ROUTER_WARPS), 32 * MOE_ROUTER_WARPS, smem,
                 (cudaStream_t)stream>>>(grad_logits, grad_probs, logits, topk_indices, num_tokens,
                                         ctx);
        MOE_CHECK_LAUNCH("moe_router_topk_bwd_warp_kernel");
        return MOE_OK;
    }
    moe_router_topk_bwd_kernel<<<moe_blocks_for(num_tokens, MOE_CUDA_THREADS), MOE_CUDA_THREADS, 0,
                                 (cudaStream_t)stream>>>(grad_logits, grad_probs, logits,
                                                         topk_indices, num_tokens, ctx,
                                                         (double *)workspace, row_words(params));
    MOE_CHECK_LAUNCH("moe_router_topk_bwd_kernel");
    return MOE_OK;
}

extern "C" moe_status_t moe_cuda_router_topk_bwd(void *grad_logits, const void *grad_probs,
                                                 const void *logits, const int64_t *topk_indices,
                                                 int64_t num_tokens, int64_t num_experts,
                                                 moe_dtype_t logits_dtype,
                                                 const moe_router_topk_params_t *params,
                                                 void *workspace, size_t workspace_bytes,
                                                 void *stream) {
    return topk_bwd(grad_logits, grad_probs, logits, topk_indices, num_tokens, num_experts,
                    logits_dtype, params, 0, workspace, workspace_bytes, stream);
}

extern "C" moe_status_t moe_cuda_router_topk_dense_bwd(void *grad_logits, const void *grad_probs,
                                                       const void *logits,
                                                       const int64_t *topk_indices,
                                                       int64_t num_tokens, int64_t num_experts,
                                                       moe_dtype_t logits_dtype,
                                                       const moe_router_topk_params_t *params,
                                                       void *workspace, size_t workspace_bytes,
                                                       void *stream) {
    return topk_bwd(grad_logits, grad_probs, logits, topk_indices, num_tokens, num_experts,
                    logits_dtype, params, 1, workspace, workspace_bytes, stream);
}
