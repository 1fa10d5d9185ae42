/*
 * topk_to_dense.c: compact routing [T, topk] ↔ Megatron's dense [T, E] probs and routing map.
 *
 * The dense form is a scatter of at most topk entries per row into zeros; its backward is the
 * matching gather. Each output row is written by one thread, so no two threads touch one element
 * and the result is the same run after run. The ids of a row must be distinct and in range: the
 * check runs before anything is written (on CUDA it would need a host sync; see the .cu file).
 */
#include "common.h"

moe_status_t moe_topk_to_dense_check_sizes(int64_t num_tokens, int64_t num_experts, int64_t topk,
                                           moe_dtype_t dtype) {
    MOE_CHECK(num_tokens >= 0, "num_tokens must be >= 0, got %lld", (long long)num_tokens);
    MOE_CHECK(num_experts >= 1, "num_experts must be >= 1, got %lld", (long long)num_experts);
    MOE_CHECK(topk >= 1 && topk <= num_experts,
              "topk must be in [1, num_experts=%lld], got topk=%lld", (long long)num_experts,
              (long long)topk);
    MOE_CHECK(moe_is_float_dtype(dtype), "probs must be a float dtype, got %s",
              moe_dtype_name(dtype));
    /* [T, E] dense outputs; [T, topk] fits whenever they do (topk <= E) */
    return moe_check_mul(num_tokens, "num_tokens", num_experts, "num_experts");
}

/* The first row (or num_tokens if none) with an id out of range or an id twice. A duplicate would
 * make the scatter's result depend on which write lands last, so it is an error, not a tie. */
static int64_t first_bad_row(const int64_t *topk_indices, int64_t num_tokens, int64_t num_experts,
                             int64_t topk) {
    int64_t bad = num_tokens;
#pragma omp parallel for schedule(static) reduction(min : bad)
    for (int64_t t = 0; t < num_tokens; ++t) {
        const int64_t *idx = topk_indices + t * topk;
        int ok = 1;
        for (int64_t j = 0; j < topk && ok; ++j) {
            ok = idx[j] >= 0 && idx[j] < num_experts;
            for (int64_t i = 0; i < j && ok; ++i) ok = idx[i] != idx[j];
        }
        if (!ok && t < bad) bad = t;
    }
    return bad;
}

/* The per-op check of both directions: sizes, then every row's ids in [0, E) and distinct. */
static moe_status_t check_args(const int64_t *topk_indices, int64_t num_tokens,
                               int64_t num_experts, int64_t topk, moe_dtype_t dtype) {
    MOE_TRY(moe_topk_to_dense_check_sizes(num_tokens, num_experts, topk, dtype));
    MOE_CHECK(num_tokens == 0 || topk_indices, "topk_indices must not be NULL");
    const int64_t t = first_bad_row(topk_indices, num_tokens, num_experts, topk);
    if (t == num_tokens) return MOE_OK;
    const int64_t *idx = topk_indices + t * topk;
    for (int64_t j = 0; j < topk; ++j) {
        MOE_CHECK(idx[j] >= 0 && idx[j] < num_experts,
                  "topk_indices[%lld, %lld] = %lld is outside [0, num_experts=%lld)",
                  (long long)t, (long long)j, (long long)idx[j], (long long)num_experts);
        for (int64_t i = 0; i < j; ++i)
            MOE_CHECK(idx[i] != idx[j],
                      "topk_indices[%lld] repeats expert %lld (at columns %lld and %lld); the "
                      "experts of a row must be distinct",
                      (long long)t, (long long)idx[j], (long long)i, (long long)j);
    }
    return MOE_OK;
}

moe_status_t moe_topk_to_dense_fwd(void *probs, uint8_t *routing_map, const void *topk_probs,
                                   const int64_t *topk_indices, int64_t num_tokens,
                                   int64_t num_experts, int64_t topk, moe_dtype_t dtype,
                                   void *workspace, size_t workspace_bytes, void *stream) {
    (void)workspace, (void)workspace_bytes, (void)stream;
    moe_clear_error();
    MOE_TRY(check_args(topk_indices, num_tokens, num_experts, topk, dtype));
    MOE_CHECK(num_tokens == 0 || !probs || topk_probs, "topk_probs must not be NULL");
    const size_t esize = moe_dtype_size(dtype);

#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < num_tokens; ++t) {
        const int64_t *idx = topk_indices + t * topk;
        if (probs) {
            memset((char *)probs + (size_t)(t * num_experts) * esize, 0,
                   (size_t)num_experts * esize);
            for (int64_t j = 0; j < topk; ++j)
                memcpy((char *)probs + (size_t)(t * num_experts + idx[j]) * esize,
                       (const char *)topk_probs + (size_t)(t * topk + j) * esize, esize);
        }
        if (routing_map) {
            memset(routing_map + t * num_experts, 0, (size_t)num_experts);
            for (int64_t j = 0; j < topk; ++j) routing_map[t * num_experts + idx[j]] = 1;
        }
    }
    return MOE_OK;
}

moe_status_t moe_topk_to_dense_bwd(void *grad_topk_probs, const void *grad_probs,
                                   const int64_t *topk_indices, int64_t num_tokens,
                                   int64_t num_experts, int64_t topk, moe_dtype_t dtype,
                                   void *workspace, size_t workspace_bytes, void *stream) {
    (void)workspace, (void)workspace_bytes, (void)stream;
    moe_clear_error();
    MOE_TRY(check_args(topk_indices, num_tokens, num_experts, topk, dtype));
    MOE_CHECK(num_tokens == 0 || (grad_topk_probs && grad_probs),
              "grad_topk_probs and grad_probs must not be NULL");
    const size_t esize = moe_dtype_size(dtype);

#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < num_tokens; ++t)
        for (int64_t j = 0; j < topk; ++j)
            memcpy((char *)grad_topk_probs + (size_t)(t * topk + j) * esize,
                   (const char *)grad_probs +
                       (size_t)(t * num_experts + topk_indices[t * topk + j]) * esize,
                   esize);
    return MOE_OK;
}
