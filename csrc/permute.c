/*
 * permute.c: tokens → the expert-grouped row layout (forward), and its backward.
 *
 * The layout is planned per expert before any data moves: a count per expert column, block sizes
 * (padded to align_size or fixed at the capacity), an exclusive scan into expert_offsets. Then each
 * expert fills its own block by one ascending walk of its column, so the row order (expert
 * ascending, token ascending) is Megatron's argsort order without sorting anything, and every
 * output row has one writer. The backward is the combine's gather over the token → rows map.
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
    MOE_CHECK(hidden >= 1, "hidden must be >= 1, got %lld", (long long)hidden);
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
    MOE_CHECK(moe_dtype_size(dtype) > 0, "tokens has an unknown dtype (%d)", (int)dtype);
    MOE_CHECK(!permuted_probs || moe_is_float_dtype(probs_dtype),
              "probs must be a float dtype, got %s", moe_dtype_name(probs_dtype));
    MOE_CHECK(!permuted_probs || num_tokens == 0 || probs,
              "probs must not be NULL when permuted_probs is requested");
    MOE_CHECK(expert_offsets && tokens_per_expert,
              "expert_offsets and tokens_per_expert must not be NULL");
    MOE_CHECK(R == 0 || (permuted_tokens && sorted_indices),
              "permuted_tokens and sorted_indices must not be NULL");
    MOE_CHECK(num_tokens == 0 || (tokens && routing_map),
              "tokens and routing_map must not be NULL");
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

moe_status_t moe_permute_bwd_check(const void *grad_tokens, const void *grad_probs,
                                   const void *grad_permuted_tokens,
                                   const void *grad_permuted_probs, const int64_t *expert_offsets,
                                   int64_t num_tokens, int64_t hidden, int64_t num_experts,
                                   int64_t num_rows, moe_dtype_t dtype, moe_dtype_t probs_dtype) {
    MOE_TRY(moe_layout_check_sizes(num_tokens, hidden, num_experts, num_rows, dtype,
                                   "grad_permuted_tokens"));
    MOE_CHECK(!grad_probs || moe_is_float_dtype(probs_dtype),
              "grad_permuted_probs must be a float dtype, got %s", moe_dtype_name(probs_dtype));
    MOE_CHECK(!grad_probs || num_rows == 0 || grad_permuted_probs,
              "grad_permuted_probs must not be NULL when grad_probs is requested");
    MOE_CHECK(!grad_probs || expert_offsets,
              "expert_offsets must not be NULL when grad_probs is requested");
    MOE_CHECK(num_tokens == 0 || grad_tokens, "grad_tokens must not be NULL");
    MOE_CHECK(num_rows == 0 || grad_permuted_tokens, "grad_permuted_tokens must not be NULL");
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
        moe_gather_sum_token(moe_row_ptr(grad_tokens, t, hidden, esize), grad_permuted_tokens,
                             rows, n, hidden, dtype, NULL, dtype, NULL, num_experts, t);
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
