// library.cpp: the moe_core ops, once each: the schema, and the CPU and CUDA kernels made from
// it. `import moe_core._C` loads this library, which runs the registrations; it has no Python API.
//
// The one idea: an op is written once, for any device (router.cpp, ...), taking the table of C
// entry points of the device it runs on (binding.h). The list below registers it twice, bound to
// the CPU table under the CPU dispatch key and to the CUDA table under the CUDA key, so the
// dispatcher chooses the device and nothing after it tests a tensor for one.
#include <Python.h>

#include <torch/library.h>

#include <utility>

#include "binding.h"

using namespace moe_torch;

namespace {

// Every op: X(name, schema after the name). Its implementation is moe_torch::name.
#define MOE_OPS(X)                                                                                 \
  /* router.cpp */                                                                                 \
  X(router_gating_linear, "(Tensor inp, Tensor weight, Tensor? bias, ScalarType router_dtype)"     \
                          " -> Tensor")                                                            \
  X(router_gating_linear_bwd, "(Tensor grad_logits, Tensor inp, Tensor weight) -> (Tensor, "       \
                              "Tensor, Tensor)")                                                   \
  X(router_topk, "(Tensor logits, int topk, bool use_pre_softmax, int num_groups, "                \
                 "int group_topk, float scaling_factor, str score_function, Tensor? expert_bias, " \
                 "bool? normalize=None, int group_score_topk=0) -> (Tensor, Tensor)")              \
  X(router_topk_bwd, "(Tensor grad_probs, Tensor logits, Tensor topk_indices, int topk, "          \
                     "bool use_pre_softmax, int num_groups, int group_topk, "                      \
                     "float scaling_factor, str score_function, bool? normalize=None, "            \
                     "int group_score_topk=0) -> Tensor")                                          \
  X(router_topk_dense, "(Tensor logits, int topk, bool use_pre_softmax, int num_groups, "          \
                       "int group_topk, float scaling_factor, str score_function, "                \
                       "Tensor? expert_bias, bool? normalize=None, int group_score_topk=0)"        \
                       " -> (Tensor, Tensor, Tensor)")                                             \
  X(router_topk_dense_bwd, "(Tensor grad_probs, Tensor logits, Tensor topk_indices, int topk, "    \
                           "bool use_pre_softmax, int num_groups, int group_topk, "                \
                           "float scaling_factor, str score_function, bool? normalize=None, "      \
                           "int group_score_topk=0) -> Tensor")                                    \
  X(router_topk_fused, "(Tensor logits, int topk, bool use_pre_softmax, int num_groups, "          \
                       "int group_topk, float scaling_factor, str score_function, "                \
                       "Tensor? expert_bias, Tensor? padding_mask, bool with_aux, bool with_lse, " \
                       "bool? normalize=None, int group_score_topk=0) -> (Tensor, Tensor, "        \
                       "Tensor, Tensor, Tensor, Tensor)")                                          \
  X(router_lse_bwd, "(Tensor grad_lse, Tensor logits, Tensor lse, Tensor? padding_mask)"           \
                    " -> Tensor")                                                                  \
  /* layout.cpp */                                                                                 \
  X(topk_to_dense, "(Tensor topk_probs, Tensor topk_indices, int num_experts) -> (Tensor, "        \
                   "Tensor)")                                                                      \
  X(topk_to_dense_bwd, "(Tensor grad_probs, Tensor topk_indices) -> Tensor")                       \
  X(token_dropping, "(Tensor routing_probs, Tensor routing_map, int capacity, str drop_policy, "   \
                    "bool pad_to_capacity) -> (Tensor, Tensor)")                                   \
  X(token_dropping_bwd, "(Tensor grad_final_probs, Tensor final_map) -> Tensor")                   \
  X(permute, "(Tensor tokens, Tensor routing_map, Tensor? probs, int num_out_tokens, "             \
             "bool drop_and_pad, int align_size) -> (Tensor, Tensor, Tensor, Tensor, Tensor)")     \
  X(permute_bwd, "(Tensor grad_permuted_tokens, Tensor? grad_permuted_probs, "                     \
                 "Tensor sorted_indices, Tensor expert_offsets, int num_tokens) -> (Tensor, "      \
                 "Tensor)")                                                                        \
  X(permute_layout, "(Tensor routing_map, Tensor? probs, int num_out_tokens, bool drop_and_pad, "  \
                    "int align_size) -> (Tensor permuted_probs, Tensor sorted_indices, "           \
                    "Tensor expert_offsets, Tensor tokens_per_expert)")                            \
  X(permute_layout_bwd, "(Tensor grad_permuted_probs, Tensor sorted_indices, "                     \
                        "Tensor expert_offsets, int num_tokens) -> Tensor")                        \
  X(permute_bwd_accumulate_, "(Tensor(a!) acc, Tensor grad_rows_chunk, Tensor sorted_indices, "  \
                             "int row_lo) -> ()")                                                  \
  X(unpermute, "(Tensor permuted_tokens, Tensor sorted_indices, int num_tokens, Tensor? probs, "   \
               "Tensor? expert_offsets) -> Tensor")                                                \
  X(unpermute_bwd, "(Tensor grad_output, Tensor sorted_indices, Tensor? probs, "                   \
                   "Tensor? expert_offsets, Tensor? permuted_tokens) -> (Tensor, Tensor)")         \
  X(sort_chunks_by_idxs, "(Tensor input, Tensor split_sizes, Tensor sorted_idxs) -> Tensor")       \
  X(sort_chunks_by_idxs_bwd, "(Tensor grad_output, Tensor split_sizes, Tensor sorted_idxs)"        \
                             " -> Tensor")                                                         \
  X(tokens_per_expert, "(Tensor routing_map, Tensor? padding_mask) -> Tensor")                     \
  /* balancing.cpp */                                                                              \
  X(aux_loss_scores, "(Tensor logits, int topk, str score_function, Tensor? padding_mask)"         \
                     " -> (Tensor, Tensor)")                                                       \
  X(aux_loss_scores_bwd, "(Tensor grad_scores, Tensor logits, str score_function, "                \
                         "Tensor? padding_mask) -> Tensor")                                        \
  X(switch_aux_loss, "(Tensor probs, Tensor tokens_per_expert, Tensor total_num_tokens, "          \
                     "int topk, int num_experts, float coeff, Tensor? padding_mask) -> Tensor")    \
  X(switch_aux_loss_bwd, "(Tensor grad_loss, Tensor probs, Tensor tokens_per_expert, "             \
                         "Tensor total_num_tokens, int topk, int num_experts, float coeff, "       \
                         "Tensor? padding_mask) -> Tensor")                                        \
  X(z_loss, "(Tensor logits, float coeff, Tensor? padding_mask) -> Tensor")                        \
  X(z_loss_bwd, "(Tensor grad_loss, Tensor logits, float coeff, Tensor? padding_mask) -> Tensor")  \
  X(expert_bias_update, "(Tensor tokens_per_expert, Tensor expert_bias, float update_rate)"        \
                        " -> Tensor")                                                              \
  X(sinkhorn, "(Tensor cost, float tol, int max_iters) -> Tensor")                                 \
  X(sinkhorn_routing, "(Tensor logits, int topk, bool training, float tol) -> (Tensor, Tensor)")   \
  X(sinkhorn_routing_bwd, "(Tensor grad_probs, Tensor logits, Tensor routing_map, int topk)"       \
                          " -> Tensor")                                                            \
  X(routing_metrics, "(Tensor routing_map, Tensor? scores, Tensor? padding_mask) -> (Tensor, "     \
                     "Tensor)")                                                                    \
  X(topk_overlap, "(Tensor indices_a, Tensor indices_b, int num_experts, Tensor? padding_mask)"    \
                  " -> Tensor")                                                                    \
  /* experts.cpp */                                                                                \
  X(grouped_gemm, "(Tensor x, Tensor weight, Tensor expert_offsets, bool trans_w=False, "          \
                  "ScalarType? out_dtype=None, Tensor? x_index=None) -> Tensor")                   \
  X(grouped_gemm_dgrad, "(Tensor grad_y, Tensor weight, Tensor expert_offsets, "                   \
                        "bool trans_w=False, ScalarType? out_dtype=None, "                         \
                        "Tensor? grad_y_index=None) -> Tensor")                                    \
  X(grouped_gemm_wgrad, "(Tensor x, Tensor grad_y, Tensor expert_offsets, bool trans_w=False, "    \
                        "ScalarType? out_dtype=None, Tensor? x_index=None, "                       \
                        "Tensor? grad_y_index=None) -> Tensor")                                    \
  X(glu_probs, "(Tensor a, Tensor? probs, str activation, bool gated_linear_unit, "                \
               "float linear_offset=0.0, float? clamp_value=None, int glu_interleave_size=0)"      \
               " -> Tensor")                                                                       \
  X(glu_probs_bwd, "(Tensor grad_h, Tensor a, Tensor? probs, str activation, "                     \
                   "bool gated_linear_unit, float linear_offset=0.0, float? clamp_value=None, "    \
                   "int glu_interleave_size=0) -> (Tensor, Tensor)")                               \
  X(glu_probs_bwd_, "(Tensor(a!) grad_h, Tensor a, Tensor(b!) grad_a, Tensor? probs, "            \
                    "str activation, bool gated_linear_unit, float linear_offset=0.0, "            \
                    "float? clamp_value=None, int glu_interleave_size=0) -> Tensor")               \
  X(grouped_gemm_glu_probs, "(Tensor x, Tensor weight, Tensor expert_offsets, Tensor? probs, "     \
                            "str activation, bool gated_linear_unit, float linear_offset=0.0, "    \
                            "float? clamp_value=None, bool trans_w=True, Tensor? x_index=None, "   \
                            "int glu_interleave_size=0) -> (Tensor, Tensor)")

// The C entry points of each device. A CPU-only build links moe_cuda_* stubs (cuda_stubs.c), so
// both tables always build; the compiler checks that each pair of entry points has one type.
#define MOE_CPU_ENTRY(name) &moe_##name,
#define MOE_CUDA_ENTRY(name) &moe_cuda_##name,
constexpr Device kCpu = {false, MOE_ENTRY_POINTS(MOE_CPU_ENTRY)};
constexpr Device kCuda = {true, MOE_ENTRY_POINTS(MOE_CUDA_ENTRY)};

// An op bound to a device: the plain function of the schema's arguments that m.impl registers.
template <const Device &D, auto Op>
struct OnDeviceOp;
template <const Device &D, typename R, typename... Args, R (*Op)(const Device &, Args...)>
struct OnDeviceOp<D, Op> {
  static R call(Args... args) { return Op(D, std::forward<Args>(args)...); }
};

template <const Device &D>
void register_kernels(torch::Library &m) {
#define MOE_IMPL(name, schema) m.impl(#name, &OnDeviceOp<D, moe_torch::name>::call);
  MOE_OPS(MOE_IMPL)
#undef MOE_IMPL
}

}  // namespace

TORCH_LIBRARY(moe_core, m) {
#define MOE_DEF(name, schema) m.def(#name schema);
  MOE_OPS(MOE_DEF)
#undef MOE_DEF
}

TORCH_LIBRARY_IMPL(moe_core, CPU, m) { register_kernels<kCpu>(m); }

// A build without CUDA kernels registers none, so CUDA tensors get the dispatcher's own
// "no kernel for CUDA" error and moe_core.has_cuda() stays False.
TORCH_LIBRARY_IMPL(moe_core, CUDA, m) {
  if (moe_has_cuda()) register_kernels<kCuda>(m);
}

static struct PyModuleDef moe_core_module = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
PyMODINIT_FUNC PyInit__C(void) { return PyModule_Create(&moe_core_module); }
