/*
 * glu_probs.cu: the expert activation (GLU-aware) and the router-probs multiply in one pass, CUDA.
 *
 * Streaming kernels: the forward reads a's gate and linear halves (or interleaved blocks, whole
 * vectors of them when the block size is a multiple of the vector) and writes h with 16-byte
 * vector accesses (one thread per vector of h), the row's prob read once per vector; the
 * backward gives each row to one warp, writes both halves of grad_a with vector stores and sums
 * grad_probs in registers. Both run their element math on floats whenever the dtypes allow (all
 * but fp64), the same bits as the double functions the CPU calls. The backward can also write the
 * forward's h, recomputed, and can run in place (grad_a over a, h over grad_h): the expert MLP's
 * backward then needs no buffer of its own for either. The element math is glu_probs_math.h, the
 * same functions the CPU runs. Eager's rounding points make that math long enough that the
 * backward issues instructions, not bytes, at its limit: in both kernels Megatron's default
 * configuration (SwiGLU, probs, no clamp) gets its own copy of the row loop with those context
 * fields as constants, so the activation switch and the rounding points' dtype tests fold away.
 *
 * The one idea: grad_probs needs no atomics and no second pass, and is the CPU's bits. Each lane
 * accumulates the chunks j ≡ lane (mod 32) of its row in fp64, in element order, and the warp folds
 * the 32 partial sums by the xor butterfly; csrc/glu_probs.c sums in exactly that order.
 */
#include "cuda_common.cuh"
#include "../glu_probs_math.h"

/* 16-byte vectors each lane of the forward has in flight (one at a time, a warp waits out a
 * whole DRAM latency per vector). The backward keeps one chunk ahead (moe_gp_bwd_row_vec):
 * loading four chunks' three vectors first took its registers past half the file, and it ran at
 * less than half the speed. */
#define MOE_GP_UNROLL 4

/* moe_gp_vec, moe_gp_vget/vset and moe_gp_vec_fwd (16-byte vectors of one dtype) live in
 * glu_probs_math.h, beside the element math they vectorise.
 *
 * Template arguments of both kernels: DT the dtype; VEC: 16-byte accesses (F a multiple of the
 * vector length, aligned pointers), else one element at a time; FLT: moe_gp_float_math holds, so
 * the element math runs on floats (the _f functions; the same bits as the double ones). */

/* Megatron's default configuration, SwiGLU with the probs multiply in fp32 and no clamp: whether
 * c is it (the float math only), and c with those fields as constants, for the row loops' own
 * copy (the linear offset and the probs stay values: adding 0.0f is no identity for -0). */
template <int DT, bool FLT>
__device__ __forceinline__ bool moe_gp_is_swiglu(const moe_gp_ctx_t &c) {
    return FLT && DT != MOE_DTYPE_FP64 && c.act == MOE_ACT_SILU && c.gated && !c.has_clamp &&
           c.has_probs && c.prod_dtype == MOE_DTYPE_FP32;
}

__device__ __forceinline__ moe_gp_ctx_t moe_gp_swiglu_ctx(moe_gp_ctx_t c) {
    c.act = MOE_ACT_SILU, c.gated = 1, c.has_clamp = 0, c.has_probs = 1;
    c.prod_dtype = MOE_DTYPE_FP32;
    return c;
}

/* One row of the forward's vectors: MOE_GP_UNROLL vectors per lane in flight, their loads
 * first, then the math and the stores (each lane still walks j, j + 32, ... in order). c by
 * value, as moe_gp_bwd_row_vec takes it. */
