/*
 * router_topk_warp32.cu: the fused fp32 router on CUDA, strided layout: logits below fp64 (rows
 * of up to 1024 experts, expert lane + 32·i) → the top-k, the probs in either layout and the
 * loss extras (aux scores and map, lse), in one pass over the logits. router_topk.cu dispatches
 * to it where the lanes kernel (router_topk_lanes.cu) does not apply.
 *
 * The clever part is the 64-bit selection key (router_topk_cuda.cuh): below fp64 every
 * selection score is an fp32 value, so a score and its expert id pack into one key whose
 * unsigned order is the C kernel's, and an arg-max round is two 32-bit warp max reductions
 * (redux.sync). Groups that are segments of lanes reduce side by side, and the extras come from
 * the same registers as the routing, so the logits are read once.
 */
#include "router_topk_cuda.cuh"

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

typedef void (*moe_topk_fwd_warp32_fn)(void *, int64_t *, void *, uint8_t *,
                                       moe_router_topk_extras_t, const void *, const float *,
                                       int64_t, moe_topk_ctx_t);
MOE_VPL_SELECTOR(fwd_warp32_kernel, moe_topk_fwd_warp32_fn, moe_router_topk_fwd_warp32_kernel)
#undef MOE_VPL_SELECTOR

moe_status_t moe_router_topk_fwd_warp32(void *topk_probs, int64_t *topk_indices, void *probs,
                                        uint8_t *routing_map, const moe_router_topk_extras_t *ex_,
                                        const void *logits, const float *expert_bias,
                                        int64_t num_tokens, const moe_topk_ctx_t *ctx_, int vpl,
                                        void *stream) {
    const moe_topk_ctx_t ctx = *ctx_;
    const moe_router_topk_extras_t ex = *ex_;
    const int64_t k = ctx.topk;
    const size_t smem = (size_t)MOE_ROUTER32_WARPS * (2 * (size_t)k + 1) * sizeof(double);
    moe_topk_fwd_warp32_fn kernel = fwd_warp32_kernel(vpl);
    MOE_TRY(warp_smem((const void *)kernel, smem));
    kernel<<<warp32_blocks(num_tokens), 32 * MOE_ROUTER32_WARPS, smem, (cudaStream_t)stream>>>(
        topk_probs, topk_indices, probs, routing_map, ex, logits, expert_bias, num_tokens,
        ctx);
    MOE_CHECK_LAUNCH("moe_router_topk_fwd_warp32_kernel");
    return MOE_OK;
}
