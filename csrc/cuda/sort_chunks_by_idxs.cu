/*
 * sort_chunks_by_idxs.cu: reorder the row chunks of a buffer (expert parallelism's local
 * regroup), on CUDA, forward and backward.
 *
 * The split sizes stay in device memory: one block scans them into the chunk starts on both sides
 * (input order and sorted order) and inverts the permutation. Then one warp per OUTPUT row finds
 * its chunk by a binary search over the output-side starts and copies the row with the widest
 * vector access the row size and pointers allow. Each output row has one writer; no host sync.
 */
#include "layout_cuda.cuh"

extern "C" size_t moe_cuda_sort_chunks_by_idxs_workspace_size(int64_t num_chunks) {
    if (num_chunks < 0) return 0;
    int64_t words;
    if (moe_checked_mul_i64(num_chunks, 3, &words) || moe_checked_add_i64(words, 2, &words) ||
        moe_checked_bytes(words, (int64_t)sizeof(int64_t)) == MOE_SIZE_OVERFLOW)
        return moe_fail_size("moe_cuda_sort_chunks_by_idxs_workspace_size: num_chunks=%lld "
                             "overflows int64 bytes", (long long)num_chunks);
    return moe_checked_bytes(words, (int64_t)sizeof(int64_t));
}

/* One block. unsorted_start[c] = Σ_{c' < c} split_sizes[c'], sorted_start[j] = Σ_{j' < j}
 * split_sizes[sorted_idxs[j']] (both [C + 1]), inv[sorted_idxs[j]] = j (-1 where no j names c).
 * An index outside [0, C) counts as an empty chunk (the caller's contract; never out of bounds). */
__global__ void __launch_bounds__(MOE_SCAN_THREADS)
moe_sort_chunks_plan_kernel(int64_t *unsorted_start, int64_t *sorted_start, int64_t *inv,
                            const int64_t *split_sizes, const int64_t *sorted_idxs, int64_t C) {
    const int64_t per = (C + blockDim.x - 1) / blockDim.x;
    const int64_t c0 = threadIdx.x * per, c1 = c0 + per < C ? c0 + per : C;
    for (int64_t c = c0; c < c1; ++c) inv[c] = -1;
    int64_t a = 0, b = 0;
    for (int64_t c = c0; c < c1; ++c) {
        const int64_t j = sorted_idxs[c];
        a += split_sizes[c];
        b += (j >= 0 && j < C) ? split_sizes[j] : 0;
    }
    int64_t total_a, total_b;
    int64_t run_a = moe_block_exclusive_scan(a, &total_a);
    int64_t run_b = moe_block_exclusive_scan(b, &total_b);
    for (int64_t c = c0; c < c1; ++c) {
        const int64_t j = sorted_idxs[c];
        unsorted_start[c] = run_a;
        sorted_start[c] = run_b;
        run_a += split_sizes[c];
        run_b += (j >= 0 && j < C) ? split_sizes[j] : 0;
    }
    if (threadIdx.x == 0) unsorted_start[C] = total_a, sorted_start[C] = total_b;
    __syncthreads(); /* inv = -1 everywhere before the scatter below */
    for (int64_t c = c0; c < c1; ++c) {
        const int64_t j = sorted_idxs[c];
        if (j >= 0 && j < C) inv[j] = c;
    }
}

/* One warp per output row o. dst_start: the output side's chunk starts; the chunk k holding o is
 * the last with dst_start[k] <= o (empty chunks before it share its start). Forward: output
 * chunk k = j (sorted order) comes from input chunk sorted_idxs[j]; backward: output chunk k = c
 * comes from sorted position inv[c]. */
template <int W>
__global__ void moe_sort_chunks_copy_kernel(void *__restrict__ dst, const void *__restrict__ src,
                                            const int64_t *__restrict__ dst_start,
                                            const int64_t *__restrict__ src_start,
                                            const int64_t *__restrict__ src_of, int64_t C,
                                            int64_t num_rows, int64_t nvec) {
    typedef typename moe_vec_t<W>::type V;
    const int64_t o = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) / 32;
    const int lane = threadIdx.x & 31;
    if (o >= num_rows) return;
    int64_t lo = 0, hi = C; /* dst_start[lo] <= o < dst_start[hi] */
    while (hi - lo > 1) {
        const int64_t mid = lo + (hi - lo) / 2;
        if (dst_start[mid] <= o) lo = mid;
        else hi = mid;
    }
    const int64_t s = src_of[lo];
    if (s < 0 || s >= C) return;
    const int64_t in_row = src_start[s] + (o - dst_start[lo]);
    if (in_row < 0 || in_row >= num_rows) return;
    const V *from = (const V *)src + in_row * nvec;
    V *to = (V *)dst + o * nvec;
    for (int64_t v = lane; v < nvec; v += 32) to[v] = from[v];
}

