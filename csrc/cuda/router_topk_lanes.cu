/*
 * router_topk_lanes.cu: the fused fp32 router on CUDA, lanes layout: logits below fp64 (rows of
 * 33-256 experts) → the top-k, the probs in either layout and the loss extras (aux scores and
 * map, lse), in one pass over the logits. router_topk.cu dispatches to it.
 *
 * The clever part is the layout: a lane holds neighbouring experts, so a group is a run of lanes
 * and the top-k a threshold plus a count over a few candidates instead of k warp arg-max rounds,
 * and the fp64 sigmoid / exp (the largest share of a row's instructions) is a polynomial that
 * rounds to the library's fp32 results, so the bits are the strided kernel's and the CPU's.
 */
#include "router_topk_cuda.cuh"
#include "exp_poly_math.h"

/* ---- the lanes kernel: a lane holds VPL neighbouring experts ---------------------------------
 * The same routing and extras as the strided fused fp32 kernel (router_topk_warp32.cu), for rows
 * of 33-256 experts, in far fewer instructions per token. Lane l holds experts l·VPL ..
 * l·VPL + VPL − 1, so a group of P experts is a segment of P / VPL lanes: a group's top-n is a
 * lane-local scan plus log2(P / VPL) shuffles, where the strided layout needs one warp reduction
 * per (group, round). The fp64 sigmoid and exp, the largest share of a row's instructions, are
 * the polynomial below instead of the library's (same fp32 result: see moe_exp_fd), evaluated
 * four experts at a time. One instantiation per score function, so a row
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
int moe_router_topk_lanes_seg(const moe_topk_ctx_t *c, int vpl) {
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

moe_status_t moe_router_topk_fwd_lanes(void *topk_probs, int64_t *topk_indices, void *probs,
                                       uint8_t *routing_map, const moe_router_topk_extras_t *ex_,
                                       const void *logits, const float *expert_bias,
                                       int64_t num_tokens, const moe_topk_ctx_t *ctx_, int vpl,
                                       int seg, void *stream) {
    const moe_topk_ctx_t ctx = *ctx_;
    const moe_router_topk_extras_t ex = *ex_;
    const int64_t k = ctx.topk, num_experts = ctx.num_experts;
    const moe_dtype_t dt = ctx.dtype;
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
