/*
 * z_loss.c: the router z-loss of ST-MoE (Megatron's z_loss_func), forward and backward, on the
 * CPU: coeff · mean over unpadded tokens of logsumexp(logits[t])².
 *
 * The clever part: each token's lse² is parked in the workspace by the parallel loop and the
 * mean is summed afterwards in token order, so the loss does not depend on the thread count;
 * logsumexp is computed in fp64 with the max subtracted, so half-precision logits lose nothing.
 */
#include "balancing_math.h"

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
    if (num_tokens <= 0) return 0;
    const size_t bytes = moe_checked_bytes(num_tokens, (int64_t)sizeof(double));
    if (bytes == MOE_SIZE_OVERFLOW)
        return moe_fail_size("moe_z_loss_workspace_size: num_tokens=%lld fp64 words overflow "
                             "int64 bytes", (long long)num_tokens);
    return bytes;
}

moe_status_t moe_z_loss_check(const void *logits, int64_t num_tokens, int64_t num_experts,
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
    MOE_TRY(moe_z_loss_check(logits, num_tokens, num_experts, coeff, logits_dtype));
    MOE_CHECK(loss != NULL, "loss must not be NULL");
    MOE_CHECK_WORKSPACE(moe_z_loss_workspace_size, num_tokens, num_experts);
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
    MOE_TRY(moe_z_loss_check(logits, num_tokens, num_experts, coeff, logits_dtype));
    MOE_CHECK(grad_loss != NULL, "grad_loss must not be NULL");
    /* an empty grad_logits may have no storage: 0 tokens have nothing to write */
    if (num_tokens == 0) return MOE_OK;
    MOE_CHECK(grad_logits != NULL, "grad_logits must not be NULL");
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
            const double x = moe_load(logits, logits_dtype, base + e);
            double g = pad ? 0.0 : scale * lse * exp(x - lse);
            moe_store(grad_logits, logits_dtype, base + e, g);
        }
    }
    return MOE_OK;
}

