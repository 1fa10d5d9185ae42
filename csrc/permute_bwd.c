/*
 * permute_bwd.c: the backward of permute (rows' gradients → tokens, row probs' gradients → the
 * [T, E] probs), and permute_bwd_accumulate, its token sum one chunk of rows at a time.
 *
 * The backward is the combine's gather over the token → rows map (layout.c) without weights: each
 * token sums its own rows in ascending row order, one writer per output element, no atomics.
 */
#include "layout.h"

moe_status_t moe_permute_bwd_check(const void *grad_tokens, const void *grad_probs,
                                   const void *grad_permuted_tokens,
                                   const void *grad_permuted_probs, const int64_t *expert_offsets,
                                   int64_t num_tokens, int64_t hidden, int64_t num_experts,
                                   int64_t num_rows, moe_dtype_t dtype, moe_dtype_t probs_dtype) {
    MOE_CHECK(hidden >= 0, "hidden must be >= 0 (0: grad_probs only, no rows), got %lld",
              (long long)hidden);
    if (hidden == 0) {
        /* the backward of the layout-only permute: grad_probs alone, from the rows' probs, which
         * are rows of one element for the size checks */
        MOE_CHECK(!grad_tokens,
                  "grad_tokens must be NULL with hidden = 0 (grad_probs only: no rows)");
        MOE_CHECK(!grad_permuted_tokens,
                  "grad_permuted_tokens must be NULL with hidden = 0 (grad_probs only: no rows)");
        MOE_CHECK(num_tokens == 0 || grad_probs,
                  "grad_probs must not be NULL with hidden = 0 (it is all this backward computes)");
        MOE_TRY(moe_layout_check_sizes(num_tokens, 1, num_experts, num_rows, probs_dtype,
                                       "grad_permuted_probs"));
    } else {
        MOE_TRY(moe_layout_check_sizes(num_tokens, hidden, num_experts, num_rows, dtype,
                                       "grad_permuted_tokens"));
        MOE_CHECK(num_tokens == 0 || grad_tokens,
                  "grad_tokens must not be NULL with hidden=%lld (NULL, with "
                  "grad_permuted_tokens NULL, needs hidden = 0: grad_probs only)",
                  (long long)hidden);
        MOE_CHECK(num_rows == 0 || grad_permuted_tokens,
                  "grad_permuted_tokens must not be NULL with hidden=%lld (NULL, with "
                  "grad_tokens NULL, needs hidden = 0: grad_probs only)", (long long)hidden);
    }
    MOE_CHECK(!grad_probs || moe_is_float_dtype(probs_dtype),
              "grad_permuted_probs must be a float dtype, got %s", moe_dtype_name(probs_dtype));
    MOE_CHECK(!grad_probs || num_rows == 0 || grad_permuted_probs,
              "grad_permuted_probs must not be NULL when grad_probs is requested");
    MOE_CHECK(!grad_probs || expert_offsets,
              "expert_offsets must not be NULL when grad_probs is requested");
    return MOE_OK;
}

moe_status_t moe_permute_bwd(void *grad_tokens, void *grad_probs, const void *grad_permuted_tokens,
                             const void *grad_permuted_probs, const int64_t *sorted_indices,
                             const int64_t *expert_offsets, int64_t num_tokens, int64_t hidden,
                             int64_t num_experts, int64_t num_rows, moe_dtype_t dtype,
                             moe_dtype_t probs_dtype, void *workspace, size_t workspace_bytes,
                             void *stream) {
    (void)stream;
    moe_clear_error();
    MOE_TRY(moe_permute_bwd_check(grad_tokens, grad_probs, grad_permuted_tokens,
                                  grad_permuted_probs, expert_offsets, num_tokens, hidden,
                                  num_experts, num_rows, dtype, probs_dtype));
    /* the values of the host buffers: the CUDA entry point cannot read them without a sync */
    MOE_TRY(moe_check_sorted_indices(sorted_indices, num_tokens, num_rows));
    if (grad_probs)
        MOE_TRY(moe_check_expert_offsets(expert_offsets, num_experts, sorted_indices, num_rows));
    moe_token_rows_t map;
    MOE_TRY(moe_token_rows_build(&map, sorted_indices, num_tokens, num_rows, workspace,
                                 workspace_bytes));
    const size_t esize = moe_dtype_size(dtype);

#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < num_tokens; ++t) {
        const int64_t *rows = map.rows + map.start[t];
        const int64_t n = map.start[t + 1] - map.start[t];
        if (hidden > 0) /* hidden = 0: grad_probs only */
            moe_gather_sum_token(moe_row_ptr(grad_tokens, t, hidden, esize),
                                 grad_permuted_tokens, rows, n, hidden, dtype, NULL, dtype, NULL,
                                 num_experts, t);
        if (grad_probs) {
            for (int64_t e = 0; e < num_experts; ++e)
                moe_store(grad_probs, probs_dtype, t * num_experts + e, 0.0);
            for (int64_t i = 0; i < n; ++i) {
                const int64_t at = t * num_experts + moe_row_expert(expert_offsets, num_experts,
                                                                    rows[i]);
                moe_store(grad_probs, probs_dtype, at,
                          moe_load(grad_probs, probs_dtype, at) +
                              moe_load(grad_permuted_probs, probs_dtype, rows[i]));
            }
        }
    }
    return MOE_OK;
}

