/*
 * moe_balancing.h: the load-balancing ops. The scores the aux losses are computed from, the
 * switch (Switch-Transformer) aux loss, the z-loss, the aux-loss-free expert bias update,
 * Sinkhorn normalisation and Sinkhorn routing, and the routing metrics a training log reports.
 *
 * Each op's CPU entry point (moe_*) is followed by its CUDA twin (moe_cuda_*): the same
 * arguments and semantics on device pointers, asynchronous on `stream`; where they differ, the
 * CUDA declaration says how. Every op with scratch has a workspace-size function on both devices
 * (0: none needed); the others take no workspace (NULL, 0).
 */
#ifndef MOE_BALANCING_H_
#define MOE_BALANCING_H_

#include "moe_types.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---------------------------------------------------------------------------------------------
 * Load balancing: aux-loss scores, the switch aux loss, z-loss, the expert bias update, Sinkhorn
 * and Sinkhorn routing, routing metrics.
 *
 * Losses are fp32 scalars (fp64 for fp64 inputs, so fp64 gradcheck is meaningful) computed with
 * fp64 accumulation in a fixed order (deterministic, no atomics). Padding masks are [num_tokens]
 * bool buffers (uint8 0/1), 1 = padding, or NULL for no padding: a padded token contributes
 * nothing to a loss, a count, a metric or a gradient.
 *
 * On CUDA, losses and metrics are two-stage fixed-order reductions (bitwise reproducible run to
 * run, no floating-point atomics); maps and counts equal the CPU's.
 * ------------------------------------------------------------------------------------------- */

/**
 * Workspace bytes of moe_aux_loss_scores_fwd (the backward takes none). CPU: O(topk) words per
 * OpenMP thread.
 */
size_t moe_aux_loss_scores_workspace_size(int64_t num_tokens, int64_t num_experts, int64_t topk);

/** CUDA: 0 (the map row itself is the top-k's scratch). */
size_t moe_cuda_aux_loss_scores_workspace_size(int64_t num_tokens, int64_t num_experts,
                                               int64_t topk);

/**
 * Scores and top-k map for the aux losses (Megatron's compute_routing_scores_for_aux_loss), in
 * one pass per token: softmax over all experts (softmax), or sigmoid / sqrt(softplus) normalised
 * over all experts (s / (Σ s + 1e-20)); the map marks the top-k of those scores (no groups, no
 * expert bias), ties to the lowest expert index. Padded rows are zero in both outputs.
 * \param[out] scores        [num_tokens, num_experts], fp32 (fp64 when logits are fp64)
 * \param[out] routing_map   [num_tokens, num_experts], bool (uint8 0/1)
 * \param[in]  logits        [num_tokens, num_experts], `logits_dtype` (fp32, fp64, fp16, bf16)
 * \param[in]  padding_mask  [num_tokens], bool, 1 = padding, or NULL
 * \param[in]  num_tokens    >= 0
 * \param[in]  num_experts   >= 1
 * \param[in]  topk          1 <= topk <= num_experts
 * \param[in]  logits_dtype  element type of logits
 * \param[in]  score_function softmax, sigmoid or sqrtsoftplus
 * \param[in]  workspace     moe_aux_loss_scores_workspace_size bytes
 */
moe_status_t moe_aux_loss_scores_fwd(void *scores, uint8_t *routing_map, const void *logits,
                                     const uint8_t *padding_mask, int64_t num_tokens,
                                     int64_t num_experts, int64_t topk, moe_dtype_t logits_dtype,
                                     moe_score_function_t score_function, void *workspace,
                                     size_t workspace_bytes, void *stream);

/**
 * CUDA: a warp per token; the element math is the CPU's, the row sums are added in a warp-tree
 * order, and the map is the CPU's whenever the scores are.
 */
moe_status_t moe_cuda_aux_loss_scores_fwd(void *scores, uint8_t *routing_map, const void *logits,
                                          const uint8_t *padding_mask, int64_t num_tokens,
                                          int64_t num_experts, int64_t topk,
                                          moe_dtype_t logits_dtype,
                                          moe_score_function_t score_function, void *workspace,
                                          size_t workspace_bytes, void *stream);

