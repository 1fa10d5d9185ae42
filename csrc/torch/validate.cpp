// validate.cpp: the binding's shared helpers: message assembly, tensor checks, the named options
// (score functions, activations) by name, the C core's status as a Python exception, the current
// stream, the workspace allocation and the GEMM operands (contiguous, aligned).
#include <ATen/ops/empty.h>

#include <c10/core/impl/VirtualGuardImpl.h>

#include <cstdint>
#include <cstdio>
#include <utility>

#include "binding.h"

namespace moe_torch {

// ---- messages -----------------------------------------------------------------------------------

void put(std::string &s, const char *v) { s += v; }
void put(std::string &s, const std::string &v) { s += v; }
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

// ---- validation ---------------------------------------------------------------------------------

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

void check_status(moe_status_t status, const char *op) {
  if (status == MOE_OK) return;
  std::string msg = std::string(op) + ": " + moe_last_error();
  MOE_CHECK_VALUE(status != MOE_ERR_INVALID_ARGUMENT, msg);
  MOE_CHECK_RUNTIME(false, msg, " (", moe_status_string(status), ")");
}

// ---- named options: the rows of an option table (moe_types.h) as (name, enumerator) pairs ------

// The enumerator named `name`, or a ValueError naming the argument `what` and listing the names
// as Python's tuple of them prints (moe_core/ops/names.py).
template <typename Enum, size_t N>
static Enum from_name(c10::string_view name, const std::pair<const char *, Enum> (&rows)[N],
                      const char *what) {
  for (const auto &row : rows)
    if (name == row.first) return row.second;
  std::string names;
  for (const auto &row : rows) names += moe_cat(names.empty() ? "" : ", ", "'", row.first, "'");
  MOE_CHECK_VALUE(false, what, " must be one of (", names, "), got '", std::string(name), "'");
  return rows[0].second;
}

#define MOE_NAMED_ROW(enumerator, value, name) {name, enumerator},

moe_score_function_t to_score_function(c10::string_view name) {
  static const std::pair<const char *, moe_score_function_t> rows[] = {
      MOE_SCORE_FUNCTIONS(MOE_NAMED_ROW)};
  return from_name(name, rows, "score_function");
}

moe_activation_t to_activation(c10::string_view name) {
  static const std::pair<const char *, moe_activation_t> rows[] = {MOE_ACTIVATIONS(MOE_NAMED_ROW)};
  return from_name(name, rows, "activation");
}

#undef MOE_NAMED_ROW

void check_same_shape(const at::Tensor &t, const char *name, const at::Tensor &ref,
                      const char *ref_name) {
  MOE_CHECK_VALUE(t.sizes() == ref.sizes(), name, " shape ", t.sizes(), " must equal ", ref_name,
                  " shape ", ref.sizes());
}

void check_routing_map(const at::Tensor &routing_map, const char *name) {
  check_dim(routing_map, 2, name);
  check_dtype(routing_map, at::kBool, name);
}

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

// ---- devices ------------------------------------------------------------------------------------

OnDevice::OnDevice(const Device &d, const at::Tensor &t) {
  if (!d.cuda) return;
  // Through c10's device-generic interface: the binding needs no CUDA header for this.
  guard_.reset_device(t.device());
  c10::impl::VirtualGuardImpl impl(t.device().type());
  stream_ = impl.getStream(t.device()).native_handle();
}

// ---- workspace ----------------------------------------------------------------------------------

Workspace workspace(const at::Tensor &like, size_t bytes) {
  MOE_CHECK_VALUE(bytes != MOE_SIZE_OVERFLOW, moe_last_error());
  Workspace ws;
  if (bytes == 0) return ws;
  ws.buffer = at::empty({(int64_t)bytes}, like.options().dtype(at::kByte));
  ws.ptr = ws.buffer.data_ptr();
  ws.bytes = bytes;
  return ws;
}

// ---- GEMM operands ------------------------------------------------------------------------------

at::Tensor gemm_operand(const at::Tensor &t) {
  at::Tensor c = t.contiguous();
  if (c.is_cuda() && c.numel() > 0 && reinterpret_cast<uintptr_t>(c.data_ptr()) % 16 != 0)
    c = c.clone();  // a new allocation: the caching allocator's blocks are aligned
  return c;
}

// ---- optional tensors -------------------------------------------------------------------------

moe_dtype_t dtype_or(const at::Tensor &t, const char *name, moe_dtype_t absent) {
  return t.defined() ? to_moe_dtype(t.scalar_type(), name) : absent;
}

at::Tensor or_empty(const at::Tensor &t, const at::Tensor &like) {
  return t.defined() ? t : at::empty({0}, like.options());
}

}  // namespace moe_torch
