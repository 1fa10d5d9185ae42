/*
 * routing_metrics.c: load-balance and route-drift metrics of a routing, on the CPU.
 *
 * These are the numbers a training log wants per MoE layer (tokens per expert, max/mean load,
 * coefficient of variation, load entropy, the router's score entropy) and the top-k overlap
 * between two routings of the same tokens. They are written to caller buffers and never read
 * back by the core, so a caller on a GPU keeps them on the device until it chooses to log.
 *
 * The clever part is small: every metric is derived from integer counts (exact in any order)
 * or from per-token values parked in the workspace and summed in token order, so the metrics
 * are bitwise reproducible whatever the thread count.
 */
#include "balancing_math.h"

size_t moe_routing_metrics_workspace_size(int64_t num_tokens, int64_t num_experts) {
    (void)num_experts;
    if (num_tokens <= 0) return 0;
    const size_t bytes = moe_checked_bytes(num_tokens, (int64_t)sizeof(double));
    if (bytes == MOE_SIZE_OVERFLOW)
        return moe_fail_size("moe_routing_metrics_workspace_size: num_tokens=%lld fp64 words "
                             "overflow int64 bytes", (long long)num_tokens);
    return bytes;
}

moe_status_t moe_routing_metrics_check(const int64_t *tokens_per_expert, const float *stats,
                                       const uint8_t *routing_map, const void *scores,
                                       int64_t num_tokens, int64_t num_experts,
                                       moe_dtype_t scores_dtype) {
    MOE_CHECK(num_tokens >= 0, "num_tokens must be >= 0, got %lld", (long long)num_tokens);
    MOE_CHECK(num_experts >= 1, "num_experts must be >= 1, got %lld", (long long)num_experts);
    MOE_TRY(moe_check_mul(num_tokens, "num_tokens", num_experts, "num_experts"));
    MOE_CHECK(scores == NULL || moe_is_float_dtype(scores_dtype),
              "scores must be a float dtype, got %s", moe_dtype_name(scores_dtype));
    MOE_CHECK(tokens_per_expert && stats && (routing_map || num_tokens == 0),
              "tokens_per_expert, stats and routing_map must not be NULL");
    return MOE_OK;
}

moe_status_t moe_routing_metrics_fwd(int64_t *tokens_per_expert, float *stats,
                                     const uint8_t *routing_map, const void *scores,
                                     const uint8_t *padding_mask, int64_t num_tokens,
                                     int64_t num_experts, moe_dtype_t scores_dtype,
                                     void *workspace, size_t workspace_bytes, void *stream) {
    (void)stream;
    moe_clear_error();
    MOE_TRY(moe_routing_metrics_check(tokens_per_expert, stats, routing_map, scores, num_tokens,
                                      num_experts, scores_dtype));
    MOE_CHECK_WORKSPACE(moe_routing_metrics_workspace_size, num_tokens, num_experts);
    const int64_t T = num_tokens, E = num_experts;

#pragma omp parallel for schedule(static)
    for (int64_t e = 0; e < E; ++e) {
        int64_t n = 0;
        for (int64_t t = 0; t < T; ++t)
            n += routing_map[t * E + e] != 0 && !is_pad(padding_mask, t);
        tokens_per_expert[e] = n;
    }
    moe_load_stats(tokens_per_expert, E, stats);

    if (scores == NULL || num_tokens == 0) {
        stats[3] = 0.0f; /* no scores: nothing to measure (an empty tensor may have no pointer) */
        return MOE_OK;
    }
    double *h = (double *)workspace;
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < T; ++t) {
        double acc = 0.0;
        if (!is_pad(padding_mask, t)) {
            for (int64_t e = 0; e < E; ++e) {
                double s = moe_load(scores, scores_dtype, t * E + e);
                if (s != 0.0) acc -= s * log(s); /* NaN and negative scores propagate as NaN */
            }
        }
        h[t] = acc;
    }
    double sum = 0.0;
    int64_t valid = 0;
    for (int64_t t = 0; t < T; ++t) {
        sum += h[t];
        valid += !is_pad(padding_mask, t);
    }
    stats[3] = valid > 0 ? (float)(sum / (double)valid) : 0.0f;
    return MOE_OK;
}

size_t moe_topk_overlap_workspace_size(int64_t num_tokens, int64_t topk) {
    (void)num_tokens, (void)topk;
    return 0; /* integer counts, reduced by OpenMP */
}

moe_status_t moe_topk_overlap_check(const float *overlap, const int64_t *indices_a,
                                    const int64_t *indices_b, int64_t num_tokens, int64_t topk,
                                    int64_t num_experts) {
    MOE_CHECK(num_tokens >= 0, "num_tokens must be >= 0, got %lld", (long long)num_tokens);
    MOE_CHECK(topk >= 1, "topk must be >= 1, got %lld", (long long)topk);
    MOE_CHECK(num_experts >= topk, "num_experts must be >= topk=%lld, got %lld", (long long)topk,
              (long long)num_experts);
    MOE_TRY(moe_check_mul(num_tokens, "num_tokens", topk, "topk"));
    MOE_CHECK(overlap && ((indices_a && indices_b) || num_tokens == 0),
              "overlap, indices_a and indices_b must not be NULL");
    return MOE_OK;
}

moe_status_t moe_topk_overlap_fwd(float *overlap, const int64_t *indices_a,
                                  const int64_t *indices_b, const uint8_t *padding_mask,
                                  int64_t num_tokens, int64_t topk, int64_t num_experts,
                                  void *workspace, size_t workspace_bytes, void *stream) {
    (void)stream;
    (void)workspace;
    (void)workspace_bytes;
    moe_clear_error();
    MOE_TRY(moe_topk_overlap_check(overlap, indices_a, indices_b, num_tokens, topk, num_experts));
    /* the ids' values (host memory; the CUDA entry point cannot read them without a sync) */
    const int64_t n = num_tokens * topk;
    int64_t bad_a = -1, bad_b = -1;
    for (int64_t i = 0; i < n && bad_a < 0; ++i)
        if (indices_a[i] < 0 || indices_a[i] >= num_experts) bad_a = i;
    for (int64_t i = 0; i < n && bad_b < 0; ++i)
        if (indices_b[i] < 0 || indices_b[i] >= num_experts) bad_b = i;
    MOE_CHECK(bad_a < 0, "indices_a has %lld at flat position %lld, outside [0, num_experts=%lld)",
              (long long)(bad_a < 0 ? 0 : indices_a[bad_a]), (long long)bad_a,
              (long long)num_experts);
    MOE_CHECK(bad_b < 0, "indices_b has %lld at flat position %lld, outside [0, num_experts=%lld)",
              (long long)(bad_b < 0 ? 0 : indices_b[bad_b]), (long long)bad_b,
              (long long)num_experts);
    /* integer counts: the OpenMP reduction is exact, hence order-independent */
    int64_t shared = 0, valid = 0;
#pragma omp parallel for schedule(static) reduction(+ : shared, valid)
    for (int64_t t = 0; t < num_tokens; ++t) {
        if (is_pad(padding_mask, t)) continue;
        ++valid;
        shared += moe_topk_row_overlap(indices_a + t * topk, indices_b + t * topk, topk);
    }
    *overlap = valid > 0 ? (float)((double)shared / ((double)valid * (double)topk)) : 0.0f;
    return MOE_OK;
}