/**
 * Backward of moe_aux_loss_scores_fwd through the scores (the map is piecewise constant).
 * Padded rows get a zero gradient.
 * \param[out] grad_logits   [num_tokens, num_experts], `logits_dtype`
 * \param[in]  grad_scores   [num_tokens, num_experts], the dtype of scores
 * \param[in]  logits        [num_tokens, num_experts], `logits_dtype`
 * (padding_mask, sizes, dtype and score_function as in the forward; no workspace needed)
 */
moe_status_t moe_aux_loss_scores_bwd(void *grad_logits, const void *grad_scores,
                                     const void *logits, const uint8_t *padding_mask,
                                     int64_t num_tokens, int64_t num_experts,
                                     moe_dtype_t logits_dtype, moe_score_function_t score_function,
                                     void *workspace, size_t workspace_bytes, void *stream);

/** CUDA: as the CPU entry point. No workspace. */
moe_status_t moe_cuda_aux_loss_scores_bwd(void *grad_logits, const void *grad_scores,
                                          const void *logits, const uint8_t *padding_mask,
                                          int64_t num_tokens, int64_t num_experts,
                                          moe_dtype_t logits_dtype,
                                          moe_score_function_t score_function, void *workspace,
                                          size_t workspace_bytes, void *stream);

/** Options of the switch load-balancing loss. */
typedef struct moe_switch_aux_loss_params {
    int64_t topk;        /**< k in the formula, >= 1 */
    int64_t num_experts; /**< E in the formula, >= 1 (the sequence loss has num_columns = B·E) */
    double coeff;        /**< the loss coefficient (any finite value) */
} moe_switch_aux_loss_params_t;

/** Workspace bytes of moe_switch_aux_loss_fwd (the backward takes none). CPU: one fp64 partial
 *  sum per column. */
size_t moe_switch_aux_loss_workspace_size(int64_t num_tokens, int64_t num_columns);

/** CUDA: the fixed-order column partial sums (a chunk of tokens per block, in fp64). */
size_t moe_cuda_switch_aux_loss_workspace_size(int64_t num_tokens, int64_t num_columns);

/**
 * Switch load-balancing loss (Megatron's switch_load_balancing_loss_func):
 *   loss = Σ_c (Σ_t probs[t, c]) · tokens_per_expert[c] · E · coeff / (topk · total²)
 * summed in fp64 over tokens in ascending order per column, then over columns; rounded once.
 * \param[out] loss              [1], fp32 (fp64 when probs are fp64)
 * \param[in]  probs             [num_tokens, num_columns], `probs_dtype` (float types)
 * \param[in]  tokens_per_expert [num_columns], fp32 (counts, or running averages of counts)
 * \param[in]  total_num_tokens  [1], fp64 (read on the device: no host sync)
 * \param[in]  padding_mask      [num_tokens], bool, 1 = padding (those rows are left out), or NULL
 * \param[in]  num_tokens        >= 0
 * \param[in]  num_columns       >= 1
 * \param[in]  probs_dtype       element type of probs
 * \param[in]  params            topk, num_experts, coeff
 * \param[in]  workspace         moe_switch_aux_loss_workspace_size bytes
 */
moe_status_t moe_switch_aux_loss_fwd(void *loss, const void *probs,
                                     const float *tokens_per_expert,
                                     const double *total_num_tokens, const uint8_t *padding_mask,
                                     int64_t num_tokens, int64_t num_columns,
                                     moe_dtype_t probs_dtype,
                                     const moe_switch_aux_loss_params_t *params, void *workspace,
                                     size_t workspace_bytes, void *stream);

/** CUDA: a two-stage fixed-order sum; total_num_tokens is read on the device. */
moe_status_t moe_cuda_switch_aux_loss_fwd(void *loss, const void *probs,
                                          const float *tokens_per_expert,
                                          const double *total_num_tokens,
                                          const uint8_t *padding_mask, int64_t num_tokens,
                                          int64_t num_columns, moe_dtype_t probs_dtype,
                                          const moe_switch_aux_loss_params_t *params,
                                          void *workspace, size_t workspace_bytes, void *stream);

