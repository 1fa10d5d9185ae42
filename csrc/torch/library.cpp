// library.cpp: the moe_core op schemas and their CPU and CUDA registrations, and the Python
// module that loads them (`import moe_core._C` runs the registrations; it has no Python API).
#include <Python.h>

#include <torch/library.h>

#include "binding.h"

using namespace moe_torch;

TORCH_LIBRARY(moe_core, m) {
  m.def("router_gating_linear(Tensor inp, Tensor weight, Tensor? bias, ScalarType router_dtype) "
        "-> Tensor");
  m.def("router_gating_linear_bwd(Tensor grad_logits, Tensor inp, Tensor weight) "
        "-> (Tensor, Tensor, Tensor)");
  m.def("router_topk(Tensor logits, int topk, bool use_pre_softmax, int num_groups, "
        "int group_topk, float scaling_factor, str score_function, Tensor? expert_bias, "
        "int routing_mode=0) -> (Tensor, Tensor)");
  m.def("router_topk_bwd(Tensor grad_probs, Tensor logits, Tensor topk_indices, int topk, "
        "bool use_pre_softmax, int num_groups, int group_topk, float scaling_factor, "
        "str score_function, int routing_mode=0) -> Tensor");
  m.def("router_topk_dense(Tensor logits, int topk, bool use_pre_softmax, int num_groups, "
        "int group_topk, float scaling_factor, str score_function, Tensor? expert_bias, "
        "int routing_mode=0) -> (Tensor, Tensor, Tensor)");
  m.def("router_topk_dense_bwd(Tensor grad_probs, Tensor logits, Tensor topk_indices, int topk, "
        "bool use_pre_softmax, int num_groups, int group_topk, float scaling_factor, "
        "str score_function, int routing_mode=0) -> Tensor");
  m.def("router_topk_fused(Tensor logits, int topk, bool use_pre_softmax, int num_groups, "
        "int group_topk, float scaling_factor, str score_function, Tensor? expert_bias, "
        "Tensor? padding_mask, bool with_aux, bool with_lse, int routing_mode=0) "
        "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def("router_lse_bwd(Tensor grad_lse, Tensor logits, Tensor lse, Tensor? padding_mask) "
        "-> Tensor");
  m.def("topk_to_dense(Tensor topk_probs, Tensor topk_indices, int num_experts) "
        "-> (Tensor, Tensor)");
  m.def("topk_to_dense_bwd(Tensor grad_probs, Tensor topk_indices) -> Tensor");
  m.def("token_dropping(Tensor routing_probs, Tensor routing_map, int capacity, str drop_policy, "
        "bool pad_to_capacity) -> (Tensor, Tensor)");
  m.def("token_dropping_bwd(Tensor grad_final_probs, Tensor final_map) -> Tensor");
  m.def("permute(Tensor tokens, Tensor routing_map, Tensor? probs, int num_out_tokens, "
        "bool drop_and_pad, int align_size) -> (Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def("permute_bwd(Tensor grad_permuted_tokens, Tensor? grad_permuted_probs, "
        "Tensor sorted_indices, Tensor expert_offsets, int num_tokens) -> (Tensor, Tensor)");
  m.def("unpermute(Tensor permuted_tokens, Tensor sorted_indices, int num_tokens, Tensor? probs, "
        "Tensor? expert_offsets) -> Tensor");
  m.def("unpermute_bwd(Tensor grad_output, Tensor sorted_indices, Tensor? probs, "
        "Tensor? expert_offsets, Tensor? permuted_tokens) -> (Tensor, Tensor)");
  m.def("sort_chunks_by_idxs(Tensor input, Tensor split_sizes, Tensor sorted_idxs) -> Tensor");
  m.def("sort_chunks_by_idxs_bwd(Tensor grad_output, Tensor split_sizes, Tensor sorted_idxs) "
        "-> Tensor");
  m.def("aux_loss_scores(Tensor logits, int topk, str score_function, Tensor? padding_mask) "
        "-> (Tensor, Tensor)");
  m.def("aux_loss_scores_bwd(Tensor grad_scores, Tensor logits, str score_function, "
        "Tensor? padding_mask) -> Tensor");
  m.def("switch_aux_loss(Tensor probs, Tensor tokens_per_expert, Tensor total_num_tokens, "
        "int topk, int num_experts, float coeff, Tensor? padding_mask) -> Tensor");
  m.def("switch_aux_loss_bwd(Tensor grad_loss, Tensor probs, Tensor tokens_per_expert, "
        "Tensor total_num_tokens, int topk, int num_experts, float coeff, Tensor? padding_mask) "
        "-> Tensor");
  m.def("z_loss(Tensor logits, float coeff, Tensor? padding_mask) -> Tensor");
  m.def("z_loss_bwd(Tensor grad_loss, Tensor logits, float coeff, Tensor? padding_mask) "
        "-> Tensor");
  m.def("tokens_per_expert(Tensor routing_map, Tensor? padding_mask) -> Tensor");
  m.def("expert_bias_update(Tensor tokens_per_expert, Tensor expert_bias, float update_rate) "
        "-> Tensor");
  m.def("sinkhorn(Tensor cost, float tol, int max_iters) -> Tensor");
  m.def("sinkhorn_routing(Tensor logits, int topk, bool training, float tol) "
        "-> (Tensor, Tensor)");
  m.def("sinkhorn_routing_bwd(Tensor grad_probs, Tensor logits, Tensor routing_map, int topk) "
        "-> Tensor");
  m.def("routing_metrics(Tensor routing_map, Tensor? scores, Tensor? padding_mask) "
        "-> (Tensor, Tensor)");
  m.def("topk_overlap(Tensor indices_a, Tensor indices_b, int num_experts, "
        "Tensor? padding_mask) -> Tensor");
  m.def("grouped_gemm(Tensor x, Tensor weight, Tensor expert_offsets, bool trans_w=False, "
        "ScalarType? out_dtype=None) -> Tensor");
  m.def("grouped_gemm_dgrad(Tensor grad_y, Tensor weight, Tensor expert_offsets, "
        "bool trans_w=False, ScalarType? out_dtype=None) -> Tensor");
  m.def("grouped_gemm_wgrad(Tensor x, Tensor grad_y, Tensor expert_offsets, bool trans_w=False, "
        "ScalarType? out_dtype=None) -> Tensor");
  m.def("glu_probs(Tensor a, Tensor? probs, str activation, bool gated_linear_unit, "
        "float linear_offset=0.0, float? clamp_value=None) -> Tensor");
  m.def("glu_probs_bwd(Tensor grad_h, Tensor a, Tensor? probs, str activation, "
        "bool gated_linear_unit, float linear_offset=0.0, float? clamp_value=None) "
        "-> (Tensor, Tensor)");
  m.def("glu_probs_bwd_(Tensor(a!) grad_h, Tensor(b!) a, Tensor? probs, str activation, "
        "bool gated_linear_unit, float linear_offset=0.0, float? clamp_value=None) -> Tensor");
  m.def("grouped_gemm_glu_probs(Tensor x, Tensor weight, Tensor expert_offsets, Tensor? probs, "
        "str activation, bool gated_linear_unit, float linear_offset=0.0, "
        "float? clamp_value=None, bool trans_w=True) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(moe_core, CPU, m) {
  m.impl("router_gating_linear", &router_gating_linear);
  m.impl("router_gating_linear_bwd", &router_gating_linear_bwd);
  m.impl("router_topk", &router_topk);
  m.impl("router_topk_bwd", &router_topk_bwd);
  m.impl("router_topk_dense", &router_topk_dense);
  m.impl("router_topk_dense_bwd", &router_topk_dense_bwd);
  m.impl("router_topk_fused", &router_topk_fused);
  m.impl("router_lse_bwd", &router_lse_bwd);
  m.impl("topk_to_dense", &topk_to_dense);
  m.impl("topk_to_dense_bwd", &topk_to_dense_bwd);
  m.impl("token_dropping", &token_dropping);
  m.impl("token_dropping_bwd", &token_dropping_bwd);
  m.impl("permute", &permute);
  m.impl("permute_bwd", &permute_bwd);
  m.impl("unpermute", &unpermute);
  m.impl("unpermute_bwd", &unpermute_bwd);
  m.impl("sort_chunks_by_idxs", &sort_chunks_by_idxs);
  m.impl("sort_chunks_by_idxs_bwd", &sort_chunks_by_idxs_bwd);
  m.impl("aux_loss_scores", &aux_loss_scores);
  m.impl("aux_loss_scores_bwd", &aux_loss_scores_bwd);
  m.impl("switch_aux_loss", &switch_aux_loss);
  m.impl("switch_aux_loss_bwd", &switch_aux_loss_bwd);
  m.impl("z_loss", &z_loss);
  m.impl("z_loss_bwd", &z_loss_bwd);
  m.impl("tokens_per_expert", &tokens_per_expert);
  m.impl("expert_bias_update", &expert_bias_update);
  m.impl("sinkhorn", &sinkhorn);
  m.impl("sinkhorn_routing", &sinkhorn_routing);
  m.impl("sinkhorn_routing_bwd", &sinkhorn_routing_bwd);
  m.impl("routing_metrics", &routing_metrics);
  m.impl("topk_overlap", &topk_overlap);
  m.impl("grouped_gemm", &grouped_gemm);
  m.impl("grouped_gemm_dgrad", &grouped_gemm_dgrad);
  m.impl("grouped_gemm_wgrad", &grouped_gemm_wgrad);
  m.impl("glu_probs", &glu_probs);
  m.impl("glu_probs_bwd", &glu_probs_bwd);
  m.impl("glu_probs_bwd_", &glu_probs_bwd_);
  m.impl("grouped_gemm_glu_probs", &grouped_gemm_glu_probs);
}

#ifdef MOE_CORE_WITH_CUDA
TORCH_LIBRARY_IMPL(moe_core, CUDA, m) {
  m.impl("router_topk", &router_topk);
  m.impl("router_topk_bwd", &router_topk_bwd);
  m.impl("router_topk_dense", &router_topk_dense);
  m.impl("router_topk_dense_bwd", &router_topk_dense_bwd);
  m.impl("topk_to_dense", &topk_to_dense);
  m.impl("topk_to_dense_bwd", &topk_to_dense_bwd);
  m.impl("token_dropping", &token_dropping);
  m.impl("token_dropping_bwd", &token_dropping_bwd);
  m.impl("permute", &permute);
  m.impl("permute_bwd", &permute_bwd);
  m.impl("unpermute", &unpermute);
  m.impl("unpermute_bwd", &unpermute_bwd);
  m.impl("sort_chunks_by_idxs", &sort_chunks_by_idxs);
  m.impl("sort_chunks_by_idxs_bwd", &sort_chunks_by_idxs_bwd);
  m.impl("tokens_per_expert", &tokens_per_expert);
  m.impl("router_gating_linear", &router_gating_linear);
  m.impl("router_gating_linear_bwd", &router_gating_linear_bwd);
  m.impl("aux_loss_scores", &aux_loss_scores);
  m.impl("aux_loss_scores_bwd", &aux_loss_scores_bwd);
  m.impl("switch_aux_loss", &switch_aux_loss);
  m.impl("switch_aux_loss_bwd", &switch_aux_loss_bwd);
  m.impl("z_loss", &z_loss);
  m.impl("z_loss_bwd", &z_loss_bwd);
  m.impl("expert_bias_update", &expert_bias_update);
  m.impl("sinkhorn", &sinkhorn);
  m.impl("sinkhorn_routing", &sinkhorn_routing);
  m.impl("sinkhorn_routing_bwd", &sinkhorn_routing_bwd);
  m.impl("routing_metrics", &routing_metrics);
  m.impl("topk_overlap", &topk_overlap);
  m.impl("glu_probs", &glu_probs);
  m.impl("glu_probs_bwd", &glu_probs_bwd);
  m.impl("glu_probs_bwd_", &glu_probs_bwd_);
  m.impl("grouped_gemm", &grouped_gemm);
  m.impl("grouped_gemm_dgrad", &grouped_gemm_dgrad);
  m.impl("grouped_gemm_wgrad", &grouped_gemm_wgrad);
  m.impl("grouped_gemm_glu_probs", &grouped_gemm_glu_probs);
  m.impl("router_topk_fused", &router_topk_fused);
  m.impl("router_lse_bwd", &router_lse_bwd);
}
#endif

// `import moe_core._C` loads this library, which runs the registrations above. No Python API.
static struct PyModuleDef moe_core_module = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
PyMODINIT_FUNC PyInit__C(void) { return PyModule_Create(&moe_core_module); }