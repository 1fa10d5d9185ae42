/*
 * unpermute.c: the combine, rows of the expert-grouped layout → tokens, and its backward.
 *
 * A gather-sum, not a scatter-add: the token → rows map (layout.c) lists each token's rows in
 * ascending order, one thread owns each output token and adds its rows in that order. The result
 * is the same run after run and needs no atomics. Each weighted row is rounded to the promoted
 * dtype before the sum, exactly where Megatron materialises `permuted_tokens * probs`, and the sum
 * of two rows in fp32 rounds once, as torch's half-precision add does: so for topk <= 2 the combine
 * is bitwise Megatron's, and for more rows it is at least as accurate.
 */
#include "layout.h"

/* The sizes, the probs' dtype and expert_offsets of both directions. */
static moe_status_t check_probs(const void *probs, const int64_t *expert_offsets,
                                int64_t num_tokens, int64_t hidden, int64_t num_experts,
                                int64_t num_rows, moe_dtype_t dtype, moe_dtype_t probs_dtype) {
    MOE_TRY(moe_layout_check_sizes(num_tokens, hidden, num_experts, num_rows, dtype,
                                   "permuted_tokens"));
    MOE_CHECK(!probs || moe_is_float_dtype(probs_dtype), "probs must be a float dtype, got %s",
              moe_dtype_name(probs_dtype));
    MOE_CHECK(!probs || expert_offsets, "expert_offsets must not be NULL when probs are given");
    return MOE_OK;
}

moe_status_t moe_unpermute_fwd_check(const void *output, const void *permuted_tokens,
                                     const void *probs, const int64_t *expert_offsets,
                                     int64_t num_tokens, int64_t hidden, int64_t num_experts,
                                     int64_t num_rows, moe_dtype_t dtype,
                                     moe_dtype_t probs_dtype) {
    MOE_TRY(check_probs(probs, expert_offsets, num_tokens, hidden, num_experts, num_rows, dtype,
                        probs_dtype));
    MOE_CHECK(num_tokens == 0 || output, "output must not be NULL");
    MOE_CHECK(num_rows == 0 || permuted_tokens, "permuted_tokens must not be NULL");
    return MOE_OK;
}

moe_status_t moe_unpermute_bwd_check(const void *grad_permuted_tokens, const void *grad_probs,
                                     const void *grad_output, const void *permuted_tokens,
                                     const void *probs, const int64_t *expert_offsets,
                                     int64_t num_tokens, int64_t hidden, int64_t num_experts,
                                     int64_t num_rows, moe_dtype_t dtype,
                                     moe_dtype_t probs_dtype) {
    MOE_TRY(check_probs(probs, expert_offsets, num_tokens, hidden, num_experts, num_rows, dtype,
                        probs_dtype));
    MOE_CHECK(!grad_probs || probs, "grad_probs needs probs (the forward had none)");
    MOE_CHECK(num_rows == 0 || grad_permuted_tokens, "grad_permuted_tokens must not be NULL");
    MOE_CHECK(num_tokens == 0 || grad_output, "grad_output must not be NULL");
    MOE_CHECK(!grad_probs || num_rows == 0 || permuted_tokens,
              "permuted_tokens must not be NULL when grad_probs is requested");
    return MOE_OK;
}

/* The values of the host buffers, after the shared check: the CUDA entry points cannot read
 * them without a sync. */
static moe_status_t check_values(const void *probs, const int64_t *sorted_indices,
                                 const int64_t *expert_offsets, int64_t num_tokens,
                                 int64_t num_experts, int64_t num_rows) {
    MOE_TRY(moe_check_sorted_indices(sorted_indices, num_tokens, num_rows));
    if (probs)
        MOE_TRY(moe_check_expert_offsets(expert_offsets, num_experts, sorted_indices, num_rows));
    return MOE_OK;
}

