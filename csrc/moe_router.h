/*
 * moe_router.h: the router ops. The gating linear (logits = inp · weightᵀ + bias in the router
 * dtype) and the top-k router (score function, group-limited top-k, probs) in its compact and
 * dense layouts, plus the fused router that also returns what the aux losses and the z-loss read
 * (scores, map, logsumexp) from the same pass over the logits.
 *
 * Each op's CPU entry point (moe_*) is followed by its CUDA twin (moe_cuda_*): the same
 * arguments and semantics on device pointers, asynchronous on `stream`; where they differ, the
 * CUDA declaration says how. Both devices have the workspace-size functions (0: none needed).
 */
#ifndef MOE_ROUTER_H_
#define MOE_ROUTER_H_

#include "moe_types.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---------------------------------------------------------------------------------------------
 * router_gating_linear: logits = inp · weightᵀ (+ bias), computed in the router dtype
 *
 * Megatron's RouterGatingLinearFunction: the input is kept (and saved for backward) in its own
 * dtype; each element is converted to the router dtype before the product. Accumulation is in
 * fp64 for fp32/fp64 router dtypes and fp32 for half ones, in ascending index order, so the
 * result is deterministic and at least as accurate as a router-dtype GEMM.
 * ------------------------------------------------------------------------------------------- */

/**
 * Workspace bytes of moe_router_gating_linear_fwd (backward = 0) or _bwd (backward = 1).
 * CPU: 0 (the sums accumulate on the stack).
 */
size_t moe_router_gating_linear_workspace_size(int64_t num_tokens, int64_t hidden,
                                               int64_t num_experts, moe_dtype_t inp_dtype,
                                               moe_dtype_t weight_dtype, moe_dtype_t router_dtype,
                                               int backward);

/** CUDA: cuBLAS's fixed scratch and any operand conversions (0 for an empty forward). */
size_t moe_cuda_router_gating_linear_workspace_size(int64_t num_tokens, int64_t hidden,
                                                    int64_t num_experts, moe_dtype_t inp_dtype,
                                                    moe_dtype_t weight_dtype,
                                                    moe_dtype_t router_dtype, int backward);

/**
 * Forward.
 * \param[out] logits        [num_tokens, num_experts], `router_dtype`
 * \param[in]  inp           [num_tokens, hidden], `inp_dtype` (fp32, fp64, fp16, bf16)
 * \param[in]  weight        [num_experts, hidden], `weight_dtype` (float types)
 * \param[in]  bias          [num_experts], `weight_dtype`, or NULL for no bias
 * \param[in]  num_tokens    rows of inp, >= 0
 * \param[in]  hidden        columns of inp and weight, >= 1
 * \param[in]  num_experts   rows of weight, >= 1
 * \param[in]  inp_dtype     element type of inp
 * \param[in]  weight_dtype  element type of weight and bias
 * \param[in]  router_dtype  element type of logits (and of the math)
 * \param[in]  workspace     moe_router_gating_linear_workspace_size(..., 0) bytes (none on the
 *                           CPU)
 * \param[in]  workspace_bytes its size
 * \param[in]  stream        CUDA stream for moe_cuda_*, ignored on the CPU
 */
moe_status_t moe_router_gating_linear_fwd(void *logits, const void *inp, const void *weight,
                                          const void *bias, int64_t num_tokens, int64_t hidden,
                                          int64_t num_experts, moe_dtype_t inp_dtype,
                                          moe_dtype_t weight_dtype, moe_dtype_t router_dtype,
                                          void *workspace, size_t workspace_bytes, void *stream);

/**
 * CUDA: cuBLAS GEMMs accumulating in fp32 (fp64 for an fp64 router dtype) instead of the CPU's
 * fp64 sums; a cuBLAS handle per device is created on first use and cached for the life of the
 * process. Workspace: moe_cuda_router_gating_linear_workspace_size(..., backward = 0) bytes.
 */
moe_status_t moe_cuda_router_gating_linear_fwd(void *logits, const void *inp, const void *weight,
                                               const void *bias, int64_t num_tokens,
                                               int64_t hidden, int64_t num_experts,
                                               moe_dtype_t inp_dtype, moe_dtype_t weight_dtype,
                                               moe_dtype_t router_dtype, void *workspace,
                                               size_t workspace_bytes, void *stream);