template <int DT, bool FLT>
__device__ __forceinline__ void moe_gp_fwd_row_vec(const moe_gp_ctx_t c, char *hrow,
                                                   const char *arow, int64_t ffn, double p,
                                                   int lane) {
    constexpr int n = moe_gp_vec_n<DT>();
    constexpr int64_t esz = 16 / n;
    const int64_t per_row = ffn / n;
    for (int64_t j0 = lane; j0 < per_row; j0 += 32 * MOE_GP_UNROLL) {
        uint4 g[MOE_GP_UNROLL], l[MOE_GP_UNROLL];
#pragma unroll
        for (int u = 0; u < MOE_GP_UNROLL; ++u) {
            const int64_t j = j0 + 32 * u;
            if (j < per_row) {
                g[u] = *(const uint4 *)(arow + moe_gp_gate_col(&c, j * n) * esz);
                l[u] = c.gated ? *(const uint4 *)(arow + moe_gp_lin_col(&c, ffn, j * n) * esz)
                               : make_uint4(0, 0, 0, 0);
            }
        }
        /* the math is large enough that the compiler keeps this loop rolled: the next vector
         * moves to slot 0 instead of being indexed by u (that would put the vectors in local
         * memory) */
#pragma unroll 1
        for (int u = 0; u < MOE_GP_UNROLL; ++u) {
            const int64_t j = j0 + 32 * u;
            if (j < per_row) *(uint4 *)(hrow + j * 16) = moe_gp_vec_fwd<DT, FLT>(&c, g[0], l[0], p);
#pragma unroll
            for (int v = 0; v + 1 < MOE_GP_UNROLL; ++v) g[v] = g[v + 1], l[v] = l[v + 1];
        }
    }
}

/* h [R, F] ← a [R, F1] (F1 = 2F with GLU), probs [R] or NULL. Warps walk the rows; in a row,
 * lane j takes the vectors j, j + 32, ..., so a warp's accesses are 512 contiguous bytes and no
 * thread divides an index. The row's prob is read once per row. */
template <int DT, bool VEC, bool FLT>
__global__ void __launch_bounds__(256) moe_glu_probs_fwd_kernel(void *__restrict__ h,
                                                                const void *__restrict__ a,
                                                                const void *probs, int64_t num_rows,
                                                                int64_t ffn, moe_gp_ctx_t ctx) {
    moe_gp_ctx_t c = ctx;
    c.dtype = (moe_dtype_t)DT; /* a compile-time constant from here on */
    constexpr int n = VEC ? moe_gp_vec_n<DT>() : 1;
    constexpr int64_t esz = DT == MOE_DTYPE_FP64 ? 8 : (DT == MOE_DTYPE_FP32 ? 4 : 2);
    const int lane = threadIdx.x % 32;
    const int64_t width = c.gated ? 2 * ffn : ffn, per_row = ffn / n;
    const int64_t warps = (int64_t)gridDim.x * (blockDim.x / 32);
    const bool swiglu = moe_gp_is_swiglu<DT, FLT>(c);
    for (int64_t r = (int64_t)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32; r < num_rows;
         r += warps) {
        const double p = c.has_probs ? moe_load(probs, c.probs_dtype, r) : 1.0;
        const char *arow = (const char *)a + r * width * esz;
        char *hrow = (char *)h + r * ffn * esz;
        if (VEC) {
            if (swiglu)
                moe_gp_fwd_row_vec<DT, FLT>(moe_gp_swiglu_ctx(c), hrow, arow, ffn, p, lane);
            else
                moe_gp_fwd_row_vec<DT, FLT>(c, hrow, arow, ffn, p, lane);
        } else {
            for (int64_t j = lane; j < per_row; j += 32) {
                const double g = moe_load(arow, c.dtype, moe_gp_gate_col(&c, j));
                const double l = c.gated ? moe_load(arow, c.dtype, moe_gp_lin_col(&c, ffn, j))
                                         : 0.0;
                const double v = FLT ? (double)moe_gp_elem_fwd_f(&c, (float)g, (float)l, (float)p)
                                     : moe_gp_elem_fwd(&c, g, l, p);
                moe_store(hrow, c.dtype, j, v);
            }
        }
    }
}

/* One row's vectors for moe_glu_probs_bwd_kernel: lane's chunks j = lane, lane + 32, ... (16
 * bytes each), its fp64 partial of grad_probs returned. The next chunk's three vectors are loaded
 * before this chunk's math and stores, so a load round trip is in flight behind the math (the
 * sum still takes the chunks in order). c comes by value: a caller passing constants for some of
 * its fields gets a copy of the loop with their branches folded away. */
