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
 * Below fp64 the fused router (dense outputs, aux scores, lse) runs one of two kernels on the
 * same order and rounding points. Rows of up to 256 experts take the lanes kernel: a lane holds
 * neighbouring experts, so a group is a run of lanes and the top-k a threshold plus a count over
 * a few candidates, with a polynomial fp64 sigmoid / exp; other rows take the strided kernel
 * (expert lane + 32·i, k rounds of 64-bit warp arg-max).
 *
 * Rows wider than 1024 experts, or more than 32 groups, take the fallback: one thread per token
 * running the C routine whole, with its scratch in the caller's workspace. Nothing is allocated
 * and nothing waits on the host.
 */
#include "cuda_common.cuh"
#include "../router_topk_math.h"
#include "exp_poly_math.h"

static int64_t row_words(const moe_router_topk_params_t *p) {
    return moe_topk_scratch_words(moe_topk_scratch_k(p), p->num_groups) + p->topk;
}

#define MOE_FULL_MASK 0xffffffffu
#define MOE_ROUTER_WARPS 4 /* tokens per block */
#define MOE_ROUTER32_WARPS 8 /* tokens per block of the fused fp32 kernel */
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
    int grp[VPL]; /* group of each value, hoisted: a 64-bit division per compare was the cost */
    uint32_t out = 0; /* bit i: expert lane + 32 i is absent, excluded by its group, or taken */
