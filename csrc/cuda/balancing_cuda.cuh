/*
 * balancing_cuda.cuh: the reductions the load-balancing kernels share (aux-loss scores, switch
 * loss, z-loss, Sinkhorn, routing metrics, the gating bias gradient).
 *
 * The one idea: every sum over tokens is a two-stage reduction whose shape depends only on the
 * sizes, never on the GPU or on timing. Stage one writes per-block partials to the workspace at
 * fixed slots; stage two, a single block, adds them in a fixed order. No floating-point atomics,
 * so the bits are the same run after run (and on any GPU). Warp sums use the xor butterfly, in
 * which lane i and its partner add the same two numbers (x + y == y + x exactly), so every lane
 * ends with the same value.
 */
#ifndef MOE_CORE_BALANCING_CUDA_CUH_
#define MOE_CORE_BALANCING_CUDA_CUH_

#include "cuda_common.cuh"
#include "../balancing_math.h"

#define MOE_FULL_MASK 0xffffffffu
#define MOE_BAL_WARPS 8         /* warps (tokens in flight) per block of the per-token kernels */
#define MOE_BAL_FINAL_THREADS 256 /* the single block of every stage-two kernel */

/* Column partials: a block sums a 32-column tile over one chunk of tokens. */
#define MOE_COL_ROWS 8          /* token rows per block (blockDim = 32 x 8) */
#define MOE_COL_MIN_CHUNK 256   /* tokens per chunk, at least */
#define MOE_COL_MAX_CHUNKS 256  /* chunks, at most (gridDim.y) */

/* Token partials: a block of MOE_BAL_WARPS warps reduces this many consecutive tokens. */
#define MOE_TOK_PER_BLOCK 64

static inline int64_t moe_ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

/* Chunks the tokens are split into for column partials (a function of T alone). */
static inline int64_t moe_col_chunks(int64_t num_tokens) {
    if (num_tokens <= 0) return 0;
    int64_t n = moe_ceil_div(num_tokens, MOE_COL_MIN_CHUNK);
    return n < MOE_COL_MAX_CHUNKS ? n : MOE_COL_MAX_CHUNKS;
}

static inline int64_t moe_col_chunk_len(int64_t num_tokens) {
    int64_t n = moe_col_chunks(num_tokens);
    return n > 0 ? moe_ceil_div(num_tokens, n) : 0;
}

/* Blocks of the per-token partial kernels (one partial per block). */
static inline int64_t moe_tok_blocks(int64_t num_tokens) {
    return num_tokens > 0 ? moe_ceil_div(num_tokens, MOE_TOK_PER_BLOCK) : 0;
}

static inline size_t moe_align256(size_t n) { return (n + 255u) & ~(size_t)255u; }

__device__ __forceinline__ double moe_warp_sum(double v) {
    for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(MOE_FULL_MASK, v, off);
    return v;
}

/* Max with NaN winning (the C kernels' "has_nan → NaN" rule). */
__device__ __forceinline__ double moe_warp_max_nan(double v) {
    for (int off = 16; off > 0; off >>= 1) {
        double o = __shfl_xor_sync(MOE_FULL_MASK, v, off);
        v = (o != o || o > v) ? o : v;
    }
    return v;
}

/* Sum over a block of `threads` (a multiple of 32, at most 1024); every thread gets the result.
 * Warp sums first, then warp 0 adds the warp totals in warp order. `smem` holds 33 doubles. */
__device__ __forceinline__ double moe_block_sum(double v, double *smem) {
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, nwarps = blockDim.x / 32;
    v = moe_warp_sum(v);
    __syncthreads(); /* smem may still be read by a previous call */
    if (lane == 0) smem[warp] = v;
    __syncthreads();
    if (warp == 0) {
        double w = lane < nwarps ? smem[lane] : 0.0;
        w = moe_warp_sum(w);
        if (lane == 0) smem[32] = w;
    }
    __syncthreads();
    return smem[32];
}

/*
 * Stage one of a column sum: partial[chunk, c] = Σ_{t in chunk, not padded} x[t, c] in fp64.
 * MAP = 1 counts nonzero bytes of a bool map instead (exact in fp64 up to 2^53).
 * Grid (ceil(C / 32), moe_col_chunks(T)), block 32 x MOE_COL_ROWS; lanes run along the columns,
 * so a warp reads 32 consecutive elements of a row. The MOE_COL_ROWS row partials are added in
 * row order.
 */
template <int MAP>
__global__ void __launch_bounds__(32 * MOE_COL_ROWS)
moe_col_partial_kernel(double *partial, const void *x, moe_dtype_t dt, const uint8_t *pad,
                       int64_t num_tokens, int64_t num_cols, int64_t chunk_len) {
    __shared__ double red[MOE_COL_ROWS][32];
    const int lane = threadIdx.x % 32, row = threadIdx.x / 32;
    const int64_t c = (int64_t)blockIdx.x * 32 + lane, chunk = blockIdx.y;
    const int64_t t0 = chunk * chunk_len;
    const int64_t t1 = t0 + chunk_len < num_tokens ? t0 + chunk_len : num_tokens;
    double acc = 0.0;
    if (c < num_cols) {
        for (int64_t t = t0 + row; t < t1; t += MOE_COL_ROWS) {
            if (is_pad(pad, t)) continue;
            const int64_t i = t * num_cols + c;
            acc += MAP ? (double)(((const uint8_t *)x)[i] != 0) : moe_load(x, dt, i);
        }
    }
    red[row][lane] = acc;
    __syncthreads();
    if (row == 0 && c < num_cols) {
        double s = 0.0;
        for (int r = 0; r < MOE_COL_ROWS; ++r) s += red[r][lane];
        partial[chunk * num_cols + c] = s;
    }
}