/**
 * Backward: grad_inp = (grad_logits · weight) cast to inp_dtype; grad_weight = (grad_logitsᵀ · inp)
 * cast to weight_dtype; grad_bias = Σ_t grad_logits cast to weight_dtype. Math in router dtype
 * (accumulated as in the forward). Any of the three outputs may be NULL to skip it.
 * \param[out] grad_inp      [num_tokens, hidden], `inp_dtype`, or NULL
 * \param[out] grad_weight   [num_experts, hidden], `weight_dtype`, or NULL
 * \param[out] grad_bias     [num_experts], `weight_dtype`, or NULL
 * \param[in]  grad_logits   [num_tokens, num_experts], `router_dtype`
 * \param[in]  inp           [num_tokens, hidden], `inp_dtype`
 * \param[in]  weight        [num_experts, hidden], `weight_dtype`
 * (sizes, dtypes, workspace and stream as in the forward)
 */
moe_status_t moe_router_gating_linear_bwd(void *grad_inp, void *grad_weight, void *grad_bias,
                                          const void *grad_logits, const void *inp,
                                          const void *weight, int64_t num_tokens, int64_t hidden,
                                          int64_t num_experts, moe_dtype_t inp_dtype,
                                          moe_dtype_t weight_dtype, moe_dtype_t router_dtype,
                                          void *workspace, size_t workspace_bytes, void *stream);

/**
 * CUDA: as moe_cuda_router_gating_linear_fwd; grad_bias is a deterministic two-stage column sum
 * in fp64. Workspace: moe_cuda_router_gating_linear_workspace_size(..., backward = 1) bytes.
 */
moe_status_t moe_cuda_router_gating_linear_bwd(void *grad_inp, void *grad_weight, void *grad_bias,
                                               const void *grad_logits, const void *inp,
                                               const void *weight, int64_t num_tokens,
                                               int64_t hidden, int64_t num_experts,
                                               moe_dtype_t inp_dtype, moe_dtype_t weight_dtype,
                                               moe_dtype_t router_dtype, void *workspace,
                                               size_t workspace_bytes, void *stream);

/* ---------------------------------------------------------------------------------------------
 * router_topk: logits → scores → (group-limited) top-k → probs, in the compact [T, topk] form
 *
 * Semantics of Megatron's topk_routing_with_score_function (unfused):
 *   softmax, pre:   s = softmax(logits over E); pick top-k of s; p = s[picked] (not renormalised)
 *   softmax, post:  pick top-k of the logits; p = softmax over the k picked logits
 *   sigmoid / sqrtsoftplus: s = f(logits); pick top-k of s + expert_bias (bias: selection only);
 *                   p = s[picked] / (Σ s[picked] + 1e-20) when topk > 1, else s[picked]
 *   then p *= scaling_factor (when it is not 0) and p is written in the logits' dtype.
 * Group-limited selection (num_groups > 0): experts form num_groups contiguous groups; a group's
 * score is the sum of its top (topk / group_topk) selection scores, or of its top
 * group_score_topk when that is set (1: the group's max); the group_topk best groups are
 * kept and the top-k is taken among their experts only.
 * Beyond Megatron: with softmax-pre, expert_bias may be added to the softmax probs for the
 * selection only (the probs stay the unbiased ones); `norm` drops or forces the renormalisation.
 *
 * Precision: score math in fp32 for fp32/fp16/bf16 logits (as Megatron) and in fp64 for fp64
 * logits (Megatron downcasts those to fp32; keeping fp64 is a documented, deliberate difference).
 *
 * Ordering and ties: the k entries of a row are sorted by descending selection score; equal
 * scores are broken by the lowest expert index (groups: the lowest group index). NaN compares
 * greater than every number, as in torch.topk, so a NaN logit is selected and its row's probs
 * are NaN: bad values propagate rather than being hidden.
 * ------------------------------------------------------------------------------------------- */

/**
 * How the k picked probs are normalised (the rules beyond Megatron's come from Hugging Face
 * families: DeepSeek-V3 with norm_topk_prob=False, Qwen / Ernie-4.5 renormalising softmax-pre).
 */
