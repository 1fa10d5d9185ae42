/*
 * aux_loss_scores.c: the scores and top-k map Megatron's aux losses are computed from
 * (compute_routing_scores_for_aux_loss), forward and backward, on the CPU.
 *
 * One token per loop iteration over OpenMP threads, each thread with its own top-k list in the
 * caller's workspace. The clever part: the map is built in the same pass that produces the
 * scores (a sorted insertion list while the experts stream by, shared with the router's
 * moe_topk_insert), and for sigmoid / sqrtsoftplus the ranking runs on the normalised values
 * read back from the output row, so the map is the top-k of exactly the scores returned, ties
 * included (rounding can merge neighbours when dividing by the row sum).
 */
#include "balancing_math.h"
#include "router_topk_math.h"

/* Softmax statistics of row t: max and 1/Σ exp(x − max), each step at compute precision. */
static inline void softmax_stats(int fp64, const void *x, moe_dtype_t dt, int64_t base, int64_t n,
                                 double *max_out, double *inv_out) {
    double m = -INFINITY;
    int has_nan = 0;
    for (int64_t e = 0; e < n; ++e) {
        double v = load_c(x, dt, base + e);
        has_nan |= v != v;
        m = v > m ? v : m;
    }
    if (has_nan) m = NAN;
    double sum = 0.0;
    for (int64_t e = 0; e < n; ++e) sum += rnd(fp64, exp(rnd(fp64, load_c(x, dt, base + e) - m)));
    *max_out = m;
    *inv_out = rnd(fp64, 1.0 / rnd(fp64, sum));
}

size_t moe_aux_loss_scores_workspace_size(int64_t num_tokens, int64_t num_experts, int64_t topk) {
    (void)num_tokens;
    (void)num_experts;
    if (topk < 1) topk = 1;
    int64_t words;
    if (moe_checked_mul_i64(topk, moe_max_threads(), &words) ||
        moe_checked_bytes(words, (int64_t)(sizeof(double) + sizeof(int64_t))) == MOE_SIZE_OVERFLOW)
        return moe_fail_size("moe_aux_loss_scores_workspace_size: topk=%lld needs more than "
                             "int64 bytes of scratch", (long long)topk);
    return moe_checked_bytes(words, (int64_t)(sizeof(double) + sizeof(int64_t)));
}

static moe_status_t check_common(int64_t num_tokens, int64_t num_experts,
                                 moe_dtype_t logits_dtype, moe_score_function_t score_function) {
    MOE_TRY(check_sizes(num_tokens, num_experts, "num_experts"));
    MOE_CHECK(moe_is_float_dtype(logits_dtype), "logits must be a float dtype, got %s",
              moe_dtype_name(logits_dtype));
    return moe_check_score_function(score_function);
}

moe_status_t moe_aux_loss_scores_fwd_check(const void *scores, const uint8_t *routing_map,
                                           const void *logits, int64_t num_tokens,
                                           int64_t num_experts, int64_t topk,
                                           moe_dtype_t logits_dtype,
                                           moe_score_function_t score_function) {
    MOE_TRY(check_common(num_tokens, num_experts, logits_dtype, score_function));
    MOE_CHECK(topk >= 1 && topk <= num_experts, "topk must be in [1, num_experts=%lld], got %lld",
              (long long)num_experts, (long long)topk);
    MOE_CHECK(num_tokens == 0 || (scores && routing_map && logits),
              "scores, routing_map and logits must not be NULL");
    return MOE_OK;
}

moe_status_t moe_aux_loss_scores_bwd_check(const void *grad_logits, const void *grad_scores,
                                           const void *logits, int64_t num_tokens,
                                           int64_t num_experts, moe_dtype_t logits_dtype,
                                           moe_score_function_t score_function) {
    MOE_TRY(check_common(num_tokens, num_experts, logits_dtype, score_function));
    MOE_CHECK(num_tokens == 0 || (grad_logits && grad_scores && logits),
              "grad_logits, grad_scores and logits must not be NULL");
    return MOE_OK;
}

