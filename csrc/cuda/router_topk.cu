/*
 * router_topk.cu: the router's score function, (group-limited) top-k and probs on CUDA.
 *
 * One warp per token. Each lane holds num_experts/32 selection scores in registers (expert
 * e = lane + 32·i, so the row is read with coalesced loads once); the top-k is k rounds of a warp
 * arg-max under the same order as the C kernel (larger first, NaN above all, ties to the lower
 * index), group scores likewise; then one lane runs the C kernel's own probs routine
 * (../router_topk_math.h) on the k winners. So CPU and GPU pick the same experts by
 * construction and compute the probs with the same rounding points; only the math library may
 * differ, in the last bit of fp64.
 *
 * Rows wider than 1024 experts, or more than 32 groups, take the fallback: one thread per token
 * running the C routine whole, with its scratch in the caller's workspace. Nothing is allocated
 * and nothing waits on the host.
 */
#include "cuda_common.cuh"
#include "../router_topk_math.h"

static int64_t row_words(const moe_router_topk_params_t *p) {
    return moe_topk_scratch_words(p->topk, p->num_groups) + p->topk;
}

#define MOE_FULL_MASK 0xffffffffu
#define MOE_ROUTER_WARPS 4 /* tokens per block */
#define MOE_ROUTER_MAX_VPL 32

/* Values per lane for a row of num_experts: the smallest power of two >= E / 32, or 0 when the
 * warp kernel does not apply (the fallback then runs). */
static int warp_vpl(int64_t num_experts, int64_t num_groups) {
    if (num_groups > 32) return 0;
    for (int v = 1; v <= MOE_ROUTER_MAX_VPL; v *= 2)
        if (num_experts <= 32 * (int64_t)v) return v;
    return 0;
}

