/*
 * balancing.c: the load-balancing math on the CPU: the scores and top-k map the aux losses are
 * computed from, the switch aux loss, the z-loss, tokens per expert and the expert bias update.
 *
 * Each kernel follows Megatron's unfused PyTorch code step by step: every value that Megatron
 * materialises as a tensor is computed in double and rounded once to the precision that tensor
 * has (fp32; fp64 when the input is fp64, so fp64 gradcheck is meaningful), and every sum is
 * accumulated in fp64 in ascending index order. The one idea worth knowing: no reduction here is
 * split by thread count. Parallel loops own whole rows or whole columns, and a row result that
 * feeds a scalar is parked in the workspace and summed afterwards in token order, so a loss is
 * bitwise the same with 1 or 64 threads, run after run.
 */
#include "common.h"
#include "router_topk_math.h"

/* Rounds to the compute precision: fp64 for fp64 inputs, else fp32. */
static inline double rnd(int fp64, double v) { return fp64 ? v : (double)(float)v; }

/* An input element as the compute-precision tensor Megatron makes of it (`x.float()`). */
static inline double load_c(const void *p, moe_dtype_t dt, int64_t i) {
    return rnd(dt == MOE_DTYPE_FP64, moe_load(p, dt, i));
}

static inline moe_dtype_t compute_dtype(moe_dtype_t dt) {
    return dt == MOE_DTYPE_FP64 ? MOE_DTYPE_FP64 : MOE_DTYPE_FP32;
}

static inline int is_pad(const uint8_t *padding_mask, int64_t t) {
    return padding_mask != NULL && padding_mask[t] != 0;
}

static moe_status_t check_sizes(int64_t num_tokens, int64_t num_experts, const char *cols) {
    MOE_CHECK(num_tokens >= 0, "num_tokens must be >= 0, got %lld", (long long)num_tokens);
    MOE_CHECK(num_experts >= 1, "%s must be >= 1, got %lld", cols, (long long)num_experts);
    return MOE_OK;
}

static moe_status_t check_score_function(moe_score_function_t sf) {
    MOE_CHECK(sf == MOE_SCORE_SOFTMAX || sf == MOE_SCORE_SIGMOID || sf == MOE_SCORE_SQRTSOFTPLUS,
              "score_function must be softmax (0), sigmoid (1) or sqrtsoftplus (2), got %d",
              (int)sf);
    return MOE_OK;
}

static moe_status_t check_workspace(const void *workspace, size_t have, size_t need,
                                    const char *fn) {
    MOE_CHECK(need == 0 || (workspace != NULL && have >= need),
              "workspace too small: %zu bytes, need %zu (%s)", have, need, fn);
    return MOE_OK;
}

/* ---- aux-loss scores ----------------------------------------------------------------------- */

/* sigmoid or sqrt(softplus) of one logit at compute precision (softplus: beta 1, threshold 20). */
static inline double unnorm_score(int fp64, moe_score_function_t sf, double x) {
    if (sf == MOE_SCORE_SIGMOID) return rnd(fp64, 1.0 / (1.0 + exp(-x)));
    double sp = rnd(fp64, x > 20.0 ? x : log1p(exp(x)));
    return rnd(fp64, sqrt(sp));
}

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

static inline double softmax_at(int fp64, double x, double m, double inv) {
    return rnd(fp64, rnd(fp64, exp(rnd(fp64, x - m))) * inv);
}

size_t moe_aux_loss_scores_workspace_size(int64_t num_tokens, int64_t num_experts, int64_t topk) {
    (void)num_tokens;
    (void)num_experts;
    if (topk < 1) topk = 1;
    return (size_t)moe_max_threads() * (size_t)topk * (sizeof(double) + sizeof(int64_t));
}

