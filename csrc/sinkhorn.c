/*
 * sinkhorn.c: Sinkhorn normalisation and Megatron's Sinkhorn routing on the CPU.
 *
 * Sinkhorn alternates two scalings of C = exp(cost) until the expert marginals stop moving: d0
 * makes every token's row sum 1/T, d1 every expert's column sum 1/E, so a top-k of
 * d1 ⊙ C ⊙ d0 spreads tokens evenly over the experts. Every step rounds where Megatron's fp32
 * tensors round (products, sums, reciprocals), with the sums accumulated in fp64 in ascending
 * index order, so the number of iterations and the selection match Megatron's.
 *
 * The clever part is the workspace layout of the routing kernel: the balanced matrix is needed
 * only to rank the experts of each row, so it lives in caller scratch next to d0, d1 and the
 * per-thread top-k lists, and the outputs are written once, in the logits dtype, from the
 * activation of the picked experts.
 */
#include "balancing_math.h"
#include "router_topk_math.h"

/* Words of scratch: d0 + d1 + d1_old + C + (routing only) one top-k list per thread; -1 when
 * the count overflows int64. */
static int64_t sinkhorn_words(int64_t T, int64_t E, int64_t topk) {
    int64_t te, e2, w, lists = 0;
    if (moe_checked_mul_i64(T, E, &te) || moe_checked_mul_i64(E, 2, &e2) ||
        moe_checked_add_i64(te, e2, &w) || moe_checked_add_i64(w, T, &w))
        return -1;
    if (topk > 0 && (moe_checked_mul_i64(topk, 2 * (int64_t)moe_max_threads(), &lists) ||
                     moe_checked_add_i64(w, lists, &w)))
        return -1;
    return w;
}

size_t moe_sinkhorn_workspace_size(int64_t num_tokens, int64_t num_experts, int64_t topk) {
    if (num_tokens < 0 || num_experts < 1) return 0;
    const int64_t words = sinkhorn_words(num_tokens, num_experts, topk);
    const size_t bytes = words < 0 ? MOE_SIZE_OVERFLOW : moe_checked_bytes(words, (int64_t)sizeof(double));
    if (bytes == MOE_SIZE_OVERFLOW)
        return moe_fail_size("moe_sinkhorn_workspace_size: num_tokens=%lld, num_experts=%lld, "
                             "topk=%lld overflow int64 bytes of scratch",
                             (long long)num_tokens, (long long)num_experts, (long long)topk);
    return bytes;
}

size_t moe_sinkhorn_routing_workspace_size(int64_t num_tokens, int64_t num_experts,
                                           int64_t topk, int training) {
    (void)training; /* eval ranks the activation, but the top-k lists sit past C all the same */
    return moe_sinkhorn_workspace_size(num_tokens, num_experts, topk);
}

/*
 * Runs Sinkhorn on C (already exp'd, at compute precision, row-major [T, E]) and overwrites it
 * with d1 ⊙ C ⊙ d0. d0 [T], d1 [E], d1_old [E] are scratch.
 */