/* Warp-wide best (value, index) under moe_topk_before; every lane gets the result. */
__device__ __forceinline__ void warp_best(double *v, int64_t *i) {
    for (int off = 16; off > 0; off >>= 1) {
        double ov = __shfl_xor_sync(MOE_FULL_MASK, *v, off);
        long long oi = __shfl_xor_sync(MOE_FULL_MASK, (long long)*i, off);
        if (moe_topk_before(ov, (int64_t)oi, *v, *i)) *v = ov, *i = (int64_t)oi;
    }
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

/* logits [T, E] → topk_probs [T, k], topk_indices [T, k]; one warp per token.
 * Shared memory: 3·k words per warp (winners' values, ids, probs). */
template <int VPL>
__global__ void __launch_bounds__(32 * MOE_ROUTER_WARPS)
moe_router_topk_fwd_warp_kernel(void *topk_probs, int64_t *topk_indices, const void *logits,
                                const float *expert_bias, int64_t num_tokens, moe_topk_ctx_t ctx) {
    extern __shared__ double moe_router_smem[];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int64_t t = (int64_t)blockIdx.x * MOE_ROUTER_WARPS + warp;
    if (t >= num_tokens) return; /* the whole warp leaves together */
    const int64_t E = ctx.num_experts, k = ctx.topk, base = t * E;
    double *win_v = moe_router_smem + (int64_t)warp * 3 * k;
    int64_t *win_i = (int64_t *)(win_v + k);
    double *win_p = win_v + 2 * k;
    const int softmax = ctx.score_function == MOE_SCORE_SOFTMAX;

    double m = 0.0, inv = 0.0;
    if (softmax && ctx.pre_softmax) warp_softmax_stats<VPL>(&ctx, logits, base, lane, &m, &inv);
    double sel[VPL];
    uint32_t out = 0; /* bit i: expert lane + 32 i is absent, excluded by its group, or taken */
#pragma unroll
    for (int i = 0; i < VPL; ++i) {
        int64_t e = lane + 32 * i;
        if (e < E) sel[i] = moe_topk_selection(&ctx, logits, base, e, expert_bias, m, inv);
        else out |= 1u << i, sel[i] = 0.0;
    }

    if (ctx.num_groups > 0) {
        const int64_t P = ctx.per_group;
        double my_group = -INFINITY; /* lane g holds the score of group g */
        for (int64_t g = 0; g < ctx.num_groups; ++g) {
            uint32_t taken = 0;
            double acc = 0.0;
            for (int64_t r = 0; r < ctx.group_n; ++r) {
                double bv = -INFINITY;
                int64_t bi = INT64_MAX;
#pragma unroll
                for (int i = 0; i < VPL; ++i) {
                    int64_t e = lane + 32 * i;
                    if (!((out | taken) >> i & 1u) && e / P == g && moe_topk_before(sel[i], e, bv, bi))
                        bv = sel[i], bi = e;
                }
                warp_best(&bv, &bi);
                if (bi % 32 == lane) taken |= 1u << (bi / 32);
                acc = moe_cround(&ctx, acc + bv);
            }
            if (softmax && !ctx.pre_softmax) acc = moe_round_to(ctx.dtype, acc);
            if (lane == g) my_group = acc;
        }
        uint32_t kept = 0;
        for (int64_t r = 0; r < ctx.group_topk; ++r) {
            double bv = -INFINITY;
            int64_t bi = INT64_MAX;
            if (lane < ctx.num_groups && !(kept >> lane & 1u)) bv = my_group, bi = lane;
            warp_best(&bv, &bi);
            kept |= 1u << bi;
        }
#pragma unroll
        for (int i = 0; i < VPL; ++i) {
            int64_t e = lane + 32 * i;
            if (e < E && !(kept >> (e / P) & 1u)) out |= 1u << i;
        }
    }

    for (int64_t r = 0; r < k; ++r) {
        double bv = -INFINITY;
        int64_t bi = INT64_MAX;
#pragma unroll
        for (int i = 0; i < VPL; ++i)
            if (!(out >> i & 1u) && moe_topk_before(sel[i], lane + 32 * i, bv, bi))
                bv = sel[i], bi = lane + 32 * i;
        warp_best(&bv, &bi);
        if (bi % 32 == lane) out |= 1u << (bi / 32);
        if (lane == 0) win_v[r] = bv, win_i[r] = bi;
    }
    __syncwarp();
    if (lane == 0) moe_topk_probs(&ctx, logits, base, win_v, win_i, win_p);
    __syncwarp();
    for (int64_t j = lane; j < k; j += 32) {
        moe_store(topk_probs, ctx.dtype, t * k + j, win_p[j]);
        topk_indices[t * k + j] = win_i[j];
    }
}

/* grad_probs [T, k] → grad_logits [T, E]; one warp per token, coalesced row writes.
 * Shared memory: 3·k + 1 words per warp. Rows with an out-of-range index are left unwritten. */
template <int VPL>
__global__ void __launch_bounds__(32 * MOE_ROUTER_WARPS)
moe_router_topk_bwd_warp_kernel(void *grad_logits, const void *grad_probs, const void *logits,
                                const int64_t *topk_indices, int64_t num_tokens,
                                moe_topk_ctx_t ctx) {
    extern __shared__ double moe_router_smem[];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int64_t t = (int64_t)blockIdx.x * MOE_ROUTER_WARPS + warp;
    if (t >= num_tokens) return;
    const int64_t E = ctx.num_experts, k = ctx.topk, base = t * E;
    const int64_t *idx = topk_indices + t * k;
    double *scratch = moe_router_smem + (int64_t)warp * (3 * k + 1);
    double *gsel = scratch + 2 * k, *dot = scratch + 3 * k;
    int bad = 0;
    for (int64_t j = lane; j < k; j += 32) bad |= idx[j] < 0 || idx[j] >= E;
    if (__any_sync(MOE_FULL_MASK, bad)) return;

    moe_topk_ctx_t c64 = ctx;
    c64.fp64 = 1;
    double m = 0.0, inv = 0.0;
    const int pre = ctx.score_function == MOE_SCORE_SOFTMAX && ctx.pre_softmax;
    if (pre) warp_softmax_stats<VPL>(&c64, logits, base, lane, &m, &inv);
    if (lane == 0) moe_topk_bwd_selected(&ctx, logits, grad_probs, t, idx, m, inv, scratch, gsel, dot);
    __syncwarp();
#pragma unroll
    for (int i = 0; i < VPL; ++i) {
        int64_t e = lane + 32 * i;
        if (e >= E) continue;
        int64_t hit = -1;
        for (int64_t j = 0; j < k; ++j) hit = idx[j] == e ? j : hit;
        double gl = hit >= 0 ? gsel[hit] : moe_topk_bwd_unpicked(&c64, logits, base + e, m, inv, *dot);
        moe_store(grad_logits, ctx.dtype, base + e, gl);
    }
}

/* ---- the fp32 fast path ---------------------------------------------------------------------
 * Below fp64 every selection score is an fp32 value (Megatron's rounding points), so a score and
 * its expert id pack into one 64-bit key whose unsigned order is exactly moe_topk_before's: the
 * score's bits made monotone in the high word (NaN above +inf), the complement of the id in the
 * low word (ties to the lower id). An arg-max round is then two 32-bit warp max reductions
 * (redux.sync) instead of five double+int64 shuffle-and-compare steps. */

__device__ __forceinline__ uint32_t order_bits(float v) {
    uint32_t u = __float_as_uint(v);
    if (v != v) return 0xffffffffu;
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
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

/* logits [T, E] (fp32 / bf16 / fp16) → topk_probs [T, k], topk_indices [T, k]; one warp per
 * token. Shared memory: 3·k words per warp, as the fp64 kernel. */
template <int VPL>
__global__ void __launch_bounds__(32 * MOE_ROUTER_WARPS)
moe_router_topk_fwd_warp32_kernel(void *topk_probs, int64_t *topk_indices, const void *logits,
                                  const float *expert_bias, int64_t num_tokens,
                                  moe_topk_ctx_t ctx) {
    extern __shared__ double moe_router_smem[];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int64_t t = (int64_t)blockIdx.x * MOE_ROUTER_WARPS + warp;
    if (t >= num_tokens) return;
    const int64_t E = ctx.num_experts, k = ctx.topk, base = t * E;
    double *win_v = moe_router_smem + (int64_t)warp * 3 * k;
    int64_t *win_i = (int64_t *)(win_v + k);
    double *win_p = win_v + 2 * k;
    const int softmax = ctx.score_function == MOE_SCORE_SOFTMAX;

    double m = 0.0, inv = 0.0;
    if (softmax && ctx.pre_softmax) warp_softmax_stats<VPL>(&ctx, logits, base, lane, &m, &inv);
    uint64_t key[VPL];
#pragma unroll
    for (int i = 0; i < VPL; ++i) {
        const int64_t e = lane + 32 * i;
        key[i] = e < E ? make_key(moe_topk_selection(&ctx, logits, base, e, expert_bias, m, inv), e)
                       : 0u;
    }

    if (ctx.num_groups > 0) {
        const int64_t P = ctx.per_group;
        uint64_t my_group = 0; /* lane g holds group g's key */
        for (int64_t g = 0; g < ctx.num_groups; ++g) {
            uint32_t taken = 0;
            double acc = 0.0;
            for (int64_t r = 0; r < ctx.group_n; ++r) {
                uint64_t best = 0;
#pragma unroll
                for (int i = 0; i < VPL; ++i)
                    if (!(taken >> i & 1u) && (lane + 32 * i) / P == g && key[i] > best) best = key[i];
                best = warp_max_key(best);
                if (key_expert(best) % 32 == lane) taken |= 1u << (key_expert(best) / 32);
                acc = moe_cround(&ctx, acc + key_value(best));
            }
            if (softmax && !ctx.pre_softmax) acc = moe_round_to(ctx.dtype, acc);
            if (lane == g) my_group = make_key(acc, g);
        }
        uint32_t kept = 0;
        for (int64_t r = 0; r < ctx.group_topk; ++r) {
            const uint64_t best = warp_max_key(kept >> lane & 1u ? 0u : my_group);
            kept |= 1u << key_expert(best);
        }
#pragma unroll
        for (int i = 0; i < VPL; ++i) {
            const int64_t e = lane + 32 * i;
            if (e < E && !(kept >> (e / P) & 1u)) key[i] = 0u;
        }
    }

    for (int64_t r = 0; r < k; ++r) {
        uint64_t best = 0;
        int slot = -1;
#pragma unroll
        for (int i = 0; i < VPL; ++i)
            if (key[i] > best) best = key[i], slot = i;
        const uint64_t win = warp_max_key(best);
        if (slot >= 0 && best == win) key[slot] = 0u;
        if (lane == 0) win_v[r] = key_value(win), win_i[r] = key_expert(win);
    }
    __syncwarp();
    if (lane == 0) moe_topk_probs(&ctx, logits, base, win_v, win_i, win_p);
    __syncwarp();
    for (int64_t j = lane; j < k; j += 32) {
        moe_store(topk_probs, ctx.dtype, t * k + j, win_p[j]);
        topk_indices[t * k + j] = win_i[j];
    }
}

typedef void (*moe_topk_fwd_warp_fn)(void *, int64_t *, const void *, const float *, int64_t,
                                     moe_topk_ctx_t);
typedef void (*moe_topk_bwd_warp_fn)(void *, const void *, const void *, const int64_t *, int64_t,
                                     moe_topk_ctx_t);

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
MOE_VPL_SELECTOR(fwd_warp_kernel, moe_topk_fwd_warp_fn, moe_router_topk_fwd_warp_kernel)
MOE_VPL_SELECTOR(fwd_warp32_kernel, moe_topk_fwd_warp_fn, moe_router_topk_fwd_warp32_kernel)
MOE_VPL_SELECTOR(bwd_warp_kernel, moe_topk_bwd_warp_fn, moe_router_topk_bwd_warp_kernel)
#undef MOE_VPL_SELECTOR

/* Dynamic shared memory of the warp kernels, opted in above the 48 KiB default when needed. */
static moe_status_t warp_smem(const void *kernel, size_t bytes) {
    if (bytes <= 48 * 1024) return MOE_OK;
    cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           (int)bytes);
    if (err != cudaSuccess)
        return moe_fail(MOE_ERR_UNSUPPORTED, "router_topk: topk too large for shared memory (%zu "
                        "bytes): %s", bytes, cudaGetErrorString(err));
    return MOE_OK;
}

/* Fallback, one thread per token: logits [T, E] → topk_probs [T, k], topk_indices [T, k] */
__global__ void moe_router_topk_fwd_kernel(void *topk_probs, int64_t *topk_indices,
                                           const void *logits, const float *expert_bias,
                                           int64_t num_tokens, moe_topk_ctx_t ctx,
                                           double *workspace, int64_t words) {
    const int64_t t = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= num_tokens) return;
    const int64_t k = ctx.topk;
    double *scratch = workspace + t * words;
    double *probs = scratch + words - k;
    moe_topk_row_fwd(&ctx, logits, t, expert_bias, scratch, topk_indices + t * k, probs);
    for (int64_t j = 0; j < k; ++j) moe_store(topk_probs, ctx.dtype, t * k + j, probs[j]);
}

