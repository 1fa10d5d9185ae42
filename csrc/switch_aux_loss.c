/*
 * switch_aux_loss.c: the Switch-Transformer load-balancing loss (Megatron's
 * switch_load_balancing_loss_func), forward and backward, on the CPU.
 *
 * loss = Σ_c (Σ_t probs[t, c]) · counts[c] · E · coeff / (topk · total²). The clever part is
 * how it stays deterministic without atomics: a thread owns whole columns and sums each in token
 * order into the workspace; the columns are then combined in index order, so the loss is bitwise
 * the same for any thread count. The total is read from device memory, never from the host.
 */
#include "balancing_math.h"

size_t moe_switch_aux_loss_workspace_size(int64_t num_tokens, int64_t num_columns) {
    (void)num_tokens;
    if (num_columns <= 0) return 0;
    const size_t bytes = moe_checked_bytes(num_columns, (int64_t)sizeof(double));
    if (bytes == MOE_SIZE_OVERFLOW)
        return moe_fail_size("moe_switch_aux_loss_workspace_size: num_columns=%lld fp64 words "
                             "overflow int64 bytes", (long long)num_columns);
    return bytes;
}

moe_status_t moe_switch_aux_loss_check(const void *out, const void *probs_or_grad,
                                       const float *tokens_per_expert,
                                       const double *total_num_tokens, int64_t num_tokens,
                                       int64_t num_columns, moe_dtype_t probs_dtype,
                                       const moe_switch_aux_loss_params_t *params,
                                       const char *out_name) {
    const moe_switch_aux_loss_params_t *p = params;
    MOE_TRY(check_sizes(num_tokens, num_columns, "num_columns"));
    MOE_CHECK(moe_is_float_dtype(probs_dtype), "probs must be a float dtype, got %s",
              moe_dtype_name(probs_dtype));
    MOE_CHECK(p != NULL, "params must not be NULL");
    MOE_CHECK(p->topk >= 1, "topk must be >= 1, got %lld", (long long)p->topk);
    MOE_CHECK(p->num_experts >= 1, "num_experts must be >= 1, got %lld",
              (long long)p->num_experts);
    MOE_CHECK(isfinite(p->coeff), "coeff must be finite, got %g", p->coeff);
    MOE_CHECK(tokens_per_expert && total_num_tokens && (probs_or_grad || num_tokens == 0),
              "probs, tokens_per_expert and total_num_tokens must not be NULL");
    MOE_CHECK(out != NULL, "%s must not be NULL", out_name);
    return MOE_OK;
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
    MOE_TRY(moe_switch_aux_loss_check(loss, probs, tokens_per_expert, total_num_tokens,
                                      num_tokens, num_columns, probs_dtype, params, "loss"));
    MOE_CHECK_WORKSPACE(moe_switch_aux_loss_workspace_size, num_tokens, num_columns);
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
              total * moe_switch_factor(params->num_experts, params->topk, params->coeff,
                                       *total_num_tokens));
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
    MOE_TRY(moe_switch_aux_loss_check(grad_loss, grad_probs, tokens_per_expert, total_num_tokens,
                                      num_tokens, num_columns, probs_dtype, params, "grad_loss"));
    const int64_t C = num_columns;
    const double g = moe_load(grad_loss, compute_dtype(probs_dtype), 0) *
                     moe_switch_factor(params->num_experts, params->topk, params->coeff,
                                       *total_num_tokens);
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < num_tokens; ++t) {
        const int pad = is_pad(padding_mask, t);
        for (int64_t c = 0; c < C; ++c)
            moe_store(grad_probs, probs_dtype, t * C + c,
                      pad ? 0.0 : g * (double)tokens_per_expert[c]);
    }
    return MOE_OK;
}

