// router.cpp: the router ops: the gating linear (logits = inp · weightᵀ + bias in the router
// dtype), the top-k router in its compact [T, topk] and dense [T, E] layouts, and the fused router
// that also returns the aux-loss scores and the z-loss logsumexp from the same pass.
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>

#include "binding.h"

namespace moe_torch {

// The schema's options as the C params. The rules beyond Megatron's (moe_core/ops/router_topk.py)
// are `normalize` (None: Megatron's rule, False: none, True: always renormalised, i.e. the
// moe_topk_norm_t) and `group_score_topk` (0: topk / group_topk); the core checks every value.
static moe_router_topk_params_t make_topk_params(int64_t topk, bool use_pre_softmax,
                                                 int64_t num_groups, int64_t group_topk,
                                                 double scaling_factor,
                                                 string_view score_function,
                                                 optional<bool> normalize,
                                                 int64_t group_score_topk) {
  moe_router_topk_params_t p;
  p.norm = !normalize.has_value() ? MOE_TOPK_NORM_DEFAULT
           : *normalize           ? MOE_TOPK_NORM_SUM
                                  : MOE_TOPK_NORM_NONE;
  p.group_score_topk = group_score_topk;
  p.topk = topk;
  p.num_groups = num_groups;
  p.group_topk = group_topk;
  p.use_pre_softmax = use_pre_softmax ? 1 : 0;
  p.score_function = to_score_function(score_function);
  p.scaling_factor = scaling_factor;
  return p;
}

// ---- router_gating_linear -----------------------------------------------------------------------

Tensor router_gating_linear(const Device &d, const Tensor &inp_, const Tensor &weight_,
                            const optional<Tensor> &bias_, at::ScalarType router_dtype) {
  check_dim(inp_, 2, "inp");
  check_dim(weight_, 2, "weight");
  check_float(inp_, "inp");
  check_float(weight_, "weight");
  MOE_CHECK_TYPE(at::isFloatingType(router_dtype), "router_dtype must be a float dtype, got ",
                   router_dtype);
  check_same_device(weight_, inp_, "weight", "inp");
  check_size(weight_, 1, inp_.size(1), "weight", "inp.shape[1] (hidden)");
  const int64_t T = inp_.size(0), H = inp_.size(1), E = weight_.size(0);
  Tensor inp = inp_.contiguous(), weight = weight_.contiguous(), bias;
  if (bias_.has_value()) {
    bias = bias_->contiguous();
    check_dim(bias, 1, "bias");
    check_size(bias, 0, E, "bias", "weight.shape[0] (num_experts)");
    check_dtype(bias, weight.scalar_type(), "bias");
    check_same_device(bias, inp, "bias", "inp");
  }
  const moe_dtype_t id = to_moe_dtype(inp.scalar_type(), "inp");
  const moe_dtype_t wd = to_moe_dtype(weight.scalar_type(), "weight");
  const moe_dtype_t rd = to_moe_dtype(router_dtype, "router_dtype");
  const OnDevice on(d, inp);
  Tensor logits = at::empty({T, E}, inp.options().dtype(router_dtype));
  const Workspace ws =
      workspace(inp, d.router_gating_linear_workspace_size(T, H, E, id, wd, rd, 0));
  check_status(d.router_gating_linear_fwd(logits.data_ptr(), inp.data_ptr(), weight.data_ptr(),
                                          data_or_null(bias), T, H, E, id, wd, rd, ws.ptr, ws.bytes,
                                          on.stream()),
               "router_gating_linear");
  return logits;
}

Tensor3 router_gating_linear_bwd(const Device &d, const Tensor &grad_logits_, const Tensor &inp_,
                                 const Tensor &weight_) {
  check_dim(grad_logits_, 2, "grad_logits");
  check_dim(inp_, 2, "inp");
  check_dim(weight_, 2, "weight");
  check_float(grad_logits_, "grad_logits");
  check_float(inp_, "inp");
  check_float(weight_, "weight");
  const int64_t T = inp_.size(0), H = inp_.size(1), E = weight_.size(0);
  // a weight swapped between forward and backward must not be read past its end
  check_size(weight_, 1, H, "weight", "inp.shape[1] (hidden)");
  check_size(grad_logits_, 0, T, "grad_logits", "inp.shape[0] (num_tokens)");
  check_size(grad_logits_, 1, E, "grad_logits", "weight.shape[0] (num_experts)");
  check_same_device(inp_, grad_logits_, "inp", "grad_logits");
  check_same_device(weight_, grad_logits_, "weight", "grad_logits");
  Tensor g = grad_logits_.contiguous(), inp = inp_.contiguous(), weight = weight_.contiguous();
  const moe_dtype_t id = to_moe_dtype(inp.scalar_type(), "inp");
  const moe_dtype_t wd = to_moe_dtype(weight.scalar_type(), "weight");
  const moe_dtype_t rd = to_moe_dtype(g.scalar_type(), "grad_logits");
  const OnDevice on(d, g);
  Tensor grad_inp = at::empty_like(inp), grad_weight = at::empty_like(weight);
  Tensor grad_bias = at::empty({E}, weight.options());
  const Workspace ws = workspace(g, d.router_gating_linear_workspace_size(T, H, E, id, wd, rd, 1));
  check_status(d.router_gating_linear_bwd(grad_inp.data_ptr(), grad_weight.data_ptr(),
                                          grad_bias.data_ptr(), g.data_ptr(), inp.data_ptr(),
                                          weight.data_ptr(), T, H, E, id, wd, rd, ws.ptr, ws.bytes,
                                          on.stream()),
               "router_gating_linear_bwd");
  return {grad_inp, grad_weight, grad_bias};
}

// ---- router_topk --------------------------------------------------------------------------------

// The routing inputs every router op validates alike: logits [T, E], the optional fp32 bias [E],
// and the options checked against E.
struct TopkInputs {
  Tensor logits, bias;
  moe_router_topk_params_t p;
  int64_t T, E;
};

static TopkInputs topk_inputs(const Tensor &logits_, int64_t topk, bool use_pre_softmax,
                              int64_t num_groups, int64_t group_topk, double scaling_factor,
                              string_view score_function, const optional<Tensor> &expert_bias_,
                              optional<bool> normalize, int64_t group_score_topk,
                              const char *op) {
  check_dim(logits_, 2, "logits");
  check_float(logits_, "logits");
  TopkInputs in;
  in.T = logits_.size(0), in.E = logits_.size(1);
  MOE_CHECK_VALUE(in.E >= 1, "logits must have at least one expert column, got shape ",
                    logits_.sizes());
  in.logits = logits_.contiguous();
  if (expert_bias_.has_value()) {
    in.bias = expert_bias_->contiguous();
    check_dim(in.bias, 1, "expert_bias");
    check_size(in.bias, 0, in.E, "expert_bias", "logits.shape[1] (num_experts)");
    check_dtype(in.bias, at::kFloat, "expert_bias");
    check_same_device(in.bias, in.logits, "expert_bias", "logits");
  }
  in.p = make_topk_params(topk, use_pre_softmax, num_groups, group_topk, scaling_factor,
                          score_function, normalize, group_score_topk);
  // topk sizes the outputs: the core's check of the params runs before anything is allocated
  check_status(moe_router_topk_check(&in.p, in.E, in.bias.defined()), op);
  return in;
}

Tensor2 router_topk(const Device &d, const Tensor &logits_, int64_t topk, bool use_pre_softmax,
                    int64_t num_groups, int64_t group_topk, double scaling_factor,
                    string_view score_function, const optional<Tensor> &expert_bias_,
                    optional<bool> normalize, int64_t group_score_topk) {
  TopkInputs in = topk_inputs(logits_, topk, use_pre_softmax, num_groups, group_topk,
                              scaling_factor, score_function, expert_bias_, normalize,
                              group_score_topk, "router_topk");
  const Tensor &logits = in.logits;
  const OnDevice on(d, logits);
  Tensor probs = at::empty({in.T, topk}, logits.options());
  Tensor indices = at::empty({in.T, topk}, logits.options().dtype(at::kLong));
  const Workspace ws = workspace(logits, d.router_topk_workspace_size(in.T, in.E, &in.p));
  check_status(d.router_topk_fwd(probs.data_ptr(), indices.data_ptr<int64_t>(), logits.data_ptr(),
                                 data_or_null<float>(in.bias), in.T, in.E,
                                 to_moe_dtype(logits.scalar_type(), "logits"), &in.p, ws.ptr,
                                 ws.bytes, on.stream()),
               "router_topk");
  return {probs, indices};
}

template <bool dense>
Tensor RouterTopkBwd<dense>::op(const Device &d, const Tensor &grad_probs_, const Tensor &logits_,
                                const Tensor &topk_indices_, int64_t topk, bool use_pre_softmax,
                                int64_t num_groups, int64_t group_topk, double scaling_factor,
                                string_view score_function, optional<bool> normalize,
                                int64_t group_score_topk) {
  check_dim(logits_, 2, "logits");
  check_float(logits_, "logits");
  const int64_t T = logits_.size(0), E = logits_.size(1);
  MOE_CHECK_VALUE(E >= 1, "logits must have at least one expert column, got shape ",
                  logits_.sizes());
  check_dim(grad_probs_, 2, "grad_probs");
  check_float(grad_probs_, "grad_probs");
  check_dim(topk_indices_, 2, "topk_indices");
  check_size(grad_probs_, 0, T, "grad_probs", "logits.shape[0] (num_tokens)");
  if (dense) check_size(grad_probs_, 1, E, "grad_probs", "logits.shape[1] (num_experts)");
  else check_size(grad_probs_, 1, topk, "grad_probs", "topk");
  check_size(topk_indices_, 0, T, "topk_indices", "logits.shape[0] (num_tokens)");
  check_size(topk_indices_, 1, topk, "topk_indices", "topk");
  check_dtype(topk_indices_, at::kLong, "topk_indices");
  check_same_device(grad_probs_, logits_, "grad_probs", "logits");
  check_same_device(topk_indices_, logits_, "topk_indices", "logits");
  Tensor logits = logits_.contiguous(), indices = topk_indices_.contiguous();
  Tensor grad_probs = grad_probs_.to(logits.scalar_type()).contiguous();
  moe_router_topk_params_t p = make_topk_params(topk, use_pre_softmax, num_groups, group_topk,
                                                scaling_factor, score_function, normalize,
                                                group_score_topk);
  const OnDevice on(d, logits);
  Tensor grad_logits = at::empty_like(logits);
  const Workspace ws = workspace(logits, d.router_topk_workspace_size(T, E, &p));
  const moe_dtype_t dt = to_moe_dtype(logits.scalar_type(), "logits");
  const auto fn = dense ? d.router_topk_dense_bwd : d.router_topk_bwd;
  const moe_status_t st = fn(grad_logits.data_ptr(), grad_probs.data_ptr(), logits.data_ptr(),
                             indices.data_ptr<int64_t>(), T, E, dt, &p, ws.ptr, ws.bytes,
                             on.stream());
  check_status(st, dense ? "router_topk_dense_bwd" : "router_topk_bwd");
  return grad_logits;
}

template struct RouterTopkBwd<false>;
template struct RouterTopkBwd<true>;

// Outputs not asked for come back empty ([0, E] and [0]) so the schema stays all-Tensor.
// The dense router with its optional extras; `op` names the caller in messages.
static Tensor6 fused_router(const Device &d, const TopkInputs &in, int64_t topk,
                            const optional<Tensor> &padding_mask, bool with_aux, bool with_lse,
                            const char *op) {
  const Tensor &logits = in.logits;
  const int64_t T = in.T, E = in.E;
  Tensor mask;
  const uint8_t *m = padding_mask_ptr(padding_mask, mask, T, logits, "logits");
  const OnDevice on(d, logits);
  const at::ScalarType st = logits.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  Tensor probs = at::empty({T, E}, logits.options());
  Tensor routing_map = at::empty({T, E}, logits.options().dtype(at::kBool));
  Tensor indices = at::empty({T, topk}, logits.options().dtype(at::kLong));
  Tensor aux_scores = at::empty({with_aux ? T : 0, E}, logits.options().dtype(st));
  Tensor aux_map = at::empty({with_aux ? T : 0, E}, logits.options().dtype(at::kBool));
  Tensor lse = at::empty({with_lse ? T : 0}, logits.options().dtype(at::kDouble));
  moe_router_topk_extras_t extras;
  extras.aux_scores = with_aux ? aux_scores.data_ptr() : nullptr;
  extras.aux_map = with_aux ? (uint8_t *)aux_map.data_ptr() : nullptr;
  extras.lse = with_lse ? lse.data_ptr<double>() : nullptr;
  extras.padding_mask = m;
  const moe_dtype_t dt = to_moe_dtype(logits.scalar_type(), "logits");
  const Workspace ws = workspace(
      logits, d.router_topk_fused_workspace_size(T, E, &in.p, dt, with_aux));
  check_status(d.router_topk_fused_fwd(probs.data_ptr(), (uint8_t *)routing_map.data_ptr(),
                                       indices.data_ptr<int64_t>(), &extras, logits.data_ptr(),
                                       data_or_null<float>(in.bias), T, E, dt, &in.p, ws.ptr,
                                       ws.bytes, on.stream()),
               op);
  return {probs, routing_map, indices, aux_scores, aux_map, lse};
}

// Outputs not asked for come back empty ([0, E] and [0]) so the schema stays all-Tensor.
Tensor6 router_topk_fused(const Device &d, const Tensor &logits, int64_t topk, bool use_pre_softmax,
                          int64_t num_groups, int64_t group_topk, double scaling_factor,
                          string_view score_function, const optional<Tensor> &expert_bias,
                          const optional<Tensor> &padding_mask, bool with_aux, bool with_lse,
                          optional<bool> normalize, int64_t group_score_topk) {
  const TopkInputs in = topk_inputs(logits, topk, use_pre_softmax, num_groups, group_topk,
                                    scaling_factor, score_function, expert_bias, normalize,
                                    group_score_topk, "router_topk_fused");
  return fused_router(d, in, topk, padding_mask, with_aux, with_lse, "router_topk_fused");
}

// The fused router in Megatron's dense layout: (probs [T, E], routing_map [T, E], indices [T, k]).
Tensor3 router_topk_dense(const Device &d, const Tensor &logits, int64_t topk, bool use_pre_softmax,
                          int64_t num_groups, int64_t group_topk, double scaling_factor,
                          string_view score_function, const optional<Tensor> &expert_bias,
                          optional<bool> normalize, int64_t group_score_topk) {
  const TopkInputs in = topk_inputs(logits, topk, use_pre_softmax, num_groups, group_topk,
                                    scaling_factor, score_function, expert_bias, normalize,
                                    group_score_topk, "router_topk");
  auto out = fused_router(d, in, topk, c10::nullopt, false, false, "router_topk_dense");
  return {std::get<0>(out), std::get<1>(out), std::get<2>(out)};
}

Tensor router_lse_bwd(const Device &d, const Tensor &grad_lse_, const Tensor &logits_,
                      const Tensor &lse_, const optional<Tensor> &padding_mask) {
  check_dim(logits_, 2, "logits");
  check_float(logits_, "logits");
  const int64_t T = logits_.size(0), E = logits_.size(1);
  check_dim(grad_lse_, 1, "grad_lse");
  check_float(grad_lse_, "grad_lse");
  check_dim(lse_, 1, "lse");
  check_size(grad_lse_, 0, T, "grad_lse", "logits.shape[0] (num_tokens)");
  check_size(lse_, 0, T, "lse", "logits.shape[0] (num_tokens)");
  check_dtype(lse_, at::kDouble, "lse");
  check_same_device(grad_lse_, logits_, "grad_lse", "logits");
  check_same_device(lse_, logits_, "lse", "logits");
  Tensor logits = logits_.contiguous(), lse = lse_.contiguous(), mask;
  Tensor g = grad_lse_.to(at::kDouble).contiguous();
  const uint8_t *m = padding_mask_ptr(padding_mask, mask, T, logits, "logits");
  const OnDevice on(d, logits);
  Tensor grad_logits = at::empty_like(logits);
  check_status(d.router_lse_bwd(grad_logits.data_ptr(), g.data_ptr<double>(), logits.data_ptr(),
                                lse.data_ptr<double>(), m, T, E,
                                to_moe_dtype(logits.scalar_type(), "logits"), nullptr, 0,
                                on.stream()),
               "router_lse_bwd");
  return grad_logits;
}

}  // namespace moe_torch