/**
 * Backward: grad_probs[t, c] = grad_loss · tokens_per_expert[c] · E · coeff / (topk · total²),
 * zero on padded rows, stored in `probs_dtype`.
 * \param[out] grad_probs    [num_tokens, num_columns], `probs_dtype`
 * \param[in]  grad_loss     [1], the dtype of loss
 * (the rest as in the forward; no workspace needed)
 */
moe_status_t moe_switch_aux_loss_bwd(void *grad_probs, const void *grad_loss,
                                     const float *tokens_per_expert,
                                     const double *total_num_tokens, const uint8_t *padding_mask,
                                     int64_t num_tokens, int64_t num_columns,
                                     moe_dtype_t probs_dtype,
                                     const moe_switch_aux_loss_params_t *params, void *workspace,
                                     size_t workspace_bytes, void *stream);

/** CUDA: as the CPU entry point. No workspace. */
moe_status_t moe_cuda_switch_aux_loss_bwd(void *grad_probs, const void *grad_loss,
                                          const float *tokens_per_expert,
                                          const double *total_num_tokens,
                                          const uint8_t *padding_mask, int64_t num_tokens,
                                          int64_t num_columns, moe_dtype_t probs_dtype,
                                          const moe_switch_aux_loss_params_t *params,
                                          void *workspace, size_t workspace_bytes, void *stream);

/**
 * Workspace bytes of moe_z_loss_fwd and moe_z_loss_bwd. CPU: one fp64 word per token (the
 * backward needs none).
 */
size_t moe_z_loss_workspace_size(int64_t num_tokens, int64_t num_experts);

/** CUDA: forward, two fp64 words per block of tokens; backward, one (the count of valid tokens). */
size_t moe_cuda_z_loss_workspace_size(int64_t num_tokens, int64_t num_experts);

/**
 * z-loss (Megatron's z_loss_func): coeff · Σ_valid logsumexp(logits[t])² / max(n_valid, 1), or
 * the plain mean over all tokens when padding_mask is NULL (NaN for zero tokens, as torch.mean).
 * logsumexp and the sums in fp64; the result is rounded once (to fp32, or kept fp64).
 * \param[out] loss          [1], fp32 (fp64 when logits are fp64)
 * \param[in]  logits        [num_tokens, num_experts], `logits_dtype` (float types)
 * \param[in]  padding_mask  [num_tokens], bool, 1 = padding, or NULL
 * \param[in]  num_tokens    >= 0
 * \param[in]  num_experts   >= 1
 * \param[in]  coeff         the loss coefficient
 * \param[in]  logits_dtype  element type of logits
 * \param[in]  workspace     moe_z_loss_workspace_size bytes
 */
moe_status_t moe_z_loss_fwd(void *loss, const void *logits, const uint8_t *padding_mask,
                            int64_t num_tokens, int64_t num_experts, double coeff,
                            moe_dtype_t logits_dtype, void *workspace, size_t workspace_bytes,
                            void *stream);

/** CUDA: a two-stage fixed-order sum. */
moe_status_t moe_cuda_z_loss_fwd(void *loss, const void *logits, const uint8_t *padding_mask,
                                 int64_t num_tokens, int64_t num_experts, double coeff,
                                 moe_dtype_t logits_dtype, void *workspace,
                                 size_t workspace_bytes, void *stream);

/**
 * Backward: grad_logits[t, e] = grad_loss · coeff · 2 · lse_t · softmax(logits[t])_e / n, with
 * n = max(n_valid, 1) (or num_tokens without a mask); zero on padded rows.
 * \param[out] grad_logits   [num_tokens, num_experts], `logits_dtype`
 * \param[in]  grad_loss     [1], the dtype of loss
 * (the rest as in the forward; no workspace needed)
 */
moe_status_t moe_z_loss_bwd(void *grad_logits, const void *grad_loss, const void *logits,
                            const uint8_t *padding_mask, int64_t num_tokens, int64_t num_experts,
                            double coeff, moe_dtype_t logits_dtype, void *workspace,
                            size_t workspace_bytes, void *stream);

/** CUDA: with a padding mask it counts the valid tokens in the workspace (see above). */
moe_status_t moe_cuda_z_loss_bwd(void *grad_logits, const void *grad_loss, const void *logits,
                                 const uint8_t *padding_mask, int64_t num_tokens,
                                 int64_t num_experts, double coeff, moe_dtype_t logits_dtype,
                                 void *workspace, size_t workspace_bytes, void *stream);