/* ---- permute_bwd_accumulate: the backward's token sum, one chunk of rows at a time ----------
 * No token → rows map here: walking the chunk's rows in ascending order and adding each into its
 * token's accumulator row is already the order permute_bwd sums in (each token's rows
 * ascending). The threads split the hidden dimension instead of the tokens, so every element
 * keeps one writer and its ascending row order without any map. */

/* Columns per thread's tile: a tile of a row is read contiguously, tiles are shared out. */
#define MOE_ACC_TILE 256

size_t moe_permute_bwd_accumulate_workspace_size(int64_t num_tokens, int64_t chunk_rows) {
    (void)num_tokens, (void)chunk_rows;
    return 0;
}

moe_status_t moe_permute_bwd_accumulate_check(const float *acc, const void *grad_rows_chunk,
                                              const int64_t *sorted_indices, int64_t num_tokens,
                                              int64_t hidden, int64_t num_rows, int64_t row_lo,
                                              int64_t chunk_rows, moe_dtype_t dtype) {
    MOE_CHECK(num_tokens >= 0, "num_tokens must be >= 0, got %lld", (long long)num_tokens);
    MOE_CHECK(hidden >= 1, "hidden must be >= 1, got %lld", (long long)hidden);
    MOE_CHECK(num_rows >= 0, "num_rows must be >= 0, got %lld", (long long)num_rows);
    /* the accumulator is fp32: fp64 rows (whose permute_bwd sums in fp64) have no such sum */
    MOE_CHECK(dtype == MOE_DTYPE_BF16 || dtype == MOE_DTYPE_FP16 || dtype == MOE_DTYPE_FP32,
              "grad_rows_chunk must be bf16, fp16 or fp32, got %s", moe_dtype_name(dtype));
    MOE_CHECK(row_lo >= 0, "row_lo must be >= 0, got %lld", (long long)row_lo);
    MOE_CHECK(chunk_rows >= 0, "chunk_rows must be >= 0, got %lld", (long long)chunk_rows);
    /* row_lo + chunk_rows <= num_rows, spelled so that it cannot overflow */
    MOE_CHECK(row_lo <= num_rows && chunk_rows <= num_rows - row_lo,
              "the chunk's rows [row_lo=%lld, row_lo + %lld) run past the %lld rows of "
              "sorted_indices", (long long)row_lo, (long long)chunk_rows, (long long)num_rows);
    MOE_TRY(moe_check_mul(num_tokens, "num_tokens", hidden, "hidden"));
    MOE_TRY(moe_check_mul(chunk_rows, "chunk_rows", hidden, "hidden"));
    MOE_CHECK(num_tokens == 0 || acc, "acc must not be NULL");
    MOE_CHECK(chunk_rows == 0 || (grad_rows_chunk && sorted_indices),
              "grad_rows_chunk and sorted_indices must not be NULL");
    return MOE_OK;
}

moe_status_t moe_permute_bwd_accumulate(float *acc, const void *grad_rows_chunk,
                                        const int64_t *sorted_indices, int64_t num_tokens,
                                        int64_t hidden, int64_t num_rows, int64_t row_lo,
                                        int64_t chunk_rows, moe_dtype_t dtype, void *workspace,
                                        size_t workspace_bytes, void *stream) {
    (void)workspace, (void)workspace_bytes, (void)stream;
    moe_clear_error();
    MOE_TRY(moe_permute_bwd_accumulate_check(acc, grad_rows_chunk, sorted_indices, num_tokens,
                                             hidden, num_rows, row_lo, chunk_rows, dtype));
    const int64_t *idx = sorted_indices + (chunk_rows > 0 ? row_lo : 0);
    /* the chunk's indices, as permute_bwd checks all of them (the CUDA entry point cannot) */
    for (int64_t i = 0; i < chunk_rows; ++i)
        MOE_CHECK(idx[i] >= -1 && idx[i] < num_tokens,
                  "sorted_indices[%lld] = %lld is outside [-1, num_tokens=%lld)",
                  (long long)(row_lo + i), (long long)idx[i], (long long)num_tokens);
    const int64_t ntiles = (hidden + MOE_ACC_TILE - 1) / MOE_ACC_TILE;
    const size_t esize = moe_dtype_size(dtype);

#pragma omp parallel for schedule(static)
    for (int64_t tile = 0; tile < ntiles; ++tile) {
        const int64_t h0 = tile * MOE_ACC_TILE;
        const int64_t w = hidden - h0 < MOE_ACC_TILE ? hidden - h0 : MOE_ACC_TILE;
        for (int64_t i = 0; i < chunk_rows; ++i) {
            const int64_t t = idx[i];
            if (t < 0) continue; /* padding row */
            float *a = acc + t * hidden + h0;
            const char *x = moe_row_ptr(grad_rows_chunk, i, hidden, esize) + (size_t)h0 * esize;
            /* one fp32 add per element: a float expression has no product to contract */
            switch (dtype) {
            case MOE_DTYPE_FP32:
                for (int64_t j = 0; j < w; ++j) a[j] = a[j] + ((const float *)x)[j];
                break;
            case MOE_DTYPE_BF16:
                for (int64_t j = 0; j < w; ++j)
                    a[j] = a[j] + moe_bf16_to_float(((const uint16_t *)x)[j]);
                break;
            default: /* MOE_DTYPE_FP16 (the check admits nothing else) */
                for (int64_t j = 0; j < w; ++j)
                    a[j] = a[j] + moe_fp16_to_float(((const uint16_t *)x)[j]);
                break;
            }
        }
    }
    return MOE_OK;
}