moe_status_t moe_aux_loss_scores_fwd(void *scores, uint8_t *routing_map, const void *logits,
                                     const uint8_t *padding_mask, int64_t num_tokens,
                                     int64_t num_experts, int64_t topk, moe_dtype_t logits_dtype,
                                     moe_score_function_t score_function, void *workspace,
                                     size_t workspace_bytes, void *stream) {
    (void)stream;
    moe_clear_error();
    MOE_TRY(check_sizes(num_tokens, num_experts, "num_experts"));
    MOE_CHECK(moe_is_float_dtype(logits_dtype), "logits must be a float dtype, got %s",
              moe_dtype_name(logits_dtype));
    MOE_CHECK(topk >= 1 && topk <= num_experts, "topk must be in [1, num_experts=%lld], got %lld",
              (long long)num_experts, (long long)topk);
    MOE_TRY(check_score_function(score_function));
    if (num_tokens == 0) return MOE_OK;
    MOE_CHECK(scores && routing_map && logits, "scores, routing_map and logits must not be NULL");
    const size_t per_thread = (size_t)topk * (sizeof(double) + sizeof(int64_t));
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
                    double s = softmax_at(fp64, load_c(logits, logits_dtype, base + e), m, inv);
                    moe_store(scores, sdt, base + e, s);
                    moe_topk_insert(vals, idx, &len, k, s, e);
                }
            } else {
                /* unnormalised scores go to the output row, then are normalised and ranked
                 * there: ranking after the division keeps torch's ties (rounding can merge
                 * neighbours), so the map is the top-k of exactly the scores returned */
                double sum = 0.0;
                for (int64_t e = 0; e < E; ++e) {
                    double s = unnorm_score(fp64, score_function,
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
    MOE_TRY(check_sizes(num_tokens, num_experts, "num_experts"));
    MOE_CHECK(moe_is_float_dtype(logits_dtype), "logits must be a float dtype, got %s",
              moe_dtype_name(logits_dtype));
    MOE_TRY(check_score_function(score_function));
    if (num_tokens == 0) return MOE_OK;
    MOE_CHECK(grad_logits && grad_scores && logits,
              "grad_logits, grad_scores and logits must not be NULL");
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
                       softmax_at(fp64, load_c(logits, logits_dtype, base + e), m, inv);
            dot = rnd(fp64, dot);
            for (int64_t e = 0; e < E; ++e) {
                double s = softmax_at(fp64, load_c(logits, logits_dtype, base + e), m, inv);
                double g = moe_load(grad_scores, sdt, base + e);
                moe_store(grad_logits, logits_dtype, base + e, rnd(fp64, s * rnd(fp64, g - dot)));
            }
            continue;
        }
        /* n = s / d with d = Σ s + 1e-20: dL/ds_j = g_j / d − Σ_e g_e s_e / d² */
        double sum = 0.0, gs = 0.0;
        for (int64_t e = 0; e < E; ++e) {
            double s = unnorm_score(fp64, score_function, load_c(logits, logits_dtype, base + e));
            sum += s;
            gs += moe_load(grad_scores, sdt, base + e) * s;
        }
        double d = rnd(fp64, rnd(fp64, sum) + rnd(fp64, 1e-20));
        double shared = rnd(fp64, -rnd(fp64, gs) / rnd(fp64, d * d));
        for (int64_t e = 0; e < E; ++e) {
            double x = load_c(logits, logits_dtype, base + e);
            double s = unnorm_score(fp64, score_function, x);
            double g = rnd(fp64, rnd(fp64, moe_load(grad_scores, sdt, base + e) / d) + shared);
            double gl;
            if (score_function == MOE_SCORE_SIGMOID) {
                gl = rnd(fp64, rnd(fp64, g * rnd(fp64, 1.0 - s)) * s);
            } else {
                double gu = rnd(fp64, g / rnd(fp64, 2.0 * s)); /* d sqrt */
                if (x > 20.0) {
                    gl = gu;
                } else {
                    double z = rnd(fp64, exp(x));
                    gl = rnd(fp64, gu * rnd(fp64, z / rnd(fp64, z + 1.0)));
                }
            }
            moe_store(grad_logits, logits_dtype, base + e, gl);
        }
    }
    return MOE_OK;
}

/* ---- switch load-balancing loss ------------------------------------------------------------ */