#pragma unroll
    for (int i = 0; i < VPL; ++i) {
        int64_t e = lane + 32 * i;
        grp[i] = ctx.num_groups > 0 && e < E ? (int)(e / ctx.per_group) : 0;
        if (e < E) sel[i] = moe_topk_selection(&ctx, logits, base, e, expert_bias, m, inv);
        else out |= 1u << i, sel[i] = 0.0;
    }

    if (ctx.num_groups > 0) {
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
                    if (!((out | taken) >> i & 1u) && grp[i] == g && moe_topk_before(sel[i], e, bv, bi))
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
            if (e < E && !(kept >> grp[i] & 1u)) out |= 1u << i;
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
    if (lane == 0) {
        moe_topk_unbias(&ctx, logits, base, expert_bias, m, inv, win_i, win_v);
        moe_topk_probs(&ctx, logits, base, win_v, win_i, win_p);
    }
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

/* For every slot i, the maximum of v[i] over its segment of P lanes (P divides 32; P == 32 is the
 * whole warp); every lane of the segment gets it. The VPL reductions are independent, so their
 * latencies overlap. */
template <int VPL>
__device__ __forceinline__ void segment_max_keys(uint64_t (&v)[VPL], int P) {
    if (P == 32) {
#pragma unroll
        for (int i = 0; i < VPL; ++i) v[i] = warp_max_key(v[i]);
        return;
    }
    for (int off = P / 2; off > 0; off >>= 1) {
#pragma unroll
        for (int i = 0; i < VPL; ++i) {
            const uint64_t o = __shfl_xor_sync(MOE_FULL_MASK, v[i], off);
            v[i] = o > v[i] ? o : v[i];
        }
    }
}

__device__ __forceinline__ int64_t key_expert(uint64_t key) {
    return (int64_t)(0xffffffffu - (uint32_t)key);
}

__device__ __forceinline__ double key_value(uint64_t key) {
    return (double)from_order_bits((uint32_t)(key >> 32));
}

/* The fused fp32 router. logits [T, E] (fp32 / bf16 / fp16) → topk_indices [T, k], and any of
 * topk_probs [T, k], probs [T, E], routing_map [T, E] (dense: every element written, so the
 * output needs no zero-fill pass). One warp per token in a grid-stride loop, so each lane's
 * expert ids, group ids and bias are loaded once per kernel, not per token; every integer
 * division is hoisted out of the token loop.
 * Each expert's selection key and its "prob source" (softmax-pre: its softmax value, softmax:
 * its logit, sigmoid / sqrtsoftplus: its unbiased score) stay in registers; a winner's lane parks
 * the source in shared memory at the winner's rank, the k probs are then finished in parallel
 * across lanes, and only the order-dependent sums run on one lane (the CPU's rounding points).
 * The extras (aux scores and map, lse), when asked for, come from the same registers: the row
 * max is shared by the softmax statistics and the lse (one more fp64 warp sum for Σ exp(x − m));
 * the aux scores are the softmax values (or the scores over one more warp sum) and their map is
 * k more key rounds, skipped for softmax-pre without groups, whose routing keys are the aux
 * keys.
 * Shared memory: 2k + 1 words per warp. */
template <int VPL>
__global__ void __launch_bounds__(32 * MOE_ROUTER32_WARPS)
moe_router_topk_fwd_warp32_kernel(void *topk_probs, int64_t *topk_indices, void *probs,
                                  uint8_t *routing_map, moe_router_topk_extras_t extras,
                                  const void *logits, const float *expert_bias,
                                  int64_t num_tokens, moe_topk_ctx_t ctx) {
    extern __shared__ double moe_router_smem[];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int E = (int)ctx.num_experts, k = (int)ctx.topk;
    double *win_p = moe_router_smem + (int64_t)warp * (2 * k + 1);
    int *win_i = (int *)(win_p + k);
    double *norm = win_p + 2 * k;
    const int softmax = ctx.score_function == MOE_SCORE_SOFTMAX, pre = ctx.pre_softmax;
    const int G = (int)ctx.num_groups, P = (int)ctx.per_group, gn = (int)ctx.group_n;
    int grp[VPL];
    float bias[VPL];
#pragma unroll
    for (int i = 0; i < VPL; ++i) {
        const int e = lane + 32 * i;
        grp[i] = G > 0 && e < E ? e / P : 0;
        bias[i] = expert_bias && e < E ? expert_bias[e] : 0.0f;
    }
    const int64_t stride = (int64_t)gridDim.x * MOE_ROUTER32_WARPS;
    for (int64_t t = (int64_t)blockIdx.x * MOE_ROUTER32_WARPS + warp; t < num_tokens; t += stride) {
        const int64_t base = t * E;
        float x[VPL];
#pragma unroll
        for (int i = 0; i < VPL; ++i) {
            const int e = lane + 32 * i;
            x[i] = e < E ? (float)moe_load(logits, ctx.dtype, base + e) : 0.0f;
        }
        /* warp-uniform: which extras this token needs */
        const int pad = extras.padding_mask != NULL && extras.padding_mask[t] != 0;
        const int aux = extras.aux_scores != NULL && !pad;
        const int want_lse = extras.lse != NULL && !pad;
        const int stats = (softmax && pre) || (aux && softmax);
        double m = 0.0, inv = 0.0;
        if (stats || want_lse) { /* row max from registers, NaN wins */
            m = -INFINITY;
#pragma unroll
            for (int i = 0; i < VPL; ++i)
                if (lane + 32 * i < E) m = (x[i] != x[i] || x[i] > m) ? (double)x[i] : m;
            m = warp_max_nan(m);
        }
        if (stats) { /* softmax statistics: fp32-rounded terms, as the CPU */
            double sum = 0.0;
#pragma unroll
            for (int i = 0; i < VPL; ++i)
                if (lane + 32 * i < E) sum += moe_cround(&ctx, exp(moe_cround(&ctx, x[i] - m)));
            sum = warp_sum(sum);
            inv = moe_cround(&ctx, 1.0 / moe_cround(&ctx, sum));
        }
        if (extras.lse != NULL) { /* z_loss.c's row_lse: NaN propagates, a ±inf max is the lse */
            double l = 0.0;
            if (want_lse && (m != m || isinf(m))) {
                l = m;
            } else if (want_lse) {
                double sum = 0.0;
#pragma unroll
                for (int i = 0; i < VPL; ++i)
                    if (lane + 32 * i < E) sum += exp((double)x[i] - m);
                l = m + log(warp_sum(sum));
            }
            if (lane == 0) extras.lse[t] = l;
        }
        uint64_t key[VPL];
        float src[VPL];
#pragma unroll
        for (int i = 0; i < VPL; ++i) {
            const int e = lane + 32 * i;
            /* every score is fp32-valued here, and an fp32 sum rounded once is the C kernel's
             * moe_cround(s + bias) (fp64 holds the exact sum of two floats' worth of bits) */
            float s, sel;
            if (softmax) {
                s = pre ? (float)moe_topk_softmax_at(&ctx, x[i], m, inv) : x[i];
            } else {
                s = (float)moe_topk_score(&ctx, x[i]);
            }
            sel = expert_bias ? __fadd_rn(s, bias[i]) : s; /* softmax: pre only (checked) */
            src[i] = (float)s;
            key[i] = e < E ? make_key(sel, e) : 0u;
        }

        if (VPL <= 8 && G > 0 && 32 % P == 0) {
            /* A group is a segment of P lanes inside one register slot (P divides 32), so all
             * of a lane's VPL slots belong to different groups and every group's rounds run
             * side by side: VPL independent segment reductions per round instead of one
             * dependent warp reduction per (group, round). Same keys, same order, same sums.
             * (Wider rows keep the serial rounds: VPL more keys per lane would spill.) */
            uint32_t taken = 0; /* bit i: slot i's key already counted in its group */
            float acc[VPL];
            uint64_t gkey[VPL]; /* the key of the group of slot i, on every lane of its segment */
#pragma unroll
            for (int i = 0; i < VPL; ++i) acc[i] = 0.0f;
            for (int r = 0; r < gn; ++r) {
                uint64_t win[VPL];
#pragma unroll
                for (int i = 0; i < VPL; ++i) win[i] = (taken >> i & 1u) ? 0u : key[i];
                segment_max_keys<VPL>(win, P);
#pragma unroll
                for (int i = 0; i < VPL; ++i) {
                    if (key[i] == win[i]) taken |= 1u << i;
                    /* fp32 + fp32 rounded once: what moe_cround(acc + v) gives */
                    acc[i] = __fadd_rn(acc[i], (float)key_value(win[i]));
                }
            }
#pragma unroll
            for (int i = 0; i < VPL; ++i) {
                double a = (double)acc[i];
                if (softmax && !pre) a = moe_round_to(ctx.dtype, a);
                gkey[i] = lane + 32 * i < E ? make_key(a, grp[i]) : 0u;
            }
            uint32_t kept = 0;
            for (int r = 0; r < (int)ctx.group_topk; ++r) {
                uint64_t best = 0;
#pragma unroll
                for (int i = 0; i < VPL; ++i) best = gkey[i] > best ? gkey[i] : best;
                best = warp_max_key(best);
                kept |= 1u << key_expert(best);
#pragma unroll
                for (int i = 0; i < VPL; ++i)
                    if (gkey[i] == best) gkey[i] = 0u;
            }
#pragma unroll
            for (int i = 0; i < VPL; ++i)
                if (!(kept >> grp[i] & 1u)) key[i] = 0u;
        } else if (G > 0) {
            uint64_t my_group = 0; /* lane g holds group g's key */
            for (int g = 0; g < G; ++g) {
                uint32_t taken = 0;
                double acc = 0.0;
                for (int r = 0; r < gn; ++r) {
                    uint64_t best = 0;
#pragma unroll
                    for (int i = 0; i < VPL; ++i)
                        if (!(taken >> i & 1u) && grp[i] == g && key[i] > best) best = key[i];
                    best = warp_max_key(best);
#pragma unroll
                    for (int i = 0; i < VPL; ++i)
                        if (key[i] == best) taken |= 1u << i;
                    acc = moe_cround(&ctx, acc + key_value(best));
                }
                if (softmax && !pre) acc = moe_round_to(ctx.dtype, acc);
                if (lane == g) my_group = make_key(acc, g);
            }
            uint32_t kept = 0;
            for (int r = 0; r < (int)ctx.group_topk; ++r) {
                const uint64_t best = warp_max_key(kept >> lane & 1u ? 0u : my_group);
                kept |= 1u << key_expert(best);
            }
#pragma unroll
            for (int i = 0; i < VPL; ++i)
                if (!(kept >> grp[i] & 1u)) key[i] = 0u;
        }

        int rank[VPL];
        uint64_t best = 0; /* this lane's best remaining key */
#pragma unroll
        for (int i = 0; i < VPL; ++i) {
            rank[i] = -1;
            best = key[i] > best ? key[i] : best;
        }
        for (int r = 0; r < k; ++r) {
            const uint64_t win = warp_max_key(best);
            /* keys are unique (the id is in them), and the id names the one lane and slot that
             * hold the winner: only that lane takes it out and rescans its slots */
            const int e_w = (int)key_expert(win);
            if (lane == (e_w & 31)) {
                best = 0;
#pragma unroll
                for (int i = 0; i < VPL; ++i) {
                    if (key[i] == win) { /* not i == e_w / 32: that becomes a local-memory index */
                        key[i] = 0u;
                        rank[i] = r;
                        win_p[r] = (double)src[i];
                        win_i[r] = e_w;
                    }
                    best = key[i] > best ? key[i] : best;
                }
            }
        }
        __syncwarp();
        /* moe_topk_probs, with its sequential sums on lane 0 and the rest spread over lanes */
        if (softmax && !pre) {
            const double top = win_p[0]; /* read by every lane before lane 0 overwrites it */
            __syncwarp();
            for (int j = lane; j < k; j += 32)
                win_p[j] = moe_cround(&ctx, exp(moe_cround(&ctx, win_p[j] - top)));
        }
        __syncwarp();
        if (lane == 0 && ((softmax && !pre) || ctx.renorm)) {
            double sum = 0.0;
            if (softmax && !pre) {
                for (int j = 0; j < k; ++j) sum += win_p[j];
                *norm = moe_cround(&ctx, 1.0 / moe_cround(&ctx, sum));
            } else { /* moe_topk_renorm's sum */
                for (int j = 0; j < k; ++j) sum += win_p[j];
                *norm = moe_cround(&ctx, moe_cround(&ctx, sum) + moe_cround(&ctx, 1e-20));
            }
        }
        __syncwarp();
        for (int j = lane; j < k; j += 32) {
            double p = win_p[j];
            if (softmax && !pre) p = moe_cround(&ctx, p * *norm);
            else if (ctx.renorm) p = moe_cround(&ctx, p / *norm);
            if (ctx.has_scaling) p = moe_cround(&ctx, p * ctx.scaling_factor);
            win_p[j] = p;
            topk_indices[t * k + j] = win_i[j];
            if (topk_probs) moe_store(topk_probs, ctx.dtype, t * k + j, p);
        }
        __syncwarp();
#pragma unroll
        for (int i = 0; i < VPL; ++i) {
            const int e = lane + 32 * i;
            if (e >= E) continue;
            if (routing_map) routing_map[base + e] = rank[i] >= 0;
            if (probs) moe_store(probs, ctx.dtype, base + e, rank[i] >= 0 ? win_p[rank[i]] : 0.0);
        }
        if (extras.aux_scores != NULL) {
            /* the aux scores, from src (softmax: the logit or the softmax value; else the
             * unbiased score), computed only now so that they hold no registers over the
             * routing rounds: softmax over all experts, or s / (Σ s + 1e-20) */
            float av[VPL];
            if (aux && softmax) {
#pragma unroll
                for (int i = 0; i < VPL; ++i)
                    av[i] = pre ? src[i] : (float)moe_topk_softmax_at(&ctx, src[i], m, inv);
            } else if (aux) {
                double sum = 0.0;
#pragma unroll
                for (int i = 0; i < VPL; ++i)
                    if (lane + 32 * i < E) sum += (double)src[i];
                sum = warp_sum(sum);
                const double d = moe_cround(&ctx, moe_cround(&ctx, sum) + moe_cround(&ctx, 1e-20));
#pragma unroll
                for (int i = 0; i < VPL; ++i) av[i] = (float)moe_cround(&ctx, (double)src[i] / d);
            }
            uint32_t hit = 0; /* bit i: expert lane + 32 i is in the aux top-k */
            if (aux && softmax && pre && G == 0 && !expert_bias) { /* the routing's own keys */
#pragma unroll
                for (int i = 0; i < VPL; ++i) hit |= (uint32_t)(rank[i] >= 0) << i;
            } else if (aux) {
#pragma unroll
                for (int i = 0; i < VPL; ++i) key[i] = lane + 32 * i < E ? make_key(av[i], lane + 32 * i) : 0u;
                for (int r = 0; r < k; ++r) {
                    uint64_t best = 0;
#pragma unroll
                    for (int i = 0; i < VPL; ++i) best = key[i] > best ? key[i] : best;
                    const uint64_t win = warp_max_key(best);
#pragma unroll
                    for (int i = 0; i < VPL; ++i)
                        if (key[i] == win) key[i] = 0u, hit |= 1u << i;
                }
            }
            float *aux_out = (float *)extras.aux_scores;
#pragma unroll
            for (int i = 0; i < VPL; ++i) {
                const int e = lane + 32 * i;
                if (e >= E) continue;
                aux_out[base + e] = aux ? av[i] : 0.0f;
                extras.aux_map[base + e] = (uint8_t)(hit >> i & 1u);
            }
        }
        __syncwarp(); /* the next token reuses this warp's shared slots */
    }
}

/* ---- the lanes kernel: a lane holds VPL neighbouring experts ---------------------------------
 * The same routing and extras as the fused fp32 kernel above, for rows of 33-256 experts, in
 * far fewer instructions per token. Lane l holds experts l·VPL .. l·VPL + VPL − 1, so a group
 * of P experts is a segment of P / VPL lanes: a group's top-n is a lane-local scan plus
 * log2(P / VPL) shuffles, where the strided layout above needs one warp reduction per (group,
 * round). The fp64 sigmoid and exp, the largest share of a
 * row's instructions, are the polynomial below instead of the library's (same fp32 result: see
 * moe_exp_fd), evaluated four experts at a time. One instantiation per score function, so a row
 * carries no per-expert switch. A row is read with 16-byte loads and the dense outputs written
 * with 16-byte stores where the layout allows. */

/* exp(a) in fp64 for a in [-708, 708]: the degree-13 polynomial of exp_poly_math.h, which
 * rounded to fp32 agrees with glibc's exp on every fp32 input as (float)exp(d), d <= 0, and as
 * (float)(1 / (1 + exp(-x))) (exhaustive host check, tests/c/test_exp_poly.c). The caller clamps
 * a: past ±708 the fp32 results no longer change. The coefficients live in constant memory: a
 * batch loads each into a uniform register once, where as 64-bit literals each DFMA would need
 * two uniform moves of its own. */
__constant__ double moe_exp_coef[15] = MOE_EXP_POLY_COEFS;

/* N exponentials side by side: each coefficient is loaded once per batch instead of once per
 * DFMA, and the N chains of dependent DFMAs hide each other's latency. For each value, the
 * operations of moe_exp_poly (exp_poly_math.h) in the same order. */
template <int N>
__device__ __forceinline__ void moe_exp_fd_n(const double (&a)[N], double (&e)[N]) {
    double r[N], p[N];
    int kk[N];
#pragma unroll
    for (int i = 0; i < N; ++i) {
        const double kd = rint(a[i] * moe_exp_coef[14]);
        r[i] = fma(-kd, moe_exp_coef[12], a[i]); /* ln2's high part: kd·hi is exact */
        r[i] = fma(-kd, moe_exp_coef[13], r[i]);
        kk[i] = (int)kd;
        p[i] = moe_exp_coef[0];
    }
#pragma unroll
    for (int j = 1; j < 12; ++j) {
#pragma unroll
        for (int i = 0; i < N; ++i) p[i] = fma(p[i], r[i], moe_exp_coef[j]);
    }
#pragma unroll
    for (int i = 0; i < N; ++i) {
        const double q = fma(fma(p[i], r[i], 1.0), r[i], 1.0);
        e[i] = __hiloint2double(__double2hiint(q) + (kk[i] << 20), __double2loint(q));
    }
}

__device__ __forceinline__ double moe_exp_fd(double a) {
    const double in[1] = {a};
    double out[1];
    moe_exp_fd_n<1>(in, out);
    return out[0];
}

/* moe_topk_score's sigmoid, (float)(1 / (1 + exp(-x))) computed in fp64, of N values. */
template <int N>
__device__ __forceinline__ void moe_sigmoid_fd_n(const float *x, float *y) {
    double a[N], e[N];
    /* clamped in fp32 (±708 are fp32 values, so the double is the same): fp64 fmin / fmax cost
     * five instructions each; NaN is handled below */
#pragma unroll
    for (int i = 0; i < N; ++i) a[i] = (double)fminf(fmaxf(-x[i], -708.0f), 708.0f);
    moe_exp_fd_n<N>(a, e);
#pragma unroll
    for (int i = 0; i < N; ++i) {
        const float v = (float)__drcp_rn(1.0 + e[i]);
        y[i] = x[i] != x[i] ? x[i] : v;
    }
}

/* (float)exp(d) computed in fp64, for d <= 0 or NaN (a softmax term x − max): NaN stays NaN,
 * below -708 the fp32 result is 0 either way. */
__device__ __forceinline__ float moe_expf_fd(float d) {
    return d != d ? d : (float)moe_exp_fd((double)fmaxf(d, -708.0f));
}

/* moe_topk_softmax_at below fp64: (float)exp((float)(x - m)) · inv, each step rounded to fp32
 * (an fp32 product rounded once is the fp64 product rounded to fp32). */
__device__ __forceinline__ float moe_softmax_at_fd(float x, float m, float inv) {
    return __fmul_rn(moe_expf_fd(__fsub_rn(x, m)), inv);
}

/* What the lanes kernel may do with 16-byte accesses, decided on the host from the pointers. */
#define MOE_LANES_VEC_LOAD 1u  /* fp32 logits rows, 16-byte aligned at every lane */
#define MOE_LANES_VEC_PROBS 2u /* fp32 dense probs, likewise */
#define MOE_LANES_VEC_MAP 4u   /* the map's VPL bytes of a lane are one aligned word */
#define MOE_LANES_VEC_AUX 8u   /* fp32 aux scores, as the probs */
#define MOE_LANES_VEC_AUX_MAP 16u /* the aux map, as the map */
#define MOE_LANES_VEC_BIAS 32u /* the expert bias, as the logits */

/* Shared memory of the lanes kernel, per warp: the k winners (expert, prob source), the
 * candidates of the selection (key, prob source) and each expert's rank (int8, -1: not picked). */
#define MOE_LANES_CAND 32
MOE_HD static inline size_t lanes_warp_bytes(int64_t topk, int vpl) {
    return (size_t)topk * 8 + MOE_LANES_CAND * 12 + (size_t)vpl * 32 + 8;
}

/* The segment's (lanes lane − lane % seg ...) top two of every lane's v[], as keys. */
__device__ __forceinline__ void seg_top2(uint32_t *a, uint32_t *b, int seg) {
    for (int off = seg / 2; off > 0; off >>= 1) {
        const uint32_t oa = __shfl_xor_sync(MOE_FULL_MASK, *a, off);
        const uint32_t ob = __shfl_xor_sync(MOE_FULL_MASK, *b, off);
        *b = max(min(*a, oa), max(*b, ob));
        *a = max(*a, oa);
    }
}

/* The top k of the warp's keys hi (0: absent or excluded; ties to the lower expert, which is the
 * lower lane, then the lower slot): rank_of[e] = rank for the k winners (-1 elsewhere on the
 * lanes' experts) and, when win_i is not NULL, win_i / win_p[rank] = expert, src. Three steps
 * instead of k rounds that rescan the winner's lane: (1) k rounds over the lanes' best keys give
 * tau, the k-th best of those, and every expert of the top k has a key >= tau; (2) the experts
 * with key >= tau (about k + a few) are compacted into shared memory; (3) each counts the
 * candidates ranked before it. More than MOE_LANES_CAND candidates (rows full of ties) take k
 * rounds over 64-bit keys instead. Ends with the warp synchronised. */
template <int VPL>
__device__ __forceinline__ void lanes_topk(uint32_t (&hi)[VPL], const float (&src)[VPL], int k,
                                           int lane, int e0, uint64_t *cand_key, float *cand_src,
                                           int8_t *rank_of, int *win_i, float *win_p) {
    uint32_t head = 0;
#pragma unroll
    for (int i = 0; i < VPL; ++i) head = max(head, hi[i]);
    /* when fewer than k lanes have a key (always when k > 32): tau = 1, every key. Once the
     * keys run out, top stays 0 for the remaining rounds: no exit test inside the loop. */
    uint32_t tau = 1u;
    if (k <= 32) {
        uint32_t h = head, top = 0u;
        for (int r = 0; r < k; ++r) {
            top = __reduce_max_sync(MOE_FULL_MASK, h);
            const uint32_t own = __ballot_sync(MOE_FULL_MASK, h == top);
            if (lane == __ffs(own) - 1) h = 0u;
        }
        tau = top != 0u ? top : 1u;
    }
    uint32_t cmask = 0;
#pragma unroll
    for (int i = 0; i < VPL; ++i) cmask |= (uint32_t)(hi[i] >= tau) << i;
    const int c = __popc(cmask);
    int incl = c;
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) {
        const int v = __shfl_up_sync(MOE_FULL_MASK, incl, off);
        if (lane >= off) incl += v;
    }
    const int n = __shfl_sync(MOE_FULL_MASK, incl, 31);
    if constexpr (VPL >= 4) {
#pragma unroll
        for (int i = 0; i < VPL; i += 4) *(uint32_t *)(rank_of + e0 + i) = 0xffffffffu;
    } else {
#pragma unroll
        for (int i = 0; i < VPL; ++i) rank_of[e0 + i] = -1;
    }
    if (n <= MOE_LANES_CAND) {
        int pos = incl - c;
#pragma unroll
        for (int i = 0; i < VPL; ++i) {
            if (cmask >> i & 1u) {
                cand_key[pos] = ((uint64_t)hi[i] << 32) | (uint64_t)(0xffffffffu - (uint32_t)(e0 + i));
                cand_src[pos] = src[i];
                ++pos;
            }
        }
        __syncwarp();
        if (lane < n) {
            const uint64_t my = cand_key[lane];
            int r = 0;
            for (int j = 0; j < n; ++j) r += cand_key[j] > my;
            if (r < k) {
                const int e = (int)key_expert(my);
                rank_of[e] = (int8_t)r;
                if (win_i) win_i[r] = e, win_p[r] = cand_src[lane];
            }
        }
    } else {
        uint64_t best = 0;
#pragma unroll
        for (int i = 0; i < VPL; ++i)
            if (hi[i] != 0u) best = max(best, ((uint64_t)hi[i] << 32) | (0xffffffffu - (uint32_t)(e0 + i)));
        for (int r = 0; r < k; ++r) {
            const uint64_t win = warp_max_key(best);
            const int e_w = (int)key_expert(win);
            if (lane == e_w / VPL) {
                best = 0;
#pragma unroll
                for (int i = 0; i < VPL; ++i) {
                    if (e0 + i == e_w) {
                        hi[i] = 0u;
                        rank_of[e_w] = (int8_t)r;
                        if (win_i) win_i[r] = e_w, win_p[r] = src[i];
                    }
                    if (hi[i] != 0u)
                        best = max(best, ((uint64_t)hi[i] << 32) | (0xffffffffu - (uint32_t)(e0 + i)));
                }
            }
        }
    }
    __syncwarp();
}

