/*
 * token_dropping.c: expert capacity (Megatron's apply_router_token_dropping) on dense routing.
 *
 * Each expert column keeps the first `capacity` tokens of a stable descending sort of its key
 * (probs or the routing bit). The one idea: making the sort stable (ties to the lower token) turns
 * torch.topk's unspecified choice into a definition, which for "position" is exactly "the first
 * capacity routed tokens", what Megatron gets on CUDA. The position policy needs no sort at all: a
 * single ascending walk of the column. Each column is owned by one thread, so no two threads write
 * one element.
 */
#include "common.h"

/* Key order of the probs policy: NaN above every number (as torch.topk), then larger first. */
static inline int key_before(double a, int64_t ia, double b, int64_t ib) {
    const int na = a != a, nb = b != b;
    if (na != nb) return na;
    if (!na && a != b) return a > b;
    return ia < ib;
}

/* Stable bottom-up merge sort of idx[0..n) by (key desc, index asc); tmp has n slots. */
static void sort_by_key(int64_t *idx, int64_t *tmp, const double *key, int64_t n) {
    for (int64_t width = 1; width < n; width *= 2) {
        for (int64_t lo = 0; lo < n; lo += 2 * width) {
            int64_t mid = lo + width < n ? lo + width : n;
            int64_t hi = lo + 2 * width < n ? lo + 2 * width : n;
            int64_t i = lo, j = mid, o = lo;
            while (i < mid && j < hi)
                tmp[o++] = key_before(key[idx[j]], idx[j], key[idx[i]], idx[i]) ? idx[j++] : idx[i++];
            while (i < mid) tmp[o++] = idx[i++];
            while (j < hi) tmp[o++] = idx[j++];
        }
        memcpy(idx, tmp, (size_t)n * sizeof(int64_t));
    }
}

/* Bytes of the probs policy's scratch for `nthreads` threads (3·T words each), or
 * MOE_SIZE_OVERFLOW. */
static size_t scratch_bytes(int64_t num_tokens, int64_t nthreads) {
    int64_t words;
    if (moe_checked_mul_i64(num_tokens, 3, &words) || moe_checked_mul_i64(words, nthreads, &words))
        return MOE_SIZE_OVERFLOW;
    return moe_checked_bytes(words, (int64_t)sizeof(int64_t));
}

size_t moe_token_dropping_workspace_size(int64_t num_tokens, int64_t num_experts,
                                         moe_drop_policy_t policy, moe_dtype_t dtype) {
    (void)num_experts, (void)dtype;
    if (policy != MOE_DROP_PROBS || num_tokens <= 0) return 0;
    const size_t bytes = scratch_bytes(num_tokens, moe_max_threads());
    if (bytes == MOE_SIZE_OVERFLOW)
        return moe_fail_size("moe_token_dropping_workspace_size: num_tokens=%lld overflows int64 "
                             "bytes of sort scratch", (long long)num_tokens);
    return bytes;
}

static moe_status_t check_sizes(int64_t num_tokens, int64_t num_experts, moe_dtype_t dtype) {
    MOE_CHECK(num_tokens >= 0, "num_tokens must be >= 0, got %lld", (long long)num_tokens);
    MOE_CHECK(num_experts >= 1, "num_experts must be >= 1, got %lld", (long long)num_experts);
    MOE_CHECK(moe_is_float_dtype(dtype), "routing_probs must be a float dtype, got %s",
              moe_dtype_name(dtype));
    return moe_check_mul(num_tokens, "num_tokens", num_experts, "num_experts");
}

moe_status_t moe_token_dropping_fwd_check(const void *final_probs, const uint8_t *final_map,
                                          const void *routing_probs, const uint8_t *routing_map,
                                          int64_t num_tokens, int64_t num_experts,
                                          int64_t capacity, moe_drop_policy_t policy,
                                          moe_dtype_t dtype) {
    MOE_TRY(check_sizes(num_tokens, num_experts, dtype));
    MOE_CHECK(capacity >= 0, "capacity must be >= 0, got %lld", (long long)capacity);
    MOE_CHECK(policy == MOE_DROP_PROBS || policy == MOE_DROP_POSITION,
              "drop_policy must be probs (0) or position (1), got %d", (int)policy);
    MOE_CHECK(num_tokens == 0 || (final_probs && final_map && routing_probs && routing_map),
              "final_probs, final_map, routing_probs and routing_map must not be NULL");
    return MOE_OK;
}