/* Fallback backward: grad_probs [T, k] → grad_logits [T, E]; rows with an out-of-range index are
 * skipped, not followed */
__global__ void moe_router_topk_bwd_kernel(void *grad_logits, const void *grad_probs,
                                           const void *logits, const int64_t *topk_indices,
                                           int64_t num_tokens, moe_topk_ctx_t ctx,
                                           double *workspace, int64_t words) {
    const int64_t t = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= num_tokens) return;
    const int64_t *idx = topk_indices + t * ctx.topk;
    for (int64_t j = 0; j < ctx.topk; ++j)
        if (idx[j] < 0 || idx[j] >= ctx.num_experts) return;
    moe_topk_row_bwd(&ctx, logits, grad_probs, t, idx, workspace + t * words, grad_logits);
}

extern "C" size_t moe_cuda_router_topk_workspace_size(int64_t num_tokens, int64_t num_experts,
                                                      const moe_router_topk_params_t *params) {
    if (!params || num_tokens <= 0 || warp_vpl(num_experts, params->num_groups) > 0) return 0;
    return (size_t)num_tokens * (size_t)row_words(params) * sizeof(double);
}

static moe_status_t check_common(int64_t num_tokens, int64_t num_experts, moe_dtype_t dt,
                                 const moe_router_topk_params_t *p, int has_bias,
                                 size_t workspace_bytes) {
    MOE_CHECK(num_tokens >= 0, "num_tokens must be >= 0, got %lld", (long long)num_tokens);
    MOE_CHECK(moe_is_float_dtype(dt), "logits must be a float dtype, got %s", moe_dtype_name(dt));
    MOE_TRY(moe_router_topk_check(p, num_experts, has_bias));
    const size_t need = moe_cuda_router_topk_workspace_size(num_tokens, num_experts, p);
    MOE_CHECK(workspace_bytes >= need, "workspace too small: %zu bytes, need %zu", workspace_bytes,
              need);
    return MOE_OK;
}

