/*
 * checks.h: the argument check of every op, one function per entry point (or per op where its
 * entry points check alike), shared by the CPU and the CUDA entry point (internal, host code).
 *
 * The one idea: a check is written once, in the op's C file next to the CPU kernel, and both
 * devices call it first, so they reject the same arguments with the same message. A check looks
 * only at what the host can see without a sync: sizes, dtypes, options, NULL pointers, and the
 * element counts and row bounds derived from them (checked int64 arithmetic). What lies in the
 * buffers (ids, offsets, split sizes) is checked by the CPU entry point only, after its check;
 * a CUDA entry point adds only its own limits (int32 grids) and its workspace size.
 *
 * Each returns MOE_OK or MOE_ERR_INVALID_ARGUMENT with the message in moe_last_error().
 */
#ifndef MOE_CORE_CHECKS_H_
#define MOE_CORE_CHECKS_H_

#include "moe_core.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- router (router_gating_linear.c, router_topk.c) ------------------------------------------ */

moe_status_t moe_router_gating_linear_check(int64_t num_tokens, int64_t hidden,
                                            int64_t num_experts, moe_dtype_t inp_dtype,
                                            moe_dtype_t weight_dtype, moe_dtype_t router_dtype);
/* Sizes, dtype and the params (moe_router_topk_check) of every router_topk entry point. */
moe_status_t moe_router_topk_check_args(int64_t num_tokens, int64_t num_experts,
                                        moe_dtype_t logits_dtype,
                                        const moe_router_topk_params_t *params,
                                        int has_expert_bias);
moe_status_t moe_router_lse_bwd_check(const void *grad_logits, const double *grad_lse,
                                      const void *logits, const double *lse, int64_t num_tokens,
                                      int64_t num_experts, moe_dtype_t logits_dtype);

/* ---- layout (topk_to_dense.c, token_dropping.c, permute.c, permute_bwd.c, unpermute.c, layout.c,
 * sort_chunks_by_idxs.c, tokens_per_expert.c) ------------------------------------------------ */

moe_status_t moe_topk_to_dense_check_sizes(int64_t num_tokens, int64_t num_experts, int64_t topk,
                                           moe_dtype_t dtype);
moe_status_t moe_token_dropping_fwd_check(const void *final_probs, const uint8_t *final_map,
                                          const void *routing_probs, const uint8_t *routing_map,
                                          int64_t num_tokens, int64_t num_experts,
                                          int64_t capacity, moe_drop_policy_t policy,
                                          moe_dtype_t dtype);
moe_status_t moe_token_dropping_bwd_check(const void *grad_routing_probs,
                                          const void *grad_final_probs, const uint8_t *final_map,
                                          int64_t num_tokens, int64_t num_experts,
                                          moe_dtype_t dtype);
/* Sizes and params of permute (hidden 0: the layout only); *num_rows receives the row bound
 * (moe_permute_num_rows). */
moe_status_t moe_permute_check_params(int64_t num_tokens, int64_t hidden, int64_t num_experts,
                                      const moe_permute_params_t *p, int64_t *num_rows);
moe_status_t moe_permute_fwd_check(const void *permuted_tokens, const void *permuted_probs,
                                   const int64_t *sorted_indices, const int64_t *expert_offsets,
                                   const int64_t *tokens_per_expert, const void *tokens,
                                   const uint8_t *routing_map, const void *probs,
                                   int64_t num_tokens, int64_t hidden, int64_t num_experts,
                                   moe_dtype_t dtype, moe_dtype_t probs_dtype,
                                   const moe_permute_params_t *params, int64_t *num_rows);
/* The sizes of unpermute / permute_bwd, the dtype of the rows (`what` names the buffer) and the
 * element counts of [num_tokens | num_rows, hidden] and [num_tokens, num_experts]. */
moe_status_t moe_layout_check_sizes(int64_t num_tokens, int64_t hidden, int64_t num_experts,
                                    int64_t num_rows, moe_dtype_t dtype, const char *what);
moe_status_t moe_permute_bwd_check(const void *grad_tokens, const void *grad_probs,
                                   const void *grad_permuted_tokens,
                                   const void *grad_permuted_probs, const int64_t *expert_offsets,
                                   int64_t num_tokens, int64_t hidden, int64_t num_experts,
                                   int64_t num_rows, moe_dtype_t dtype, moe_dtype_t probs_dtype);
/* Sizes, dtype, the row range [row_lo, row_lo + chunk_rows) inside num_rows, NULL pointers. */
moe_status_t moe_permute_bwd_accumulate_check(const float *acc, const void *grad_rows_chunk,
                                              const int64_t *sorted_indices, int64_t num_tokens,
                                              int64_t hidden, int64_t num_rows, int64_t row_lo,
                                              int64_t chunk_rows, moe_dtype_t dtype);
moe_status_t moe_unpermute_fwd_check(const void *output, const void *permuted_tokens,
                                     const void *probs, const int64_t *expert_offsets,
                                     int64_t num_tokens, int64_t hidden, int64_t num_experts,
                                     int64_t num_rows, moe_dtype_t dtype,
                                     moe_dtype_t probs_dtype);
