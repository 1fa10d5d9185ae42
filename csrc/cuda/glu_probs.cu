/*
 * glu_probs.cu: the expert activation (GLU-aware) and the router-probs multiply in one pass, CUDA.
 *
 * A bandwidth kernel: the forward reads a's gate and linear halves and writes h with 16-byte
 * vector accesses (one thread per vector of h), the row's prob read once per vector; the
 * backward gives each row to one warp, writes both halves of grad_a with vector stores and sums
 * grad_probs in registers. The element math is glu_probs_math.h, the same functions the CPU runs.
 *
 * The one idea: grad_probs needs no atomics and no second pass, and is the CPU's bits. Each lane
 * accumulates the chunks j ≡ lane (mod 32) of its row in fp64, in element order, and the warp folds
 * the 32 partial sums by the xor butterfly; csrc/glu_probs.c sums in exactly that order.
 */
#include "cuda_common.cuh"
#include "../glu_probs_math.h"

/* moe_gp_vec, moe_gp_vget/vset and moe_gp_vec_fwd (16-byte vectors of one dtype) live in
 * glu_probs_math.h: the grouped GEMM's fused epilogue runs the same element loop. */

/* h [R, F] ← a [R, F1] (F1 = 2F with GLU), probs [R] or NULL. VEC: 16-byte accesses (F % n == 0
 * and aligned pointers), else one element per thread. */
template <int DT, bool VEC>
__global__ void __launch_bounds__(256) moe_glu_probs_fwd_kernel(void *h, const void *a, const void *probs,
                                                                int64_t num_rows, int64_t ffn,
                                                                moe_gp_ctx_t ctx) {
    moe_gp_ctx_t c = ctx;
    c.dtype = (moe_dtype_t)DT; /* a compile-time constant from here on */
    constexpr int n = VEC ? moe_gp_vec_n<DT>() : 1;
    const int64_t per_row = ffn / n, width = c.gated ? 2 * ffn : ffn;
    const int64_t total = num_rows * per_row;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (int64_t)gridDim.x * blockDim.x) {
        const int64_t r = i / per_row, f = (i - r * per_row) * n;
        const double p = c.has_probs ? moe_load(probs, c.probs_dtype, r) : 1.0;
        if (VEC) {
            const uint4 g = *(const uint4 *)((const char *)a +
                                             (r * width + f) * (int64_t)sizeof(uint4) / n);
            const uint4 l = c.gated ? *(const uint4 *)((const char *)a + (r * width + ffn + f) *
                                                                            (int64_t)sizeof(uint4) / n)
                                    : make_uint4(0, 0, 0, 0);
            *(uint4 *)((char *)h + (r * ffn + f) * (int64_t)sizeof(uint4) / n) =
                moe_gp_vec_fwd<DT>(&c, g, l, p);
        } else {
            const double g = moe_load(a, c.dtype, r * width + f);
            const double l = c.gated ? moe_load(a, c.dtype, r * width + ffn + f) : 0.0;
            moe_store(h, c.dtype, r * ffn + f, moe_gp_elem_fwd(&c, g, l, p));
        }
    }
}

/* One warp per row: grad_a [R, F1], grad_probs [R] (or NULL) ← grad_h [R, F], a, probs.
 * Chunks of `chunk` elements (moe_gp_chunk): VEC loads each as one 16-byte vector. */