template <int DT, bool FLT>
__device__ __forceinline__ double moe_gp_bwd_row_vec(const moe_gp_ctx_t c, void *grad_a, void *h,
                                                     const void *grad_h, const void *a,
                                                     int64_t r, int64_t ffn, int64_t width,
                                                     int64_t nchunks, double p, int lane) {
    constexpr int n = moe_gp_vec_n<DT>();
    constexpr int64_t esz = 16 / n;
    const float pf = (float)p;
    double acc = 0.0;
    const char *dy_row = (const char *)grad_h + r * ffn * esz;
    const char *a_row = (const char *)a + r * width * esz;
    char *ga_row = (char *)grad_a + r * width * esz;
    char *h_row = h ? (char *)h + r * ffn * esz : NULL;
    const uint4 zero = make_uint4(0, 0, 0, 0);
    moe_gp_vec dy, g, l;
    dy.u = g.u = l.u = zero;
    if (lane < nchunks) {
        dy.u = *(const uint4 *)(dy_row + lane * 16);
        g.u = *(const uint4 *)(a_row + moe_gp_gate_col(&c, lane * n) * esz);
        if (c.gated) l.u = *(const uint4 *)(a_row + moe_gp_lin_col(&c, ffn, lane * n) * esz);
    }
    for (int64_t j = lane; j < nchunks; j += 32) {
        moe_gp_vec ndy, ng, nl, gg, gl, hv;
        ndy.u = ng.u = nl.u = zero;
        if (j + 32 < nchunks) {
            ndy.u = *(const uint4 *)(dy_row + (j + 32) * 16);
            ng.u = *(const uint4 *)(a_row + moe_gp_gate_col(&c, (j + 32) * n) * esz);
            if (c.gated)
                nl.u = *(const uint4 *)(a_row + moe_gp_lin_col(&c, ffn, (j + 32) * n) * esz);
        }
#pragma unroll
        for (int e = 0; e < n; ++e) {
            if constexpr (FLT && DT != MOE_DTYPE_FP64) {
                float vg, vl, term, vh;
                moe_gp_elem_bwd_f(&c, moe_gp_vgetf<DT>(dy, e), moe_gp_vgetf<DT>(g, e),
                                  c.gated ? moe_gp_vgetf<DT>(l, e) : 0.0f, pf, &vg, &vl, &term,
                                  &vh);
                moe_gp_vsetf<DT>(gg, e, vg);
                moe_gp_vsetf<DT>(gl, e, vl);
                moe_gp_vsetf<DT>(hv, e, vh);
                acc = __dadd_rn(acc, (double)term);
            } else {
                double vg, vl, term, vh;
                moe_gp_elem_bwd(&c, moe_gp_vget<DT>(dy, e), moe_gp_vget<DT>(g, e),
                                c.gated ? moe_gp_vget<DT>(l, e) : 0.0, p, &vg, &vl, &term, &vh);
                moe_gp_vset<DT>(gg, e, vg);
                moe_gp_vset<DT>(gl, e, vl);
                moe_gp_vset<DT>(hv, e, vh);
                acc = __dadd_rn(acc, term);
            }
        }
        *(uint4 *)(ga_row + moe_gp_gate_col(&c, j * n) * esz) = gg.u;
        if (c.gated) *(uint4 *)(ga_row + moe_gp_lin_col(&c, ffn, j * n) * esz) = gl.u;
        if (h_row) *(uint4 *)(h_row + j * 16) = hv.u;
        dy = ndy, g = ng, l = nl;
    }
    return acc;
}

/* One warp per row: grad_a [R, F1], grad_probs [R] (or NULL) and, when h is not NULL, the
 * forward's h [R, F] recomputed, ← grad_h [R, F], a, probs. Chunks of `chunk` elements
 * (moe_gp_chunk): VEC loads each as one 16-byte vector. grad_a may be a and h may be grad_h: each
 * element is read before it is written, by the thread that writes it. At least five blocks an
 * SM: left free, ptxas gives the two copies of the row loop over 100 registers and the SM four
 * blocks; bounded at five it needs no spills. */