/**
 * Aux-loss-free expert bias update (Megatron's get_updated_expert_bias, after its all-reduce):
 *   mean = (Σ_e counts[l, e]) / E;  updated[l, e] = bias[l, e] + sign(mean − counts[l, e]) · rate
 * in fp32 with the rounding points of Megatron's fp32 tensors (sign(0) = 0, NaN propagates), so
 * the result equals Megatron's bit for bit whenever the row sum of the counts is exact in fp32
 * (integer counts below 2^24).
 * \param[out] updated_bias      [num_rows, num_experts], fp32 (may alias expert_bias)
 * \param[in]  tokens_per_expert [num_rows, num_experts], fp32
 * \param[in]  expert_bias       [num_rows, num_experts], fp32
 * \param[in]  num_rows          >= 0 (1 for one router; L for biases stacked over layers)
 * \param[in]  num_experts       >= 1
 * \param[in]  update_rate       the step (Megatron's moe_router_bias_update_rate), finite
 */
moe_status_t moe_expert_bias_update_fwd(float *updated_bias, const float *tokens_per_expert,
                                        const float *expert_bias, int64_t num_rows,
                                        int64_t num_experts, double update_rate, void *workspace,
                                        size_t workspace_bytes, void *stream);

/** CUDA: bitwise the CPU's result. No workspace. */
moe_status_t moe_cuda_expert_bias_update_fwd(float *updated_bias, const float *tokens_per_expert,
                                             const float *expert_bias, int64_t num_rows,
                                             int64_t num_experts, double update_rate,
                                             void *workspace, size_t workspace_bytes,
                                             void *stream);

/**
 * Workspace bytes of moe_sinkhorn_fwd (topk = 0): the [num_tokens, num_experts] matrix and the
 * scalings in fp64. CPU: with topk > 0 it also covers moe_sinkhorn_routing_fwd's top-k lists.
 */
size_t moe_sinkhorn_workspace_size(int64_t num_tokens, int64_t num_experts, int64_t topk);

/** CUDA: the same matrix and scalings (topk plays no part). */
size_t moe_cuda_sinkhorn_workspace_size(int64_t num_tokens, int64_t num_experts, int64_t topk);

/**
 * Sinkhorn normalisation (Megatron's sinkhorn): C = exp(cost); d0 = 1, d1 = 1; repeat
 * { d0 = (1/T) / (C·d1 + 1e-8);  d1 = (1/E) / (d0ᵀC + 1e-8) } until mean|d1_old − d1| <= tol;
 * out = d1 ⊙ C ⊙ d0[:, None]. Math in fp32 (fp64 for fp64 cost), sums accumulated in fp64 in
 * ascending index order. The loop runs at most max_iters times (0 = no limit, as Megatron).
 * \param[out] out           [num_tokens, num_experts], `out_dtype` (fp32, or fp64 for fp64 cost)
 * \param[in]  cost          [num_tokens, num_experts], `cost_dtype` (float types)
 * \param[in]  num_tokens    >= 0
 * \param[in]  num_experts   >= 1
 * \param[in]  cost_dtype    element type of cost
 * \param[in]  tol           stopping tolerance, >= 0
 * \param[in]  max_iters     iteration cap, >= 0 (0 = unlimited)
 * \param[in]  workspace     moe_sinkhorn_workspace_size(num_tokens, num_experts, 0) bytes
 */
moe_status_t moe_sinkhorn_fwd(void *out, const void *cost, int64_t num_tokens,
                              int64_t num_experts, moe_dtype_t cost_dtype, double tol,
                              int64_t max_iters, void *workspace, size_t workspace_bytes,
                              void *stream);

/**
 * CUDA: the whole iteration loop runs in one single-block kernel on the device (no host sync,
 * the convergence test evaluated there).
 */
moe_status_t moe_cuda_sinkhorn_fwd(void *out, const void *cost, int64_t num_tokens,
                                   int64_t num_experts, moe_dtype_t cost_dtype, double tol,
                                   int64_t max_iters, void *workspace, size_t workspace_bytes,
                                   void *stream);

/**
 * Workspace bytes of moe_sinkhorn_routing_fwd. CPU: moe_sinkhorn_workspace_size(num_tokens,
 * num_experts, topk) in either mode (the top-k lists sit past the matrix).
 */
