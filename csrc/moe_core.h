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
 * `cudaStream_t` passed as `void *`, and exist only in a build with CUDA (MOE_CORE_WITH_CUDA).
 * Both have the same signature and the same semantics, bit for bit where the op says so.
 *
 * The core never allocates, never creates streams or handles, never synchronises with the host
 * and never exits. On failure a function returns a status other than MOE_OK and leaves a message
 * naming the argument and its bad value in a thread-local buffer, read with moe_last_error().
 * Sizes and indices are int64 throughout.
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
 * score is the sum of its top (topk / group_topk) selection scores; the group_topk best groups are
 * kept and the top-k is taken among their experts only.
 *
 * Precision: score math in fp32 for fp32/fp16/bf16 logits (as Megatron) and in fp64 for fp64
 * logits (Megatron downcasts those to fp32; keeping fp64 is a documented, deliberate difference).
 *
 * Ordering and ties: the k entries of a row are sorted by descending selection score; equal
 * scores are broken by the lowest expert index (groups: the lowest group index). NaN compares
 * greater than every number, as in torch.topk, so a NaN logit is selected and its row's probs
 * are NaN: bad values propagate rather than being hidden.
 * ------------------------------------------------------------------------------------------- */

/** Options of router_topk (a struct: more than a handful of scalars). */
typedef struct moe_router_topk_params {
    int64_t topk;                        /**< experts per token, 1 <= topk <= num_experts */
    int64_t num_groups;                  /**< 0 (no groups) or a divisor of num_experts */
    int64_t group_topk;                  /**< groups kept per token, 1..num_groups (0 iff no groups) */
    int use_pre_softmax;                 /**< softmax only: score before top-k, no renormalising */
    moe_score_function_t score_function; /**< softmax, sigmoid or sqrtsoftplus */
    double scaling_factor;               /**< multiplies the probs; 0 means off (as Megatron) */
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
 * \param[in]  expert_bias   [num_experts], fp32, or NULL; sigmoid/sqrtsoftplus only
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

/* ---------------------------------------------------------------------------------------------
 * topk_to_dense: compact [T, topk] routing → Megatron's [T, E] probs and boolean routing map
 * ------------------------------------------------------------------------------------------- */

/**
 * Forward: probs[t, e] = topk_probs[t, j] where topk_indices[t, j] == e, else 0;
 * routing_map[t, e] = 1 exactly there. Indices must be distinct within a row and in [0, E).
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
 * expert_offsets: int64, num_experts + 1 entries, offsets[0] = 0, non-decreasing, last =
 * num_rows. It is read where the kernel runs: host memory for moe_*, device memory for the CUDA
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
 * CUDA entry points: same signatures and semantics as the CPU ones above, on device pointers,
 * asynchronous on `stream` (a cudaStream_t). Declared always, defined only with CUDA.
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
moe_status_t moe_cuda_topk_to_dense_fwd(void *probs, uint8_t *routing_map, const void *topk_probs,
                                        const int64_t *topk_indices, int64_t num_tokens,
                                        int64_t num_experts, int64_t topk, moe_dtype_t dtype,
                                        void *workspace, size_t workspace_bytes, void *stream);
moe_status_t moe_cuda_topk_to_dense_bwd(void *grad_topk_probs, const void *grad_probs,
                                        const int64_t *topk_indices, int64_t num_tokens,
                                        int64_t num_experts, int64_t topk, moe_dtype_t dtype,
                                        void *workspace, size_t workspace_bytes, void *stream);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* MOE_CORE_H_ */
