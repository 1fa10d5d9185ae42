// torch_binding.cpp: the only file that includes torch. It registers the moe_core ops with the
// PyTorch dispatcher (TORCH_LIBRARY schemas, CPU and CUDA implementations) and, for each call,
// validates the tensors with messages that name the argument, allocates the outputs, and calls
// the C ABI on the current stream. Nothing else lives here: no math, no policy.
#include <Python.h>

#include <ATen/ATen.h>
#include <torch/library.h>

#ifdef MOE_CORE_WITH_CUDA
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#endif

#include <string>

#include "moe_core.h"

namespace {

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
    default: TORCH_CHECK_TYPE(false, name, " has unsupported dtype ", st);
  }
  return MOE_DTYPE_FP32;
}

void check_float(const at::Tensor &t, const char *name) {
  TORCH_CHECK_TYPE(at::isFloatingType(t.scalar_type()) && t.scalar_type() != at::kFloat8_e4m3fn &&
                       t.scalar_type() != at::kFloat8_e5m2,
                   name, " must be float32, float64, float16 or bfloat16, got ", t.scalar_type());
}

void check_dtype(const at::Tensor &t, at::ScalarType st, const char *name) {
  TORCH_CHECK_TYPE(t.scalar_type() == st, name, " must be ", st, ", got ", t.scalar_type());
}

void check_dim(const at::Tensor &t, int64_t dim, const char *name) {
  TORCH_CHECK_VALUE(t.dim() == dim, name, " must be ", dim, "-D, got a ", t.dim(),
                    "-D tensor of shape ", t.sizes());
}

void check_size(const at::Tensor &t, int64_t dim, int64_t size, const char *name,
                const char *what) {
  TORCH_CHECK_VALUE(t.size(dim) == size, name, ".shape[", dim, "] must equal ", what, " (", size,
                    "), got shape ", t.sizes());
}

void check_same_device(const at::Tensor &t, const at::Tensor &ref, const char *name,
                       const char *ref_name) {
  TORCH_CHECK_VALUE(t.device() == ref.device(), name, " is on ", t.device(), " but ", ref_name,
                    " is on ", ref.device(), "; all tensors must be on one device");
}

// Raises the C core's message: ValueError for a bad argument, RuntimeError otherwise.
void check_status(moe_status_t status, const char *op) {
  if (status == MOE_OK) return;
  std::string msg = std::string(op) + ": " + moe_last_error();
  TORCH_CHECK_VALUE(status != MOE_ERR_INVALID_ARGUMENT, msg);
  TORCH_CHECK(false, msg, " (", moe_status_string(status), ")");
}

moe_score_function_t to_score_function(c10::string_view name) {
  if (name == "softmax") return MOE_SCORE_SOFTMAX;
  if (name == "sigmoid") return MOE_SCORE_SIGMOID;
  if (name == "sqrtsoftplus") return MOE_SCORE_SQRTSOFTPLUS;
  TORCH_CHECK_VALUE(false, "score_function must be 'softmax', 'sigmoid' or 'sqrtsoftplus', got '",
                    std::string(name), "'");
  return MOE_SCORE_SOFTMAX;
}