static void sinkhorn_core(int fp64, double *C, int64_t T, int64_t E, double tol, int64_t max_iters,
                          double *d0, double *d1, double *d1_old) {
    const double eps = rnd(fp64, 1e-8), inv_t = rnd(fp64, 1.0 / (double)T),
                 inv_e = rnd(fp64, 1.0 / (double)E);
    for (int64_t t = 0; t < T; ++t) d0[t] = 1.0;
    for (int64_t e = 0; e < E; ++e) d1[e] = d1_old[e] = 1.0;
    double error = 1e9;
    for (int64_t it = 0; error > tol && (max_iters == 0 || it < max_iters); ++it) {
        /* d0 = (1/T) · 1 / (Σ_e d1·C + eps); Python's `float / tensor` is reciprocal · float */
#pragma omp parallel for schedule(static)
        for (int64_t t = 0; t < T; ++t) {
            double s = 0.0;
            for (int64_t e = 0; e < E; ++e) s += rnd(fp64, d1[e] * C[t * E + e]);
            d0[t] = rnd(fp64, rnd(fp64, 1.0 / rnd(fp64, rnd(fp64, s) + eps)) * inv_t);
        }
#pragma omp parallel for schedule(static)
        for (int64_t e = 0; e < E; ++e) {
            double s = 0.0;
            for (int64_t t = 0; t < T; ++t) s += rnd(fp64, d0[t] * C[t * E + e]);
            d1[e] = rnd(fp64, rnd(fp64, 1.0 / rnd(fp64, rnd(fp64, s) + eps)) * inv_e);
        }
        double err = 0.0;
        for (int64_t e = 0; e < E; ++e) {
            err += fabs(d1_old[e] - d1[e]);
            d1_old[e] = d1[e];
        }
        error = rnd(fp64, rnd(fp64, err) / (double)E);
    }
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < T; ++t)
        for (int64_t e = 0; e < E; ++e)
            C[t * E + e] = rnd(fp64, rnd(fp64, d1[e] * C[t * E + e]) * d0[t]);
}

static moe_status_t check_common(int64_t T, int64_t E, moe_dtype_t dt, const char *name) {
    MOE_CHECK(T >= 0, "num_tokens must be >= 0, got %lld", (long long)T);
    MOE_CHECK(E >= 1, "num_experts must be >= 1, got %lld", (long long)E);
    MOE_CHECK(moe_is_float_dtype(dt), "%s must be a float dtype, got %s", name,
              moe_dtype_name(dt));
    return moe_check_mul(T, "num_tokens", E, "num_experts");
}

moe_status_t moe_sinkhorn_fwd_check(const void *out, const void *cost, int64_t num_tokens,
                                    int64_t num_experts, moe_dtype_t cost_dtype, double tol,
                                    int64_t max_iters) {
    MOE_TRY(check_common(num_tokens, num_experts, cost_dtype, "cost"));
    MOE_CHECK(tol >= 0.0, "tol must be >= 0, got %g", tol); /* also rejects NaN */
    MOE_CHECK(max_iters >= 0, "max_iters must be >= 0, got %lld", (long long)max_iters);
    MOE_CHECK(num_tokens == 0 || (out && cost), "out and cost must not be NULL");
    return MOE_OK;
}

static moe_status_t check_topk(int64_t num_experts, int64_t topk) {
    MOE_CHECK(topk >= 1 && topk <= num_experts, "topk must be in [1, num_experts=%lld], got %lld",
              (long long)num_experts, (long long)topk);
    return MOE_OK;
}

moe_status_t moe_sinkhorn_routing_fwd_check(const void *probs, const uint8_t *routing_map,
                                            const void *logits, int64_t num_tokens,
                                            int64_t num_experts, int64_t topk,
                                            moe_dtype_t logits_dtype, double tol) {
    MOE_TRY(check_common(num_tokens, num_experts, logits_dtype, "logits"));
    MOE_TRY(check_topk(num_experts, topk));
    MOE_CHECK(tol >= 0.0, "tol must be >= 0, got %g", tol);
    MOE_CHECK(num_tokens == 0 || (probs && routing_map && logits),
              "probs, routing_map and logits must not be NULL");
    return MOE_OK;
}

moe_status_t moe_sinkhorn_routing_bwd_check(const void *grad_logits, const void *grad_probs,
                                            const void *logits, const uint8_t *routing_map,
                                            int64_t num_tokens, int64_t num_experts, int64_t topk,
                                            moe_dtype_t logits_dtype) {
    MOE_TRY(check_common(num_tokens, num_experts, logits_dtype, "logits"));
    MOE_TRY(check_topk(num_experts, topk));
    MOE_CHECK(num_tokens == 0 || (grad_logits && grad_probs && logits && routing_map),
              "grad_logits, grad_probs, logits and routing_map must not be NULL");
    return MOE_OK;
}