moe_status_t moe_unpermute_bwd_check(const void *grad_permuted_tokens, const void *grad_probs,
                                     const void *grad_output, const void *permuted_tokens,
                                     const void *probs, const int64_t *expert_offsets,
                                     int64_t num_tokens, int64_t hidden, int64_t num_experts,
                                     int64_t num_rows, moe_dtype_t dtype,
                                     moe_dtype_t probs_dtype);
/* Both directions: `dst` is the output, `src` the input. */
moe_status_t moe_sort_chunks_by_idxs_check(const void *dst, const void *src,
                                           const int64_t *split_sizes, const int64_t *sorted_idxs,
                                           int64_t num_rows, int64_t row_elems,
                                           int64_t num_chunks, moe_dtype_t dtype);
moe_status_t moe_tokens_per_expert_check(const int64_t *counts, const uint8_t *routing_map,
                                         int64_t num_tokens, int64_t num_experts);

/* ---- balancing (aux_loss_scores.c, switch_aux_loss.c, z_loss.c, expert_bias_update.c,
 * sinkhorn.c, routing_metrics.c) ------------------------------------------------------------- */

moe_status_t moe_aux_loss_scores_fwd_check(const void *scores, const uint8_t *routing_map,
                                           const void *logits, int64_t num_tokens,
                                           int64_t num_experts, int64_t topk,
                                           moe_dtype_t logits_dtype,
                                           moe_score_function_t score_function);
moe_status_t moe_aux_loss_scores_bwd_check(const void *grad_logits, const void *grad_scores,
                                           const void *logits, int64_t num_tokens,
                                           int64_t num_experts, moe_dtype_t logits_dtype,
                                           moe_score_function_t score_function);
/* Both directions: `out` is the loss (forward) or grad_loss (backward), `probs_or_grad` the
 * probs (forward) or grad_probs (backward). */
moe_status_t moe_switch_aux_loss_check(const void *out, const void *probs_or_grad,
                                       const float *tokens_per_expert,
                                       const double *total_num_tokens, int64_t num_tokens,
                                       int64_t num_columns, moe_dtype_t probs_dtype,
                                       const moe_switch_aux_loss_params_t *params,
                                       const char *out_name);
moe_status_t moe_z_loss_check(const void *logits, int64_t num_tokens, int64_t num_experts,
                              double coeff, moe_dtype_t logits_dtype);
moe_status_t moe_expert_bias_update_check(const float *updated_bias,
                                          const float *tokens_per_expert,
                                          const float *expert_bias, int64_t num_rows,
                                          int64_t num_experts, double update_rate);
moe_status_t moe_sinkhorn_fwd_check(const void *out, const void *cost, int64_t num_tokens,
                                    int64_t num_experts, moe_dtype_t cost_dtype, double tol,
                                    int64_t max_iters);
moe_status_t moe_sinkhorn_routing_fwd_check(const void *probs, const uint8_t *routing_map,
                                            const void *logits, int64_t num_tokens,
                                            int64_t num_experts, int64_t topk,
                                            moe_dtype_t logits_dtype, double tol);
moe_status_t moe_sinkhorn_routing_bwd_check(const void *grad_logits, const void *grad_probs,
                                            const void *logits, const uint8_t *routing_map,
                                            int64_t num_tokens, int64_t num_experts, int64_t topk,
                                            moe_dtype_t logits_dtype);
moe_status_t moe_routing_metrics_check(const int64_t *tokens_per_expert, const float *stats,
                                       const uint8_t *routing_map, const void *scores,
                                       int64_t num_tokens, int64_t num_experts,
                                       moe_dtype_t scores_dtype);
moe_status_t moe_topk_overlap_check(const float *overlap, const int64_t *indices_a,
                                    const int64_t *indices_b, int64_t num_tokens, int64_t topk,
                                    int64_t num_experts);

/* ---- experts (grouped_gemm.c; glu_probs' own checks are glu_probs_math.h's moe_gp_check_args,
 * beside the element math that both devices share) ------------------------------------------ */

/* The grouped GEMM op a params struct is checked for: which operand it may gather differs. */
typedef enum moe_gg_op {
    MOE_GG_OP_FWD = 0,
    MOE_GG_OP_DGRAD = 1,
    MOE_GG_OP_WGRAD = 2,
    MOE_GG_OP_GLU_PROBS_FWD = 3
} moe_gg_op_t;

moe_status_t moe_grouped_gemm_check_params(const moe_grouped_gemm_params_t *p, moe_gg_op_t op);
/* grouped_gemm_glu_probs: the GEMM's params, then glu_probs' check of a = fc1's output
 * [num_rows, out_features]; *ffn receives F (out_features / 2 with GLU). */
moe_status_t moe_grouped_gemm_glu_probs_fwd_check(const void *h, const void *a, const void *probs,
                                                  moe_dtype_t probs_dtype,
                                                  const moe_grouped_gemm_params_t *gemm,
                                                  const moe_glu_probs_params_t *glu,
                                                  int64_t *ffn);

#ifdef __cplusplus
}
#endif

#endif /* MOE_CORE_CHECKS_H_ */
