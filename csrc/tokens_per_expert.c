/*
 * tokens_per_expert.c: how many unpadded tokens each expert receives in a routing map.
 *
 * A thread owns whole expert columns; the counts are integers, so the result is exact and the
 * same in any order. It feeds the aux losses, the expert-bias counts and the metrics.
 */
#include "balancing_math.h"

moe_status_t moe_tokens_per_expert_check(const int64_t *counts, const uint8_t *routing_map,
                                         int64_t num_tokens, int64_t num_experts) {
    MOE_TRY(check_sizes(num_tokens, num_experts, "num_experts"));
    MOE_CHECK(counts != NULL && (routing_map != NULL || num_tokens == 0),
              "counts and routing_map must not be NULL");
    return MOE_OK;
}

moe_status_t moe_tokens_per_expert_fwd(int64_t *counts, const uint8_t *routing_map,
                                       const uint8_t *padding_mask, int64_t num_tokens,
                                       int64_t num_experts, void *workspace,
                                       size_t workspace_bytes, void *stream) {
    (void)stream;
    (void)workspace;
    (void)workspace_bytes;
    moe_clear_error();
    MOE_TRY(moe_tokens_per_expert_check(counts, routing_map, num_tokens, num_experts));
#pragma omp parallel for schedule(static)
    for (int64_t e = 0; e < num_experts; ++e) {
        int64_t n = 0;
        for (int64_t t = 0; t < num_tokens; ++t)
            n += routing_map[t * num_experts + e] != 0 && !is_pad(padding_mask, t);
        counts[e] = n;
    }
    return MOE_OK;
}