size_t moe_sinkhorn_routing_workspace_size(int64_t num_tokens, int64_t num_experts, int64_t topk,
                                           int training);

/** CUDA: training, moe_cuda_sinkhorn_workspace_size's; eval, 0 (no Sinkhorn runs). */
size_t moe_cuda_sinkhorn_routing_workspace_size(int64_t num_tokens, int64_t num_experts,
                                                int64_t topk, int training);

/**
 * Sinkhorn routing (Megatron's TopKRouter.sinkhorn_load_balancing): the experts of a token are
 * the top-k of sinkhorn(fp32 logits) when `training`, else the top-k of the activation; the
 * activation is sigmoid(logits) for topk = 1 and softmax(logits) (fp32, then rounded to the
 * logits dtype) for topk > 1; probs = activation on the picked experts, 0 elsewhere. Ties go to
 * the lowest expert index.
 * \param[out] probs         [num_tokens, num_experts], `logits_dtype`
 * \param[out] routing_map   [num_tokens, num_experts], bool
 * \param[in]  logits        [num_tokens, num_experts], `logits_dtype` (float types)
 * \param[in]  num_tokens, num_experts  sizes (num_experts >= 1)
 * \param[in]  topk          1 <= topk <= num_experts
 * \param[in]  logits_dtype  element type of logits and probs
 * \param[in]  training      nonzero: select with Sinkhorn; 0: select by the activation
 * \param[in]  tol           Sinkhorn tolerance (training only), >= 0
 * \param[in]  workspace     moe_sinkhorn_routing_workspace_size(num_tokens, num_experts, topk,
 *                           training) bytes
 */
moe_status_t moe_sinkhorn_routing_fwd(void *probs, uint8_t *routing_map, const void *logits,
                                      int64_t num_tokens, int64_t num_experts, int64_t topk,
                                      moe_dtype_t logits_dtype, int training, double tol,
                                      void *workspace, size_t workspace_bytes, void *stream);

/** CUDA: Sinkhorn as moe_cuda_sinkhorn_fwd, then a warp per token ranks the row. */
moe_status_t moe_cuda_sinkhorn_routing_fwd(void *probs, uint8_t *routing_map, const void *logits,
                                           int64_t num_tokens, int64_t num_experts, int64_t topk,
                                           moe_dtype_t logits_dtype, int training, double tol,
                                           void *workspace, size_t workspace_bytes, void *stream);

/**
 * Backward of moe_sinkhorn_routing_fwd through the activation, masked by the routing map
 * (the selection is piecewise constant).
 * \param[out] grad_logits   [num_tokens, num_experts], `logits_dtype`
 * \param[in]  grad_probs    [num_tokens, num_experts], `logits_dtype`
 * \param[in]  logits        [num_tokens, num_experts], `logits_dtype`
 * \param[in]  routing_map   [num_tokens, num_experts], bool, as written by the forward
 * (sizes, topk and dtype as in the forward; no workspace needed)
 */
moe_status_t moe_sinkhorn_routing_bwd(void *grad_logits, const void *grad_probs,
                                      const void *logits, const uint8_t *routing_map,
                                      int64_t num_tokens, int64_t num_experts, int64_t topk,
                                      moe_dtype_t logits_dtype, void *workspace,
                                      size_t workspace_bytes, void *stream);

/** CUDA: as the CPU entry point. No workspace. */
moe_status_t moe_cuda_sinkhorn_routing_bwd(void *grad_logits, const void *grad_probs,
                                           const void *logits, const uint8_t *routing_map,
                                           int64_t num_tokens, int64_t num_experts, int64_t topk,
                                           moe_dtype_t logits_dtype, void *workspace,
                                           size_t workspace_bytes, void *stream);

/** Workspace bytes of moe_routing_metrics_fwd. CPU: one fp64 word per token. */
size_t moe_routing_metrics_workspace_size(int64_t num_tokens, int64_t num_experts);

/** CUDA: the fixed-order partial counts and entropies. */
size_t moe_cuda_routing_metrics_workspace_size(int64_t num_tokens, int64_t num_experts);

