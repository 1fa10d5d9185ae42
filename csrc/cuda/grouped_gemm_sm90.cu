/* STUB: replaced by the Hopper kernels (wgmma + TMA, another helper's branch) at merge. */
/*
 * grouped_gemm_sm90.cu (stub): the moe_cuda_gg_sm90_* entry points of grouped_gemm_impl.cuh that
 * decline every problem, so the dispatcher in grouped_gemm.cu always takes the portable path and
 * this branch builds and links on its own. Nothing here launches anything.
 */
#include "grouped_gemm_impl.cuh"

extern "C" size_t moe_cuda_gg_sm90_workspace_size(const moe_grouped_gemm_params_t *params) {
    (void)params;
    return 0;
}

extern "C" int moe_cuda_gg_sm90_compiled(void) { return 0; }

extern "C" moe_status_t moe_cuda_gg_sm90_fwd(void *y, const void *x, const void *weight,
                                             const int64_t *expert_offsets,
                                             const moe_grouped_gemm_params_t *params,
                                             void *workspace, size_t workspace_bytes,
                                             void *stream) {
    (void)y, (void)x, (void)weight, (void)expert_offsets, (void)params, (void)workspace,
        (void)workspace_bytes, (void)stream;
    return MOE_ERR_UNSUPPORTED;
}

extern "C" moe_status_t moe_cuda_gg_sm90_dgrad(void *grad_x, const void *grad_y,
                                               const void *weight, const int64_t *expert_offsets,
                                               const moe_grouped_gemm_params_t *params,
                                               void *workspace, size_t workspace_bytes,
                                               void *stream) {
    (void)grad_x, (void)grad_y, (void)weight, (void)expert_offsets, (void)params,
        (void)workspace, (void)workspace_bytes, (void)stream;
    return MOE_ERR_UNSUPPORTED;
}

extern "C" moe_status_t moe_cuda_gg_sm90_wgrad(void *grad_weight, const void *x,
                                               const void *grad_y, const int64_t *expert_offsets,
                                               const moe_grouped_gemm_params_t *params,
                                               void *workspace, size_t workspace_bytes,
                                               void *stream) {
    (void)grad_weight, (void)x, (void)grad_y, (void)expert_offsets, (void)params,
        (void)workspace, (void)workspace_bytes, (void)stream;
    return MOE_ERR_UNSUPPORTED;
}
