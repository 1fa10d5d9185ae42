/*
 * moe_layout.h: the token layout ops. Compact [T, topk] routing to Megatron's dense [T, E] form,
 * expert capacity (token dropping), permute (tokens → rows grouped by expert) and unpermute (the
 * combine, rows → tokens), chunk sorting for expert parallelism, and tokens per expert.
 *
 * Each op's CPU entry point (moe_*) is followed by its CUDA twin (moe_cuda_*): the same
 * arguments and semantics on device pointers, asynchronous on `stream`; the differences are
 * listed below the layout description. Every op with scratch has a workspace-size function on
 * both devices (0: none needed); the others take no workspace (NULL, 0).
 */
#ifndef MOE_LAYOUT_H_
#define MOE_LAYOUT_H_

#include "moe_types.h"

#ifdef __cplusplus
extern "C" {
#endif

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

/** CUDA: the ids are not checked (see above). No workspace. */
moe_status_t moe_cuda_topk_to_dense_fwd(void *probs, uint8_t *routing_map, const void *topk_probs,
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

/** CUDA: a gather on the device; the ids are not checked. No workspace. */
moe_status_t moe_cuda_topk_to_dense_bwd(void *grad_topk_probs, const void *grad_probs,
                                        const int64_t *topk_indices, int64_t num_tokens,
                                        int64_t num_experts, int64_t topk, moe_dtype_t dtype,
                                        void *workspace, size_t workspace_bytes, void *stream);

/* ---------------------------------------------------------------------------------------------
 * Token layout: capacity dropping, permute / unpermute, chunk sorting, tokens per expert
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
 *
 * On CUDA the semantics are the same, with these differences, all forced by "no host sync":
 * - Arguments that live in device memory (sorted_indices, expert_offsets, split_sizes,
 *   sorted_idxs) are not validated; out-of-range values are the caller's contract (the kernels
 *   skip an index outside [-1, num_tokens) / [0, num_chunks) rather than write out of bounds).
 *   Everything derived from the sizes alone (row bounds, element counts, workspace bytes) is
 *   checked on the host exactly as on the CPU, with the same messages.
 * - Integer outputs (indices, offsets, counts, maps) are bitwise the CPU's; so are permute's
 *   rows and probs, unpermute's output, permute_bwd's grads, permute_bwd_accumulate's acc,
 *   unpermute_bwd's grad_permuted_tokens and token dropping's outputs. unpermute_bwd's grad_probs
 *   sums its hidden-length dot products in a fixed tree order (per thread, then warp, then block)
 *   instead of ascending h: deterministic run to run, not bitwise the CPU's.
 * - The workspaces differ: each op's moe_cuda_*_workspace_size says how much to pass.
 * ------------------------------------------------------------------------------------------- */

/** Capacity drop policy (Megatron's moe_token_drop_policy). */
typedef enum moe_drop_policy {
    MOE_DROP_PROBS = 0,   /**< keep the `capacity` highest probs of each expert */
    MOE_DROP_POSITION = 1 /**< keep the first `capacity` routed tokens of each expert */
} moe_drop_policy_t;

/**
 * Workspace bytes of moe_token_dropping_fwd. CPU: for the probs policy, T sort keys and 2·T
 * indices for each OpenMP thread (depends on the calling process's thread count); 0 otherwise.
 */
size_t moe_token_dropping_workspace_size(int64_t num_tokens, int64_t num_experts,
                                         moe_drop_policy_t policy, moe_dtype_t dtype);

/**
 * CUDA: the columns' sort keys transposed to [E, T] (4 bytes each, 8 for fp64 probs) and two
 * int64 per column.
 */
size_t moe_cuda_token_dropping_workspace_size(int64_t num_tokens, int64_t num_experts,
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

/** CUDA: bitwise the CPU's outputs. */
moe_status_t moe_cuda_token_dropping_fwd(void *final_probs, uint8_t *final_map,
                                         const void *routing_probs, const uint8_t *routing_map,
                                         int64_t num_tokens, int64_t num_experts,
                                         int64_t capacity, moe_drop_policy_t policy,
                                         int pad_to_capacity, moe_dtype_t dtype, void *workspace,
                                         size_t workspace_bytes, void *stream);

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

/** CUDA: as the CPU entry point. No workspace. */
moe_status_t moe_cuda_token_dropping_bwd(void *grad_routing_probs, const void *grad_final_probs,
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

/** Workspace bytes of moe_permute_fwd. CPU: 0 (the plan lives in the offsets and counts). */
size_t moe_permute_workspace_size(int64_t num_tokens, int64_t num_experts,
                                  const moe_permute_params_t *params);

/** CUDA: per-(chunk, expert) counts and ballots, O(T·E / 32). */
size_t moe_cuda_permute_workspace_size(int64_t num_tokens, int64_t num_experts,
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
 * \param[in]  num_tokens, hidden, num_experts  sizes (>= 0, >= 0, >= 1)
 * \param[in]  dtype, probs_dtype  element types (any moe_dtype_t for tokens; float for probs)
 * \param[in]  params          layout options; num_rows = moe_permute_num_rows(...)
 * \param[in]  workspace       moe_permute_workspace_size(...) bytes (none on the CPU)
 *
 * Layout only: hidden = 0 with permuted_tokens and tokens NULL (and dtype not read) computes the
 * layout alone: sorted_indices, permuted_probs (when asked), expert_offsets and
 * tokens_per_expert, bitwise those of the full mode, and moves no row. Any other combination of
 * hidden = 0 or a NULL row buffer is rejected, naming the argument.
 */
moe_status_t moe_permute_fwd(void *permuted_tokens, void *permuted_probs, int64_t *sorted_indices,
                             int64_t *expert_offsets, int64_t *tokens_per_expert,
                             const void *tokens, const uint8_t *routing_map, const void *probs,
                             int64_t num_tokens, int64_t hidden, int64_t num_experts,
                             moe_dtype_t dtype, moe_dtype_t probs_dtype,
                             const moe_permute_params_t *params, void *workspace,
                             size_t workspace_bytes, void *stream);

/**
 * CUDA: bitwise the CPU's rows, probs, indices, offsets and counts. The layout only runs the same
 * plan and scatter kernels, which then read and write no row.
 */
moe_status_t moe_cuda_permute_fwd(void *permuted_tokens, void *permuted_probs,
                                  int64_t *sorted_indices, int64_t *expert_offsets,
                                  int64_t *tokens_per_expert, const void *tokens,
                                  const uint8_t *routing_map, const void *probs,
                                  int64_t num_tokens, int64_t hidden, int64_t num_experts,
                                  moe_dtype_t dtype, moe_dtype_t probs_dtype,
                                  const moe_permute_params_t *params, void *workspace,
                                  size_t workspace_bytes, void *stream);

/**
 * Workspace bytes of moe_permute_bwd, moe_unpermute_fwd and moe_unpermute_bwd. CPU: the
 * token → rows map, (num_tokens + 1 + num_rows) int64.
 */
size_t moe_unpermute_workspace_size(int64_t num_tokens, int64_t num_rows);

/**
 * CUDA: the token → rows map with each row's expert and one fp64 word per row,
 * (2·num_tokens + 1 + 3·num_rows) int64.
 */
size_t moe_cuda_unpermute_workspace_size(int64_t num_tokens, int64_t num_rows);

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
 * \param[in]  hidden               >= 0
 * \param[in]  workspace            moe_unpermute_workspace_size(num_tokens, num_rows) bytes
 *
 * grad_probs only (the backward of the layout-only forward): hidden = 0 with grad_tokens and
 * grad_permuted_tokens NULL computes grad_probs alone (required then, unless num_tokens = 0),
 * bitwise the full mode's; dtype is not read. Any other combination of hidden = 0 or a NULL row
 * buffer is rejected, naming the argument.
 */
moe_status_t moe_permute_bwd(void *grad_tokens, void *grad_probs, const void *grad_permuted_tokens,
                             const void *grad_permuted_probs, const int64_t *sorted_indices,
                             const int64_t *expert_offsets, int64_t num_tokens, int64_t hidden,
                             int64_t num_experts, int64_t num_rows, moe_dtype_t dtype,
                             moe_dtype_t probs_dtype, void *workspace, size_t workspace_bytes,
                             void *stream);

/** CUDA: bitwise the CPU's grads; sorted_indices and expert_offsets are not checked. */
moe_status_t moe_cuda_permute_bwd(void *grad_tokens, void *grad_probs,
                                  const void *grad_permuted_tokens,
                                  const void *grad_permuted_probs, const int64_t *sorted_indices,
                                  const int64_t *expert_offsets, int64_t num_tokens,
                                  int64_t hidden, int64_t num_experts, int64_t num_rows,
                                  moe_dtype_t dtype, moe_dtype_t probs_dtype, void *workspace,
                                  size_t workspace_bytes, void *stream);

/** Workspace bytes of moe_permute_bwd_accumulate. CPU: 0 (no map: see below). */
size_t moe_permute_bwd_accumulate_workspace_size(int64_t num_tokens, int64_t chunk_rows);

/** CUDA: the token → rows map of the chunk's rows, moe_cuda_unpermute_workspace_size(T, n). */
size_t moe_cuda_permute_bwd_accumulate_workspace_size(int64_t num_tokens, int64_t chunk_rows);

/**
 * permute_bwd's token sum, one chunk of rows at a time, into an fp32 accumulator (the rows'
 * gradient then never needs to exist whole). For every row r in [row_lo, row_lo + chunk_rows)
 * with token t = sorted_indices[r] >= 0, in ascending r:
 *     acc[t, h] = fp32(acc[t, h] + float(grad_rows_chunk[r - row_lo, h]))   (never fused)
 * permute_bwd starts each token's fp32 sum at +0.0 and adds all its rows in ascending order, then
 * rounds once; so an acc filled with +0.0 and given every chunk in ascending row order (any
 * split, empty chunks included) holds that very sum, and rounding it to `dtype` (a plain cast,
 * RNE) is bitwise permute_bwd's grad_tokens, tokens without rows (+0.0) included.
 * \param[in,out] acc           [num_tokens, hidden], fp32
 * \param[in]  grad_rows_chunk  [chunk_rows, hidden], `dtype` (bf16, fp16 or fp32): the rows'
 *                              gradient of rows [row_lo, row_lo + chunk_rows)
 * \param[in]  sorted_indices   [num_rows], int64: the whole layout, as permute returns it (-1:
 *                              padding row); only the chunk's entries are read. CPU: they must be
 *                              in [-1, num_tokens) (checked); CUDA: others are skipped, unchecked
 * \param[in]  row_lo, chunk_rows  0 <= row_lo, row_lo + chunk_rows <= num_rows
 * \param[in]  workspace        moe_permute_bwd_accumulate_workspace_size(...) bytes
 */
moe_status_t moe_permute_bwd_accumulate(float *acc, const void *grad_rows_chunk,
                                        const int64_t *sorted_indices, int64_t num_tokens,
                                        int64_t hidden, int64_t num_rows, int64_t row_lo,
                                        int64_t chunk_rows, moe_dtype_t dtype, void *workspace,
                                        size_t workspace_bytes, void *stream);

/** CUDA: bitwise the CPU's acc; sorted_indices is not checked (out-of-range entries skipped). */
moe_status_t moe_cuda_permute_bwd_accumulate(float *acc, const void *grad_rows_chunk,
                                             const int64_t *sorted_indices, int64_t num_tokens,
                                             int64_t hidden, int64_t num_rows, int64_t row_lo,
                                             int64_t chunk_rows, moe_dtype_t dtype,
                                             void *workspace, size_t workspace_bytes,
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

/** CUDA: bitwise the CPU's output; sorted_indices and expert_offsets are not checked. */
moe_status_t moe_cuda_unpermute_fwd(void *output, const void *permuted_tokens,
                                    const int64_t *sorted_indices, const void *probs,
                                    const int64_t *expert_offsets, int64_t num_tokens,
                                    int64_t hidden, int64_t num_experts, int64_t num_rows,
                                    moe_dtype_t dtype, moe_dtype_t probs_dtype, void *workspace,
                                    size_t workspace_bytes, void *stream);

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

/**
 * CUDA: grad_permuted_tokens bitwise the CPU's; grad_probs sums its dot products in a fixed tree
 * order (deterministic, not bitwise the CPU's). sorted_indices and expert_offsets are not checked.
 */
moe_status_t moe_cuda_unpermute_bwd(void *grad_permuted_tokens, void *grad_probs,
                                    const void *grad_output, const void *permuted_tokens,
                                    const int64_t *sorted_indices, const void *probs,
                                    const int64_t *expert_offsets, int64_t num_tokens,
                                    int64_t hidden, int64_t num_experts, int64_t num_rows,
                                    moe_dtype_t dtype, moe_dtype_t probs_dtype, void *workspace,
                                    size_t workspace_bytes, void *stream);

/** Workspace bytes of moe_sort_chunks_by_idxs_fwd / _bwd. CPU: 0. */
size_t moe_sort_chunks_by_idxs_workspace_size(int64_t num_chunks);

/** CUDA: 3·num_chunks + 2 int64 (every chunk's two starts, computed on the device). */
size_t moe_cuda_sort_chunks_by_idxs_workspace_size(int64_t num_chunks);

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

/** CUDA: split_sizes and sorted_idxs are in device memory and not checked. */
moe_status_t moe_cuda_sort_chunks_by_idxs_fwd(void *output, const void *input,
                                              const int64_t *split_sizes,
                                              const int64_t *sorted_idxs, int64_t num_rows,
                                              int64_t row_elems, int64_t num_chunks,
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

/** CUDA: as moe_cuda_sort_chunks_by_idxs_fwd. */
moe_status_t moe_cuda_sort_chunks_by_idxs_bwd(void *grad_input, const void *grad_output,
                                              const int64_t *split_sizes,
                                              const int64_t *sorted_idxs, int64_t num_rows,
                                              int64_t row_elems, int64_t num_chunks,
                                              moe_dtype_t dtype, void *workspace,
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

/** CUDA: bitwise the CPU's counts. No workspace. */
moe_status_t moe_cuda_tokens_per_expert_fwd(int64_t *counts, const uint8_t *routing_map,
                                            const uint8_t *padding_mask, int64_t num_tokens,
                                            int64_t num_experts, void *workspace,
                                            size_t workspace_bytes, void *stream);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* MOE_LAYOUT_H_ */
