/*
 * z_loss.cu: the router z-loss of ST-MoE (Megatron's z_loss_func), forward and backward, on
 * CUDA: coeff · mean over unpadded tokens of logsumexp(logits[t])².
 *
 * One warp per token computes logsumexp in fp64 (max subtracted, NaN and ±inf rows as the C
 * kernel). The forward is a two-stage reduction: each block of MOE_BAL_WARPS warps sums the
 * lse² of MOE_TOK_PER_BLOCK consecutive tokens (each warp its tokens in order, then the warps
 * in order) and counts the unpadded ones, into two fixed workspace slots; one block then adds
 * the slots in a fixed order. The backward needs the unpadded count (the mean's divisor): one
 * block counts the mask into the workspace first, so nothing waits on the host.
 */
#include "balancing_cuda.cuh"

/* logsumexp of a row in fp64, warp-reduced (±inf rows give ±inf, NaN propagates). */
__device__ __forceinline__ double warp_row_lse(const void *logits, moe_dtype_t dt, int64_t base,
                                               int64_t E, int lane) {
    double m = -INFINITY;
    for (int64_t e = lane; e < E; e += 32) {
        double v = moe_load(logits, dt, base + e);
        m = (v != v || v > m) ? v : m;
    }
    m = moe_warp_max_nan(m);
    if (m != m) return m;
    if (isinf(m)) return m;
    double sum = 0.0;
    for (int64_t e = lane; e < E; e += 32) sum += exp(moe_load(logits, dt, base + e) - m);
    return m + log(moe_warp_sum(sum));
}

/* Stage one: partial[2 b] = Σ lse² and partial[2 b + 1] = #unpadded over block b's tokens. */
__global__ void __launch_bounds__(32 * MOE_BAL_WARPS)
moe_z_loss_partial_kernel(double *partial, const void *logits, const uint8_t *padding_mask,
                          int64_t num_tokens, int64_t E, moe_dtype_t dt) {
    __shared__ double red[MOE_BAL_WARPS][2];
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int64_t t0 = (int64_t)blockIdx.x * MOE_TOK_PER_BLOCK;
    double acc = 0.0, valid = 0.0;
    for (int64_t j = warp; j < MOE_TOK_PER_BLOCK; j += MOE_BAL_WARPS) {
        const int64_t t = t0 + j;
        if (t >= num_tokens) break;
        if (is_pad(padding_mask, t)) continue;
        double lse = warp_row_lse(logits, dt, t * E, E, lane);
        acc += lse * lse;
        valid += 1.0;
    }
    if (lane == 0) red[warp][0] = acc, red[warp][1] = valid;
    __syncthreads();
    if (threadIdx.x == 0) {
        double s = 0.0, n = 0.0;
        for (int w = 0; w < MOE_BAL_WARPS; ++w) s += red[w][0], n += red[w][1];
        partial[2 * blockIdx.x] = s;
        partial[2 * blockIdx.x + 1] = n;
    }
}

/* Stage two (one block): loss = Σ / divisor · coeff. */
__global__ void __launch_bounds__(MOE_BAL_FINAL_THREADS)
moe_z_loss_final_kernel(void *loss, moe_dtype_t loss_dtype, const double *partial,
                        int64_t nblocks, int has_mask, int64_t num_tokens, double coeff) {
    __shared__ double smem[33];
    double s = 0.0, n = 0.0;
    for (int64_t b = threadIdx.x; b < nblocks; b += blockDim.x)
        s += partial[2 * b], n += partial[2 * b + 1];
    s = moe_block_sum(s, smem);
    n = moe_block_sum(n, smem);
    if (threadIdx.x == 0) {
        /* 0 / 0 = NaN for an empty unmasked batch, as torch.mean of nothing */
        const double div = has_mask ? (n > 0.0 ? n : 1.0) : (double)num_tokens;
        moe_store(loss, loss_dtype, 0, s / div * coeff);
    }
}

/* One block counts the unpadded tokens: count[0] = max(n, 1) (the backward's divisor). */
__global__ void __launch_bounds__(MOE_BAL_FINAL_THREADS)
moe_z_loss_count_kernel(double *count, const uint8_t *padding_mask, int64_t num_tokens) {
    __shared__ double smem[33];
    double n = 0.0;
    for (int64_t t = threadIdx.x; t < num_tokens; t += blockDim.x) n += padding_mask[t] == 0;
    n = moe_block_sum(n, smem);
    if (threadIdx.x == 0) count[0] = n > 0.0 ? n : 1.0;
}

