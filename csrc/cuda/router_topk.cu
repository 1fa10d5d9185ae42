/*
 * router_topk.cu: the router's score function, (group-limited) top-k and probs on CUDA: the
 * forward of both layouts (compact [T, topk] and dense [T, E] with the loss extras), its
 * dispatch among the kernels and its entry points.
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
 * same order and rounding points. Rows of up to 256 experts take the lanes kernel
 * (router_topk_lanes.cu): a lane holds neighbouring experts, so a group is a run of lanes and the
 * top-k a threshold plus a count over a few candidates, with a polynomial fp64 sigmoid / exp;
 * other rows take the strided kernel (router_topk_warp32.cu: expert lane + 32·i, k rounds of
 * 64-bit warp arg-max).
 *
 * Rows wider than 1024 experts, or more than 32 groups, take the fallback: one thread per token
 * running the C routine whole, with its scratch in the caller's workspace. Nothing is allocated
 * and nothing waits on the host. The backward is router_topk_bwd.cu.
 */
#include "router_topk_cuda.cuh"

/* Warp-wide best (value, index) under moe_topk_before; every lane gets the result. */
__device__ __forceinline__ void warp_best(double *v, int64_t *i) {
    for (int off = 16; off > 0; off >>= 1) {
        double ov = __shfl_xor_sync(MOE_FULL_MASK, *v, off);
        long long oi = __shfl_xor_sync(MOE_FULL_MASK, (long long)*i, off);
        if (moe_topk_before(ov, (int64_t)oi, *v, *i)) *v = ov, *i = (int64_t)oi;
    }
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

typedef void (*moe_topk_fwd_warp_fn)(void *, int64_t *, const void *, const float *, int64_t,
                                     moe_topk_ctx_t);
MOE_VPL_SELECTOR(fwd_warp_kernel, moe_topk_fwd_warp_fn, moe_router_topk_fwd_warp_kernel)
#undef MOE_VPL_SELECTOR

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

/* Bytes of the compact-probs block at the front of the dense paths' workspace. */
static size_t compact_bytes(int64_t num_tokens, int64_t topk, moe_dtype_t dt) {
    return ((size_t)(num_tokens * topk) * moe_dtype_size(dt) + 255) / 256 * 256;
}

/* The forward behind both layouts: compact topk_probs and/or dense probs + map, and the extras.
 * fp32/bf16/fp16 rows up to 1024 experts take a fused kernel (lanes or strided, extras
 * included: router_topk_lanes.cu, router_topk_warp32.cu); fp64 rows
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
        const int seg = moe_router_topk_lanes_seg(&ctx, vpl);
        if (seg >= 0)
            return moe_router_topk_fwd_lanes(topk_probs, topk_indices, probs, routing_map, &ex,
                                             logits, expert_bias, num_tokens, &ctx, vpl, seg,
                                             stream);
        return moe_router_topk_fwd_warp32(topk_probs, topk_indices, probs, routing_map, &ex,
                                          logits, expert_bias, num_tokens, &ctx, vpl, stream);
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
