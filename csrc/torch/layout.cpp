// layout.cpp: the token layout ops: compact routing to Megatron's dense form, capacity dropping,
// permute / unpermute (tokens <-> the expert-grouped rows), chunk sorting, tokens per expert.
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>

#include "checks.h"  // moe_permute_check_params: the row bound sizes the outputs

#include "binding.h"

namespace moe_torch {

// ---- topk_to_dense ------------------------------------------------------------------------------

Tensor2 topk_to_dense(const Device &d, const Tensor &topk_probs_, const Tensor &topk_indices_,
                      int64_t num_experts) {
  check_dim(topk_probs_, 2, "topk_probs");
  check_dim(topk_indices_, 2, "topk_indices");
  check_float(topk_probs_, "topk_probs");
  check_dtype(topk_indices_, at::kLong, "topk_indices");
  check_same_shape(topk_probs_, "topk_probs", topk_indices_, "topk_indices");
  check_same_device(topk_indices_, topk_probs_, "topk_indices", "topk_probs");
  const int64_t T = topk_probs_.size(0), k = topk_probs_.size(1);
  Tensor tp = topk_probs_.contiguous(), ti = topk_indices_.contiguous();
  const OnDevice on(d, tp);
  Tensor probs = at::empty({T, num_experts}, tp.options());
  Tensor routing_map = at::empty({T, num_experts}, tp.options().dtype(at::kBool));
  check_status(d.topk_to_dense_fwd(probs.data_ptr(), (uint8_t *)routing_map.data_ptr(),
                                   tp.data_ptr(), ti.data_ptr<int64_t>(), T, num_experts, k,
                                   to_moe_dtype(tp.scalar_type(), "topk_probs"), nullptr, 0,
                                   on.stream()),
               "topk_to_dense");
  return {probs, routing_map};
}

Tensor topk_to_dense_bwd(const Device &d, const Tensor &grad_probs_, const Tensor &topk_indices_) {
  check_dim(grad_probs_, 2, "grad_probs");
  check_dim(topk_indices_, 2, "topk_indices");
  check_float(grad_probs_, "grad_probs");
  check_dtype(topk_indices_, at::kLong, "topk_indices");
  check_size(topk_indices_, 0, grad_probs_.size(0), "topk_indices",
             "grad_probs.shape[0] (num_tokens)");
  check_same_device(topk_indices_, grad_probs_, "topk_indices", "grad_probs");
  const int64_t T = grad_probs_.size(0), E = grad_probs_.size(1), k = topk_indices_.size(1);
  Tensor g = grad_probs_.contiguous(), ti = topk_indices_.contiguous();
  const OnDevice on(d, g);
  Tensor out = at::empty({T, k}, g.options());
  check_status(d.topk_to_dense_bwd(out.data_ptr(), g.data_ptr(), ti.data_ptr<int64_t>(), T, E, k,
                                   to_moe_dtype(g.scalar_type(), "grad_probs"), nullptr, 0,
                                   on.stream()),
               "topk_to_dense_bwd");
  return out;
}

static void check_index_vector(const Tensor &t, int64_t size, const char *name, const char *what,
                               const Tensor &ref, const char *ref_name) {
  check_dim(t, 1, name);
  check_dtype(t, at::kLong, name);
  if (size >= 0) check_size(t, 0, size, name, what);
  check_same_device(t, ref, name, ref_name);
}

static moe_drop_policy_t to_drop_policy(string_view name) {
  if (name == "probs") return MOE_DROP_PROBS;
  if (name == "position") return MOE_DROP_POSITION;
  MOE_CHECK_VALUE(false, "drop_policy must be 'probs' or 'position', got '", std::string(name),
                    "'");
  return MOE_DROP_PROBS;
}

// Dense probs [T, E] (float, E >= 1) and their bool map of the same shape, on one device.
static void check_probs_and_map(const Tensor &probs, const char *probs_name, const Tensor &map,
                                const char *map_name) {
  check_dim(probs, 2, probs_name);
  check_float(probs, probs_name);
  check_routing_map(map, map_name);
  check_same_shape(map, map_name, probs, probs_name);
  check_same_device(map, probs, map_name, probs_name);
  MOE_CHECK_VALUE(probs.size(1) >= 1, probs_name,
                  " must have at least one expert column, got shape ", probs.sizes());
}

Tensor2 token_dropping(const Device &d, const Tensor &routing_probs_, const Tensor &routing_map_,
                       int64_t capacity, string_view drop_policy, bool pad_to_capacity) {
  check_probs_and_map(routing_probs_, "routing_probs", routing_map_, "routing_map");
  const moe_drop_policy_t policy = to_drop_policy(drop_policy);
  const int64_t T = routing_probs_.size(0), E = routing_probs_.size(1);
  Tensor probs = routing_probs_.contiguous(), map = routing_map_.contiguous();
  Tensor final_probs = at::empty_like(probs), final_map = at::empty_like(map);
  const moe_dtype_t dt = to_moe_dtype(probs.scalar_type(), "routing_probs");
  const OnDevice on(d, probs);
  const Workspace ws = workspace(probs, d.token_dropping_workspace_size(T, E, policy, dt));
  check_status(d.token_dropping_fwd(final_probs.data_ptr(), (uint8_t *)final_map.data_ptr(),
                                    probs.data_ptr(), (const uint8_t *)map.data_ptr(), T, E,
                                    capacity, policy, pad_to_capacity ? 1 : 0, dt, ws.ptr, ws.bytes,
                                    on.stream()),
               "token_dropping");
  return {final_probs, final_map};
}

Tensor token_dropping_bwd(const Device &d, const Tensor &grad_final_probs_,
                          const Tensor &final_map_) {
  check_probs_and_map(grad_final_probs_, "grad_final_probs", final_map_, "final_map");
  Tensor g = grad_final_probs_.contiguous(), map = final_map_.contiguous();
  Tensor out = at::empty_like(g);
  const OnDevice on(d, g);
  check_status(d.token_dropping_bwd(out.data_ptr(), g.data_ptr(), (const uint8_t *)map.data_ptr(),
                                    g.size(0), g.size(1),
                                    to_moe_dtype(g.scalar_type(), "grad_final_probs"), nullptr, 0,
                                    on.stream()),
               "token_dropping_bwd");
  return out;
}

// What permute and permute_layout check alike (one check): the tokens [T, H] float with H >= 1
// when given (permute; undefined for the layout only), the map [T, E] bool with E >= 1, the
// optional probs of the map's shape on the same device, and the params, whose core check
// (checked int64 arithmetic, the row bound and [rows, hidden] included) runs before anything is
// allocated.
struct PermuteArgs {
  Tensor tokens, map, probs;  // contiguous; tokens and probs undefined where absent
  moe_permute_params_t params;
  int64_t num_rows;
};

static PermuteArgs check_permute_args(const char *op, const Tensor &tokens_,
                                      const Tensor &routing_map_, const optional<Tensor> &probs_,
                                      int64_t num_out_tokens, bool drop_and_pad,
                                      int64_t align_size) {
  const bool rows = tokens_.defined();
  if (rows) {
    check_dim(tokens_, 2, "tokens");
    check_float(tokens_, "tokens");
  }
  check_routing_map(routing_map_, "routing_map");
  if (rows) {
    check_size(routing_map_, 0, tokens_.size(0), "routing_map", "tokens.shape[0] (num_tokens)");
    check_same_device(routing_map_, tokens_, "routing_map", "tokens");
  }
  const int64_t T = routing_map_.size(0), E = routing_map_.size(1);
  const int64_t H = rows ? tokens_.size(1) : 0;  // 0: the layout only
  if (rows) MOE_CHECK_VALUE(H >= 1, "tokens must have hidden >= 1, got shape ", tokens_.sizes());
  MOE_CHECK_VALUE(E >= 1, "routing_map must have at least one expert column, got shape ",
                  routing_map_.sizes());
  PermuteArgs a;
  if (rows) a.tokens = tokens_.contiguous();
  a.map = routing_map_.contiguous();
  if (probs_.has_value()) {
    a.probs = probs_->contiguous();
    check_dim(a.probs, 2, "probs");
    check_float(a.probs, "probs");
    check_same_shape(a.probs, "probs", a.map, "routing_map");
    check_same_device(a.probs, rows ? a.tokens : a.map, "probs", rows ? "tokens" : "routing_map");
  }
  a.params.num_out_tokens = num_out_tokens;
  a.params.align_size = align_size;
  a.params.drop_and_pad = drop_and_pad ? 1 : 0;
  a.num_rows = 0;
  check_status(moe_permute_check_params(T, H, E, &a.params, &a.num_rows), op);
  return a;
}

Tensor5 permute(const Device &d, const Tensor &tokens_, const Tensor &routing_map_,
                const optional<Tensor> &probs_, int64_t num_out_tokens, bool drop_and_pad,
                int64_t align_size) {
  const PermuteArgs a = check_permute_args("permute", tokens_, routing_map_, probs_,
                                           num_out_tokens, drop_and_pad, align_size);
  const Tensor &tokens = a.tokens, &map = a.map, &probs = a.probs;
  const int64_t T = tokens.size(0), H = tokens.size(1), E = map.size(1), R = a.num_rows;
  Tensor out = at::empty({R, H}, tokens.options());
  Tensor out_probs;  // with probs only
  if (probs.defined()) out_probs = at::empty({R}, probs.options());
  Tensor idx = at::empty({R}, tokens.options().dtype(at::kLong));
  Tensor offsets = at::empty({E + 1}, idx.options());
  Tensor counts = at::empty({E}, idx.options());
  const OnDevice on(d, tokens);
  const Workspace ws = workspace(tokens, d.permute_workspace_size(T, E, &a.params));
  check_status(d.permute_fwd(out.data_ptr(), data_or_null(out_probs), idx.data_ptr<int64_t>(),
                             offsets.data_ptr<int64_t>(), counts.data_ptr<int64_t>(),
                             tokens.data_ptr(), (const uint8_t *)map.data_ptr(),
                             data_or_null(probs), T, H, E,
                             to_moe_dtype(tokens.scalar_type(), "tokens"),
                             dtype_or(probs, "probs", MOE_DTYPE_FP32), &a.params, ws.ptr, ws.bytes,
                             on.stream()),
               "permute");
  return {out, or_empty(out_probs, tokens), idx, offsets, counts};
}

// permute without the rows: the core's layout-only mode (no row buffers, hidden 0). Without
// probs the first output is an empty fp32 [0].
Tensor4 permute_layout(const Device &d, const Tensor &routing_map_,
                       const optional<Tensor> &probs_, int64_t num_out_tokens, bool drop_and_pad,
                       int64_t align_size) {
  const PermuteArgs a = check_permute_args("permute_layout", Tensor(), routing_map_, probs_,
                                           num_out_tokens, drop_and_pad, align_size);
  const Tensor &map = a.map, &probs = a.probs;
  const int64_t T = map.size(0), E = map.size(1), R = a.num_rows;
  Tensor out_probs = probs.defined() ? at::empty({R}, probs.options())
                                     : at::empty({0}, map.options().dtype(at::kFloat));
  Tensor idx = at::empty({R}, map.options().dtype(at::kLong));
  Tensor offsets = at::empty({E + 1}, idx.options());
  Tensor counts = at::empty({E}, idx.options());
  const moe_dtype_t pdt = dtype_or(probs, "probs", MOE_DTYPE_FP32);
  const OnDevice on(d, map);
  const Workspace ws = workspace(map, d.permute_workspace_size(T, E, &a.params));
  // no rows: their dtype is not read, the probs' stands in
  check_status(d.permute_fwd(nullptr, probs.defined() ? out_probs.data_ptr() : nullptr,
                             idx.data_ptr<int64_t>(), offsets.data_ptr<int64_t>(),
                             counts.data_ptr<int64_t>(), nullptr,
                             (const uint8_t *)map.data_ptr(), data_or_null(probs), T, 0, E, pdt,
                             pdt, &a.params, ws.ptr, ws.bytes, on.stream()),
               "permute_layout");
  return {out_probs, idx, offsets, counts};
}

// What permute_bwd and permute_layout_bwd check alike (one check): the rows' gradient
// grad_rows [R, H] float with H >= 1 when given (permute_bwd; undefined for the layout's
// backward, whose R is grad_permuted_probs'), grad_permuted_probs [R] float when given, the
// layout (sorted_indices [R], expert_offsets [E + 1], E >= 1) on their device, and the token
// count. Returns E.
static int64_t check_permute_bwd_args(const Tensor &grad_rows,
                                      const optional<Tensor> &grad_permuted_probs,
                                      const Tensor &sorted_indices, const Tensor &expert_offsets,
                                      int64_t num_tokens) {
  const bool rows = grad_rows.defined();
  if (rows) {
    check_dim(grad_rows, 2, "grad_permuted_tokens");
    check_float(grad_rows, "grad_permuted_tokens");
    MOE_CHECK_VALUE(grad_rows.size(1) >= 1, "grad_permuted_tokens must have hidden >= 1, got "
                    "shape ", grad_rows.sizes());
  }
  if (grad_permuted_probs.has_value()) {
    check_dim(*grad_permuted_probs, 1, "grad_permuted_probs");
    check_float(*grad_permuted_probs, "grad_permuted_probs");
  }
  const Tensor &ref = rows ? grad_rows : *grad_permuted_probs;
  const char *ref_name = rows ? "grad_permuted_tokens" : "grad_permuted_probs";
  const char *rows_what = rows ? "grad_permuted_tokens.shape[0] (rows)"
                               : "grad_permuted_probs.shape[0] (rows)";
  const int64_t R = ref.size(0);
  if (rows && grad_permuted_probs.has_value()) {
    check_size(*grad_permuted_probs, 0, R, "grad_permuted_probs", rows_what);
    check_same_device(*grad_permuted_probs, grad_rows, "grad_permuted_probs", ref_name);
  }
  check_index_vector(sorted_indices, R, "sorted_indices", rows_what, ref, ref_name);
  check_index_vector(expert_offsets, -1, "expert_offsets", "", ref, ref_name);
  const int64_t E = expert_offsets.size(0) - 1;
  MOE_CHECK_VALUE(E >= 1, "expert_offsets must have num_experts + 1 >= 2 entries, got shape ",
                  expert_offsets.sizes());
  MOE_CHECK_VALUE(num_tokens >= 0, "num_tokens must be >= 0, got ", num_tokens);
  return E;
}

Tensor2 permute_bwd(const Device &d, const Tensor &grad_permuted_tokens_,
                    const optional<Tensor> &grad_permuted_probs_, const Tensor &sorted_indices_,
                    const Tensor &expert_offsets_, int64_t num_tokens) {
  const int64_t E = check_permute_bwd_args(grad_permuted_tokens_, grad_permuted_probs_,
                                           sorted_indices_, expert_offsets_, num_tokens);
  const int64_t R = grad_permuted_tokens_.size(0), H = grad_permuted_tokens_.size(1);
  Tensor g = grad_permuted_tokens_.contiguous(), idx = sorted_indices_.contiguous();
  Tensor offsets = expert_offsets_.contiguous(), gp;
  if (grad_permuted_probs_.has_value()) gp = grad_permuted_probs_->contiguous();
  Tensor grad_tokens = at::empty({num_tokens, H}, g.options());
  Tensor grad_probs;  // with grad_permuted_probs only
  if (gp.defined()) grad_probs = at::empty({num_tokens, E}, gp.options());
  const OnDevice on(d, g);
  const Workspace ws = workspace(g, d.unpermute_workspace_size(num_tokens, R));
  check_status(d.permute_bwd(grad_tokens.data_ptr(), data_or_null(grad_probs), g.data_ptr(),
                             data_or_null(gp), idx.data_ptr<int64_t>(), offsets.data_ptr<int64_t>(),
                             num_tokens, H, E, R,
                             to_moe_dtype(g.scalar_type(), "grad_permuted_tokens"),
                             dtype_or(gp, "grad_permuted_probs", MOE_DTYPE_FP32), ws.ptr, ws.bytes,
                             on.stream()),
               "permute_bwd");
  return {grad_tokens, or_empty(grad_probs, g)};
}

// permute_bwd without the rows: the core's grad_probs-only mode (no row buffers, hidden 0).
Tensor permute_layout_bwd(const Device &d, const Tensor &grad_permuted_probs_,
                          const Tensor &sorted_indices_, const Tensor &expert_offsets_,
                          int64_t num_tokens) {
  const int64_t E = check_permute_bwd_args(Tensor(), grad_permuted_probs_, sorted_indices_,
                                           expert_offsets_, num_tokens);
  Tensor gp = grad_permuted_probs_.contiguous(), idx = sorted_indices_.contiguous();
  Tensor offsets = expert_offsets_.contiguous();
  const int64_t R = gp.size(0);
  Tensor grad_probs = at::empty({num_tokens, E}, gp.options());
  const moe_dtype_t pdt = to_moe_dtype(gp.scalar_type(), "grad_permuted_probs");
  const OnDevice on(d, gp);
  const Workspace ws = workspace(gp, d.unpermute_workspace_size(num_tokens, R));
  check_status(d.permute_bwd(nullptr, grad_probs.data_ptr(), nullptr, gp.data_ptr(),
                             idx.data_ptr<int64_t>(), offsets.data_ptr<int64_t>(), num_tokens, 0,
                             E, R, pdt, pdt, ws.ptr, ws.bytes, on.stream()),
               "permute_layout_bwd");
  return grad_probs;
}

// In place: acc is the caller's accumulator, so it is never copied (it must be contiguous fp32);
// the row range and the dtype are the C core's check (one check for both devices).
void permute_bwd_accumulate_(const Device &d, const Tensor &acc, const Tensor &grad_rows_chunk_,
                             const Tensor &sorted_indices_, int64_t row_lo) {
  check_dim(acc, 2, "acc");
  check_dtype(acc, at::kFloat, "acc");
  MOE_CHECK_VALUE(acc.is_contiguous(), "acc must be contiguous (it is updated in place), got "
                  "strides ", acc.strides());
  check_dim(grad_rows_chunk_, 2, "grad_rows_chunk");
  check_float(grad_rows_chunk_, "grad_rows_chunk");
  check_size(grad_rows_chunk_, 1, acc.size(1), "grad_rows_chunk", "acc.shape[1] (hidden)");
  check_same_device(grad_rows_chunk_, acc, "grad_rows_chunk", "acc");
  check_index_vector(sorted_indices_, -1, "sorted_indices", "", acc, "acc");
  MOE_CHECK_VALUE(acc.size(1) >= 1, "acc must have hidden >= 1, got shape ", acc.sizes());
  Tensor g = grad_rows_chunk_.contiguous(), idx = sorted_indices_.contiguous();
  const int64_t T = acc.size(0), H = acc.size(1), R = idx.size(0), n = g.size(0);
  const OnDevice on(d, acc);
  const Workspace ws = workspace(acc, d.permute_bwd_accumulate_workspace_size(T, n));
  check_status(d.permute_bwd_accumulate(acc.data_ptr<float>(), g.data_ptr(),
                                        idx.data_ptr<int64_t>(), T, H, R, row_lo, n,
                                        to_moe_dtype(g.scalar_type(), "grad_rows_chunk"), ws.ptr,
                                        ws.bytes, on.stream()),
               "permute_bwd_accumulate_");
}

// Shared checks of unpermute and its backward (`ref`: the [*, hidden] tensor on the op's
// device; `rows`: the row count). Returns E (probs.shape[1], or 1 without probs).
static int64_t check_unpermute_args(const Tensor &ref, const char *ref_name, int64_t rows,
                                    const Tensor &sorted_indices, int64_t num_tokens,
                                    const optional<Tensor> &probs,
                                    const optional<Tensor> &expert_offsets) {
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

Tensor unpermute(const Device &d, const Tensor &permuted_tokens_, const Tensor &sorted_indices_,
                 int64_t num_tokens, const optional<Tensor> &probs_,
                 const optional<Tensor> &expert_offsets_) {
  check_dim(permuted_tokens_, 2, "permuted_tokens");
  check_float(permuted_tokens_, "permuted_tokens");
  const int64_t E = check_unpermute_args(permuted_tokens_, "permuted_tokens",
                                         permuted_tokens_.size(0), sorted_indices_, num_tokens,
                                         probs_, expert_offsets_);
  const int64_t R = permuted_tokens_.size(0), H = permuted_tokens_.size(1);
  Tensor x = permuted_tokens_.contiguous(), idx = sorted_indices_.contiguous(), probs, offsets;
  if (probs_.has_value()) probs = probs_->contiguous(), offsets = expert_offsets_->contiguous();
  Tensor out = at::empty({num_tokens, H}, x.options());
  const OnDevice on(d, x);
  const Workspace ws = workspace(x, d.unpermute_workspace_size(num_tokens, R));
  check_status(d.unpermute_fwd(out.data_ptr(), x.data_ptr(), idx.data_ptr<int64_t>(),
                               data_or_null(probs), data_or_null<int64_t>(offsets), num_tokens, H,
                               E, R, to_moe_dtype(x.scalar_type(), "permuted_tokens"),
                               dtype_or(probs, "probs", MOE_DTYPE_FP32), ws.ptr, ws.bytes,
                               on.stream()),
               "unpermute");
  return out;
}

// grad_probs is computed iff permuted_tokens is given (the forward's rows, needed for it); without
// it the autograd graph does not keep the rows alive.
Tensor2 unpermute_bwd(const Device &d, const Tensor &grad_output_, const Tensor &sorted_indices_,
                      const optional<Tensor> &probs_, const optional<Tensor> &expert_offsets_,
                      const optional<Tensor> &permuted_tokens_) {
  check_dim(grad_output_, 2, "grad_output");
  check_float(grad_output_, "grad_output");
  check_dim(sorted_indices_, 1, "sorted_indices");
  const int64_t T = grad_output_.size(0), H = grad_output_.size(1), R = sorted_indices_.size(0);
  const int64_t E = check_unpermute_args(grad_output_, "grad_output", R, sorted_indices_, T,
                                         probs_, expert_offsets_);
  Tensor x;
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
  Tensor g = grad_output_.contiguous(), idx = sorted_indices_.contiguous(), probs, offsets;
  if (probs_.has_value()) probs = probs_->contiguous(), offsets = expert_offsets_->contiguous();
  Tensor grad_x = at::empty({R, H}, g.options());
  Tensor grad_probs;  // with permuted_tokens only
  if (x.defined()) grad_probs = at::empty({T, E}, probs.options());
  const OnDevice on(d, g);
  const Workspace ws = workspace(g, d.unpermute_workspace_size(T, R));
  check_status(d.unpermute_bwd(grad_x.data_ptr(), data_or_null(grad_probs), g.data_ptr(),
                               data_or_null(x), idx.data_ptr<int64_t>(), data_or_null(probs),
                               data_or_null<int64_t>(offsets), T, H, E, R,
                               to_moe_dtype(g.scalar_type(), "grad_output"),
                               dtype_or(probs, "probs", MOE_DTYPE_FP32), ws.ptr, ws.bytes,
                               on.stream()),
               "unpermute_bwd");
  return {grad_x, or_empty(grad_probs, g)};
}

// Rows are dim 0; everything after it moves as one row of `row_elems` elements.
static Tensor sort_chunks_impl(const Device &d, const Tensor &input_, const Tensor &split_sizes_,
                               const Tensor &sorted_idxs_, bool backward) {
  const char *in_name = backward ? "grad_output" : "input";
  MOE_CHECK_VALUE(input_.dim() >= 1, in_name, " must be at least 1-D, got a 0-D tensor");
  check_index_vector(split_sizes_, -1, "split_sizes", "", input_, in_name);
  check_index_vector(sorted_idxs_, split_sizes_.size(0), "sorted_idxs",
                     "split_sizes.shape[0] (num_chunks)", input_, in_name);
  Tensor x = input_.contiguous(), sizes = split_sizes_.contiguous();
  Tensor order = sorted_idxs_.contiguous();
  const int64_t rows = x.size(0), row_elems = rows > 0 ? x.numel() / rows : 0;
  Tensor out = at::empty_like(x);
  const int64_t C = sizes.size(0);
  const moe_dtype_t dt = to_moe_dtype(x.scalar_type(), in_name);
  const OnDevice on(d, x);
  const Workspace ws = workspace(x, d.sort_chunks_by_idxs_workspace_size(C));
  const auto fn = backward ? d.sort_chunks_by_idxs_bwd : d.sort_chunks_by_idxs_fwd;
  check_status(fn(out.data_ptr(), x.data_ptr(), sizes.data_ptr<int64_t>(),
                  order.data_ptr<int64_t>(), rows, row_elems, C, dt, ws.ptr, ws.bytes,
                  on.stream()),
               backward ? "sort_chunks_by_idxs_bwd" : "sort_chunks_by_idxs");
  return out;
}

Tensor sort_chunks_by_idxs(const Device &d, const Tensor &input, const Tensor &split_sizes,
                           const Tensor &sorted_idxs) {
  return sort_chunks_impl(d, input, split_sizes, sorted_idxs, false);
}

Tensor sort_chunks_by_idxs_bwd(const Device &d, const Tensor &grad_output,
                               const Tensor &split_sizes, const Tensor &sorted_idxs) {
  return sort_chunks_impl(d, grad_output, split_sizes, sorted_idxs, true);
}

Tensor tokens_per_expert(const Device &d, const Tensor &routing_map_,
                         const optional<Tensor> &padding_mask) {
  check_routing_map(routing_map_, "routing_map");
  const int64_t T = routing_map_.size(0), E = routing_map_.size(1);
  Tensor map = routing_map_.contiguous(), mask;
  const uint8_t *m = padding_mask_ptr(padding_mask, mask, T, map, "routing_map");
  Tensor counts = at::empty({E}, map.options().dtype(at::kLong));
  const OnDevice on(d, map);
  check_status(d.tokens_per_expert_fwd(counts.data_ptr<int64_t>(), (const uint8_t *)map.data_ptr(),
                                       m, T, E, nullptr, 0, on.stream()),
               "tokens_per_expert");
  return counts;
}

}  // namespace moe_torch
