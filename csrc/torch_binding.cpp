// torch_binding.cpp: the only file that includes torch. It registers the moe_core ops with the
// PyTorch dispatcher (TORCH_LIBRARY schemas, CPU and CUDA implementations) and, for each call,
// validates the tensors with messages that name the argument, allocates the outputs, and calls
// the C ABI on the current stream. Nothing else lives here: no math, no policy.
#include <Python.h>

#include <ATen/ATen.h>
#include <ATen/MemoryOverlap.h>
#include <torch/library.h>

#ifdef MOE_CORE_WITH_CUDA
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#endif

#include <cinttypes>
#include <cstdio>
#include <string>

#include "moe_core.h"
#include "common.h"  // the core's checked int64 arithmetic (moe_checked_mul_i64)

namespace {

// ---- messages ---------------------------------------------------------------------------------
// Error messages are assembled with plain string appends and snprintf, never through an ostream
// (c10::str): on a machine whose torch was built with another libstdc++ than this extension, a
// numeric ostream insertion instantiated here crashed inside the locale machinery. So every
// check below builds its text with moe_cat() and throws c10's typed error directly.

void put(std::string &s, const char *v) { s += v; }
void put(std::string &s, const std::string &v) { s += v; }
void put(std::string &s, c10::string_view v) { s.append(v.data(), v.size()); }
void put(std::string &s, int v) { s += std::to_string(v); }
void put(std::string &s, long v) { s += std::to_string(v); }
void put(std::string &s, long long v) { s += std::to_string(v); }
void put(std::string &s, unsigned long v) { s += std::to_string(v); }
void put(std::string &s, unsigned long long v) { s += std::to_string(v); }
void put(std::string &s, double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%g", v);
  s += buf;
}
void put(std::string &s, at::IntArrayRef v) {
  s += "[";
  for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
  s += "]";
}
void put(std::string &s, at::ScalarType v) { s += c10::toString(v); }
void put(std::string &s, const at::Device &d) {
  s += c10::DeviceTypeName(d.type(), /*lower_case=*/true);
  if (d.has_index()) s += ":" + std::to_string((int)d.index());
}

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

// ---- validation -------------------------------------------------------------------------------

moe_dtype_t to_moe_dtype(at::ScalarType st, const char *name) {
  switch (st) {
    case at::kFloat: return MOE_DTYPE_FP32;
    case at::kDouble: return MOE_DTYPE_FP64;
    case at::kHalf: return MOE_DTYPE_FP16;
    case at::kBFloat16: return MOE_DTYPE_BF16;
    case at::kInt: return MOE_DTYPE_INT32;
    case at::kLong: return MOE_DTYPE_INT64;
    case at::kBool: return MOE_DTYPE_BOOL;
    default: MOE_CHECK_TYPE(false, name, " has unsupported dtype ", st);
  }
  return MOE_DTYPE_FP32;
}

void check_float(const at::Tensor &t, const char *name) {
  MOE_CHECK_TYPE(at::isFloatingType(t.scalar_type()) && t.scalar_type() != at::kFloat8_e4m3fn &&
                       t.scalar_type() != at::kFloat8_e5m2,
                   name, " must be float32, float64, float16 or bfloat16, got ", t.scalar_type());
}

void check_dtype(const at::Tensor &t, at::ScalarType st, const char *name) {
  MOE_CHECK_TYPE(t.scalar_type() == st, name, " must be ", st, ", got ", t.scalar_type());
}

void check_dim(const at::Tensor &t, int64_t dim, const char *name) {
  MOE_CHECK_VALUE(t.dim() == dim, name, " must be ", dim, "-D, got a ", t.dim(),
                    "-D tensor of shape ", t.sizes());
}

void check_size(const at::Tensor &t, int64_t dim, int64_t size, const char *name,
                const char *what) {
  MOE_CHECK_VALUE(t.size(dim) == size, name, ".shape[", dim, "] must equal ", what, " (", size,
                    "), got shape ", t.sizes());
}

void check_same_device(const at::Tensor &t, const at::Tensor &ref, const char *name,
                       const char *ref_name) {
  MOE_CHECK_VALUE(t.device() == ref.device(), name, " is on ", t.device(), " but ", ref_name,
                    " is on ", ref.device(), "; all tensors must be on one device");
}

// Raises the C core's message: ValueError for a bad argument, RuntimeError otherwise.
void check_status(moe_status_t status, const char *op) {
  if (status == MOE_OK) return;
  std::string msg = std::string(op) + ": " + moe_last_error();
  MOE_CHECK_VALUE(status != MOE_ERR_INVALID_ARGUMENT, msg);
  MOE_CHECK_RUNTIME(false, msg, " (", moe_status_string(status), ")");
}

moe_score_function_t to_score_function(c10::string_view name) {
  if (name == "softmax") return MOE_SCORE_SOFTMAX;
  if (name == "sigmoid") return MOE_SCORE_SIGMOID;
  if (name == "sqrtsoftplus") return MOE_SCORE_SQRTSOFTPLUS;
  MOE_CHECK_VALUE(false, "score_function must be 'softmax', 'sigmoid' or 'sqrtsoftplus', got '",
                    std::string(name), "'");
  return MOE_SCORE_SOFTMAX;
}

// routing_mode packs the rules beyond Megatron's (moe_core/ops/router_topk.py, routing_mode):
// bits 0-1 the moe_topk_norm_t, bits 2.. the group_score_topk (0: topk / group_topk).
moe_router_topk_params_t make_topk_params(int64_t topk, bool use_pre_softmax, int64_t num_groups,
                                          int64_t group_topk, double scaling_factor,
                                          c10::string_view score_function, int64_t routing_mode) {
  MOE_CHECK_VALUE(routing_mode >= 0, "routing_mode must be >= 0, got ", routing_mode);
  moe_router_topk_params_t p;
  p.norm = (moe_topk_norm_t)(routing_mode & 3);
  p.group_score_topk = routing_mode >> 2;
  p.topk = topk;
  p.num_groups = num_groups;
  p.group_topk = group_topk;
  p.use_pre_softmax = use_pre_softmax ? 1 : 0;
  p.score_function = to_score_function(score_function);
  p.scaling_factor = scaling_factor;
  return p;
}

bool on_cuda(const at::Tensor &t) { return t.device().is_cuda(); }

void *stream_of(const at::Tensor &t) {
#ifdef MOE_CORE_WITH_CUDA
  if (on_cuda(t)) return c10::cuda::getCurrentCUDAStream(t.device().index()).stream();
#endif
  (void)t;
  return nullptr;
}

#ifdef MOE_CORE_WITH_CUDA
#define MOE_DEVICE_GUARD(t) c10::cuda::OptionalCUDAGuard moe_guard_(on_cuda(t) ? \
    c10::optional<c10::Device>((t).device()) : c10::nullopt)
#define MOE_CALL(t, fn, ...) (on_cuda(t) ? moe_cuda_##fn(__VA_ARGS__) : moe_##fn(__VA_ARGS__))
#else
#define MOE_DEVICE_GUARD(t) (void)0
#define MOE_CALL(t, fn, ...) moe_##fn(__VA_ARGS__)
#endif

// Workspace bytes: the CPU expression, or the CUDA one for a CUDA tensor (CUDA builds only).
#ifdef MOE_CORE_WITH_CUDA
#define MOE_WS_BYTES(t, cpu_bytes, cuda_bytes) (on_cuda(t) ? (size_t)(cuda_bytes) : (size_t)(cpu_bytes))
#else
#define MOE_WS_BYTES(t, cpu_bytes, cuda_bytes) ((size_t)(cpu_bytes))
#endif

// Every workspace is allocated here, so a size function's overflow sentinel is always caught:
// MOE_SIZE_OVERFLOW becomes a ValueError with the size function's message (which names the
// function, the argument and its value) instead of a request for SIZE_MAX bytes.
at::Tensor workspace_for(const at::Tensor &like, size_t bytes) {
  MOE_CHECK_VALUE(bytes != MOE_SIZE_OVERFLOW, moe_last_error());
  return at::empty({(int64_t)bytes}, like.options().dtype(at::kByte));
}

// ---- router_gating_linear ---------------------------------------------------------------------

at::Tensor router_gating_linear(const at::Tensor &inp_, const at::Tensor &weight_,
                                const c10::optional<at::Tensor> &bias_,
                                at::ScalarType router_dtype) {
  check_dim(inp_, 2, "inp");
  check_dim(weight_, 2, "weight");
  check_float(inp_, "inp");
  check_float(weight_, "weight");
  MOE_CHECK_TYPE(at::isFloatingType(router_dtype), "router_dtype must be a float dtype, got ",
                   router_dtype);
  check_same_device(weight_, inp_, "weight", "inp");
  check_size(weight_, 1, inp_.size(1), "weight", "inp.shape[1] (hidden)");
  const int64_t T = inp_.size(0), H = inp_.size(1), E = weight_.size(0);
  at::Tensor inp = inp_.contiguous(), weight = weight_.contiguous(), bias;
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
  MOE_DEVICE_GUARD(inp);
  at::Tensor logits = at::empty({T, E}, inp.options().dtype(router_dtype));
  at::Tensor ws = workspace_for(
      inp, T == 0 ? 0 : MOE_WS_BYTES(inp, 0, moe_cuda_router_gating_linear_workspace_size(
                                              T, H, E, id, wd, rd, 0)));
  check_status(MOE_CALL(inp, router_gating_linear_fwd, logits.data_ptr(), inp.data_ptr(),
                        weight.data_ptr(), bias.defined() ? bias.data_ptr() : nullptr, T, H, E, id,
                        wd, rd, ws.data_ptr(), (size_t)ws.numel(), stream_of(inp)),
               "router_gating_linear");
  return logits;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> router_gating_linear_bwd(
    const at::Tensor &grad_logits_, const at::Tensor &inp_, const at::Tensor &weight_) {
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
  at::Tensor g = grad_logits_.contiguous(), inp = inp_.contiguous(), weight = weight_.contiguous();
  const moe_dtype_t id = to_moe_dtype(inp.scalar_type(), "inp");
  const moe_dtype_t wd = to_moe_dtype(weight.scalar_type(), "weight");
  const moe_dtype_t rd = to_moe_dtype(g.scalar_type(), "grad_logits");
  MOE_DEVICE_GUARD(g);
  at::Tensor grad_inp = at::empty_like(inp), grad_weight = at::empty_like(weight);
  at::Tensor grad_bias = at::empty({E}, weight.options());
  at::Tensor ws = workspace_for(
      g, MOE_WS_BYTES(g, 0, moe_cuda_router_gating_linear_workspace_size(T, H, E, id, wd, rd, 1)));
  check_status(MOE_CALL(g, router_gating_linear_bwd, grad_inp.data_ptr(), grad_weight.data_ptr(),
                        grad_bias.data_ptr(), g.data_ptr(), inp.data_ptr(), weight.data_ptr(), T,
                        H, E, id, wd, rd, ws.data_ptr(), (size_t)ws.numel(), stream_of(g)),
               "router_gating_linear_bwd");
  return {grad_inp, grad_weight, grad_bias};
}

// ---- router_topk ------------------------------------------------------------------------------

at::Tensor topk_workspace(const at::Tensor &logits, const moe_router_topk_params_t &p) {
  const int64_t T = logits.size(0), E = logits.size(1);
  size_t bytes = on_cuda(logits) ?
#ifdef MOE_CORE_WITH_CUDA
                                 moe_cuda_router_topk_workspace_size(T, E, &p)
#else
                                 0
#endif
                                 : moe_router_topk_workspace_size(T, E, &p);
  return workspace_for(logits, bytes);
}

// The routing inputs every router op validates alike: logits [T, E], the optional fp32 bias [E],
// and the options checked against E.
struct TopkInputs {
  at::Tensor logits, bias;
  moe_router_topk_params_t p;
  int64_t T, E;
};

TopkInputs topk_inputs(const at::Tensor &logits_, int64_t topk, bool use_pre_softmax,
                       int64_t num_groups, int64_t group_topk, double scaling_factor,
                       c10::string_view score_function,
                       const c10::optional<at::Tensor> &expert_bias_, int64_t routing_mode,
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
                          score_function, routing_mode);
  check_status(moe_router_topk_check(&in.p, in.E, in.bias.defined()), op);
  return in;
}

