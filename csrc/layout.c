/*
 * layout.c: the token → rows map that turns unpermute into a gather, and argument checks shared
 * by the layout kernels.
 *
 * Why a counting sort: permute hands over Megatron's sorted_indices (row → token). Inverting it
 * with one pass of counts, an exclusive scan and one in-order fill lists each token's rows in
 * ascending row order, so the sum over them has a fixed order and one writer per output token:
 * deterministic, no atomics, and the same plan works on the GPU with a stable scan.
 */
#include "layout.h"

moe_status_t moe_token_rows_build(moe_token_rows_t *out, const int64_t *sorted_indices,
                                  int64_t num_tokens, int64_t num_rows, void *workspace,
                                  size_t workspace_bytes) {
    MOE_CHECK_WORKSPACE(moe_unpermute_workspace_size, num_tokens, num_rows);
    int64_t *start = (int64_t *)workspace;
    int64_t *rows = start + num_tokens + 1;
    for (int64_t t = 0; t <= num_tokens; ++t) start[t] = 0;
    for (int64_t r = 0; r < num_rows; ++r) {
        const int64_t t = sorted_indices[r]; /* in [-1, num_tokens): moe_check_sorted_indices */
        if (t >= 0) ++start[t + 1];
    }
    for (int64_t t = 0; t < num_tokens; ++t) start[t + 1] += start[t];
    /* Fill in ascending row order; `start[t]` serves as token t's cursor and is restored after. */
    for (int64_t r = 0; r < num_rows; ++r) {
        const int64_t t = sorted_indices[r];
        if (t >= 0) rows[start[t]++] = r;
    }
    for (int64_t t = num_tokens; t > 0; --t) start[t] = start[t - 1];
    start[0] = 0;
    out->start = start;
    out->rows = rows;
    return MOE_OK;
}

size_t moe_unpermute_workspace_size(int64_t num_tokens, int64_t num_rows) {
    if (num_tokens < 0 || num_rows < 0) return 0;
    int64_t words;
    size_t bytes = MOE_SIZE_OVERFLOW;
    if (!moe_checked_add_i64(num_tokens, 1, &words) &&
        !moe_checked_add_i64(words, num_rows, &words))
        bytes = moe_checked_bytes(words, (int64_t)sizeof(int64_t));
    if (bytes == MOE_SIZE_OVERFLOW)
        return moe_fail_size("moe_unpermute_workspace_size: num_tokens=%lld + 1 + num_rows=%lld "
                             "int64 words overflow int64 bytes",
                             (long long)num_tokens, (long long)num_rows);
    return bytes;
}

moe_status_t moe_layout_check_sizes(int64_t num_tokens, int64_t hidden, int64_t num_experts,
                                    int64_t num_rows, moe_dtype_t dtype, const char *what) {
    MOE_CHECK(num_tokens >= 0, "num_tokens must be >= 0, got %lld", (long long)num_tokens);
    MOE_CHECK(hidden >= 1, "hidden must be >= 1, got %lld", (long long)hidden);
    MOE_CHECK(num_experts >= 1, "num_experts must be >= 1, got %lld", (long long)num_experts);
    MOE_CHECK(num_rows >= 0, "num_rows must be >= 0, got %lld", (long long)num_rows);
    MOE_CHECK(moe_is_float_dtype(dtype), "%s must be a float dtype, got %s", what,
              moe_dtype_name(dtype));
    MOE_TRY(moe_check_mul(num_tokens, "num_tokens", hidden, "hidden"));
    MOE_TRY(moe_check_mul(num_rows, "num_rows", hidden, "hidden"));
    MOE_TRY(moe_check_mul(num_tokens, "num_tokens", num_experts, "num_experts"));
    return MOE_OK;
}

