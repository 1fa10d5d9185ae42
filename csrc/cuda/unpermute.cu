/*
 * unpermute.cu: the combine (rows of the expert-grouped layout → tokens) and its backward, on
 * CUDA.
 *
 * The forward is layout.cu's gather-sum over the token → rows map, each row weighted by its
 * prob: one thread group owns each output token and adds its rows in ascending row order, with
 * the CPU's rounding points, so the output is the CPU's bit for bit. The backward walks the same
 * map the other way: one block per token stores the token's gradient (times the prob) to each of
 * its rows and, for grad_probs, sums each row's dot product in a fixed tree order; without probs
 * it is a plain copy that the unsorted slots table serves.
 *
 * Data kernels read and write 16 bytes per access when the row size and the pointers allow it.
 */
#include "layout_cuda.cuh"

/* ---- unpermute backward ---------------------------------------------------------------------- */

#define MOE_BWD_GROUP 8

/*
 * One block per token (X threads). For each of the token's rows: grad_x[r] = narrow(round_P(g · w))
 * (a raw copy of g without probs); with want_dots also the dot g · x[r], each product rounded to
 * P and summed in C: per thread in its fixed vector order, then a fixed xor tree in the warp, then
 * the warps in order. dots[entry] = round_P(dot). Rows go in groups of MOE_BWD_GROUP so the
 * partial dots stay in registers.
 */
template <typename ET, typename C, int RP, int VE>
__global__ void __launch_bounds__(MOE_GATHER_THREADS)
moe_unpermute_bwd_kernel(void *__restrict__ grad_x, double *__restrict__ dots,
                         const void *__restrict__ grad_output, const void *__restrict__ x_rows,
                         const int64_t *__restrict__ start, const int64_t *__restrict__ rows,
                         const int64_t *__restrict__ rexp, const void *__restrict__ probs,
                         moe_dtype_t probs_dtype, int64_t E, int64_t nvec, int want_dots) {
    typedef moe_pack<ET, VE> P;
    __shared__ C s_red[MOE_GATHER_THREADS / 32][MOE_BWD_GROUP];
    moe_pdl_trigger();
    moe_pdl_wait();
    const int x = threadIdx.x, lane = x & 31, warp = x >> 5, nwarps = blockDim.x >> 5;
    const int64_t t = blockIdx.x;
    const int64_t b = start[t], n = start[t + 1] - b;
    const P *g_row = (const P *)grad_output + t * nvec;
    P *gx = (P *)grad_x;
    const P *xs = (const P *)x_rows;
    for (int64_t i0 = 0; i0 < n; i0 += MOE_BWD_GROUP) {
        int64_t r[MOE_BWD_GROUP];
        C w[MOE_BWD_GROUP], part[MOE_BWD_GROUP];
#pragma unroll
        for (int j = 0; j < MOE_BWD_GROUP; ++j) {
            const int64_t i = i0 + j;
            r[j] = i < n ? rows[b + i] : -1;
            w[j] = (i < n && probs) ? (C)moe_load(probs, probs_dtype, t * E + rexp[b + i]) : (C)1;
            part[j] = (C)0;
        }
        for (int64_t v = x; v < nvec; v += blockDim.x) {
            const P g = g_row[v];
            C gc[VE];
#pragma unroll
            for (int k = 0; k < VE; ++k) gc[k] = (C)moe_widen(g.v[k]);
#pragma unroll
            for (int j = 0; j < MOE_BWD_GROUP; ++j) {
                if (r[j] < 0) continue;
                if (probs) {
                    P o;
#pragma unroll
                    for (int k = 0; k < VE; ++k)
                        o.v[k] = moe_narrow<ET>(moe_round_p<RP>(moe_mul_rn(gc[k], w[j])));
                    gx[r[j] * nvec + v] = o;
                } else {
                    gx[r[j] * nvec + v] = g;
                }
                if (want_dots) {
                    const P xv = xs[r[j] * nvec + v];
#pragma unroll
                    for (int k = 0; k < VE; ++k)
                        part[j] = moe_add_rn(
                            part[j], moe_round_p<RP>(moe_mul_rn(gc[k], (C)moe_widen(xv.v[k]))));
                }
            }
        }
        if (want_dots) { /* uniform across the block: n and want_dots are per block */
#pragma unroll
            for (int j = 0; j < MOE_BWD_GROUP; ++j) {
                C s = part[j];
#pragma unroll
                for (int d = 16; d >= 1; d /= 2) s = moe_add_rn(s, __shfl_xor_sync(0xffffffffu, s, d));
                if (lane == 0) s_red[warp][j] = s;
            }
            __syncthreads();
            if (x == 0)
                for (int j = 0; j < MOE_BWD_GROUP && i0 + j < n; ++j) {
                    C s = s_red[0][j];
                    for (int k = 1; k < nwarps; ++k) s = moe_add_rn(s, s_red[k][j]);
                    dots[b + i0 + j] = (double)moe_round_p<RP>(s);
                }
            __syncthreads();
        }
    }
}