moe_status_t moe_sinkhorn_fwd(void *out, const void *cost, int64_t num_tokens,
                              int64_t num_experts, moe_dtype_t cost_dtype, double tol,
                              int64_t max_iters, void *workspace, size_t workspace_bytes,
                              void *stream) {
    (void)stream;
    moe_clear_error();
    MOE_TRY(moe_sinkhorn_fwd_check(out, cost, num_tokens, num_experts, cost_dtype, tol,
                                   max_iters));
    if (num_tokens == 0) return MOE_OK;
    const int64_t T = num_tokens, E = num_experts;
    MOE_TRY(moe_check_workspace(workspace, workspace_bytes, moe_sinkhorn_workspace_size(T, E, 0),
                                "moe_sinkhorn_workspace_size, topk=0"));
    const int fp64 = cost_dtype == MOE_DTYPE_FP64;
    double *d0 = (double *)workspace, *d1 = d0 + T, *d1_old = d1 + E, *C = d1_old + E;
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < T * E; ++i)
        C[i] = rnd(fp64, exp(rnd(fp64, moe_load(cost, cost_dtype, i))));
    sinkhorn_core(fp64, C, T, E, tol, max_iters, d0, d1, d1_old);
    const moe_dtype_t odt = fp64 ? MOE_DTYPE_FP64 : MOE_DTYPE_FP32;
    for (int64_t i = 0; i < T * E; ++i) moe_store(out, odt, i, C[i]);
    return MOE_OK;
}

/* The routing activation of one logit row: sigmoid (topk 1) or softmax (topk > 1). */
static inline double act_softmax_at(int fp64, double x, double m, double inv) {
    return rnd(fp64, rnd(fp64, exp(rnd(fp64, x - m))) * inv);
}

static inline void act_softmax_stats(int fp64, const void *x, moe_dtype_t dt, int64_t base,
                                     int64_t n, double *m_out, double *inv_out) {
    double m = -INFINITY;
    int has_nan = 0;
    for (int64_t e = 0; e < n; ++e) {
        double v = moe_load(x, dt, base + e);
        has_nan |= v != v;
        m = v > m ? v : m;
    }
    if (has_nan) m = NAN;
    double sum = 0.0;
    for (int64_t e = 0; e < n; ++e) sum += rnd(fp64, exp(rnd(fp64, moe_load(x, dt, base + e) - m)));
    *m_out = m;
    *inv_out = rnd(fp64, 1.0 / rnd(fp64, sum));
}

