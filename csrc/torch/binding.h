// binding.h: what the torch binding's files share. The binding registers the moe_core ops with
// the PyTorch dispatcher (library.cpp) and, for each call, validates the tensors with messages
// that name the argument, allocates the outputs and the workspace, and calls the C core on the
// current stream (router.cpp, layout.cpp, balancing.cpp, experts.cpp). Nothing else lives here:
// no math, no policy. These are the only files that include torch.
//
// The one idea: error messages are assembled with plain string appends and snprintf, never
// through an ostream (c10::str). On a machine whose torch was built with another libstdc++ than
// this extension, a numeric ostream insertion instantiated here crashed inside the locale
// machinery. So every check builds its text with moe_cat() and throws c10's typed error directly.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <string>
#include <tuple>

#include <c10/core/DeviceGuard.h>

#include "moe_core.h"

namespace moe_torch {

// ---- messages -----------------------------------------------------------------------------------

void put(std::string &s, const char *v);
void put(std::string &s, const std::string &v);
void put(std::string &s, int v);
void put(std::string &s, long v);
void put(std::string &s, long long v);
void put(std::string &s, unsigned long v);
void put(std::string &s, unsigned long long v);
void put(std::string &s, double v);
void put(std::string &s, at::IntArrayRef v);
void put(std::string &s, at::ScalarType v);
void put(std::string &s, const at::Device &d);

template <typename... Args>
std::string moe_cat(const Args &...args) {
  std::string s;
  (put(s, args), ...);
  return s;
}

#define MOE_LOC \
  c10::SourceLocation { __func__, __FILE__, static_cast<uint32_t>(__LINE__) }
#define MOE_CHECK_VALUE(cond, ...) \
  do { if (!(cond)) throw c10::ValueError(MOE_LOC, moe_cat(__VA_ARGS__)); } while (0)
#define MOE_CHECK_TYPE(cond, ...) \
  do { if (!(cond)) throw c10::TypeError(MOE_LOC, moe_cat(__VA_ARGS__)); } while (0)
#define MOE_CHECK_RUNTIME(cond, ...) \
  do { if (!(cond)) throw c10::Error(MOE_LOC, moe_cat(__VA_ARGS__)); } while (0)

// ---- validation of tensors ----------------------------------------------------------------------

moe_dtype_t to_moe_dtype(at::ScalarType st, const char *name);
void check_float(const at::Tensor &t, const char *name);
void check_dtype(const at::Tensor &t, at::ScalarType st, const char *name);
void check_dim(const at::Tensor &t, int64_t dim, const char *name);
void check_size(const at::Tensor &t, int64_t dim, int64_t size, const char *name, const char *what);
void check_same_device(const at::Tensor &t, const at::Tensor &ref, const char *name,
                       const char *ref_name);
// t.shape == ref.shape.
void check_same_shape(const at::Tensor &t, const char *name, const at::Tensor &ref,
                      const char *ref_name);
// A [num_tokens, num_experts] bool map.
void check_routing_map(const at::Tensor &routing_map, const char *name);

// A padding mask (True = padding) as the C core's [num_tokens] uint8 buffer, or nullptr; `keep`
// holds the contiguous copy alive for the call.
const uint8_t *padding_mask_ptr(const c10::optional<at::Tensor> &mask_, at::Tensor &keep,
                                int64_t num_tokens, const at::Tensor &ref, const char *ref_name);

// Raises the C core's message: ValueError for a bad argument, RuntimeError otherwise.
void check_status(moe_status_t status, const char *op);

// A named option as its enumerator (moe_types.h's option tables), or a ValueError listing them.
moe_score_function_t to_score_function(c10::string_view name);
moe_activation_t to_activation(c10::string_view name);

// ---- devices ------------------------------------------------------------------------------------

// Every C entry point the binding calls, named without its device prefix: moe_<name> runs on the
// CPU, moe_cuda_<name> on CUDA, with the same signature (a CPU-only build links stubs for the
// latter). One list, so both devices' tables come from it and cannot drift apart.
#define MOE_ENTRY_POINTS(X)                                                                      \
  X(router_gating_linear_workspace_size) X(router_gating_linear_fwd) X(router_gating_linear_bwd) \
  X(router_topk_workspace_size) X(router_topk_fwd) X(router_topk_bwd) X(router_topk_dense_bwd)   \
  X(router_topk_fused_workspace_size) X(router_topk_fused_fwd) X(router_lse_bwd)                 \
  X(topk_to_dense_fwd) X(topk_to_dense_bwd)                                                      \
  X(token_dropping_workspace_size) X(token_dropping_fwd) X(token_dropping_bwd)                   \
  X(permute_workspace_size) X(permute_fwd) X(permute_bwd)                                        \
  X(permute_bwd_accumulate_workspace_size) X(permute_bwd_accumulate)                              \
  X(unpermute_workspace_size) X(unpermute_fwd) X(unpermute_bwd)                                  \
  X(sort_chunks_by_idxs_workspace_size) X(sort_chunks_by_idxs_fwd) X(sort_chunks_by_idxs_bwd)    \
  X(tokens_per_expert_fwd)                                                                       \
  X(aux_loss_scores_workspace_size) X(aux_loss_scores_fwd) X(aux_loss_scores_bwd)                \
  X(switch_aux_loss_workspace_size) X(switch_aux_loss_fwd) X(switch_aux_loss_bwd)                \
  X(z_loss_workspace_size) X(z_loss_fwd) X(z_loss_bwd)                                           \
  X(expert_bias_update_fwd)                                                                      \
  X(sinkhorn_workspace_size) X(sinkhorn_fwd)                                                     \
  X(sinkhorn_routing_workspace_size) X(sinkhorn_routing_fwd) X(sinkhorn_routing_bwd)             \
  X(routing_metrics_workspace_size) X(routing_metrics_fwd)                                       \
  X(topk_overlap_workspace_size) X(topk_overlap_fwd)                                             \
  X(grouped_gemm_workspace_size) X(grouped_gemm_fwd) X(grouped_gemm_dgrad) X(grouped_gemm_wgrad) \
  X(glu_probs_fwd) X(glu_probs_bwd) X(grouped_gemm_glu_probs_fwd)

// A device: its table of C entry points. Each op receives the table of the device its kernel is
// registered for (library.cpp), so an op body calls `d.permute_fwd(...)` and never tests a tensor
// for its device: the dispatcher has chosen it.
struct Device {
  bool cuda;
#define MOE_DEVICE_FIELD(name) decltype(&moe_##name) name;
  MOE_ENTRY_POINTS(MOE_DEVICE_FIELD)
#undef MOE_DEVICE_FIELD
};

// One call on a device: the device of `t` made current for the call's lifetime, and its current
// stream (NULL on the CPU), the last argument of every C entry point.
class OnDevice {
 public:
  OnDevice(const Device &d, const at::Tensor &t);
  void *stream() const { return stream_; }