typedef enum moe_topk_norm {
    MOE_TOPK_NORM_DEFAULT = 0, /**< Megatron's: sigmoid / sqrtsoftplus renormalised when topk > 1,
                                    softmax-pre not, softmax-post a softmax over the k */
    MOE_TOPK_NORM_NONE = 1,    /**< the picked scores as they are (not with softmax-post) */
    MOE_TOPK_NORM_SUM = 2      /**< p / (Σ p + 1e-20) for every topk (not with softmax-post) */
} moe_topk_norm_t;

/** Options of router_topk (a struct: more than a handful of scalars). Zero-initialised trailing
 * fields give Megatron's rules. */
typedef struct moe_router_topk_params {
    int64_t topk;                        /**< experts per token, 1 <= topk <= num_experts */
    int64_t num_groups;                  /**< 0 (no groups) or a divisor of num_experts */
    int64_t group_topk;                  /**< groups kept per token: 1..num_groups, 0 iff none */
    int use_pre_softmax;                 /**< softmax only: score before top-k, no renormalising */
    moe_score_function_t score_function; /**< softmax, sigmoid or sqrtsoftplus */
    double scaling_factor;               /**< multiplies the probs; 0 means off (as Megatron) */
    moe_topk_norm_t norm;                /**< normalisation of the picked probs */
    int64_t group_score_topk;            /**< a group's score sums its top this-many selection
                                              scores, 1..experts per group (1: the group's max);
                                              0: topk / group_topk (Megatron's) */
} moe_router_topk_params_t;

/** Checks the params against num_experts; MOE_OK or MOE_ERR_INVALID_ARGUMENT with a message. */
moe_status_t moe_router_topk_check(const moe_router_topk_params_t *params, int64_t num_experts,
                                   int has_expert_bias);

/**
 * Workspace bytes of moe_router_topk_fwd, _bwd and _dense_bwd. CPU: scratch of
 * O(topk + num_groups) words for each OpenMP thread (it depends on the thread count of the
 * calling process).
 */
size_t moe_router_topk_workspace_size(int64_t num_tokens, int64_t num_experts,
                                      const moe_router_topk_params_t *params);

/**
 * CUDA: 0 where a row fits one warp (up to 1024 experts, 32 groups); otherwise per token
 * 4·topk + 3·num_groups + 1 fp64 words for the thread-per-token kernels.
 */
size_t moe_cuda_router_topk_workspace_size(int64_t num_tokens, int64_t num_experts,
                                           const moe_router_topk_params_t *params);

/**
 * Forward.
 * \param[out] topk_probs    [num_tokens, topk], `logits_dtype`
 * \param[out] topk_indices  [num_tokens, topk], int64 expert ids, sorted as described above
 * \param[in]  logits        [num_tokens, num_experts], `logits_dtype` (fp32, fp64, fp16, bf16)
 * \param[in]  expert_bias   [num_experts], fp32, or NULL; sigmoid/sqrtsoftplus/softmax-pre
 * \param[in]  num_tokens    >= 0
 * \param[in]  num_experts   >= 1
 * \param[in]  logits_dtype  element type of logits and topk_probs
 * \param[in]  params        the routing options
 */
moe_status_t moe_router_topk_fwd(void *topk_probs, int64_t *topk_indices, const void *logits,
                                 const float *expert_bias, int64_t num_tokens,
                                 int64_t num_experts, moe_dtype_t logits_dtype,
                                 const moe_router_topk_params_t *params, void *workspace,
                                 size_t workspace_bytes, void *stream);

/**
 * CUDA: one warp per token (a thread per token past 1024 experts or 32 groups). The experts are
 * picked under the CPU's order by construction and the probs computed with its rounding points;
 * only the math library may differ, in the last bit of fp64.
 */
moe_status_t moe_cuda_router_topk_fwd(void *topk_probs, int64_t *topk_indices, const void *logits,
                                      const float *expert_bias, int64_t num_tokens,
                                      int64_t num_experts, moe_dtype_t logits_dtype,
                                      const moe_router_topk_params_t *params, void *workspace,
                                      size_t workspace_bytes, void *stream);

