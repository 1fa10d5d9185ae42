/*
 * balancing_math.h: small helpers shared by the load-balancing kernels (aux_loss_scores.c,
 * switch_aux_loss.c, z_loss.c, tokens_per_expert.c, expert_bias_update.c).
 *
 * The one idea: a kernel that follows Megatron's PyTorch code rounds every value Megatron
 * materialises as a tensor to that tensor's precision, and `rnd` is that rounding: fp32, or
 * fp64 when the input is fp64 (so fp64 gradcheck is meaningful). Sums are accumulated in fp64.
 * The per-element helpers are MOE_HD: the CUDA kernels (csrc/cuda/) call the same functions, so
 * both devices round at the same points by construction.
 */
#ifndef MOE_CORE_BALANCING_MATH_H_
#define MOE_CORE_BALANCING_MATH_H_

#include "common.h"

/* Rounds to the compute precision: fp64 for fp64 inputs, else fp32. */
MOE_HD static inline double rnd(int fp64, double v) { return fp64 ? v : (double)(float)v; }

/* An input element as the compute-precision tensor Megatron makes of it (`x.float()`). */
MOE_HD static inline double load_c(const void *p, moe_dtype_t dt, int64_t i) {
    return rnd(dt == MOE_DTYPE_FP64, moe_load(p, dt, i));
}

MOE_HD static inline moe_dtype_t compute_dtype(moe_dtype_t dt) {
    return dt == MOE_DTYPE_FP64 ? MOE_DTYPE_FP64 : MOE_DTYPE_FP32;
}

MOE_HD static inline int is_pad(const uint8_t *padding_mask, int64_t t) {
    return padding_mask != NULL && padding_mask[t] != 0;
}

/* stats[0..2] of routing_metrics from the integer counts: max/mean load, coefficient of
 * variation, load entropy (all 0 when nothing is routed). Counts are exact, the loops run in
 * expert order: the same bits on the CPU and on the one CUDA thread that calls it. */
MOE_HD static inline void moe_load_stats(const int64_t *tokens_per_expert, int64_t E,
                                         float *stats) {
    int64_t total = 0, max = 0;
    for (int64_t e = 0; e < E; ++e) {
        total += tokens_per_expert[e];
        max = tokens_per_expert[e] > max ? tokens_per_expert[e] : max;
    }
    if (total == 0) {
        stats[0] = stats[1] = stats[2] = 0.0f;
        return;
    }
    const double mean = (double)total / (double)E;
    double var = 0.0, ent = 0.0;
    for (int64_t e = 0; e < E; ++e) {
        const double n = (double)tokens_per_expert[e], d = n - mean;
        var += d * d;
        if (n > 0) ent -= (n / (double)total) * log(n / (double)total);
    }
    stats[0] = (float)((double)max / mean);
    stats[1] = (float)(sqrt(var / (double)E) / mean);
    stats[2] = (float)ent;
}

/* |A ∩ B| of two rows of k distinct expert ids: the top-k overlap of one token, an exact integer
 * (the CPU loop and the CUDA thread of a token count alike). */
MOE_HD static inline int64_t moe_topk_row_overlap(const int64_t *a, const int64_t *b, int64_t k) {
    int64_t shared = 0;
    for (int64_t i = 0; i < k; ++i)
        for (int64_t j = 0; j < k; ++j)
            if (a[i] == b[j]) {
                ++shared;
                break;
            }
    return shared;
}

/* sigmoid or sqrt(softplus) of one logit at compute precision (softplus: beta 1, threshold 20). */
MOE_HD static inline double moe_bal_unnorm_score(int fp64, moe_score_function_t sf, double x) {
    if (sf == MOE_SCORE_SIGMOID) return rnd(fp64, 1.0 / (1.0 + exp(-x)));
    double sp = rnd(fp64, x > 20.0 ? x : log1p(exp(x)));
    return rnd(fp64, sqrt(sp));
}

/* One softmax value from the row's max m and inv = 1/Σ exp(x − m), each step rounded. */
MOE_HD static inline double moe_bal_softmax_at(int fp64, double x, double m, double inv) {
    return rnd(fp64, rnd(fp64, exp(rnd(fp64, x - m))) * inv);
}

/* d score / d logit applied to g, for sigmoid or sqrt(softplus) at logit x with score s: the
 * chain of autograd's backward kernels, each step rounded where Megatron's tensors are. */
MOE_HD static inline double moe_bal_unnorm_score_bwd(int fp64, moe_score_function_t sf, double x,
                                                     double s, double g) {
    if (sf == MOE_SCORE_SIGMOID) return rnd(fp64, rnd(fp64, g * rnd(fp64, 1.0 - s)) * s);
    const double gu = rnd(fp64, g / rnd(fp64, 2.0 * s)); /* d sqrt */
    if (x > 20.0) return gu;
    const double z = rnd(fp64, exp(x));
    return rnd(fp64, gu * rnd(fp64, z / rnd(fp64, z + 1.0)));
}

/* E · coeff / (topk · total²): the switch loss's scalar factor, in fp64. */
MOE_HD static inline double moe_switch_factor(int64_t num_experts, int64_t topk, double coeff,
                                              double total) {
    return (double)num_experts * coeff / ((double)topk * total * total);
}

static inline moe_status_t check_sizes(int64_t num_tokens, int64_t num_experts, const char *cols) {
    MOE_CHECK(num_tokens >= 0, "num_tokens must be >= 0, got %lld", (long long)num_tokens);
    MOE_CHECK(num_experts >= 1, "%s must be >= 1, got %lld", cols, (long long)num_experts);
    return moe_check_mul(num_tokens, "num_tokens", num_experts, cols);
}

#endif /* MOE_CORE_BALANCING_MATH_H_ */