/** Number of values moe_routing_metrics_fwd writes to `stats`. */
#define MOE_ROUTING_STATS 4

/**
 * Routing metrics of one routing (what Megatron's logging and router trace report), on the
 * device, fp64 accumulation in a fixed order. With n_e the tokens per expert (padding excluded)
 * and mean = Σ n_e / E:
 *   stats[0] max_over_mean   max_e n_e / mean              (0 when no token is routed)
 *   stats[1] load_cv         sqrt(Σ (n_e − mean)² / E) / mean, the population coefficient of
 *                            variation (0 when no token is routed)
 *   stats[2] load_entropy    −Σ_e f_e ln f_e with f_e = n_e / Σ n (nats; 0·ln 0 = 0)
 *   stats[3] score_entropy   mean over unpadded tokens of −Σ_e s ln s of `scores` (nats, s = 0
 *                            terms skipped); 0 when no token is unpadded or scores is NULL
 * \param[out] tokens_per_expert [num_experts], int64
 * \param[out] stats             [MOE_ROUTING_STATS], fp32
 * \param[in]  routing_map       [num_tokens, num_experts], bool
 * \param[in]  scores            [num_tokens, num_experts], `scores_dtype`, or NULL
 * \param[in]  padding_mask      [num_tokens], bool, 1 = padding, or NULL
 * \param[in]  num_tokens, num_experts  sizes (num_experts >= 1)
 * \param[in]  scores_dtype      element type of scores (float types; ignored when NULL)
 * \param[in]  workspace         moe_routing_metrics_workspace_size bytes
 */
moe_status_t moe_routing_metrics_fwd(int64_t *tokens_per_expert, float *stats,
                                     const uint8_t *routing_map, const void *scores,
                                     const uint8_t *padding_mask, int64_t num_tokens,
                                     int64_t num_experts, moe_dtype_t scores_dtype,
                                     void *workspace, size_t workspace_bytes, void *stream);

/** CUDA: the counts exact; the load stats the CPU's up to the math library's log. */
moe_status_t moe_cuda_routing_metrics_fwd(int64_t *tokens_per_expert, float *stats,
                                          const uint8_t *routing_map, const void *scores,
                                          const uint8_t *padding_mask, int64_t num_tokens,
                                          int64_t num_experts, moe_dtype_t scores_dtype,
                                          void *workspace, size_t workspace_bytes, void *stream);

/** Workspace bytes of moe_topk_overlap_fwd. CPU: 0 (integer counts, reduced exactly). */
size_t moe_topk_overlap_workspace_size(int64_t num_tokens, int64_t topk);

/** CUDA: two int64 partial counts per block of tokens. */
size_t moe_cuda_topk_overlap_workspace_size(int64_t num_tokens, int64_t topk);

/**
 * Top-k overlap of two routings of the same tokens (route drift): the mean over unpadded tokens
 * of |A_t ∩ B_t| / topk, where A_t, B_t are the expert sets in row t of the two index buffers
 * (1 = same experts, 0 = disjoint; 0 when every token is padding). Rows must hold distinct ids.
 * \param[out] overlap       [1], fp32
 * \param[in]  indices_a     [num_tokens, topk], int64 expert ids in [0, num_experts)
 * \param[in]  indices_b     [num_tokens, topk], int64 expert ids in [0, num_experts)
 * \param[in]  padding_mask  [num_tokens], bool, 1 = padding, or NULL
 * \param[in]  num_tokens    >= 0
 * \param[in]  topk          >= 1
 * \param[in]  num_experts   >= topk
 */
moe_status_t moe_topk_overlap_fwd(float *overlap, const int64_t *indices_a,
                                  const int64_t *indices_b, const uint8_t *padding_mask,
                                  int64_t num_tokens, int64_t topk, int64_t num_experts,
                                  void *workspace, size_t workspace_bytes, void *stream);

/** CUDA: the ids are in device memory and not range-checked (the CPU checks them). */
moe_status_t moe_cuda_topk_overlap_fwd(float *overlap, const int64_t *indices_a,
                                       const int64_t *indices_b, const uint8_t *padding_mask,
                                       int64_t num_tokens, int64_t topk, int64_t num_experts,
                                       void *workspace, size_t workspace_bytes, void *stream);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* MOE_BALANCING_H_ */