/*
 * unpermute_bwd without probs: grad_x[r] = grad_output[token of r], a copy in which nothing is
 * summed and every row has one writer, so the slots serve unsorted. Blocks [0, T): token t's
 * gradient row read once and stored to each of its slot rows; the MOE_OVF_BLOCKS blocks after
 * them take the overflow list's entries in turn (none, unless a token has more than MOE_SLOTS
 * rows). Raw W-byte vectors, any dtype.
 */
#define MOE_OVF_BLOCKS 64
template <int W>
__global__ void __launch_bounds__(MOE_GATHER_THREADS)
moe_copy_rows_slots_kernel(void *__restrict__ grad_x, const void *__restrict__ grad_output,
                           moe_cuda_token_slots_t m, int64_t T, int64_t nvec) {
    typedef typename moe_vec_t<W>::type V;
    moe_pdl_trigger();
    moe_pdl_wait(); /* the slots are the slots kernel's */
    const V *g = (const V *)grad_output;
    V *gx = (V *)grad_x;
    if ((int64_t)blockIdx.x < T) {
        const int64_t t = blockIdx.x;
        const int64_t c = m.count[t];
        const int n = c < MOE_SLOTS ? (int)c : MOE_SLOTS;
        int64_t r[MOE_SLOTS];
#pragma unroll
        for (int j = 0; j < MOE_SLOTS; ++j) r[j] = j < n ? m.slot[t * MOE_SLOTS + j] : 0;
        for (int64_t v = threadIdx.x; v < nvec; v += blockDim.x) {
            const V val = g[t * nvec + v];
#pragma unroll
            for (int j = 0; j < MOE_SLOTS; ++j)
                if (j < n) gx[r[j] * nvec + v] = val;
        }
        return;
    }
    const int64_t L = *m.ovf_n;
    for (int64_t i = (int64_t)blockIdx.x - T; i < L; i += (int64_t)gridDim.x - T) {
        const longlong2 o = m.ovf[i];
        for (int64_t v = threadIdx.x; v < nvec; v += blockDim.x) gx[o.y * nvec + v] = g[o.x * nvec + v];
    }
}

static moe_status_t launch_copy_rows_slots(void *grad_x, const void *grad_output,
                                           const moe_cuda_token_slots_t *m, int64_t T,
                                           size_t row_bytes, cudaStream_t st) {
    void (*copy)(void *, const void *, moe_cuda_token_slots_t, int64_t, int64_t);
    int64_t nvec;
    switch (moe_vec_bytes(row_bytes, grad_x, grad_output, NULL)) {
    case 16: copy = moe_copy_rows_slots_kernel<16>, nvec = (int64_t)(row_bytes / 16); break;
    case 8: copy = moe_copy_rows_slots_kernel<8>, nvec = (int64_t)(row_bytes / 8); break;
    case 4: copy = moe_copy_rows_slots_kernel<4>, nvec = (int64_t)(row_bytes / 4); break;
    case 2: copy = moe_copy_rows_slots_kernel<2>, nvec = (int64_t)(row_bytes / 2); break;
    default: copy = moe_copy_rows_slots_kernel<1>, nvec = (int64_t)row_bytes; break;
    }
    const int X = moe_pow2_clamp(nvec, 32, MOE_GATHER_THREADS);
    MOE_LAUNCH_CHAINED(copy, dim3((unsigned)(T + MOE_OVF_BLOCKS)), dim3(X), 0, st, grad_x,
                       grad_output, *m, T, nvec);
    MOE_CHECK_LAUNCH("moe_copy_rows_slots_kernel");
    return MOE_OK;
}

