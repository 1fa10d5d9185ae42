/*
 * aux_loss_scores.cu: the scores and top-k map of Megatron's aux losses
 * (compute_routing_scores_for_aux_loss), forward and backward, on CUDA.
 *
 * One warp per token; lane l handles experts l, l + 32, ... The per-element math is the C
 * kernel's own (moe_bal_softmax_at, moe_bal_unnorm_score in ../balancing_math.h), so every value
 * is rounded at the same points; only the row sums (max, Σ exp, Σ s) are added in a warp-tree
 * order instead of ascending order. The clever part is the map: it is built by k rounds of a
 * warp arg-max over the scores *read back from the output row* (as the C kernel ranks the
 * stored values), with the map row itself as the "taken" set, under the C kernel's order
 * (larger first, NaN first, ties to the lower expert). So it needs no scratch, and it is the
 * CPU's map whenever the scores are the CPU's scores.
 */
#include "balancing_cuda.cuh"

/* logits [T, E] → scores [T, E] (fp32, fp64 for fp64 logits), routing_map [T, E]. */
__global__ void __launch_bounds__(32 * MOE_BAL_WARPS)
moe_aux_loss_scores_fwd_kernel(void *scores, uint8_t *routing_map, const void *logits,
                               const uint8_t *padding_mask, int64_t num_tokens, int64_t E,
                               int64_t k, moe_dtype_t dt, int score_function) {
    const int lane = threadIdx.x % 32;
    const int64_t t = (int64_t)blockIdx.x * MOE_BAL_WARPS + threadIdx.x / 32;
    if (t >= num_tokens) return; /* the whole warp leaves together */
    const int fp64 = dt == MOE_DTYPE_FP64;
    const moe_dtype_t sdt = compute_dtype(dt);
    const int64_t base = t * E;
    uint8_t *map_row = routing_map + base;
    if (is_pad(padding_mask, t)) {
        for (int64_t e = lane; e < E; e += 32) {
            moe_store(scores, sdt, base + e, 0.0);
            map_row[e] = 0;
        }
        return;
    }
    if (score_function == MOE_SCORE_SOFTMAX) {
        double m, inv;
        moe_warp_softmax_stats(fp64, 1, logits, dt, base, E, lane, &m, &inv);
        for (int64_t e = lane; e < E; e += 32)
            moe_store(scores, sdt, base + e,
                      moe_bal_softmax_at(fp64, load_c(logits, dt, base + e), m, inv));
    } else {
        /* unnormalised scores go to the output row, then are normalised in place, as on CPU */
        double sum = 0.0;
        for (int64_t e = lane; e < E; e += 32) {
            double s = moe_bal_unnorm_score(fp64, (moe_score_function_t)score_function,
                                            load_c(logits, dt, base + e));
            moe_store(scores, sdt, base + e, s);
            sum += s;
        }
        sum = moe_warp_sum(sum);
        const double d = rnd(fp64, rnd(fp64, sum) + rnd(fp64, 1e-20));
        for (int64_t e = lane; e < E; e += 32)
            moe_store(scores, sdt, base + e, rnd(fp64, moe_load(scores, sdt, base + e) / d));
    }
    /* each lane re-reads only the elements it wrote itself: no cross-lane visibility needed */
    moe_warp_topk_map(map_row, E, k, lane, scores, sdt, base);
}