std::tuple<at::Tensor, at::Tensor> router_topk(const at::Tensor &logits_, int64_t topk,
                                               bool use_pre_softmax, int64_t num_groups,
                                               int64_t group_topk, double scaling_factor,
                                               c10::string_view score_function,
                                               const c10::optional<at::Tensor> &expert_bias_,
                                               int64_t routing_mode) {
  TopkInputs in = topk_inputs(logits_, topk, use_pre_softmax, num_groups, group_topk,
                              scaling_factor, score_function, expert_bias_, routing_mode,
                              "router_topk");
  const at::Tensor &logits = in.logits;
  MOE_DEVICE_GUARD(logits);
  at::Tensor probs = at::empty({in.T, topk}, logits.options());
  at::Tensor indices = at::empty({in.T, topk}, logits.options().dtype(at::kLong));
  at::Tensor ws = topk_workspace(logits, in.p);
  check_status(MOE_CALL(logits, router_topk_fwd, probs.data_ptr(), indices.data_ptr<int64_t>(),
                        logits.data_ptr(),
                        in.bias.defined() ? in.bias.data_ptr<float>() : nullptr, in.T, in.E,
                        to_moe_dtype(logits.scalar_type(), "logits"), &in.p, ws.data_ptr(),
                        (size_t)ws.numel(), stream_of(logits)),
               "router_topk");
  return {probs, indices};
}

// Backward of router_topk (grad_probs [T, topk]) and of the dense routers (grad_probs [T, E]).
at::Tensor topk_bwd(const at::Tensor &grad_probs_, const at::Tensor &logits_,
                    const at::Tensor &topk_indices_, int64_t topk, bool use_pre_softmax,
                    int64_t num_groups, int64_t group_topk, double scaling_factor,
                    c10::string_view score_function, int64_t routing_mode, bool dense) {
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
  at::Tensor logits = logits_.contiguous(), indices = topk_indices_.contiguous();
  at::Tensor grad_probs = grad_probs_.to(logits.scalar_type()).contiguous();
  moe_router_topk_params_t p = make_topk_params(topk, use_pre_softmax, num_groups, group_topk,
                                                scaling_factor, score_function, routing_mode);
  MOE_DEVICE_GUARD(logits);
  at::Tensor grad_logits = at::empty_like(logits);
  at::Tensor ws = topk_workspace(logits, p);
  const moe_dtype_t dt = to_moe_dtype(logits.scalar_type(), "logits");
  const moe_status_t st =
      dense ? MOE_CALL(logits, router_topk_dense_bwd, grad_logits.data_ptr(),
                       grad_probs.data_ptr(), logits.data_ptr(), indices.data_ptr<int64_t>(), T, E,
                       dt, &p, ws.data_ptr(), (size_t)ws.numel(), stream_of(logits))
            : MOE_CALL(logits, router_topk_bwd, grad_logits.data_ptr(), grad_probs.data_ptr(),
                       logits.data_ptr(), indices.data_ptr<int64_t>(), T, E, dt, &p,
                       ws.data_ptr(), (size_t)ws.numel(), stream_of(logits));
  check_status(st, dense ? "router_topk_dense_bwd" : "router_topk_bwd");
  return grad_logits;
}

at::Tensor router_topk_bwd(const at::Tensor &grad_probs, const at::Tensor &logits,
                           const at::Tensor &topk_indices, int64_t topk, bool use_pre_softmax,
                           int64_t num_groups, int64_t group_topk, double scaling_factor,
                           c10::string_view score_function, int64_t routing_mode) {
  return topk_bwd(grad_probs, logits, topk_indices, topk, use_pre_softmax, num_groups,
                  group_topk, scaling_factor, score_function, routing_mode, false);
}

at::Tensor router_topk_dense_bwd(const at::Tensor &grad_probs, const at::Tensor &logits,
                                 const at::Tensor &topk_indices, int64_t topk,
                                 bool use_pre_softmax, int64_t num_groups, int64_t group_topk,
                                 double scaling_factor, c10::string_view score_function,
                                 int64_t routing_mode) {
  return topk_bwd(grad_probs, logits, topk_indices, topk, use_pre_softmax, num_groups,
                  group_topk, scaling_factor, score_function, routing_mode, true);
}

// ---- router_topk_fused (issue 6: the aux-loss scores and the z-loss lse in the router's pass) --

const uint8_t *padding_mask_ptr(const c10::optional<at::Tensor> &mask_, at::Tensor &keep,
                                int64_t num_tokens, const at::Tensor &ref, const char *ref_name);

// Outputs not asked for come back empty ([0, E] and [0]) so the schema stays all-Tensor.
// The dense router with its optional extras; `op` names the caller in messages.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> fused_router(
    const TopkInputs &in, int64_t topk, const c10::optional<at::Tensor> &padding_mask,
    bool with_aux, bool with_lse, const char *op) {
  const at::Tensor &logits = in.logits;
  const int64_t T = in.T, E = in.E;
  at::Tensor mask;
  const uint8_t *m = padding_mask_ptr(padding_mask, mask, T, logits, "logits");
  MOE_DEVICE_GUARD(logits);
  const at::ScalarType st = logits.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  at::Tensor probs = at::empty({T, E}, logits.options());
  at::Tensor routing_map = at::empty({T, E}, logits.options().dtype(at::kBool));
  at::Tensor indices = at::empty({T, topk}, logits.options().dtype(at::kLong));
  at::Tensor aux_scores = at::empty({with_aux ? T : 0, E}, logits.options().dtype(st));
  at::Tensor aux_map = at::empty({with_aux ? T : 0, E}, logits.options().dtype(at::kBool));
  at::Tensor lse = at::empty({with_lse ? T : 0}, logits.options().dtype(at::kDouble));
  moe_router_topk_extras_t extras;
  extras.aux_scores = with_aux ? aux_scores.data_ptr() : nullptr;
  extras.aux_map = with_aux ? (uint8_t *)aux_map.data_ptr() : nullptr;
  extras.lse = with_lse ? lse.data_ptr<double>() : nullptr;
  extras.padding_mask = m;
  const moe_dtype_t dt = to_moe_dtype(logits.scalar_type(), "logits");
  size_t bytes = on_cuda(logits) ?
#ifdef MOE_CORE_WITH_CUDA
                                 moe_cuda_router_topk_fused_workspace_size(T, E, &in.p, dt, with_aux)
#else
                                 0
#endif
                                 : moe_router_topk_workspace_size(T, E, &in.p);
  at::Tensor ws = bytes ? workspace_for(logits, bytes) : at::Tensor();
  check_status(MOE_CALL(logits, router_topk_fused_fwd, probs.data_ptr(),
                        (uint8_t *)routing_map.data_ptr(), indices.data_ptr<int64_t>(), &extras,
                        logits.data_ptr(),
                        in.bias.defined() ? in.bias.data_ptr<float>() : nullptr, T, E, dt, &in.p,
                        ws.defined() ? ws.data_ptr() : nullptr, bytes, stream_of(logits)),
               op);
  return {probs, routing_map, indices, aux_scores, aux_map, lse};
}

// Outputs not asked for come back empty ([0, E] and [0]) so the schema stays all-Tensor.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>
router_topk_fused(const at::Tensor &logits, int64_t topk, bool use_pre_softmax,
                  int64_t num_groups, int64_t group_topk, double scaling_factor,
                  c10::string_view score_function, const c10::optional<at::Tensor> &expert_bias,
                  const c10::optional<at::Tensor> &padding_mask, bool with_aux, bool with_lse,
                  int64_t routing_mode) {
  const TopkInputs in = topk_inputs(logits, topk, use_pre_softmax, num_groups, group_topk,
                                    scaling_factor, score_function, expert_bias, routing_mode,
                                    "router_topk_fused");
  return fused_router(in, topk, padding_mask, with_aux, with_lse, "router_topk_fused");
}

// The fused router in Megatron's dense layout: (probs [T, E], routing_map [T, E], indices [T, k]).
std::tuple<at::Tensor, at::Tensor, at::Tensor> router_topk_dense(
    const at::Tensor &logits, int64_t topk, bool use_pre_softmax, int64_t num_groups,
    int64_t group_topk, double scaling_factor, c10::string_view score_function,
    const c10::optional<at::Tensor> &expert_bias, int64_t routing_mode) {
  const TopkInputs in = topk_inputs(logits, topk, use_pre_softmax, num_groups, group_topk,
                                    scaling_factor, score_function, expert_bias, routing_mode,
                                    "router_topk");
  auto out = fused_router(in, topk, c10::nullopt, false, false, "router_topk_dense");
  return {std::get<0>(out), std::get<1>(out), std::get<2>(out)};
}

at::Tensor router_lse_bwd(const at::Tensor &grad_lse_, const at::Tensor &logits_,
                          const at::Tensor &lse_, const c10::optional<at::Tensor> &padding_mask) {
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
  at::Tensor logits = logits_.contiguous(), lse = lse_.contiguous(), mask;
  at::Tensor g = grad_lse_.to(at::kDouble).contiguous();
  const uint8_t *m = padding_mask_ptr(padding_mask, mask, T, logits, "logits");
  MOE_DEVICE_GUARD(logits);
  at::Tensor grad_logits = at::empty_like(logits);
  check_status(MOE_CALL(logits, router_lse_bwd, grad_logits.data_ptr(), g.data_ptr<double>(),
                        logits.data_ptr(), lse.data_ptr<double>(), m, T, E,
                        to_moe_dtype(logits.scalar_type(), "logits"), nullptr, 0,
                        stream_of(logits)),
               "router_lse_bwd");
  return grad_logits;
}

