/*
 * permute_bwd.cu: the backward of permute (rows' gradients → tokens, row probs' gradients → the
 * [T, E] probs) and permute_bwd_accumulate, its token sum one chunk of rows at a time, on CUDA.
 *
 * The backward is layout.cu's gather-sum without weights: one thread group owns each token and
 * adds its rows in ascending row order, so grad_tokens is the CPU's bit for bit, with no atomics
 * on data. grad_probs needs each (token, expert) entry in order, so it takes the CSR map (with
 * each row's expert); the plain gather takes the slots table. With hidden = 0 (the backward of
 * the layout-only permute) only grad_probs is computed: the CSR and the per-(token, expert) sum,
 * no gather.
 *
 * permute_bwd_accumulate (permute_bwd's token sum over one chunk of rows [row_lo, row_lo + n),
 * added into an fp32 accumulator) builds the CSR per call over the chunk's own slice of
 * sorted_indices, as a layout of n rows: its row numbers are then the chunk's own, O(T + n) work
 * per chunk, and the op needs nothing kept between calls (a map of the whole layout would have
 * to be built once and handed from chunk to chunk). The data kernel is the gather's, with the
 * token's running sum starting from its acc row instead of +0.0 and written back unrounded.
 */
#include "layout_cuda.cuh"

extern "C" moe_status_t moe_cuda_permute_bwd(void *grad_tokens, void *grad_probs,
                                             const void *grad_permuted_tokens,
                                             const void *grad_permuted_probs,
                                             const int64_t *sorted_indices,
                                             const int64_t *expert_offsets, int64_t num_tokens,
                                             int64_t hidden, int64_t num_experts,
                                             int64_t num_rows, moe_dtype_t dtype,
                                             moe_dtype_t probs_dtype, void *workspace,
                                             size_t workspace_bytes, void *stream) {
    moe_clear_error();
    MOE_TRY(moe_permute_bwd_check(grad_tokens, grad_probs, grad_permuted_tokens,
                                  grad_permuted_probs, expert_offsets, num_tokens, hidden,
                                  num_experts, num_rows, dtype, probs_dtype));
    MOE_TRY(moe_cuda_layout_check_tokens(num_tokens));
    cudaStream_t st = (cudaStream_t)stream;
    moe_cuda_token_rows_t m;
    moe_cuda_token_slots_t sl;
    moe_cuda_rows_args_t a = {grad_tokens, NULL, grad_permuted_tokens, NULL, &m, NULL,
                              sorted_indices, NULL, num_rows, NULL, probs_dtype, num_tokens,
                              num_experts, hidden, st};
    /* grad_probs sums per (token, expert) over the CSR; the plain gather takes the slots */
    if (!grad_probs && moe_cuda_use_slots(num_tokens)) {
        MOE_TRY(moe_cuda_token_slots_build(&sl, workspace, workspace_bytes, sorted_indices,
                                           num_tokens, num_rows, st));
        a.m = NULL, a.sl = &sl;
    } else {
        MOE_TRY(moe_cuda_token_rows_build(&m, workspace, workspace_bytes, sorted_indices,
                                          grad_probs ? expert_offsets : NULL, num_tokens,
                                          num_experts, num_rows, st));
    }
    if (hidden > 0) /* hidden = 0: grad_probs only, no rows to gather */
        MOE_TRY(moe_cuda_gather_sum(&a, dtype, moe_cuda_math_for(dtype, NULL, probs_dtype)));
    if (grad_probs)
        MOE_TRY(moe_cuda_token_expert_sum(grad_probs, NULL, grad_permuted_probs, &m, num_tokens,
                                          num_experts, probs_dtype, st));
    return MOE_OK;
}

/* ---- permute_bwd_accumulate: permute_bwd's token sum, one chunk of rows at a time ----------- */

/*
 * acc[t] += the chunk's rows of token t, in ascending row order, one fp32 add each (never
 * fused). blockDim = (X, Y): Y tokens per block, X threads per token, VE elements per access.
 * The map (start, rows) is the chunk's own CSR, its rows relative to the chunk. A token without
 * rows in the chunk leaves its acc row untouched (not even read).
 */
