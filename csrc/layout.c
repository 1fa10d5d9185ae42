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
    const size_t need = moe_unpermute_workspace_size(num_tokens, num_rows);
    MOE_CHECK(workspace_bytes >= need && (need == 0 || workspace),
              "workspace too small: %zu bytes, need at least %zu (moe_unpermute_workspace_size)",
              workspace_bytes, need);
    MOE_CHECK(num_rows == 0 || sorted_indices, "sorted_indices must not be NULL");
    int64_t *start = (int64_t *)workspace;
    int64_t *rows = start + num_tokens + 1;
    for (int64_t t = 0; t <= num_tokens; ++t) start[t] = 0;
    for (int64_t r = 0; r < num_rows; ++r) {
        const int64_t t = sorted_indices[r];
        MOE_CHECK(t >= -1 && t < num_tokens,
                  "sorted_indices[%lld] = %lld is outside [-1, num_tokens=%lld)", (long long)r,
                  (long long)t, (long long)num_tokens);
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
    return (size_t)(num_tokens + 1 + num_rows) * sizeof(int64_t);
}

moe_status_t moe_check_expert_offsets(const int64_t *expert_offsets, int64_t num_experts,
                                      const int64_t *sorted_indices, int64_t num_rows) {
    MOE_CHECK(expert_offsets, "expert_offsets must not be NULL when probs are given");
    MOE_CHECK(expert_offsets[0] >= 0, "expert_offsets[0] must be >= 0, got %lld",
              (long long)expert_offsets[0]);
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
