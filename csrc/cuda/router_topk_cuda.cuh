/*
 * router_topk_cuda.cuh: what the CUDA router kernels share: the warp layout of a row, the warp
 * reductions, the 64-bit selection keys of the fp32 kernels, the host-side checks and launch
 * helpers, and the launches of the two fused fp32 kernels, which router_topk.cu's dispatch calls.
 *
 *     router_topk.cu         the forward's dispatch and entry points; the fp64 warp kernel, the
 *                            thread-per-token fallback and the extras kernel of those two paths
 *     router_topk_warp32.cu  the fused fp32 kernel, strided layout (expert lane + 32·i)
 *     router_topk_lanes.cu   the fused fp32 kernel, lanes layout (a lane holds neighbours)
 *     router_topk_bwd.cu     the backward: the probs' gradient (both layouts) and the lse's
 *
 * The one idea: every kernel ranks, reduces and rounds with these helpers and the C core's row
 * math (../router_topk_math.h), so which kernel a row takes changes its speed, never its bits.
 */
#ifndef MOE_CORE_ROUTER_TOPK_CUDA_CUH_
#define MOE_CORE_ROUTER_TOPK_CUDA_CUH_

#include "cuda_common.cuh"
#include "../router_topk_math.h"

#define MOE_FULL_MASK 0xffffffffu
#define MOE_ROUTER_WARPS 4 /* tokens per block */
#define MOE_ROUTER32_WARPS 8 /* tokens per block of the fused fp32 kernel */
#define MOE_ROUTER_MAX_VPL 32

static inline int64_t row_words(const moe_router_topk_params_t *p) {
    return moe_topk_scratch_words(moe_topk_scratch_k(p), p->num_groups) + p->topk;
}

/* Values per lane for a row of num_experts: the smallest power of two >= E / 32, or 0 when the
 * warp kernel does not apply (the fallback then runs). */
static inline int warp_vpl(int64_t num_experts, int64_t num_groups) {
    if (num_groups > 32) return 0;
    for (int v = 1; v <= MOE_ROUTER_MAX_VPL; v *= 2)
        if (num_experts <= 32 * (int64_t)v) return v;
    return 0;
}

__device__ __forceinline__ double warp_sum(double v) {
    for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(MOE_FULL_MASK, v, off);
    return v;
}

/* Row max with NaN winning, as moe_topk_softmax_stats does. */
__device__ __forceinline__ double warp_max_nan(double v) {
    for (int off = 16; off > 0; off >>= 1) {
        double o = __shfl_xor_sync(MOE_FULL_MASK, v, off);
        v = (o != o || o > v) ? o : v;
    }
    return v;
}

/* Softmax stats of row `base` (max, 1/sum), reduced across the warp. `fp32_points` rounds the
 * terms as the forward does; the backward passes a ctx with fp64 set. */
template <int VPL>
__device__ __forceinline__ void warp_softmax_stats(const moe_topk_ctx_t *c, const void *logits,
                                                   int64_t base, int lane, double *m_out,
                                                   double *inv_out) {
    double m = -INFINITY;
#pragma unroll
    for (int i = 0; i < VPL; ++i) {
        int64_t e = lane + 32 * i;
        if (e < c->num_experts) {
            double x = moe_load(logits, c->dtype, base + e);
            m = (x != x || x > m) ? x : m;
        }
    }
    m = warp_max_nan(m);
    double sum = 0.0;
#pragma unroll
    for (int i = 0; i < VPL; ++i) {
        int64_t e = lane + 32 * i;
        if (e < c->num_experts)
            sum += moe_cround(c, exp(moe_cround(c, moe_load(logits, c->dtype, base + e) - m)));
    }
    sum = warp_sum(sum);
    *m_out = m;
    *inv_out = moe_cround(c, 1.0 / moe_cround(c, sum));
}

/* ---- the fp32 fast path ---------------------------------------------------------------------
 * Below fp64 every selection score is an fp32 value (Megatron's rounding points), so a score and
 * its expert id pack into one 64-bit key whose unsigned order is exactly moe_topk_before's: the
 * score's bits made monotone in the high word (NaN above +inf), the complement of the id in the
 * low word (ties to the lower id). An arg-max round is then two 32-bit warp max reductions
 * (redux.sync) instead of five double+int64 shuffle-and-compare steps. */

__device__ __forceinline__ uint32_t order_bits(float v) {
    const uint32_t u = __float_as_uint(v);
    if (v != v) return 0xffffffffu;
    return u ^ ((uint32_t)((int32_t)u >> 31) | 0x80000000u); /* negative: ~u; else: u | sign */
}

/* order_bits with -0 ranked as +0 (-0 + +0 is +0 when rounding to nearest; every other value is
 * unchanged, NaN stays NaN). */
__device__ __forceinline__ uint32_t order_bits_z(float v) {
    return order_bits(__fadd_rn(v, 0.0f));
}