/* Stage two for one column: the chunk partials of column c in chunk order. */
__device__ __forceinline__ double moe_col_total(const double *partial, int64_t nchunks,
                                                int64_t num_cols, int64_t c) {
    double s = 0.0;
    for (int64_t i = 0; i < nchunks; ++i) s += partial[i * num_cols + c];
    return s;
}

/* Launches stage one (nothing for 0 tokens). */
static inline moe_status_t moe_launch_col_partial(int map, double *partial, const void *x,
                                                  moe_dtype_t dt, const uint8_t *pad,
                                                  int64_t num_tokens, int64_t num_cols,
                                                  cudaStream_t stream) {
    const int64_t nchunks = moe_col_chunks(num_tokens);
    if (nchunks == 0) return MOE_OK;
    dim3 grid((unsigned)moe_ceil_div(num_cols, 32), (unsigned)nchunks);
    if (map)
        moe_col_partial_kernel<1><<<grid, 32 * MOE_COL_ROWS, 0, stream>>>(
            partial, x, dt, pad, num_tokens, num_cols, moe_col_chunk_len(num_tokens));
    else
        moe_col_partial_kernel<0><<<grid, 32 * MOE_COL_ROWS, 0, stream>>>(
            partial, x, dt, pad, num_tokens, num_cols, moe_col_chunk_len(num_tokens));
    MOE_CHECK_LAUNCH("moe_col_partial_kernel");
    return MOE_OK;
}

/* "a ranks before b": larger first, NaN above everything, ties to the lower index (the same
 * rule as moe_topk_before in router_topk_math.h, on int indices). */
__device__ __forceinline__ int moe_bal_before(double a, int ia, double b, int ib) {
    int na = a != a, nb = b != b;
    if (na || nb) return na && (!nb || ia < ib);
    if (a != b) return a > b;
    return ia < ib;
}

/*
 * Top-k of one row into its bool map, by one warp: k rounds of a warp arg-max under
 * moe_bal_before over the values vals[base + e] (`vdt`). The map row is the "taken" set: lane
 * e % 32 owns element e (it zeroes it, reads it, sets it, and is the lane that wrote vals[e]),
 * so no lane needs another lane's writes. Needs k <= E.
 */
__device__ __forceinline__ void moe_warp_topk_map(uint8_t *map_row, int64_t E, int64_t k,
                                                  int lane, const void *vals, moe_dtype_t vdt,
                                                  int64_t base) {
    for (int64_t e = lane; e < E; e += 32) map_row[e] = 0;
    for (int64_t r = 0; r < k; ++r) {
        double bv = -INFINITY;
        int bi = 0x7fffffff; /* any untaken element ranks before this sentinel */
        for (int64_t e = lane; e < E; e += 32) {
            if (map_row[e]) continue;
            double v = moe_load(vals, vdt, base + e);
            if (moe_bal_before(v, (int)e, bv, bi)) bv = v, bi = (int)e;
        }
        for (int off = 16; off > 0; off >>= 1) {
            double ov = __shfl_xor_sync(MOE_FULL_MASK, bv, off);
            int oi = __shfl_xor_sync(MOE_FULL_MASK, bi, off);
            if (moe_bal_before(ov, oi, bv, bi)) bv = ov, bi = oi;
        }
        if (bi % 32 == lane) map_row[bi] = 1;
    }
}

/* Max and 1/Σ exp(x − max) of a row, warp-reduced: the C kernels' softmax_stats (round_inputs:
 * each logit first rounded to the compute precision, as aux_loss_scores.c) or act_softmax_stats
 * (plain loads, as sinkhorn.c). */
__device__ __forceinline__ void moe_warp_softmax_stats(int fp64, int round_inputs, const void *x,
                                                       moe_dtype_t dt, int64_t base, int64_t E,
                                                       int lane, double *m_out, double *inv_out) {
    double m = -INFINITY;
    for (int64_t e = lane; e < E; e += 32) {
        const double v = round_inputs ? load_c(x, dt, base + e) : moe_load(x, dt, base + e);
        m = (v != v || v > m) ? v : m;
    }
    m = moe_warp_max_nan(m);
    double sum = 0.0;
    for (int64_t e = lane; e < E; e += 32) {
        const double v = round_inputs ? load_c(x, dt, base + e) : moe_load(x, dt, base + e);
        sum += rnd(fp64, exp(rnd(fp64, v - m)));
    }
    sum = moe_warp_sum(sum);
    *m_out = m;
    *inv_out = rnd(fp64, 1.0 / rnd(fp64, sum));
}

#endif /* MOE_CORE_BALANCING_CUDA_CUH_ */