static moe_status_t check_switch(const void *probs, const float *tpe, const double *total,
                                 int64_t num_tokens, int64_t num_columns, moe_dtype_t dt,
                                 const moe_switch_aux_loss_params_t *p) {
    MOE_TRY(check_sizes(num_tokens, num_columns, "num_columns"));
    MOE_CHECK(moe_is_float_dtype(dt), "probs must be a float dtype, got %s", moe_dtype_name(dt));
    MOE_CHECK(p != NULL, "params must not be NULL");
    MOE_CHECK(p->topk >= 1, "topk must be >= 1, got %lld", (long long)p->topk);
    MOE_CHECK(p->num_experts >= 1, "num_experts must be >= 1, got %lld",
              (long long)p->num_experts);
    MOE_CHECK(isfinite(p->coeff), "coeff must be finite, got %g", p->coeff);
    MOE_CHECK(tpe && total && (probs || num_tokens == 0),
              "probs, tokens_per_expert and total_num_tokens must not be NULL");
    return MOE_OK;
}

/* E · coeff / (topk · total²): Megatron's scalar factor, in fp64. */
static inline double switch_factor(const moe_switch_aux_loss_params_t *p, double total) {
    return (double)p->num_experts * p->coeff / ((double)p->topk * total * total);
}

size_t moe_switch_aux_loss_workspace_size(int64_t num_tokens, int64_t num_columns) {
    (void)num_tokens;
    return (size_t)(num_columns > 0 ? num_columns : 0) * sizeof(double);
}

moe_status_t moe_switch_aux_loss_fwd(void *loss, const void *probs,
                                     const float *tokens_per_expert,
                                     const double *total_num_tokens, const uint8_t *padding_mask,
                                     int64_t num_tokens, int64_t num_columns,
                                     moe_dtype_t probs_dtype,
                                     const moe_switch_aux_loss_params_t *params, void *workspace,
                                     size_t workspace_bytes, void *stream) {
    (void)stream;
    moe_clear_error();
    MOE_TRY(check_switch(probs, tokens_per_expert, total_num_tokens, num_tokens, num_columns,
                         probs_dtype, params));
    MOE_CHECK(loss != NULL, "loss must not be NULL");
    MOE_TRY(check_workspace(workspace, workspace_bytes,
                            moe_switch_aux_loss_workspace_size(num_tokens, num_columns),
                            "moe_switch_aux_loss_workspace_size"));
    const int64_t C = num_columns;
    double *colsum = (double *)workspace;
    /* a thread owns whole columns; each column is summed in token order */
#pragma omp parallel for schedule(static)
    for (int64_t c = 0; c < C; ++c) {
        double acc = 0.0;
        for (int64_t t = 0; t < num_tokens; ++t)
            if (!is_pad(padding_mask, t)) acc += moe_load(probs, probs_dtype, t * C + c);
        colsum[c] = acc;
    }
    double total = 0.0;
    for (int64_t c = 0; c < C; ++c) total += colsum[c] * (double)tokens_per_expert[c];
    moe_store(loss, compute_dtype(probs_dtype), 0,
              total * switch_factor(params, *total_num_tokens));
    return MOE_OK;
}

moe_status_t moe_switch_aux_loss_bwd(void *grad_probs, const void *grad_loss,
                                     const float *tokens_per_expert,
                                     const double *total_num_tokens, const uint8_t *padding_mask,
                                     int64_t num_tokens, int64_t num_columns,
                                     moe_dtype_t probs_dtype,
                                     const moe_switch_aux_loss_params_t *params, void *workspace,
                                     size_t workspace_bytes, void *stream) {
    (void)stream;
    (void)workspace;
    (void)workspace_bytes;
    moe_clear_error();
    MOE_TRY(check_switch(grad_probs, tokens_per_expert, total_num_tokens, num_tokens, num_columns,
                         probs_dtype, params));
    MOE_CHECK(grad_loss != NULL, "grad_loss must not be NULL");
    const int64_t C = num_columns;
    const double g = moe_load(grad_loss, compute_dtype(probs_dtype), 0) *
                     switch_factor(params, *total_num_tokens);
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < num_tokens; ++t) {
        const int pad = is_pad(padding_mask, t);
        for (int64_t c = 0; c < C; ++c)
            moe_store(grad_probs, probs_dtype, t * C + c,
                      pad ? 0.0 : g * (double)tokens_per_expert[c]);
    }
    return MOE_OK;
}