template <int DT, bool VEC>
__global__ void __launch_bounds__(128) moe_glu_probs_bwd_kernel(void *grad_a, void *grad_probs,
                                                                const void *grad_h, const void *a,
                                                                const void *probs, int64_t num_rows,
                                                                int64_t ffn, int64_t chunk,
                                                                moe_gp_ctx_t ctx) {
    moe_gp_ctx_t c = ctx;
    c.dtype = (moe_dtype_t)DT;
    constexpr int n = moe_gp_vec_n<DT>();
    const int lane = threadIdx.x % 32;
    const int64_t width = c.gated ? 2 * ffn : ffn, nchunks = ffn / chunk;
    const int64_t warps = (int64_t)gridDim.x * (blockDim.x / 32);
    for (int64_t r = (int64_t)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32; r < num_rows;
         r += warps) {
        const double p = c.has_probs ? moe_load(probs, c.probs_dtype, r) : 1.0;
        double acc = 0.0;
        for (int64_t j = lane; j < nchunks; j += 32) {
            const int64_t f = j * chunk;
            if (VEC) {
                moe_gp_vec dy, g, l, gg, gl;
                dy.u = *(const uint4 *)((const char *)grad_h + (r * ffn + f) * (int64_t)sizeof(uint4) / n);
                g.u = *(const uint4 *)((const char *)a + (r * width + f) * (int64_t)sizeof(uint4) / n);
                if (c.gated)
                    l.u = *(const uint4 *)((const char *)a +
                                            (r * width + ffn + f) * (int64_t)sizeof(uint4) / n);
#pragma unroll
                for (int e = 0; e < n; ++e) {
                    double vg, vl, term;
                    moe_gp_elem_bwd(&c, moe_gp_vget<DT>(dy, e), moe_gp_vget<DT>(g, e),
                                    c.gated ? moe_gp_vget<DT>(l, e) : 0.0, p, &vg, &vl, &term);
                    moe_gp_vset<DT>(gg, e, vg);
                    moe_gp_vset<DT>(gl, e, vl);
                    acc = __dadd_rn(acc, term);
                }
                *(uint4 *)((char *)grad_a + (r * width + f) * (int64_t)sizeof(uint4) / n) = gg.u;
                if (c.gated)
                    *(uint4 *)((char *)grad_a + (r * width + ffn + f) * (int64_t)sizeof(uint4) / n) =
                        gl.u;
            } else {
                for (int64_t e = 0; e < chunk; ++e) {
                    double vg, vl, term;
                    moe_gp_elem_bwd(&c, moe_load(grad_h, c.dtype, r * ffn + f + e),
                                    moe_load(a, c.dtype, r * width + f + e),
                                    c.gated ? moe_load(a, c.dtype, r * width + ffn + f + e) : 0.0,
                                    p, &vg, &vl, &term);
                    moe_store(grad_a, c.dtype, r * width + f + e, vg);
                    if (c.gated) moe_store(grad_a, c.dtype, r * width + ffn + f + e, vl);
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
    const int vec = ffn % n == 0 && moe_gp_aligned(a) && moe_gp_aligned(h);
    const int64_t work = num_rows * (vec ? ffn / n : ffn);
    cudaStream_t s = (cudaStream_t)stream;
    MOE_GP_DISPATCH(dtype, DT, {
        if (vec)
            moe_glu_probs_fwd_kernel<DT, true><<<moe_gp_grid(work, 256), 256, 0, s>>>(
                h, a, probs, num_rows, ffn, c);
        else
            moe_glu_probs_fwd_kernel<DT, false><<<moe_gp_grid(work, 256), 256, 0, s>>>(
                h, a, probs, num_rows, ffn, c);
    });
    MOE_CHECK_LAUNCH("moe_glu_probs_fwd_kernel");
    return MOE_OK;
}

extern "C" moe_status_t moe_cuda_glu_probs_bwd(void *grad_a, void *grad_probs, const void *grad_h,
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
    const int vec = chunk > 1 && moe_gp_aligned(a) && moe_gp_aligned(grad_a) &&
                    moe_gp_aligned(grad_h);
    cudaStream_t s = (cudaStream_t)stream;
    const unsigned grid = moe_gp_grid(num_rows, 4); /* 4 warps, one row each */
    MOE_GP_DISPATCH(dtype, DT, {
        if (vec)
            moe_glu_probs_bwd_kernel<DT, true><<<grid, 128, 0, s>>>(
                grad_a, grad_probs, grad_h, a, probs, num_rows, ffn, chunk, c);
        else
            moe_glu_probs_bwd_kernel<DT, false><<<grid, 128, 0, s>>>(
                grad_a, grad_probs, grad_h, a, probs, num_rows, ffn, chunk, c);
    });
    MOE_CHECK_LAUNCH("moe_glu_probs_bwd_kernel");
    return MOE_OK;
}