/* grad_scores [T, E] (the scores' dtype) → grad_logits [T, E] (the logits' dtype). */
__global__ void __launch_bounds__(32 * MOE_BAL_WARPS)
moe_aux_loss_scores_bwd_kernel(void *grad_logits, const void *grad_scores, const void *logits,
                               const uint8_t *padding_mask, int64_t num_tokens, int64_t E,
                               moe_dtype_t dt, int score_function) {
    const int lane = threadIdx.x % 32;
    const int64_t t = (int64_t)blockIdx.x * MOE_BAL_WARPS + threadIdx.x / 32;
    if (t >= num_tokens) return;
    const int fp64 = dt == MOE_DTYPE_FP64;
    const moe_dtype_t sdt = compute_dtype(dt);
    const int64_t base = t * E;
    if (is_pad(padding_mask, t)) {
        for (int64_t e = lane; e < E; e += 32) moe_store(grad_logits, dt, base + e, 0.0);
        return;
    }
    if (score_function == MOE_SCORE_SOFTMAX) {
        /* d softmax: s · (g − Σ g·s) */
        double m, inv, dot = 0.0;
        moe_warp_softmax_stats(fp64, 1, logits, dt, base, E, lane, &m, &inv);
        for (int64_t e = lane; e < E; e += 32)
            dot += moe_load(grad_scores, sdt, base + e) *
                   moe_bal_softmax_at(fp64, load_c(logits, dt, base + e), m, inv);
        dot = rnd(fp64, moe_warp_sum(dot));
        for (int64_t e = lane; e < E; e += 32) {
            double s = moe_bal_softmax_at(fp64, load_c(logits, dt, base + e), m, inv);
            double g = moe_load(grad_scores, sdt, base + e);
            moe_store(grad_logits, dt, base + e, rnd(fp64, s * rnd(fp64, g - dot)));
        }
        return;
    }
    /* n = s / d with d = Σ s + 1e-20: dL/ds_j = g_j / d − Σ_e g_e s_e / d² */
    const moe_score_function_t sf = (moe_score_function_t)score_function;
    double sum = 0.0, gs = 0.0;
    for (int64_t e = lane; e < E; e += 32) {
        double s = moe_bal_unnorm_score(fp64, sf, load_c(logits, dt, base + e));
        sum += s;
        gs += moe_load(grad_scores, sdt, base + e) * s;
    }
    sum = moe_warp_sum(sum);
    gs = moe_warp_sum(gs);
    const double d = rnd(fp64, rnd(fp64, sum) + rnd(fp64, 1e-20));
    const double shared = rnd(fp64, -rnd(fp64, gs) / rnd(fp64, d * d));
    for (int64_t e = lane; e < E; e += 32) {
        double x = load_c(logits, dt, base + e);
        double s = moe_bal_unnorm_score(fp64, sf, x);
        double g = rnd(fp64, rnd(fp64, moe_load(grad_scores, sdt, base + e) / d) + shared);
        moe_store(grad_logits, dt, base + e,
                  moe_bal_unnorm_score_bwd(fp64, sf, x, s, g));
    }
}

/* The kernels' own limit (a lane's expert index is an int), after the op's shared check. */
static moe_status_t check_cuda_limits(int64_t num_experts) {
    MOE_CHECK(num_experts <= 0x7fffffff, "num_experts must be < 2^31, got %lld",
              (long long)num_experts);
    return MOE_OK;
}

extern "C" size_t moe_cuda_aux_loss_scores_workspace_size(int64_t num_tokens, int64_t num_experts,
                                                          int64_t topk) {
    (void)num_tokens, (void)num_experts, (void)topk;
    return 0; /* the map row is the top-k scratch */
}

extern "C" moe_status_t moe_cuda_aux_loss_scores_fwd(void *scores, uint8_t *routing_map,
                                                     const void *logits,
                                                     const uint8_t *padding_mask,
                                                     int64_t num_tokens, int64_t num_experts,
                                                     int64_t topk, moe_dtype_t logits_dtype,
                                                     moe_score_function_t score_function,
                                                     void *workspace, size_t workspace_bytes,
                                                     void *stream) {
    (void)workspace, (void)workspace_bytes;
    moe_clear_error();
    MOE_TRY(moe_aux_loss_scores_fwd_check(scores, routing_map, logits, num_tokens, num_experts,
                                          topk, logits_dtype, score_function));
    MOE_TRY(check_cuda_limits(num_experts));
    if (num_tokens == 0) return MOE_OK;
    moe_aux_loss_scores_fwd_kernel<<<moe_blocks_for(num_tokens, MOE_BAL_WARPS), 32 * MOE_BAL_WARPS,
                                     0, (cudaStream_t)stream>>>(
        scores, routing_map, logits, padding_mask, num_tokens, num_experts, topk, logits_dtype,
        (int)score_function);
    MOE_CHECK_LAUNCH("moe_aux_loss_scores_fwd_kernel");
    return MOE_OK;
}

extern "C" moe_status_t moe_cuda_aux_loss_scores_bwd(void *grad_logits, const void *grad_scores,
                                                     const void *logits,
                                                     const uint8_t *padding_mask,
                                                     int64_t num_tokens, int64_t num_experts,
                                                     moe_dtype_t logits_dtype,
                                                     moe_score_function_t score_function,
                                                     void *workspace, size_t workspace_bytes,
                                                     void *stream) {
    (void)workspace, (void)workspace_bytes;
    moe_clear_error();
    MOE_TRY(moe_aux_loss_scores_bwd_check(grad_logits, grad_scores, logits, num_tokens,
                                          num_experts, logits_dtype, score_function));
    MOE_TRY(check_cuda_limits(num_experts));
    if (num_tokens == 0) return MOE_OK;
    moe_aux_loss_scores_bwd_kernel<<<moe_blocks_for(num_tokens, MOE_BAL_WARPS), 32 * MOE_BAL_WARPS,
                                     0, (cudaStream_t)stream>>>(
        grad_logits, grad_scores, logits, padding_mask, num_tokens, num_experts, logits_dtype,
        (int)score_function);
    MOE_CHECK_LAUNCH("moe_aux_loss_scores_bwd_kernel");
    return MOE_OK;
}