moe_status_t moe_check_sorted_indices(const int64_t *sorted_indices, int64_t num_tokens,
                                      int64_t num_rows) {
    MOE_CHECK(num_rows == 0 || sorted_indices, "sorted_indices must not be NULL");
    for (int64_t r = 0; r < num_rows; ++r)
        MOE_CHECK(sorted_indices[r] >= -1 && sorted_indices[r] < num_tokens,
                  "sorted_indices[%lld] = %lld is outside [-1, num_tokens=%lld)", (long long)r,
                  (long long)sorted_indices[r], (long long)num_tokens);
    return MOE_OK;
}

moe_status_t moe_check_expert_offsets(const int64_t *expert_offsets, int64_t num_experts,
                                      const int64_t *sorted_indices, int64_t num_rows) {
    MOE_CHECK(expert_offsets, "expert_offsets must not be NULL when probs are given");
    MOE_CHECK(expert_offsets[0] >= 0, "expert_offsets[0] must be >= 0, got %lld",
              (long long)expert_offsets[0]);
    /* the blocks describe rows of this buffer: one past its end names rows that do not exist */
    MOE_CHECK(expert_offsets[num_experts] <= num_rows,
              "expert_offsets[num_experts=%lld] = %lld is past the rows of the permuted buffer "
              "(num_rows=%lld)", (long long)num_experts, (long long)expert_offsets[num_experts],
              (long long)num_rows);
    for (int64_t e = 0; e < num_experts; ++e)
        MOE_CHECK(expert_offsets[e + 1] >= expert_offsets[e],
                  "expert_offsets must be non-decreasing, got expert_offsets[%lld] = %lld > "
                  "expert_offsets[%lld] = %lld",
                  (long long)e, (long long)expert_offsets[e], (long long)(e + 1),
                  (long long)expert_offsets[e + 1]);
    for (int64_t r = 0; r < num_rows; ++r)
        MOE_CHECK(sorted_indices[r] < 0 ||
                      (r >= expert_offsets[0] && r < expert_offsets[num_experts]),
                  "row %lld has token %lld but lies outside every expert block of "
                  "expert_offsets [%lld, %lld)",
                  (long long)r, (long long)sorted_indices[r], (long long)expert_offsets[0],
                  (long long)expert_offsets[num_experts]);
    return MOE_OK;
}

/* The hidden dimension is walked in tiles of TILE columns with the row loop inside, so each row is
 * read contiguously and its weight looked up once per tile, while every element still sums its
 * rows in ascending order. */
#define TILE 64

void moe_gather_sum_token(void *out_row, const void *rows_base, const int64_t *rows, int64_t n,
                          int64_t hidden, moe_dtype_t dtype, const void *probs,
                          moe_dtype_t probs_dtype, const int64_t *expert_offsets,
                          int64_t num_experts, int64_t token) {
    const size_t esize = moe_dtype_size(dtype);
    const moe_dtype_t pd = probs ? moe_promote_dtype(dtype, probs_dtype) : dtype;
    const moe_dtype_t acc = moe_acc_dtype(pd);
    double sum[TILE];
    for (int64_t h0 = 0; h0 < hidden; h0 += TILE) {
        const int64_t w = hidden - h0 < TILE ? hidden - h0 : TILE;
        for (int64_t j = 0; j < w; ++j) sum[j] = 0.0;
        for (int64_t i = 0; i < n; ++i) {
            const char *x = moe_row_ptr(rows_base, rows[i], hidden, esize);
            if (probs) {
                const int64_t e = moe_row_expert(expert_offsets, num_experts, rows[i]);
                const double p = moe_load(probs, probs_dtype, token * num_experts + e);
                for (int64_t j = 0; j < w; ++j)
                    sum[j] = moe_round_to(acc, sum[j] + moe_round_to(pd, moe_load(x, dtype, h0 + j) * p));
            } else {
                for (int64_t j = 0; j < w; ++j)
                    sum[j] = moe_round_to(acc, sum[j] + moe_load(x, dtype, h0 + j));
            }
        }
        for (int64_t j = 0; j < w; ++j) moe_store(out_row, dtype, h0 + j, moe_round_to(pd, sum[j]));
    }
}