/* ---- z-loss -------------------------------------------------------------------------------- */

/* logsumexp of row t in fp64 (±inf rows give ±inf, NaN propagates). */
static inline double row_lse(const void *logits, moe_dtype_t dt, int64_t base, int64_t n) {
    double m = -INFINITY;
    int has_nan = 0;
    for (int64_t e = 0; e < n; ++e) {
        double v = moe_load(logits, dt, base + e);
        has_nan |= v != v;
        m = v > m ? v : m;
    }
    if (has_nan) return NAN;
    if (isinf(m)) return m;
    double sum = 0.0;
    for (int64_t e = 0; e < n; ++e) sum += exp(moe_load(logits, dt, base + e) - m);
    return m + log(sum);
}

size_t moe_z_loss_workspace_size(int64_t num_tokens, int64_t num_experts) {
    (void)num_experts;
    return (size_t)(num_tokens > 0 ? num_tokens : 0) * sizeof(double);
}

static moe_status_t check_z(const void *logits, int64_t num_tokens, int64_t num_experts,
                            double coeff, moe_dtype_t dt) {
    MOE_TRY(check_sizes(num_tokens, num_experts, "num_experts"));
    MOE_CHECK(moe_is_float_dtype(dt), "logits must be a float dtype, got %s", moe_dtype_name(dt));
    MOE_CHECK(isfinite(coeff), "z_loss_coeff must be finite, got %g", coeff);
    MOE_CHECK(logits != NULL || num_tokens == 0, "logits must not be NULL");
    return MOE_OK;
}

/* The mean's divisor: valid tokens (at least 1) with a mask, all tokens without. */
static double z_divisor(const uint8_t *padding_mask, int64_t num_tokens) {
    if (padding_mask == NULL) return (double)num_tokens;
    int64_t n = 0;
    for (int64_t t = 0; t < num_tokens; ++t) n += padding_mask[t] == 0;
    return n > 0 ? (double)n : 1.0;
}

moe_status_t moe_z_loss_fwd(void *loss, const void *logits, const uint8_t *padding_mask,
                            int64_t num_tokens, int64_t num_experts, double coeff,
                            moe_dtype_t logits_dtype, void *workspace, size_t workspace_bytes,
                            void *stream) {
    (void)stream;
    moe_clear_error();
    MOE_TRY(check_z(logits, num_tokens, num_experts, coeff, logits_dtype));
    MOE_CHECK(loss != NULL, "loss must not be NULL");
    MOE_TRY(check_workspace(workspace, workspace_bytes,
                            moe_z_loss_workspace_size(num_tokens, num_experts),
                            "moe_z_loss_workspace_size"));
    double *z = (double *)workspace;
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < num_tokens; ++t) {
        double lse = row_lse(logits, logits_dtype, t * num_experts, num_experts);
        z[t] = is_pad(padding_mask, t) ? 0.0 : lse * lse;
    }
    double sum = 0.0;
    for (int64_t t = 0; t < num_tokens; ++t) sum += z[t];
    /* 0 / 0 = NaN for an empty unmasked batch, as torch.mean of nothing */
    moe_store(loss, compute_dtype(logits_dtype), 0,
              sum / z_divisor(padding_mask, num_tokens) * coeff);
    return MOE_OK;
}

