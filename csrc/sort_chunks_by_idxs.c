/*
 * sort_chunks_by_idxs.c: reorder the row chunks of a buffer (expert parallelism's local regroup).
 *
 * The input is split into chunks of split_sizes rows; the output is the chunks in sorted_idxs
 * order. The split sizes stay in memory the core reads (on the GPU: device memory), so no host
 * round trip is needed: the start of every chunk on both sides comes from two running sums, then
 * whole chunks move with memcpy. The backward is the same move in the other direction.
 */
#include "layout.h"

size_t moe_sort_chunks_by_idxs_workspace_size(int64_t num_chunks) {
    (void)num_chunks;
    return 0; /* each chunk's two starts are running sums, recomputed per chunk */
}

moe_status_t moe_sort_chunks_by_idxs_check(const void *dst, const void *src,
                                           const int64_t *split_sizes, const int64_t *sorted_idxs,
                                           int64_t num_rows, int64_t row_elems,
                                           int64_t num_chunks, moe_dtype_t dtype) {
    MOE_CHECK(num_rows >= 0, "num_rows must be >= 0, got %lld", (long long)num_rows);
    MOE_CHECK(row_elems >= 0, "row_elems must be >= 0, got %lld", (long long)row_elems);
    MOE_CHECK(num_chunks >= 0, "num_chunks must be >= 0, got %lld", (long long)num_chunks);
    MOE_CHECK(moe_dtype_size(dtype) > 0, "input has an unknown dtype (%d)", (int)dtype);
    MOE_TRY(moe_check_mul(num_rows, "num_rows", row_elems, "row_elems"));
    /* the one thing the sizes say about split_sizes: no chunk, no rows */
    MOE_CHECK(num_chunks > 0 || num_rows == 0,
              "split_sizes must sum to the rows of input (%lld), got 0 (no chunks)",
              (long long)num_rows);
    MOE_CHECK(num_chunks == 0 || (split_sizes && sorted_idxs),
              "split_sizes and sorted_idxs must not be NULL");
    MOE_CHECK(num_rows == 0 || row_elems == 0 || (dst && src), "input and output must not be NULL");
    return MOE_OK;
}

/* The values of split_sizes and sorted_idxs (host memory; on CUDA the caller's contract). */
static moe_status_t check_values(const int64_t *split_sizes, const int64_t *sorted_idxs,
                                 int64_t num_rows, int64_t num_chunks) {
    /* A checked sum: sizes whose wrapped sum equals num_rows would otherwise pass and move chunks
     * far past the buffer. Every partial sum fits, so the running starts of move_chunks do too. */
    int64_t total = 0;
    for (int64_t c = 0; c < num_chunks; ++c) {
        MOE_CHECK(split_sizes[c] >= 0, "split_sizes[%lld] = %lld must be >= 0", (long long)c,
                  (long long)split_sizes[c]);
        int64_t next;
        MOE_CHECK(!moe_checked_add_i64(total, split_sizes[c], &next),
                  "split_sizes overflow int64 when summed: split_sizes[%lld] = %lld after a "
                  "partial sum of %lld (they must sum to the rows of input, %lld)",
                  (long long)c, (long long)split_sizes[c], (long long)total,
                  (long long)num_rows);
        total = next;
    }
    MOE_CHECK(total == num_rows, "split_sizes must sum to the rows of input (%lld), got %lld",
              (long long)num_rows, (long long)total);
    /* a permutation: every index in range and none twice (a bitmap over the chunks would need
     * scratch; an O(C^2) scan is fine for the few dozen chunks of expert parallelism) */
    for (int64_t j = 0; j < num_chunks; ++j) {
        MOE_CHECK(sorted_idxs[j] >= 0 && sorted_idxs[j] < num_chunks,
                  "sorted_idxs[%lld] = %lld is outside [0, num_chunks=%lld)", (long long)j,
                  (long long)sorted_idxs[j], (long long)num_chunks);
        for (int64_t i = 0; i < j; ++i)
            MOE_CHECK(sorted_idxs[i] != sorted_idxs[j],
                      "sorted_idxs must be a permutation of [0, %lld), but %lld appears twice",
                      (long long)num_chunks, (long long)sorted_idxs[j]);
    }
    return MOE_OK;
}

/* Forward: input chunk sorted_idxs[j] goes to the j-th output slot; `inverse` moves it back. Each
 * thread finds its chunk's two starts by running sums: O(C^2) adds, nothing for small C. */
static void move_chunks(void *dst, const void *src, const int64_t *split_sizes,
                        const int64_t *sorted_idxs, int64_t row_elems, int64_t num_chunks,
                        size_t esize, int inverse) {
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t j = 0; j < num_chunks; ++j) {
        const int64_t c = sorted_idxs[j];
        int64_t unsorted_start = 0, sorted_start = 0;
        for (int64_t i = 0; i < c; ++i) unsorted_start += split_sizes[i];
        for (int64_t i = 0; i < j; ++i) sorted_start += split_sizes[sorted_idxs[i]];
        const size_t bytes = (size_t)(split_sizes[c] * row_elems) * esize;
        if (bytes == 0) continue;
        if (inverse)
            memcpy(moe_row_ptr(dst, unsorted_start, row_elems, esize),
                   moe_row_ptr(src, sorted_start, row_elems, esize), bytes);
        else
            memcpy(moe_row_ptr(dst, sorted_start, row_elems, esize),
                   moe_row_ptr(src, unsorted_start, row_elems, esize), bytes);
    }
}

moe_status_t moe_sort_chunks_by_idxs_fwd(void *output, const void *input,
                                         const int64_t *split_sizes, const int64_t *sorted_idxs,
                                         int64_t num_rows, int64_t row_elems, int64_t num_chunks,
                                         moe_dtype_t dtype, void *workspace,
                                         size_t workspace_bytes, void *stream) {
    (void)workspace, (void)workspace_bytes, (void)stream;
    moe_clear_error();
    MOE_TRY(moe_sort_chunks_by_idxs_check(output, input, split_sizes, sorted_idxs, num_rows,
                                          row_elems, num_chunks, dtype));
    MOE_TRY(check_values(split_sizes, sorted_idxs, num_rows, num_chunks));
    move_chunks(output, input, split_sizes, sorted_idxs, row_elems, num_chunks,
                moe_dtype_size(dtype), 0);
    return MOE_OK;
}

moe_status_t moe_sort_chunks_by_idxs_bwd(void *grad_input, const void *grad_output,
                                         const int64_t *split_sizes, const int64_t *sorted_idxs,
                                         int64_t num_rows, int64_t row_elems, int64_t num_chunks,
                                         moe_dtype_t dtype, void *workspace,
                                         size_t workspace_bytes, void *stream) {
    (void)workspace, (void)workspace_bytes, (void)stream;
    moe_clear_error();
    MOE_TRY(moe_sort_chunks_by_idxs_check(grad_input, grad_output, split_sizes, sorted_idxs,
                                          num_rows, row_elems, num_chunks, dtype));
    MOE_TRY(check_values(split_sizes, sorted_idxs, num_rows, num_chunks));
    move_chunks(grad_input, grad_output, split_sizes, sorted_idxs, row_elems, num_chunks,
                moe_dtype_size(dtype), 1);
    return MOE_OK;
}