/* Stores a lane's VPL fp32 values at dst (16-byte stores when vec4), or in dtype dt. */
template <int VPL>
__device__ __forceinline__ void lanes_store_row(void *dst, moe_dtype_t dt, int64_t at, int valid,
                                                const float (&v)[VPL], int vec4) {
    if (vec4) {
#pragma unroll
        for (int i = 0; i < VPL; i += 4)
            *(float4 *)((float *)dst + at + i) = make_float4(v[i], v[i + 1], v[i + 2], v[i + 3]);
    } else {
#pragma unroll
        for (int i = 0; i < VPL; ++i)
            if (i < valid) moe_store(dst, dt, at + i, (double)v[i]);
    }
}

/* Stores a lane's VPL map bytes (flag bit i) at dst (one word when aligned). */
template <int VPL>
__device__ __forceinline__ void lanes_store_bits(uint8_t *dst, int valid, uint32_t bits, int word) {
    if constexpr (VPL == 4 || VPL == 8) {
        if (word) {
            uint32_t w[VPL / 4];
#pragma unroll
            for (int j = 0; j < VPL / 4; ++j) w[j] = 0;
#pragma unroll
            for (int i = 0; i < VPL; ++i) w[i / 4] |= (bits >> i & 1u) << (8 * (i % 4));
            if constexpr (VPL == 4) *(uint32_t *)dst = w[0];
            else *(uint2 *)dst = make_uint2(w[0], w[1]);
            return;
        }
    }
#pragma unroll
    for (int i = 0; i < VPL; ++i)
        if (i < valid) dst[i] = (uint8_t)(bits >> i & 1u);
}

