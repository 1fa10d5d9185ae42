/*
 * cuda_stubs.c: the CUDA entry points of moe_core.h for a build without CUDA kernels.
 *
 * Every moe_cuda_* op returns MOE_ERR_UNSUPPORTED with a message naming it, and every
 * moe_cuda_*_workspace_size returns 0, so a CPU-only build links everything the header declares
 * and its callers (the torch binding's device tables) need no #ifdef. moe_has_cuda() tells the
 * two builds apart at run time. In a CUDA build (MOE_CORE_WITH_CUDA) this file is empty: the
 * kernels in csrc/cuda/ define these functions.
 */
#ifndef MOE_CORE_WITH_CUDA

#include "common.h"

/* A stub ignores its arguments by design. */
#pragma GCC diagnostic ignored "-Wunused-parameter"

static moe_status_t no_cuda(const char *fn) {
    return moe_fail(MOE_ERR_UNSUPPORTED, "%s: this build of moe-core has no CUDA kernels", fn);
}

/* ---- router ---------------------------------------------------------------------------------- */

size_t moe_cuda_router_gating_linear_workspace_size(int64_t num_tokens, int64_t hidden,
                                                    int64_t num_experts, moe_dtype_t inp_dtype,
                                                    moe_dtype_t weight_dtype,
                                                    moe_dtype_t router_dtype, int backward) {
    return 0;
}

moe_status_t moe_cuda_router_gating_linear_fwd(void *logits, const void *inp, const void *weight,
                                               const void *bias, int64_t num_tokens, int64_t hidden,
                                               int64_t num_experts, moe_dtype_t inp_dtype,
                                               moe_dtype_t weight_dtype, moe_dtype_t router_dtype,
                                               void *workspace, size_t workspace_bytes,
                                               void *stream) {
    return no_cuda("moe_cuda_router_gating_linear_fwd");
}

moe_status_t moe_cuda_router_gating_linear_bwd(void *grad_inp, void *grad_weight, void *grad_bias,
                                               const void *grad_logits, const void *inp,
                                               const void *weight, int64_t num_tokens,
                                               int64_t hidden, int64_t num_experts,
                                               moe_dtype_t inp_dtype, moe_dtype_t weight_dtype,
                                               moe_dtype_t router_dtype, void *workspace,
                                               size_t workspace_bytes, void *stream) {
    return no_cuda("moe_cuda_router_gating_linear_bwd");
}

size_t moe_cuda_router_topk_workspace_size(int64_t num_tokens, int64_t num_experts,
                                           const moe_router_topk_params_t *params) {
    return 0;
}

moe_status_t moe_cuda_router_topk_fwd(void *topk_probs, int64_t *topk_indices, const void *logits,
                                      const float *expert_bias, int64_t num_tokens,
                                      int64_t num_experts, moe_dtype_t logits_dtype,
                                      const moe_router_topk_params_t *params, void *workspace,
                                      size_t workspace_bytes, void *stream) {
    return no_cuda("moe_cuda_router_topk_fwd");
}

moe_status_t moe_cuda_router_topk_bwd(void *grad_logits, const void *grad_probs, const void *logits,
                                      const int64_t *topk_indices, int64_t num_tokens,
                                      int64_t num_experts, moe_dtype_t logits_dtype,
                                      const moe_router_topk_params_t *params, void *workspace,
                                      size_t workspace_bytes, void *stream) {
    return no_cuda("moe_cuda_router_topk_bwd");
}

moe_status_t moe_cuda_router_topk_dense_bwd(void *grad_logits, const void *grad_probs,
                                            const void *logits, const int64_t *topk_indices,
                                            int64_t num_tokens, int64_t num_experts,
                                            moe_dtype_t logits_dtype,
                                            const moe_router_topk_params_t *params, void *workspace,
                                            size_t workspace_bytes, void *stream) {
    return no_cuda("moe_cuda_router_topk_dense_bwd");
}

size_t moe_cuda_router_topk_fused_workspace_size(int64_t num_tokens, int64_t num_experts,
                                                 const moe_router_topk_params_t *params,
                                                 moe_dtype_t logits_dtype, int with_aux) {
    return 0;
}

