/*
 * router_topk.c: the router's score function, (group-limited) top-k and probs on the CPU.
 *
 * One token per loop iteration, tokens spread over OpenMP threads; each thread works in its own
 * slice of the caller's workspace, so the kernel allocates nothing.
 *
 * The clever part is how parity with Megatron's unfused PyTorch code is kept: every value that
 * Megatron materialises as a tensor (the fp32 scores, the biased selection scores, the sum used to
 * renormalise, the probs before the cast) is computed here in double and then rounded to the
 * precision that tensor has (`moe_round_to`). So each step is the correctly rounded result of the
 * same operation, and selection sees the same values up to the last-bit error of torch's own
 * vectorised exp. Ties are broken by the lowest expert index, which torch leaves unspecified.
 */
#include "common.h"
#include "router_topk_math.h"

/* One thread's scratch (row scratch + its probs + the aux top-k list of the fused forward),
 * padded to whole 64-byte cache lines so that threads never write to the same line; -1 when the
 * word count overflows int64 (topk or num_groups near 2^62). */
static int64_t thread_words(int64_t topk, int64_t num_groups) {
    int64_t a, b, w;
    if (topk < 0) topk = 0;
    if (num_groups < 0) num_groups = 0;
    if (moe_checked_mul_i64(topk, 6, &a) || moe_checked_mul_i64(num_groups, 3, &b) ||
        moe_checked_add_i64(a, b, &w) || moe_checked_add_i64(w, 1 + 7, &w))
        return -1;
    return w / 8 * 8;
}

size_t moe_router_topk_workspace_size(int64_t num_tokens, int64_t num_experts,
                                      const moe_router_topk_params_t *params) {
    (void)num_tokens;
    int64_t groups = params && params->num_groups > 0 ? params->num_groups : 0;
    int64_t topk = params ? moe_topk_scratch_k(params) : num_experts;
    const int64_t words = thread_words(topk, groups);
    int64_t all;
    if (words < 0 || moe_checked_mul_i64(words, moe_max_threads(), &all) ||
        moe_checked_bytes(all, (int64_t)sizeof(double)) == MOE_SIZE_OVERFLOW)
        return moe_fail_size("moe_router_topk_workspace_size: topk=%lld, num_groups=%lld need "
                             "more than int64 bytes of scratch",
                             (long long)topk, (long long)groups);
    return moe_checked_bytes(all, (int64_t)sizeof(double));
}

size_t moe_router_topk_fused_workspace_size(int64_t num_tokens, int64_t num_experts,
                                            const moe_router_topk_params_t *params,
                                            moe_dtype_t logits_dtype, int with_aux) {
    (void)logits_dtype, (void)with_aux; /* a thread's scratch already holds the aux list */
    return moe_router_topk_workspace_size(num_tokens, num_experts, params);
}

moe_status_t moe_router_topk_check(const moe_router_topk_params_t *p, int64_t num_experts,
                                   int has_expert_bias) {
    MOE_CHECK(p != NULL, "params must not be NULL");
    MOE_CHECK(num_experts >= 1, "num_experts must be >= 1, got %lld", (long long)num_experts);
    MOE_CHECK(p->topk >= 1 && p->topk <= num_experts,
              "topk must be in [1, num_experts=%lld], got topk=%lld", (long long)num_experts,
              (long long)p->topk);
    MOE_TRY(moe_check_score_function(p->score_function));
    const int post = p->score_function == MOE_SCORE_SOFTMAX && !p->use_pre_softmax;
    MOE_CHECK(!(has_expert_bias && post),
              "expert_bias with score_function softmax needs use_pre_softmax (the bias is added "
              "to the softmax probs for the selection only)");
    MOE_CHECK(p->norm == MOE_TOPK_NORM_DEFAULT || p->norm == MOE_TOPK_NORM_NONE ||
                  p->norm == MOE_TOPK_NORM_SUM,
              "norm must be default (0), none (1) or sum (2), got %d", (int)p->norm);
    MOE_CHECK(!(post && p->norm != MOE_TOPK_NORM_DEFAULT),
              "norm=%d: softmax without use_pre_softmax is a softmax over the k picked logits, "
              "normalised by construction; only the default norm (0) applies",
              (int)p->norm);
    MOE_CHECK(p->group_score_topk >= 0, "group_score_topk must be >= 0 (0: topk / group_topk), "
              "got %lld", (long long)p->group_score_topk);
    if (p->num_groups == 0 && p->group_topk == 0) {
        MOE_CHECK(p->group_score_topk == 0, "group_score_topk=%lld needs group-limited routing "
                  "(num_groups and group_topk)", (long long)p->group_score_topk);
        return MOE_OK;
    }
    MOE_CHECK(p->num_groups >= 1, "num_groups must be >= 1 when group_topk is set, got %lld",
              (long long)p->num_groups);
    MOE_CHECK(num_experts % p->num_groups == 0,
              "num_experts=%lld must be divisible by num_groups=%lld", (long long)num_experts,
              (long long)p->num_groups);
    MOE_CHECK(p->group_topk >= 1 && p->group_topk <= p->num_groups,
              "group_topk must be in [1, num_groups=%lld], got group_topk=%lld",
              (long long)p->num_groups, (long long)p->group_topk);
    int64_t per_group = num_experts / p->num_groups;
    MOE_CHECK(p->group_topk * per_group >= p->topk,
              "topk=%lld exceeds the experts in the kept groups (group_topk=%lld x %lld experts "
              "per group = %lld)",
              (long long)p->topk, (long long)p->group_topk, (long long)per_group,
              (long long)(p->group_topk * per_group));
    if (p->group_score_topk > 0) {
        MOE_CHECK(p->group_score_topk <= per_group,
                  "group_score_topk=%lld exceeds the %lld experts of a group",
                  (long long)p->group_score_topk, (long long)per_group);
        return MOE_OK;
    }
    MOE_CHECK(p->topk >= p->group_topk,
              "group_topk=%lld must be <= topk=%lld: a group's score is the sum of its top "
              "topk // group_topk experts, which would be empty",
              (long long)p->group_topk, (long long)p->topk);
    return MOE_OK;
}

