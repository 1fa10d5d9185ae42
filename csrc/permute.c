/*
 * permute.c: tokens → the expert-grouped row layout (the forward; the backward is permute_bwd.c).
 *
 * The layout is planned per expert before any data moves: a count per expert column, block sizes
 * (padded to align_size or fixed at the capacity), an exclusive scan into expert_offsets. Then each
 * expert fills its own block by one ascending walk of its column, so the row order (expert
 * ascending, token ascending) is Megatron's argsort order without sorting anything, and every
 * output row has one writer.
 */
#include "layout.h"

/* x rounded up to a multiple of m (m <= 1: x itself); 1 when that overflows int64. */
static int round_up_checked(int64_t x, int64_t m, int64_t *out) {
    if (m <= 1) return *out = x, 0;
    if (moe_checked_add_i64(x, m - 1, out)) return 1;
    return moe_checked_mul_i64(*out / m, m, out);
}

/* round_up for a block that is cut off at the row bound anyway: saturates instead of failing. */
static int64_t round_up_sat(int64_t x, int64_t m) {
    int64_t r;
    return round_up_checked(x, m, &r) ? INT64_MAX : r;
}

int64_t moe_permute_num_rows(int64_t num_tokens, int64_t num_experts,
                             const moe_permute_params_t *p) {
    if (!p) return moe_fail(MOE_ERR_INVALID_ARGUMENT, "params must not be NULL"), -1;
    if (num_tokens < 0)
        return moe_fail(MOE_ERR_INVALID_ARGUMENT, "num_tokens must be >= 0, got %lld",
                        (long long)num_tokens), -1;
    if (num_experts < 1)
        return moe_fail(MOE_ERR_INVALID_ARGUMENT, "num_experts must be >= 1, got %lld",
                        (long long)num_experts), -1;
    if (p->num_out_tokens < 0)
        return moe_fail(MOE_ERR_INVALID_ARGUMENT, "num_out_tokens must be >= 0, got %lld",
                        (long long)p->num_out_tokens), -1;
    if (p->align_size < 0)
        return moe_fail(MOE_ERR_INVALID_ARGUMENT, "align_size must be >= 0, got %lld",
                        (long long)p->align_size), -1;
    int64_t rows, block;
    if (p->drop_and_pad) {
        const int64_t capacity = p->num_out_tokens / num_experts;
        if (round_up_checked(capacity, p->align_size, &block) ||
            moe_checked_mul_i64(num_experts, block, &rows))
            return moe_fail(MOE_ERR_INVALID_ARGUMENT,
                            "drop_and_pad: num_experts=%lld blocks of capacity=%lld "
                            "(num_out_tokens=%lld) rounded up to align_size=%lld overflow int64 "
                            "rows", (long long)num_experts, (long long)capacity,
                            (long long)p->num_out_tokens, (long long)p->align_size), -1;
        return rows;
    }
    if (p->align_size <= 1) return p->num_out_tokens;
    if (moe_checked_mul_i64(num_experts, p->align_size - 1, &block) ||
        moe_checked_add_i64(p->num_out_tokens, block, &rows))
        return moe_fail(MOE_ERR_INVALID_ARGUMENT,
                        "align_size=%lld overflows the row bound num_out_tokens=%lld + "
                        "num_experts=%lld * (align_size - 1)", (long long)p->align_size,
                        (long long)p->num_out_tokens, (long long)num_experts), -1;
    return rows;
}

size_t moe_permute_workspace_size(int64_t num_tokens, int64_t num_experts,
                                  const moe_permute_params_t *params) {
    (void)num_tokens, (void)num_experts, (void)params;
    return 0; /* the plan lives in tokens_per_expert and expert_offsets */
}

moe_status_t moe_permute_check_params(int64_t num_tokens, int64_t hidden, int64_t num_experts,
                                      const moe_permute_params_t *p, int64_t *num_rows) {
    MOE_CHECK(p != NULL, "params must not be NULL");
    MOE_CHECK(num_tokens >= 0, "num_tokens must be >= 0, got %lld", (long long)num_tokens);
    MOE_CHECK(hidden >= 0, "hidden must be >= 0 (0: the layout only, no rows), got %lld",
              (long long)hidden);
    MOE_CHECK(num_experts >= 1, "num_experts must be >= 1, got %lld", (long long)num_experts);
    MOE_CHECK(p->num_out_tokens >= 0, "num_out_tokens must be >= 0, got %lld",
              (long long)p->num_out_tokens);
    MOE_CHECK(p->align_size >= 0, "align_size must be >= 0, got %lld", (long long)p->align_size);
    const int64_t R = moe_permute_num_rows(num_tokens, num_experts, p);
    if (R < 0) return MOE_ERR_INVALID_ARGUMENT; /* moe_permute_num_rows said why */
    MOE_TRY(moe_check_mul(num_tokens, "num_tokens", hidden, "hidden"));
    MOE_TRY(moe_check_mul(num_tokens, "num_tokens", num_experts, "num_experts"));
    MOE_TRY(moe_check_mul(R, "num_rows", hidden, "hidden"));
    *num_rows = R;
    return MOE_OK;
}

