/*
 * switch_aux_loss.cu: the Switch-Transformer load-balancing loss (Megatron's
 * switch_load_balancing_loss_func), forward and backward, on CUDA.
 *
 * loss = Σ_c (Σ_t probs[t, c]) · counts[c] · E · coeff / (topk · total²). The forward is a
 * deterministic two-stage column sum: blocks write fp64 partial column sums of fixed token
 * chunks to the workspace ([chunks, C]), then one block adds each column's chunks in order,
 * weights it by its count and sums the columns in a fixed tree. The total is read from device
 * memory, never from the host. The backward is elementwise and bitwise the CPU's (same
 * products in the same order).
 */
#include "balancing_cuda.cuh"

/* partial [chunks, C] → loss (one block). */
__global__ void __launch_bounds__(MOE_BAL_FINAL_THREADS)
moe_switch_aux_loss_final_kernel(void *loss, moe_dtype_t loss_dtype, const double *partial,
                                 int64_t nchunks, const float *tokens_per_expert,
                                 const double *total_num_tokens, int64_t num_cols,
                                 int64_t num_experts, int64_t topk, double coeff) {
    __shared__ double smem[33];
    double acc = 0.0;
    for (int64_t c = threadIdx.x; c < num_cols; c += blockDim.x)
        acc += moe_col_total(partial, nchunks, num_cols, c) * (double)tokens_per_expert[c];
    acc = moe_block_sum(acc, smem);
    if (threadIdx.x == 0)
        moe_store(loss, loss_dtype, 0,
                  acc * moe_switch_factor(num_experts, topk, coeff, *total_num_tokens));
}

/* grad_probs [T, C] = grad_loss · factor · counts[c], 0 on padded rows. */
__global__ void moe_switch_aux_loss_bwd_kernel(void *grad_probs, const void *grad_loss,
                                               moe_dtype_t loss_dtype,
                                               const float *tokens_per_expert,
                                               const double *total_num_tokens,
                                               const uint8_t *padding_mask, int64_t num_tokens,
                                               int64_t num_cols, moe_dtype_t dt,
                                               int64_t num_experts, int64_t topk, double coeff) {
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= num_tokens * num_cols) return;
    const int64_t t = i / num_cols, c = i % num_cols;
    const double g = moe_load(grad_loss, loss_dtype, 0) *
                     moe_switch_factor(num_experts, topk, coeff, *total_num_tokens);
    moe_store(grad_probs, dt, i, is_pad(padding_mask, t) ? 0.0 : g * (double)tokens_per_expert[c]);
}

extern "C" size_t moe_cuda_switch_aux_loss_workspace_size(int64_t num_tokens,
                                                          int64_t num_columns) {
    if (num_columns < 1) return 0;
    int64_t cells;
    if (num_tokens > INT64_MAX - MOE_COL_MIN_CHUNK || /* moe_col_chunks rounds up */
        moe_checked_mul_i64(moe_col_chunks(num_tokens), num_columns, &cells) ||
        moe_checked_bytes(cells, (int64_t)sizeof(double)) == MOE_SIZE_OVERFLOW)
        return moe_fail_size("moe_cuda_switch_aux_loss_workspace_size: num_tokens=%lld, "
                             "num_columns=%lld overflow int64 bytes", (long long)num_tokens,
                             (long long)num_columns);
    return moe_checked_bytes(cells, (int64_t)sizeof(double));
}

extern "C" moe_status_t moe_cuda_switch_aux_loss_fwd(
    void *loss, const void *probs, const float *tokens_per_expert,
    const double *total_num_tokens, const uint8_t *padding_mask, int64_t num_tokens,
    int64_t num_columns, moe_dtype_t probs_dtype, const moe_switch_aux_loss_params_t *params,
    void *workspace, size_t workspace_bytes, void *stream) {
    moe_clear_error();
    MOE_TRY(moe_switch_aux_loss_check(loss, probs, tokens_per_expert, total_num_tokens,
                                      num_tokens, num_columns, probs_dtype, params, "loss"));
    MOE_CHECK_WORKSPACE(moe_cuda_switch_aux_loss_workspace_size, num_tokens, num_columns);
    cudaStream_t s = (cudaStream_t)stream;
    double *partial = (double *)workspace;
    MOE_TRY(moe_launch_col_partial(0, partial, probs, probs_dtype, padding_mask, num_tokens,
                                   num_columns, s));
    /* always launched: 0 tokens still write the loss (0 · factor, as the C kernel) */
    moe_switch_aux_loss_final_kernel<<<1, MOE_BAL_FINAL_THREADS, 0, s>>>(
        loss, compute_dtype(probs_dtype), partial, moe_col_chunks(num_tokens), tokens_per_expert,
        total_num_tokens, num_columns, params->num_experts, params->topk, params->coeff);
    MOE_CHECK_LAUNCH("moe_switch_aux_loss_final_kernel");
    return MOE_OK;
}

extern "C" moe_status_t moe_cuda_switch_aux_loss_bwd(
    void *grad_probs, const void *grad_loss, const float *tokens_per_expert,
    const double *total_num_tokens, const uint8_t *padding_mask, int64_t num_tokens,
    int64_t num_columns, moe_dtype_t probs_dtype, const moe_switch_aux_loss_params_t *params,
    void *workspace, size_t workspace_bytes, void *stream) {
    (void)workspace, (void)workspace_bytes;
    moe_clear_error();
    MOE_TRY(moe_switch_aux_loss_check(grad_loss, grad_probs, tokens_per_expert, total_num_tokens,
                                      num_tokens, num_columns, probs_dtype, params, "grad_loss"));
    const int64_t n = num_tokens * num_columns;
    if (n == 0) return MOE_OK;
    moe_switch_aux_loss_bwd_kernel<<<moe_blocks_for(n, 256), 256, 0, (cudaStream_t)stream>>>(
        grad_probs, grad_loss, compute_dtype(probs_dtype), tokens_per_expert, total_num_tokens,
        padding_mask, num_tokens, num_columns, probs_dtype, params->num_experts, params->topk,
        params->coeff);
    MOE_CHECK_LAUNCH("moe_switch_aux_loss_bwd_kernel");
    return MOE_OK;
}