extern "C" moe_status_t moe_cuda_router_topk_fwd(void *topk_probs, int64_t *topk_indices,
                                                 const void *logits, const float *expert_bias,
                                                 int64_t num_tokens, int64_t num_experts,
                                                 moe_dtype_t logits_dtype,
                                                 const moe_router_topk_params_t *params,
                                                 void *workspace, size_t workspace_bytes,
                                                 void *stream) {
    moe_clear_error();
    MOE_TRY(check_common(num_tokens, num_experts, logits_dtype, params, expert_bias != NULL,
                         workspace_bytes));
    if (num_tokens == 0) return MOE_OK;
    const moe_topk_ctx_t ctx = moe_topk_ctx_make(params, num_experts, logits_dtype);
    const int vpl = warp_vpl(num_experts, params->num_groups);
    if (vpl > 0) {
        const size_t smem = (size_t)MOE_ROUTER_WARPS * 3 * (size_t)params->topk * sizeof(double);
        moe_topk_fwd_warp_fn kernel =
            logits_dtype == MOE_DTYPE_FP64 ? fwd_warp_kernel(vpl) : fwd_warp32_kernel(vpl);
        MOE_TRY(warp_smem((const void *)kernel, smem));
        kernel<<<moe_blocks_for(num_tokens, MOE_ROUTER_WARPS), 32 * MOE_ROUTER_WARPS, smem,
                 (cudaStream_t)stream>>>(topk_probs, topk_indices, logits, expert_bias, num_tokens,
                                         ctx);
        MOE_CHECK_LAUNCH("moe_router_topk_fwd_warp_kernel");
        return MOE_OK;
    }
    moe_router_topk_fwd_kernel<<<moe_blocks_for(num_tokens, MOE_CUDA_THREADS), MOE_CUDA_THREADS, 0,
                                 (cudaStream_t)stream>>>(topk_probs, topk_indices, logits,
                                                         expert_bias, num_tokens, ctx,
                                                         (double *)workspace, row_words(params));
    MOE_CHECK_LAUNCH("moe_router_topk_fwd_kernel");
    return MOE_OK;
}