moe_status_t moe_permute_fwd_check(const void *permuted_tokens, const void *permuted_probs,
                                   const int64_t *sorted_indices, const int64_t *expert_offsets,
                                   const int64_t *tokens_per_expert, const void *tokens,
                                   const uint8_t *routing_map, const void *probs,
                                   int64_t num_tokens, int64_t hidden, int64_t num_experts,
                                   moe_dtype_t dtype, moe_dtype_t probs_dtype,
                                   const moe_permute_params_t *params, int64_t *num_rows) {
    int64_t R;
    MOE_TRY(moe_permute_check_params(num_tokens, hidden, num_experts, params, &R));
    /* hidden = 0 is the layout-only mode: no rows in, none out, so both row buffers are NULL */
    const int layout_only = hidden == 0;
    MOE_CHECK(!layout_only || !permuted_tokens,
              "permuted_tokens must be NULL with hidden = 0 (the layout only: no row is moved)");
    MOE_CHECK(!layout_only || !tokens,
              "tokens must be NULL with hidden = 0 (the layout only: no row is read)");
    MOE_CHECK(layout_only || moe_dtype_size(dtype) > 0, "tokens has an unknown dtype (%d)",
              (int)dtype);
    MOE_CHECK(!permuted_probs || moe_is_float_dtype(probs_dtype),
              "probs must be a float dtype, got %s", moe_dtype_name(probs_dtype));
    MOE_CHECK(!permuted_probs || num_tokens == 0 || probs,
              "probs must not be NULL when permuted_probs is requested");
    MOE_CHECK(expert_offsets && tokens_per_expert,
              "expert_offsets and tokens_per_expert must not be NULL");
    MOE_CHECK(layout_only || R == 0 || permuted_tokens,
              "permuted_tokens must not be NULL with hidden=%lld (NULL, with tokens NULL, needs "
              "hidden = 0: the layout only)", (long long)hidden);
    MOE_CHECK(R == 0 || sorted_indices, "sorted_indices must not be NULL");
    MOE_CHECK(num_tokens == 0 || routing_map, "routing_map must not be NULL");
    MOE_CHECK(layout_only || num_tokens == 0 || tokens,
              "tokens must not be NULL with hidden=%lld (NULL, with permuted_tokens NULL, needs "
              "hidden = 0: the layout only)", (long long)hidden);
    *num_rows = R;
    return MOE_OK;
}

moe_status_t moe_permute_fwd(void *permuted_tokens, void *permuted_probs, int64_t *sorted_indices,
                             int64_t *expert_offsets, int64_t *tokens_per_expert,
                             const void *tokens, const uint8_t *routing_map, const void *probs,
                             int64_t num_tokens, int64_t hidden, int64_t num_experts,
                             moe_dtype_t dtype, moe_dtype_t probs_dtype,
                             const moe_permute_params_t *params, void *workspace,
                             size_t workspace_bytes, void *stream) {
    (void)workspace, (void)workspace_bytes, (void)stream;
    moe_clear_error();
    int64_t R;
    MOE_TRY(moe_permute_fwd_check(permuted_tokens, permuted_probs, sorted_indices, expert_offsets,
                                  tokens_per_expert, tokens, routing_map, probs, num_tokens,
                                  hidden, num_experts, dtype, probs_dtype, params, &R));
    const size_t esize = moe_dtype_size(dtype);
    const int64_t T = num_tokens, E = num_experts;
    const int dap = params->drop_and_pad != 0;
    const int64_t align = params->align_size > 1 ? params->align_size : 1;
    const int64_t capacity = dap ? params->num_out_tokens / E : 0;

    /* 1. plan: rows each expert takes (its block), cut off at the row bound R */
#pragma omp parallel for schedule(static)
    for (int64_t e = 0; e < E; ++e) {
        int64_t count = 0;
        for (int64_t t = 0; t < T; ++t) count += routing_map[t * E + e] != 0;
        tokens_per_expert[e] = round_up_sat(dap ? capacity : count, align); /* cut to R below */
    }
    expert_offsets[0] = 0;
    for (int64_t e = 0; e < E; ++e) {
        const int64_t room = R - expert_offsets[e];
        if (tokens_per_expert[e] > room) tokens_per_expert[e] = room;
        expert_offsets[e + 1] = expert_offsets[e] + tokens_per_expert[e];
    }

    /* 2. fill each block's indices and probs: routed tokens ascending; drop_and_pad then takes
     *    unrouted tokens ascending (Megatron's stable argsort of the column); -1 for the rest */
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t e = 0; e < E; ++e) {
        const int64_t begin = expert_offsets[e], n = tokens_per_expert[e];
        const int64_t real = dap ? (capacity < T ? capacity : T) : n;
        int64_t j = 0;
        for (int64_t t = 0; t < T && j < real; ++t)
            if (routing_map[t * E + e]) sorted_indices[begin + j++] = t;
        for (int64_t t = 0; dap && t < T && j < real; ++t)
            if (!routing_map[t * E + e]) sorted_indices[begin + j++] = t;
        for (; j < n; ++j) sorted_indices[begin + j] = -1;
        if (permuted_probs)
            for (j = 0; j < n; ++j) {
                const int64_t t = sorted_indices[begin + j];
                moe_store(permuted_probs, probs_dtype, begin + j,
                          t >= 0 ? moe_load(probs, probs_dtype, t * E + e) : 0.0);
            }
    }
    for (int64_t r = expert_offsets[E]; r < R; ++r) {
        sorted_indices[r] = -1;
        if (permuted_probs) moe_store(permuted_probs, probs_dtype, r, 0.0);
    }

    if (hidden == 0) return MOE_OK; /* the layout only: no row to move */

    /* 3. move the rows (int64 offsets: R × hidden passes 2^31) */
    const size_t row_bytes = (size_t)hidden * esize;
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < R; ++r) {
        char *dst = moe_row_ptr(permuted_tokens, r, hidden, esize);
        const int64_t t = sorted_indices[r];
        if (t >= 0) memcpy(dst, moe_row_ptr(tokens, t, hidden, esize), row_bytes);
        else memset(dst, 0, row_bytes);
    }
    return MOE_OK;
}