template <int DT, bool VEC, bool FLT>
__global__ void __launch_bounds__(128, 5) moe_glu_probs_bwd_kernel(void *grad_a, void *grad_probs,
                                                                void *h, const void *grad_h,
                                                                const void *a, const void *probs,
                                                                int64_t num_rows, int64_t ffn,
                                                                int64_t chunk, moe_gp_ctx_t ctx) {
    moe_gp_ctx_t c = ctx;
    c.dtype = (moe_dtype_t)DT;
    const int lane = threadIdx.x % 32;
    const int64_t width = c.gated ? 2 * ffn : ffn, nchunks = ffn / chunk;
    const int64_t warps = (int64_t)gridDim.x * (blockDim.x / 32);
    const bool swiglu = moe_gp_is_swiglu<DT, FLT>(c);
    for (int64_t r = (int64_t)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32; r < num_rows;
         r += warps) {
        const double p = c.has_probs ? moe_load(probs, c.probs_dtype, r) : 1.0;
        double acc = 0.0;
        if (VEC) {
            acc = swiglu ? moe_gp_bwd_row_vec<DT, FLT>(moe_gp_swiglu_ctx(c), grad_a, h, grad_h, a,
                                                       r, ffn, width, nchunks, p, lane)
                         : moe_gp_bwd_row_vec<DT, FLT>(c, grad_a, h, grad_h, a, r, ffn, width,
                                                       nchunks, p, lane);
        } else {
            for (int64_t j = lane; j < nchunks; j += 32) {
                const int64_t f = j * chunk;
                for (int64_t e = 0; e < chunk; ++e) {
                    const int64_t gc = r * width + moe_gp_gate_col(&c, f + e);
                    const int64_t lc = r * width + moe_gp_lin_col(&c, ffn, f + e);
                    double vg, vl, term, vh;
                    moe_gp_elem_bwd(&c, moe_load(grad_h, c.dtype, r * ffn + f + e),
                                    moe_load(a, c.dtype, gc),
                                    c.gated ? moe_load(a, c.dtype, lc) : 0.0,
                                    p, &vg, &vl, &term, &vh);
                    moe_store(grad_a, c.dtype, gc, vg);
                    if (c.gated) moe_store(grad_a, c.dtype, lc, vl);
                    if (h) moe_store(h, c.dtype, r * ffn + f + e, vh);
                    acc = __dadd_rn(acc, term);
                }
            }
        }
        if (grad_probs) { /* warp-uniform branch: every lane takes part in the shuffles */
#pragma unroll
            for (int off = 16; off >= 1; off /= 2)
                acc = __dadd_rn(acc, __shfl_xor_sync(0xffffffffu, acc, off));
            if (lane == 0) moe_store(grad_probs, c.probs_dtype, r, moe_gp_grad_probs_round(&c, acc));
        }
    }
}

static int moe_gp_aligned(const void *p) { return ((uintptr_t)p & 15u) == 0; }

/* Picks the dtype instantiation: the one switch the templates replace. */
#define MOE_GP_DISPATCH(dtype, DT, ...)                                    \
    switch (dtype) {                                                       \
    case MOE_DTYPE_FP32: { constexpr int DT = MOE_DTYPE_FP32; __VA_ARGS__; break; } \
    case MOE_DTYPE_FP64: { constexpr int DT = MOE_DTYPE_FP64; __VA_ARGS__; break; } \
    case MOE_DTYPE_FP16: { constexpr int DT = MOE_DTYPE_FP16; __VA_ARGS__; break; } \
    case MOE_DTYPE_BF16: { constexpr int DT = MOE_DTYPE_BF16; __VA_ARGS__; break; } \
    default: return moe_fail(MOE_ERR_INVALID_ARGUMENT, "dtype must be a float dtype"); \
    }

static unsigned moe_gp_grid(int64_t work, int64_t per_block) {
    const int64_t b = (work + per_block - 1) / per_block;
    return (unsigned)(b < (int64_t)1 << 30 ? b : (int64_t)1 << 30);
}

