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

static inline moe_status_t check_sizes(int64_t num_tokens, int64_t num_experts, const char *cols) {
    MOE_CHECK(num_tokens >= 0, "num_tokens must be >= 0, got %lld", (long long)num_tokens);
    MOE_CHECK(num_experts >= 1, "%s must be >= 1, got %lld", cols, (long long)num_experts);
    return MOE_OK;
}

static inline moe_status_t check_score_function(moe_score_function_t sf) {
    MOE_CHECK(sf == MOE_SCORE_SOFTMAX || sf == MOE_SCORE_SIGMOID || sf == MOE_SCORE_SQRTSOFTPLUS,
              "score_function must be softmax (0), sigmoid (1) or sqrtsoftplus (2), got %d",
              (int)sf);
    return MOE_OK;
}

static inline moe_status_t check_workspace(const void *workspace, size_t have, size_t need,
                                    const char *fn) {
    MOE_CHECK(need == 0 || (workspace != NULL && have >= need),
              "workspace too small: %zu bytes, need %zu (%s)", have, need, fn);
    return MOE_OK;
}

#endif /* MOE_CORE_BALANCING_MATH_H_ */