moe_status_t moe_z_loss_bwd(void *grad_logits, const void *grad_loss, const void *logits,
                            const uint8_t *padding_mask, int64_t num_tokens, int64_t num_experts,
                            double coeff, moe_dtype_t logits_dtype, void *workspace,
                            size_t workspace_bytes, void *stream) {
    (void)stream;
    (void)workspace;
    (void)workspace_bytes;
    moe_clear_error();
    MOE_TRY(check_z(logits, num_tokens, num_experts, coeff, logits_dtype));
    MOE_CHECK(grad_logits != NULL && grad_loss != NULL,
              "grad_logits and grad_loss must not be NULL");
    if (num_tokens == 0) return MOE_OK;
    const double scale = moe_load(grad_loss, compute_dtype(logits_dtype), 0) * coeff * 2.0 /
                         z_divisor(padding_mask, num_tokens);
    const int64_t E = num_experts;
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < num_tokens; ++t) {
        const int64_t base = t * E;
        const int pad = is_pad(padding_mask, t);
        double lse = pad ? 0.0 : row_lse(logits, logits_dtype, base, E);
        for (int64_t e = 0; e < E; ++e) {
            /* d lse² / dx = 2 · lse · softmax(x) = 2 · lse · exp(x − lse) */
            double g = pad ? 0.0 : scale * lse * exp(moe_load(logits, logits_dtype, base + e) - lse);
            moe_store(grad_logits, logits_dtype, base + e, g);
        }
    }
    return MOE_OK;
}

/* ---- tokens per expert and the expert bias update ------------------------------------------ */

moe_status_t moe_tokens_per_expert_fwd(int64_t *counts, const uint8_t *routing_map,
                                       const uint8_t *padding_mask, int64_t num_tokens,
                                       int64_t num_experts, void *workspace,
                                       size_t workspace_bytes, void *stream) {
    (void)stream;
    (void)workspace;
    (void)workspace_bytes;
    moe_clear_error();
    MOE_TRY(check_sizes(num_tokens, num_experts, "num_experts"));
    MOE_CHECK(counts != NULL && (routing_map != NULL || num_tokens == 0),
              "counts and routing_map must not be NULL");
#pragma omp parallel for schedule(static)
    for (int64_t e = 0; e < num_experts; ++e) {
        int64_t n = 0;
        for (int64_t t = 0; t < num_tokens; ++t)
            n += routing_map[t * num_experts + e] != 0 && !is_pad(padding_mask, t);
        counts[e] = n;
    }
    return MOE_OK;
}

moe_status_t moe_expert_bias_update_fwd(float *updated_bias, const float *tokens_per_expert,
                                        const float *expert_bias, int64_t num_rows,
                                        int64_t num_experts, double update_rate, void *workspace,
                                        size_t workspace_bytes, void *stream) {
    (void)stream;
    (void)workspace;
    (void)workspace_bytes;
    moe_clear_error();
    MOE_CHECK(num_rows >= 0, "num_rows must be >= 0, got %lld", (long long)num_rows);
    MOE_CHECK(num_experts >= 1, "num_experts must be >= 1, got %lld", (long long)num_experts);
    MOE_CHECK(isfinite(update_rate), "expert_bias_update_rate must be finite, got %g",
              update_rate);
    if (num_rows == 0) return MOE_OK;
    MOE_CHECK(updated_bias && tokens_per_expert && expert_bias,
              "updated_bias, tokens_per_expert and expert_bias must not be NULL");
    /* Megatron: sign(sum/E − count) · rate, each an fp32 tensor op. Float arithmetic here rounds
     * at the same points; sign of a rounded difference is the sign of the exact one. */
    const float rate = (float)update_rate;
    for (int64_t l = 0; l < num_rows; ++l) {
        const float *c = tokens_per_expert + l * num_experts;
        double sum = 0.0;
        for (int64_t e = 0; e < num_experts; ++e) sum += (double)c[e];
        const float mean = (float)sum / (float)num_experts;
        for (int64_t e = 0; e < num_experts; ++e) {
            float off = mean - c[e];
            float sign = off > 0.0f ? 1.0f : off < 0.0f ? -1.0f : off == 0.0f ? 0.0f : off;
            float step = sign * rate;
            updated_bias[l * num_experts + e] = expert_bias[l * num_experts + e] + step;
        }
    }
    return MOE_OK;
}