/* The backward kernel's launch for one element type, math and vector width
 * (moe_cuda_launch_rows): one block per token. */
template <typename ET, typename C, int RP, int VE>
struct unpermute_bwd_launch {
    static moe_status_t launch(const moe_cuda_rows_args_t *a) {
        const int64_t nvec = a->hidden / VE;
        const int X = moe_pow2_clamp(nvec, 32, MOE_GATHER_THREADS);
        void (*bwd)(void *, double *, const void *, const void *, const int64_t *,
                    const int64_t *, const int64_t *, const void *, moe_dtype_t, int64_t, int64_t,
                    int) = moe_unpermute_bwd_kernel<ET, C, RP, VE>;
        MOE_LAUNCH_CHAINED(bwd, dim3((unsigned)a->T), dim3(X), 0, a->st, a->dst, a->dots, a->src,
                           a->x_rows, a->m->start, a->m->rows, a->m->rexp, a->probs,
                           a->probs_dtype, a->E, nvec, a->x_rows != NULL);
        MOE_CHECK_LAUNCH("moe_unpermute_bwd_kernel");
        return MOE_OK;
    }
};

static moe_status_t launch_zero_pad(void *rows_base, const int64_t *sorted_indices, int64_t R,
                                    int64_t T, size_t row_bytes, cudaStream_t st) {
    if (R == 0) return MOE_OK;
    const dim3 grid(moe_blocks_for(R, 256)); /* one thread per row, a warp per 32 rows */
    void (*pad)(void *, const int64_t *, int64_t, int64_t, int64_t);
    int64_t nvec;
    switch (moe_vec_bytes(row_bytes, rows_base, NULL, NULL)) {
    case 16: pad = moe_zero_pad_rows_kernel<16>, nvec = (int64_t)(row_bytes / 16); break;
    case 8: pad = moe_zero_pad_rows_kernel<8>, nvec = (int64_t)(row_bytes / 8); break;
    case 4: pad = moe_zero_pad_rows_kernel<4>, nvec = (int64_t)(row_bytes / 4); break;
    case 2: pad = moe_zero_pad_rows_kernel<2>, nvec = (int64_t)(row_bytes / 2); break;
    default: pad = moe_zero_pad_rows_kernel<1>, nvec = (int64_t)row_bytes; break;
    }
    MOE_LAUNCH_CHAINED(pad, grid, dim3(256), 0, st, rows_base, sorted_indices, R, T, nvec);
    MOE_CHECK_LAUNCH("moe_zero_pad_rows_kernel");
    return MOE_OK;
}

/* ---- entry points ---------------------------------------------------------------------------- */