moe_status_t moe_unpermute_fwd(void *output, const void *permuted_tokens,
                               const int64_t *sorted_indices, const void *probs,
                               const int64_t *expert_offsets, int64_t num_tokens, int64_t hidden,
                               int64_t num_experts, int64_t num_rows, moe_dtype_t dtype,
                               moe_dtype_t probs_dtype, void *workspace, size_t workspace_bytes,
                               void *stream) {
    (void)stream;
    moe_clear_error();
    MOE_TRY(moe_unpermute_fwd_check(output, permuted_tokens, probs, expert_offsets, num_tokens,
                                    hidden, num_experts, num_rows, dtype, probs_dtype));
    MOE_TRY(check_values(probs, sorted_indices, expert_offsets, num_tokens, num_experts,
                         num_rows));
    moe_token_rows_t map;
    MOE_TRY(moe_token_rows_build(&map, sorted_indices, num_tokens, num_rows, workspace,
                                 workspace_bytes));
    const size_t esize = moe_dtype_size(dtype);

#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < num_tokens; ++t)
        moe_gather_sum_token(moe_row_ptr(output, t, hidden, esize), permuted_tokens,
                             map.rows + map.start[t], map.start[t + 1] - map.start[t], hidden,
                             dtype, probs, probs_dtype, expert_offsets, num_experts, t);
    return MOE_OK;
}

moe_status_t moe_unpermute_bwd(void *grad_permuted_tokens, void *grad_probs,
                               const void *grad_output, const void *permuted_tokens,
                               const int64_t *sorted_indices, const void *probs,
                               const int64_t *expert_offsets, int64_t num_tokens, int64_t hidden,
                               int64_t num_experts, int64_t num_rows, moe_dtype_t dtype,
                               moe_dtype_t probs_dtype, void *workspace, size_t workspace_bytes,
                               void *stream) {
    (void)stream;
    moe_clear_error();
    MOE_TRY(moe_unpermute_bwd_check(grad_permuted_tokens, grad_probs, grad_output,
                                    permuted_tokens, probs, expert_offsets, num_tokens, hidden,
                                    num_experts, num_rows, dtype, probs_dtype));
    MOE_TRY(check_values(probs, sorted_indices, expert_offsets, num_tokens, num_experts,
                         num_rows));
    moe_token_rows_t map;
    MOE_TRY(moe_token_rows_build(&map, sorted_indices, num_tokens, num_rows, workspace,
                                 workspace_bytes));
    const size_t esize = moe_dtype_size(dtype);
    const moe_dtype_t pd = probs ? moe_promote_dtype(dtype, probs_dtype) : dtype;
    const moe_dtype_t acc = moe_acc_dtype(pd);

    /* padding rows get no gradient */
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < num_rows; ++r)
        if (sorted_indices[r] < 0)
            memset(moe_row_ptr(grad_permuted_tokens, r, hidden, esize), 0, (size_t)hidden * esize);

    /* one thread per token: its rows' gradients and its row of grad_probs */
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < num_tokens; ++t) {
        const int64_t *rows = map.rows + map.start[t];
        const int64_t n = map.start[t + 1] - map.start[t];
        const char *g = moe_row_ptr(grad_output, t, hidden, esize);
        if (grad_probs)
            for (int64_t e = 0; e < num_experts; ++e)
                moe_store(grad_probs, probs_dtype, t * num_experts + e, 0.0);
        for (int64_t i = 0; i < n; ++i) {
            const int64_t r = rows[i];
            char *gx = moe_row_ptr(grad_permuted_tokens, r, hidden, esize);
            if (!probs) {
                memcpy(gx, g, (size_t)hidden * esize);
                continue;
            }
            const int64_t at = t * num_experts + moe_row_expert(expert_offsets, num_experts, r);
            const double w = moe_load(probs, probs_dtype, at);
            const char *x = moe_row_ptr(permuted_tokens, r, hidden, esize);
            double dw = 0.0;
            for (int64_t h = 0; h < hidden; ++h) {
                const double gh = moe_load(g, dtype, h);
                moe_store(gx, dtype, h, moe_round_to(pd, gh * w));
                if (grad_probs) dw = moe_round_to(acc, dw + moe_round_to(pd, gh * moe_load(x, dtype, h)));
            }
            if (grad_probs)
                moe_store(grad_probs, probs_dtype, at,
                          moe_load(grad_probs, probs_dtype, at) + moe_round_to(pd, dw));
        }
    }
    return MOE_OK;
}