moe_status_t moe_cuda_router_topk_fused_fwd(void *probs, uint8_t *routing_map,
                                            int64_t *topk_indices,
                                            const moe_router_topk_extras_t *extras,
                                            const void *logits, const float *expert_bias,
                                            int64_t num_tokens, int64_t num_experts,
                                            moe_dtype_t logits_dtype,
                                            const moe_router_topk_params_t *params, void *workspace,
                                            size_t workspace_bytes, void *stream) {
    return no_cuda("moe_cuda_router_topk_fused_fwd");
}

moe_status_t moe_cuda_router_lse_bwd(void *grad_logits, const double *grad_lse, const void *logits,
                                     const double *lse, const uint8_t *padding_mask,
                                     int64_t num_tokens, int64_t num_experts,
                                     moe_dtype_t logits_dtype, void *workspace,
                                     size_t workspace_bytes, void *stream) {
    return no_cuda("moe_cuda_router_lse_bwd");
}

/* ---- layout ---------------------------------------------------------------------------------- */

moe_status_t moe_cuda_topk_to_dense_fwd(void *probs, uint8_t *routing_map, const void *topk_probs,
                                        const int64_t *topk_indices, int64_t num_tokens,
                                        int64_t num_experts, int64_t topk, moe_dtype_t dtype,
                                        void *workspace, size_t workspace_bytes, void *stream) {
    return no_cuda("moe_cuda_topk_to_dense_fwd");
}

moe_status_t moe_cuda_topk_to_dense_bwd(void *grad_topk_probs, const void *grad_probs,
                                        const int64_t *topk_indices, int64_t num_tokens,
                                        int64_t num_experts, int64_t topk, moe_dtype_t dtype,
                                        void *workspace, size_t workspace_bytes, void *stream) {
    return no_cuda("moe_cuda_topk_to_dense_bwd");
}

size_t moe_cuda_token_dropping_workspace_size(int64_t num_tokens, int64_t num_experts,
                                              moe_drop_policy_t policy, moe_dtype_t dtype) {
    return 0;
}

moe_status_t moe_cuda_token_dropping_fwd(void *final_probs, uint8_t *final_map,
                                         const void *routing_probs, const uint8_t *routing_map,
                                         int64_t num_tokens, int64_t num_experts, int64_t capacity,
                                         moe_drop_policy_t policy, int pad_to_capacity,
                                         moe_dtype_t dtype, void *workspace, size_t workspace_bytes,
                                         void *stream) {
    return no_cuda("moe_cuda_token_dropping_fwd");
}

moe_status_t moe_cuda_token_dropping_bwd(void *grad_routing_probs, const void *grad_final_probs,
                                         const uint8_t *final_map, int64_t num_tokens,
                                         int64_t num_experts, moe_dtype_t dtype, void *workspace,
                                         size_t workspace_bytes, void *stream) {
    return no_cuda("moe_cuda_token_dropping_bwd");
}

size_t moe_cuda_permute_workspace_size(int64_t num_tokens, int64_t num_experts,
                                       const moe_permute_params_t *params) {
    return 0;
}

moe_status_t moe_cuda_permute_fwd(void *permuted_tokens, void *permuted_probs,
                                  int64_t *sorted_indices, int64_t *expert_offsets,
                                  int64_t *tokens_per_expert, const void *tokens,
                                  const uint8_t *routing_map, const void *probs, int64_t num_tokens,
                                  int64_t hidden, int64_t num_experts, moe_dtype_t dtype,
                                  moe_dtype_t probs_dtype, const moe_permute_params_t *params,
                                  void *workspace, size_t workspace_bytes, void *stream) {
    return no_cuda("moe_cuda_permute_fwd");
}

size_t moe_cuda_unpermute_workspace_size(int64_t num_tokens, int64_t num_rows) {
    return 0;
}

moe_status_t moe_cuda_permute_bwd(void *grad_tokens, void *grad_probs,
                                  const void *grad_permuted_tokens, const void *grad_permuted_probs,
                                  const int64_t *sorted_indices, const int64_t *expert_offsets,
                                  int64_t num_tokens, int64_t hidden, int64_t num_experts,
                                  int64_t num_rows, moe_dtype_t dtype, moe_dtype_t probs_dtype,
                                  void *workspace, size_t workspace_bytes, void *stream) {
    return no_cuda("moe_cuda_permute_bwd");
}