/* logits [T, E] (fp32 / bf16 / fp16) → topk_indices [T, k], and any of topk_probs [T, k],
 * probs [T, E], routing_map [T, E], and the extras (aux scores + map, lse) of the fused router.
 * One warp per token, grid-stride; seg = P / VPL lanes per group (a power of two), 0 without
 * groups. Shared memory: lanes_warp_bytes per warp. Keys are the 32-bit monotone bits of the
 * fp32 selection value (0: absent or excluded), ties to the lower expert. */
/* 4 blocks of 8 warps per SM (64 registers, a few spilled at VPL = 8): the kernel is bound by
 * instruction latency, so the occupancy of a fourth block is worth more than the registers a
 * third block would leave it (docs/perf-history.md has the A/B). */
template <int VPL, int SF>
__global__ void __launch_bounds__(32 * MOE_ROUTER32_WARPS, 4)
moe_router_topk_fwd_lanes_kernel(void *topk_probs, int64_t *topk_indices, void *probs,
                                 uint8_t *routing_map, moe_router_topk_extras_t extras,
                                 const void *logits, const float *expert_bias, int64_t num_tokens,
                                 moe_topk_ctx_t ctx, int seg, unsigned vec) {
    extern __shared__ double moe_router_smem[];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int E = (int)ctx.num_experts, k = (int)ctx.topk, e0 = lane * VPL;
    const int valid = E - e0; /* this lane's experts in the row: VPL or fewer (<= 0: none) */
    char *ws = (char *)moe_router_smem + (size_t)warp * lanes_warp_bytes(k, VPL);
    uint64_t *cand_key = (uint64_t *)ws;
    float *cand_src = (float *)(cand_key + MOE_LANES_CAND);
    float *win_p = cand_src + MOE_LANES_CAND;
    int *win_i = (int *)(win_p + k);
    float *norm = (float *)(win_i + k);
    int8_t *rank_of = (int8_t *)(norm + 2); /* 8-byte aligned: k words of each kind, + 2 */
    constexpr int softmax = SF == MOE_SCORE_SOFTMAX, sigmoid = SF == MOE_SCORE_SIGMOID;
    const int pre = ctx.pre_softmax;
    const int gn = (int)ctx.group_n, has_group = seg > 0 && e0 < E;
    const float sf = (float)ctx.scaling_factor;
    /* the first lane of this lane's group and the group's lanes (seg is not a compile-time value:
     * the divisions stay out of the token loop) */
    const int seg_base = seg > 0 ? lane - lane % seg : 0;
    const uint32_t segmask = seg > 0 ? (seg == 32 ? ~0u : (1u << seg) - 1u) << seg_base : 0u;
    const int64_t stride = (int64_t)gridDim.x * MOE_ROUTER32_WARPS;
    for (int64_t t = (int64_t)blockIdx.x * MOE_ROUTER32_WARPS + warp; t < num_tokens; t += stride) {
        const int64_t base = t * E;
        float x[VPL];
        if (vec & MOE_LANES_VEC_LOAD) {
            if (e0 < E) {
#pragma unroll
                for (int i = 0; i < VPL; i += 4) {
                    const float4 v = *(const float4 *)((const float *)logits + base + e0 + i);
                    x[i] = v.x, x[i + 1] = v.y, x[i + 2] = v.z, x[i + 3] = v.w;
                }
            }
        } else {
#pragma unroll
            for (int i = 0; i < VPL; ++i)
                x[i] = i < valid ? (float)moe_load(logits, ctx.dtype, base + e0 + i) : 0.0f;
        }
        /* warp-uniform: which extras this token needs */
        const int pad = extras.padding_mask != NULL && extras.padding_mask[t] != 0;
        const int aux = extras.aux_scores != NULL && !pad;
        const int want_lse = extras.lse != NULL && !pad;
        const int stats = (softmax && pre) || (aux && softmax);
        float m = 0.0f, inv = 0.0f;
        if (stats || want_lse) { /* row max, NaN wins */
            double mx = -INFINITY;
#pragma unroll
            for (int i = 0; i < VPL; ++i)
                if (i < valid) mx = (x[i] != x[i] || x[i] > mx) ? (double)x[i] : mx;
            m = (float)warp_max_nan(mx);
        }
        if (stats) { /* softmax statistics: fp32-rounded terms, as the CPU */
            double sum = 0.0;
#pragma unroll
            for (int i = 0; i < VPL; ++i)
                if (i < valid) sum += (double)moe_expf_fd(__fsub_rn(x[i], m));
            inv = __frcp_rn((float)warp_sum(sum));
        }
        if (extras.lse != NULL) { /* z_loss.c's row_lse: NaN propagates, a ±inf max is the lse */
            double l = 0.0;
            if (want_lse && (m != m || isinf(m))) {
                l = m;
            } else if (want_lse) {
                double sum = 0.0;
#pragma unroll
                for (int i = 0; i < VPL; ++i) /* exact differences; below -708 the terms are 0 */
                    if (i < valid) sum += moe_exp_fd(fmax((double)x[i] - (double)m, -708.0));
                l = (double)m + log(warp_sum(sum));
            }
            if (lane == 0) extras.lse[t] = l;
        }
        uint32_t hi[VPL];
        float src[VPL];
        if constexpr (softmax) {
            if (pre) {
#pragma unroll
                for (int i = 0; i < VPL; ++i) src[i] = moe_softmax_at_fd(x[i], m, inv);
            } else {
#pragma unroll
                for (int i = 0; i < VPL; ++i) src[i] = x[i];
            }
        } else if constexpr (sigmoid) { /* four at a time: the batch shares its coefficients */
            constexpr int B = VPL < 4 ? VPL : 4;
#pragma unroll
            for (int i = 0; i < VPL; i += B) moe_sigmoid_fd_n<B>(x + i, src + i);
        } else {
#pragma unroll
            for (int i = 0; i < VPL; ++i) src[i] = (float)moe_topk_score(&ctx, x[i]);
        }
        float sel[VPL];
#pragma unroll
        for (int i = 0; i < VPL; ++i) sel[i] = src[i];
        /* the bias is re-read per token (an L1 hit): fewer registers; softmax takes one only
         * with pre (checked), where src is the softmax value */
        if (expert_bias && e0 < E) {
            if (vec & MOE_LANES_VEC_BIAS) {
#pragma unroll
                for (int i = 0; i < VPL; i += 4) {
                    const float4 b = __ldg((const float4 *)(expert_bias + e0 + i));
                    sel[i] = __fadd_rn(src[i], b.x);
                    sel[i + 1] = __fadd_rn(src[i + 1], b.y);
                    sel[i + 2] = __fadd_rn(src[i + 2], b.z);
                    sel[i + 3] = __fadd_rn(src[i + 3], b.w);
                }
            } else {
#pragma unroll
                for (int i = 0; i < VPL; ++i)
                    if (i < valid) sel[i] = __fadd_rn(src[i], __ldg(expert_bias + e0 + i));
            }
        }
#pragma unroll
        for (int i = 0; i < VPL; ++i) /* -0 ranks as +0 */
            hi[i] = i < valid ? order_bits_z(sel[i]) : 0u;
        if (seg > 0) {
            /* the group's top gn values and their fp32 sum in rank order, as the C kernel's */
            float acc = 0.0f;
            if (gn <= 2) {
                uint32_t a = 0, b = 0;
#pragma unroll
                for (int i = 0; i < VPL; ++i) {
                    b = max(b, min(a, hi[i]));
                    a = max(a, hi[i]);
                }
                seg_top2(&a, &b, seg);
                acc = __fadd_rn(acc, from_order_bits(a));
                if (gn == 2) acc = __fadd_rn(acc, from_order_bits(b));
            } else {
                uint32_t hv[VPL];
#pragma unroll
                for (int i = 0; i < VPL; ++i) hv[i] = hi[i];
                for (int r = 0; r < gn; ++r) {
                    uint32_t b = 0;
#pragma unroll
                    for (int i = 0; i < VPL; ++i) b = max(b, hv[i]);
                    uint32_t sb = b;
                    for (int off = seg / 2; off > 0; off >>= 1)
                        sb = max(sb, __shfl_xor_sync(MOE_FULL_MASK, sb, off));
                    /* one copy of the value leaves per round, from the segment's lowest lane */
                    const uint32_t own = __ballot_sync(MOE_FULL_MASK, b == sb) & segmask;
                    if (lane == __ffs(own) - 1) {
                        int done = 0;
#pragma unroll
                        for (int i = 0; i < VPL; ++i)
                            if (!done && hv[i] == sb) hv[i] = 0u, done = 1;
                    }
                    acc = __fadd_rn(acc, from_order_bits(sb));
                }
            }
            float a = acc;
            if (softmax && !pre) a = (float)moe_round_to(ctx.dtype, (double)a);
            /* the kept groups: group_topk rounds over the segment leaders' keys, ties to the
             * lower group (the lower lane) */
            uint32_t gk = has_group && lane == seg_base ? order_bits_z(a) : 0u;
            int kept = 0;
            for (int r = 0; r < (int)ctx.group_topk; ++r) {
                const uint32_t top = __reduce_max_sync(MOE_FULL_MASK, gk);
                const uint32_t own = __ballot_sync(MOE_FULL_MASK, gk == top && top != 0u);
                if (lane == __ffs(own) - 1) kept = 1, gk = 0u;
            }
            kept = __shfl_sync(MOE_FULL_MASK, kept, seg_base);
            if (!kept) {
#pragma unroll
                for (int i = 0; i < VPL; ++i) hi[i] = 0u;
            }
        }

        lanes_topk<VPL>(hi, src, k, lane, e0, cand_key, cand_src, rank_of, win_i, win_p);
        /* moe_topk_probs in fp32 (every value here is fp32; an fp32 op rounded once is the C
         * kernel's fp64 op rounded to fp32): the order-dependent sums on lane 0 */
        if (softmax && !pre) {
            const float top = win_p[0];
            __syncwarp();
            for (int j = lane; j < k; j += 32) win_p[j] = moe_expf_fd(__fsub_rn(win_p[j], top));
        }
        __syncwarp();
        if (lane == 0 && ((softmax && !pre) || ctx.renorm)) {
            double sum = 0.0;
            for (int j = 0; j < k; ++j) sum += (double)win_p[j];
            if (softmax && !pre) *norm = __frcp_rn((float)sum);
            else *norm = __fadd_rn((float)sum, 1e-20f); /* moe_topk_renorm's sum */
        }
        __syncwarp();
        for (int j = lane; j < k; j += 32) {
            float p = win_p[j];
            if (softmax && !pre) p = __fmul_rn(p, *norm);
            else if (ctx.renorm) p = __fdiv_rn(p, *norm);
            if (ctx.has_scaling) p = __fmul_rn(p, sf);
            win_p[j] = p;
            topk_indices[t * k + j] = win_i[j];
            if (topk_probs) moe_store(topk_probs, ctx.dtype, t * k + j, (double)p);
        }
        __syncwarp();
        uint32_t picked = 0; /* bit i: expert e0 + i is routed */
        float pv[VPL];
#pragma unroll
        for (int i = 0; i < VPL; ++i) {
            const int r = rank_of[e0 + i];
            picked |= (uint32_t)(r >= 0) << i;
            pv[i] = r >= 0 ? win_p[r] : 0.0f;
        }
        if (probs && e0 < E)
            lanes_store_row<VPL>(probs, ctx.dtype, base + e0, valid, pv, vec & MOE_LANES_VEC_PROBS);
        if (routing_map && e0 < E)
            lanes_store_bits<VPL>(routing_map + base + e0, valid, picked, vec & MOE_LANES_VEC_MAP);
        if (extras.aux_scores != NULL) {
            /* the aux scores from src (softmax: the logit or the softmax value; else the unbiased
             * score): softmax over all experts, or s / (sum s + 1e-20); their top k is the aux
             * map, the routing's own for softmax-pre without groups (the same keys) */
            float av[VPL];
            uint32_t hit = 0;
            if (aux && softmax) {
#pragma unroll
                for (int i = 0; i < VPL; ++i) av[i] = pre ? src[i] : moe_softmax_at_fd(src[i], m, inv);
            } else if (aux) {
                double sum = 0.0;
#pragma unroll
                for (int i = 0; i < VPL; ++i)
                    if (i < valid) sum += (double)src[i];
                const float d = __fadd_rn((float)warp_sum(sum), 1e-20f);
#pragma unroll
                for (int i = 0; i < VPL; ++i) av[i] = __fdiv_rn(src[i], d);
            } else {
#pragma unroll
                for (int i = 0; i < VPL; ++i) av[i] = 0.0f;
            }
            if (aux && softmax && pre && seg == 0 && !expert_bias) { /* the routing's own keys */
                hit = picked;
            } else if (aux) {
#pragma unroll
                for (int i = 0; i < VPL; ++i)
                    hi[i] = i < valid ? order_bits_z(av[i]) : 0u;
                lanes_topk<VPL>(hi, av, k, lane, e0, cand_key, cand_src, rank_of, NULL, NULL);
#pragma unroll
                for (int i = 0; i < VPL; ++i) hit |= (uint32_t)(rank_of[e0 + i] >= 0) << i;
            }
            if (e0 < E) {
                lanes_store_row<VPL>(extras.aux_scores, MOE_DTYPE_FP32, base + e0, valid, av,
                                     vec & MOE_LANES_VEC_AUX);
                lanes_store_bits<VPL>(extras.aux_map + base + e0, valid, hit,
                                      vec & MOE_LANES_VEC_AUX_MAP);
            }
        }
        __syncwarp(); /* the next token reuses this warp's shared memory */
    }
}