/**
 * Backward: the gradient of the logits through the probs (the selection is piecewise constant).
 * Scores are recomputed from the logits; entries of grad_logits outside a row's softmax/score
 * support are zero (post-softmax, sigmoid, sqrtsoftplus: all but the k picked experts).
 * \param[out] grad_logits   [num_tokens, num_experts], `logits_dtype`
 * \param[in]  grad_probs    [num_tokens, topk], `logits_dtype`
 * \param[in]  logits        [num_tokens, num_experts], `logits_dtype`
 * \param[in]  topk_indices  [num_tokens, topk], int64, as written by the forward
 * (sizes, dtype and params as in the forward; groups and bias play no part here)
 */
moe_status_t moe_router_topk_bwd(void *grad_logits, const void *grad_probs, const void *logits,
                                 const int64_t *topk_indices, int64_t num_tokens,
                                 int64_t num_experts, moe_dtype_t logits_dtype,
                                 const moe_router_topk_params_t *params, void *workspace,
                                 size_t workspace_bytes, void *stream);

/**
 * CUDA: as the CPU entry point, except that topk_indices is in device memory and not checked to
 * lie in [0, num_experts) (the CPU checks it; here that would need a host sync).
 */
moe_status_t moe_cuda_router_topk_bwd(void *grad_logits, const void *grad_probs,
                                      const void *logits, const int64_t *topk_indices,
                                      int64_t num_tokens, int64_t num_experts,
                                      moe_dtype_t logits_dtype,
                                      const moe_router_topk_params_t *params, void *workspace,
                                      size_t workspace_bytes, void *stream);

/**
 * Backward of moe_router_topk_fused_fwd's probs: as moe_router_topk_bwd, reading the gradient of
 * the dense probs ([num_tokens, num_experts], `logits_dtype`) at the picked experts only (the
 * probs are zero elsewhere whatever the logits, so the rest carries no gradient).
 */
moe_status_t moe_router_topk_dense_bwd(void *grad_logits, const void *grad_probs,
                                       const void *logits, const int64_t *topk_indices,
                                       int64_t num_tokens, int64_t num_experts,
                                       moe_dtype_t logits_dtype,
                                       const moe_router_topk_params_t *params, void *workspace,
                                       size_t workspace_bytes, void *stream);

/** CUDA: as moe_cuda_router_topk_bwd, reading the dense gradient. */
moe_status_t moe_cuda_router_topk_dense_bwd(void *grad_logits, const void *grad_probs,
                                            const void *logits, const int64_t *topk_indices,
                                            int64_t num_tokens, int64_t num_experts,
                                            moe_dtype_t logits_dtype,
                                            const moe_router_topk_params_t *params,
                                            void *workspace, size_t workspace_bytes, void *stream);

/**
 * The fused router's optional extras: what the load-balancing losses need, computed from the same
 * read of the logits as the routing. Every pointer may be NULL (aux_scores and aux_map
 * together); the mask concerns these outputs only, the routing is unaffected by it.
 *   aux_scores [num_tokens, num_experts] fp32 (fp64 for fp64 logits) and aux_map [num_tokens,
 *     num_experts] bool: bit for bit moe_aux_loss_scores_fwd's with topk = params->topk and the
 *     params' score function (softmax over all experts, or s / (Σ s + 1e-20); the top-k of those
 *     values, no groups, no bias, ties to the lower index); padded rows all zero.
 *   lse [num_tokens] fp64: logsumexp of each row (the value the z-loss squares, as z_loss.c
 *     computes it); 0 on padded rows.
 *   padding_mask [num_tokens] uint8 (nonzero = padding), or NULL.
 * On the CPU the values are computed by the same loops as aux_loss_scores.c / z_loss.c, so they
 * are identical; on CUDA the fp64 row sums (softmax and score sums, lse) are warp reductions and
 * may differ from the CPU's ascending-order sums in the last bit of fp64 (as the router's own
 * softmax statistics do).
 */
typedef struct moe_router_topk_extras {
    void *aux_scores;
    uint8_t *aux_map;
    double *lse;
    const uint8_t *padding_mask;
} moe_router_topk_extras_t;

/** Checks the extras (aux_scores and aux_map both set or both NULL); MOE_OK or a message. */
moe_status_t moe_router_topk_extras_check(const moe_router_topk_extras_t *extras,
                                          int64_t num_tokens);

/**
 * Workspace bytes of moe_router_topk_fused_fwd. CPU: moe_router_topk_workspace_size's (a
 * thread's scratch already holds the aux top-k list).
 */