// ---- topk_to_dense ----------------------------------------------------------------------------

std::tuple<at::Tensor, at::Tensor> topk_to_dense(const at::Tensor &topk_probs_,
                                                 const at::Tensor &topk_indices_,
                                                 int64_t num_experts) {
  check_dim(topk_probs_, 2, "topk_probs");
  check_dim(topk_indices_, 2, "topk_indices");
  check_float(topk_probs_, "topk_probs");
  check_dtype(topk_indices_, at::kLong, "topk_indices");
  MOE_CHECK_VALUE(topk_probs_.sizes() == topk_indices_.sizes(), "topk_probs shape ",
                    topk_probs_.sizes(), " must equal topk_indices shape ", topk_indices_.sizes());
  check_same_device(topk_indices_, topk_probs_, "topk_indices", "topk_probs");
  const int64_t T = topk_probs_.size(0), k = topk_probs_.size(1);
  at::Tensor tp = topk_probs_.contiguous(), ti = topk_indices_.contiguous();
  MOE_DEVICE_GUARD(tp);
  at::Tensor probs = at::empty({T, num_experts}, tp.options());
  at::Tensor routing_map = at::empty({T, num_experts}, tp.options().dtype(at::kBool));
  check_status(MOE_CALL(tp, topk_to_dense_fwd, probs.data_ptr(),
                        (uint8_t *)routing_map.data_ptr(), tp.data_ptr(), ti.data_ptr<int64_t>(),
                        T, num_experts, k, to_moe_dtype(tp.scalar_type(), "topk_probs"), nullptr,
                        0, stream_of(tp)),
               "topk_to_dense");
  return {probs, routing_map};
}

at::Tensor topk_to_dense_bwd(const at::Tensor &grad_probs_, const at::Tensor &topk_indices_) {
  check_dim(grad_probs_, 2, "grad_probs");
  check_dim(topk_indices_, 2, "topk_indices");
  check_float(grad_probs_, "grad_probs");
  check_dtype(topk_indices_, at::kLong, "topk_indices");
  check_size(topk_indices_, 0, grad_probs_.size(0), "topk_indices",
             "grad_probs.shape[0] (num_tokens)");
  check_same_device(topk_indices_, grad_probs_, "topk_indices", "grad_probs");
  const int64_t T = grad_probs_.size(0), E = grad_probs_.size(1), k = topk_indices_.size(1);
  at::Tensor g = grad_probs_.contiguous(), ti = topk_indices_.contiguous();
  MOE_DEVICE_GUARD(g);
  at::Tensor out = at::empty({T, k}, g.options());
  check_status(MOE_CALL(g, topk_to_dense_bwd, out.data_ptr(), g.data_ptr(), ti.data_ptr<int64_t>(),
                        T, E, k, to_moe_dtype(g.scalar_type(), "grad_probs"), nullptr, 0,
                        stream_of(g)),
               "topk_to_dense_bwd");
  return out;
}

// ---- permute / unpermute / capacity (issue 3) -------------------------------------------------

// A CUDA workspace size where the build has CUDA (a CPU-only build never calls it).
#ifdef MOE_CORE_WITH_CUDA
#define MOE_CUDA_SIZE(expr) (expr)
#else
#define MOE_CUDA_SIZE(expr) ((size_t)0)
#endif

void check_routing_map(const at::Tensor &routing_map, const char *name) {
  check_dim(routing_map, 2, name);
  check_dtype(routing_map, at::kBool, name);
}

void check_index_vector(const at::Tensor &t, int64_t size, const char *name, const char *what,
                        const at::Tensor &ref, const char *ref_name) {
  check_dim(t, 1, name);
  check_dtype(t, at::kLong, name);
  if (size >= 0) check_size(t, 0, size, name, what);
  check_same_device(t, ref, name, ref_name);
}

at::Tensor workspace_bytes(const at::Tensor &like, size_t bytes) {
  return workspace_for(like, bytes);
}

moe_drop_policy_t to_drop_policy(c10::string_view name) {
  if (name == "probs") return MOE_DROP_PROBS;
  if (name == "position") return MOE_DROP_POSITION;
  MOE_CHECK_VALUE(false, "drop_policy must be 'probs' or 'position', got '", std::string(name),
                    "'");
  return MOE_DROP_PROBS;
}

std::tuple<at::Tensor, at::Tensor> token_dropping(const at::Tensor &routing_probs_,
                                                  const at::Tensor &routing_map_,
                                                  int64_t capacity, c10::string_view drop_policy,
                                                  bool pad_to_capacity) {
  check_dim(routing_probs_, 2, "routing_probs");
  check_float(routing_probs_, "routing_probs");
  check_routing_map(routing_map_, "routing_map");
  MOE_CHECK_VALUE(routing_map_.sizes() == routing_probs_.sizes(), "routing_map shape ",
                    routing_map_.sizes(), " must equal routing_probs shape ",
                    routing_probs_.sizes());
  check_same_device(routing_map_, routing_probs_, "routing_map", "routing_probs");
  MOE_CHECK_VALUE(capacity >= 0, "capacity must be >= 0, got ", capacity);
  const moe_drop_policy_t policy = to_drop_policy(drop_policy);
  const int64_t T = routing_probs_.size(0), E = routing_probs_.size(1);
  MOE_CHECK_VALUE(E >= 1, "routing_probs must have at least one expert column, got shape ",
                    routing_probs_.sizes());
  at::Tensor probs = routing_probs_.contiguous(), map = routing_map_.contiguous();
  at::Tensor final_probs = at::empty_like(probs), final_map = at::empty_like(map);
  const moe_dtype_t dt = to_moe_dtype(probs.scalar_type(), "routing_probs");
  MOE_DEVICE_GUARD(probs);
  at::Tensor ws = workspace_bytes(
      probs, on_cuda(probs) ? MOE_CUDA_SIZE(moe_cuda_token_dropping_workspace_size(T, E, policy, dt))
                            : moe_token_dropping_workspace_size(T, E, policy));
  check_status(MOE_CALL(probs, token_dropping_fwd, final_probs.data_ptr(),
                        (uint8_t *)final_map.data_ptr(), probs.data_ptr(),
                        (const uint8_t *)map.data_ptr(), T, E, capacity, policy,
                        pad_to_capacity ? 1 : 0, dt, ws.data_ptr(), (size_t)ws.numel(),
                        stream_of(probs)),
               "token_dropping");
  return {final_probs, final_map};
}