typedef void (*moe_topk_fwd_warp_fn)(void *, int64_t *, const void *, const float *, int64_t,
                                     moe_topk_ctx_t);
typedef void (*moe_topk_fwd_warp32_fn)(void *, int64_t *, void *, uint8_t *,
                                       moe_router_topk_extras_t, const void *, const float *,
                                       int64_t, moe_topk_ctx_t);
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
MOE_VPL_SELECTOR(fwd_warp32_kernel, moe_topk_fwd_warp32_fn, moe_router_topk_fwd_warp32_kernel)
MOE_VPL_SELECTOR(bwd_warp_kernel, moe_topk_bwd_warp_fn, moe_router_topk_bwd_warp_kernel)
#undef MOE_VPL_SELECTOR

typedef void (*moe_topk_fwd_lanes_fn)(void *, int64_t *, void *, uint8_t *,
                                      moe_router_topk_extras_t, const void *, const float *,
                                      int64_t, moe_topk_ctx_t, int, unsigned);
#define MOE_LANES_SF(vpl_)                                                     \
    switch (score_function) {                                                  \
    case MOE_SCORE_SOFTMAX: return moe_router_topk_fwd_lanes_kernel<vpl_, MOE_SCORE_SOFTMAX>; \
    case MOE_SCORE_SIGMOID: return moe_router_topk_fwd_lanes_kernel<vpl_, MOE_SCORE_SIGMOID>; \
    default: return moe_router_topk_fwd_lanes_kernel<vpl_, MOE_SCORE_SQRTSOFTPLUS>;          \
    }
