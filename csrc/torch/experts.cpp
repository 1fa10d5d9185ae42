// experts.cpp: the expert ops: the grouped GEMMs (forward, dgrad, wgrad), the activation with
// the router probs (glu_probs), and fc1 with that activation fused into its epilogue.
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/MemoryOverlap.h>

#include "binding.h"

namespace moe_torch {

// ---- grouped GEMM -------------------------------------------------------------------------------

// Shared checks of the three products: ranks, one operand dtype, offsets [E + 1] int64 on the
// same device. Returns the params; the C core validates the offsets' values (on the CPU).
static moe_grouped_gemm_params_t grouped_gemm_params(const Tensor &a, const char *a_name,
                                                     const Tensor &b, const char *b_name,
                                                     const Tensor &offsets, int64_t num_experts,
                                                     const char *experts_from, int64_t in_features,
                                                     int64_t out_features, bool trans_w,
                                                     at::ScalarType out_dtype) {
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
  moe_grouped_gemm_params_t p{};  // no gather unless set_gather sets one
  p.num_rows = a.size(0);
  p.num_experts = num_experts;
  p.in_features = in_features;
  p.out_features = out_features;
  p.trans_w = trans_w ? 1 : 0;
  p.dtype = to_moe_dtype(a.scalar_type(), a_name);
  p.out_dtype = to_moe_dtype(out_dtype, "out_dtype");
  return p;
}

// The params of a product of rows with the weight: the forward (x [R, K] · W, a's columns meet
// K) or dgrad (grad_y [R, N] · Wᵀ, they meet N). The weight is [E, K, N], or [E, N, K] with
// trans_w; `what` names a's columns in the message when the weight does not match them.
static moe_grouped_gemm_params_t weight_product(const Tensor &a, const char *a_name,
                                                const char *what, const Tensor &weight,
                                                const Tensor &offsets, bool trans_w, bool dgrad,
                                                at::ScalarType out_dtype) {
  check_dim(a, 2, a_name);
  check_dim(weight, 3, "weight");
  const int meet = trans_w != dgrad ? 2 : 1;  // the weight dim a's columns meet
  check_size(weight, meet, a.size(1), "weight", what);
  const int64_t other = weight.size(3 - meet);
  const int64_t K = dgrad ? other : a.size(1), N = dgrad ? a.size(1) : other;
  return grouped_gemm_params(a, a_name, weight, "weight", offsets, weight.size(0),
                             "weight.shape[0]", K, N, trans_w, out_dtype);
}

// The optional index of a gathered operand (`src`, read as rows src[index]; -1 a zero row): a 1-D
// contiguous int64 tensor on src's device. Sets p's gather fields (num_rows becomes the index's
// length); the C core checks the values on the CPU. `index` must outlive the call.
static void set_gather(moe_grouped_gemm_params_t &p, const optional<Tensor> &index,
                       const char *index_name, const Tensor &src, const char *src_name,
                       moe_gg_gather_t operand) {
  p.gather_operand = MOE_GG_GATHER_NONE;
  p.gather_index = nullptr;
  p.gather_rows = 0;
  if (!index.has_value()) return;
  check_dtype(*index, at::kLong, index_name);
  check_dim(*index, 1, index_name);
  check_same_device(*index, src, index_name, src_name);
  MOE_CHECK_VALUE(index->is_contiguous(), index_name, " must be contiguous, got strides ",
                  index->strides());
  p.gather_operand = operand;
  p.gather_index = index->data_ptr<int64_t>();
  p.gather_rows = src.size(0);
  p.num_rows = index->size(0);
}

// One of the three products: the operands made contiguous (and aligned), `out` allocated, the call.
using GroupedGemmFn = decltype(&moe_grouped_gemm_fwd);
static Tensor run_product(const Device &d, GroupedGemmFn fn, const char *op, const Tensor &in0_,
                          const Tensor &in1_, const Tensor &offsets_,
                          const moe_grouped_gemm_params_t &p, at::IntArrayRef out_shape,
                          at::ScalarType out_dtype) {
  Tensor in0 = gemm_operand(in0_), in1 = gemm_operand(in1_), off = offsets_.contiguous();
  const OnDevice on(d, in0);
  Tensor out = at::empty(out_shape, in0.options().dtype(out_dtype));
  const Workspace ws = workspace(in0, d.grouped_gemm_workspace_size(&p));
  check_status(fn(out.data_ptr(), in0.data_ptr(), in1.data_ptr(), off.data_ptr<int64_t>(), &p,
                  ws.ptr, ws.bytes, on.stream()),
               op);
  return out;
}

Tensor grouped_gemm(const Device &d, const Tensor &x, const Tensor &weight,
                    const Tensor &expert_offsets, bool trans_w, optional<at::ScalarType> out_dtype,
                    const optional<Tensor> &x_index) {
  const at::ScalarType odt = out_dtype.value_or(x.scalar_type());
  auto p = weight_product(x, "x", "x.shape[1] (in_features)", weight, expert_offsets, trans_w,
                          false, odt);
  set_gather(p, x_index, "x_index", x, "x", MOE_GG_GATHER_X);
  return run_product(d, d.grouped_gemm_fwd, "grouped_gemm", x, weight, expert_offsets, p,
                     {p.num_rows, p.out_features}, odt);
}

Tensor grouped_gemm_dgrad(const Device &d, const Tensor &grad_y, const Tensor &weight,
                          const Tensor &expert_offsets, bool trans_w,
                          optional<at::ScalarType> out_dtype,
                          const optional<Tensor> &grad_y_index) {
  const at::ScalarType odt = out_dtype.value_or(grad_y.scalar_type());
  auto p = weight_product(grad_y, "grad_y", "grad_y.shape[1] (out_features)", weight,
                          expert_offsets, trans_w, true, odt);
  set_gather(p, grad_y_index, "grad_y_index", grad_y, "grad_y", MOE_GG_GATHER_DY);
  return run_product(d, d.grouped_gemm_dgrad, "grouped_gemm_dgrad", grad_y, weight,
                     expert_offsets, p, {p.num_rows, p.in_features}, odt);
}

// At most one of x_index / grad_y_index: the rows of the other operand are its own rows.
Tensor grouped_gemm_wgrad(const Device &d, const Tensor &x, const Tensor &grad_y,
                          const Tensor &expert_offsets, bool trans_w,
                          optional<at::ScalarType> out_dtype, const optional<Tensor> &x_index,
                          const optional<Tensor> &grad_y_index) {
  MOE_CHECK_VALUE(!(x_index.has_value() && grad_y_index.has_value()),
                  "grouped_gemm_wgrad gathers at most one operand: pass x_index or grad_y_index, "
                  "not both");
  check_dim(x, 2, "x");
  check_dim(grad_y, 2, "grad_y");
  check_dim(expert_offsets, 1, "expert_offsets");
  // the rows: the index's length for the gathered operand, the other operand's own rows
  if (x_index.has_value()) {
    check_dim(*x_index, 1, "x_index");
    check_size(grad_y, 0, x_index->size(0), "grad_y", "x_index.shape[0] (num_rows)");
  } else if (grad_y_index.has_value()) {
    check_dim(*grad_y_index, 1, "grad_y_index");
    check_size(x, 0, grad_y_index->size(0), "x", "grad_y_index.shape[0] (num_rows)");
  } else {
    check_size(grad_y, 0, x.size(0), "grad_y", "x.shape[0] (num_rows)");
  }
  const int64_t E = expert_offsets.size(0) - 1, K = x.size(1), N = grad_y.size(1);
  const at::ScalarType odt = out_dtype.value_or(x.scalar_type());
  auto p = grouped_gemm_params(x, "x", grad_y, "grad_y", expert_offsets, E,
                               "expert_offsets.shape[0] - 1", K, N, trans_w, odt);
  if (x_index.has_value()) set_gather(p, x_index, "x_index", x, "x", MOE_GG_GATHER_X);
  else set_gather(p, grad_y_index, "grad_y_index", grad_y, "grad_y", MOE_GG_GATHER_DY);
  return run_product(d, d.grouped_gemm_wgrad, "grouped_gemm_wgrad", x, grad_y, expert_offsets, p,
                     trans_w ? at::IntArrayRef({E, N, K}) : at::IntArrayRef({E, K, N}), odt);
}

// ---- glu_probs ----------------------------------------------------------------------------------

// The activation options of glu_probs and of fc1 + glu_probs (the core checks their values).
static moe_glu_probs_params_t glu_options(string_view activation, bool gated_linear_unit,
                                          double linear_offset, optional<double> clamp_value,
                                          int64_t glu_interleave_size) {
  moe_glu_probs_params_t p;
  p.interleave = glu_interleave_size;
  p.activation = to_activation(activation);
  p.gated_linear_unit = gated_linear_unit ? 1 : 0;
  p.linear_offset = linear_offset;
  p.has_clamp = clamp_value.has_value() ? 1 : 0;
  p.clamp_value = clamp_value.value_or(0.0);
  return p;
}

// F of the activation input whose dim `dim` of `t` is its width: 2F with GLU, else F.
static int64_t glu_ffn(const Tensor &t, const char *name, int dim, bool gated_linear_unit) {
  const int64_t width = t.size(dim);
  if (gated_linear_unit) {
    MOE_CHECK_VALUE(width >= 2 && width % 2 == 0, name, ".shape[", dim,
                    "] must be 2F (even, >= 2) with gated_linear_unit, got shape ", t.sizes());
    return width / 2;
  }
  MOE_CHECK_VALUE(width >= 1, name, ".shape[", dim, "] must be F >= 1, got shape ", t.sizes());
  return width;
}

// The optional per-row probs: [rows] float on the device of `ref`; `rows_of` names the rows.
static void check_row_probs(const optional<Tensor> &probs, int64_t rows, const Tensor &ref,
                            const char *ref_name, const char *rows_of) {
  if (!probs.has_value()) return;
  check_dim(*probs, 1, "probs");
  check_float(*probs, "probs");
  check_size(*probs, 0, rows, "probs", rows_of);
  check_same_device(*probs, ref, "probs", ref_name);
}

// Validates a and probs; returns the options and F.
static moe_glu_probs_params_t glu_probs_params(const Tensor &a, const optional<Tensor> &probs,
                                               string_view activation, bool gated_linear_unit,
                                               double linear_offset, optional<double> clamp_value,
                                               int64_t glu_interleave_size, int64_t *ffn) {
  check_dim(a, 2, "a");
  check_float(a, "a");
  const moe_glu_probs_params_t p = glu_options(activation, gated_linear_unit, linear_offset,
                                               clamp_value, glu_interleave_size);
  *ffn = glu_ffn(a, "a", 1, gated_linear_unit);
  check_row_probs(probs, a.size(0), a, "a", "a.shape[0] (num_rows)");
  return p;
}

Tensor glu_probs(const Device &d, const Tensor &a_, const optional<Tensor> &probs_,
                 string_view activation, bool gated_linear_unit, double linear_offset,
                 optional<double> clamp_value, int64_t glu_interleave_size) {
  int64_t F = 0;
  moe_glu_probs_params_t p = glu_probs_params(a_, probs_, activation, gated_linear_unit,
                                              linear_offset, clamp_value, glu_interleave_size, &F);
  const int64_t R = a_.size(0);
  Tensor a = a_.contiguous(), probs;
  if (probs_.has_value()) probs = probs_->contiguous();
  const OnDevice on(d, a);
  Tensor h = at::empty({R, F}, a.options());
  const moe_dtype_t dt = to_moe_dtype(a.scalar_type(), "a");
  check_status(d.glu_probs_fwd(h.data_ptr(), a.data_ptr(), data_or_null(probs), R, F, dt,
                               dtype_or(probs, "probs", dt), &p, nullptr, 0, on.stream()),
               "glu_probs");
  return h;
}

// The checks of glu_probs_bwd / glu_probs_bwd_: a and probs as in the forward, grad_h [R, F].
static moe_glu_probs_params_t glu_probs_bwd_params(const Tensor &grad_h, const Tensor &a,
                                                   const optional<Tensor> &probs,
                                                   string_view activation, bool gated_linear_unit,
                                                   double linear_offset,
                                                   optional<double> clamp_value,
                                                   int64_t glu_interleave_size, int64_t *ffn) {
  moe_glu_probs_params_t p = glu_probs_params(a, probs, activation, gated_linear_unit,
                                              linear_offset, clamp_value, glu_interleave_size, ffn);
  check_dim(grad_h, 2, "grad_h");
  check_dtype(grad_h, a.scalar_type(), "grad_h");
  check_size(grad_h, 0, a.size(0), "grad_h", "a.shape[0] (num_rows)");
  check_size(grad_h, 1, *ffn, "grad_h", "F (a.shape[1], halved with gated_linear_unit)");
  check_same_device(grad_h, a, "grad_h", "a");
  return p;
}

// Runs the kernel: grad_a and h may be a and grad_h (in place); h may be undefined (not wanted).
static Tensor glu_probs_bwd_call(const Device &d, Tensor &grad_a, Tensor &h, const Tensor &grad_h,
                                 const Tensor &a, const Tensor &probs, int64_t F,
                                 const moe_glu_probs_params_t &p) {
  const int64_t R = a.size(0);
  const OnDevice on(d, a);
  Tensor grad_probs;  // with probs only
  if (probs.defined()) grad_probs = at::empty({R}, probs.options());
  const moe_dtype_t dt = to_moe_dtype(a.scalar_type(), "a");
  check_status(d.glu_probs_bwd(grad_a.data_ptr(), data_or_null(grad_probs), data_or_null(h),
                               grad_h.data_ptr(), a.data_ptr(), data_or_null(probs), R, F, dt,
                               dtype_or(probs, "probs", dt), &p, nullptr, 0, on.stream()),
               "glu_probs_bwd");
  return or_empty(grad_probs, a);
}

// grad_probs is [num_rows] in probs' dtype, or an empty [0] tensor when probs is None.
Tensor2 glu_probs_bwd(const Device &d, const Tensor &grad_h_, const Tensor &a_,
                      const optional<Tensor> &probs_, string_view activation,
                      bool gated_linear_unit, double linear_offset, optional<double> clamp_value,
                      int64_t glu_interleave_size) {
  int64_t F = 0;
  const moe_glu_probs_params_t p =
      glu_probs_bwd_params(grad_h_, a_, probs_, activation, gated_linear_unit, linear_offset,
                           clamp_value, glu_interleave_size, &F);
  Tensor a = a_.contiguous(), g = grad_h_.contiguous(), probs, none;
  if (probs_.has_value()) probs = probs_->contiguous();
  Tensor grad_a = at::empty_like(a);
  Tensor grad_probs = glu_probs_bwd_call(d, grad_a, none, g, a, probs, F, p);
  return {grad_a, grad_probs};
}

// In place: grad_h becomes the forward's h (recomputed) and grad_a gets a's gradient; returns
// grad_probs. grad_a may be a itself (a becomes its gradient: the expert MLP's eager backward,
// which then needs no [rows, 2F] or [rows, F] buffer of its own) or a buffer of a's shape that
// shares no memory with it (a compiled backward, whose saved a is an input of the graph that a
// mutation would make the compiler copy first).
Tensor glu_probs_bwd_(const Device &d, Tensor grad_h, const Tensor &a, Tensor grad_a,
                      const optional<Tensor> &probs_, string_view activation,
                      bool gated_linear_unit, double linear_offset, optional<double> clamp_value,
                      int64_t glu_interleave_size) {
  int64_t F = 0;
  const moe_glu_probs_params_t p =
      glu_probs_bwd_params(grad_h, a, probs_, activation, gated_linear_unit, linear_offset,
                           clamp_value, glu_interleave_size, &F);
  check_dtype(grad_a, a.scalar_type(), "grad_a");
  check_same_shape(grad_a, "grad_a", a, "a");
  check_same_device(grad_a, a, "grad_a", "a");
  MOE_CHECK_VALUE(a.is_contiguous() && grad_h.is_contiguous() && grad_a.is_contiguous(),
                  "glu_probs_bwd_ works in place: a, grad_a and grad_h must be contiguous, got "
                  "strides ", a.strides(), ", ", grad_a.strides(), " and ", grad_h.strides());
  MOE_CHECK_VALUE(at::get_overlap_status(a, grad_h) == at::MemOverlapStatus::No &&
                      at::get_overlap_status(grad_a, grad_h) == at::MemOverlapStatus::No,
                  "glu_probs_bwd_: grad_h must not share memory with a or grad_a (grad_h "
                  "becomes h)");
  const auto a_overlap = at::get_overlap_status(grad_a, a);
  MOE_CHECK_VALUE(a_overlap == at::MemOverlapStatus::No ||
                      (a_overlap == at::MemOverlapStatus::Full &&
                       grad_a.data_ptr() == a.data_ptr()),
                  "glu_probs_bwd_: grad_a must be a itself or share no memory with it");
  Tensor probs;
  if (probs_.has_value()) probs = probs_->contiguous();
  return glu_probs_bwd_call(d, grad_a, grad_h, grad_h, a, probs, F, p);
}

// ---- fc1 + glu_probs (the epilogue fusion) ------------------------------------------------------

// Returns (h [rows, F], a [rows, 2F or F]); the backward is glu_probs_bwd then the GEMM's.
Tensor2 grouped_gemm_glu_probs(const Device &d, const Tensor &x_, const Tensor &weight_,
                               const Tensor &expert_offsets_, const optional<Tensor> &probs_,
                               string_view activation, bool gated_linear_unit, double linear_offset,
                               optional<double> clamp_value, bool trans_w,
                               const optional<Tensor> &x_index, int64_t glu_interleave_size) {
  auto p = weight_product(x_, "x", "x.shape[1] (in_features)", weight_, expert_offsets_, trans_w,
                          false, x_.scalar_type());
  set_gather(p, x_index, "x_index", x_, "x", MOE_GG_GATHER_X);
  const int64_t R = p.num_rows, N = p.out_features;
  const int64_t F = glu_ffn(weight_, "weight", trans_w ? 1 : 2, gated_linear_unit);
  const moe_glu_probs_params_t g = glu_options(activation, gated_linear_unit, linear_offset,
                                               clamp_value, glu_interleave_size);
  check_row_probs(probs_, R, x_, "x",
                  x_index.has_value() ? "x_index.shape[0] (num_rows)" : "x.shape[0] (num_rows)");
  Tensor x = gemm_operand(x_), w = gemm_operand(weight_), off = expert_offsets_.contiguous(), probs;
  if (probs_.has_value()) probs = probs_->contiguous();
  const OnDevice on(d, x);
  Tensor h = at::empty({R, F}, x.options());
  Tensor a = at::empty({R, N}, x.options());
  const Workspace ws = workspace(x, d.grouped_gemm_workspace_size(&p));

  check_status(d.grouped_gemm_glu_probs_fwd(h.data_ptr(), a.data_ptr(), x.data_ptr(), w.data_ptr(),
                                            off.data_ptr<int64_t>(), data_or_null(probs),
                                            dtype_or(probs, "probs", p.dtype), &p, &g, ws.ptr,
                                            ws.bytes, on.stream()),
               "grouped_gemm_glu_probs");
  return {h, a};
}

}  // namespace moe_torch