static moe_status_t sort_chunks(void *dst, const void *src, const int64_t *split_sizes,
                                const int64_t *sorted_idxs, int64_t num_rows, int64_t row_elems,
                                int64_t num_chunks, moe_dtype_t dtype, void *workspace,
                                size_t workspace_bytes, cudaStream_t st, int backward) {
    MOE_TRY(moe_sort_chunks_by_idxs_check(dst, src, split_sizes, sorted_idxs, num_rows, row_elems,
                                          num_chunks, dtype));
    const size_t esize = moe_dtype_size(dtype);
    if (num_chunks == 0 || num_rows == 0 || row_elems == 0) return MOE_OK;
    MOE_CHECK_WORKSPACE(moe_cuda_sort_chunks_by_idxs_workspace_size, num_chunks);
    int64_t *unsorted_start = (int64_t *)workspace;
    int64_t *sorted_start = unsorted_start + num_chunks + 1;
    int64_t *inv = sorted_start + num_chunks + 1;
    moe_sort_chunks_plan_kernel<<<1, MOE_SCAN_THREADS, 0, st>>>(unsorted_start, sorted_start, inv,
                                                                split_sizes, sorted_idxs,
                                                                num_chunks);
    MOE_CHECK_LAUNCH("moe_sort_chunks_plan_kernel");
    const int64_t *dst_start = backward ? unsorted_start : sorted_start;
    const int64_t *src_start = backward ? sorted_start : unsorted_start;
    const int64_t *src_of = backward ? inv : sorted_idxs;
    const size_t row_bytes = (size_t)row_elems * esize;
    const unsigned grid = moe_blocks_for(num_rows * 32, 256);
    const int w = moe_vec_bytes(row_bytes, dst, src, NULL);
    const int64_t nvec = (int64_t)(row_bytes / (size_t)w);
#define MOE_SORT_CHUNKS_LAUNCH(W)                                                              \
    moe_sort_chunks_copy_kernel<W><<<grid, 256, 0, st>>>(dst, src, dst_start, src_start, src_of, \
                                                         num_chunks, num_rows, nvec)
    switch (w) {
    case 16: MOE_SORT_CHUNKS_LAUNCH(16); break;
    case 8: MOE_SORT_CHUNKS_LAUNCH(8); break;
    case 4: MOE_SORT_CHUNKS_LAUNCH(4); break;
    case 2: MOE_SORT_CHUNKS_LAUNCH(2); break;
    default: MOE_SORT_CHUNKS_LAUNCH(1); break;
    }
#undef MOE_SORT_CHUNKS_LAUNCH
    MOE_CHECK_LAUNCH("moe_sort_chunks_copy_kernel");
    return MOE_OK;
}

extern "C" moe_status_t moe_cuda_sort_chunks_by_idxs_fwd(void *output, const void *input,
                                                         const int64_t *split_sizes,
                                                         const int64_t *sorted_idxs,
                                                         int64_t num_rows, int64_t row_elems,
                                                         int64_t num_chunks, moe_dtype_t dtype,
                                                         void *workspace, size_t workspace_bytes,
                                                         void *stream) {
    moe_clear_error();
    return sort_chunks(output, input, split_sizes, sorted_idxs, num_rows, row_elems, num_chunks,
                       dtype, workspace, workspace_bytes, (cudaStream_t)stream, 0);
}

extern "C" moe_status_t moe_cuda_sort_chunks_by_idxs_bwd(void *grad_input, const void *grad_output,
                                                         const int64_t *split_sizes,
                                                         const int64_t *sorted_idxs,
                                                         int64_t num_rows, int64_t row_elems,
                                                         int64_t num_chunks, moe_dtype_t dtype,
                                                         void *workspace, size_t workspace_bytes,
                                                         void *stream) {
    moe_clear_error();
    return sort_chunks(grad_input, grad_output, split_sizes, sorted_idxs, num_rows, row_elems,
                       num_chunks, dtype, workspace, workspace_bytes, (cudaStream_t)stream, 1);
}