 private:
  c10::OptionalDeviceGuard guard_;
  void *stream_ = nullptr;
};

// ---- workspace ----------------------------------------------------------------------------------

// The scratch of one C call: `bytes` as the op's *_workspace_size function of the call's device
// gives them, allocated on the device of `like`; no buffer (NULL, 0) when it asks for none.
// Every workspace is allocated here, so a size function's overflow sentinel is always caught:
// MOE_SIZE_OVERFLOW becomes a ValueError with the size function's message (which names the
// function, the argument and its value) instead of a request for SIZE_MAX bytes.
struct Workspace {
  at::Tensor buffer;  // owns the bytes for the call
  void *ptr = nullptr;
  size_t bytes = 0;
};
Workspace workspace(const at::Tensor &like, size_t bytes);

// ---- GEMM operands ------------------------------------------------------------------------------

// An operand as the grouped GEMMs take it: contiguous, and on CUDA at a 16-byte aligned address.
// The Hopper kernels load through tensor maps, whose base must be aligned: a misaligned plain
// call would run the portable kernel instead, and a gathered one has no workspace for the
// fallback's row copy (moe_experts.h). So a misaligned tensor (a view at an odd element offset)
// is copied once here; any other is passed as it is.
at::Tensor gemm_operand(const at::Tensor &t);

// ---- optional tensors -------------------------------------------------------------------------

// The data of an optional tensor, or NULL when it is absent (undefined): the C core's "none".
inline void *data_or_null(const at::Tensor &t) { return t.defined() ? t.data_ptr() : nullptr; }
template <typename T>
T *data_or_null(const at::Tensor &t) {
  return t.defined() ? t.data_ptr<T>() : nullptr;
}

// The element type of an optional tensor, or `absent` when there is none.
moe_dtype_t dtype_or(const at::Tensor &t, const char *name, moe_dtype_t absent);

// An optional output as the schema returns it: the tensor, or an empty [0] one like `like`.
at::Tensor or_empty(const at::Tensor &t, const at::Tensor &like);

// ---- the ops, by area (schemas in library.cpp) --------------------------------------------------

using c10::optional;
using c10::string_view;
using at::Tensor;
using Tensor2 = std::tuple<Tensor, Tensor>;
using Tensor3 = std::tuple<Tensor, Tensor, Tensor>;
using Tensor4 = std::tuple<Tensor, Tensor, Tensor, Tensor>;
using Tensor5 = std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor>;
using Tensor6 = std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor>;

// router.cpp: the gating linear, the top-k router (compact, dense, fused with the loss extras)
Tensor router_gating_linear(const Device &d, const Tensor &inp, const Tensor &weight,
                            const optional<Tensor> &bias, at::ScalarType router_dtype);
Tensor3 router_gating_linear_bwd(const Device &d, const Tensor &grad_logits, const Tensor &inp,
                                 const Tensor &weight);
Tensor2 router_topk(const Device &d, const Tensor &logits, int64_t topk, bool use_pre_softmax,
                    int64_t num_groups, int64_t group_topk, double scaling_factor,
                    string_view score_function, const optional<Tensor> &expert_bias,
                    optional<bool> normalize, int64_t group_score_topk);
Tensor3 router_topk_dense(const Device &d, const Tensor &logits, int64_t topk, bool use_pre_softmax,
                          int64_t num_groups, int64_t group_topk, double scaling_factor,
                          string_view score_function, const optional<Tensor> &expert_bias,
                          optional<bool> normalize, int64_t group_score_topk);
// router_topk_bwd (grad_probs [T, topk]) and router_topk_dense_bwd (the dense [T, E] gradient)
template <bool dense>
struct RouterTopkBwd {
  static Tensor op(const Device &d, const Tensor &grad_probs, const Tensor &logits,
                   const Tensor &topk_indices, int64_t topk, bool use_pre_softmax,
                   int64_t num_groups, int64_t group_topk, double scaling_factor,
                   string_view score_function, optional<bool> normalize, int64_t group_score_topk);
};
inline constexpr auto router_topk_bwd = &RouterTopkBwd<false>::op;
inline constexpr auto router_topk_dense_bwd = &RouterTopkBwd<true>::op;
Tensor6 router_topk_fused(const Device &d, const Tensor &logits, int64_t topk, bool use_pre_softmax,
                          int64_t num_groups, int64_t group_topk, double scaling_factor,
                          string_view score_function, const optional<Tensor> &expert_bias,
                          const optional<Tensor> &padding_mask, bool with_aux, bool with_lse,
                          optional<bool> normalize, int64_t group_score_topk);
Tensor router_lse_bwd(const Device &d, const Tensor &grad_lse, const Tensor &logits,
                      const Tensor &lse, const optional<Tensor> &padding_mask);

// layout.cpp: dense routing, capacity, permute / unpermute, chunk sorting, token counts
Tensor2 topk_to_dense(const Device &d, const Tensor &topk_probs, const Tensor &topk_indices,
                      int64_t num_experts);
Tensor topk_to_dense_bwd(const Device &d, const Tensor &grad_probs, const Tensor &topk_indices);
Tensor2 token_dropping(const Device &d, const Tensor &routing_probs, const Tensor &routing_map,
                       int64_t capacity, string_view drop_policy, bool pad_to_capacity);
Tensor token_dropping_bwd(const Device &d, const Tensor &grad_final_probs, const Tensor &final_map);
Tensor5 permute(const Device &d, const Tensor &tokens, const Tensor &routing_map,
                const optional<Tensor> &probs, int64_t num_out_tokens, bool drop_and_pad,
                int64_t align_size);
Tensor2 permute_bwd(const Device &d, const Tensor &grad_permuted_tokens,
                    const optional<Tensor> &grad_permuted_probs, const Tensor &sorted_indices,
                    const Tensor &expert_offsets, int64_t num_tokens);
Tensor4 permute_layout(const Device &d, const Tensor &routing_map, const optional<Tensor> &probs,
                       int64_t num_out_tokens, bool drop_and_pad, int64_t align_size);
Tensor permute_layout_bwd(const Device &d, const Tensor &grad_permuted_probs,
                          const Tensor &sorted_indices, const Tensor &expert_offsets,
                          int64_t num_tokens);
void permute_bwd_accumulate_(const Device &d, const Tensor &acc, const Tensor &grad_rows_chunk,
                             const Tensor &sorted_indices, int64_t row_lo);
Tensor unpermute(const Device &d, const Tensor &permuted_tokens, const Tensor &sorted_indices,
                 int64_t num_tokens, const optional<Tensor> &probs,
                 const optional<Tensor> &expert_offsets);
Tensor2 unpermute_bwd(const Device &d, const Tensor &grad_output, const Tensor &sorted_indices,
                      const optional<Tensor> &probs, const optional<Tensor> &expert_offsets,
                      const optional<Tensor> &permuted_tokens);
Tensor sort_chunks_by_idxs(const Device &d, const Tensor &input, const Tensor &split_sizes,
                           const Tensor &sorted_idxs);
Tensor sort_chunks_by_idxs_bwd(const Device &d, const Tensor &grad_output,
                               const Tensor &split_sizes, const Tensor &sorted_idxs);
Tensor tokens_per_expert(const Device &d, const Tensor &routing_map,
                         const optional<Tensor> &padding_mask);

// balancing.cpp: the aux losses and their scores, the z-loss, the expert bias, Sinkhorn, metrics
Tensor2 aux_loss_scores(const Device &d, const Tensor &logits, int64_t topk,
                        string_view score_function, const optional<Tensor> &padding_mask);
Tensor aux_loss_scores_bwd(const Device &d, const Tensor &grad_scores, const Tensor &logits,
                           string_view score_function, const optional<Tensor> &padding_mask);
Tensor switch_aux_loss(const Device &d, const Tensor &probs, const Tensor &tokens_per_expert,
                       const Tensor &total_num_tokens, int64_t topk, int64_t num_experts,
                       double coeff, const optional<Tensor> &padding_mask);
Tensor switch_aux_loss_bwd(const Device &d, const Tensor &grad_loss, const Tensor &probs,
                           const Tensor &tokens_per_expert, const Tensor &total_num_tokens,
                           int64_t topk, int64_t num_experts, double coeff,
                           const optional<Tensor> &padding_mask);
Tensor z_loss(const Device &d, const Tensor &logits, double coeff,
              const optional<Tensor> &padding_mask);
Tensor z_loss_bwd(const Device &d, const Tensor &grad_loss, const Tensor &logits, double coeff,
                  const optional<Tensor> &padding_mask);
Tensor expert_bias_update(const Device &d, const Tensor &tokens_per_expert,
                          const Tensor &expert_bias, double update_rate);
Tensor sinkhorn(const Device &d, const Tensor &cost, double tol, int64_t max_iters);
Tensor2 sinkhorn_routing(const Device &d, const Tensor &logits, int64_t topk, bool training,
                         double tol);
Tensor sinkhorn_routing_bwd(const Device &d, const Tensor &grad_probs, const Tensor &logits,
                            const Tensor &routing_map, int64_t topk);
Tensor2 routing_metrics(const Device &d, const Tensor &routing_map, const optional<Tensor> &scores,
                        const optional<Tensor> &padding_mask);
Tensor topk_overlap(const Device &d, const Tensor &indices_a, const Tensor &indices_b,
                    int64_t num_experts, const optional<Tensor> &padding_mask);

// experts.cpp: the grouped GEMMs, the activation with the probs, and fc1 fused with it
// x_index / grad_y_index: the gathered operand's rows (moe_experts.h's gather_operand), or none
Tensor grouped_gemm(const Device &d, const Tensor &x, const Tensor &weight,
                    const Tensor &expert_offsets, bool trans_w, optional<at::ScalarType> out_dtype,
                    const optional<Tensor> &x_index);
Tensor grouped_gemm_dgrad(const Device &d, const Tensor &grad_y, const Tensor &weight,
                          const Tensor &expert_offsets, bool trans_w,
                          optional<at::ScalarType> out_dtype,
                          const optional<Tensor> &grad_y_index);
Tensor grouped_gemm_wgrad(const Device &d, const Tensor &x, const Tensor &grad_y,
                          const Tensor &expert_offsets, bool trans_w,
                          optional<at::ScalarType> out_dtype, const optional<Tensor> &x_index,
                          const optional<Tensor> &grad_y_index);
Tensor glu_probs(const Device &d, const Tensor &a, const optional<Tensor> &probs,
                 string_view activation, bool gated_linear_unit, double linear_offset,
                 optional<double> clamp_value, int64_t glu_interleave_size);
Tensor2 glu_probs_bwd(const Device &d, const Tensor &grad_h, const Tensor &a,
                      const optional<Tensor> &probs, string_view activation, bool gated_linear_unit,
                      double linear_offset, optional<double> clamp_value,
                      int64_t glu_interleave_size);
Tensor glu_probs_bwd_(const Device &d, Tensor grad_h, const Tensor &a, Tensor grad_a,
                      const optional<Tensor> &probs, string_view activation,
                      bool gated_linear_unit, double linear_offset, optional<double> clamp_value,
                      int64_t glu_interleave_size);
Tensor2 grouped_gemm_glu_probs(const Device &d, const Tensor &x, const Tensor &weight,
                               const Tensor &expert_offsets, const optional<Tensor> &probs,
                               string_view activation, bool gated_linear_unit, double linear_offset,
                               optional<double> clamp_value, bool trans_w,
                               const optional<Tensor> &x_index, int64_t glu_interleave_size);

}  // namespace moe_torch