size_t moe_cuda_permute_bwd_accumulate_workspace_size(int64_t num_tokens, int64_t chunk_rows) {
    return 0;
}

moe_status_t moe_cuda_permute_bwd_accumulate(float *acc, const void *grad_rows_chunk,
                                             const int64_t *sorted_indices, int64_t num_tokens,
                                             int64_t hidden, int64_t num_rows, int64_t row_lo,
                                             int64_t chunk_rows, moe_dtype_t dtype,
                                             void *workspace, size_t workspace_bytes,
                                             void *stream) {
    return no_cuda("moe_cuda_permute_bwd_accumulate");
}

moe_status_t moe_cuda_unpermute_fwd(void *output, const void *permuted_tokens,
                                    const int64_t *sorted_indices, const void *probs,
                                    const int64_t *expert_offsets, int64_t num_tokens,
                                    int64_t hidden, int64_t num_experts, int64_t num_rows,
                                    moe_dtype_t dtype, moe_dtype_t probs_dtype, void *workspace,
                                    size_t workspace_bytes, void *stream) {
    return no_cuda("moe_cuda_unpermute_fwd");
}

moe_status_t moe_cuda_unpermute_bwd(void *grad_permuted_tokens, void *grad_probs,
                                    const void *grad_output, const void *permuted_tokens,
                                    const int64_t *sorted_indices, const void *probs,
                                    const int64_t *expert_offsets, int64_t num_tokens,
                                    int64_t hidden, int64_t num_experts, int64_t num_rows,
                                    moe_dtype_t dtype, moe_dtype_t probs_dtype, void *workspace,
                                    size_t workspace_bytes, void *stream) {
    return no_cuda("moe_cuda_unpermute_bwd");
}

size_t moe_cuda_sort_chunks_by_idxs_workspace_size(int64_t num_chunks) {
    return 0;
}

moe_status_t moe_cuda_sort_chunks_by_idxs_fwd(void *output, const void *input,
                                              const int64_t *split_sizes,
                                              const int64_t *sorted_idxs, int64_t num_rows,
                                              int64_t row_elems, int64_t num_chunks,
                                              moe_dtype_t dtype, void *workspace,
                                              size_t workspace_bytes, void *stream) {
    return no_cuda("moe_cuda_sort_chunks_by_idxs_fwd");
}

moe_status_t moe_cuda_sort_chunks_by_idxs_bwd(void *grad_input, const void *grad_output,
                                              const int64_t *split_sizes,
                                              const int64_t *sorted_idxs, int64_t num_rows,
                                              int64_t row_elems, int64_t num_chunks,
                                              moe_dtype_t dtype, void *workspace,
                                              size_t workspace_bytes, void *stream) {
    return no_cuda("moe_cuda_sort_chunks_by_idxs_bwd");
}

moe_status_t moe_cuda_tokens_per_expert_fwd(int64_t *counts, const uint8_t *routing_map,
                                            const uint8_t *padding_mask, int64_t num_tokens,
                                            int64_t num_experts, void *workspace,
                                            size_t workspace_bytes, void *stream) {
    return no_cuda("moe_cuda_tokens_per_expert_fwd");
}

/* ---- balancing ------------------------------------------------------------------------------- */

size_t moe_cuda_aux_loss_scores_workspace_size(int64_t num_tokens, int64_t num_experts,
                                               int64_t topk) {
    return 0;
}

moe_status_t moe_cuda_aux_loss_scores_fwd(void *scores, uint8_t *routing_map, const void *logits,
                                          const uint8_t *padding_mask, int64_t num_tokens,
                                          int64_t num_experts, int64_t topk,
                                          moe_dtype_t logits_dtype,
                                          moe_score_function_t score_function, void *workspace,
                                          size_t workspace_bytes, void *stream) {
    return no_cuda("moe_cuda_aux_loss_scores_fwd");
}

