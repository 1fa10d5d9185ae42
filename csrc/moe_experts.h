/*
 * moe_experts.h: the expert ops. The grouped GEMM (every expert's GEMM over its contiguous rows
 * of one buffer: forward, dgrad, wgrad), the expert activation multiplied by the router probs
 * (glu_probs), and fc1 followed by that activation as one op (grouped_gemm_glu_probs).
 *
 * Each op's CPU entry point (moe_*) is followed by its CUDA twin (moe_cuda_*): the same
 * arguments and semantics on device pointers, asynchronous on `stream`; where they differ, the
 * CUDA declaration says how. Every op with scratch has a workspace-size function on both devices;
 * the others take no workspace (NULL, 0).
 */
#ifndef MOE_EXPERTS_H_
#define MOE_EXPERTS_H_

#include "moe_types.h"

#ifdef __cplusplus
extern "C" {
#endif

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
 * permute's with token dropping): fwd/dgrad write zeros there, wgrad ignores them. It is read
 * where the kernel runs: host memory for moe_*, device memory for the CUDA entry points (which
 * never copy it to the host). The CPU entry points validate it; a CUDA implementation cannot
 * without a sync, so there it is the caller's contract.
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
 *
 * On CUDA, bf16/fp16 operands take the tensor cores (wgmma on sm_90a, else mma.sync), fp32/fp64
 * a SIMT kernel; fp32 accumulation (fp64 for fp64), one rounding per output element, no
 * floating-point atomics, bitwise reproducible on one GPU and build.
 * ------------------------------------------------------------------------------------------- */

/**
 * Which operand the GEMM reads through an index instead of as contiguous rows (the "gathered
 * operand"): the result is exactly that of materialising rows = src[gather_index] (-1 a zero row)
 * and running the op on them, bit for bit, without the [num_rows, cols] copy. Allowed:
 * moe_grouped_gemm_fwd and moe_grouped_gemm_glu_probs_fwd: X; dgrad: DY; wgrad: X or DY.
 * Zero-initialised params (NONE) are the plain op.
 *
 * Index values: the CPU entry points reject one outside [-1, gather_rows). The CUDA entry points
 * cannot read them without a host sync, so there they are the caller's contract, as for permute's
 * sorted_indices: a value outside [0, gather_rows) reads a zero row (never out of bounds).
 */
typedef enum moe_gg_gather {
    MOE_GG_GATHER_NONE = 0, /**< every operand is contiguous rows (the plain op) */
    MOE_GG_GATHER_X = 1,    /**< x (fwd, glu_probs_fwd, wgrad) */
    MOE_GG_GATHER_DY = 2    /**< grad_y (dgrad, wgrad) */
} moe_gg_gather_t;

/** Sizes and options shared by the three grouped GEMM products. */
typedef struct moe_grouped_gemm_params {
    int64_t num_rows;      /**< rows of x, y, dy, dx (all experts together), >= 0 */
    int64_t num_experts;   /**< E: groups, >= 1; expert_offsets has E + 1 entries */
    int64_t in_features;   /**< K: columns of x and dx, >= 0 */
    int64_t out_features;  /**< N: columns of y and dy, >= 0 */
    int trans_w;           /**< 0: weight is [E, K, N]; 1: weight is [E, N, K] (nn.Linear) */
    moe_dtype_t dtype;     /**< element type of both operands: fp32, fp16, bf16 or fp64 */
    moe_dtype_t out_dtype; /**< element type of the output: fp32, fp16, bf16 or fp64 */
    /** The gathered operand (gather_operand != MOE_GG_GATHER_NONE): row r (0 <= r < num_rows) of
     *  that operand is row gather_index[r] of the tensor passed for it, which has gather_rows rows
     *  (same columns, contiguous); an index of -1 is a zero row. gather_index: [num_rows] int64, host
     *  memory on the CPU, device memory for moe_cuda_* . */
    int gather_operand;            /* moe_gg_gather_t */
    const int64_t *gather_index;
    int64_t gather_rows;
} moe_grouped_gemm_params_t;

/**
 * Workspace bytes of moe_grouped_gemm_fwd / _dgrad / _wgrad (and of fc1 in
 * moe_grouped_gemm_glu_probs_fwd). CPU: fp32 packing buffers of a fixed size for each OpenMP
 * thread (so it depends on the calling process's thread count).
 */
size_t moe_grouped_gemm_workspace_size(const moe_grouped_gemm_params_t *params);

/**
 * CUDA: a few hundred bytes, except for bf16/fp16 on Hopper: there wgrad builds two tensor maps
 * per expert in it (256 * E + 128 bytes), and when fwd or dgrad reduces over 64 or more blocks of
 * 64 (K or N > 4032) it holds the partial sums of a split last wave of tiles, 128 KB per SM
 * (about 17 MB on an H200); see csrc/cuda/grouped_gemm_sm90.cu. A gathered call gets no room
 * for a copy of its rows on Hopper, where the kernels read them by index: there its operands and
 * output must be 16-byte aligned (the tensor maps' bases), else the call is refused with an
 * error, its fallback having no workspace to copy the rows into.
 */
size_t moe_cuda_grouped_gemm_workspace_size(const moe_grouped_gemm_params_t *params);

/**
 * Forward: y_e = x_e · W_e (trans_w = 0) or x_e · W_eᵀ (trans_w = 1), for every expert e.
 * \param[out] y               [num_rows, N], `params->out_dtype`
 * \param[in]  x               [num_rows, K], `params->dtype`; [gather_rows, K] when gathered
 *                             (gather_operand = MOE_GG_GATHER_X)
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

/** CUDA: expert_offsets in device memory, not validated (see above). */
moe_status_t moe_cuda_grouped_gemm_fwd(void *y, const void *x, const void *weight,
                                       const int64_t *expert_offsets,
                                       const moe_grouped_gemm_params_t *params, void *workspace,
                                       size_t workspace_bytes, void *stream);

/**
 * Gradient of x: dx_e = dy_e · W_eᵀ (trans_w = 0) or dy_e · W_e (trans_w = 1).
 * \param[out] grad_x          [num_rows, K], `params->out_dtype`
 * \param[in]  grad_y          [num_rows, N], `params->dtype`; [gather_rows, N] when gathered
 *                             (gather_operand = MOE_GG_GATHER_DY)
 * \param[in]  weight          [E, K, N] (trans_w = 0) or [E, N, K] (trans_w = 1), `params->dtype`
 * (expert_offsets, params, workspace and stream as in the forward)
 */
moe_status_t moe_grouped_gemm_dgrad(void *grad_x, const void *grad_y, const void *weight,
                                    const int64_t *expert_offsets,
                                    const moe_grouped_gemm_params_t *params, void *workspace,
                                    size_t workspace_bytes, void *stream);

/** CUDA: as moe_cuda_grouped_gemm_fwd. */
moe_status_t moe_cuda_grouped_gemm_dgrad(void *grad_x, const void *grad_y, const void *weight,
                                         const int64_t *expert_offsets,
                                         const moe_grouped_gemm_params_t *params,
                                         void *workspace, size_t workspace_bytes, void *stream);

/**
 * Gradient of the weight: dW_e = x_eᵀ · dy_e (trans_w = 0, [K, N]) or dy_eᵀ · x_e (trans_w = 1,
 * [N, K]); zero for an expert with no rows. Parallel over (expert, output tile), never over rows:
 * each element is one thread's fixed-order sum.
 * \param[out] grad_weight     [E, K, N] (trans_w = 0) or [E, N, K] (trans_w = 1), `out_dtype`
 * \param[in]  x               [num_rows, K], `params->dtype` ([gather_rows, K] when gathered)
 * \param[in]  grad_y          [num_rows, N], `params->dtype` ([gather_rows, N] when gathered)
 * (expert_offsets, params, workspace and stream as in the forward)
 */
moe_status_t moe_grouped_gemm_wgrad(void *grad_weight, const void *x, const void *grad_y,
                                    const int64_t *expert_offsets,
                                    const moe_grouped_gemm_params_t *params, void *workspace,
                                    size_t workspace_bytes, void *stream);

/** CUDA: as moe_cuda_grouped_gemm_fwd. */
moe_status_t moe_cuda_grouped_gemm_wgrad(void *grad_weight, const void *x, const void *grad_y,
                                         const int64_t *expert_offsets,
                                         const moe_grouped_gemm_params_t *params,
                                         void *workspace, size_t workspace_bytes, void *stream);

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

/**
 * Activation functions (Megatron's activation_func), an option table as in moe_types.h:
 *   silu:         F.silu (SwiGLU with gated_linear_unit)
 *   gelu:         F.gelu, exact erf form (GEGLU with gated_linear_unit)
 *   gelu_tanh:    F.gelu(approximate="tanh")
 *   relu:         F.relu
 *   squared_relu: torch.pow(F.relu(x), 2), Megatron's squared_relu
 *   quick_gelu:   x * torch.sigmoid(1.702 * x), eager (three rounded tensors)
 */
#define MOE_ACTIVATIONS(X)                     \
    X(MOE_ACT_SILU, 0, "silu")                 \
    X(MOE_ACT_GELU, 1, "gelu")                 \
    X(MOE_ACT_GELU_TANH, 2, "gelu_tanh")       \
    X(MOE_ACT_RELU, 3, "relu")                 \
    X(MOE_ACT_SQUARED_RELU, 4, "squared_relu") \
    X(MOE_ACT_QUICK_GELU, 5, "quick_gelu")

/** Activation function, one of MOE_ACTIVATIONS. */
typedef enum moe_activation { MOE_ACTIVATIONS(MOE_ENUMERATOR) } moe_activation_t;

/** Options of glu_probs (Megatron's TransformerConfig fields of the same meaning). */
typedef struct moe_glu_probs_params {
    moe_activation_t activation; /**< activation_func */
    int gated_linear_unit;       /**< 1: a is [rows, 2F] = [gate | linear]; 0: a is [rows, F] */
    double linear_offset;        /**< glu_linear_offset (GLU only) */
    int has_clamp;               /**< 1: activation_func_clamp_value is set (GLU only) */
    double clamp_value;          /**< v: gate clamped to max=v, linear to [-v, v]; v >= 0 */
    int64_t interleave;          /**< GLU only: 0: a's row is [gate F | linear F]; s > 0 (a
                                      divisor of F): blocks of s gate and s linear columns
                                      alternate (Megatron's glu interleave size), h's column f
                                      pairing a's (f / s)·2s + f % s with the s after it */
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
 * CUDA: 16-byte vector accesses; the element math is glu_probs_math.h's, as on the CPU. No
 * workspace.
 */
moe_status_t moe_cuda_glu_probs_fwd(void *h, const void *a, const void *probs, int64_t num_rows,
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

/** CUDA: a warp per row; grad_probs is the CPU's bits (the same summation order). */
moe_status_t moe_cuda_glu_probs_bwd(void *grad_a, void *grad_probs, void *h, const void *grad_h,
                                    const void *a, const void *probs, int64_t num_rows,
                                    int64_t ffn, moe_dtype_t dtype, moe_dtype_t probs_dtype,
                                    const moe_glu_probs_params_t *params, void *workspace,
                                    size_t workspace_bytes, void *stream);

/* ---------------------------------------------------------------------------------------------
 * grouped_gemm_glu_probs: fc1 of the experts followed by glu_probs, as one op
 *
 * a = grouped_gemm_fwd(x, weight) in dtype, then h = glu_probs(a, probs), as one op that returns
 * both (a is what the backward needs: glu_probs_bwd, then grouped_gemm_dgrad / _wgrad of grad_a).
 * With GLU, a's columns [0, F) are the gate half and [F, 2F) the linear half (Megatron's fc1
 * weight [E, 2F, H] with trans_w = 1), column j pairing with j + F; or, with glu->interleave s,
 * alternating blocks of s gate and s linear columns (fc1's rows stored that way). h and a equal that
 * composition's bits on every path: it is the composition, on the CPU and on CUDA (the grouped
 * GEMM and the glu_probs kernel back to back on the stream: glu_probs' element math in fc1's
 * epilogue would hold up the tensor cores, where its own pass spreads over every SM). Rows past
 * expert_offsets[E]: a = 0, h = glu_probs of a zero row (as composed).
 * ------------------------------------------------------------------------------------------- */

/**
 * Forward.
 * \param[out] h               [num_rows, F], `gemm->dtype`
 * \param[out] a               [num_rows, out_features], `gemm->dtype`: fc1's output
 * \param[in]  x               [num_rows, in_features], `gemm->dtype`; [gather_rows, in_features]
 *                             when gathered (gemm->gather_operand = MOE_GG_GATHER_X, fc1's x)
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

/**
 * CUDA: the composition's bits, whichever path runs (see csrc/cuda/grouped_gemm.cu); expert_offsets
 * in device memory, not validated. Workspace: moe_cuda_grouped_gemm_workspace_size(gemm) bytes.
 */
moe_status_t moe_cuda_grouped_gemm_glu_probs_fwd(void *h, void *a, const void *x,
                                                 const void *weight, const int64_t *expert_offsets,
                                                 const void *probs, moe_dtype_t probs_dtype,
                                                 const moe_grouped_gemm_params_t *gemm,
                                                 const moe_glu_probs_params_t *glu,
                                                 void *workspace, size_t workspace_bytes,
                                                 void *stream);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* MOE_EXPERTS_H_ */