moe_status_t moe_router_topk_check_args(int64_t num_tokens, int64_t num_experts,
                                        moe_dtype_t logits_dtype,
                                        const moe_router_topk_params_t *params,
                                        int has_expert_bias) {
    MOE_CHECK(num_tokens >= 0, "num_tokens must be >= 0, got %lld", (long long)num_tokens);
    MOE_CHECK(moe_is_float_dtype(logits_dtype), "logits must be a float dtype, got %s",
              moe_dtype_name(logits_dtype));
    MOE_TRY(moe_router_topk_check(params, num_experts, has_expert_bias));
    /* [T, E] logits and probs; [T, topk] with topk <= E fits whenever this does */
    return moe_check_mul(num_tokens, "num_tokens", num_experts, "num_experts");
}

/* The CPU's own limit on top of the shared check: its per-thread scratch must be countable. */
static moe_status_t check_common(int64_t num_tokens, int64_t num_experts, moe_dtype_t dt,
                                 const moe_router_topk_params_t *p, int has_bias) {
    MOE_TRY(moe_router_topk_check_args(num_tokens, num_experts, dt, p, has_bias));
    MOE_CHECK(thread_words(moe_topk_scratch_k(p), p->num_groups) >= 0,
              "topk=%lld, num_groups=%lld, group_score_topk=%lld: the per-thread scratch "
              "overflows int64",
              (long long)p->topk, (long long)p->num_groups, (long long)p->group_score_topk);
    return MOE_OK;
}

/* The forward of both layouts: compact topk_probs [T, k] and/or dense probs + map [T, E], and
 * the fused router's optional extras (aux scores + map, lse) from the same row while it is hot. */