/* grad_logits[t, e] = scale · lse_t · exp(x − lse_t), scale = grad_loss · coeff · 2 / divisor. */
__global__ void __launch_bounds__(32 * MOE_BAL_WARPS)
moe_z_loss_bwd_kernel(void *grad_logits, const void *grad_loss, moe_dtype_t loss_dtype,
                      const void *logits, const uint8_t *padding_mask, const double *divisor,
                      int64_t num_tokens, int64_t E, double coeff, moe_dtype_t dt) {
    const int lane = threadIdx.x % 32;
    const int64_t t = (int64_t)blockIdx.x * MOE_BAL_WARPS + threadIdx.x / 32;
    if (t >= num_tokens) return;
    const int64_t base = t * E;
    if (is_pad(padding_mask, t)) {
        for (int64_t e = lane; e < E; e += 32) moe_store(grad_logits, dt, base + e, 0.0);
        return;
    }
    const double div = divisor ? *divisor : (double)num_tokens;
    const double scale = moe_load(grad_loss, loss_dtype, 0) * coeff * 2.0 / div;
    const double lse = warp_row_lse(logits, dt, base, E, lane);
    for (int64_t e = lane; e < E; e += 32) {
        const double x = moe_load(logits, dt, base + e);
        moe_store(grad_logits, dt, base + e, scale * lse * exp(x - lse));
    }
}

extern "C" size_t moe_cuda_z_loss_workspace_size(int64_t num_tokens, int64_t num_experts) {
    (void)num_experts;
    /* forward: two words per block; backward: one word (the divisor). Blocks are a fraction of
     * the tokens, so only a num_tokens near 2^63 can overflow (moe_tok_blocks' rounding). */
    if (num_tokens > INT64_MAX - MOE_TOK_PER_BLOCK)
        return moe_fail_size("moe_cuda_z_loss_workspace_size: num_tokens=%lld overflows int64",
                             (long long)num_tokens);
    const size_t fwd = moe_checked_bytes(moe_tok_blocks(num_tokens), 2 * (int64_t)sizeof(double));
    return fwd > sizeof(double) ? fwd : sizeof(double);
}

extern "C" moe_status_t moe_cuda_z_loss_fwd(void *loss, const void *logits,
                                            const uint8_t *padding_mask, int64_t num_tokens,
                                            int64_t num_experts, double coeff,
                                            moe_dtype_t logits_dtype, void *workspace,
                                            size_t workspace_bytes, void *stream) {
    moe_clear_error();
    MOE_TRY(moe_z_loss_check(logits, num_tokens, num_experts, coeff, logits_dtype));
    MOE_CHECK(loss != NULL, "loss must not be NULL");
    MOE_CHECK_WORKSPACE(moe_cuda_z_loss_workspace_size, num_tokens, num_experts);
    cudaStream_t s = (cudaStream_t)stream;
    double *partial = (double *)workspace;
    const int64_t nblocks = moe_tok_blocks(num_tokens);
    if (nblocks > 0) {
        moe_z_loss_partial_kernel<<<(unsigned)nblocks, 32 * MOE_BAL_WARPS, 0, s>>>(
            partial, logits, padding_mask, num_tokens, num_experts, logits_dtype);
        MOE_CHECK_LAUNCH("moe_z_loss_partial_kernel");
    }
    moe_z_loss_final_kernel<<<1, MOE_BAL_FINAL_THREADS, 0, s>>>(
        loss, compute_dtype(logits_dtype), partial, nblocks, padding_mask != NULL, num_tokens,
        coeff);
    MOE_CHECK_LAUNCH("moe_z_loss_final_kernel");
    return MOE_OK;
}

extern "C" moe_status_t moe_cuda_z_loss_bwd(void *grad_logits, const void *grad_loss,
                                            const void *logits, const uint8_t *padding_mask,
                                            int64_t num_tokens, int64_t num_experts, double coeff,
                                            moe_dtype_t logits_dtype, void *workspace,
                                            size_t workspace_bytes, void *stream) {
    moe_clear_error();
    MOE_TRY(moe_z_loss_check(logits, num_tokens, num_experts, coeff, logits_dtype));
    MOE_CHECK(grad_loss != NULL, "grad_loss must not be NULL");
    /* an empty grad_logits may have no storage: 0 tokens have nothing to write */
    if (num_tokens == 0) return MOE_OK;
    MOE_CHECK(grad_logits != NULL, "grad_logits must not be NULL");
    cudaStream_t s = (cudaStream_t)stream;
    double *divisor = NULL;
    if (padding_mask) {
        MOE_TRY(moe_check_workspace(workspace, workspace_bytes, sizeof(double),
                                    "moe_cuda_z_loss_workspace_size"));
        divisor = (double *)workspace;
        moe_z_loss_count_kernel<<<1, MOE_BAL_FINAL_THREADS, 0, s>>>(divisor, padding_mask,
                                                                    num_tokens);
        MOE_CHECK_LAUNCH("moe_z_loss_count_kernel");
    }
    moe_z_loss_bwd_kernel<<<moe_blocks_for(num_tokens, MOE_BAL_WARPS), 32 * MOE_BAL_WARPS, 0, s>>>(
        grad_logits, grad_loss, compute_dtype(logits_dtype), logits, padding_mask, divisor,
        num_tokens, num_experts, coeff, logits_dtype);
    MOE_CHECK_LAUNCH("moe_z_loss_bwd_kernel");
    return MOE_OK;
}