at::Tensor token_dropping_bwd(const at::Tensor &grad_final_probs_, const at::Tensor &final_map_) {
  check_dim(grad_final_probs_, 2, "grad_final_probs");
  check_float(grad_final_probs_, "grad_final_probs");
  check_routing_map(final_map_, "final_map");
  MOE_CHECK_VALUE(final_map_.sizes() == grad_final_probs_.sizes(), "final_map shape ",
                    final_map_.sizes(), " must equal grad_final_probs shape ",
                    grad_final_probs_.sizes());
  check_same_device(final_map_, grad_final_probs_, "final_map", "grad_final_probs");
  MOE_CHECK_VALUE(grad_final_probs_.size(1) >= 1,
                  "grad_final_probs must have at least one expert column, got shape ",
                  grad_final_probs_.sizes());
  at::Tensor g = grad_final_probs_.contiguous(), map = final_map_.contiguous();
  at::Tensor out = at::empty_like(g);
  MOE_DEVICE_GUARD(g);
  check_status(MOE_CALL(g, token_dropping_bwd, out.data_ptr(), g.data_ptr(),
                        (const uint8_t *)map.data_ptr(), g.size(0), g.size(1),
                        to_moe_dtype(g.scalar_type(), "grad_final_probs"), nullptr, 0,
                        stream_of(g)),
               "token_dropping_bwd");
  return out;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> permute(
    const at::Tensor &tokens_, const at::Tensor &routing_map_,
    const c10::optional<at::Tensor> &probs_, int64_t num_out_tokens, bool drop_and_pad,
    int64_t align_size) {
  check_dim(tokens_, 2, "tokens");
  check_float(tokens_, "tokens");
  check_routing_map(routing_map_, "routing_map");
  check_size(routing_map_, 0, tokens_.size(0), "routing_map", "tokens.shape[0] (num_tokens)");
  check_same_device(routing_map_, tokens_, "routing_map", "tokens");
  const int64_t T = tokens_.size(0), H = tokens_.size(1), E = routing_map_.size(1);
  MOE_CHECK_VALUE(H >= 1, "tokens must have hidden >= 1, got shape ", tokens_.sizes());
  MOE_CHECK_VALUE(E >= 1, "routing_map must have at least one expert column, got shape ",
                    routing_map_.sizes());
  MOE_CHECK_VALUE(num_out_tokens >= 0, "num_out_tokens must be >= 0, got ", num_out_tokens);
  MOE_CHECK_VALUE(align_size >= 0, "align_size must be >= 0, got ", align_size);
  at::Tensor tokens = tokens_.contiguous(), map = routing_map_.contiguous(), probs;
  if (probs_.has_value()) {
    probs = probs_->contiguous();
    check_dim(probs, 2, "probs");
    check_float(probs, "probs");
    MOE_CHECK_VALUE(probs.sizes() == map.sizes(), "probs shape ", probs.sizes(),
                      " must equal routing_map shape ", map.sizes());
    check_same_device(probs, tokens, "probs", "tokens");
  }
  moe_permute_params_t p;
  p.num_out_tokens = num_out_tokens;
  p.align_size = align_size;
  p.drop_and_pad = drop_and_pad ? 1 : 0;
  // the row bound is checked arithmetic in the core: -1 (with the reason) when it overflows
  const int64_t R = moe_permute_num_rows(T, E, &p);
  MOE_CHECK_VALUE(R >= 0, "permute: ", moe_last_error());
  int64_t elems = 0;
  MOE_CHECK_VALUE(!moe_checked_mul_i64(R, H, &elems), "permute: the permuted buffer has ", R,
                  " rows (num_out_tokens=", num_out_tokens, ", align_size=", align_size,
                  ") of hidden=", H, " elements, which overflows int64");
  at::Tensor out = at::empty({R, H}, tokens.options());
  at::Tensor out_probs = probs.defined() ? at::empty({R}, probs.options())
                                         : at::empty({0}, tokens.options());
  at::Tensor idx = at::empty({R}, tokens.options().dtype(at::kLong));
  at::Tensor offsets = at::empty({E + 1}, idx.options());
  at::Tensor counts = at::empty({E}, idx.options());
  MOE_DEVICE_GUARD(tokens);
  at::Tensor ws = workspace_bytes(tokens,
                                  on_cuda(tokens) ? MOE_CUDA_SIZE(moe_cuda_permute_workspace_size(T, E, &p)) : 0);
  check_status(MOE_CALL(tokens, permute_fwd, out.data_ptr(),
                        probs.defined() ? out_probs.data_ptr() : nullptr, idx.data_ptr<int64_t>(),
                        offsets.data_ptr<int64_t>(), counts.data_ptr<int64_t>(),
                        tokens.data_ptr(), (const uint8_t *)map.data_ptr(),
                        probs.defined() ? probs.data_ptr() : nullptr, T, H, E,
                        to_moe_dtype(tokens.scalar_type(), "tokens"),
                        probs.defined() ? to_moe_dtype(probs.scalar_type(), "probs")
                                        : MOE_DTYPE_FP32,
                        &p, ws.numel() ? ws.data_ptr() : nullptr, (size_t)ws.numel(),
                        stream_of(tokens)),
               "permute");
  return {out, out_probs, idx, offsets, counts};
}

// The token → rows map's scratch: the CUDA kernels also keep each row's expert and a dot.
size_t unpermute_workspace(const at::Tensor &t, int64_t num_tokens, int64_t rows) {
  return on_cuda(t) ? MOE_CUDA_SIZE(moe_cuda_unpermute_workspace_size(num_tokens, rows))
                    : moe_unpermute_workspace_size(num_tokens, rows);
}

std::tuple<at::Tensor, at::Tensor> permute_bwd(
    const at::Tensor &grad_permuted_tokens_, const c10::optional<at::Tensor> &grad_permuted_probs_,
    const at::Tensor &sorted_indices_, const at::Tensor &expert_offsets_, int64_t num_tokens) {
  check_dim(grad_permuted_tokens_, 2, "grad_permuted_tokens");
  check_float(grad_permuted_tokens_, "grad_permuted_tokens");
  const int64_t R = grad_permuted_tokens_.size(0), H = grad_permuted_tokens_.size(1);
  MOE_CHECK_VALUE(H >= 1, "grad_permuted_tokens must have hidden >= 1, got shape ",
                  grad_permuted_tokens_.sizes());
  check_index_vector(sorted_indices_, R, "sorted_indices", "grad_permuted_tokens.shape[0] (rows)",
                     grad_permuted_tokens_, "grad_permuted_tokens");
  check_index_vector(expert_offsets_, -1, "expert_offsets", "", grad_permuted_tokens_,
                     "grad_permuted_tokens");
  const int64_t E = expert_offsets_.size(0) - 1;
  MOE_CHECK_VALUE(E >= 1, "expert_offsets must have num_experts + 1 >= 2 entries, got shape ",
                    expert_offsets_.sizes());
  MOE_CHECK_VALUE(num_tokens >= 0, "num_tokens must be >= 0, got ", num_tokens);
  at::Tensor g = grad_permuted_tokens_.contiguous(), idx = sorted_indices_.contiguous();
  at::Tensor offsets = expert_offsets_.contiguous(), gp;
  if (grad_permuted_probs_.has_value()) {
    gp = grad_permuted_probs_->contiguous();
    check_dim(gp, 1, "grad_permuted_probs");
    check_float(gp, "grad_permuted_probs");
    check_size(gp, 0, R, "grad_permuted_probs", "grad_permuted_tokens.shape[0] (rows)");
    check_same_device(gp, g, "grad_permuted_probs", "grad_permuted_tokens");
  }
  at::Tensor grad_tokens = at::empty({num_tokens, H}, g.options());
  at::Tensor grad_probs = gp.defined() ? at::empty({num_tokens, E}, gp.options())
                                       : at::empty({0}, g.options());
  MOE_DEVICE_GUARD(g);
  at::Tensor ws = workspace_bytes(g, unpermute_workspace(g, num_tokens, R));
  check_status(MOE_CALL(g, permute_bwd, grad_tokens.data_ptr(),
                        gp.defined() ? grad_probs.data_ptr() : nullptr, g.data_ptr(),
                        gp.defined() ? gp.data_ptr() : nullptr, idx.data_ptr<int64_t>(),
                        offsets.data_ptr<int64_t>(), num_tokens, H, E, R,
                        to_moe_dtype(g.scalar_type(), "grad_permuted_tokens"),
                        gp.defined() ? to_moe_dtype(gp.scalar_type(), "grad_permuted_probs")
                                     : MOE_DTYPE_FP32,
                        ws.data_ptr(), (size_t)ws.numel(), stream_of(g)),
               "permute_bwd");
  return {grad_tokens, grad_probs};
}

// Shared checks of unpermute and its backward (`ref`: the [*, hidden] tensor on the op's
// device; `rows`: the row count). Returns E (probs.shape[1], or 1 without probs).
int64_t check_unpermute_args(const at::Tensor &ref, const char *ref_name, int64_t rows,
                             const at::Tensor &sorted_indices, int64_t num_tokens,
                             const c10::optional<at::Tensor> &probs,
                             const c10::optional<at::Tensor> &expert_offsets) {
  check_index_vector(sorted_indices, rows, "sorted_indices", "the permuted rows", ref, ref_name);
  MOE_CHECK_VALUE(num_tokens >= 0, "num_tokens must be >= 0, got ", num_tokens);
  MOE_CHECK_VALUE(ref.size(1) >= 1, ref_name, " must have hidden >= 1, got shape ", ref.sizes());
  if (!probs.has_value()) return 1;
  check_dim(*probs, 2, "probs");
  check_float(*probs, "probs");
  check_size(*probs, 0, num_tokens, "probs", "restore_shape[0] (num_tokens)");
  check_same_device(*probs, ref, "probs", ref_name);
  const int64_t E = probs->size(1);
  MOE_CHECK_VALUE(E >= 1, "probs must have at least one expert column, got shape ",
                    probs->sizes());
  MOE_CHECK_VALUE(expert_offsets.has_value(), "expert_offsets is required when probs are given");
  check_index_vector(*expert_offsets, E + 1, "expert_offsets", "probs.shape[1] + 1", ref,
                     ref_name);
  return E;
}

at::Tensor unpermute(const at::Tensor &permuted_tokens_, const at::Tensor &sorted_indices_,
                     int64_t num_tokens, const c10::optional<at::Tensor> &probs_,
                     const c10::optional<at::Tensor> &expert_offsets_) {
  check_dim(permuted_tokens_, 2, "permuted_tokens");
  check_float(permuted_tokens_, "permuted_tokens");
  const int64_t E = check_unpermute_args(permuted_tokens_, "permuted_tokens",
                                         permuted_tokens_.size(0), sorted_indices_, num_tokens,
                                         probs_, expert_offsets_);
  const int64_t R = permuted_tokens_.size(0), H = permuted_tokens_.size(1);
  at::Tensor x = permuted_tokens_.contiguous(), idx = sorted_indices_.contiguous(), probs, offsets;
  if (probs_.has_value()) probs = probs_->contiguous(), offsets = expert_offsets_->contiguous();
  at::Tensor out = at::empty({num_tokens, H}, x.options());
  MOE_DEVICE_GUARD(x);
  at::Tensor ws = workspace_bytes(x, unpermute_workspace(x, num_tokens, R));
  check_status(MOE_CALL(x, unpermute_fwd, out.data_ptr(), x.data_ptr(), idx.data_ptr<int64_t>(),
                        probs.defined() ? probs.data_ptr() : nullptr,
                        offsets.defined() ? offsets.data_ptr<int64_t>() : nullptr, num_tokens, H,
                        E, R, to_moe_dtype(x.scalar_type(), "permuted_tokens"),
                        probs.defined() ? to_moe_dtype(probs.scalar_type(), "probs")
                                        : MOE_DTYPE_FP32,
                        ws.data_ptr(), (size_t)ws.numel(), stream_of(x)),
               "unpermute");
  return out;
}

// grad_probs is computed iff permuted_tokens is given (the forward's rows, needed for it); without
// it the autograd graph does not keep the rows alive.
std::tuple<at::Tensor, at::Tensor> unpermute_bwd(const at::Tensor &grad_output_,
                                                 const at::Tensor &sorted_indices_,
                                                 const c10::optional<at::Tensor> &probs_,
                                                 const c10::optional<at::Tensor> &expert_offsets_,
                                                 const c10::optional<at::Tensor> &permuted_tokens_) {
  check_dim(grad_output_, 2, "grad_output");
  check_float(grad_output_, "grad_output");
  check_dim(sorted_indices_, 1, "sorted_indices");
  const int64_t T = grad_output_.size(0), H = grad_output_.size(1), R = sorted_indices_.size(0);
  const int64_t E = check_unpermute_args(grad_output_, "grad_output", R, sorted_indices_, T,
                                         probs_, expert_offsets_);
  at::Tensor x;
  if (permuted_tokens_.has_value()) {
    MOE_CHECK_VALUE(probs_.has_value(), "permuted_tokens is given (grad of probs requested) but "
                      "probs is None");
    x = permuted_tokens_->contiguous();
    check_dim(x, 2, "permuted_tokens");
    check_size(x, 0, R, "permuted_tokens", "sorted_indices.shape[0] (rows)");
    check_size(x, 1, H, "permuted_tokens", "grad_output.shape[1] (hidden)");
    check_dtype(x, grad_output_.scalar_type(), "permuted_tokens");
    check_same_device(x, grad_output_, "permuted_tokens", "grad_output");
  }
  at::Tensor g = grad_output_.contiguous(), idx = sorted_indices_.contiguous(), probs, offsets;
  if (probs_.has_value()) probs = probs_->contiguous(), offsets = expert_offsets_->contiguous();
  at::Tensor grad_x = at::empty({R, H}, g.options());
  at::Tensor grad_probs = x.defined() ? at::empty({T, E}, probs.options())
                                      : at::empty({0}, g.options());
  MOE_DEVICE_GUARD(g);
  at::Tensor ws = workspace_bytes(g, unpermute_workspace(g, T, R));
  check_status(MOE_CALL(g, unpermute_bwd, grad_x.data_ptr(),
                        x.defined() ? grad_probs.data_ptr() : nullptr, g.data_ptr(),
                        x.defined() ? x.data_ptr() : nullptr, idx.data_ptr<int64_t>(),
                        probs.defined() ? probs.data_ptr() : nullptr,
                        offsets.defined() ? offsets.data_ptr<int64_t>() : nullptr, T, H, E, R,
                        to_moe_dtype(g.scalar_type(), "grad_output"),
                        probs.defined() ? to_moe_dtype(probs.scalar_type(), "probs")
                                        : MOE_DTYPE_FP32,
                        ws.data_ptr(), (size_t)ws.numel(), stream_of(g)),
               "unpermute_bwd");
  return {grad_x, grad_probs};
}

// Rows are dim 0; everything after it moves as one row of `row_elems` elements.
at::Tensor sort_chunks_impl(const at::Tensor &input_, const at::Tensor &split_sizes_,
                            const at::Tensor &sorted_idxs_, bool backward) {
  const char *in_name = backward ? "grad_output" : "input";
  MOE_CHECK_VALUE(input_.dim() >= 1, in_name, " must be at least 1-D, got a 0-D tensor");
  check_index_vector(split_sizes_, -1, "split_sizes", "", input_, in_name);
  check_index_vector(sorted_idxs_, split_sizes_.size(0), "sorted_idxs",
                     "split_sizes.shape[0] (num_chunks)", input_, in_name);
  at::Tensor x = input_.contiguous(), sizes = split_sizes_.contiguous();
  at::Tensor order = sorted_idxs_.contiguous();
  const int64_t rows = x.size(0), row_elems = rows > 0 ? x.numel() / rows : 0;
  at::Tensor out = at::empty_like(x);
  const int64_t C = sizes.size(0);
  const moe_dtype_t dt = to_moe_dtype(x.scalar_type(), in_name);
  MOE_DEVICE_GUARD(x);
  at::Tensor ws = workspace_bytes(x, on_cuda(x) ? MOE_CUDA_SIZE(moe_cuda_sort_chunks_by_idxs_workspace_size(C)) : 0);
  void *w = ws.numel() ? ws.data_ptr() : nullptr;
  check_status(backward ? MOE_CALL(x, sort_chunks_by_idxs_bwd, out.data_ptr(), x.data_ptr(),
                                   sizes.data_ptr<int64_t>(), order.data_ptr<int64_t>(), rows,
                                   row_elems, C, dt, w, (size_t)ws.numel(), stream_of(x))
                        : MOE_CALL(x, sort_chunks_by_idxs_fwd, out.data_ptr(), x.data_ptr(),
                                   sizes.data_ptr<int64_t>(), order.data_ptr<int64_t>(), rows,
                                   row_elems, C, dt, w, (size_t)ws.numel(), stream_of(x)),
               backward ? "sort_chunks_by_idxs_bwd" : "sort_chunks_by_idxs");
  return out;
}

at::Tensor sort_chunks_by_idxs(const at::Tensor &input, const at::Tensor &split_sizes,
                               const at::Tensor &sorted_idxs) {
  return sort_chunks_impl(input, split_sizes, sorted_idxs, false);
}

at::Tensor sort_chunks_by_idxs_bwd(const at::Tensor &grad_output, const at::Tensor &split_sizes,
                                   const at::Tensor &sorted_idxs) {
  return sort_chunks_impl(grad_output, split_sizes, sorted_idxs, true);
}

// ---- load balancing (issue 4) ----------------------------------------------------------------

// A padding mask (True = padding) as the C core's [num_tokens] uint8 buffer, or nullptr.
const uint8_t *padding_mask_ptr(const c10::optional<at::Tensor> &mask_, at::Tensor &keep,
                                int64_t num_tokens, const at::Tensor &ref, const char *ref_name) {
  if (!mask_.has_value()) return nullptr;
  check_dim(*mask_, 1, "padding_mask");
  check_dtype(*mask_, at::kBool, "padding_mask");
  MOE_CHECK_VALUE(mask_->size(0) == num_tokens, "padding_mask.shape[0] must equal ", ref_name,
                    ".shape[0] (num_tokens=", num_tokens, "), got shape ", mask_->sizes());
  check_same_device(*mask_, ref, "padding_mask", ref_name);
  keep = mask_->contiguous();
  // An empty mask has no storage; it is still a mask (n_valid = 0), not "no mask" (NULL).
  static const uint8_t no_tokens = 0;
  return num_tokens == 0 ? &no_tokens : (const uint8_t *)keep.data_ptr();
}

// fp64 inputs keep fp64 losses and scores (gradcheck); everything else computes in fp32.
at::ScalarType compute_type(const at::Tensor &t) {
  return t.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

void check_no_cuda(const at::Tensor &t, const char *op) {
  MOE_CHECK_RUNTIME(!on_cuda(t), op, " has no CUDA kernel yet; got a tensor on ", t.device());
}

std::tuple<at::Tensor, at::Tensor> aux_loss_scores(const at::Tensor &logits_, int64_t topk,
                                                   c10::string_view score_function,
                                                   const c10::optional<at::Tensor> &padding_mask) {
  check_dim(logits_, 2, "logits");
  check_float(logits_, "logits");
  const int64_t T = logits_.size(0), E = logits_.size(1);
  at::Tensor logits = logits_.contiguous(), mask;
  const uint8_t *m = padding_mask_ptr(padding_mask, mask, T, logits, "logits");
  moe_score_function_t sf = to_score_function(score_function);
  MOE_DEVICE_GUARD(logits);
  at::Tensor scores = at::empty({T, E}, logits.options().dtype(compute_type(logits)));
  at::Tensor routing_map = at::empty({T, E}, logits.options().dtype(at::kBool));
  at::Tensor ws = workspace_for(logits, MOE_WS_BYTES(logits,
                                                     moe_aux_loss_scores_workspace_size(T, E, topk),
                                                     moe_cuda_aux_loss_scores_workspace_size(T, E, topk)));
  check_status(MOE_CALL(logits, aux_loss_scores_fwd, scores.data_ptr(),
                        (uint8_t *)routing_map.data_ptr(), logits.data_ptr(), m, T, E, topk,
                        to_moe_dtype(logits.scalar_type(), "logits"), sf, ws.data_ptr(),
                        (size_t)ws.numel(), stream_of(logits)),
               "aux_loss_scores");
  return {scores, routing_map};
}

at::Tensor aux_loss_scores_bwd(const at::Tensor &grad_scores_, const at::Tensor &logits_,
                               c10::string_view score_function,
                               const c10::optional<at::Tensor> &padding_mask) {
  check_dim(logits_, 2, "logits");
  check_float(logits_, "logits");
  const int64_t T = logits_.size(0), E = logits_.size(1);
  check_dim(grad_scores_, 2, "grad_scores");
  check_float(grad_scores_, "grad_scores");
  check_size(grad_scores_, 0, T, "grad_scores", "logits.shape[0] (num_tokens)");
  check_size(grad_scores_, 1, E, "grad_scores", "logits.shape[1] (num_experts)");
  check_same_device(grad_scores_, logits_, "grad_scores", "logits");
  at::Tensor logits = logits_.contiguous(), mask;
  at::Tensor g = grad_scores_.to(compute_type(logits)).contiguous();
  const uint8_t *m = padding_mask_ptr(padding_mask, mask, T, logits, "logits");
  MOE_DEVICE_GUARD(logits);
  at::Tensor grad_logits = at::empty_like(logits);
  check_status(MOE_CALL(logits, aux_loss_scores_bwd, grad_logits.data_ptr(), g.data_ptr(),
                        logits.data_ptr(), m, T, E, to_moe_dtype(logits.scalar_type(), "logits"),
                        to_score_function(score_function), nullptr, 0, stream_of(logits)),
               "aux_loss_scores_bwd");
  return grad_logits;
}

// Validates the switch-loss inputs; returns counts as fp32 and the total as a one-element fp64.
std::tuple<at::Tensor, at::Tensor, at::Tensor> switch_inputs(const at::Tensor &probs_,
                                                             const at::Tensor &tokens_per_expert,
                                                             const at::Tensor &total_num_tokens) {
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

moe_switch_aux_loss_params_t switch_params(int64_t topk, int64_t num_experts, double coeff) {
  moe_switch_aux_loss_params_t p;
  p.topk = topk;
  p.num_experts = num_experts;
  p.coeff = coeff;
  return p;
}

at::Tensor switch_aux_loss(const at::Tensor &probs_, const at::Tensor &tokens_per_expert_,
                           const at::Tensor &total_num_tokens_, int64_t topk, int64_t num_experts,
                           double coeff, const c10::optional<at::Tensor> &padding_mask) {
  auto [probs, tpe, total] = switch_inputs(probs_, tokens_per_expert_, total_num_tokens_);
  const int64_t T = probs.size(0), C = probs.size(1);
  at::Tensor mask;
  const uint8_t *m = padding_mask_ptr(padding_mask, mask, T, probs, "probs");
  moe_switch_aux_loss_params_t p = switch_params(topk, num_experts, coeff);
  MOE_DEVICE_GUARD(probs);
  at::Tensor loss = at::empty({}, probs.options().dtype(compute_type(probs)));
  at::Tensor ws = workspace_for(probs, MOE_WS_BYTES(probs, moe_switch_aux_loss_workspace_size(T, C),
                                                    moe_cuda_switch_aux_loss_workspace_size(T, C)));
  check_status(MOE_CALL(probs, switch_aux_loss_fwd, loss.data_ptr(), probs.data_ptr(),
                        tpe.data_ptr<float>(), total.data_ptr<double>(), m, T, C,
                        to_moe_dtype(probs.scalar_type(), "probs"), &p, ws.data_ptr(),
                        (size_t)ws.numel(), stream_of(probs)),
               "switch_aux_loss");
  return loss;
}

at::Tensor switch_aux_loss_bwd(const at::Tensor &grad_loss_, const at::Tensor &probs_,
                               const at::Tensor &tokens_per_expert_,
                               const at::Tensor &total_num_tokens_, int64_t topk,
                               int64_t num_experts, double coeff,
                               const c10::optional<at::Tensor> &padding_mask) {
  auto [probs, tpe, total] = switch_inputs(probs_, tokens_per_expert_, total_num_tokens_);
  MOE_CHECK_VALUE(grad_loss_.numel() == 1, "grad_loss must have one element, got shape ",
                    grad_loss_.sizes());
  check_float(grad_loss_, "grad_loss");
  check_same_device(grad_loss_, probs, "grad_loss", "probs");
  const int64_t T = probs.size(0), C = probs.size(1);
  at::Tensor mask, g = grad_loss_.to(compute_type(probs)).reshape({1}).contiguous();
  const uint8_t *m = padding_mask_ptr(padding_mask, mask, T, probs, "probs");
  moe_switch_aux_loss_params_t p = switch_params(topk, num_experts, coeff);
  MOE_DEVICE_GUARD(probs);
  at::Tensor grad_probs = at::empty_like(probs);
  check_status(MOE_CALL(probs, switch_aux_loss_bwd, grad_probs.data_ptr(), g.data_ptr(),
                        tpe.data_ptr<float>(), total.data_ptr<double>(), m, T, C,
                        to_moe_dtype(probs.scalar_type(), "probs"), &p, nullptr, 0,
                        stream_of(probs)),
               "switch_aux_loss_bwd");
  return grad_probs;
}

at::Tensor z_loss(const at::Tensor &logits_, double coeff,
                  const c10::optional<at::Tensor> &padding_mask) {
  check_dim(logits_, 2, "logits");
  check_float(logits_, "logits");
  const int64_t T = logits_.size(0), E = logits_.size(1);
  at::Tensor logits = logits_.contiguous(), mask;
  const uint8_t *m = padding_mask_ptr(padding_mask, mask, T, logits, "logits");
  MOE_DEVICE_GUARD(logits);
  at::Tensor loss = at::empty({}, logits.options().dtype(compute_type(logits)));
  at::Tensor ws = workspace_for(logits, MOE_WS_BYTES(logits, moe_z_loss_workspace_size(T, E),
                                                     moe_cuda_z_loss_workspace_size(T, E)));
  check_status(MOE_CALL(logits, z_loss_fwd, loss.data_ptr(), logits.data_ptr(), m, T, E, coeff,
                        to_moe_dtype(logits.scalar_type(), "logits"), ws.data_ptr(),
                        (size_t)ws.numel(), stream_of(logits)),
               "z_loss");
  return loss;
}

at::Tensor z_loss_bwd(const at::Tensor &grad_loss_, const at::Tensor &logits_, double coeff,
                      const c10::optional<at::Tensor> &padding_mask) {
  check_dim(logits_, 2, "logits");
  check_float(logits_, "logits");
  MOE_CHECK_VALUE(grad_loss_.numel() == 1, "grad_loss must have one element, got shape ",
                    grad_loss_.sizes());
  check_float(grad_loss_, "grad_loss");
  check_same_device(grad_loss_, logits_, "grad_loss", "logits");
  const int64_t T = logits_.size(0), E = logits_.size(1);
  at::Tensor logits = logits_.contiguous(), mask;
  at::Tensor g = grad_loss_.to(compute_type(logits)).reshape({1}).contiguous();
  const uint8_t *m = padding_mask_ptr(padding_mask, mask, T, logits, "logits");
  MOE_DEVICE_GUARD(logits);
  at::Tensor grad_logits = at::empty_like(logits);
  at::Tensor ws = workspace_for(logits, MOE_WS_BYTES(logits, 0, moe_cuda_z_loss_workspace_size(T, E)));
  check_status(MOE_CALL(logits, z_loss_bwd, grad_logits.data_ptr(), g.data_ptr(),
                        logits.data_ptr(), m, T, E, coeff,
                        to_moe_dtype(logits.scalar_type(), "logits"), ws.data_ptr(),
                        (size_t)ws.numel(), stream_of(logits)),
               "z_loss_bwd");
  return grad_logits;
}

// The routing-map checks of issue 3, plus "no CUDA kernel yet" naming the op.
void check_cpu_routing_map(const at::Tensor &routing_map, const char *op) {
  check_routing_map(routing_map, "routing_map");
  check_no_cuda(routing_map, op);
}

at::Tensor tokens_per_expert(const at::Tensor &routing_map_,
                             const c10::optional<at::Tensor> &padding_mask) {
  check_routing_map(routing_map_, "routing_map");
  const int64_t T = routing_map_.size(0), E = routing_map_.size(1);
  at::Tensor map = routing_map_.contiguous(), mask;
  const uint8_t *m = padding_mask_ptr(padding_mask, mask, T, map, "routing_map");
  at::Tensor counts = at::empty({E}, map.options().dtype(at::kLong));
  MOE_DEVICE_GUARD(map);
  check_status(MOE_CALL(map, tokens_per_expert_fwd, counts.data_ptr<int64_t>(),
                        (const uint8_t *)map.data_ptr(), m, T, E, nullptr, 0, stream_of(map)),
               "tokens_per_expert");
  return counts;
}

at::Tensor expert_bias_update(const at::Tensor &tokens_per_expert_,
                              const at::Tensor &expert_bias_, double update_rate) {
  MOE_CHECK_VALUE(expert_bias_.dim() == 1 || expert_bias_.dim() == 2,
                    "expert_bias must be 1-D [num_experts] or 2-D [num_layers, num_experts], got "
                    "a ", expert_bias_.dim(), "-D tensor of shape ", expert_bias_.sizes());
  check_dtype(expert_bias_, at::kFloat, "expert_bias");
  MOE_CHECK_VALUE(tokens_per_expert_.sizes() == expert_bias_.sizes(),
                    "tokens_per_expert shape ", tokens_per_expert_.sizes(),
                    " must equal expert_bias shape ", expert_bias_.sizes());
  MOE_CHECK_TYPE(!tokens_per_expert_.is_complex() &&
                       tokens_per_expert_.scalar_type() != at::kBool,
                   "tokens_per_expert must be a real number dtype, got ",
                   tokens_per_expert_.scalar_type());
  check_same_device(tokens_per_expert_, expert_bias_, "tokens_per_expert", "expert_bias");
  const int64_t E = expert_bias_.size(-1), L = expert_bias_.numel() / (E > 0 ? E : 1);
  MOE_CHECK_VALUE(E >= 1, "expert_bias must have at least one expert, got shape ",
                    expert_bias_.sizes());
  // Megatron's counts are fp32 tensors; integer counts promote to fp32 in its arithmetic too.
  at::Tensor counts = tokens_per_expert_.to(at::kFloat).contiguous();
  at::Tensor bias = expert_bias_.contiguous();
  MOE_DEVICE_GUARD(bias);
  at::Tensor updated = at::empty_like(bias);
  check_status(MOE_CALL(bias, expert_bias_update_fwd, updated.data_ptr<float>(),
                        counts.data_ptr<float>(), bias.data_ptr<float>(), L, E, update_rate,
                        nullptr, 0, stream_of(bias)),
               "expert_bias_update");
  return updated;
}

at::Tensor sinkhorn(const at::Tensor &cost_, double tol, int64_t max_iters) {
  check_dim(cost_, 2, "cost");
  check_float(cost_, "cost");
  const int64_t T = cost_.size(0), E = cost_.size(1);
  at::Tensor cost = cost_.contiguous();
  MOE_DEVICE_GUARD(cost);
  at::Tensor out = at::empty({T, E}, cost.options().dtype(compute_type(cost)));
  at::Tensor ws = workspace_for(cost, MOE_WS_BYTES(cost, moe_sinkhorn_workspace_size(T, E, 0),
                                                   moe_cuda_sinkhorn_workspace_size(T, E, 0)));
  check_status(MOE_CALL(cost, sinkhorn_fwd, out.data_ptr(), cost.data_ptr(), T, E,
                        to_moe_dtype(cost.scalar_type(), "cost"), tol, max_iters, ws.data_ptr(),
                        (size_t)ws.numel(), stream_of(cost)),
               "sinkhorn");
  return out;
}

std::tuple<at::Tensor, at::Tensor> sinkhorn_routing(const at::Tensor &logits_, int64_t topk,
                                                    bool training, double tol) {
  check_dim(logits_, 2, "logits");
  check_float(logits_, "logits");
  const int64_t T = logits_.size(0), E = logits_.size(1);
  at::Tensor logits = logits_.contiguous();
  MOE_DEVICE_GUARD(logits);
  at::Tensor probs = at::empty({T, E}, logits.options());
  at::Tensor routing_map = at::empty({T, E}, logits.options().dtype(at::kBool));
  at::Tensor ws = workspace_for(logits, MOE_WS_BYTES(logits, moe_sinkhorn_workspace_size(T, E, topk),
                                                     training ? moe_cuda_sinkhorn_workspace_size(T, E, topk) : 0));
  check_status(MOE_CALL(logits, sinkhorn_routing_fwd, probs.data_ptr(),
                        (uint8_t *)routing_map.data_ptr(), logits.data_ptr(), T, E, topk,
                        to_moe_dtype(logits.scalar_type(), "logits"), training ? 1 : 0, tol,
                        ws.data_ptr(), (size_t)ws.numel(), stream_of(logits)),
               "sinkhorn_routing");
  return {probs, routing_map};
}

at::Tensor sinkhorn_routing_bwd(const at::Tensor &grad_probs_, const at::Tensor &logits_,
                                const at::Tensor &routing_map_, int64_t topk) {
  check_dim(logits_, 2, "logits");
  check_float(logits_, "logits");
  check_routing_map(routing_map_, "routing_map");
  check_float(grad_probs_, "grad_probs");
  MOE_CHECK_VALUE(grad_probs_.sizes() == logits_.sizes(), "grad_probs shape ",
                    grad_probs_.sizes(), " must equal logits shape ", logits_.sizes());
  MOE_CHECK_VALUE(routing_map_.sizes() == logits_.sizes(), "routing_map shape ",
                    routing_map_.sizes(), " must equal logits shape ", logits_.sizes());
  check_same_device(grad_probs_, logits_, "grad_probs", "logits");
  check_same_device(routing_map_, logits_, "routing_map", "logits");
  const int64_t T = logits_.size(0), E = logits_.size(1);
  at::Tensor logits = logits_.contiguous(), map = routing_map_.contiguous();
  at::Tensor g = grad_probs_.to(logits.scalar_type()).contiguous();
  MOE_DEVICE_GUARD(logits);
  at::Tensor grad_logits = at::empty_like(logits);
  check_status(MOE_CALL(logits, sinkhorn_routing_bwd, grad_logits.data_ptr(), g.data_ptr(),
                        logits.data_ptr(), (const uint8_t *)map.data_ptr(), T, E, topk,
                        to_moe_dtype(logits.scalar_type(), "logits"), nullptr, 0,
                        stream_of(logits)),
               "sinkhorn_routing_bwd");
  return grad_logits;
}

std::tuple<at::Tensor, at::Tensor> routing_metrics(const at::Tensor &routing_map_,
                                                   const c10::optional<at::Tensor> &scores_,
                                                   const c10::optional<at::Tensor> &padding_mask) {
  check_routing_map(routing_map_, "routing_map");
  const int64_t T = routing_map_.size(0), E = routing_map_.size(1);
  at::Tensor map = routing_map_.contiguous(), scores, mask;
  if (scores_.has_value()) {
    check_float(*scores_, "scores");
    MOE_CHECK_VALUE(scores_->sizes() == map.sizes(), "scores shape ", scores_->sizes(),
                      " must equal routing_map shape ", map.sizes());
    check_same_device(*scores_, map, "scores", "routing_map");
    scores = scores_->contiguous();
  }
  const uint8_t *m = padding_mask_ptr(padding_mask, mask, T, map, "routing_map");
  MOE_DEVICE_GUARD(map);
  at::Tensor counts = at::empty({E}, map.options().dtype(at::kLong));
  at::Tensor stats = at::empty({MOE_ROUTING_STATS}, map.options().dtype(at::kFloat));
  at::Tensor ws = workspace_for(map, MOE_WS_BYTES(map, moe_routing_metrics_workspace_size(T, E),
                                                  moe_cuda_routing_metrics_workspace_size(T, E)));
  check_status(MOE_CALL(map, routing_metrics_fwd, counts.data_ptr<int64_t>(),
                        stats.data_ptr<float>(), (const uint8_t *)map.data_ptr(),
                        scores.defined() ? scores.data_ptr() : nullptr, m, T, E,
                        scores.defined() ? to_moe_dtype(scores.scalar_type(), "scores")
                                         : MOE_DTYPE_FP32,
                        ws.data_ptr(), (size_t)ws.numel(), stream_of(map)),
               "routing_metrics");
  return {counts, stats};
}

at::Tensor topk_overlap(const at::Tensor &indices_a_, const at::Tensor &indices_b_,
                        int64_t num_experts, const c10::optional<at::Tensor> &padding_mask) {
  check_dim(indices_a_, 2, "indices_a");
  check_dim(indices_b_, 2, "indices_b");
  check_dtype(indices_a_, at::kLong, "indices_a");
  check_dtype(indices_b_, at::kLong, "indices_b");
  MOE_CHECK_VALUE(indices_a_.sizes() == indices_b_.sizes(), "indices_b shape ",
                    indices_b_.sizes(), " must equal indices_a shape ", indices_a_.sizes());
  check_same_device(indices_b_, indices_a_, "indices_b", "indices_a");
  const int64_t T = indices_a_.size(0), k = indices_a_.size(1);
  at::Tensor a = indices_a_.contiguous(), b = indices_b_.contiguous(), mask;
  const uint8_t *m = padding_mask_ptr(padding_mask, mask, T, a, "indices_a");
  MOE_DEVICE_GUARD(a);
  at::Tensor overlap = at::empty({}, a.options().dtype(at::kFloat));
  at::Tensor ws = workspace_for(a, MOE_WS_BYTES(a, 0, moe_cuda_topk_overlap_workspace_size(T, k)));
  check_status(MOE_CALL(a, topk_overlap_fwd, overlap.data_ptr<float>(), a.data_ptr<int64_t>(),
                        b.data_ptr<int64_t>(), m, T, k, num_experts, ws.data_ptr(),
                        (size_t)ws.numel(), stream_of(a)),
               "topk_overlap");
  return overlap;
}

// ---- grouped GEMM (issue 5) -------------------------------------------------------------------

// Shared checks of the three products: ranks, one operand dtype, offsets [E + 1] int64 on the
// same device. Returns the params; the C core validates the offsets' values (on the CPU).
moe_grouped_gemm_params_t grouped_gemm_params(const at::Tensor &a, const char *a_name,
                                              const at::Tensor &b, const char *b_name,
                                              const at::Tensor &offsets, int64_t num_experts,
                                              const char *experts_from,
                                              int64_t in_features, int64_t out_features,
                                              bool trans_w, at::ScalarType out_dtype) {
  check_float(a, a_name);
  MOE_CHECK_TYPE(b.scalar_type() == a.scalar_type(), b_name, " must have the same dtype as ",
                   a_name, " (", a.scalar_type(), "), got ", b.scalar_type());
  check_dtype(offsets, at::kLong, "expert_offsets");
  check_dim(offsets, 1, "expert_offsets");
  MOE_CHECK_VALUE(num_experts >= 1, "num_experts (", experts_from, ") must be >= 1, got ",
                    num_experts);
  check_size(offsets, 0, num_experts + 1, "expert_offsets", "num_experts + 1");
  check_same_device(b, a, b_name, a_name);
  check_same_device(offsets, a, "expert_offsets", a_name);
  MOE_CHECK_TYPE(at::isFloatingType(out_dtype) && out_dtype != at::kFloat8_e4m3fn &&
                       out_dtype != at::kFloat8_e5m2,
                   "out_dtype must be float32, float64, float16 or bfloat16, got ", out_dtype);
  moe_grouped_gemm_params_t p;
  p.num_rows = a.size(0);
  p.num_experts = num_experts;
  p.in_features = in_features;
  p.out_features = out_features;
  p.trans_w = trans_w ? 1 : 0;
  p.dtype = to_moe_dtype(a.scalar_type(), a_name);
  p.out_dtype = to_moe_dtype(out_dtype, "out_dtype");
  return p;
}

at::Tensor grouped_gemm_workspace(const at::Tensor &like, const moe_grouped_gemm_params_t &p) {
  size_t bytes = on_cuda(like) ?
#ifdef MOE_CORE_WITH_CUDA
                               moe_cuda_grouped_gemm_workspace_size(&p)
#else
                               0
#endif
                               : moe_grouped_gemm_workspace_size(&p);
  return workspace_for(like, bytes);
}

at::Tensor grouped_gemm(const at::Tensor &x_, const at::Tensor &weight_,
                        const at::Tensor &expert_offsets_, bool trans_w,
                        c10::optional<at::ScalarType> out_dtype) {
  check_dim(x_, 2, "x");
  check_dim(weight_, 3, "weight");
  const int64_t E = weight_.size(0), K = x_.size(1);
  const int64_t N = trans_w ? weight_.size(1) : weight_.size(2);
  check_size(weight_, trans_w ? 2 : 1, K, "weight", "x.shape[1] (in_features)");
  auto p = grouped_gemm_params(x_, "x", weight_, "weight", expert_offsets_, E,
                               "weight.shape[0]", K, N, trans_w,
                               out_dtype.value_or(x_.scalar_type()));
  at::Tensor x = x_.contiguous(), w = weight_.contiguous(), off = expert_offsets_.contiguous();
  MOE_DEVICE_GUARD(x);
  at::Tensor y = at::empty({p.num_rows, N},
                           x.options().dtype(out_dtype.value_or(x.scalar_type())));
  at::Tensor ws = grouped_gemm_workspace(x, p);
  check_status(MOE_CALL(x, grouped_gemm_fwd, y.data_ptr(), x.data_ptr(), w.data_ptr(),
                        off.data_ptr<int64_t>(), &p, ws.data_ptr(), (size_t)ws.numel(),
                        stream_of(x)),
               "grouped_gemm");
  return y;
}

at::Tensor grouped_gemm_dgrad(const at::Tensor &grad_y_, const at::Tensor &weight_,
                              const at::Tensor &expert_offsets_, bool trans_w,
                              c10::optional<at::ScalarType> out_dtype) {
  check_dim(grad_y_, 2, "grad_y");
  check_dim(weight_, 3, "weight");
  const int64_t E = weight_.size(0), N = grad_y_.size(1);
  const int64_t K = trans_w ? weight_.size(2) : weight_.size(1);
  check_size(weight_, trans_w ? 1 : 2, N, "weight", "grad_y.shape[1] (out_features)");
  auto p = grouped_gemm_params(grad_y_, "grad_y", weight_, "weight", expert_offsets_, E,
                               "weight.shape[0]", K, N, trans_w,
                               out_dtype.value_or(grad_y_.scalar_type()));
  at::Tensor g = grad_y_.contiguous(), w = weight_.contiguous(), off = expert_offsets_.contiguous();
  MOE_DEVICE_GUARD(g);
  at::Tensor dx = at::empty({p.num_rows, K},
                            g.options().dtype(out_dtype.value_or(g.scalar_type())));
  at::Tensor ws = grouped_gemm_workspace(g, p);
  check_status(MOE_CALL(g, grouped_gemm_dgrad, dx.data_ptr(), g.data_ptr(), w.data_ptr(),
                        off.data_ptr<int64_t>(), &p, ws.data_ptr(), (size_t)ws.numel(),
                        stream_of(g)),
               "grouped_gemm_dgrad");
  return dx;
}

at::Tensor grouped_gemm_wgrad(const at::Tensor &x_, const at::Tensor &grad_y_,
                              const at::Tensor &expert_offsets_, bool trans_w,
                              c10::optional<at::ScalarType> out_dtype) {
  check_dim(x_, 2, "x");
  check_dim(grad_y_, 2, "grad_y");
  check_dim(expert_offsets_, 1, "expert_offsets");
  check_size(grad_y_, 0, x_.size(0), "grad_y", "x.shape[0] (num_rows)");
  const int64_t E = expert_offsets_.size(0) - 1, K = x_.size(1), N = grad_y_.size(1);
  auto p = grouped_gemm_params(x_, "x", grad_y_, "grad_y", expert_offsets_, E,
                               "expert_offsets.shape[0] - 1", K, N, trans_w,
                               out_dtype.value_or(x_.scalar_type()));
  at::Tensor x = x_.contiguous(), g = grad_y_.contiguous(), off = expert_offsets_.contiguous();
  MOE_DEVICE_GUARD(x);
  at::Tensor dw = at::empty(trans_w ? at::IntArrayRef({E, N, K}) : at::IntArrayRef({E, K, N}),
                            x.options().dtype(out_dtype.value_or(x.scalar_type())));
  at::Tensor ws = grouped_gemm_workspace(x, p);
  check_status(MOE_CALL(x, grouped_gemm_wgrad, dw.data_ptr(), x.data_ptr(), g.data_ptr(),
                        off.data_ptr<int64_t>(), &p, ws.data_ptr(), (size_t)ws.numel(),
                        stream_of(x)),
               "grouped_gemm_wgrad");
  return dw;
}

// ---- glu_probs (issue 7, item 3) ---------------------------------------------------------------

moe_activation_t to_activation(c10::string_view name) {
  if (name == "silu") return MOE_ACT_SILU;
  if (name == "gelu") return MOE_ACT_GELU;
  if (name == "gelu_tanh") return MOE_ACT_GELU_TANH;
  if (name == "relu") return MOE_ACT_RELU;
  if (name == "squared_relu") return MOE_ACT_SQUARED_RELU;
  if (name == "quick_gelu") return MOE_ACT_QUICK_GELU;
  MOE_CHECK_VALUE(false, "activation must be 'silu', 'gelu', 'gelu_tanh', 'relu', 'squared_relu' "
                  "or 'quick_gelu', got '", std::string(name), "'");
  return MOE_ACT_SILU;
}

// The activation options of glu_probs and of fc1 + glu_probs, validated.
moe_glu_probs_params_t glu_options(c10::string_view activation, bool gated_linear_unit,
                                   double linear_offset, c10::optional<double> clamp_value) {
  moe_glu_probs_params_t p;
  p.activation = to_activation(activation);
  p.gated_linear_unit = gated_linear_unit ? 1 : 0;
  p.linear_offset = linear_offset;
  p.has_clamp = clamp_value.has_value() ? 1 : 0;
  p.clamp_value = clamp_value.value_or(0.0);
  MOE_CHECK_VALUE(!clamp_value.has_value() || *clamp_value >= 0.0,
                  "clamp_value must be >= 0 (the linear half is clamped to [-v, v]), got ",
                  p.clamp_value);
  return p;
}

// Validates a and probs; returns the options and F.
moe_glu_probs_params_t glu_probs_params(const at::Tensor &a, const c10::optional<at::Tensor> &probs,
                                        c10::string_view activation, bool gated_linear_unit,
                                        double linear_offset, c10::optional<double> clamp_value,
                                        int64_t *ffn) {
  check_dim(a, 2, "a");
  check_float(a, "a");
  const moe_glu_probs_params_t p =
      glu_options(activation, gated_linear_unit, linear_offset, clamp_value);
  const int64_t width = a.size(1);
  if (gated_linear_unit) {
    MOE_CHECK_VALUE(width >= 2 && width % 2 == 0, "a.shape[1] must be 2F (even, >= 2) with "
                    "gated_linear_unit, got shape ", a.sizes());
  } else {
    MOE_CHECK_VALUE(width >= 1, "a.shape[1] must be F >= 1, got shape ", a.sizes());
  }
  *ffn = gated_linear_unit ? width / 2 : width;
  if (probs.has_value()) {
    check_dim(*probs, 1, "probs");
    check_float(*probs, "probs");
    check_size(*probs, 0, a.size(0), "probs", "a.shape[0] (num_rows)");
    check_same_device(*probs, a, "probs", "a");
  }
  return p;
}

at::Tensor glu_probs(const at::Tensor &a_, const c10::optional<at::Tensor> &probs_,
                     c10::string_view activation, bool gated_linear_unit, double linear_offset,
                     c10::optional<double> clamp_value) {
  int64_t F = 0;
  moe_glu_probs_params_t p = glu_probs_params(a_, probs_, activation, gated_linear_unit,
                                              linear_offset, clamp_value, &F);
  const int64_t R = a_.size(0);
  at::Tensor a = a_.contiguous(), probs;
  if (probs_.has_value()) probs = probs_->contiguous();
  MOE_DEVICE_GUARD(a);
  at::Tensor h = at::empty({R, F}, a.options());
  const moe_dtype_t pdt =
      probs.defined() ? to_moe_dtype(probs.scalar_type(), "probs") : to_moe_dtype(a.scalar_type(), "a");
  check_status(MOE_CALL(a, glu_probs_fwd, h.data_ptr(), a.data_ptr(),
                        probs.defined() ? probs.data_ptr() : nullptr, R, F,
                        to_moe_dtype(a.scalar_type(), "a"), pdt, &p, nullptr, 0, stream_of(a)),
               "glu_probs");
  return h;
}

// The checks of glu_probs_bwd / glu_probs_bwd_: a and probs as in the forward, grad_h [R, F].
moe_glu_probs_params_t glu_probs_bwd_params(const at::Tensor &grad_h, const at::Tensor &a,
                                            const c10::optional<at::Tensor> &probs,
                                            c10::string_view activation, bool gated_linear_unit,
                                            double linear_offset, c10::optional<double> clamp_value,
                                            int64_t *ffn) {
  moe_glu_probs_params_t p = glu_probs_params(a, probs, activation, gated_linear_unit,
                                              linear_offset, clamp_value, ffn);
  check_dim(grad_h, 2, "grad_h");
  check_dtype(grad_h, a.scalar_type(), "grad_h");
  check_size(grad_h, 0, a.size(0), "grad_h", "a.shape[0] (num_rows)");
  check_size(grad_h, 1, *ffn, "grad_h", "F (a.shape[1], halved with gated_linear_unit)");
  check_same_device(grad_h, a, "grad_h", "a");
  return p;
}

// Runs the kernel: grad_a and h may be a and grad_h (in place); h may be undefined (not wanted).
at::Tensor glu_probs_bwd_call(at::Tensor &grad_a, at::Tensor &h, const at::Tensor &grad_h,
                              const at::Tensor &a, const at::Tensor &probs, int64_t F,
                              const moe_glu_probs_params_t &p) {
  const int64_t R = a.size(0);
  MOE_DEVICE_GUARD(a);
  at::Tensor grad_probs = probs.defined() ? at::empty({R}, probs.options())
                                          : at::empty({0}, a.options());
  const moe_dtype_t pdt =
      probs.defined() ? to_moe_dtype(probs.scalar_type(), "probs") : to_moe_dtype(a.scalar_type(), "a");
  check_status(MOE_CALL(a, glu_probs_bwd, grad_a.data_ptr(),
                        probs.defined() ? grad_probs.data_ptr() : nullptr,
                        h.defined() ? h.data_ptr() : nullptr, grad_h.data_ptr(), a.data_ptr(),
                        probs.defined() ? probs.data_ptr() : nullptr, R, F,
                        to_moe_dtype(a.scalar_type(), "a"), pdt, &p, nullptr, 0, stream_of(a)),
               "glu_probs_bwd");
  return grad_probs;
}

// grad_probs is [num_rows] in probs' dtype, or an empty [0] tensor when probs is None.
std::tuple<at::Tensor, at::Tensor> glu_probs_bwd(const at::Tensor &grad_h_, const at::Tensor &a_,
                                                 const c10::optional<at::Tensor> &probs_,
                                                 c10::string_view activation,
                                                 bool gated_linear_unit, double linear_offset,
                                                 c10::optional<double> clamp_value) {
  int64_t F = 0;
  const moe_glu_probs_params_t p = glu_probs_bwd_params(
      grad_h_, a_, probs_, activation, gated_linear_unit, linear_offset, clamp_value, &F);
  at::Tensor a = a_.contiguous(), g = grad_h_.contiguous(), probs, none;
  if (probs_.has_value()) probs = probs_->contiguous();
  at::Tensor grad_a = at::empty_like(a);
  at::Tensor grad_probs = glu_probs_bwd_call(grad_a, none, g, a, probs, F, p);
  return {grad_a, grad_probs};
}

// In place: a becomes grad_a and grad_h becomes the forward's h (recomputed); returns grad_probs.
// The expert MLP's backward uses it to need no [rows, 2F] or [rows, F] buffer of its own.
at::Tensor glu_probs_bwd_(at::Tensor grad_h, at::Tensor a, const c10::optional<at::Tensor> &probs_,
                          c10::string_view activation, bool gated_linear_unit,
                          double linear_offset, c10::optional<double> clamp_value) {
  int64_t F = 0;
  const moe_glu_probs_params_t p = glu_probs_bwd_params(
      grad_h, a, probs_, activation, gated_linear_unit, linear_offset, clamp_value, &F);
  MOE_CHECK_VALUE(a.is_contiguous() && grad_h.is_contiguous(),
                  "glu_probs_bwd_ works in place: a and grad_h must be contiguous, got strides ",
                  a.strides(), " and ", grad_h.strides());
  const auto overlap = at::get_overlap_status(a, grad_h);
  MOE_CHECK_VALUE(overlap == at::MemOverlapStatus::No,
                  "glu_probs_bwd_: a and grad_h must not share memory (a becomes grad_a, grad_h "
                  "becomes h)");
  at::Tensor probs;
  if (probs_.has_value()) probs = probs_->contiguous();
  return glu_probs_bwd_call(a, grad_h, grad_h, a, probs, F, p);
}

// ---- fc1 + glu_probs (issue 7, item 3: the epilogue fusion) -------------------------------------

// Returns (h [rows, F], a [rows, 2F or F]); the backward is glu_probs_bwd then the GEMM's.
std::tuple<at::Tensor, at::Tensor> grouped_gemm_glu_probs(
    const at::Tensor &x_, const at::Tensor &weight_, const at::Tensor &expert_offsets_,
    const c10::optional<at::Tensor> &probs_, c10::string_view activation,
    bool gated_linear_unit, double linear_offset, c10::optional<double> clamp_value,
    bool trans_w) {
  check_dim(x_, 2, "x");
  check_dim(weight_, 3, "weight");
  const int64_t E = weight_.size(0), K = x_.size(1), R = x_.size(0);
  const int64_t N = trans_w ? weight_.size(1) : weight_.size(2);
  check_size(weight_, trans_w ? 2 : 1, K, "weight", "x.shape[1] (in_features)");
  auto p = grouped_gemm_params(x_, "x", weight_, "weight", expert_offsets_, E, "weight.shape[0]",
                               K, N, trans_w, x_.scalar_type());
  const int n_dim = trans_w ? 1 : 2;
  if (gated_linear_unit) {
    MOE_CHECK_VALUE(N >= 2 && N % 2 == 0, "weight.shape[", n_dim, "] must be 2F (even, >= 2) "
                    "with gated_linear_unit, got shape ", weight_.sizes());
  } else {
    MOE_CHECK_VALUE(N >= 1, "weight.shape[", n_dim, "] must be F >= 1, got shape ",
                    weight_.sizes());
  }
  const int64_t F = gated_linear_unit ? N / 2 : N;
  const moe_glu_probs_params_t g =
      glu_options(activation, gated_linear_unit, linear_offset, clamp_value);
  at::Tensor probs;
  if (probs_.has_value()) {
    check_dim(*probs_, 1, "probs");
    check_float(*probs_, "probs");
    check_size(*probs_, 0, R, "probs", "x.shape[0] (num_rows)");
    check_same_device(*probs_, x_, "probs", "x");
    probs = probs_->contiguous();
  }
  at::Tensor x = x_.contiguous(), w = weight_.contiguous(), off = expert_offsets_.contiguous();
  MOE_DEVICE_GUARD(x);
  at::Tensor h = at::empty({R, F}, x.options());
  at::Tensor a = at::empty({R, N}, x.options());
  at::Tensor ws = grouped_gemm_workspace(x, p);
  const moe_dtype_t pdt = probs.defined() ? to_moe_dtype(probs.scalar_type(), "probs") : p.dtype;
  check_status(MOE_CALL(x, grouped_gemm_glu_probs_fwd, h.data_ptr(), a.data_ptr(), x.data_ptr(),
                        w.data_ptr(), off.data_ptr<int64_t>(),
                        probs.defined() ? probs.data_ptr() : nullptr, pdt, &p, &g, ws.data_ptr(),
                        (size_t)ws.numel(), stream_of(x)),
               "grouped_gemm_glu_probs");
  return {h, a};
}

}  // namespace

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
  // load balancing (issue 4)
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
  // the activation epilogue (issue 7, item 3)
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
  // load balancing (issue 4)
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