moe_status_t moe_token_dropping_bwd_check(const void *grad_routing_probs,
                                          const void *grad_final_probs, const uint8_t *final_map,
                                          int64_t num_tokens, int64_t num_experts,
                                          moe_dtype_t dtype) {
    MOE_TRY(check_sizes(num_tokens, num_experts, dtype));
    MOE_CHECK(num_tokens == 0 || (grad_routing_probs && grad_final_probs && final_map),
              "grad_routing_probs, grad_final_probs and final_map must not be NULL");
    return MOE_OK;
}

moe_status_t moe_token_dropping_fwd(void *final_probs, uint8_t *final_map,
                                    const void *routing_probs, const uint8_t *routing_map,
                                    int64_t num_tokens, int64_t num_experts, int64_t capacity,
                                    moe_drop_policy_t policy, int pad_to_capacity,
                                    moe_dtype_t dtype, void *workspace, size_t workspace_bytes,
                                    void *stream) {
    (void)stream;
    moe_clear_error();
    MOE_TRY(moe_token_dropping_fwd_check(final_probs, final_map, routing_probs, routing_map,
                                         num_tokens, num_experts, capacity, policy, dtype));
    if (num_tokens == 0) return MOE_OK;
    const int64_t T = num_tokens, E = num_experts;
    const int sorting = policy == MOE_DROP_PROBS && capacity < T;
    const int nthreads = moe_max_threads();
    /* 3 · T words per thread, used only when sorting (where scratch_bytes checked the product) */
    const int64_t words = sorting ? 3 * T : 0;
    if (sorting) {
        const size_t need = scratch_bytes(T, nthreads);
        MOE_CHECK(need != MOE_SIZE_OVERFLOW,
                  "num_tokens=%lld: the sort scratch overflows int64 bytes", (long long)T);
        MOE_CHECK(workspace && workspace_bytes >= need,
                  "workspace too small: %zu bytes, need at least %zu "
                  "(moe_token_dropping_workspace_size)",
                  workspace_bytes, need);
    }

#pragma omp parallel num_threads(nthreads)
    {
        int64_t *idx = sorting ? (int64_t *)workspace + (int64_t)moe_thread_id() * (int64_t)words
                               : NULL;
#pragma omp for schedule(dynamic, 1)
        for (int64_t e = 0; e < E; ++e) {
            /* mask column e into final_map first, then combine with routing_map in place */
            if (capacity >= T) {
                for (int64_t t = 0; t < T; ++t) final_map[t * E + e] = 1;
            } else if (policy == MOE_DROP_POSITION) {
                int64_t kept = 0;
                for (int64_t t = 0; t < T; ++t) {
                    const uint8_t take = routing_map[t * E + e] && kept < capacity;
                    kept += take;
                    final_map[t * E + e] = take;
                }
                /* the filler of a short column: its first unrouted tokens (stable sort order) */
                for (int64_t t = 0; t < T && kept < capacity; ++t)
                    if (!routing_map[t * E + e]) final_map[t * E + e] = 1, ++kept;
            } else {
                double *key = (double *)(idx + 2 * T);
                for (int64_t t = 0; t < T; ++t) {
                    key[t] = moe_load(routing_probs, dtype, t * E + e);
                    idx[t] = t;
                    final_map[t * E + e] = 0;
                }
                sort_by_key(idx, idx + T, key, T);
                for (int64_t j = 0; j < capacity; ++j) final_map[idx[j] * E + e] = 1;
            }
            for (int64_t t = 0; t < T; ++t) {
                const int64_t i = t * E + e;
                const uint8_t m = pad_to_capacity ? final_map[i] : (uint8_t)(final_map[i] && routing_map[i]);
                final_map[i] = m;
                moe_store(final_probs, dtype, i, moe_load(routing_probs, dtype, i) * (double)m);
            }
        }
    }
    return MOE_OK;
}

moe_status_t moe_token_dropping_bwd(void *grad_routing_probs, const void *grad_final_probs,
                                    const uint8_t *final_map, int64_t num_tokens,
                                    int64_t num_experts, moe_dtype_t dtype, void *workspace,
                                    size_t workspace_bytes, void *stream) {
    (void)workspace, (void)workspace_bytes, (void)stream;
    moe_clear_error();
    MOE_TRY(moe_token_dropping_bwd_check(grad_routing_probs, grad_final_probs, final_map,
                                         num_tokens, num_experts, dtype));
    if (num_tokens == 0) return MOE_OK;
    const int64_t n = num_tokens * num_experts;
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i)
        moe_store(grad_routing_probs, dtype, i,
                  moe_load(grad_final_probs, dtype, i) * (double)final_map[i]);
    return MOE_OK;
}