/* One instantiation per (row width, score function): the score function is then known at compile
 * time, so a row's code carries no per-expert switch and no other function's registers. */
static moe_topk_fwd_lanes_fn fwd_lanes_kernel(int vpl, int score_function) {
    switch (vpl) {
    case 2: MOE_LANES_SF(2)
    case 4: MOE_LANES_SF(4)
    default: MOE_LANES_SF(8)
    }
}
#undef MOE_LANES_SF

/* Lanes per group for the lanes kernel (0 without groups), or -1 where it does not apply: rows
 * of up to 32 experts (one per lane: both layouts are the same and k rounds cost less than the
 * threshold), rows wider than 256 (VPL = 16 spills), topk above 127, or groups that are not
 * whole power-of-two runs of lanes. The router_lanes switch (tuning.h) off keeps the strided
 * kernel, so the tests can run it on every width. */
static int lanes_seg(const moe_topk_ctx_t *c, int vpl) {
    if (!moe_tuning_get().router_lanes || vpl < 2 || vpl > 8 || c->topk > 127)
        return -1; /* topk > 127: the lanes kernel's ranks are int8 */
    if (c->num_groups == 0) return 0;
    if (c->per_group % vpl != 0) return -1;
    const int64_t s = c->per_group / vpl;
    return s <= 32 && (s & (s - 1)) == 0 ? (int)s : -1;
}

/* The lanes kernel's 16-byte access flags for these pointers. */
static unsigned lanes_vec(int64_t num_experts, int vpl, moe_dtype_t dt, const void *logits,
                          const float *expert_bias, const void *probs,
                          const uint8_t *routing_map, const moe_router_topk_extras_t *ex) {
    unsigned vec = 0;
    if (num_experts % vpl != 0) return 0; /* a lane's run would cross into the next row */
    if (vpl % 4 == 0) {
        if (dt == MOE_DTYPE_FP32 && (uintptr_t)logits % 16 == 0) vec |= MOE_LANES_VEC_LOAD;
        if (dt == MOE_DTYPE_FP32 && probs && (uintptr_t)probs % 16 == 0) vec |= MOE_LANES_VEC_PROBS;
        if (ex->aux_scores && (uintptr_t)ex->aux_scores % 16 == 0) vec |= MOE_LANES_VEC_AUX;
        if (expert_bias && (uintptr_t)expert_bias % 16 == 0) vec |= MOE_LANES_VEC_BIAS;
    }
    if (vpl == 4 || vpl == 8) {
        if (routing_map && (uintptr_t)routing_map % vpl == 0) vec |= MOE_LANES_VEC_MAP;
        if (ex->aux_map && (uintptr_t)ex->aux_map % vpl == 0) vec |= MOE_LANES_VEC_AUX_MAP;
    }
    return vec;
}

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

