// balancing.cpp: the load-balancing ops: the aux-loss scores, the switch aux loss, the z-loss,
// the expert bias update, Sinkhorn and Sinkhorn routing, routing metrics and top-k overlap.
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>

#include "binding.h"

namespace moe_torch {

// fp64 inputs keep fp64 losses and scores (gradcheck); everything else computes in fp32.
static at::ScalarType compute_type(const Tensor &t) {
  return t.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

Tensor2 aux_loss_scores(const Device &d, const Tensor &logits_, int64_t topk,
                        string_view score_function, const optional<Tensor> &padding_mask) {
  check_dim(logits_, 2, "logits");
  check_float(logits_, "logits");
  const int64_t T = logits_.size(0), E = logits_.size(1);
  Tensor logits = logits_.contiguous(), mask;
  const uint8_t *m = padding_mask_ptr(padding_mask, mask, T, logits, "logits");
  moe_score_function_t sf = to_score_function(score_function);
  const OnDevice on(d, logits);
  Tensor scores = at::empty({T, E}, logits.options().dtype(compute_type(logits)));
  Tensor routing_map = at::empty({T, E}, logits.options().dtype(at::kBool));
  const Workspace ws = workspace(logits, d.aux_loss_scores_workspace_size(T, E, topk));
  check_status(d.aux_loss_scores_fwd(scores.data_ptr(), (uint8_t *)routing_map.data_ptr(),
                                     logits.data_ptr(), m, T, E, topk,
                                     to_moe_dtype(logits.scalar_type(), "logits"), sf, ws.ptr,
                                     ws.bytes, on.stream()),
               "aux_loss_scores");
  return {scores, routing_map};
}

Tensor aux_loss_scores_bwd(const Device &d, const Tensor &grad_scores_, const Tensor &logits_,
                           string_view score_function, const optional<Tensor> &padding_mask) {
  check_dim(logits_, 2, "logits");
  check_float(logits_, "logits");
  const int64_t T = logits_.size(0), E = logits_.size(1);
  check_dim(grad_scores_, 2, "grad_scores");
  check_float(grad_scores_, "grad_scores");
  check_size(grad_scores_, 0, T, "grad_scores", "logits.shape[0] (num_tokens)");
  check_size(grad_scores_, 1, E, "grad_scores", "logits.shape[1] (num_experts)");
  check_same_device(grad_scores_, logits_, "grad_scores", "logits");
  Tensor logits = logits_.contiguous(), mask;
  Tensor g = grad_scores_.to(compute_type(logits)).contiguous();
  const uint8_t *m = padding_mask_ptr(padding_mask, mask, T, logits, "logits");
  const OnDevice on(d, logits);
  Tensor grad_logits = at::empty_like(logits);
  check_status(d.aux_loss_scores_bwd(grad_logits.data_ptr(), g.data_ptr(), logits.data_ptr(), m, T,
                                     E, to_moe_dtype(logits.scalar_type(), "logits"),
                                     to_score_function(score_function), nullptr, 0, on.stream()),
               "aux_loss_scores_bwd");
  return grad_logits;
}

// Validates the switch-loss inputs; returns counts as fp32 and the total as a one-element fp64.
static Tensor3 switch_inputs(const Tensor &probs_, const Tensor &tokens_per_expert,
                             const Tensor &total_num_tokens) {
  check_dim(probs_, 2, "probs");
  check_float(probs_, "probs");
  check_dim(tokens_per_expert, 1, "tokens_per_expert");
  check_size(tokens_per_expert, 0, probs_.size(1), "tokens_per_expert", "probs.shape[1]");
  MOE_CHECK_TYPE(!tokens_per_expert.is_complex() && tokens_per_expert.scalar_type() != at::kBool,
                   "tokens_per_expert must be a real number dtype, got ",
                   tokens_per_expert.scalar_type());
  MOE_CHECK_VALUE(total_num_tokens.numel() == 1,
                    "total_num_tokens must have one element, got shape ", total_num_tokens.sizes());
  check_same_device(tokens_per_expert, probs_, "tokens_per_expert", "probs");
  check_same_device(total_num_tokens, probs_, "total_num_tokens", "probs");
  return {probs_.contiguous(), tokens_per_expert.to(at::kFloat).contiguous(),
          total_num_tokens.to(at::kDouble).reshape({1}).contiguous()};
}

static moe_switch_aux_loss_params_t switch_params(int64_t topk, int64_t num_experts, double coeff) {
  moe_switch_aux_loss_params_t p;
  p.topk = topk;
  p.num_experts = num_experts;
  p.coeff = coeff;
  return p;
}

Tensor switch_aux_loss(const Device &d, const Tensor &probs_, const Tensor &tokens_per_expert_,
                       const Tensor &total_num_tokens_, int64_t topk, int64_t num_experts,
                       double coeff, const optional<Tensor> &padding_mask) {
  auto [probs, tpe, total] = switch_inputs(probs_, tokens_per_expert_, total_num_tokens_);
  const int64_t T = probs.size(0), C = probs.size(1);
  Tensor mask;
  const uint8_t *m = padding_mask_ptr(padding_mask, mask, T, probs, "probs");
  moe_switch_aux_loss_params_t p = switch_params(topk, num_experts, coeff);
  const OnDevice on(d, probs);
  Tensor loss = at::empty({}, probs.options().dtype(compute_type(probs)));
  const Workspace ws = workspace(probs, d.switch_aux_loss_workspace_size(T, C));
  check_status(d.switch_aux_loss_fwd(loss.data_ptr(), probs.data_ptr(), tpe.data_ptr<float>(),
                                     total.data_ptr<double>(), m, T, C,
                                     to_moe_dtype(probs.scalar_type(), "probs"), &p, ws.ptr,
                                     ws.bytes, on.stream()),
               "switch_aux_loss");
  return loss;
}

Tensor switch_aux_loss_bwd(const Device &d, const Tensor &grad_loss_, const Tensor &probs_,
                           const Tensor &tokens_per_expert_, const Tensor &total_num_tokens_,
                           int64_t topk, int64_t num_experts, double coeff,
                           const optional<Tensor> &padding_mask) {
  auto [probs, tpe, total] = switch_inputs(probs_, tokens_per_expert_, total_num_tokens_);
  MOE_CHECK_VALUE(grad_loss_.numel() == 1, "grad_loss must have one element, got shape ",
                    grad_loss_.sizes());
  check_float(grad_loss_, "grad_loss");
  check_same_device(grad_loss_, probs, "grad_loss", "probs");
  const int64_t T = probs.size(0), C = probs.size(1);
  Tensor mask, g = grad_loss_.to(compute_type(probs)).reshape({1}).contiguous();
  const uint8_t *m = padding_mask_ptr(padding_mask, mask, T, probs, "probs");
  moe_switch_aux_loss_params_t p = switch_params(topk, num_experts, coeff);
  const OnDevice on(d, probs);
  Tensor grad_probs = at::empty_like(probs);
  check_status(d.switch_aux_loss_bwd(grad_probs.data_ptr(), g.data_ptr(), tpe.data_ptr<float>(),
                                     total.data_ptr<double>(), m, T, C,
                                     to_moe_dtype(probs.scalar_type(), "probs"), &p, nullptr, 0,
                                     on.stream()),
               "switch_aux_loss_bwd");
  return grad_probs;
}

Tensor z_loss(const Device &d, const Tensor &logits_, double coeff,
              const optional<Tensor> &padding_mask) {
  check_dim(logits_, 2, "logits");
  check_float(logits_, "logits");
  const int64_t T = logits_.size(0), E = logits_.size(1);
  Tensor logits = logits_.contiguous(), mask;
  const uint8_t *m = padding_mask_ptr(padding_mask, mask, T, logits, "logits");
  const OnDevice on(d, logits);
  Tensor loss = at::empty({}, logits.options().dtype(compute_type(logits)));
  const Workspace ws = workspace(logits, d.z_loss_workspace_size(T, E));
  check_status(d.z_loss_fwd(loss.data_ptr(), logits.data_ptr(), m, T, E, coeff,
                            to_moe_dtype(logits.scalar_type(), "logits"), ws.ptr, ws.bytes,
                            on.stream()),
               "z_loss");
  return loss;
}

Tensor z_loss_bwd(const Device &d, const Tensor &grad_loss_, const Tensor &logits_, double coeff,
                  const optional<Tensor> &padding_mask) {
  check_dim(logits_, 2, "logits");
  check_float(logits_, "logits");
  MOE_CHECK_VALUE(grad_loss_.numel() == 1, "grad_loss must have one element, got shape ",
                    grad_loss_.sizes());
  check_float(grad_loss_, "grad_loss");
  check_same_device(grad_loss_, logits_, "grad_loss", "logits");
  const int64_t T = logits_.size(0), E = logits_.size(1);
  Tensor logits = logits_.contiguous(), mask;
  Tensor g = grad_loss_.to(compute_type(logits)).reshape({1}).contiguous();
  const uint8_t *m = padding_mask_ptr(padding_mask, mask, T, logits, "logits");
  const OnDevice on(d, logits);
  Tensor grad_logits = at::empty_like(logits);
  const Workspace ws = workspace(logits, d.z_loss_workspace_size(T, E));
  check_status(d.z_loss_bwd(grad_logits.data_ptr(), g.data_ptr(), logits.data_ptr(), m, T, E, coeff,
                            to_moe_dtype(logits.scalar_type(), "logits"), ws.ptr, ws.bytes,
                            on.stream()),
               "z_loss_bwd");
  return grad_logits;
}


Tensor expert_bias_update(const Device &d, const Tensor &tokens_per_expert_,
                          const Tensor &expert_bias_, double update_rate) {
  MOE_CHECK_VALUE(expert_bias_.dim() == 1 || expert_bias_.dim() == 2,
                    "expert_bias must be 1-D [num_experts] or 2-D [num_layers, num_experts], got "
                    "a ", expert_bias_.dim(), "-D tensor of shape ", expert_bias_.sizes());
  check_dtype(expert_bias_, at::kFloat, "expert_bias");
  check_same_shape(tokens_per_expert_, "tokens_per_expert", expert_bias_, "expert_bias");
  MOE_CHECK_TYPE(!tokens_per_expert_.is_complex() &&
                       tokens_per_expert_.scalar_type() != at::kBool,
                   "tokens_per_expert must be a real number dtype, got ",
                   tokens_per_expert_.scalar_type());
  check_same_device(tokens_per_expert_, expert_bias_, "tokens_per_expert", "expert_bias");
  const int64_t E = expert_bias_.size(-1), L = expert_bias_.numel() / (E > 0 ? E : 1);
  MOE_CHECK_VALUE(E >= 1, "expert_bias must have at least one expert, got shape ",
                    expert_bias_.sizes());
  // Megatron's counts are fp32 tensors; integer counts promote to fp32 in its arithmetic too.
  Tensor counts = tokens_per_expert_.to(at::kFloat).contiguous();
  Tensor bias = expert_bias_.contiguous();
  const OnDevice on(d, bias);
  Tensor updated = at::empty_like(bias);
  check_status(d.expert_bias_update_fwd(updated.data_ptr<float>(), counts.data_ptr<float>(),
                                        bias.data_ptr<float>(), L, E, update_rate, nullptr, 0,
                                        on.stream()),
               "expert_bias_update");
  return updated;
}

Tensor sinkhorn(const Device &d, const Tensor &cost_, double tol, int64_t max_iters) {
  check_dim(cost_, 2, "cost");
  check_float(cost_, "cost");
  const int64_t T = cost_.size(0), E = cost_.size(1);
  Tensor cost = cost_.contiguous();
  const OnDevice on(d, cost);
  Tensor out = at::empty({T, E}, cost.options().dtype(compute_type(cost)));
  const Workspace ws = workspace(cost, d.sinkhorn_workspace_size(T, E, 0));
  check_status(d.sinkhorn_fwd(out.data_ptr(), cost.data_ptr(), T, E,
                              to_moe_dtype(cost.scalar_type(), "cost"), tol, max_iters, ws.ptr,
                              ws.bytes, on.stream()),
               "sinkhorn");
  return out;
}

Tensor2 sinkhorn_routing(const Device &d, const Tensor &logits_, int64_t topk, bool training,
                         double tol) {
  check_dim(logits_, 2, "logits");
  check_float(logits_, "logits");
  const int64_t T = logits_.size(0), E = logits_.size(1);
  Tensor logits = logits_.contiguous();
  const OnDevice on(d, logits);
  Tensor probs = at::empty({T, E}, logits.options());
  Tensor routing_map = at::empty({T, E}, logits.options().dtype(at::kBool));
  const Workspace ws = workspace(
      logits, d.sinkhorn_routing_workspace_size(T, E, topk, training ? 1 : 0));
  check_status(d.sinkhorn_routing_fwd(probs.data_ptr(), (uint8_t *)routing_map.data_ptr(),
                                      logits.data_ptr(), T, E, topk,
                                      to_moe_dtype(logits.scalar_type(), "logits"),
                                      training ? 1 : 0, tol, ws.ptr, ws.bytes, on.stream()),
               "sinkhorn_routing");
  return {probs, routing_map};
}

Tensor sinkhorn_routing_bwd(const Device &d, const Tensor &grad_probs_, const Tensor &logits_,
                            const Tensor &routing_map_, int64_t topk) {
  check_dim(logits_, 2, "logits");
  check_float(logits_, "logits");
  check_routing_map(routing_map_, "routing_map");
  check_float(grad_probs_, "grad_probs");
  check_same_shape(grad_probs_, "grad_probs", logits_, "logits");
  check_same_shape(routing_map_, "routing_map", logits_, "logits");
  check_same_device(grad_probs_, logits_, "grad_probs", "logits");
  check_same_device(routing_map_, logits_, "routing_map", "logits");
  const int64_t T = logits_.size(0), E = logits_.size(1);
  Tensor logits = logits_.contiguous(), map = routing_map_.contiguous();
  Tensor g = grad_probs_.to(logits.scalar_type()).contiguous();
  const OnDevice on(d, logits);
  Tensor grad_logits = at::empty_like(logits);
  check_status(d.sinkhorn_routing_bwd(grad_logits.data_ptr(), g.data_ptr(), logits.data_ptr(),
                                      (const uint8_t *)map.data_ptr(), T, E, topk,
                                      to_moe_dtype(logits.scalar_type(), "logits"), nullptr, 0,
                                      on.stream()),
               "sinkhorn_routing_bwd");
  return grad_logits;
}

Tensor2 routing_metrics(const Device &d, const Tensor &routing_map_,
                        const optional<Tensor> &scores_, const optional<Tensor> &padding_mask) {
  check_routing_map(routing_map_, "routing_map");
  const int64_t T = routing_map_.size(0), E = routing_map_.size(1);
  Tensor map = routing_map_.contiguous(), scores, mask;
  if (scores_.has_value()) {
    check_float(*scores_, "scores");
    check_same_shape(*scores_, "scores", map, "routing_map");
    check_same_device(*scores_, map, "scores", "routing_map");
    scores = scores_->contiguous();
  }
  const uint8_t *m = padding_mask_ptr(padding_mask, mask, T, map, "routing_map");
  const OnDevice on(d, map);
  Tensor counts = at::empty({E}, map.options().dtype(at::kLong));
  Tensor stats = at::empty({MOE_ROUTING_STATS}, map.options().dtype(at::kFloat));
  const Workspace ws = workspace(map, d.routing_metrics_workspace_size(T, E));
  check_status(d.routing_metrics_fwd(counts.data_ptr<int64_t>(), stats.data_ptr<float>(),
                                     (const uint8_t *)map.data_ptr(), data_or_null(scores), m, T, E,
                                     dtype_or(scores, "scores", MOE_DTYPE_FP32), ws.ptr, ws.bytes,
                                     on.stream()),
               "routing_metrics");
  return {counts, stats};
}

Tensor topk_overlap(const Device &d, const Tensor &indices_a_, const Tensor &indices_b_,
                    int64_t num_experts, const optional<Tensor> &padding_mask) {
  check_dim(indices_a_, 2, "indices_a");
  check_dim(indices_b_, 2, "indices_b");
  check_dtype(indices_a_, at::kLong, "indices_a");
  check_dtype(indices_b_, at::kLong, "indices_b");
  check_same_shape(indices_b_, "indices_b", indices_a_, "indices_a");
  check_same_device(indices_b_, indices_a_, "indices_b", "indices_a");
  const int64_t T = indices_a_.size(0), k = indices_a_.size(1);
  Tensor a = indices_a_.contiguous(), b = indices_b_.contiguous(), mask;
  const uint8_t *m = padding_mask_ptr(padding_mask, mask, T, a, "indices_a");
  const OnDevice on(d, a);
  Tensor overlap = at::empty({}, a.options().dtype(at::kFloat));
  const Workspace ws = workspace(a, d.topk_overlap_workspace_size(T, k));
  check_status(d.topk_overlap_fwd(overlap.data_ptr<float>(), a.data_ptr<int64_t>(),
                                  b.data_ptr<int64_t>(), m, T, k, num_experts, ws.ptr, ws.bytes,
                                  on.stream()),
               "topk_overlap");
  return overlap;
}

}  // namespace moe_torch