moe_status_t moe_cuda_aux_loss_scores_bwd(void *grad_logits, const void *grad_scores,
                                          const void *logits, const uint8_t *padding_mask,
                                          int64_t num_tokens, int64_t num_experts,
                                          moe_dtype_t logits_dtype,
                                          moe_score_function_t score_function, void *workspace,
                                          size_t workspace_bytes, void *stream) {
    return no_cuda("moe_cuda_aux_loss_scores_bwd");
}

size_t moe_cuda_switch_aux_loss_workspace_size(int64_t num_tokens, int64_t num_columns) {
    return 0;
}

moe_status_t moe_cuda_switch_aux_loss_fwd(void *loss, const void *probs,
                                          const float *tokens_per_expert,
                                          const double *total_num_tokens,
                                          const uint8_t *padding_mask, int64_t num_tokens,
                                          int64_t num_columns, moe_dtype_t probs_dtype,
                                          const moe_switch_aux_loss_params_t *params,
                                          void *workspace, size_t workspace_bytes, void *stream) {
    return no_cuda("moe_cuda_switch_aux_loss_fwd");
}

moe_status_t moe_cuda_switch_aux_loss_bwd(void *grad_probs, const void *grad_loss,
                                          const float *tokens_per_expert,
                                          const double *total_num_tokens,
                                          const uint8_t *padding_mask, int64_t num_tokens,
                                          int64_t num_columns, moe_dtype_t probs_dtype,
                                          const moe_switch_aux_loss_params_t *params,
                                          void *workspace, size_t workspace_bytes, void *stream) {
    return no_cuda("moe_cuda_switch_aux_loss_bwd");
}

size_t moe_cuda_z_loss_workspace_size(int64_t num_tokens, int64_t num_experts) {
    return 0;
}

moe_status_t moe_cuda_z_loss_fwd(void *loss, const void *logits, const uint8_t *padding_mask,
                                 int64_t num_tokens, int64_t num_experts, double coeff,
                                 moe_dtype_t logits_dtype, void *workspace, size_t workspace_bytes,
                                 void *stream) {
    return no_cuda("moe_cuda_z_loss_fwd");
}

moe_status_t moe_cuda_z_loss_bwd(void *grad_logits, const void *grad_loss, const void *logits,
                                 const uint8_t *padding_mask, int64_t num_tokens,
                                 int64_t num_experts, double coeff, moe_dtype_t logits_dtype,
                                 void *workspace, size_t workspace_bytes, void *stream) {
    return no_cuda("moe_cuda_z_loss_bwd");
}

moe_status_t moe_cuda_expert_bias_update_fwd(float *updated_bias, const float *tokens_per_expert,
                                             const float *expert_bias, int64_t num_rows,
                                             int64_t num_experts, double update_rate,
                                             void *workspace, size_t workspace_bytes,
                                             void *stream) {
    return no_cuda("moe_cuda_expert_bias_update_fwd");
}

size_t moe_cuda_sinkhorn_workspace_size(int64_t num_tokens, int64_t num_experts, int64_t topk) {
    return 0;
}

moe_status_t moe_cuda_sinkhorn_fwd(void *out, const void *cost, int64_t num_tokens,
                                   int64_t num_experts, moe_dtype_t cost_dtype, double tol,
                                   int64_t max_iters, void *workspace, size_t workspace_bytes,
                                   void *stream) {
    return no_cuda("moe_cuda_sinkhorn_fwd");
}

size_t moe_cuda_sinkhorn_routing_workspace_size(int64_t num_tokens, int64_t num_experts,
                                                int64_t topk, int training) {
    return 0;
}

moe_status_t moe_cuda_sinkhorn_routing_fwd(void *probs, uint8_t *routing_map, const void *logits,
                                           int64_t num_tokens, int64_t num_experts, int64_t topk,
                                           moe_dtype_t logits_dtype, int training, double tol,
                                           void *workspace, size_t workspace_bytes, void *stream) {
    return no_cuda("moe_cuda_sinkhorn_routing_fwd");
}