/* The extras on the fp64 / wide-row paths, one thread per token running the CPU's row routines:
 * a second read of the logits, which the fused fp32 kernel avoids. scratch: 2·topk words per
 * token for the aux top-k list. */
__global__ void moe_router_extras_kernel(moe_router_topk_extras_t extras, const void *logits,
                                         int64_t num_tokens, moe_topk_ctx_t ctx,
                                         double *scratch) {
    const int64_t t = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= num_tokens) return;
    const int64_t E = ctx.num_experts;
    const int pad = extras.padding_mask != NULL && extras.padding_mask[t] != 0;
    if (extras.aux_scores != NULL && pad) {
        const moe_dtype_t sdt = ctx.fp64 ? MOE_DTYPE_FP64 : MOE_DTYPE_FP32;
        for (int64_t e = 0; e < E; ++e) {
            moe_store(extras.aux_scores, sdt, t * E + e, 0.0);
            extras.aux_map[t * E + e] = 0;
        }
    } else if (extras.aux_scores != NULL) {
        moe_router_aux_row(&ctx, logits, t, extras.aux_scores, extras.aux_map,
                           scratch + t * 2 * ctx.topk);
    }
    if (extras.lse != NULL) extras.lse[t] = pad ? 0.0 : moe_router_row_lse(logits, ctx.dtype, t * E, E);
}

/* grad_lse [T] → grad_logits [T, E] = grad_lse[t] · softmax row (0 on padded rows); one thread
 * per element, grid-stride. */
__global__ void moe_router_lse_bwd_kernel(void *grad_logits, const double *grad_lse,
                                          const void *logits, const double *lse,
                                          const uint8_t *padding_mask, int64_t num_tokens,
                                          int64_t num_experts, moe_dtype_t dt) {
    const int64_t n = num_tokens * num_experts;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x) {
        const int64_t t = i / num_experts;
        const int pad = padding_mask != NULL && padding_mask[t] != 0;
        moe_store(grad_logits, dt, i,
                  moe_router_lse_grad(grad_lse[t], moe_load(logits, dt, i), lse[t], pad));
    }
}

extern "C" size_t moe_cuda_router_topk_workspace_size(int64_t num_tokens, int64_t num_experts,
                                                      const moe_router_topk_params_t *params) {
    if (!params || num_tokens <= 0 || warp_vpl(num_experts, params->num_groups) > 0) return 0;
    /* row_words <= 4·topk + 3·num_groups + 1 (topk: moe_topk_scratch_k), per token, checked */
    const int64_t k = moe_topk_scratch_k(params) > 0 ? moe_topk_scratch_k(params) : 0;
    const int64_t g = params->num_groups > 0 ? params->num_groups : 0;
    int64_t a, b, words;
    if (moe_checked_mul_i64(k, 4, &a) || moe_checked_mul_i64(g, 3, &b) ||
        moe_checked_add_i64(a, b, &words) || moe_checked_add_i64(words, 1, &words) ||
        moe_checked_mul_i64(words, num_tokens, &words) ||
        moe_checked_bytes(words, (int64_t)sizeof(double)) == MOE_SIZE_OVERFLOW)
        return moe_fail_size("moe_cuda_router_topk_workspace_size: num_tokens=%lld, topk=%lld, "
                             "num_groups=%lld overflow int64 bytes", (long long)num_tokens,
                             (long long)params->topk, (long long)params->num_groups);
    return moe_checked_bytes(words, (int64_t)sizeof(double));
}

