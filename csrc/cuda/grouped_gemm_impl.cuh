/*
 * grouped_gemm_impl.cuh: the internal contract between the CUDA grouped GEMM dispatcher
 * (grouped_gemm.cu: argument checks, the portable mma.sync path, fp32/fp64 SIMT path) and the
 * Hopper kernels (grouped_gemm_sm90.cu: wgmma + TMA, persistent over (expert, tile) work).
 *
 * The dispatcher validates the arguments exactly as the CPU entry points do, then offers the
 * problem to the sm90 path first when the current device is compute capability 9.0 and the binary
 * holds sm_90a code; an sm90 entry point that cannot take a problem (dtype, alignment, layout,
 * workspace) returns MOE_ERR_UNSUPPORTED *without launching anything*, and the dispatcher falls
 * back to the portable path. Both paths honour the public contract in moe_core.h: offsets read
 * from device memory, any counts, rows past expert_offsets[E] zeroed (fwd/dgrad), dW_e = 0 for an
 * empty expert, fp32 accumulation, one rounding per output element, no floating-point atomics,
 * no host sync, bitwise reproducible.
 */
#ifndef MOE_CORE_CUDA_GROUPED_GEMM_IMPL_CUH_
#define MOE_CORE_CUDA_GROUPED_GEMM_IMPL_CUH_

#include "../moe_core.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Workspace bytes the sm90 path needs for this problem (0 when it needs none). The public
 * moe_cuda_grouped_gemm_workspace_size returns the max of this and the portable path's need. */
size_t moe_cuda_gg_sm90_workspace_size(const moe_grouped_gemm_params_t *params);

/* 1 when the sm90 kernels were compiled into this binary (sm_90a in the arch list). */
int moe_cuda_gg_sm90_compiled(void);

/* 1 when the sm90 path takes a call of these sizes and dtypes on the current device (only a
 * misaligned pointer could still make it decline): a gathered call then needs no room for a copy
 * of the rows in the workspace, since the sm90 kernels read a gathered operand's rows by index
 * (params->gather_operand, params->gather_index). */
int moe_cuda_gg_sm90_takes(const moe_grouped_gemm_params_t *params);

moe_status_t moe_cuda_gg_sm90_fwd(void *y, const void *x, const void *weight,
                                  const int64_t *expert_offsets,
                                  const moe_grouped_gemm_params_t *params, void *workspace,
                                  size_t workspace_bytes, void *stream);
moe_status_t moe_cuda_gg_sm90_dgrad(void *grad_x, const void *grad_y, const void *weight,
                                    const int64_t *expert_offsets,
                                    const moe_grouped_gemm_params_t *params, void *workspace,
                                    size_t workspace_bytes, void *stream);
moe_status_t moe_cuda_gg_sm90_wgrad(void *grad_weight, const void *x, const void *grad_y,
                                    const int64_t *expert_offsets,
                                    const moe_grouped_gemm_params_t *params, void *workspace,
                                    size_t workspace_bytes, void *stream);

#ifdef __cplusplus
}
#endif

#endif /* MOE_CORE_CUDA_GROUPED_GEMM_IMPL_CUH_ */
