/*
 * expert_bias_update.c: the aux-loss-free expert bias step (Megatron's get_updated_expert_bias
 * after its all-reduce): bias += sign(mean(counts) − counts) · rate, in fp32.
 *
 * The clever part is how it is bit for bit Megatron's: the arithmetic is done in C `float` at the
 * points where Megatron's fp32 tensor ops round (mean, difference, sign · rate, sum), and the sign
 * of a rounded difference equals the sign of the exact one, so only the row sum could differ, and
 * that sum is exact for integer counts below 2^24.
 */
#include "balancing_math.h"

moe_status_t moe_expert_bias_update_check(const float *updated_bias,
                                          const float *tokens_per_expert,
                                          const float *expert_bias, int64_t num_rows,
                                          int64_t num_experts, double update_rate) {
    MOE_CHECK(num_rows >= 0, "num_rows must be >= 0, got %lld", (long long)num_rows);
    MOE_CHECK(num_experts >= 1, "num_experts must be >= 1, got %lld", (long long)num_experts);
    MOE_CHECK(isfinite(update_rate), "expert_bias_update_rate must be finite, got %g",
              update_rate);
    MOE_TRY(moe_check_mul(num_rows, "num_rows", num_experts, "num_experts"));
    MOE_CHECK(num_rows == 0 || (updated_bias && tokens_per_expert && expert_bias),
              "updated_bias, tokens_per_expert and expert_bias must not be NULL");
    return MOE_OK;
}

moe_status_t moe_expert_bias_update_fwd(float *updated_bias, const float *tokens_per_expert,
                                        const float *expert_bias, int64_t num_rows,
                                        int64_t num_experts, double update_rate, void *workspace,
                                        size_t workspace_bytes, void *stream) {
    (void)stream;
    (void)workspace;
    (void)workspace_bytes;
    moe_clear_error();
    MOE_TRY(moe_expert_bias_update_check(updated_bias, tokens_per_expert, expert_bias, num_rows,
                                         num_experts, update_rate));
    /* Megatron: sign(sum/E − count) · rate, each an fp32 tensor op. Float arithmetic here rounds
     * at the same points; sign of a rounded difference is the sign of the exact one. */
    const float rate = (float)update_rate;
    for (int64_t l = 0; l < num_rows; ++l) {
        const float *c = tokens_per_expert + l * num_experts;
        double sum = 0.0;
        for (int64_t e = 0; e < num_experts; ++e) sum += (double)c[e];
        const float mean = (float)sum / (float)num_experts;
        for (int64_t e = 0; e < num_experts; ++e) {
            float off = mean - c[e];
            float sign = off > 0.0f ? 1.0f : off < 0.0f ? -1.0f : off == 0.0f ? 0.0f : off;
            float step = sign * rate;
            updated_bias[l * num_experts + e] = expert_bias[l * num_experts + e] + step;
        }
    }
    return MOE_OK;
}