moe_status_t moe_sinkhorn_routing_fwd(void *probs, uint8_t *routing_map, const void *logits,
                                      int64_t num_tokens, int64_t num_experts, int64_t topk,
                                      moe_dtype_t logits_dtype, int training, double tol,
                                      void *workspace, size_t workspace_bytes, void *stream) {
    (void)stream;
    moe_clear_error();
    MOE_TRY(moe_sinkhorn_routing_fwd_check(probs, routing_map, logits, num_tokens, num_experts,
                                           topk, logits_dtype, tol));
    if (num_tokens == 0) return MOE_OK;
    const int64_t T = num_tokens, E = num_experts, k = topk;
    MOE_CHECK_WORKSPACE(moe_sinkhorn_routing_workspace_size, T, E, k, training);
    const int fp64 = logits_dtype == MOE_DTYPE_FP64;
    double *d0 = (double *)workspace, *d1 = d0 + T, *d1_old = d1 + E, *C = d1_old + E;
    double *lists = C + T * E;
    const int64_t nthreads = (int64_t)((workspace_bytes / sizeof(double) -
                                        (size_t)(lists - (double *)workspace)) /
                                       (2u * (size_t)k));
    if (training) {
        /* Megatron: sinkhorn(logits.to(float32)) under no_grad */
#pragma omp parallel for schedule(static)
        for (int64_t i = 0; i < T * E; ++i)
            C[i] = rnd(fp64, exp(rnd(fp64, moe_load(logits, logits_dtype, i))));
        sinkhorn_core(fp64, C, T, E, tol, 0, d0, d1, d1_old);
    }

#pragma omp parallel num_threads((int)(nthreads < 1 ? 1 : nthreads))
    {
        double *vals = lists + (int64_t)moe_thread_id() * 2 * k;
        int64_t *idx = (int64_t *)(vals + k);
#pragma omp for schedule(static)
        for (int64_t t = 0; t < T; ++t) {
            const int64_t base = t * E;
            double m = 0.0, inv = 0.0;
            if (k > 1) act_softmax_stats(fp64, logits, logits_dtype, base, E, &m, &inv);
            /* the activation, as the logits-dtype tensor Megatron ranks in eval mode */
            for (int64_t e = 0; e < E; ++e) {
                double x = moe_load(logits, logits_dtype, base + e);
                double a = k == 1 ? 1.0 / (1.0 + exp(-x)) : act_softmax_at(fp64, x, m, inv);
                moe_store(probs, logits_dtype, base + e, a);
            }
            int64_t len = 0;
            for (int64_t e = 0; e < E; ++e) {
                double v = training ? C[base + e] : moe_load(probs, logits_dtype, base + e);
                moe_topk_insert(vals, idx, &len, k, v, e);
            }
            for (int64_t e = 0; e < E; ++e) routing_map[base + e] = 0;
            for (int64_t j = 0; j < len; ++j) routing_map[base + idx[j]] = 1;
            for (int64_t e = 0; e < E; ++e)
                if (!routing_map[base + e]) moe_store(probs, logits_dtype, base + e, 0.0);
        }
    }
    return MOE_OK;
}

moe_status_t moe_sinkhorn_routing_bwd(void *grad_logits, const void *grad_probs,
                                      const void *logits, const uint8_t *routing_map,
                                      int64_t num_tokens, int64_t num_experts, int64_t topk,
                                      moe_dtype_t logits_dtype, void *workspace,
                                      size_t workspace_bytes, void *stream) {
    (void)stream;
    (void)workspace;
    (void)workspace_bytes;
    moe_clear_error();
    MOE_TRY(moe_sinkhorn_routing_bwd_check(grad_logits, grad_probs, logits, routing_map,
                                           num_tokens, num_experts, topk, logits_dtype));
    if (num_tokens == 0) return MOE_OK;
    const int fp64 = logits_dtype == MOE_DTYPE_FP64;
    const int64_t E = num_experts;
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < num_tokens; ++t) {
        const int64_t base = t * E;
        if (topk == 1) {
            /* sigmoid in the logits dtype: g · (1 − s) · s on the picked expert */
            for (int64_t e = 0; e < E; ++e) {
                const int64_t i = base + e;
                double g = routing_map[i] ? moe_load(grad_probs, logits_dtype, i) : 0.0;
                double s = moe_round_to(logits_dtype,
                                        1.0 / (1.0 + exp(-moe_load(logits, logits_dtype, i))));
                moe_store(grad_logits, logits_dtype, i, g * (1.0 - s) * s);
            }
            continue;
        }
        /* softmax (fp32) · map: s · (g' − Σ g'·s) with g' = g · map */
        double m, inv, dot = 0.0;
        act_softmax_stats(fp64, logits, logits_dtype, base, E, &m, &inv);
        for (int64_t e = 0; e < E; ++e)
            if (routing_map[base + e])
                dot += moe_load(grad_probs, logits_dtype, base + e) *
                       act_softmax_at(fp64, moe_load(logits, logits_dtype, base + e), m, inv);
        dot = rnd(fp64, dot);
        for (int64_t e = 0; e < E; ++e) {
            double s = act_softmax_at(fp64, moe_load(logits, logits_dtype, base + e), m, inv);
            double g = routing_map[base + e] ? moe_load(grad_probs, logits_dtype, base + e) : 0.0;
            moe_store(grad_logits, logits_dtype, base + e, rnd(fp64, s * rnd(fp64, g - dot)));
        }
    }
    return MOE_OK;
}