template <typename ET, int VE>
__global__ void __launch_bounds__(MOE_GATHER_THREADS)
moe_accumulate_rows_kernel(float *__restrict__ acc, const void *__restrict__ rows_base,
                           const int64_t *__restrict__ start, const int64_t *__restrict__ rows,
                           int64_t T, int64_t nvec) {
    typedef moe_pack<ET, VE> P;
    typedef moe_pack<float, VE> A;
    moe_pdl_trigger();
    moe_pdl_wait(); /* the map is the previous kernel's; acc the stream's earlier work */
    const int64_t t = (int64_t)blockIdx.x * blockDim.y + threadIdx.y;
    if (t >= T) return;
    const int64_t b = start[t], n = start[t + 1] - b;
    if (n == 0) return;
    A *dst = (A *)acc + t * nvec;
    const P *src = (const P *)rows_base;
    for (int64_t v = threadIdx.x; v < nvec; v += blockDim.x) {
        A a = dst[v];
        for (int64_t i = 0; i < n; ++i) {
            const P in = src[rows[b + i] * nvec + v];
#pragma unroll
            for (int k = 0; k < VE; ++k) a.v[k] = moe_add_rn(a.v[k], moe_widen(in.v[k]));
        }
        dst[v] = a;
    }
}

template <typename ET>
static moe_status_t launch_accumulate(float *acc, const void *chunk,
                                      const moe_cuda_token_rows_t *m,
                                      int64_t T, int64_t hidden, cudaStream_t st) {
    /* four elements per access when both rows allow it: 16 bytes of acc, 4·sizeof(ET) of rows */
    const bool vec4 = moe_vec_bytes((size_t)hidden * sizeof(float), acc, NULL, NULL) == 16 &&
                      moe_vec_bytes((size_t)hidden * sizeof(ET), chunk, NULL, NULL) >=
                          (int)(4 * sizeof(ET));
    const int VE = vec4 ? 4 : 1;
    const int64_t nvec = hidden / VE;
    const int X = moe_pow2_clamp(nvec, 32, MOE_GATHER_THREADS);
    const int Y = MOE_GATHER_THREADS / X;
    void (*kernel)(float *, const void *, const int64_t *, const int64_t *, int64_t, int64_t) =
        vec4 ? moe_accumulate_rows_kernel<ET, 4> : moe_accumulate_rows_kernel<ET, 1>;
    MOE_LAUNCH_CHAINED(kernel, dim3(moe_blocks_for(T, Y)), dim3(X, Y), 0, st, acc, chunk,
                       (const int64_t *)m->start, (const int64_t *)m->rows, T, nvec);
    MOE_CHECK_LAUNCH("moe_accumulate_rows_kernel");
    return MOE_OK;
}

extern "C" size_t moe_cuda_permute_bwd_accumulate_workspace_size(int64_t num_tokens,
                                                                 int64_t chunk_rows) {
    return moe_cuda_unpermute_workspace_size(num_tokens, chunk_rows);
}

extern "C" moe_status_t moe_cuda_permute_bwd_accumulate(float *acc, const void *grad_rows_chunk,
                                                        const int64_t *sorted_indices,
                                                        int64_t num_tokens, int64_t hidden,
                                                        int64_t num_rows, int64_t row_lo,
                                                        int64_t chunk_rows, moe_dtype_t dtype,
                                                        void *workspace, size_t workspace_bytes,
                                                        void *stream) {
    moe_clear_error();
    MOE_TRY(moe_permute_bwd_accumulate_check(acc, grad_rows_chunk, sorted_indices, num_tokens,
                                             hidden, num_rows, row_lo, chunk_rows, dtype));
    MOE_TRY(moe_cuda_layout_check_tokens(num_tokens));
    if (num_tokens == 0 || chunk_rows == 0) return MOE_OK; /* nothing to add */
    cudaStream_t st = (cudaStream_t)stream;
    /* the chunk's slice of sorted_indices is a layout of its own, rows relative to row_lo: the
     * map built over it indexes grad_rows_chunk directly */
    moe_cuda_token_rows_t m;
    MOE_TRY(moe_cuda_token_rows_build(&m, workspace, workspace_bytes, sorted_indices + row_lo,
                                      NULL, num_tokens, 1, chunk_rows, st));
    switch (dtype) {
    case MOE_DTYPE_FP32: return launch_accumulate<float>(acc, grad_rows_chunk, &m, num_tokens,
                                                         hidden, st);
    case MOE_DTYPE_BF16: return launch_accumulate<moe_bf16_s>(acc, grad_rows_chunk, &m,
                                                              num_tokens, hidden, st);
    case MOE_DTYPE_FP16: return launch_accumulate<moe_fp16_s>(acc, grad_rows_chunk, &m,
                                                              num_tokens, hidden, st);
    default:
        return moe_fail(MOE_ERR_INTERNAL, "permute_bwd_accumulate: unexpected dtype %d",
                        (int)dtype);
    }
}