extern "C" moe_status_t moe_cuda_glu_probs_fwd(void *h, const void *a, const void *probs,
                                               int64_t num_rows, int64_t ffn, moe_dtype_t dtype,
                                               moe_dtype_t probs_dtype,
                                               const moe_glu_probs_params_t *params,
                                               void *workspace, size_t workspace_bytes,
                                               void *stream) {
    (void)workspace, (void)workspace_bytes;
    moe_clear_error();
    MOE_TRY(moe_gp_check_args(h, a, num_rows, ffn, dtype, probs, probs_dtype, params));
    if (num_rows == 0) return MOE_OK;
    const moe_gp_ctx_t c = moe_gp_ctx_make(params, dtype, probs != NULL, probs_dtype);
    const int64_t n = 16 / (int64_t)moe_dtype_size(dtype);
    /* vectors of h's columns stay inside one interleaved block: n divides the block size */
    const int vec = ffn % n == 0 && c.interleave % n == 0 && moe_gp_aligned(a) &&
                    moe_gp_aligned(h);
    const int flt = moe_gp_float_math(&c);
    const unsigned grid = moe_gp_grid(num_rows, 8); /* 8 warps, a row at a time each */
    cudaStream_t s = (cudaStream_t)stream;
    MOE_GP_DISPATCH(dtype, DT, {
        if (vec && flt)
            moe_glu_probs_fwd_kernel<DT, true, true><<<grid, 256, 0, s>>>(h, a, probs, num_rows, ffn, c);
        else if (vec)
            moe_glu_probs_fwd_kernel<DT, true, false><<<grid, 256, 0, s>>>(h, a, probs, num_rows, ffn, c);
        else if (flt)
            moe_glu_probs_fwd_kernel<DT, false, true><<<grid, 256, 0, s>>>(h, a, probs, num_rows, ffn, c);
        else
            moe_glu_probs_fwd_kernel<DT, false, false><<<grid, 256, 0, s>>>(h, a, probs, num_rows, ffn, c);
    });
    MOE_CHECK_LAUNCH("moe_glu_probs_fwd_kernel");
    return MOE_OK;
}

extern "C" moe_status_t moe_cuda_glu_probs_bwd(void *grad_a, void *grad_probs, void *h,
                                               const void *grad_h,
                                               const void *a, const void *probs, int64_t num_rows,
                                               int64_t ffn, moe_dtype_t dtype,
                                               moe_dtype_t probs_dtype,
                                               const moe_glu_probs_params_t *params,
                                               void *workspace, size_t workspace_bytes,
                                               void *stream) {
    (void)workspace, (void)workspace_bytes;
    moe_clear_error();
    MOE_TRY(moe_gp_check_args(grad_a, a, num_rows, ffn, dtype, probs, probs_dtype, params));
    MOE_CHECK(num_rows == 0 || grad_h, "grad_h must not be NULL");
    MOE_CHECK(!grad_probs || probs, "grad_probs needs probs (there is no multiply without them)");
    if (num_rows == 0) return MOE_OK;
    const moe_gp_ctx_t c = moe_gp_ctx_make(params, dtype, probs != NULL, probs_dtype);
    const int64_t chunk = moe_gp_chunk(dtype, ffn);
    const int vec = chunk > 1 && c.interleave % chunk == 0 && moe_gp_aligned(a) &&
                    moe_gp_aligned(grad_a) &&
                    moe_gp_aligned(grad_h) && (!h || moe_gp_aligned(h));
    const int flt = moe_gp_float_math(&c);
    cudaStream_t s = (cudaStream_t)stream;
    const unsigned grid = moe_gp_grid(num_rows, 4); /* 4 warps, one row each */
    MOE_GP_DISPATCH(dtype, DT, {
        if (vec && flt)
            moe_glu_probs_bwd_kernel<DT, true, true><<<grid, 128, 0, s>>>(
                grad_a, grad_probs, h, grad_h, a, probs, num_rows, ffn, chunk, c);
        else if (vec)
            moe_glu_probs_bwd_kernel<DT, true, false><<<grid, 128, 0, s>>>(
                grad_a, grad_probs, h, grad_h, a, probs, num_rows, ffn, chunk, c);
        else
            moe_glu_probs_bwd_kernel<DT, false, false><<<grid, 128, 0, s>>>(
                grad_a, grad_probs, h, grad_h, a, probs, num_rows, ffn, chunk, c);
    });
    MOE_CHECK_LAUNCH("moe_glu_probs_bwd_kernel");
    return MOE_OK;
}
