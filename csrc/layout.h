/*
 * layout.h: helpers shared by the token layout kernels (permute, unpermute, sort_chunks_by_idxs).
 *
 * The one idea: every byte offset into a [rows, row_elems] buffer goes through moe_row_ptr, which
 * multiplies in int64 and only then converts to size_t, so rows × hidden past 2^31 (DeepSeek-V3:
 * 8192 tokens × 8 experts × 7168 hidden) can never wrap in a 32-bit product.
 */
#ifndef MOE_CORE_LAYOUT_H_
#define MOE_CORE_LAYOUT_H_

#include "common.h"

/* Address of element 0 of `row` in a row-major buffer of `row_elems` elements of `esize` bytes. */
static inline char *moe_row_ptr(const void *base, int64_t row, int64_t row_elems, size_t esize) {
    return (char *)base + (size_t)(row * row_elems) * esize;
}

/* torch.promote_types for the float dtypes: the dtype a product of the two is computed in. */
static inline moe_dtype_t moe_promote_dtype(moe_dtype_t a, moe_dtype_t b) {
    if (a == b) return a;
    if (a == MOE_DTYPE_FP64 || b == MOE_DTYPE_FP64) return MOE_DTYPE_FP64;
    return MOE_DTYPE_FP32; /* fp32 with a half type, or fp16 with bf16 */
}

/* The accumulator of a sum whose result is in `dt`: fp64 for fp64, else fp32 (as torch's). */
static inline moe_dtype_t moe_acc_dtype(moe_dtype_t dt) {
    return dt == MOE_DTYPE_FP64 ? MOE_DTYPE_FP64 : MOE_DTYPE_FP32;
}

/* The expert whose block [offsets[e], offsets[e+1]) holds row r (offsets non-decreasing, with
 * offsets[0] <= r < offsets[E]); the last such e when blocks are empty. Binary search. */
static inline int64_t moe_row_expert(const int64_t *offsets, int64_t num_experts, int64_t r) {
    int64_t lo = 0, hi = num_experts; /* invariant: offsets[lo] <= r < offsets[hi] */
    while (hi - lo > 1) {
        int64_t mid = lo + (hi - lo) / 2;
        if (offsets[mid] <= r) lo = mid;
        else hi = mid;
    }
    return lo;
}

/*
 * The token → rows map, built from sorted_indices by a stable counting sort in `workspace`
 * ((num_tokens + 1 + num_rows) int64): the rows of token t are rows[start[t] .. start[t+1]), in
 * ascending order. The indices must have passed moe_check_sorted_indices (the op's check).
 */
typedef struct moe_token_rows {
    const int64_t *start; /* [num_tokens + 1] */
    const int64_t *rows;  /* [number of rows with an index >= 0] */
} moe_token_rows_t;

moe_status_t moe_token_rows_build(moe_token_rows_t *out, const int64_t *sorted_indices,
                                  int64_t num_tokens, int64_t num_rows, void *workspace,
                                  size_t workspace_bytes);

/*
 * One output token of the combine: out_row = Σ_i v_i over the token's rows (ascending), where
 * v_i = round_P(row_i · probs[token, expert(row_i)]) with probs, or row_i without. The sum runs in
 * fp32 (fp64 when P is fp64), is rounded to P and stored as `dtype`. P = promote(dtype,
 * probs_dtype) with probs, else dtype.
 */
void moe_gather_sum_token(void *out_row, const void *rows_base, const int64_t *rows, int64_t n,
                          int64_t hidden, moe_dtype_t dtype, const void *probs,
                          moe_dtype_t probs_dtype, const int64_t *expert_offsets,
                          int64_t num_experts, int64_t token);

/* Checks sorted_indices: every entry in [-1, num_tokens) (moe_token_rows_build relies on it). */
moe_status_t moe_check_sorted_indices(const int64_t *sorted_indices, int64_t num_tokens,
                                      int64_t num_rows);

/* Checks expert_offsets: [E + 1] non-decreasing from >= 0 to at most num_rows, and every row with
 * a token inside [offsets[0], offsets[E]). */
moe_status_t moe_check_expert_offsets(const int64_t *expert_offsets, int64_t num_experts,
                                      const int64_t *sorted_indices, int64_t num_rows);

#endif /* MOE_CORE_LAYOUT_H_ */
