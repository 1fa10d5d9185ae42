/*
 * moe_core.h: the public C11 ABI of moe-core.
 *
 * Every op is a plain function on raw, contiguous, row-major buffers:
 *
 *     moe_status_t moe_<op>_<fwd|bwd>(outputs..., inputs..., sizes (int64_t)..., options...,
 *                                     void *workspace, size_t workspace_bytes, void *stream);
 *
 * Outputs come first, the stream last. The CPU entry points are `moe_<op>_*` and ignore `stream`
 * (pass NULL); the CUDA entry points are `moe_cuda_<op>_*`, take device pointers and a
 * `cudaStream_t` passed as `void *`, and run only in a build with CUDA (MOE_CORE_WITH_CUDA); a
 * build without it defines them too, returning MOE_ERR_UNSUPPORTED (see moe_has_cuda()).
 * Both have the same signature and the same semantics, bit for bit where the op says so.
 *
 * The core never allocates, never creates streams or handles, never synchronises with the host
 * and never exits. On failure a function returns a status other than MOE_OK and leaves a message
 * naming the argument and its bad value in a thread-local buffer, read with moe_last_error().
 * Sizes and indices are int64 throughout.
 *
 * Overflow: every size the core derives from its arguments (element counts, row bounds, byte
 * counts) is computed with checked int64 arithmetic. An op whose sizes do not fit returns
 * MOE_ERR_INVALID_ARGUMENT naming the argument and its value; a *_workspace_size function, which
 * has no status to return, returns MOE_SIZE_OVERFLOW and leaves the message in moe_last_error().
 */
#ifndef MOE_CORE_H_
#define MOE_CORE_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define MOE_CORE_VERSION_MAJOR 0
#define MOE_CORE_VERSION_MINOR 1

/* ---------------------------------------------------------------------------------------------
 * Status, dtypes, options
 * ------------------------------------------------------------------------------------------- */

/** Result of every op. */
typedef enum moe_status {
    MOE_OK = 0,                   /**< success */
    MOE_ERR_INVALID_ARGUMENT = 1, /**< an argument is out of its documented range */
    MOE_ERR_UNSUPPORTED = 2,      /**< a valid combination this build does not implement */
    MOE_ERR_CUDA = 3,             /**< the CUDA runtime reported an error (launch or config) */
    MOE_ERR_INTERNAL = 4          /**< a bug in moe-core; please report it */
} moe_status_t;

/** Element type of a buffer. Half types are stored as their 16-bit patterns. */
typedef enum moe_dtype {
    MOE_DTYPE_FP32 = 0,
    MOE_DTYPE_FP64 = 1,
    MOE_DTYPE_FP16 = 2,
    MOE_DTYPE_BF16 = 3,
    MOE_DTYPE_INT32 = 4,
    MOE_DTYPE_INT64 = 5,
    MOE_DTYPE_BOOL = 6 /**< one byte per element, 0 or 1 */
} moe_dtype_t;

/** Router score function (Megatron's moe_router_score_function). */
typedef enum moe_score_function {
    MOE_SCORE_SOFTMAX = 0,     /**< softmax over the experts (pre) or over the top-k (post) */
    MOE_SCORE_SIGMOID = 1,     /**< sigmoid(x), renormalised over the top-k when topk > 1 */
    MOE_SCORE_SQRTSOFTPLUS = 2 /**< sqrt(softplus(x)), renormalised like sigmoid */
} moe_score_function_t;

/**
 * What every *_workspace_size function returns when the size does not fit (an argument so large
 * that the byte count overflows int64): never a valid request, since no
 * buffer can have SIZE_MAX bytes. moe_last_error() then names the function and its arguments.
 */
#define MOE_SIZE_OVERFLOW SIZE_MAX

/** Name of a status code, e.g. "MOE_ERR_INVALID_ARGUMENT". Never NULL. */
const char *moe_status_string(moe_status_t status);

/** The message of the last failed call on this thread ("" if none). Valid until the next call. */
const char *moe_last_error(void);

/** Size in bytes of one element of `dtype`, or 0 for an unknown value. */
size_t moe_dtype_size(moe_dtype_t dtype);

/** 1 if this build has the CUDA entry points (moe_cuda_*), else 0. */
int moe_has_cuda(void);

/* ---------------------------------------------------------------------------------------------
 * router_gating_linear: logits = inp · weightᵀ (+ bias), computed in the router dtype
 *
 * Megatron's RouterGatingLinearFunction: the input is kept (and saved for backward) in its own
 * dtype; each element is converted to the router dtype before the product. Accumulation is in
 * fp64 for fp32/fp64 router dtypes and fp32 for half ones, in ascending index order, so the
 * result is deterministic and at least as accurate as a router-dtype GEMM.
 * ------------------------------------------------------------------------------------------- */

/** Workspace bytes of moe_router_gating_linear_fwd (backward = 0) / _bwd (1): 0 on the CPU. */
size_t moe_router_gating_linear_workspace_size(int64_t num_tokens, int64_t hidden,
                                               int64_t num_experts, moe_dtype_t inp_dtype,
                                               moe_dtype_t weight_dtype, moe_dtype_t router_dtype,
                                               int backward);

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
 * \param[in]  workspace     unused (NULL), kept for the uniform signature
 * \param[in]  workspace_bytes 0
 * \param[in]  stream        CUDA stream for moe_cuda_*, ignored on the CPU
 */
moe_status_t moe_router_gating_linear_fwd(void *logits, const void *inp, const void *weight,
                                          const void *bias, int64_t num_tokens, int64_t hidden,
                                          int64_t num_experts, moe_dtype_t inp_dtype,
                                          moe_dtype_t weight_dtype, moe_dtype_t router_dtype,
                                          void *workspace, size_t workspace_bytes, void *stream);

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
    int64_t group_topk;                  /**< groups kept per token, 1..num_groups (0 iff no groups) */
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
 * Workspace bytes moe_router_topk_fwd / _bwd need on the CPU: scratch of O(topk + num_groups)
 * words for each OpenMP thread (it depends on the thread count of the calling process).
 */