static moe_status_t check_common(int64_t num_tokens, int64_t num_experts, moe_dtype_t dt,
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
static unsigned warp32_blocks(int64_t num_tokens) {
    int dev = 0, sms = 132;
    if (cudaGetDevice(&dev) == cudaSuccess)
        cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
    const int64_t need = (num_tokens + MOE_ROUTER32_WARPS - 1) / MOE_ROUTER32_WARPS;
    const int64_t full = (int64_t)sms * (2048 / (32 * MOE_ROUTER32_WARPS));
    return (unsigned)(need < full ? need : full);
}

/* Bytes of the compact-probs block at the front of the dense paths' workspace. */
static size_t compact_bytes(int64_t num_tokens, int64_t topk, moe_dtype_t dt) {
    return ((size_t)(num_tokens * topk) * moe_dtype_size(dt) + 255) / 256 * 256;
}

/* The forward behind both layouts: compact topk_probs and/or dense probs + map, and the extras.
 * fp32/bf16/fp16 rows up to 1024 experts take a fused kernel (lanes or strided, extras
 * included); fp64 rows
 * take the fp64 warp kernel, wider rows or more than 32 groups the thread-per-token fallback;
 * those two write the dense layout with a second kernel from compact probs kept in the
 * workspace, and the extras with a third (moe_router_extras_kernel). */
static moe_status_t topk_fwd(void *topk_probs, int64_t *topk_indices, void *probs,
                             uint8_t *routing_map, const moe_router_topk_extras_t *extras,
                             const void *logits, const float *expert_bias, int64_t num_tokens,
                             int64_t num_experts, moe_dtype_t dt,
                             const moe_router_topk_params_t *params, void *workspace,
                             void *stream) {
    const moe_topk_ctx_t ctx = moe_topk_ctx_make(params, num_experts, dt);
    const int vpl = warp_vpl(num_experts, params->num_groups);
    const int64_t k = params->topk;
    moe_router_topk_extras_t ex = {NULL, NULL, NULL, NULL};
    if (extras) ex = *extras;
    if (vpl > 0 && dt != MOE_DTYPE_FP64) {
        const size_t smem = (size_t)MOE_ROUTER32_WARPS * (2 * (size_t)k + 1) * sizeof(double);
        const int seg = lanes_seg(&ctx, vpl);
        if (seg >= 0) {
            const size_t lsmem = MOE_ROUTER32_WARPS * lanes_warp_bytes(k, vpl);
            moe_topk_fwd_lanes_fn lanes = fwd_lanes_kernel(vpl, ctx.score_function);
            MOE_TRY(warp_smem((const void *)lanes, lsmem));
            lanes<<<warp32_blocks(num_tokens), 32 * MOE_ROUTER32_WARPS, lsmem, (cudaStream_t)stream>>>(
                topk_probs, topk_indices, probs, routing_map, ex, logits, expert_bias, num_tokens,
                ctx, seg,
                lanes_vec(num_experts, vpl, dt, logits, expert_bias, probs, routing_map, &ex));
            MOE_CHECK_LAUNCH("moe_router_topk_fwd_lanes_kernel");
            return MOE_OK;
        }
        moe_topk_fwd_warp32_fn kernel = fwd_warp32_kernel(vpl);
        MOE_TRY(warp_smem((const void *)kernel, smem));
        kernel<<<warp32_blocks(num_tokens), 32 * MOE_ROUTER32_WARPS, smem, (cudaStream_t)stream>>>(
            topk_probs, topk_indices, probs, routing_map, ex, logits, expert_bias, num_tokens,
            ctx);
        MOE_CHECK_LAUNCH("moe_router_topk_fwd_warp32_kernel");
        return MOE_OK;
    }
    char *ws = (char *)workspace;
    void *compact = topk_probs;
    if (!compact) { /* dense only: compact probs go to the front of the workspace */
        compact = ws;
        ws += compact_bytes(num_tokens, k, dt);
    }
    if (vpl > 0) {
        const size_t smem = (size_t)MOE_ROUTER_WARPS * 3 * (size_t)k * sizeof(double);
        moe_topk_fwd_warp_fn kernel = fwd_warp_kernel(vpl);
        MOE_TRY(warp_smem((const void *)kernel, smem));
        kernel<<<moe_blocks_for(num_tokens, MOE_ROUTER_WARPS), 32 * MOE_ROUTER_WARPS, smem,
                 (cudaStream_t)stream>>>(compact, topk_indices, logits, expert_bias, num_tokens,
                                         ctx);
        MOE_CHECK_LAUNCH("moe_router_topk_fwd_warp_kernel");
    } else {
        moe_router_topk_fwd_kernel<<<moe_blocks_for(num_tokens, MOE_CUDA_THREADS),
                                     MOE_CUDA_THREADS, 0, (cudaStream_t)stream>>>(
            compact, topk_indices, logits, expert_bias, num_tokens, ctx, (double *)ws,
            row_words(params));
        MOE_CHECK_LAUNCH("moe_router_topk_fwd_kernel");
        ws += moe_cuda_router_topk_workspace_size(num_tokens, num_experts, params);
    }
    if (probs || routing_map)
        MOE_TRY(moe_cuda_topk_to_dense_fwd(probs, routing_map, compact, topk_indices, num_tokens,
                                           num_experts, k, dt, NULL, 0, stream));
    if (ex.aux_scores || ex.lse) {
        moe_router_extras_kernel<<<moe_blocks_for(num_tokens, MOE_CUDA_THREADS), MOE_CUDA_THREADS,
                                   0, (cudaStream_t)stream>>>(ex, logits, num_tokens, ctx,
                                                              (double *)ws);
        MOE_CHECK_LAUNCH("moe_router_extras_kernel");
    }
    return MOE_OK;
}

extern "C" size_t moe_cuda_router_topk_fused_workspace_size(int64_t num_tokens,
                                                            int64_t num_experts,
                                                            const moe_router_topk_params_t *params,
                                                            moe_dtype_t logits_dtype,
                                                            int with_aux) {
    if (!params || num_tokens <= 0) return 0;
    const int vpl = warp_vpl(num_experts, params->num_groups);
    if (vpl > 0 && logits_dtype != MOE_DTYPE_FP64) return 0;
    /* the compact [T, topk] probs (256-byte aligned), the per-row scratch, the aux lists */
    const size_t rows = moe_cuda_router_topk_workspace_size(num_tokens, num_experts, params);
    int64_t total = 0;
    if (rows == MOE_SIZE_OVERFLOW) return rows;
    int64_t cells;
    if (moe_checked_mul_i64(num_tokens, params->topk > 0 ? params->topk : 0, &cells) ||
        moe_checked_section(&total, cells, (int64_t)moe_dtype_size(logits_dtype), 256) ||
        moe_checked_add_i64(total, (int64_t)rows, &total) ||
        (with_aux && moe_checked_section(&total, cells, 2 * (int64_t)sizeof(double), 1)))
        return moe_fail_size("moe_cuda_router_topk_fused_workspace_size: num_tokens=%lld, "
                             "topk=%lld overflow int64 bytes", (long long)num_tokens,
                             (long long)params->topk);
    return (size_t)total;
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
    return topk_fwd(topk_probs, topk_indices, NULL, NULL, NULL, logits, expert_bias, num_tokens,
                    num_experts, logits_dtype, params, workspace, stream);
}

extern "C" moe_status_t moe_cuda_router_topk_fused_fwd(void *probs, uint8_t *routing_map,
                                                       int64_t *topk_indices,
                                                       const moe_router_topk_extras_t *extras,
                                                       const void *logits,
                                                       const float *expert_bias,
                                                       int64_t num_tokens, int64_t num_experts,
                                                       moe_dtype_t logits_dtype,
                                                       const moe_router_topk_params_t *params,
                                                       void *workspace, size_t workspace_bytes,
                                                       void *stream) {
    moe_clear_error();
    /* the workspace check is the fused size's below (check_common knows the compact path's) */
    MOE_TRY(check_common(num_tokens, num_experts, logits_dtype, params, expert_bias != NULL,
                         MOE_SIZE_OVERFLOW));
    MOE_TRY(moe_router_topk_extras_check(extras, num_tokens));
    const size_t need = moe_cuda_router_topk_fused_workspace_size(
        num_tokens, num_experts, params, logits_dtype, extras && extras->aux_scores);
    if (need == MOE_SIZE_OVERFLOW) return MOE_ERR_INVALID_ARGUMENT; /* the size function said why */
    MOE_CHECK(workspace_bytes >= need, "workspace too small: %zu bytes, need %zu", workspace_bytes,
              need);
    if (num_tokens == 0) return MOE_OK;
    MOE_CHECK(probs && routing_map, "probs and routing_map must not be NULL");
    return topk_fwd(NULL, topk_indices, probs, routing_map, extras, logits, expert_bias,
                    num_tokens, num_experts, logits_dtype, params, workspace, stream);
}

extern "C" moe_status_t moe_cuda_router_lse_bwd(void *grad_logits, const double *grad_lse,
                                                const void *logits, const double *lse,
                                                const uint8_t *padding_mask, int64_t num_tokens,
                                                int64_t num_experts, moe_dtype_t logits_dtype,
                                                void *workspace, size_t workspace_bytes,
                                                void *stream) {
    (void)workspace;
    (void)workspace_bytes;
    moe_clear_error();
    MOE_TRY(moe_router_lse_bwd_check(grad_logits, grad_lse, logits, lse, num_tokens, num_experts,
                                     logits_dtype));
    if (num_tokens == 0) return MOE_OK;
    int64_t blocks = (num_tokens * num_experts + 255) / 256;
    if (blocks > (1 << 20)) blocks = 1 << 20; /* grid-stride beyond */
    moe_router_lse_bwd_kernel<<<(unsigned)blocks, 256, 0, (cudaStream_t)stream>>>(
        grad_logits, grad_lse, logits, lse, padding_mask, num_tokens, num_experts, logits_dtype);
    MOE_CHECK_LAUNCH("moe_router_lse_bwd_kernel");
    return MOE_OK;
}

static moe_status_t topk_bwd(void *grad_logits, const void *grad_probs, const void *logits,
                             const int64_t *topk_indices, int64_t num_tokens, int64_t num_experts,
                             moe_dtype_t logits_dtype, const moe_router_topk_params_t *params,
                             int grad_dense, void *workspace, size_t workspace_bytes,
                             void *stream) {
    moe_clear_error();
    MOE_TRY(check_common(num_tokens, num_experts, logits_dtype, params, 0, workspace_bytes));
    if (num_tokens == 0) return MOE_OK;
    moe_topk_ctx_t ctx = moe_topk_ctx_make(params, num_experts, logits_dtype);
    ctx.grad_dense = grad_dense;
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

extern "C" moe_status_t moe_cuda_router_topk_bwd(void *grad_logits, const void *grad_probs,
                                                 const void *logits, const int64_t *topk_indices,
                                                 int64_t num_tokens, int64_t num_experts,
                                                 moe_dtype_t logits_dtype,
                                                 const moe_router_topk_params_t *params,
                                                 void *workspace, size_t workspace_bytes,
                                                 void *stream) {
    return topk_bwd(grad_logits, grad_probs, logits, topk_indices, num_tokens, num_experts,
                    logits_dtype, params, 0, workspace, workspace_bytes, stream);
}

extern "C" moe_status_t moe_cuda_router_topk_dense_bwd(void *grad_logits, const void *grad_probs,
                                                       const void *logits,
                                                       const int64_t *topk_indices,
                                                       int64_t num_tokens, int64_t num_experts,
                                                       moe_dtype_t logits_dtype,
                                                       const moe_router_topk_params_t *params,
                                                       void *workspace, size_t workspace_bytes,
                                                       void *stream) {
    return topk_bwd(grad_logits, grad_probs, logits, topk_indices, num_tokens, num_experts,
                    logits_dtype, params, 1, workspace, workspace_bytes, stream);
}