static moe_status_t topk_fwd(void *topk_probs, int64_t *topk_indices, void *probs,
                             uint8_t *routing_map, const moe_router_topk_extras_t *extras,
                             const void *logits, const float *expert_bias, int64_t num_tokens,
                             int64_t num_experts, moe_dtype_t logits_dtype,
                             const moe_router_topk_params_t *params, void *workspace,
                             size_t workspace_bytes) {
    moe_clear_error();
    MOE_TRY(check_common(num_tokens, num_experts, logits_dtype, params, expert_bias != NULL));
    if (num_tokens == 0) return MOE_OK;
    MOE_CHECK(topk_indices && logits && (topk_probs || probs || routing_map),
              "topk_indices, logits and an output for the probs must not be NULL");
    const int64_t words = thread_words(moe_topk_scratch_k(params), params->num_groups);
    const int64_t nthreads = (int64_t)(workspace_bytes / ((size_t)words * sizeof(double)));
    MOE_CHECK(workspace != NULL && nthreads >= 1,
              "workspace too small: %zu bytes, need at least %zu (moe_router_topk_workspace_size)",
              workspace_bytes, (size_t)words * sizeof(double));
    const int64_t k = params->topk, E = num_experts;
    const moe_topk_ctx_t ctx = moe_topk_ctx_make(params, num_experts, logits_dtype);
    void *aux_scores = extras ? extras->aux_scores : NULL;
    uint8_t *aux_map = extras ? extras->aux_map : NULL;
    double *lse = extras ? extras->lse : NULL;
    const uint8_t *mask = extras ? extras->padding_mask : NULL;
    const moe_dtype_t sdt = logits_dtype == MOE_DTYPE_FP64 ? MOE_DTYPE_FP64 : MOE_DTYPE_FP32;

#pragma omp parallel num_threads((int)nthreads)
    {
        double *scratch = (double *)workspace + (int64_t)moe_thread_id() * words;
#pragma omp for schedule(static)
        for (int64_t t = 0; t < num_tokens; ++t) {
            double *p = scratch + moe_topk_scratch_words(moe_topk_scratch_k(params),
                                                         params->num_groups);
            const int64_t *idx = topk_indices + t * k;
            moe_topk_row_fwd(&ctx, logits, t, expert_bias, scratch, topk_indices + t * k, p);
            if (topk_probs)
                for (int64_t j = 0; j < k; ++j) moe_store(topk_probs, logits_dtype, t * k + j, p[j]);
            if (probs) {
                for (int64_t e = 0; e < E; ++e) moe_store(probs, logits_dtype, t * E + e, 0.0);
                for (int64_t j = 0; j < k; ++j) moe_store(probs, logits_dtype, t * E + idx[j], p[j]);
            }
            if (routing_map) {
                for (int64_t e = 0; e < E; ++e) routing_map[t * E + e] = 0;
                for (int64_t j = 0; j < k; ++j) routing_map[t * E + idx[j]] = 1;
            }
            const int pad = mask != NULL && mask[t] != 0;
            if (aux_scores && pad) {
                for (int64_t e = 0; e < E; ++e) {
                    moe_store(aux_scores, sdt, t * E + e, 0.0);
                    aux_map[t * E + e] = 0;
                }
            } else if (aux_scores) {
                moe_router_aux_row(&ctx, logits, t, aux_scores, aux_map, p + k);
            }
            if (lse) lse[t] = pad ? 0.0 : moe_router_row_lse(logits, logits_dtype, t * E, E);
        }
    }
    return MOE_OK;
}

moe_status_t moe_router_topk_fwd(void *topk_probs, int64_t *topk_indices, const void *logits,
                                 const float *expert_bias, int64_t num_tokens,
                                 int64_t num_experts, moe_dtype_t logits_dtype,
                                 const moe_router_topk_params_t *params, void *workspace,
                                 size_t workspace_bytes, void *stream) {
    (void)stream;
    moe_clear_error();
    MOE_CHECK(num_tokens <= 0 || topk_probs, "topk_probs must not be NULL");
    return topk_fwd(topk_probs, topk_indices, NULL, NULL, NULL, logits, expert_bias, num_tokens,
                    num_experts, logits_dtype, params, workspace, workspace_bytes);
}

moe_status_t moe_router_topk_extras_check(const moe_router_topk_extras_t *extras,
                                          int64_t num_tokens) {
    if (extras == NULL || num_tokens <= 0) return MOE_OK;
    MOE_CHECK((extras->aux_scores == NULL) == (extras->aux_map == NULL),
              "aux_scores and aux_map must be both set or both NULL (got aux_scores=%p, "
              "aux_map=%p)", extras->aux_scores, (void *)extras->aux_map);
    return MOE_OK;
}

moe_status_t moe_router_topk_fused_fwd(void *probs, uint8_t *routing_map, int64_t *topk_indices,
                                       const moe_router_topk_extras_t *extras, const void *logits,
                                       const float *expert_bias, int64_t num_tokens,
                                       int64_t num_experts, moe_dtype_t logits_dtype,
                                       const moe_router_topk_params_t *params, void *workspace,
                                       size_t workspace_bytes, void *stream) {
    (void)stream;
    moe_clear_error();
    MOE_CHECK(num_tokens <= 0 || (probs && routing_map), "probs and routing_map must not be NULL");
    MOE_TRY(moe_router_topk_extras_check(extras, num_tokens));
    return topk_fwd(NULL, topk_indices, probs, routing_map, extras, logits, expert_bias,
                    num_tokens, num_experts, logits_dtype, params, workspace, workspace_bytes);
}