size_t moe_router_topk_workspace_size(int64_t num_tokens, int64_t num_experts,
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
 * Backward of moe_router_topk_fused_fwd's probs: as moe_router_topk_bwd, reading the gradient of the
 * dense probs ([num_tokens, num_experts], `logits_dtype`) at the picked experts only (the probs
 * are zero elsewhere whatever the logits, so the rest carries no gradient).
 */
moe_status_t moe_router_topk_dense_bwd(void *grad_logits, const void *grad_probs,
                                       const void *logits, const int64_t *topk_indices,
                                       int64_t num_tokens, int64_t num_experts,
                                       moe_dtype_t logits_dtype,
                                       const moe_router_topk_params_t *params, void *workspace,
                                       size_t workspace_bytes, void *stream);

/**
 * The fused router's optional extras: what the load-balancing losses need, computed from the same
 * read of the logits as the routing (issue 6). Every pointer may be NULL (aux_scores and aux_map
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

/** Workspace bytes of moe_router_topk_fused_fwd: on the CPU, moe_router_topk_workspace_size's. */
size_t moe_router_topk_fused_workspace_size(int64_t num_tokens, int64_t num_experts,
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

/* ---------------------------------------------------------------------------------------------
 * topk_to_dense: compact [T, topk] routing → Megatron's [T, E] probs and boolean routing map
 * ------------------------------------------------------------------------------------------- */

/**
 * Forward: probs[t, e] = topk_probs[t, j] where topk_indices[t, j] == e, else 0;
 * routing_map[t, e] = 1 exactly there. Indices must be distinct within a row and in [0, E): the
 * CPU entry points (forward and backward) reject a repeated or out-of-range id before writing
 * anything; the CUDA ones cannot without a host sync (the ids are in device memory), so there it
 * is the caller's contract (an out-of-range id is ignored, a repeated one's last value wins).
 * \param[out] probs         [num_tokens, num_experts], `dtype`, or NULL
 * \param[out] routing_map   [num_tokens, num_experts], bool (uint8 0/1), or NULL
 * \param[in]  topk_probs    [num_tokens, topk], `dtype`
 * \param[in]  topk_indices  [num_tokens, topk], int64
 * \param[in]  num_tokens, num_experts, topk  sizes (topk <= num_experts)
 * \param[in]  dtype         element type of probs (any float type)
 */
moe_status_t moe_topk_to_dense_fwd(void *probs, uint8_t *routing_map, const void *topk_probs,
                                   const int64_t *topk_indices, int64_t num_tokens,
                                   int64_t num_experts, int64_t topk, moe_dtype_t dtype,
                                   void *workspace, size_t workspace_bytes, void *stream);

/**
 * Backward: grad_topk_probs[t, j] = grad_probs[t, topk_indices[t, j]] (a gather).
 * \param[out] grad_topk_probs [num_tokens, topk], `dtype`
 * \param[in]  grad_probs      [num_tokens, num_experts], `dtype`
 * \param[in]  topk_indices    [num_tokens, topk], int64
 */
moe_status_t moe_topk_to_dense_bwd(void *grad_topk_probs, const void *grad_probs,
                                   const int64_t *topk_indices, int64_t num_tokens,
                                   int64_t num_experts, int64_t topk, moe_dtype_t dtype,
                                   void *workspace, size_t workspace_bytes, void *stream);

/* ---------------------------------------------------------------------------------------------
 * Token layout (issue 3): capacity dropping, permute / unpermute, chunk sorting
 *
 * The permuted layout ("rows"): every (token, expert) pair that is kept becomes one row of a
 * [num_rows, hidden] buffer. Rows are grouped by expert in ascending expert id; within an expert
 * the tokens are in ascending token index (exactly Megatron's order). Expert e owns the rows
 * [expert_offsets[e], expert_offsets[e+1]); tokens_per_expert[e] is that block's length. A block
 * may end with padding rows (align_size, or drop-and-pad capacity beyond the token count), and the
 * buffer may end with unused rows (num_rows is a static bound); both are zero and are marked -1 in
 * sorted_indices. Nothing about the layout needs the host: num_rows is known from the shapes, the
 * used count expert_offsets[E] stays in device memory.
 *
 * What permute hands to unpermute is Megatron's `sorted_indices` ([num_rows] int64: the source
 * token of each row, or -1 for a padding row) plus `expert_offsets` when probs are applied.
 * unpermute inverts sorted_indices into a token → rows map in its workspace (a stable counting
 * sort), then each output token is the sum of its own rows in ascending row order: a gather, not a
 * scatter-add, so the combine is deterministic and needs no atomics.
 * ------------------------------------------------------------------------------------------- */

/** Capacity drop policy (Megatron's moe_token_drop_policy). */
typedef enum moe_drop_policy {
    MOE_DROP_PROBS = 0,   /**< keep the `capacity` highest probs of each expert */
    MOE_DROP_POSITION = 1 /**< keep the first `capacity` routed tokens of each expert */
} moe_drop_policy_t;

/**
 * Workspace bytes moe_token_dropping_fwd needs: for the probs policy, T sort keys and 2·T
 * indices for each OpenMP thread (depends on the calling process's thread count); 0 otherwise.
 */
size_t moe_token_dropping_workspace_size(int64_t num_tokens, int64_t num_experts,
                                         moe_drop_policy_t policy, moe_dtype_t dtype);

/**
 * Forward of apply_router_token_dropping. Per expert column e, tokens are ranked by a stable
 * descending sort of the key (probs: routing_probs[:, e], NaN first; position: routing_map[:, e])
 * and the first `capacity` form the capacity mask (all tokens when capacity > num_tokens). Ties
 * go to the lower token index, so "position" keeps the first `capacity` routed tokens in
 * ascending order and, when padding, fills with the first unrouted tokens.
 *   final_map   = pad_to_capacity ? mask : routing_map & mask
 *   final_probs = routing_probs * final_map  (a product, so NaN·0 stays NaN as in torch)
 * \param[out] final_probs   [num_tokens, num_experts], `dtype`
 * \param[out] final_map     [num_tokens, num_experts], bool (uint8 0/1)
 * \param[in]  routing_probs [num_tokens, num_experts], `dtype` (float)
 * \param[in]  routing_map   [num_tokens, num_experts], bool (uint8 0/1)
 * \param[in]  num_tokens    >= 0
 * \param[in]  num_experts   >= 1
 * \param[in]  capacity      tokens kept per expert, >= 0 (get_capacity(T·topk, E, factor))
 * \param[in]  policy        MOE_DROP_PROBS or MOE_DROP_POSITION
 * \param[in]  pad_to_capacity nonzero: the map becomes the mask itself (every column `capacity`)
 * \param[in]  dtype         element type of the probs
 * \param[in]  workspace     moe_token_dropping_workspace_size(...) bytes (may be NULL when 0)
 */
moe_status_t moe_token_dropping_fwd(void *final_probs, uint8_t *final_map,
                                    const void *routing_probs, const uint8_t *routing_map,
                                    int64_t num_tokens, int64_t num_experts, int64_t capacity,
                                    moe_drop_policy_t policy, int pad_to_capacity,
                                    moe_dtype_t dtype, void *workspace, size_t workspace_bytes,
                                    void *stream);

/**
 * Backward: grad_routing_probs = grad_final_probs * final_map (same product form as the forward).
 * \param[out] grad_routing_probs [num_tokens, num_experts], `dtype`
 * \param[in]  grad_final_probs   [num_tokens, num_experts], `dtype`
 * \param[in]  final_map          [num_tokens, num_experts], bool, as written by the forward
 */
moe_status_t moe_token_dropping_bwd(void *grad_routing_probs, const void *grad_final_probs,
                                    const uint8_t *final_map, int64_t num_tokens,
                                    int64_t num_experts, moe_dtype_t dtype, void *workspace,
                                    size_t workspace_bytes, void *stream);

/** Options of permute (a struct: more than a handful of scalars). */
typedef struct moe_permute_params {
    int64_t num_out_tokens; /**< dropless: the row bound (Megatron's num_out_tokens, usually
                                 num_tokens·topk); drop_and_pad: num_experts·capacity */
    int64_t align_size;     /**< 0 or 1: no alignment; else each expert block is padded with zero
                                 rows to a multiple of align_size */
    int drop_and_pad;       /**< nonzero: the [E·capacity] layout, capacity = num_out_tokens / E */
} moe_permute_params_t;

/**
 * Rows of the permuted buffer (the static bound), or -1 with a message (moe_last_error()) for
 * bad params or a bound that overflows int64 (e.g. a huge align_size):
 *   dropless:     num_out_tokens + (align_size > 1 ? num_experts·(align_size - 1) : 0)
 *   drop_and_pad: num_experts · roundup(num_out_tokens / num_experts, max(align_size, 1))
 */
int64_t moe_permute_num_rows(int64_t num_tokens, int64_t num_experts,
                             const moe_permute_params_t *params);

/** Workspace bytes of moe_permute_fwd: 0 on the CPU. */
size_t moe_permute_workspace_size(int64_t num_tokens, int64_t num_experts,
                                  const moe_permute_params_t *params);

/**
 * Forward of permute. Dropless: expert e's block holds its routed tokens in ascending order.
 * If the routed pairs exceed num_out_tokens, the rows past it are cut off (as in Megatron); the
 * counts and offsets describe what is in the buffer. Drop-and-pad: each block holds the first
 * `capacity` tokens of a stable descending sort of routing_map[:, e] (routed tokens ascending,
 * then unrouted ones ascending: Megatron's layout), then -1 rows where capacity > num_tokens.
 * \param[out] permuted_tokens [num_rows, hidden], `dtype`; padding rows are zero
 * \param[out] permuted_probs  [num_rows], `probs_dtype`, or NULL: probs[token, expert] per row,
 *                             zero on padding rows
 * \param[out] sorted_indices  [num_rows], int64: source token of each row, -1 for padding
 * \param[out] expert_offsets  [num_experts + 1], int64: block starts; [E] is the used row count
 * \param[out] tokens_per_expert [num_experts], int64: rows of each block (padding included)
 * \param[in]  tokens          [num_tokens, hidden], `dtype`
 * \param[in]  routing_map     [num_tokens, num_experts], bool (uint8 0/1)
 * \param[in]  probs           [num_tokens, num_experts], `probs_dtype`, or NULL
 * \param[in]  num_tokens, hidden, num_experts  sizes (>= 0, >= 1, >= 1)
 * \param[in]  dtype, probs_dtype  element types (any moe_dtype_t for tokens; float for probs)
 * \param[in]  params          layout options; num_rows = moe_permute_num_rows(...)
 * \param[in]  workspace       unused (NULL)
 */
moe_status_t moe_permute_fwd(void *permuted_tokens, void *permuted_probs, int64_t *sorted_indices,
                             int64_t *expert_offsets, int64_t *tokens_per_expert,
                             const void *tokens, const uint8_t *routing_map, const void *probs,
                             int64_t num_tokens, int64_t hidden, int64_t num_experts,
                             moe_dtype_t dtype, moe_dtype_t probs_dtype,
                             const moe_permute_params_t *params, void *workspace,
                             size_t workspace_bytes, void *stream);

/**
 * Workspace bytes of moe_permute_bwd, moe_unpermute_fwd and moe_unpermute_bwd: the token → rows
 * map, (num_tokens + 1 + num_rows) int64.
 */
size_t moe_unpermute_workspace_size(int64_t num_tokens, int64_t num_rows);

/**
 * Backward of permute. grad_tokens[t] = Σ grad_permuted_tokens[r] over the rows r of token t, in
 * ascending r, accumulated in fp32 (fp64 for fp64) and rounded once to `dtype`;
 * grad_probs[t, e] = grad_permuted_probs[r] for the row r of (t, e), zero elsewhere.
 * \param[out] grad_tokens          [num_tokens, hidden], `dtype`
 * \param[out] grad_probs           [num_tokens, num_experts], `probs_dtype`, or NULL
 * \param[in]  grad_permuted_tokens [num_rows, hidden], `dtype`
 * \param[in]  grad_permuted_probs  [num_rows], `probs_dtype` (NULL iff grad_probs is NULL)
 * \param[in]  sorted_indices       [num_rows], int64, from the forward (-1: padding row)
 * \param[in]  expert_offsets       [num_experts + 1], int64, from the forward (with grad_probs)
 * \param[in]  workspace            moe_unpermute_workspace_size(num_tokens, num_rows) bytes
 */
moe_status_t moe_permute_bwd(void *grad_tokens, void *grad_probs, const void *grad_permuted_tokens,
                             const void *grad_permuted_probs, const int64_t *sorted_indices,
                             const int64_t *expert_offsets, int64_t num_tokens, int64_t hidden,
                             int64_t num_experts, int64_t num_rows, moe_dtype_t dtype,
                             moe_dtype_t probs_dtype, void *workspace, size_t workspace_bytes,
                             void *stream);

/**
 * Forward of unpermute (the combine). With probs, row r of token t in expert e is weighted by
 * probs[t, e], the product rounded to P = promote(dtype, probs_dtype) (Megatron multiplies in the
 * promoted dtype); without probs P = dtype. Each token sums its rows in ascending row order in
 * fp32 (fp64 when P is fp64), rounds to P and then to `dtype`. For up to two rows per token this
 * is bitwise Megatron's result. Tokens with no row are zero.
 * \param[out] output          [num_tokens, hidden], `dtype`
 * \param[in]  permuted_tokens [num_rows, hidden], `dtype` (float)
 * \param[in]  sorted_indices  [num_rows], int64 in [-1, num_tokens): -1 rows are skipped
 * \param[in]  probs           [num_tokens, num_experts], `probs_dtype`, or NULL
 * \param[in]  expert_offsets  [num_experts + 1], int64, non-decreasing, offsets[E] <= num_rows
 *                             (required with probs): row r belongs to the expert e with
 *                             offsets[e] <= r < offsets[e+1]
 * \param[in]  workspace       moe_unpermute_workspace_size(num_tokens, num_rows) bytes
 */
moe_status_t moe_unpermute_fwd(void *output, const void *permuted_tokens,
                               const int64_t *sorted_indices, const void *probs,
                               const int64_t *expert_offsets, int64_t num_tokens, int64_t hidden,
                               int64_t num_experts, int64_t num_rows, moe_dtype_t dtype,
                               moe_dtype_t probs_dtype, void *workspace, size_t workspace_bytes,
                               void *stream);

/**
 * Backward of unpermute. grad_permuted_tokens[r] = grad_output[t] · probs[t, e] (rounded to P,
 * then to `dtype`; a copy without probs; zero for -1 rows). grad_probs[t, e] = Σ_h
 * grad_output[t, h] · permuted_tokens[r, h] (products rounded to P, summed in fp32/fp64 in
 * ascending h), zero where (t, e) has no row.
 * \param[out] grad_permuted_tokens [num_rows, hidden], `dtype`
 * \param[out] grad_probs      [num_tokens, num_experts], `probs_dtype`, or NULL (no probs grad)
 * \param[in]  grad_output     [num_tokens, hidden], `dtype`
 * \param[in]  permuted_tokens [num_rows, hidden], `dtype` (read only for grad_probs)
 * (the other arguments as in the forward)
 */
moe_status_t moe_unpermute_bwd(void *grad_permuted_tokens, void *grad_probs,
                               const void *grad_output, const void *permuted_tokens,
                               const int64_t *sorted_indices, const void *probs,
                               const int64_t *expert_offsets, int64_t num_tokens, int64_t hidden,
                               int64_t num_experts, int64_t num_rows, moe_dtype_t dtype,
                               moe_dtype_t probs_dtype, void *workspace, size_t workspace_bytes,
                               void *stream);

/** Workspace bytes of moe_sort_chunks_by_idxs_fwd / _bwd: 0 on the CPU. */
size_t moe_sort_chunks_by_idxs_workspace_size(int64_t num_chunks);

/**
 * sort_chunks_by_idxs: input is split into chunks of split_sizes rows; the output is the chunks
 * concatenated in the order sorted_idxs gives (a permutation of [0, num_chunks)). Rows move whole.
 * \param[out] output      [num_rows, row_elems], `dtype`
 * \param[in]  input       [num_rows, row_elems], `dtype`
 * \param[in]  split_sizes [num_chunks], int64 >= 0, summing to num_rows
 * \param[in]  sorted_idxs [num_chunks], int64, a permutation of [0, num_chunks)
 * \param[in]  num_rows, row_elems, num_chunks  sizes (>= 0, >= 0, >= 0)
 * \param[in]  dtype       element type (any)
 */
moe_status_t moe_sort_chunks_by_idxs_fwd(void *output, const void *input,
                                         const int64_t *split_sizes, const int64_t *sorted_idxs,
                                         int64_t num_rows, int64_t row_elems, int64_t num_chunks,
                                         moe_dtype_t dtype, void *workspace,
                                         size_t workspace_bytes, void *stream);

/**
 * Backward: the inverse move, grad_input's chunk sorted_idxs[j] = grad_output's j-th chunk.
 * \param[out] grad_input  [num_rows, row_elems], `dtype`
 * \param[in]  grad_output [num_rows, row_elems], `dtype`
 * (split_sizes, sorted_idxs and sizes as in the forward)
 */
moe_status_t moe_sort_chunks_by_idxs_bwd(void *grad_input, const void *grad_output,
                                         const int64_t *split_sizes, const int64_t *sorted_idxs,
                                         int64_t num_rows, int64_t row_elems, int64_t num_chunks,
                                         moe_dtype_t dtype, void *workspace,
                                         size_t workspace_bytes, void *stream);

/* ---------------------------------------------------------------------------------------------
 * Load balancing (CPU): aux-loss scores, the switch aux loss, z-loss, token counts, the expert
 * bias update, Sinkhorn and Sinkhorn routing, routing metrics.
 *
 * Losses are fp32 scalars (fp64 for fp64 inputs, so fp64 gradcheck is meaningful) computed with
 * fp64 accumulation in a fixed order (deterministic, no atomics). Padding masks are [num_tokens]
 * bool buffers (uint8 0/1), 1 = padding, or NULL for no padding: a padded token contributes
 * nothing to a loss, a count, a metric or a gradient.
 * ------------------------------------------------------------------------------------------- */

/**
 * Workspace bytes moe_aux_loss_scores_fwd needs on the CPU: O(topk) words per OpenMP thread.
 */
size_t moe_aux_loss_scores_workspace_size(int64_t num_tokens, int64_t num_experts, int64_t topk);

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

/** Options of the switch load-balancing loss. */
typedef struct moe_switch_aux_loss_params {
    int64_t topk;        /**< k in the formula, >= 1 */
    int64_t num_experts; /**< E in the formula, >= 1 (the sequence loss has num_columns = B·E) */
    double coeff;        /**< the loss coefficient (any finite value) */
} moe_switch_aux_loss_params_t;

/** Workspace bytes of moe_switch_aux_loss_fwd: one fp64 partial sum per column. */
size_t moe_switch_aux_loss_workspace_size(int64_t num_tokens, int64_t num_columns);

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

/** Workspace bytes of moe_z_loss_fwd: one fp64 word per token. */
size_t moe_z_loss_workspace_size(int64_t num_tokens, int64_t num_experts);

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

/**
 * Tokens per expert: counts[e] = #{t : routing_map[t, e] and not padding_mask[t]}.
 * \param[out] counts        [num_experts], int64
 * \param[in]  routing_map   [num_tokens, num_experts], bool
 * \param[in]  padding_mask  [num_tokens], bool, 1 = padding, or NULL
 * \param[in]  num_tokens    >= 0
 * \param[in]  num_experts   >= 1
 */
moe_status_t moe_tokens_per_expert_fwd(int64_t *counts, const uint8_t *routing_map,
                                       const uint8_t *padding_mask, int64_t num_tokens,
                                       int64_t num_experts, void *workspace,
                                       size_t workspace_bytes, void *stream);

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

/**
 * Workspace bytes of moe_sinkhorn_fwd (topk = 0) and moe_sinkhorn_routing_fwd (its topk): the
 * [num_tokens, num_experts] balanced matrix and the scalings in fp64, plus one top-k list per
 * OpenMP thread for routing.
 */
size_t moe_sinkhorn_workspace_size(int64_t num_tokens, int64_t num_experts, int64_t topk);

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

/** Workspace bytes of moe_sinkhorn_routing_fwd (on the CPU: moe_sinkhorn_workspace_size's). */
size_t moe_sinkhorn_routing_workspace_size(int64_t num_tokens, int64_t num_experts, int64_t topk,
                                           int training);

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

/** Workspace bytes of moe_routing_metrics_fwd: one fp64 word per token. */
size_t moe_routing_metrics_workspace_size(int64_t num_tokens, int64_t num_experts);

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

/** Workspace bytes of moe_topk_overlap_fwd: 0 on the CPU. */
size_t moe_topk_overlap_workspace_size(int64_t num_tokens, int64_t topk);

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

/* ---------------------------------------------------------------------------------------------
 * grouped_gemm: the experts' GEMMs, one per expert, over contiguous row ranges of one buffer
 *
 * Rows of x (tokens already permuted so that each expert's rows are contiguous) are split by
 * expert_offsets: expert e owns rows [expert_offsets[e], expert_offsets[e + 1]). With K the
 * in_features and N the out_features of every expert:
 *
 *   trans_w = 0   weight [E, K, N]   fwd   y_e  = x_e · W_e        dgrad  dx_e = dy_e · W_eᵀ
 *                                    wgrad dW_e = x_eᵀ · dy_e    ([K, N])
 *   trans_w = 1   weight [E, N, K]   fwd   y_e  = x_e · W_eᵀ       dgrad  dx_e = dy_e · W_e
 *                 (nn.Linear layout: Megatron's SequentialMLP / TEGroupedMLP weights stacked)
 *                                    wgrad dW_e = dy_eᵀ · x_e    ([N, K])
 *
 * x is [num_rows, K], y and dy are [num_rows, N], dx is [num_rows, K]; all row-major, contiguous.
 * An expert with no rows writes nothing in fwd/dgrad and writes dW_e = 0 in wgrad.
 *
 * expert_offsets: int64, num_experts + 1 entries, offsets[0] = 0, non-decreasing, last <=
 * num_rows. Rows past the last offset belong to no expert (a buffer sized by a static bound, as
 * permute's with token dropping): fwd/dgrad write zeros there, wgrad ignores them. It is read where the kernel runs: host memory for moe_*, device memory for the CUDA
 * entry points (which never copy it to the host). The CPU entry points validate it; a CUDA
 * implementation cannot without a sync, so there it is the caller's contract.
 *
 * Precision: both operands have one dtype (fp32, fp16, bf16, or fp64); elements are widened
 * exactly to fp32 (fp64 for fp64 operands), products are summed in an fp32 (fp64) accumulator,
 * and each output element is rounded once to out_dtype (any float type). No atomics: every
 * output element has one writer and a fixed summation order, so results are bitwise
 * reproducible run to run. On the CPU that order is one running sum in ascending order along
 * the reduction, whatever the blocking and the thread count; the kernel (AVX-512 fused
 * multiply-add, or portable) is picked by the CPU's features, so bits may differ between
 * machines, never between runs. bf16 on a CPU with AVX512_BF16 uses its pair dot product: the
 * same sums in the same order, bit for bit, except that bf16 subnormal inputs (|x| < 2^-126)
 * and fp32 subnormal partial sums are flushed to zero.
 * ------------------------------------------------------------------------------------------- */

/** Sizes and options shared by the three grouped GEMM products. */
typedef struct moe_grouped_gemm_params {
    int64_t num_rows;      /**< rows of x, y, dy, dx (all experts together), >= 0 */
    int64_t num_experts;   /**< E: groups, >= 1; expert_offsets has E + 1 entries */
    int64_t in_features;   /**< K: columns of x and dx, >= 0 */
    int64_t out_features;  /**< N: columns of y and dy, >= 0 */
    int trans_w;           /**< 0: weight is [E, K, N]; 1: weight is [E, N, K] (nn.Linear) */
    moe_dtype_t dtype;     /**< element type of both operands: fp32, fp16, bf16 or fp64 */
    moe_dtype_t out_dtype; /**< element type of the output: fp32, fp16, bf16 or fp64 */
} moe_grouped_gemm_params_t;

/**
 * Workspace bytes moe_grouped_gemm_fwd / _dgrad / _wgrad need on the CPU: fp32 packing buffers
 * of a fixed size for each OpenMP thread (so it depends on the calling process's thread count).
 */
size_t moe_grouped_gemm_workspace_size(const moe_grouped_gemm_params_t *params);

/**
 * Forward: y_e = x_e · W_e (trans_w = 0) or x_e · W_eᵀ (trans_w = 1), for every expert e.
 * \param[out] y               [num_rows, N], `params->out_dtype`
 * \param[in]  x               [num_rows, K], `params->dtype`
 * \param[in]  weight          [E, K, N] (trans_w = 0) or [E, N, K] (trans_w = 1), `params->dtype`
 * \param[in]  expert_offsets  [E + 1], int64, as described above
 * \param[in]  params          sizes, layout and dtypes
 * \param[in]  workspace       moe_grouped_gemm_workspace_size(params) bytes
 * \param[in]  workspace_bytes its size
 * \param[in]  stream          CUDA stream for moe_cuda_*, ignored on the CPU (NULL)
 */
moe_status_t moe_grouped_gemm_fwd(void *y, const void *x, const void *weight,
                                  const int64_t *expert_offsets,
                                  const moe_grouped_gemm_params_t *params, void *workspace,
                                  size_t workspace_bytes, void *stream);

/**
 * Gradient of x: dx_e = dy_e · W_eᵀ (trans_w = 0) or dy_e · W_e (trans_w = 1).
 * \param[out] grad_x          [num_rows, K], `params->out_dtype`
 * \param[in]  grad_y          [num_rows, N], `params->dtype`
 * \param[in]  weight          [E, K, N] (trans_w = 0) or [E, N, K] (trans_w = 1), `params->dtype`
 * (expert_offsets, params, workspace and stream as in the forward)
 */
moe_status_t moe_grouped_gemm_dgrad(void *grad_x, const void *grad_y, const void *weight,
                                    const int64_t *expert_offsets,
                                    const moe_grouped_gemm_params_t *params, void *workspace,
                                    size_t workspace_bytes, void *stream);

/**
 * Gradient of the weight: dW_e = x_eᵀ · dy_e (trans_w = 0, [K, N]) or dy_eᵀ · x_e (trans_w = 1,
 * [N, K]); zero for an expert with no rows. Parallel over (expert, output tile), never over rows:
 * each element is one thread's fixed-order sum.
 * \param[out] grad_weight     [E, K, N] (trans_w = 0) or [E, N, K] (trans_w = 1), `out_dtype`
 * \param[in]  x               [num_rows, K], `params->dtype`
 * \param[in]  grad_y          [num_rows, N], `params->dtype`
 * (expert_offsets, params, workspace and stream as in the forward)
 */
moe_status_t moe_grouped_gemm_wgrad(void *grad_weight, const void *x, const void *grad_y,
                                    const int64_t *expert_offsets,
                                    const moe_grouped_gemm_params_t *params, void *workspace,
                                    size_t workspace_bytes, void *stream);

/* ---------------------------------------------------------------------------------------------
 * glu_probs: the expert activation and the router probs in one pass over fc1's output
 *
 * Megatron's unfused expert activation (MLP.forward without bias_activation_fusion), followed by
 * the "probs after activation" multiply of the grouped MLP:
 *     GLU:      h = (act(clamp(a[:, :F])) * (clamp(a[:, F:]) + linear_offset) * p).to(dtype)
 *     no GLU:   h = (act(a) * p).to(dtype)
 * with every intermediate rounded where PyTorch's eager ops round it (see glu_probs_math.h, the
 * element functions both devices share). The CPU result equals torch's scalar CPU kernels bit for
 * bit; CUDA differs only where its expf/erff/tanhf differ from glibc's. No atomics; grad_probs is a
 * fixed-order fp64 row sum, the same order on both devices.
 * ------------------------------------------------------------------------------------------- */

/** Activation function (Megatron's activation_func). */
typedef enum moe_activation {
    MOE_ACT_SILU = 0,         /**< F.silu (SwiGLU with gated_linear_unit) */
    MOE_ACT_GELU = 1,         /**< F.gelu, exact erf form (GEGLU with gated_linear_unit) */
    MOE_ACT_GELU_TANH = 2,    /**< F.gelu(approximate="tanh") */
    MOE_ACT_RELU = 3,         /**< F.relu */
    MOE_ACT_SQUARED_RELU = 4, /**< torch.pow(F.relu(x), 2), Megatron's squared_relu */
    MOE_ACT_QUICK_GELU = 5    /**< x * torch.sigmoid(1.702 * x), eager (three rounded tensors) */
} moe_activation_t;

/** Options of glu_probs (Megatron's TransformerConfig fields of the same meaning). */
typedef struct moe_glu_probs_params {
    moe_activation_t activation; /**< activation_func */
    int gated_linear_unit;       /**< 1: a is [rows, 2F] = [gate | linear]; 0: a is [rows, F] */
    double linear_offset;        /**< glu_linear_offset (GLU only) */
    int has_clamp;               /**< 1: activation_func_clamp_value is set (GLU only) */
    double clamp_value;          /**< v: gate clamped to max=v, linear to [-v, v]; v >= 0 */
} moe_glu_probs_params_t;

/**
 * Forward.
 * \param[out] h            [num_rows, ffn], `dtype`
 * \param[in]  a            [num_rows, 2 ffn] (GLU) or [num_rows, ffn], `dtype` (any float type)
 * \param[in]  probs        [num_rows], `probs_dtype` (any float type), or NULL for no multiply
 * \param[in]  num_rows     >= 0
 * \param[in]  ffn          F, >= 1
 * \param[in]  dtype        element type of a and h
 * \param[in]  probs_dtype  element type of probs (ignored when probs is NULL)
 * \param[in]  params       activation and GLU options
 * \param[in]  workspace    unused (NULL); workspace_bytes 0; stream ignored on the CPU
 */
moe_status_t moe_glu_probs_fwd(void *h, const void *a, const void *probs, int64_t num_rows,
                               int64_t ffn, moe_dtype_t dtype, moe_dtype_t probs_dtype,
                               const moe_glu_probs_params_t *params, void *workspace,
                               size_t workspace_bytes, void *stream);

/**
 * Backward: grad_a (both halves with GLU) and grad_probs[r] = Σ_f grad_h[r, f] · h0[r, f], where h0
 * is the activation output before the probs multiply, each product rounded to
 * promote(dtype, probs_dtype) as autograd's MulBackward does, the sum in fp64 in the canonical
 * order of glu_probs_math.h, rounded to the product dtype and then to probs_dtype.
 * \param[out] grad_a       [num_rows, 2 ffn] or [num_rows, ffn], `dtype`
 * \param[out] grad_probs   [num_rows], `probs_dtype`, or NULL (not wanted; must be NULL when
 *                          probs is)
 * \param[out] h            [num_rows, ffn], `dtype`: the forward's output recomputed (the same
 *                          bits as moe_glu_probs_fwd), or NULL (not wanted)
 * \param[in]  grad_h       [num_rows, ffn], `dtype`
 * \param[in]  a, probs     the forward's inputs (probs may be NULL)
 * (sizes, dtypes, params, workspace and stream as in the forward)
 * In place is allowed: grad_a may be a, and h may be grad_h (every element is read before it is
 * written, by the thread that writes it); the two pairs are otherwise disjoint.
 */
moe_status_t moe_glu_probs_bwd(void *grad_a, void *grad_probs, void *h, const void *grad_h,
                               const void *a,
                               const void *probs, int64_t num_rows, int64_t ffn, moe_dtype_t dtype,
                               moe_dtype_t probs_dtype, const moe_glu_probs_params_t *params,
                               void *workspace, size_t workspace_bytes, void *stream);

/* ---------------------------------------------------------------------------------------------
 * grouped_gemm_glu_probs: fc1 of the experts with glu_probs fused into its epilogue
 *
 * a = grouped_gemm_fwd(x, weight) in dtype, then h = glu_probs(a, probs), as one op that returns
 * both (a is what the backward needs: glu_probs_bwd, then grouped_gemm_dgrad / _wgrad of grad_a).
 * With GLU, a's columns [0, F) are the gate half and [F, 2F) the linear half (Megatron's fc1
 * weight [E, 2F, H] with trans_w = 1), column j pairing with j + F. h and a equal that
 * composition's bits on every path: on the CPU it is the composition; on CUDA the Hopper kernel
 * rounds a exactly as the GEMM does and computes h from those values with glu_probs' element
 * functions, and other GPUs / shapes run the two kernels back to back. Rows past
 * expert_offsets[E]: a = 0, h = glu_probs of a zero row (as composed).
 * ------------------------------------------------------------------------------------------- */

/**
 * Forward.
 * \param[out] h               [num_rows, F], `gemm->dtype`
 * \param[out] a               [num_rows, out_features], `gemm->dtype`: fc1's output
 * \param[in]  x               [num_rows, in_features], `gemm->dtype`
 * \param[in]  weight          [E, out_features, in_features] (trans_w = 1) or [E, in_features,
 *                             out_features] (trans_w = 0), `gemm->dtype`
 * \param[in]  expert_offsets  [E + 1], int64, as for moe_grouped_gemm_fwd (host memory here,
 *                             device memory for the CUDA entry point)
 * \param[in]  probs           [num_rows], `probs_dtype`, or NULL for no multiply
 * \param[in]  probs_dtype     element type of probs (ignored when probs is NULL)
 * \param[in]  gemm            the GEMM's sizes and layout; out_dtype must equal dtype, and
 *                             out_features = 2F with gated_linear_unit (even), F without
 * \param[in]  glu             activation and GLU options, as for moe_glu_probs_fwd
 * \param[in]  workspace       moe_grouped_gemm_workspace_size(gemm) bytes on the CPU,
 *                             moe_cuda_grouped_gemm_workspace_size(gemm) on CUDA
 * \param[in]  workspace_bytes its size
 * \param[in]  stream          CUDA stream for moe_cuda_*, ignored on the CPU (NULL)
 */
moe_status_t moe_grouped_gemm_glu_probs_fwd(void *h, void *a, const void *x, const void *weight,
                                            const int64_t *expert_offsets, const void *probs,
                                            moe_dtype_t probs_dtype,
                                            const moe_grouped_gemm_params_t *gemm,
                                            const moe_glu_probs_params_t *glu, void *workspace,
                                            size_t workspace_bytes, void *stream);

/* ---------------------------------------------------------------------------------------------
 * CUDA entry points: same signatures and semantics as the CPU ones above, on device pointers,
 * asynchronous on `stream` (a cudaStream_t). Without CUDA they return MOE_ERR_UNSUPPORTED.
 * ------------------------------------------------------------------------------------------- */

size_t moe_cuda_router_topk_workspace_size(int64_t num_tokens, int64_t num_experts,
                                           const moe_router_topk_params_t *params);
moe_status_t moe_cuda_router_topk_fwd(void *topk_probs, int64_t *topk_indices, const void *logits,
                                      const float *expert_bias, int64_t num_tokens,
                                      int64_t num_experts, moe_dtype_t logits_dtype,
                                      const moe_router_topk_params_t *params, void *workspace,
                                      size_t workspace_bytes, void *stream);
moe_status_t moe_cuda_router_topk_bwd(void *grad_logits, const void *grad_probs,
                                      const void *logits, const int64_t *topk_indices,
                                      int64_t num_tokens, int64_t num_experts,
                                      moe_dtype_t logits_dtype,
                                      const moe_router_topk_params_t *params, void *workspace,
                                      size_t workspace_bytes, void *stream);
moe_status_t moe_cuda_router_topk_dense_bwd(void *grad_logits, const void *grad_probs,
                                            const void *logits, const int64_t *topk_indices,
                                            int64_t num_tokens, int64_t num_experts,
                                            moe_dtype_t logits_dtype,
                                            const moe_router_topk_params_t *params,
                                            void *workspace, size_t workspace_bytes, void *stream);
moe_status_t moe_cuda_topk_to_dense_fwd(void *probs, uint8_t *routing_map, const void *topk_probs,
                                        const int64_t *topk_indices, int64_t num_tokens,
                                        int64_t num_experts, int64_t topk, moe_dtype_t dtype,
                                        void *workspace, size_t workspace_bytes, void *stream);
moe_status_t moe_cuda_topk_to_dense_bwd(void *grad_topk_probs, const void *grad_probs,
                                        const int64_t *topk_indices, int64_t num_tokens,
                                        int64_t num_experts, int64_t topk, moe_dtype_t dtype,
                                        void *workspace, size_t workspace_bytes, void *stream);

/* ---- CUDA token layout (issue 6): permute, unpermute, chunk sorting, capacity, counts ---------
 * Same semantics as the CPU entry points, with these differences, all forced by "no host sync":
 * - Arguments that live in device memory (sorted_indices, expert_offsets, split_sizes,
 *   sorted_idxs) are not validated; out-of-range values are the caller's contract (the kernels
 *   skip an index outside [-1, num_tokens) / [0, num_chunks) rather than write out of bounds).
 *   Everything derived from the sizes alone (row bounds, element counts, workspace bytes) is
 *   checked on the host exactly as on the CPU, with the same messages.
 * - Integer outputs (indices, offsets, counts, maps) are bitwise the CPU's; so are permute's
 *   rows and probs, unpermute's output, permute_bwd's grads, unpermute_bwd's
 *   grad_permuted_tokens and token dropping's outputs. unpermute_bwd's grad_probs sums its
 *   hidden-length dot products in a fixed tree order (per thread, then warp, then block) instead
 *   of ascending h: deterministic run to run, not bitwise the CPU's.
 * - The workspaces differ from the CPU's: use the moe_cuda_*_workspace_size functions below. */

/** Workspace bytes of moe_cuda_permute_fwd: per-(chunk, expert) counts and ballots,
 *  O(T·E / 32). */
size_t moe_cuda_permute_workspace_size(int64_t num_tokens, int64_t num_experts,
                                       const moe_permute_params_t *params);
moe_status_t moe_cuda_permute_fwd(void *permuted_tokens, void *permuted_probs,
                                  int64_t *sorted_indices, int64_t *expert_offsets,
                                  int64_t *tokens_per_expert, const void *tokens,
                                  const uint8_t *routing_map, const void *probs,
                                  int64_t num_tokens, int64_t hidden, int64_t num_experts,
                                  moe_dtype_t dtype, moe_dtype_t probs_dtype,
                                  const moe_permute_params_t *params, void *workspace,
                                  size_t workspace_bytes, void *stream);
/** Workspace bytes of moe_cuda_permute_bwd / moe_cuda_unpermute_fwd / _bwd: the token → rows
 * map with each row's expert and one fp64 word per row, (2·num_tokens + 1 + 3·num_rows) int64. */
size_t moe_cuda_unpermute_workspace_size(int64_t num_tokens, int64_t num_rows);
moe_status_t moe_cuda_permute_bwd(void *grad_tokens, void *grad_probs,
                                  const void *grad_permuted_tokens,
                                  const void *grad_permuted_probs, const int64_t *sorted_indices,
                                  const int64_t *expert_offsets, int64_t num_tokens,
                                  int64_t hidden, int64_t num_experts, int64_t num_rows,
                                  moe_dtype_t dtype, moe_dtype_t probs_dtype, void *workspace,
                                  size_t workspace_bytes, void *stream);
moe_status_t moe_cuda_unpermute_fwd(void *output, const void *permuted_tokens,
                                    const int64_t *sorted_indices, const void *probs,
                                    const int64_t *expert_offsets, int64_t num_tokens,
                                    int64_t hidden, int64_t num_experts, int64_t num_rows,
                                    moe_dtype_t dtype, moe_dtype_t probs_dtype, void *workspace,
                                    size_t workspace_bytes, void *stream);
moe_status_t moe_cuda_unpermute_bwd(void *grad_permuted_tokens, void *grad_probs,
                                    const void *grad_output, const void *permuted_tokens,
                                    const int64_t *sorted_indices, const void *probs,
                                    const int64_t *expert_offsets, int64_t num_tokens,
                                    int64_t hidden, int64_t num_experts, int64_t num_rows,
                                    moe_dtype_t dtype, moe_dtype_t probs_dtype, void *workspace,
                                    size_t workspace_bytes, void *stream);
/** Workspace bytes of moe_cuda_sort_chunks_by_idxs_fwd / _bwd: 3·num_chunks + 2 int64. */
size_t moe_cuda_sort_chunks_by_idxs_workspace_size(int64_t num_chunks);
moe_status_t moe_cuda_sort_chunks_by_idxs_fwd(void *output, const void *input,
                                              const int64_t *split_sizes,
                                              const int64_t *sorted_idxs, int64_t num_rows,
                                              int64_t row_elems, int64_t num_chunks,
                                              moe_dtype_t dtype, void *workspace,
                                              size_t workspace_bytes, void *stream);
moe_status_t moe_cuda_sort_chunks_by_idxs_bwd(void *grad_input, const void *grad_output,
                                              const int64_t *split_sizes,
                                              const int64_t *sorted_idxs, int64_t num_rows,
                                              int64_t row_elems, int64_t num_chunks,
                                              moe_dtype_t dtype, void *workspace,
                                              size_t workspace_bytes, void *stream);
moe_status_t moe_cuda_tokens_per_expert_fwd(int64_t *counts, const uint8_t *routing_map,
                                            const uint8_t *padding_mask, int64_t num_tokens,
                                            int64_t num_experts, void *workspace,
                                            size_t workspace_bytes, void *stream);
/** Workspace bytes of moe_cuda_token_dropping_fwd: the columns' sort keys transposed to
 * [E, T] (4 bytes each, 8 for fp64 probs) and two int64 per column. */
size_t moe_cuda_token_dropping_workspace_size(int64_t num_tokens, int64_t num_experts,
                                              moe_drop_policy_t policy, moe_dtype_t dtype);
moe_status_t moe_cuda_token_dropping_fwd(void *final_probs, uint8_t *final_map,
                                         const void *routing_probs, const uint8_t *routing_map,
                                         int64_t num_tokens, int64_t num_experts,
                                         int64_t capacity, moe_drop_policy_t policy,
                                         int pad_to_capacity, moe_dtype_t dtype, void *workspace,
                                         size_t workspace_bytes, void *stream);
moe_status_t moe_cuda_token_dropping_bwd(void *grad_routing_probs, const void *grad_final_probs,
                                         const uint8_t *final_map, int64_t num_tokens,
                                         int64_t num_experts, moe_dtype_t dtype, void *workspace,
                                         size_t workspace_bytes, void *stream);
/* ---------------------------------------------------------------------------------------------
 * CUDA entry points of the load-balancing ops and the router's gating linear (issue 6). Same
 * arguments and semantics as the CPU functions above; losses and metrics are two-stage fixed-order
 * reductions (bitwise reproducible, no floating-point atomics), maps and counts equal the CPU's.
 * Where the CUDA scratch differs from the CPU's, a moe_cuda_*_workspace_size says how much to
 * pass (bytes; 0 means none is needed). Differences from the CPU entry points:
 *   - moe_cuda_z_loss_bwd needs moe_cuda_z_loss_workspace_size bytes (the padding count).
 *   - moe_cuda_topk_overlap_fwd does not range-check the ids (that needs the host); it takes
 *     moe_cuda_topk_overlap_workspace_size bytes.
 *   - moe_cuda_sinkhorn_*: the whole iteration loop runs in one single-block kernel on the device
 *     (no host sync, the convergence test evaluated there); see csrc/cuda/sinkhorn.cu.
 *   - moe_cuda_router_gating_linear_*: cuBLAS GEMMs accumulating in fp32 (fp64 for an fp64 router
 *     dtype) instead of the CPU's fp64 sums; the workspace holds cuBLAS's fixed scratch and any
 *     operand conversions (`backward` selects the size for _bwd). A cuBLAS handle per device is
 *     created on first use and cached for the life of the process.
 * ------------------------------------------------------------------------------------------- */

size_t moe_cuda_aux_loss_scores_workspace_size(int64_t num_tokens, int64_t num_experts,
                                               int64_t topk);
moe_status_t moe_cuda_aux_loss_scores_fwd(void *scores, uint8_t *routing_map, const void *logits,
                                          const uint8_t *padding_mask, int64_t num_tokens,
                                          int64_t num_experts, int64_t topk,
                                          moe_dtype_t logits_dtype,
                                          moe_score_function_t score_function, void *workspace,
                                          size_t workspace_bytes, void *stream);
moe_status_t moe_cuda_aux_loss_scores_bwd(void *grad_logits, const void *grad_scores,
                                          const void *logits, const uint8_t *padding_mask,
                                          int64_t num_tokens, int64_t num_experts,
                                          moe_dtype_t logits_dtype,
                                          moe_score_function_t score_function, void *workspace,
                                          size_t workspace_bytes, void *stream);
size_t moe_cuda_switch_aux_loss_workspace_size(int64_t num_tokens, int64_t num_columns);
moe_status_t moe_cuda_switch_aux_loss_fwd(void *loss, const void *probs,
                                          const float *tokens_per_expert,
                                          const double *total_num_tokens,
                                          const uint8_t *padding_mask, int64_t num_tokens,
                                          int64_t num_columns, moe_dtype_t probs_dtype,
                                          const moe_switch_aux_loss_params_t *params,
                                          void *workspace, size_t workspace_bytes, void *stream);
moe_status_t moe_cuda_switch_aux_loss_bwd(void *grad_probs, const void *grad_loss,
                                          const float *tokens_per_expert,
                                          const double *total_num_tokens,
                                          const uint8_t *padding_mask, int64_t num_tokens,
                                          int64_t num_columns, moe_dtype_t probs_dtype,
                                          const moe_switch_aux_loss_params_t *params,
                                          void *workspace, size_t workspace_bytes, void *stream);
size_t moe_cuda_z_loss_workspace_size(int64_t num_tokens, int64_t num_experts);
moe_status_t moe_cuda_z_loss_fwd(void *loss, const void *logits, const uint8_t *padding_mask,
                                 int64_t num_tokens, int64_t num_experts, double coeff,
                                 moe_dtype_t logits_dtype, void *workspace,
                                 size_t workspace_bytes, void *stream);
moe_status_t moe_cuda_z_loss_bwd(void *grad_logits, const void *grad_loss, const void *logits,
                                 const uint8_t *padding_mask, int64_t num_tokens,
                                 int64_t num_experts, double coeff, moe_dtype_t logits_dtype,
                                 void *workspace, size_t workspace_bytes, void *stream);
moe_status_t moe_cuda_expert_bias_update_fwd(float *updated_bias, const float *tokens_per_expert,
                                             const float *expert_bias, int64_t num_rows,
                                             int64_t num_experts, double update_rate,
                                             void *workspace, size_t workspace_bytes,
                                             void *stream);
size_t moe_cuda_sinkhorn_workspace_size(int64_t num_tokens, int64_t num_experts, int64_t topk);
size_t moe_cuda_sinkhorn_routing_workspace_size(int64_t num_tokens, int64_t num_experts,
                                                int64_t topk, int training);
moe_status_t moe_cuda_sinkhorn_fwd(void *out, const void *cost, int64_t num_tokens,
                                   int64_t num_experts, moe_dtype_t cost_dtype, double tol,
                                   int64_t max_iters, void *workspace, size_t workspace_bytes,
                                   void *stream);
moe_status_t moe_cuda_sinkhorn_routing_fwd(void *probs, uint8_t *routing_map, const void *logits,
                                           int64_t num_tokens, int64_t num_experts, int64_t topk,
                                           moe_dtype_t logits_dtype, int training, double tol,
                                           void *workspace, size_t workspace_bytes, void *stream);
moe_status_t moe_cuda_sinkhorn_routing_bwd(void *grad_logits, const void *grad_probs,
                                           const void *logits, const uint8_t *routing_map,
                                           int64_t num_tokens, int64_t num_experts, int64_t topk,
                                           moe_dtype_t logits_dtype, void *workspace,
                                           size_t workspace_bytes, void *stream);
size_t moe_cuda_routing_metrics_workspace_size(int64_t num_tokens, int64_t num_experts);
moe_status_t moe_cuda_routing_metrics_fwd(int64_t *tokens_per_expert, float *stats,
                                          const uint8_t *routing_map, const void *scores,
                                          const uint8_t *padding_mask, int64_t num_tokens,
                                          int64_t num_experts, moe_dtype_t scores_dtype,
                                          void *workspace, size_t workspace_bytes, void *stream);
size_t moe_cuda_topk_overlap_workspace_size(int64_t num_tokens, int64_t topk);
moe_status_t moe_cuda_topk_overlap_fwd(float *overlap, const int64_t *indices_a,
                                       const int64_t *indices_b, const uint8_t *padding_mask,
                                       int64_t num_tokens, int64_t topk, int64_t num_experts,
                                       void *workspace, size_t workspace_bytes, void *stream);
size_t moe_cuda_router_gating_linear_workspace_size(int64_t num_tokens, int64_t hidden,
                                                    int64_t num_experts, moe_dtype_t inp_dtype,
                                                    moe_dtype_t weight_dtype,
                                                    moe_dtype_t router_dtype, int backward);
moe_status_t moe_cuda_router_gating_linear_fwd(void *logits, const void *inp, const void *weight,
                                               const void *bias, int64_t num_tokens,
                                               int64_t hidden, int64_t num_experts,
                                               moe_dtype_t inp_dtype, moe_dtype_t weight_dtype,
                                               moe_dtype_t router_dtype, void *workspace,
                                               size_t workspace_bytes, void *stream);
moe_status_t moe_cuda_router_gating_linear_bwd(void *grad_inp, void *grad_weight, void *grad_bias,
                                               const void *grad_logits, const void *inp,
                                               const void *weight, int64_t num_tokens,
                                               int64_t hidden, int64_t num_experts,
                                               moe_dtype_t inp_dtype, moe_dtype_t weight_dtype,
                                               moe_dtype_t router_dtype, void *workspace,
                                               size_t workspace_bytes, void *stream);
/* glu_probs (issue 7, item 3: the activation epilogue) */
moe_status_t moe_cuda_glu_probs_fwd(void *h, const void *a, const void *probs, int64_t num_rows,
                                    int64_t ffn, moe_dtype_t dtype, moe_dtype_t probs_dtype,
                                    const moe_glu_probs_params_t *params, void *workspace,
                                    size_t workspace_bytes, void *stream);
moe_status_t moe_cuda_glu_probs_bwd(void *grad_a, void *grad_probs, void *h, const void *grad_h,
                                    const void *a, const void *probs, int64_t num_rows,
                                    int64_t ffn, moe_dtype_t dtype, moe_dtype_t probs_dtype,
                                    const moe_glu_probs_params_t *params, void *workspace,
                                    size_t workspace_bytes, void *stream);
/* ---- CUDA grouped GEMM (issue 7) ------------------------------------------------------------
 * Same arguments and semantics as moe_grouped_gemm_fwd / _dgrad / _wgrad, except that
 * expert_offsets lives in device memory and is not validated (that would need a host sync): it
 * is the caller's contract. Operands bf16/fp16 take the tensor cores (wgmma on sm_90a, else
 * mma.sync), fp32/fp64 a SIMT kernel; fp32 accumulation (fp64 for fp64), one rounding per output
 * element, no floating-point atomics, bitwise reproducible on one GPU and build.
 * The workspace is a few hundred bytes, except for bf16/fp16 on Hopper: there wgrad builds two
 * tensor maps per expert in it (256 * E + 128 bytes), and when fwd or dgrad reduces over 64 or
 * more blocks of 64 (K or N > 4032) it holds the partial sums of a split last wave of tiles,
 * 128 KB per SM (about 17 MB on an H200); see grouped_gemm_sm90.cu. */
size_t moe_cuda_grouped_gemm_workspace_size(const moe_grouped_gemm_params_t *params);
moe_status_t moe_cuda_grouped_gemm_fwd(void *y, const void *x, const void *weight,
                                       const int64_t *expert_offsets,
                                       const moe_grouped_gemm_params_t *params, void *workspace,
                                       size_t workspace_bytes, void *stream);
moe_status_t moe_cuda_grouped_gemm_dgrad(void *grad_x, const void *grad_y, const void *weight,
                                         const int64_t *expert_offsets,
                                         const moe_grouped_gemm_params_t *params,
                                         void *workspace, size_t workspace_bytes, void *stream);
moe_status_t moe_cuda_grouped_gemm_wgrad(void *grad_weight, const void *x, const void *grad_y,
                                         const int64_t *expert_offsets,
                                         const moe_grouped_gemm_params_t *params,
                                         void *workspace, size_t workspace_bytes, void *stream);
moe_status_t moe_cuda_grouped_gemm_glu_probs_fwd(void *h, void *a, const void *x,
                                                 const void *weight, const int64_t *expert_offsets,
                                                 const void *probs, moe_dtype_t probs_dtype,
                                                 const moe_grouped_gemm_params_t *gemm,
                                                 const moe_glu_probs_params_t *glu,
                                                 void *workspace, size_t workspace_bytes,
                                                 void *stream);
/* ---- CUDA: the fused router's extras (issue 6: aux scores, aux map and lse in the router's
 * pass). The fp32/bf16/fp16 warp kernel (rows up to 1024 experts) computes them from the values
 * already in registers; the fp64 and wide-row paths run a second, thread-per-token kernel over
 * the logits for them (moe_router_aux_row / moe_router_row_lse). */
size_t moe_cuda_router_topk_fused_workspace_size(int64_t num_tokens, int64_t num_experts,
                                                 const moe_router_topk_params_t *params,
                                                 moe_dtype_t logits_dtype, int with_aux);
moe_status_t moe_cuda_router_topk_fused_fwd(void *probs, uint8_t *routing_map,
                                            int64_t *topk_indices,
                                            const moe_router_topk_extras_t *extras,
                                            const void *logits, const float *expert_bias,
                                            int64_t num_tokens, int64_t num_experts,
                                            moe_dtype_t logits_dtype,
                                            const moe_router_topk_params_t *params,
                                            void *workspace, size_t workspace_bytes, void *stream);
moe_status_t moe_cuda_router_lse_bwd(void *grad_logits, const double *grad_lse,
                                     const void *logits, const double *lse,
                                     const uint8_t *padding_mask, int64_t num_tokens,
                                     int64_t num_experts, moe_dtype_t logits_dtype,
                                     void *workspace, size_t workspace_bytes, void *stream);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* MOE_CORE_H_ */