extern "C" moe_status_t moe_cuda_unpermute_fwd(void *output, const void *permuted_tokens,
                                               const int64_t *sorted_indices, const void *probs,
                                               const int64_t *expert_offsets, int64_t num_tokens,
                                               int64_t hidden, int64_t num_experts,
                                               int64_t num_rows, moe_dtype_t dtype,
                                               moe_dtype_t probs_dtype, void *workspace,
                                               size_t workspace_bytes, void *stream) {
    moe_clear_error();
    MOE_TRY(moe_unpermute_fwd_check(output, permuted_tokens, probs, expert_offsets, num_tokens,
                                    hidden, num_experts, num_rows, dtype, probs_dtype));
    MOE_TRY(moe_cuda_layout_check_tokens(num_tokens));
    cudaStream_t st = (cudaStream_t)stream;
    const int64_t *offsets = probs ? expert_offsets : NULL;
    moe_cuda_token_rows_t m;
    moe_cuda_token_slots_t sl;
    moe_cuda_rows_args_t a = {output, NULL, permuted_tokens, NULL, &m, NULL, sorted_indices,
                              offsets, num_rows, probs, probs_dtype, num_tokens, num_experts,
                              hidden, st};
    if (moe_cuda_use_slots(num_tokens)) {
        MOE_TRY(moe_cuda_token_slots_build(&sl, workspace, workspace_bytes, sorted_indices,
                                           num_tokens, num_rows, st));
        a.m = NULL, a.sl = &sl;
    } else {
        MOE_TRY(moe_cuda_token_rows_build(&m, workspace, workspace_bytes, sorted_indices, offsets,
                                          num_tokens, num_experts, num_rows, st));
    }
    return moe_cuda_gather_sum(&a, dtype, moe_cuda_math_for(dtype, probs, probs_dtype));
}

extern "C" moe_status_t moe_cuda_unpermute_bwd(void *grad_permuted_tokens, void *grad_probs,
                                               const void *grad_output,
                                               const void *permuted_tokens,
                                               const int64_t *sorted_indices, const void *probs,
                                               const int64_t *expert_offsets, int64_t num_tokens,
                                               int64_t hidden, int64_t num_experts,
                                               int64_t num_rows, moe_dtype_t dtype,
                                               moe_dtype_t probs_dtype, void *workspace,
                                               size_t workspace_bytes, void *stream) {
    moe_clear_error();
    MOE_TRY(moe_unpermute_bwd_check(grad_permuted_tokens, grad_probs, grad_output,
                                    permuted_tokens, probs, expert_offsets, num_tokens, hidden,
                                    num_experts, num_rows, dtype, probs_dtype));
    MOE_TRY(moe_cuda_layout_check_tokens(num_tokens));
    cudaStream_t st = (cudaStream_t)stream;
    const size_t esize = moe_dtype_size(dtype);
    if (!probs && moe_cuda_use_slots(num_tokens)) { /* a plain copy back to the rows */
        moe_cuda_token_slots_t sl;
        MOE_TRY(moe_cuda_token_slots_build(&sl, workspace, workspace_bytes, sorted_indices,
                                           num_tokens, num_rows, st));
        MOE_TRY(launch_zero_pad(grad_permuted_tokens, sorted_indices, num_rows, num_tokens,
                                (size_t)hidden * esize, st));
        return launch_copy_rows_slots(grad_permuted_tokens, grad_output, &sl, num_tokens,
                                      (size_t)hidden * esize, st);
    }
    moe_cuda_token_rows_t m;
    MOE_TRY(moe_cuda_token_rows_build(&m, workspace, workspace_bytes, sorted_indices,
                                      probs ? expert_offsets : NULL, num_tokens, num_experts,
                                      num_rows, st));
    MOE_TRY(launch_zero_pad(grad_permuted_tokens, sorted_indices, num_rows, num_tokens,
                            (size_t)hidden * esize, st));
    moe_cuda_rows_args_t a = {grad_permuted_tokens, m.dots, grad_output,
                              grad_probs ? permuted_tokens : NULL, &m, NULL, NULL, NULL,
                              num_rows, probs, probs_dtype, num_tokens, num_experts, hidden, st};
    const moe_cuda_math_t mt = moe_cuda_math_for(dtype, probs, probs_dtype);
    MOE_TRY(moe_cuda_launch_rows<unpermute_bwd_launch>(&a, dtype, mt));
    if (grad_probs)
        MOE_TRY(moe_cuda_token_expert_sum(grad_probs, m.dots, NULL, &m, num_tokens, num_experts,
                                          probs_dtype, st));
    return MOE_OK;
}