moe_router_topk_params_t make_topk_params(int64_t topk, bool use_pre_softmax, int64_t num_groups,
                                          int64_t group_topk, double scaling_factor,
                                          c10::string_view score_function) {
  moe_router_topk_params_t p;
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

// ---- router_gating_linear ---------------------------------------------------------------------

at::Tensor router_gating_linear(const at::Tensor &inp_, const at::Tensor &weight_,
                                const c10::optional<at::Tensor> &bias_,
                                at::ScalarType router_dtype) {
  check_dim(inp_, 2, "inp");
  check_dim(weight_, 2, "weight");
  check_float(inp_, "inp");
  check_float(weight_, "weight");
  TORCH_CHECK_TYPE(at::isFloatingType(router_dtype), "router_dtype must be a float dtype, got ",
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
  at::Tensor logits = at::empty({T, E}, inp.options().dtype(router_dtype));
  check_status(moe_router_gating_linear_fwd(
                   logits.data_ptr(), inp.data_ptr(), weight.data_ptr(),
                   bias.defined() ? bias.data_ptr() : nullptr, T, H, E,
                   to_moe_dtype(inp.scalar_type(), "inp"),
                   to_moe_dtype(weight.scalar_type(), "weight"),
                   to_moe_dtype(router_dtype, "router_dtype"), nullptr, 0, nullptr),
               "router_gating_linear");
  return logits;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> router_gating_linear_bwd(
    const at::Tensor &grad_logits_, const at::Tensor &inp_, const at::Tensor &weight_) {
  check_dim(grad_logits_, 2, "grad_logits");
  check_dim(inp_, 2, "inp");
  check_dim(weight_, 2, "weight");
  check_float(grad_logits_, "grad_logits");
  const int64_t T = inp_.size(0), H = inp_.size(1), E = weight_.size(0);
  check_size(grad_logits_, 0, T, "grad_logits", "inp.shape[0] (num_tokens)");
  check_size(grad_logits_, 1, E, "grad_logits", "weight.shape[0] (num_experts)");
  at::Tensor g = grad_logits_.contiguous(), inp = inp_.contiguous(), weight = weight_.contiguous();
  at::Tensor grad_inp = at::empty_like(inp), grad_weight = at::empty_like(weight);
  at::Tensor grad_bias = at::empty({E}, weight.options());
  check_status(moe_router_gating_linear_bwd(
                   grad_inp.data_ptr(), grad_weight.data_ptr(), grad_bias.data_ptr(), g.data_ptr(),
                   inp.data_ptr(), weight.data_ptr(), T, H, E,
                   to_moe_dtype(inp.scalar_type(), "inp"),
                   to_moe_dtype(weight.scalar_type(), "weight"),
                   to_moe_dtype(g.scalar_type(), "grad_logits"), nullptr, 0, nullptr),
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
  return at::empty({(int64_t)bytes}, logits.options().dtype(at::kByte));
}

std::tuple<at::Tensor, at::Tensor> router_topk(const at::Tensor &logits_, int64_t topk,
                                               bool use_pre_softmax, int64_t num_groups,
                                               int64_t group_topk, double scaling_factor,
                                               c10::string_view score_function,
                                               const c10::optional<at::Tensor> &expert_bias_) {
  check_dim(logits_, 2, "logits");
  check_float(logits_, "logits");
  const int64_t T = logits_.size(0), E = logits_.size(1);
  TORCH_CHECK_VALUE(E >= 1, "logits must have at least one expert column, got shape ",
                    logits_.sizes());
  at::Tensor logits = logits_.contiguous(), bias;
  if (expert_bias_.has_value()) {
    bias = expert_bias_->contiguous();
    check_dim(bias, 1, "expert_bias");
    check_size(bias, 0, E, "expert_bias", "logits.shape[1] (num_experts)");
    check_dtype(bias, at::kFloat, "expert_bias");
    check_same_device(bias, logits, "expert_bias", "logits");
  }
  moe_router_topk_params_t p = make_topk_params(topk, use_pre_softmax, num_groups, group_topk,
                                                scaling_factor, score_function);
  check_status(moe_router_topk_check(&p, E, bias.defined()), "router_topk");
  MOE_DEVICE_GUARD(logits);
  at::Tensor probs = at::empty({T, topk}, logits.options());
  at::Tensor indices = at::empty({T, topk}, logits.options().dtype(at::kLong));
  at::Tensor ws = topk_workspace(logits, p);
  check_status(MOE_CALL(logits, router_topk_fwd, probs.data_ptr(), indices.data_ptr<int64_t>(),
                        logits.data_ptr(), bias.defined() ? bias.data_ptr<float>() : nullptr, T, E,
                        to_moe_dtype(logits.scalar_type(), "logits"), &p, ws.data_ptr(),
                        (size_t)ws.numel(), stream_of(logits)),
               "router_topk");
  return {probs, indices};
}

at::Tensor router_topk_bwd(const at::Tensor &grad_probs_, const at::Tensor &logits_,
                           const at::Tensor &topk_indices_, int64_t topk, bool use_pre_softmax,
                           int64_t num_groups, int64_t group_topk, double scaling_factor,
                           c10::string_view score_function) {
  check_dim(logits_, 2, "logits");
  check_float(logits_, "logits");
  const int64_t T = logits_.size(0), E = logits_.size(1);
  check_dim(grad_probs_, 2, "grad_probs");
  check_dim(topk_indices_, 2, "topk_indices");
  check_size(grad_probs_, 0, T, "grad_probs", "logits.shape[0] (num_tokens)");
  check_size(grad_probs_, 1, topk, "grad_probs", "topk");
  check_size(topk_indices_, 0, T, "topk_indices", "logits.shape[0] (num_tokens)");
  check_size(topk_indices_, 1, topk, "topk_indices", "topk");
  check_dtype(topk_indices_, at::kLong, "topk_indices");
  check_same_device(grad_probs_, logits_, "grad_probs", "logits");
  check_same_device(topk_indices_, logits_, "topk_indices", "logits");
  at::Tensor logits = logits_.contiguous(), indices = topk_indices_.contiguous();
  at::Tensor grad_probs = grad_probs_.to(logits.scalar_type()).contiguous();
  moe_router_topk_params_t p = make_topk_params(topk, use_pre_softmax, num_groups, group_topk,
                                                scaling_factor, score_function);
  MOE_DEVICE_GUARD(logits);
  at::Tensor grad_logits = at::empty_like(logits);
  at::Tensor ws = topk_workspace(logits, p);
  check_status(MOE_CALL(logits, router_topk_bwd, grad_logits.data_ptr(), grad_probs.data_ptr(),
                        logits.data_ptr(), indices.data_ptr<int64_t>(), T, E,
                        to_moe_dtype(logits.scalar_type(), "logits"), &p, ws.data_ptr(),
                        (size_t)ws.numel(), stream_of(logits)),
               "router_topk_bwd");
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
  TORCH_CHECK_VALUE(topk_probs_.sizes() == topk_indices_.sizes(), "topk_probs shape ",
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
  TORCH_CHECK_TYPE(b.scalar_type() == a.scalar_type(), b_name, " must have the same dtype as ",
                   a_name, " (", a.scalar_type(), "), got ", b.scalar_type());
  check_dtype(offsets, at::kLong, "expert_offsets");
  check_dim(offsets, 1, "expert_offsets");
  TORCH_CHECK_VALUE(num_experts >= 1, "num_experts (", experts_from, ") must be >= 1, got ",
                    num_experts);
  check_size(offsets, 0, num_experts + 1, "expert_offsets", "num_experts + 1");
  check_same_device(b, a, b_name, a_name);
  check_same_device(offsets, a, "expert_offsets", a_name);
  TORCH_CHECK_TYPE(at::isFloatingType(out_dtype) && out_dtype != at::kFloat8_e4m3fn &&
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
  return at::empty({(int64_t)moe_grouped_gemm_workspace_size(&p)},
                   like.options().dtype(at::kByte));
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
  at::Tensor y = at::empty({p.num_rows, N},
                           x.options().dtype(out_dtype.value_or(x.scalar_type())));
  at::Tensor ws = grouped_gemm_workspace(x, p);
  check_status(moe_grouped_gemm_fwd(y.data_ptr(), x.data_ptr(), w.data_ptr(),
                                    off.data_ptr<int64_t>(), &p, ws.data_ptr(),
                                    (size_t)ws.numel(), nullptr),
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
  at::Tensor dx = at::empty({p.num_rows, K},
                            g.options().dtype(out_dtype.value_or(g.scalar_type())));
  at::Tensor ws = grouped_gemm_workspace(g, p);
  check_status(moe_grouped_gemm_dgrad(dx.data_ptr(), g.data_ptr(), w.data_ptr(),
                                      off.data_ptr<int64_t>(), &p, ws.data_ptr(),
                                      (size_t)ws.numel(), nullptr),
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
  at::Tensor dw = at::empty(trans_w ? at::IntArrayRef({E, N, K}) : at::IntArrayRef({E, K, N}),
                            x.options().dtype(out_dtype.value_or(x.scalar_type())));
  at::Tensor ws = grouped_gemm_workspace(x, p);
  check_status(moe_grouped_gemm_wgrad(dw.data_ptr(), x.data_ptr(), g.data_ptr(),
                                      off.data_ptr<int64_t>(), &p, ws.data_ptr(),
                                      (size_t)ws.numel(), nullptr),
               "grouped_gemm_wgrad");
  return dw;
}

}  // namespace

TORCH_LIBRARY(moe_core, m) {
  m.def("router_gating_linear(Tensor inp, Tensor weight, Tensor? bias, ScalarType router_dtype) "
        "-> Tensor");
  m.def("router_gating_linear_bwd(Tensor grad_logits, Tensor inp, Tensor weight) "
        "-> (Tensor, Tensor, Tensor)");
  m.def("router_topk(Tensor logits, int topk, bool use_pre_softmax, int num_groups, "
        "int group_topk, float scaling_factor, str score_function, Tensor? expert_bias) "
        "-> (Tensor, Tensor)");
  m.def("router_topk_bwd(Tensor grad_probs, Tensor logits, Tensor topk_indices, int topk, "
        "bool use_pre_softmax, int num_groups, int group_topk, float scaling_factor, "
        "str score_function) -> Tensor");
  m.def("topk_to_dense(Tensor topk_probs, Tensor topk_indices, int num_experts) "
        "-> (Tensor, Tensor)");
  m.def("topk_to_dense_bwd(Tensor grad_probs, Tensor topk_indices) -> Tensor");
  m.def("grouped_gemm(Tensor x, Tensor weight, Tensor expert_offsets, bool trans_w=False, "
        "ScalarType? out_dtype=None) -> Tensor");
  m.def("grouped_gemm_dgrad(Tensor grad_y, Tensor weight, Tensor expert_offsets, "
        "bool trans_w=False, ScalarType? out_dtype=None) -> Tensor");
  m.def("grouped_gemm_wgrad(Tensor x, Tensor grad_y, Tensor expert_offsets, bool trans_w=False, "
        "ScalarType? out_dtype=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(moe_core, CPU, m) {
  m.impl("router_gating_linear", &router_gating_linear);
  m.impl("router_gating_linear_bwd", &router_gating_linear_bwd);
  m.impl("router_topk", &router_topk);
  m.impl("router_topk_bwd", &router_topk_bwd);
  m.impl("topk_to_dense", &topk_to_dense);
  m.impl("topk_to_dense_bwd", &topk_to_dense_bwd);
  m.impl("grouped_gemm", &grouped_gemm);
  m.impl("grouped_gemm_dgrad", &grouped_gemm_dgrad);
  m.impl("grouped_gemm_wgrad", &grouped_gemm_wgrad);
}

#ifdef MOE_CORE_WITH_CUDA
TORCH_LIBRARY_IMPL(moe_core, CUDA, m) {
  m.impl("router_topk", &router_topk);
  m.impl("router_topk_bwd", &router_topk_bwd);
  m.impl("topk_to_dense", &topk_to_dense);
  m.impl("topk_to_dense_bwd", &topk_to_dense_bwd);
}
#endif

// `import moe_core._C` loads this library, which runs the registrations above. No Python API.
static struct PyModuleDef moe_core_module = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
PyMODINIT_FUNC PyInit__C(void) { return PyModule_Create(&moe_core_module); }