size_t moe_router_topk_fused_workspace_size(int64_t num_tokens, int64_t num_experts,
                                            const moe_router_topk_params_t *params,
                                            moe_dtype_t logits_dtype, int with_aux);

/**
 * CUDA: 0 on the warp path (fp32 / bf16 / fp16 rows up to 1024 experts, where the extras come
 * from the values already in registers); otherwise the compact [T, topk] probs, the per-token
 * scratch and, with the aux extras, their top-k lists (the fp64 and wide-row paths write the
 * dense layout and the extras with second kernels).
 */
size_t moe_cuda_router_topk_fused_workspace_size(int64_t num_tokens, int64_t num_experts,
                                                 const moe_router_topk_params_t *params,
                                                 moe_dtype_t logits_dtype, int with_aux);

/**
 * The fused router in Megatron's default layout: the same routing as moe_router_topk_fwd, written
 * straight to the dense [T, E] probs (zero off the top-k) and boolean routing map, plus the
 * [T, topk] expert ids the backward needs, and optionally the extras above. One pass over the
 * logits on CUDA. With NULL extras it is the plain dense router.
 * \param[out] probs         [num_tokens, num_experts], `logits_dtype`; every element written
 * \param[out] routing_map   [num_tokens, num_experts], bool (uint8 0/1); every element written
 * \param[out] topk_indices  [num_tokens, topk], int64, best first (as moe_router_topk_fwd)
 * \param[out] extras        the optional extra outputs (and their padding mask), or NULL
 * (inputs, sizes, params as moe_router_topk_fwd; workspace: moe_router_topk_workspace_size on
 * the CPU (it covers the extras), moe_cuda_router_topk_fused_workspace_size on CUDA)
 */
moe_status_t moe_router_topk_fused_fwd(void *probs, uint8_t *routing_map, int64_t *topk_indices,
                                       const moe_router_topk_extras_t *extras, const void *logits,
                                       const float *expert_bias, int64_t num_tokens,
                                       int64_t num_experts, moe_dtype_t logits_dtype,
                                       const moe_router_topk_params_t *params, void *workspace,
                                       size_t workspace_bytes, void *stream);

/** CUDA: one pass over the logits on the warp path; the extras as described above. */
moe_status_t moe_cuda_router_topk_fused_fwd(void *probs, uint8_t *routing_map,
                                            int64_t *topk_indices,
                                            const moe_router_topk_extras_t *extras,
                                            const void *logits, const float *expert_bias,
                                            int64_t num_tokens, int64_t num_experts,
                                            moe_dtype_t logits_dtype,
                                            const moe_router_topk_params_t *params,
                                            void *workspace, size_t workspace_bytes, void *stream);

/**
 * Backward of the lse extra: grad_logits[t, e] = grad_lse[t] · exp(logits[t, e] − lse[t]) (the
 * softmax row), 0 on padded rows; computed in fp64, stored in `logits_dtype`. With
 * grad_lse = (g · coeff · 2 / n) · lse this is, bit for bit on the CPU, moe_z_loss_bwd.
 * \param[out] grad_logits  [num_tokens, num_experts], `logits_dtype`
 * \param[in]  grad_lse     [num_tokens], fp64
 * \param[in]  logits       [num_tokens, num_experts], `logits_dtype`
 * \param[in]  lse          [num_tokens], fp64, as the forward wrote it
 * \param[in]  padding_mask [num_tokens] uint8 or NULL
 * No workspace.
 */
moe_status_t moe_router_lse_bwd(void *grad_logits, const double *grad_lse, const void *logits,
                                const double *lse, const uint8_t *padding_mask,
                                int64_t num_tokens, int64_t num_experts, moe_dtype_t logits_dtype,
                                void *workspace, size_t workspace_bytes, void *stream);

/** CUDA: as the CPU entry point, elementwise on the device. No workspace. */
moe_status_t moe_cuda_router_lse_bwd(void *grad_logits, const double *grad_lse,
                                     const void *logits, const double *lse,
                                     const uint8_t *padding_mask, int64_t num_tokens,
                                     int64_t num_experts, moe_dtype_t logits_dtype,
                                     void *workspace, size_t workspace_bytes, void *stream);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* MOE_ROUTER_H_ */
