/*
 * expert_bias_update.cu: the aux-loss-free expert bias step (Megatron's get_updated_expert_bias
 * after its all-reduce) on CUDA: bias += sign(mean(counts) − counts) · rate, in fp32.
 *
 * One block per row. The clever part is that it is bit for bit the C kernel (and so Megatron
 * whenever that one is): the row sum is one thread's fp64 sum in ascending order, exactly the C
 * loop, and the element math uses the _rn intrinsics, which the compiler can never fuse into an
 * FMA, so every operation rounds where the C `float` code rounds. The rows are short (the
 * experts of one layer), so the serial sum costs nothing next to a launch.
 */
#include "cuda_common.cuh"

__global__ void moe_expert_bias_update_kernel(float *updated_bias, const float *tokens_per_expert,
                                              const float *expert_bias, int64_t num_experts,
                                              float rate) {
    __shared__ float mean_s;
    const int64_t l = blockIdx.x;
    const float *c = tokens_per_expert + l * num_experts;
    if (threadIdx.x == 0) {
        double sum = 0.0;
        for (int64_t e = 0; e < num_experts; ++e) sum = __dadd_rn(sum, (double)c[e]);
        mean_s = __fdiv_rn((float)sum, (float)num_experts);
    }
    __syncthreads();
    const float mean = mean_s;
    for (int64_t e = threadIdx.x; e < num_experts; e += blockDim.x) {
        const int64_t i = l * num_experts + e;
        const float off = __fsub_rn(mean, c[e]);
        const float sign = off > 0.0f ? 1.0f : off < 0.0f ? -1.0f : off == 0.0f ? 0.0f : off;
        /* updated_bias may alias expert_bias: each element is read, then written, by one thread */
        updated_bias[i] = __fadd_rn(expert_bias[i], __fmul_rn(sign, rate));
    }
}

extern "C" moe_status_t moe_cuda_expert_bias_update_fwd(float *updated_bias,
                                                        const float *tokens_per_expert,
                                                        const float *expert_bias, int64_t num_rows,
                                                        int64_t num_experts, double update_rate,
                                                        void *workspace, size_t workspace_bytes,
                                                        void *stream) {
    (void)workspace, (void)workspace_bytes;
    moe_clear_error();
    MOE_TRY(moe_expert_bias_update_check(updated_bias, tokens_per_expert, expert_bias, num_rows,
                                         num_experts, update_rate));
    /* one block per row */
    MOE_CHECK(num_rows <= 0x7fffffff, "num_rows must be < 2^31, got %lld", (long long)num_rows);
    if (num_rows == 0) return MOE_OK;
    moe_expert_bias_update_kernel<<<(unsigned)num_rows, MOE_CUDA_THREADS, 0,
                                    (cudaStream_t)stream>>>(updated_bias, tokens_per_expert,
                                                            expert_bias, num_experts,
                                                            (float)update_rate);
    MOE_CHECK_LAUNCH("moe_expert_bias_update_kernel");
    return MOE_OK;
}