moe_status_t moe_aux_loss_scores_fwd(void *scores, uint8_t *routing_map, const void *logits,
                                     const uint8_t *padding_mask, int64_t num_tokens,
                                     int64_t num_experts, int64_t topk, moe_dtype_t logits_dtype,
                                     moe_score_function_t score_function, void *workspace,
                                     size_t workspace_bytes, void *stream) {
    (void)stream;
    moe_clear_error();
    MOE_TRY(moe_aux_loss_scores_fwd_check(scores, routing_map, logits, num_tokens, num_experts,
                                          topk, logits_dtype, score_function));
    if (num_tokens == 0) return MOE_OK;
    const size_t per_thread = moe_checked_bytes(topk, (int64_t)(sizeof(double) + sizeof(int64_t)));
    MOE_CHECK(per_thread != MOE_SIZE_OVERFLOW, "topk=%lld: its scratch overflows int64 bytes",
              (long long)topk);
    const int64_t nthreads = (int64_t)(workspace_bytes / per_thread);
    MOE_CHECK(workspace != NULL && nthreads >= 1,
              "workspace too small: %zu bytes, need at least %zu "
              "(moe_aux_loss_scores_workspace_size)",
              workspace_bytes, per_thread);
    const int fp64 = logits_dtype == MOE_DTYPE_FP64;
    const moe_dtype_t sdt = compute_dtype(logits_dtype);
    const int64_t E = num_experts, k = topk;

#pragma omp parallel num_threads((int)nthreads)
    {
        double *vals = (double *)((char *)workspace + (size_t)moe_thread_id() * per_thread);
        int64_t *idx = (int64_t *)(vals + k);
#pragma omp for schedule(static)
        for (int64_t t = 0; t < num_tokens; ++t) {
            const int64_t base = t * E;
            memset(routing_map + base, 0, (size_t)E);
            if (is_pad(padding_mask, t)) {
                for (int64_t e = 0; e < E; ++e) moe_store(scores, sdt, base + e, 0.0);
                continue;
            }
            int64_t len = 0;
            if (score_function == MOE_SCORE_SOFTMAX) {
                /* the scores are final as soon as they are computed: rank them on the way */
                double m, inv;
                softmax_stats(fp64, logits, logits_dtype, base, E, &m, &inv);
                for (int64_t e = 0; e < E; ++e) {
                    double s = moe_bal_softmax_at(fp64, load_c(logits, logits_dtype, base + e), m, inv);
                    moe_store(scores, sdt, base + e, s);
                    moe_topk_insert(vals, idx, &len, k, s, e);
                }
            } else {
                /* unnormalised scores go to the output row, then are normalised and ranked
                 * there: ranking after the division keeps torch's ties (rounding can merge
                 * neighbours), so the map is the top-k of exactly the scores returned */
                double sum = 0.0;
                for (int64_t e = 0; e < E; ++e) {
                    double s = moe_bal_unnorm_score(fp64, score_function,
                                            load_c(logits, logits_dtype, base + e));
                    moe_store(scores, sdt, base + e, s);
                    sum += s;
                }
                double d = rnd(fp64, rnd(fp64, sum) + rnd(fp64, 1e-20));
                for (int64_t e = 0; e < E; ++e) {
                    double s = rnd(fp64, moe_load(scores, sdt, base + e) / d);
                    moe_store(scores, sdt, base + e, s);
                    moe_topk_insert(vals, idx, &len, k, s, e);
                }
            }
            for (int64_t j = 0; j < len; ++j) routing_map[base + idx[j]] = 1;
        }
    }
    return MOE_OK;
}

moe_status_t moe_aux_loss_scores_bwd(void *grad_logits, const void *grad_scores,
                                     const void *logits, const uint8_t *padding_mask,
                                     int64_t num_tokens, int64_t num_experts,
                                     moe_dtype_t logits_dtype, moe_score_function_t score_function,
                                     void *workspace, size_t workspace_bytes, void *stream) {
    (void)stream;
    (void)workspace;
    (void)workspace_bytes;
    moe_clear_error();
    MOE_TRY(moe_aux_loss_scores_bwd_check(grad_logits, grad_scores, logits, num_tokens,
                                          num_experts, logits_dtype, score_function));
    if (num_tokens == 0) return MOE_OK;
    const int fp64 = logits_dtype == MOE_DTYPE_FP64;
    const moe_dtype_t sdt = compute_dtype(logits_dtype);
    const int64_t E = num_experts;

#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < num_tokens; ++t) {
        const int64_t base = t * E;
        if (is_pad(padding_mask, t)) {
            for (int64_t e = 0; e < E; ++e) moe_store(grad_logits, logits_dtype, base + e, 0.0);
            continue;
        }
        if (score_function == MOE_SCORE_SOFTMAX) {
            /* d softmax: s · (g − Σ g·s) */
            double m, inv, dot = 0.0;
            softmax_stats(fp64, logits, logits_dtype, base, E, &m, &inv);
            for (int64_t e = 0; e < E; ++e)
                dot += moe_load(grad_scores, sdt, base + e) *
                       moe_bal_softmax_at(fp64, load_c(logits, logits_dtype, base + e), m, inv);
            dot = rnd(fp64, dot);
            for (int64_t e = 0; e < E; ++e) {
                double s = moe_bal_softmax_at(fp64, load_c(logits, logits_dtype, base + e), m, inv);
                double g = moe_load(grad_scores, sdt, base + e);
                moe_store(grad_logits, logits_dtype, base + e, rnd(fp64, s * rnd(fp64, g - dot)));
            }
            continue;
        }
        /* n = s / d with d = Σ s + 1e-20: dL/ds_j = g_j / d − Σ_e g_e s_e / d² */
        double sum = 0.0, gs = 0.0;
        for (int64_t e = 0; e < E; ++e) {
            double s = moe_bal_unnorm_score(fp64, score_function, load_c(logits, logits_dtype, base + e));
            sum += s;
            gs += moe_load(grad_scores, sdt, base + e) * s;
        }
        double d = rnd(fp64, rnd(fp64, sum) + rnd(fp64, 1e-20));
        double shared = rnd(fp64, -rnd(fp64, gs) / rnd(fp64, d * d));
        for (int64_t e = 0; e < E; ++e) {
            double x = load_c(logits, logits_dtype, base + e);
            double s = moe_bal_unnorm_score(fp64, score_function, x);
            double g = rnd(fp64, rnd(fp64, moe_load(grad_scores, sdt, base + e) / d) + shared);
            moe_store(grad_logits, logits_dtype, base + e,
                      moe_bal_unnorm_score_bwd(fp64, score_function, x, s, g));
        }
    }
    return MOE_OK;
}

