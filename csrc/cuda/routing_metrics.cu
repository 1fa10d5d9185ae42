/*
 * routing_metrics.cu: load-balance and route-drift metrics of a routing, on CUDA.
 *
 * Every metric is derived from integer counts or from per-token fp64 values, reduced in two
 * fixed stages (block partials in the workspace, then one block), so the results are bitwise
 * reproducible and nothing reaches the host. The clever part: the stage-two block writes the
 * exact integer counts and then a single thread derives max/mean, CV and load entropy from them
 * in ascending expert order, i.e. with the C kernel's own arithmetic, so those three equal the
 * CPU's up to the math library's log. The top-k overlap is pure integer counting, hence exact;
 * its ids are not range-checked here (that needs the host): an id out of range is simply an id.
 */
#include "balancing_cuda.cuh"

/* Per-token score entropy: partial[2 b] = Σ h_t, partial[2 b + 1] = #unpadded, block b. */
__global__ void __launch_bounds__(32 * MOE_BAL_WARPS)
moe_score_entropy_partial_kernel(double *partial, const void *scores, moe_dtype_t dt,
                                 const uint8_t *padding_mask, int64_t num_tokens, int64_t E) {
    __shared__ double red[MOE_BAL_WARPS][2];
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int64_t t0 = (int64_t)blockIdx.x * MOE_TOK_PER_BLOCK;
    double acc = 0.0, valid = 0.0;
    for (int64_t j = warp; j < MOE_TOK_PER_BLOCK; j += MOE_BAL_WARPS) {
        const int64_t t = t0 + j;
        if (t >= num_tokens) break;
        if (is_pad(padding_mask, t)) continue;
        double h = 0.0;
        for (int64_t e = lane; e < E; e += 32) {
            double s = moe_load(scores, dt, t * E + e);
            if (s != 0.0) h -= s * log(s); /* NaN and negative scores propagate as NaN */
        }
        acc += moe_warp_sum(h);
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

/* Stage two (one block): counts, then the stats. */
__global__ void __launch_bounds__(MOE_BAL_FINAL_THREADS)
moe_routing_metrics_final_kernel(int64_t *tokens_per_expert, float *stats,
                                 const double *count_partial, int64_t nchunks,
                                 const double *ent_partial, int64_t nblocks, int64_t E) {
    __shared__ double smem[33];
    for (int64_t e = threadIdx.x; e < E; e += blockDim.x)
        tokens_per_expert[e] = (int64_t)moe_col_total(count_partial, nchunks, E, e);
    double h = 0.0, valid = 0.0;
    for (int64_t b = threadIdx.x; b < nblocks; b += blockDim.x)
        h += ent_partial[2 * b], valid += ent_partial[2 * b + 1];
    h = moe_block_sum(h, smem); /* its barriers also publish tokens_per_expert to thread 0 */
    valid = moe_block_sum(valid, smem);
    if (threadIdx.x != 0) return;
    moe_load_stats(tokens_per_expert, E, stats);
    /* no scores (nblocks = 0): nothing to measure */
    stats[3] = (nblocks > 0 && valid > 0.0) ? (float)(h / valid) : 0.0f;
}

/* Top-k overlap stage one: partial[2 b] = Σ |A_t ∩ B_t|, partial[2 b + 1] = #unpadded. */
__global__ void __launch_bounds__(MOE_BAL_FINAL_THREADS)
moe_topk_overlap_partial_kernel(int64_t *partial, const int64_t *a, const int64_t *b,
                                const uint8_t *padding_mask, int64_t num_tokens, int64_t k) {
    __shared__ int64_t red[MOE_BAL_FINAL_THREADS][2];
    const int64_t t = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    int64_t shared = 0, valid = 0;
    if (t < num_tokens && !is_pad(padding_mask, t)) {
        valid = 1;
        shared = moe_topk_row_overlap(a + t * k, b + t * k, k);
    }
    red[threadIdx.x][0] = shared;
    red[threadIdx.x][1] = valid;
    __syncthreads();
    for (int stride = blockDim.x / 2; stride > 0; stride >>= 1) {
        if (threadIdx.x < stride) {
            red[threadIdx.x][0] += red[threadIdx.x + stride][0];
            red[threadIdx.x][1] += red[threadIdx.x + stride][1];
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) partial[2 * blockIdx.x] = red[0][0], partial[2 * blockIdx.x + 1] = red[0][1];
}

__global__ void __launch_bounds__(MOE_BAL_FINAL_THREADS)
moe_topk_overlap_final_kernel(float *overlap, const int64_t *partial, int64_t nblocks,
                              int64_t k) {
    __shared__ int64_t red[MOE_BAL_FINAL_THREADS][2];
    int64_t shared = 0, valid = 0;
    for (int64_t b = threadIdx.x; b < nblocks; b += blockDim.x)
        shared += partial[2 * b], valid += partial[2 * b + 1];
    red[threadIdx.x][0] = shared;
    red[threadIdx.x][1] = valid;
    __syncthreads();
    for (int stride = blockDim.x / 2; stride > 0; stride >>= 1) {
        if (threadIdx.x < stride) {
            red[threadIdx.x][0] += red[threadIdx.x + stride][0];
            red[threadIdx.x][1] += red[threadIdx.x + stride][1];
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        shared = red[0][0], valid = red[0][1];
        *overlap = valid > 0 ? (float)((double)shared / ((double)valid * (double)k)) : 0.0f;
    }
}

/* Workspace: count partials [chunks, E], then entropy partials [2 · token blocks] (fp64). */
extern "C" size_t moe_cuda_routing_metrics_workspace_size(int64_t num_tokens,
                                                          int64_t num_experts) {
    if (num_experts < 1) return 0;
    int64_t cells, words;
    if (num_tokens > INT64_MAX - MOE_COL_MIN_CHUNK || /* the chunk and block counts round up */
        moe_checked_mul_i64(moe_col_chunks(num_tokens), num_experts, &cells) ||
        moe_checked_mul_i64(moe_tok_blocks(num_tokens), 2, &words) ||
        moe_checked_add_i64(cells, words, &words) ||
        moe_checked_bytes(words, (int64_t)sizeof(double)) == MOE_SIZE_OVERFLOW)
        return moe_fail_size("moe_cuda_routing_metrics_workspace_size: num_tokens=%lld, "
                             "num_experts=%lld overflow int64 bytes", (long long)num_tokens,
                             (long long)num_experts);
    return moe_checked_bytes(words, (int64_t)sizeof(double));
}

extern "C" moe_status_t moe_cuda_routing_metrics_fwd(int64_t *tokens_per_expert, float *stats,
                                                     const uint8_t *routing_map,
                                                     const void *scores,
                                                     const uint8_t *padding_mask,
                                                     int64_t num_tokens, int64_t num_experts,
                                                     moe_dtype_t scores_dtype, void *workspace,
                                                     size_t workspace_bytes, void *stream) {
    moe_clear_error();
    MOE_TRY(moe_routing_metrics_check(tokens_per_expert, stats, routing_map, scores, num_tokens,
                                      num_experts, scores_dtype));
    MOE_CHECK_WORKSPACE(moe_cuda_routing_metrics_workspace_size, num_tokens, num_experts);
    cudaStream_t s = (cudaStream_t)stream;
    const int64_t T = num_tokens, E = num_experts;
    double *counts = (double *)workspace;
    double *ent = counts + moe_col_chunks(T) * E;
    MOE_TRY(moe_launch_col_partial(1, counts, routing_map, MOE_DTYPE_BOOL, padding_mask, T, E, s));
    const int64_t nblocks = (scores != NULL) ? moe_tok_blocks(T) : 0;
    if (nblocks > 0) {
        moe_score_entropy_partial_kernel<<<(unsigned)nblocks, 32 * MOE_BAL_WARPS, 0, s>>>(
            ent, scores, scores_dtype, padding_mask, T, E);
        MOE_CHECK_LAUNCH("moe_score_entropy_partial_kernel");
    }
    moe_routing_metrics_final_kernel<<<1, MOE_BAL_FINAL_THREADS, 0, s>>>(
        tokens_per_expert, stats, counts, moe_col_chunks(T), ent, nblocks, E);
    MOE_CHECK_LAUNCH("moe_routing_metrics_final_kernel");
    return MOE_OK;
}

/* Workspace: two int64 words per block of MOE_BAL_FINAL_THREADS tokens. */
extern "C" size_t moe_cuda_topk_overlap_workspace_size(int64_t num_tokens, int64_t topk) {
    (void)topk;
    if (num_tokens > INT64_MAX - MOE_BAL_FINAL_THREADS)
        return moe_fail_size("moe_cuda_topk_overlap_workspace_size: num_tokens=%lld overflows "
                             "int64", (long long)num_tokens);
    const int64_t nblocks = num_tokens > 0 ? moe_ceil_div(num_tokens, MOE_BAL_FINAL_THREADS) : 0;
    return moe_checked_bytes(nblocks, 2 * (int64_t)sizeof(int64_t));
}

extern "C" moe_status_t moe_cuda_topk_overlap_fwd(float *overlap, const int64_t *indices_a,
                                                  const int64_t *indices_b,
                                                  const uint8_t *padding_mask,
                                                  int64_t num_tokens, int64_t topk,
                                                  int64_t num_experts, void *workspace,
                                                  size_t workspace_bytes, void *stream) {
    moe_clear_error();
    MOE_TRY(moe_topk_overlap_check(overlap, indices_a, indices_b, num_tokens, topk, num_experts));
    MOE_CHECK_WORKSPACE(moe_cuda_topk_overlap_workspace_size, num_tokens, topk);
    cudaStream_t s = (cudaStream_t)stream;
    int64_t *partial = (int64_t *)workspace;
    const int64_t nblocks = num_tokens > 0 ? moe_ceil_div(num_tokens, MOE_BAL_FINAL_THREADS) : 0;
    if (nblocks > 0) {
        moe_topk_overlap_partial_kernel<<<(unsigned)nblocks, MOE_BAL_FINAL_THREADS, 0, s>>>(
            partial, indices_a, indices_b, padding_mask, num_tokens, topk);
        MOE_CHECK_LAUNCH("moe_topk_overlap_partial_kernel");
    }
    moe_topk_overlap_final_kernel<<<1, MOE_BAL_FINAL_THREADS, 0, s>>>(overlap, partial, nblocks,
                                                                      topk);
    MOE_CHECK_LAUNCH("moe_topk_overlap_final_kernel");
    return MOE_OK;
}