__device__ __forceinline__ float from_order_bits(uint32_t k) {
    return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}

__device__ __forceinline__ uint64_t make_key(double v, int64_t e) {
    float f = (float)v;
    if (f == 0.0f) f = 0.0f; /* -0 and +0 are equal scores: one key, so the lower id wins */
    return ((uint64_t)order_bits(f) << 32) | (uint64_t)(0xffffffffu - (uint32_t)e);
}

/* Warp-wide maximum key; every lane gets it. 0 is below every real key. */
__device__ __forceinline__ uint64_t warp_max_key(uint64_t key) {
    const uint32_t hi = (uint32_t)(key >> 32);
    const uint32_t top = __reduce_max_sync(MOE_FULL_MASK, hi);
    const uint32_t lo = __reduce_max_sync(MOE_FULL_MASK, hi == top ? (uint32_t)key : 0u);
    return ((uint64_t)top << 32) | lo;
}

__device__ __forceinline__ int64_t key_expert(uint64_t key) {
    return (int64_t)(0xffffffffu - (uint32_t)key);
}

__device__ __forceinline__ double key_value(uint64_t key) {
    return (double)from_order_bits((uint32_t)(key >> 32));
}

/* The instantiation of a warp kernel for a row of `vpl` values per lane (1, 2, 4, ..., 32). */
#define MOE_VPL_SELECTOR(name, fn_t, kernel)          \
    static fn_t name(int vpl) {                       \
        switch (vpl) {                                \
        case 1: return kernel<1>;                     \
        case 2: return kernel<2>;                     \
        case 4: return kernel<4>;                     \
        case 8: return kernel<8>;                     \
        case 16: return kernel<16>;                   \
        default: return kernel<32>;                   \
        }                                             \
    }

/* Dynamic shared memory of the warp kernels, opted in above the 48 KiB default when needed. */
static inline moe_status_t warp_smem(const void *kernel, size_t bytes) {
    if (bytes <= 48 * 1024) return MOE_OK;
    cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           (int)bytes);
    if (err != cudaSuccess)
        return moe_fail(MOE_ERR_UNSUPPORTED, "router_topk: topk too large for shared memory (%zu "
                        "bytes): %s", bytes, cudaGetErrorString(err));
    return MOE_OK;
}

static inline moe_status_t check_common(int64_t num_tokens, int64_t num_experts, moe_dtype_t dt,
                                        const moe_router_topk_params_t *p, int has_bias,
                                        size_t workspace_bytes) {
    MOE_TRY(moe_router_topk_check_args(num_tokens, num_experts, dt, p, has_bias));
    if (workspace_bytes == MOE_SIZE_OVERFLOW) return MOE_OK; /* the caller checks its own size */
    const size_t need = moe_cuda_router_topk_workspace_size(num_tokens, num_experts, p);
    if (need == MOE_SIZE_OVERFLOW) return MOE_ERR_INVALID_ARGUMENT; /* the size function said why */
    MOE_CHECK(workspace_bytes >= need, "workspace too small: %zu bytes, need %zu", workspace_bytes,
              need);
    return MOE_OK;
}

/* Blocks for the fused kernel's grid-stride loop: enough to fill the device, no more. */
static inline unsigned warp32_blocks(int64_t num_tokens) {
    int dev = 0, sms = 132;
    if (cudaGetDevice(&dev) == cudaSuccess)
        cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
    const int64_t need = (num_tokens + MOE_ROUTER32_WARPS - 1) / MOE_ROUTER32_WARPS;
    const int64_t full = (int64_t)sms * (2048 / (32 * MOE_ROUTER32_WARPS));
    return (unsigned)(need < full ? need : full);
}

/* The launches of the fused fp32 kernels (logits below fp64, rows of warp_vpl > 0 values per
 * lane): the outputs as topk_fwd's (router_topk.cu), any of topk_probs, probs and routing_map
 * may be NULL. The lanes kernel takes the rows moe_router_topk_lanes_seg accepts (seg >= 0),
 * the strided warp32 kernel the others. */
int moe_router_topk_lanes_seg(const moe_topk_ctx_t *c, int vpl);
moe_status_t moe_router_topk_fwd_lanes(void *topk_probs, int64_t *topk_indices, void *probs,
                                       uint8_t *routing_map, const moe_router_topk_extras_t *ex,
                                       const void *logits, const float *expert_bias,
                                       int64_t num_tokens, const moe_topk_ctx_t *ctx, int vpl,
                                       int seg, void *stream);
moe_status_t moe_router_topk_fwd_warp32(void *topk_probs, int64_t *topk_indices, void *probs,
                                        uint8_t *routing_map, const moe_router_topk_extras_t *ex,
                                        const void *logits, const float *expert_bias,
                                        int64_t num_tokens, const moe_topk_ctx_t *ctx, int vpl,
                                        void *stream);

#endif /* MOE_CORE_ROUTER_TOPK_CUDA_CUH_ */