extern "C" moe_status_t moe_cuda_router_topk_bwd(void *grad_logits, const void *grad_probs,
                                                 const void *logits, const int64_t *topk_indices,
                                                 int64_t num_tokens, int64_t num_experts,
                                                 moe_dtype_t logits_dtype,
                                                 const moe_router_topk_params_t *params,
                                                 void *workspace, size_t workspace_bytes,
                                                 void *stream) {
    moe_clear_error();
    MOE_TRY(check_common(num_tokens, num_experts, logits_dtype, params, 0, workspace_bytes));
    if (num_tokens == 0) return MOE_OK;
    const moe_topk_ctx_t ctx = moe_topk_ctx_make(params, num_experts, logits_dtype);
    const int vpl = warp_vpl(num_experts, params->num_groups);
    if (vpl > 0) {
        const size_t smem = (size_t)MOE_ROUTER_WARPS * (3 * (size_t)params->topk + 1) * sizeof(double);
        moe_topk_bwd_warp_fn kernel = bwd_warp_kernel(vpl);
        MOE_TRY(warp_smem((const void *)kernel, smem));
        kernel<<<moe_blocks_for(num_tokens, MOE_ROUTER_WARPS), 32 * MOE_ROUTER_WARPS, smem,
                 (cudaStream_t)stream>>>(grad_logits, grad_probs, logits, topk_indices, num_tokens,
                                         ctx);
        MOE_CHECK_LAUNCH("moe_router_topk_bwd_warp_kernel");
        return MOE_OK;
    }
    moe_router_topk_bwd_kernel<<<moe_blocks_for(num_tokens, MOE_CUDA_THREADS), MOE_CUDA_THREADS, 0,
                                 (cudaStream_t)stream>>>(grad_logits, grad_probs, logits,
                                                         topk_indices, num_tokens, ctx,
                                                         (double *)workspace, row_words(params));
    MOE_CHECK_LAUNCH("moe_router_topk_bwd_kernel");
    return MOE_OK;
}