moe_status_t moe_cuda_sinkhorn_routing_bwd(void *grad_logits, const void *grad_probs,
                                           const void *logits, const uint8_t *routing_map,
                                           int64_t num_tokens, int64_t num_experts, int64_t topk,
                                           moe_dtype_t logits_dtype, void *workspace,
                                           size_t workspace_bytes, void *stream) {
    return no_cuda("moe_cuda_sinkhorn_routing_bwd");
}

size_t moe_cuda_routing_metrics_workspace_size(int64_t num_tokens, int64_t num_experts) {
    return 0;
}

moe_status_t moe_cuda_routing_metrics_fwd(int64_t *tokens_per_expert, float *stats,
                                          const uint8_t *routing_map, const void *scores,
                                          const uint8_t *padding_mask, int64_t num_tokens,
                                          int64_t num_experts, moe_dtype_t scores_dtype,
                                          void *workspace, size_t workspace_bytes, void *stream) {
    return no_cuda("moe_cuda_routing_metrics_fwd");
}

size_t moe_cuda_topk_overlap_workspace_size(int64_t num_tokens, int64_t topk) {
    return 0;
}

moe_status_t moe_cuda_topk_overlap_fwd(float *overlap, const int64_t *indices_a,
                                       const int64_t *indices_b, const uint8_t *padding_mask,
                                       int64_t num_tokens, int64_t topk, int64_t num_experts,
                                       void *workspace, size_t workspace_bytes, void *stream) {
    return no_cuda("moe_cuda_topk_overlap_fwd");
}

/* ---- experts --------------------------------------------------------------------------------- */

size_t moe_cuda_grouped_gemm_workspace_size(const moe_grouped_gemm_params_t *params) {
    return 0;
}

moe_status_t moe_cuda_grouped_gemm_fwd(void *y, const void *x, const void *weight,
                                       const int64_t *expert_offsets,
                                       const moe_grouped_gemm_params_t *params, void *workspace,
                                       size_t workspace_bytes, void *stream) {
    return no_cuda("moe_cuda_grouped_gemm_fwd");
}

moe_status_t moe_cuda_grouped_gemm_dgrad(void *grad_x, const void *grad_y, const void *weight,
                                         const int64_t *expert_offsets,
                                         const moe_grouped_gemm_params_t *params, void *workspace,
                                         size_t workspace_bytes, void *stream) {
    return no_cuda("moe_cuda_grouped_gemm_dgrad");
}

moe_status_t moe_cuda_grouped_gemm_wgrad(void *grad_weight, const void *x, const void *grad_y,
                                         const int64_t *expert_offsets,
                                         const moe_grouped_gemm_params_t *params, void *workspace,
                                         size_t workspace_bytes, void *stream) {
    return no_cuda("moe_cuda_grouped_gemm_wgrad");
}

moe_status_t moe_cuda_glu_probs_fwd(void *h, const void *a, const void *probs, int64_t num_rows,
                                    int64_t ffn, moe_dtype_t dtype, moe_dtype_t probs_dtype,
                                    const moe_glu_probs_params_t *params, void *workspace,
                                    size_t workspace_bytes, void *stream) {
    return no_cuda("moe_cuda_glu_probs_fwd");
}

moe_status_t moe_cuda_glu_probs_bwd(void *grad_a, void *grad_probs, void *h, const void *grad_h,
                                    const void *a, const void *probs, int64_t num_rows, int64_t ffn,
                                    moe_dtype_t dtype, moe_dtype_t probs_dtype,
                                    const moe_glu_probs_params_t *params, void *workspace,
                                    size_t workspace_bytes, void *stream) {
    return no_cuda("moe_cuda_glu_probs_bwd");
}

moe_status_t moe_cuda_grouped_gemm_glu_probs_fwd(void *h, void *a, const void *x,
                                                 const void *weight, const int64_t *expert_offsets,
                                                 const void *probs, moe_dtype_t probs_dtype,
                                                 const moe_grouped_gemm_params_t *gemm,
                                                 const moe_glu_probs_params_t *glu, void *workspace,
                                                 size_t workspace_bytes, void *stream) {
    return no_cuda("moe_cuda_grouped_gemm_glu_probs_fwd");
}

#endif /* !MOE_CORE_WITH_CUDA */