moe_status_t moe_router_lse_bwd_check(const void *grad_logits, const double *grad_lse,
                                      const void *logits, const double *lse, int64_t num_tokens,
                                      int64_t num_experts, moe_dtype_t logits_dtype) {
    MOE_CHECK(num_tokens >= 0, "num_tokens must be >= 0, got %lld", (long long)num_tokens);
    MOE_CHECK(num_experts >= 1, "num_experts must be >= 1, got %lld", (long long)num_experts);
    MOE_CHECK(moe_is_float_dtype(logits_dtype), "logits must be a float dtype, got %s",
              moe_dtype_name(logits_dtype));
    MOE_TRY(moe_check_mul(num_tokens, "num_tokens", num_experts, "num_experts"));
    MOE_CHECK(num_tokens == 0 || (grad_logits && grad_lse && logits && lse),
              "grad_logits, grad_lse, logits and lse must not be NULL");
    return MOE_OK;
}

moe_status_t moe_router_lse_bwd(void *grad_logits, const double *grad_lse, const void *logits,
                                const double *lse, const uint8_t *padding_mask,
                                int64_t num_tokens, int64_t num_experts, moe_dtype_t logits_dtype,
                                void *workspace, size_t workspace_bytes, void *stream) {
    (void)workspace;
    (void)workspace_bytes;
    (void)stream;
    moe_clear_error();
    MOE_TRY(moe_router_lse_bwd_check(grad_logits, grad_lse, logits, lse, num_tokens, num_experts,
                                     logits_dtype));
    const int64_t E = num_experts;
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < num_tokens; ++t) {
        const int pad = padding_mask != NULL && padding_mask[t] != 0;
        for (int64_t e = 0; e < E; ++e)
            moe_store(grad_logits, logits_dtype, t * E + e,
                      moe_router_lse_grad(grad_lse[t], moe_load(logits, logits_dtype, t * E + e),
                                          lse[t], pad));
    }
    return MOE_OK;
}

static moe_status_t topk_bwd(void *grad_logits, const void *grad_probs, const void *logits,
                             const int64_t *topk_indices, int64_t num_tokens, int64_t num_experts,
                             moe_dtype_t logits_dtype, const moe_router_topk_params_t *params,
                             int grad_dense, void *workspace, size_t workspace_bytes) {
    moe_clear_error();
    MOE_TRY(check_common(num_tokens, num_experts, logits_dtype, params, 0));
    if (num_tokens == 0) return MOE_OK;
    MOE_CHECK(grad_logits && grad_probs && logits && topk_indices,
              "grad_logits, grad_probs, logits and topk_indices must not be NULL");
    const int64_t words = thread_words(moe_topk_scratch_k(params), params->num_groups);
    const int64_t nthreads = (int64_t)(workspace_bytes / ((size_t)words * sizeof(double)));
    MOE_CHECK(workspace != NULL && nthreads >= 1,
              "workspace too small: %zu bytes, need at least %zu (moe_router_topk_workspace_size)",
              workspace_bytes, (size_t)words * sizeof(double));
    const int64_t k = params->topk;
    int bad = 0;
    for (int64_t i = 0; i < num_tokens * k; ++i)
        bad |= topk_indices[i] < 0 || topk_indices[i] >= num_experts;
    MOE_CHECK(!bad, "topk_indices has an entry outside [0, num_experts=%lld)",
              (long long)num_experts);
    moe_topk_ctx_t ctx = moe_topk_ctx_make(params, num_experts, logits_dtype);
    ctx.grad_dense = grad_dense;

#pragma omp parallel num_threads((int)nthreads)
    {
        double *scratch = (double *)workspace + (int64_t)moe_thread_id() * words;
#pragma omp for schedule(static)
        for (int64_t t = 0; t < num_tokens; ++t) {
            moe_topk_row_bwd(&ctx, logits, grad_probs, t, topk_indices + t * k, scratch,
                             grad_logits);
        }
    }
    return MOE_OK;
}

moe_status_t moe_router_topk_bwd(void *grad_logits, const void *grad_probs, const void *logits,
                                 const int64_t *topk_indices, int64_t num_tokens,
                                 int64_t num_experts, moe_dtype_t logits_dtype,
                                 const moe_router_topk_params_t *params, void *workspace,
                                 size_t workspace_bytes, void *stream) {
    (void)stream;
    return topk_bwd(grad_logits, grad_probs, logits, topk_indices, num_tokens, num_experts,
                    logits_dtype, params, 0, workspace, workspace_bytes);
}

moe_status_t moe_router_topk_dense_bwd(void *grad_logits, const void *grad_probs,
                                       const void *logits, const int64_t *topk_indices,
                                       int64_t num_tokens, int64_t num_experts,
                                       moe_dtype_t logits_dtype,
                                       const moe_router_topk_params_t *params, void *workspace,
                                       size_t workspace_bytes, void *stream) {
    (void)stream;
    return topk_bwd(grad_logits, grad_probs, logits, topk_indices, num_tokens, num_experts,
                    logits_dtype, params, 1, workspace, workspace_bytes);
}
