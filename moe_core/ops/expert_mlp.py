"""expert_mlp: every expert's MLP (fc1, the gated activation times the router probs, fc2) as one
op whose backward keeps as little as the math allows.

It computes exactly::

    h, a = grouped_gemm_glu_probs(rows, weight1, expert_offsets, probs, activation, ...)
    y = grouped_gemm(h, weight2, expert_offsets, trans_w=True)
    y = unpermute(y, sorted_indices, tokens.shape)                   with combine=True only

where ``rows = tokens[sorted_indices]`` (``permute``'s rows) may be left unmade: with
``rows=None`` the GEMMs read each row straight from ``tokens`` through ``sorted_indices``
(the gathered operand of ``grouped_gemm``), so no ``[rows, H]`` copy is kept. Where a copy costs
less than the gathered loads (``MOE_CORE_EXPERT_COPY_ROWS``, csrc/tuning.h: wide GEMMs on CUDA)
and fits in what the step holds at its peak anyway (the weight gradients it makes, beside fc1's
output or its gradient ``[rows, F1]``), fc1, fc2's dgrad and dW1 read a transient copy instead,
made just before the GEMM and freed right after it; dW2, at the step's peak, always gathers.
What the op saves for the backward is fc1's output ``a`` ``[rows, F1]`` and the small index
tensors: not the rows and not ``h`` (the activation backward recomputes it from ``a``, with the
same element functions, in the same pass that computes ``grad_a``). The backward allocates no
``[rows, F1]`` or ``[rows, F]`` buffer of its own: ``glu_probs_bwd_`` turns the saved ``a`` into
``grad_a`` and fc2's input gradient into ``h``, in place. Backward, with ``rows=None`` and
``combine`` (the rows' gradient is then read from the tokens' output gradient by index too)::

    grad_h = grouped_gemm_dgrad(grad_out, weight2, grad_y_index=sorted_indices)   [rows, F]
    grad_probs = glu_probs_bwd_(grad_h, a, a, probs)                 a := grad_a, grad_h := h
    d_tokens = permute_bwd(grouped_gemm_dgrad(grad_a, weight1))     whole, or in row chunks
    dW1 = grouped_gemm_wgrad(tokens, grad_a, x_index=sorted_indices)
    (grad_a's storage released)
    dW2 = grouped_gemm_wgrad(h, grad_out, grad_y_index=sorted_indices)

so the weight gradients come last and dW2's buffer never coexists with ``grad_a`` (the peak of
the backward is the larger of dW1 + grad_a + h and dW1 + dW2 + h, plus the tokens' two [T, H]
gradients). Autograd holds a saved tensor until the backward returns, so the backward frees
``grad_a``'s memory itself (its storage resized to 0; in eager mode outside CUDA-graph capture,
while no tensor outside the backward shares it; a compiled graph frees it on its own).
A compiled backward writes ``grad_a`` into a new buffer instead where that costs no memory:
there the saved ``a`` is an input of the graph, which inductor copies before any op may mutate
it (one more pass over ``[rows, F1]``), while a buffer made in the graph is mutated where it
lies, and the graph frees ``a`` after that op, its last reader. ``a`` and ``grad_a`` then exist
together, before any weight gradient: below the step's peak (which holds both weight gradients
and ``h``) as long as ``2·R·F1 <= |dW1| + |dW2|`` (at the reference shapes; not when the rows
outnumber three quarters of E·H with a GLU). Where it would raise the peak, the copy stays.

With the rows given, the same products run on materialised rows, dW2 first (which frees ``h``
and the rows' gradient ``g = grad_out[sorted_indices]``), then dW1 on the rows gathered again
(one pass of unpermute's row copy, freed after its GEMM), then ``d_rows``, which goes to
``rows``.

With ``rows=None`` the tokens' gradient is made whole where the ``[rows, H]`` rows' gradient
fits in the same room as a copy does (it comes before any weight gradient exists), else chunk
by chunk when the rows outnumber ``4 / itemsize`` times the tokens (top-k above 2 in bf16): each
chunk of rows' gradient (``grouped_gemm_dgrad`` of that slice of ``grad_a``) is added into an
fp32 ``[T, H]`` accumulator (``permute_bwd_accumulate_``) and freed, so at no point does the
whole ``[rows, H]`` gradient exist; a chunk's buffer is never larger than the accumulator. fp64
is made in one piece: its ``permute_bwd`` sums in fp64, which the fp32 accumulator cannot.

Precision contract
------------------
* The output and every gradient are bit for bit those of autograd through the two ops above
  (``grouped_gemm_glu_probs`` then ``grouped_gemm``), on every device: the same kernels on the
  same values in the same order (the recomputed ``h`` is the forward's, bit for bit: both come
  from ``glu_probs_math.h``'s element functions on the same ``a``; the gathered rows, and the
  transient copies of them, are copies).
  So every statement of those ops' contracts holds: fp32 accumulation, one rounding of ``a`` to
  the dtype, the activation rounded where torch's eager sequence rounds it; deterministic, no
  atomics, no host synchronisation. The tokens' gradient made in row chunks adds each token's
  rows in the same ascending order in fp32 and rounds once, as ``permute_bwd`` does; its rows'
  gradients come from ``grouped_gemm_dgrad`` over each chunk, the same sums except where the
  Hopper kernel splits a partial last wave of tiles along the reduction (reductions of 4096 or
  more), whose fp32 partial sums then group differently from the unchunked call's (still the
  same bits run after run: whole or chunked, copied or gathered, is decided by the sizes, the
  tuning switch and which weights need a gradient, never by the values).
* The backward consumes what it saved (``a`` becomes ``grad_a``, and with ``rows=None`` its memory
  is freed): a second backward through the same graph (``retain_graph=True``) raises a
  RuntimeError instead of reading overwritten values.
  Without ``tokens`` / ``sorted_indices`` (rows that arrived by an all-to-all) the rows are saved.
* Only what ``needs_input_grad`` asks for is computed. Double backward is not supported (the
  backward ops have no derivatives of their own): a backward with ``create_graph=True`` raises a
  RuntimeError (every gradient depends on the saved ``a``, which requires grad).
"""
from typing import Optional, Tuple

import torch

from moe_core import tuning
from moe_core.ops._guards import (double_backward_error, int64_checked, register_autograd,
                                  register_fake)
from moe_core.ops.glu_probs import interleave_size
from moe_core.ops.grouped_gemm import gathered_rows_grad
from moe_core.ops.permute_bwd_accumulate import permute_bwd_accumulator

_FC1 = int64_checked(torch.ops.moe_core.grouped_gemm_glu_probs)
_FC2 = int64_checked(torch.ops.moe_core.grouped_gemm)
_DGRAD = int64_checked(torch.ops.moe_core.grouped_gemm_dgrad)
_WGRAD = int64_checked(torch.ops.moe_core.grouped_gemm_wgrad)
_GLU_BWD_ = int64_checked(torch.ops.moe_core.glu_probs_bwd_)
_GLU_BWD = int64_checked(torch.ops.moe_core.glu_probs_bwd)
_UNPERMUTE = int64_checked(torch.ops.moe_core.unpermute)
_UNPERMUTE_BWD = int64_checked(torch.ops.moe_core.unpermute_bwd)
_ACCUMULATE_ = int64_checked(torch.ops.moe_core.permute_bwd_accumulate_)


def expert_mlp(
    rows: Optional[torch.Tensor],
    weight1: torch.Tensor,
    weight2: torch.Tensor,
    expert_offsets: torch.Tensor,
    probs: Optional[torch.Tensor],
    activation: str,
    gated_linear_unit: bool,
    linear_offset: float = 0.0,
    clamp_value: Optional[float] = None,
    tokens: Optional[torch.Tensor] = None,
    sorted_indices: Optional[torch.Tensor] = None,
    combine: bool = False,
    glu_interleave_size: int = 0,
) -> torch.Tensor:
    """The experts' MLPs over expert-sorted rows, with a minimal-memory backward.

    Args:
        rows: ``[R, H]`` expert-sorted rows (bf16 / fp16 / fp32 / fp64); expert ``e`` owns
            ``rows[expert_offsets[e]:expert_offsets[e + 1]]``. None: the rows are
            ``tokens[sorted_indices]``, read by index inside the GEMMs and never made.
        weight1: ``[E, F1, H]`` (Megatron's ``linear_fc1.weight`` stacked; ``F1 = 2F`` with
            ``gated_linear_unit``, gate rows first), rows' dtype.
        weight2: ``[E, H, F]`` (``linear_fc2.weight`` stacked), rows' dtype.
        expert_offsets: ``[E + 1]`` int64 on rows' device (as for ``grouped_gemm``).
        probs: ``[R]`` router probs of each row (any float dtype), or None for no multiply.
        activation, gated_linear_unit, linear_offset, clamp_value: as for ``glu_probs``.
        tokens: ``[T, H]`` the tensor the rows were gathered from (``permute``'s input), or None.
        sorted_indices: ``[R]`` int64, the token of each row (-1: a zero padding row), as
            ``permute`` returns it; given with ``tokens``, the rows are read again by index in the
            backward instead of being saved. ``rows`` must then equal that gather.
        combine: return each token's sum of its rows' outputs, ``[T, H]`` (``unpermute`` of the
            rows' outputs, same kernel, same bits), instead of the rows' outputs. Needs
            ``tokens`` and ``sorted_indices``. The backward then makes the rows' ``[R, H]``
            gradient itself and frees it after fc2, before it gathers the rows again; given from
            outside, autograd would hold it until the whole backward returns.
        glu_interleave_size: as for ``glu_probs``: 0 for weight1's gate rows then linear rows,
            ``s`` for blocks of s gate and s linear rows alternating.

    Returns:
        ``[R, H]`` (``[T, H]`` with ``combine``) in rows' dtype. Differentiable in ``rows``,
        ``weight1``, ``weight2`` and ``probs`` (the gradient reaching ``rows`` flows on to
        ``tokens`` through ``permute``); with ``rows=None`` in ``tokens`` instead of ``rows``.
    """
    if rows is None and (tokens is None or sorted_indices is None):
        raise ValueError("expert_mlp: rows=None reads the rows from tokens by sorted_indices; pass "
                         f"both, got tokens={'None' if tokens is None else 'a tensor'} and "
                         f"sorted_indices={'None' if sorted_indices is None else 'a tensor'}")
    if (tokens is None) != (sorted_indices is None):
        raise ValueError("expert_mlp: pass tokens and sorted_indices together (the rows' source), "
                         f"got tokens={'None' if tokens is None else 'a tensor'} and "
                         f"sorted_indices={'None' if sorted_indices is None else 'a tensor'}")
    if rows is not None and sorted_indices is not None and sorted_indices.shape != rows.shape[:1]:
        raise ValueError(f"expert_mlp: sorted_indices must be [{rows.shape[0]}] (one per row), got "
                         f"{tuple(sorted_indices.shape)}")
    if rows is None and sorted_indices.dim() != 1:
        raise ValueError(f"expert_mlp: sorted_indices must be [R] (one per row), got "
                         f"{tuple(sorted_indices.shape)}")
    if combine and tokens is None:
        raise ValueError("expert_mlp: combine=True needs tokens and sorted_indices (the tokens "
                         "whose rows are summed), got tokens=None")
    hidden = weight1.shape[-1] if rows is None else rows.shape[1]
    if tokens is not None and (tokens.dim() != 2 or tokens.shape[1] != hidden):
        raise ValueError(f"expert_mlp: tokens must be [T, {hidden}] (the rows' hidden "
                         f"size), got {tuple(tokens.shape)}")
    if tokens is not None and rows is not None:
        tokens = tokens.detach()  # the rows carry the gradient (to tokens through permute)
    # the weight gradients the backward will make: what the forward may hold beside its own
    # tensors without raising the step's peak (see _copies)
    grads = torch.is_grad_enabled()
    weight_grads = ((weight1.numel() if grads and weight1.requires_grad else 0)
                    + (weight2.numel() if grads and weight2.requires_grad else 0))
    y, _a = _expert_mlp(rows, weight1, weight2, expert_offsets, probs, tokens, sorted_indices,
                        activation,
                        bool(gated_linear_unit), float(linear_offset),
                        None if clamp_value is None else float(clamp_value), bool(combine),
                        int(weight_grads), interleave_size(glu_interleave_size))
    return y


@torch.library.custom_op("moe_core::expert_mlp", mutates_args=())
def _expert_mlp(rows: Optional[torch.Tensor], weight1: torch.Tensor, weight2: torch.Tensor,
                expert_offsets: torch.Tensor, probs: Optional[torch.Tensor],
                tokens: Optional[torch.Tensor], sorted_indices: Optional[torch.Tensor],
                activation: str, gated_linear_unit: bool, linear_offset: float,
                clamp_value: Optional[float], combine: bool = False, weight_grads: int = 0,
                glu_interleave_size: int = 0) -> Tuple[torch.Tensor, torch.Tensor]:
    """Returns ``(y, a)``: ``a`` (fc1's output) is an output only so that the backward may keep
    it; :func:`expert_mlp` drops it. ``y``: the rows' outputs, or with ``combine`` their sums
    per token. ``weight_grads``: the elements of the weight gradients the backward will make
    (0 without one), the room a transient copy of the rows may take (see _copies)."""
    if rows is None and _copies(weight1.device, sorted_indices.shape[0], weight1.shape[2],
                                weight1.shape[1], weight1.shape[1], weight_grads):
        x = _gather_rows(tokens, sorted_indices)  # fc1 on a transient copy of its rows
        h, a = _FC1(x, weight1, expert_offsets, probs, activation, gated_linear_unit,
                    linear_offset, clamp_value, True, glu_interleave_size=glu_interleave_size)
        del x
    elif rows is None:  # fc1 reads tokens[sorted_indices] by index
        h, a = _FC1(tokens, weight1, expert_offsets, probs, activation, gated_linear_unit,
                    linear_offset, clamp_value, True, sorted_indices,
                    glu_interleave_size=glu_interleave_size)
    else:
        h, a = _FC1(rows, weight1, expert_offsets, probs, activation, gated_linear_unit,
                    linear_offset, clamp_value, True, glu_interleave_size=glu_interleave_size)
    y = _FC2(h, weight2, expert_offsets, True, None)
    if combine:
        del h
        y = _UNPERMUTE(y, sorted_indices, tokens.shape[0], None, None)
    return y, a


@register_fake("moe_core::expert_mlp")
def _(rows, weight1, weight2, expert_offsets, probs, tokens, sorted_indices, activation,
      gated_linear_unit, linear_offset, clamp_value, combine=False, weight_grads=0,
      glu_interleave_size=0):
    num_rows = sorted_indices.shape[0] if rows is None else rows.shape[0]
    out_rows = tokens.shape[0] if combine else num_rows
    return weight2.new_empty((out_rows, weight2.shape[1])), \
        weight1.new_empty((num_rows, weight1.shape[1]))


def _gather_rows(tokens: torch.Tensor, sorted_indices: torch.Tensor) -> torch.Tensor:
    """``tokens[sorted_indices]``, zero where the index is -1: ``permute``'s rows again, or with
    the combined output's gradient as ``tokens``, the rows' gradient (the rows-made path, where
    the GEMMs read materialised rows).

    That is exactly unpermute's backward without probs (each row gets its token's row, a -1
    row zero): its row-copy kernel, one pass, where an index_select needs a zero row appended
    to the tokens and the indices remapped first."""
    return _UNPERMUTE_BWD(tokens.contiguous(), sorted_indices, None, None, None)[0]


# MOE_CORE_EXPERT_COPY_ROWS's default (csrc/tuning.h): on CUDA the rows are copied before the GEMMs
# at least this many outputs wide. The copy is one pass over [R, H]; the gathered loads cost the
# Hopper kernel a fraction of its time that does not shrink with the width, so the copy pays on
# wide GEMMs and breaks even around a width of 1-2 thousand (tools/gg_gather_ab.py,
# docs/perf-history.md).
_COPY_MIN_WIDTH = 2048


def _fits(num_rows, hidden, f1, room) -> bool:
    """Whether ``[R, H]`` beside ``[R, F1]`` (fc1's output or its gradient, live at every step
    before the weight gradients) takes at most ``room`` elements: the weight gradients the step
    makes, so such a buffer never raises the step's peak."""
    return _size_hint(num_rows) * (_size_hint(hidden) + _size_hint(f1)) <= _size_hint(room)


def _copies(device: torch.device, num_rows, hidden, f1, width, room) -> bool:
    """Whether a GEMM with the rows read by index, ``width`` outputs wide, reads a transient copy
    of them instead (``[R, H]``, unpermute's row-copy kernel, freed after that GEMM): where
    MOE_CORE_EXPERT_COPY_ROWS says the copy pays, and where the copy and fc1's output (or its
    gradient) ``[R, F1]``, which every such step also holds, fit in ``room`` elements (what the
    step holds at its peak anyway: the weight gradients it makes). So no copy raises the step's
    peak. Decided at the traced sizes under dynamic shapes (no guard: the same bits either way)."""
    mode = tuning.current()["expert_copy_rows"]
    if mode == tuning.CopyRows.NEVER or (mode != tuning.CopyRows.ALWAYS and (
            device.type != "cuda" or _size_hint(width) < _COPY_MIN_WIDTH)):
        return False
    return _fits(num_rows, hidden, f1, room)


def _size_hint(n) -> int:
    """A size's value for a choice that must not specialise a compiled graph (the chunk count of
    :func:`_tokens_grad`: every count gives the same bits): a symbolic size's hint, no guard."""
    if not isinstance(n, torch.SymInt):
        return int(n)
    try:
        from torch.fx.experimental.symbolic_shapes import optimization_hint
    except ImportError:  # an older torch: the value the trace was made with
        return int(n.node.hint)
    return optimization_hint(n)


def _tokens_grad(grad_a: torch.Tensor, weight1: torch.Tensor, offsets: torch.Tensor,
                 sorted_indices: torch.Tensor, num_tokens: int, dtype: torch.dtype,
                 whole: bool = False) -> torch.Tensor:
    """The tokens' gradient ``[T, H]``: ``permute_bwd`` of fc1's input gradient
    ``grouped_gemm_dgrad(grad_a, weight1)`` ``[R, H]``, made whole when ``whole``, else in
    ``ceil(R * itemsize / 4T)`` chunks of rows (a chunk's buffer then never outgrows the fp32
    accumulator it is added into; the count depends only on top-k and the dtype, so it stays one
    number under dynamic shapes).
    A chunk's expert offsets are the layout's, shifted to the chunk's first row and clamped to
    its rows, on the device: the experts before and after it are empty there, one cut by its ends
    keeps its rows inside it."""
    R = grad_a.shape[0]
    r, t = _size_hint(R), _size_hint(num_tokens)
    chunks = 1 if t == 0 else max(1, -(-(r * grad_a.element_size()) // (4 * t)))
    if whole or chunks == 1 or dtype == torch.float64:
        # fp64: permute_bwd sums in fp64, which the fp32 accumulator cannot; one piece
        d_rows = _DGRAD(grad_a, weight1, offsets, True, dtype)
        return gathered_rows_grad(d_rows, sorted_indices, offsets, num_tokens)
    acc = permute_bwd_accumulator(num_tokens, weight1.shape[-1], grad_a.device)
    for c in range(chunks):
        lo, hi = c * R // chunks, (c + 1) * R // chunks
        d_rows = _DGRAD(grad_a[lo:hi], weight1, (offsets - lo).clamp(0, hi - lo), True, dtype)
        # the chunk's own slice of the layout (row_lo 0): a symbolic row_lo would specialise
        _ACCUMULATE_(acc, d_rows, sorted_indices[lo:hi], 0)
        del d_rows
    return acc if dtype == torch.float32 else _rounded(acc, dtype)


@torch.library.custom_op("moe_core::rounded", mutates_args=())
def _rounded(acc: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``acc.to(dtype)`` as an op of its own: the one rounding of the accumulated tokens'
    gradient. Inductor fuses a plain cast into the cast tensor's consumer (here, the sum with the
    router's input gradient) and skips the rounding, which would break compiled == eager."""
    return acc.to(dtype)


@register_fake("moe_core::rounded")
def _(acc, dtype):
    return acc.new_empty(acc.shape, dtype=dtype)


def _setup_context(ctx, inputs, output):
    (rows, weight1, weight2, offsets, probs, tokens, sorted_indices, activation, gated, offset,
     clamp, *rest) = inputs
    _y, a = output
    ctx.gathered = rows is None
    # the rows' gradient goes to rows, or with rows=None to tokens
    need_rows = ctx.needs_input_grad[5] if ctx.gathered else ctx.needs_input_grad[0]
    need_w1 = ctx.needs_input_grad[1]
    keep_rows = need_w1 and tokens is None
    ctx.combine = bool(rest and rest[0])
    ctx.num_tokens = None if tokens is None else tokens.shape[0]
    ctx.save_for_backward(rows if keep_rows else None, tokens if need_w1 else None,
                          sorted_indices if need_w1 or ctx.combine or ctx.gathered else None,
                          weight1 if need_rows else None, weight2, offsets, probs, a)
    ctx.need_rows = need_rows
    ctx.glu_opts = (activation, gated, offset, clamp, rest[2] if len(rest) > 2 else 0)
    ctx.consumed = False


def _backward(ctx, grad_y, grad_a_out):
    # an unused output's gradient is None (ops/_guards.py, which runs this only when one of the
    # two is not; a's is None always: expert_mlp drops it)
    if torch.is_grad_enabled():
        # create_graph=True: every gradient depends on the saved fc1 output (an output of this
        # op, so it requires grad), and the in-place backward must not run under grad mode
        raise double_backward_error("expert_mlp")
    if ctx.consumed:
        raise RuntimeError(
            "expert_mlp: backward ran twice through the same graph (retain_graph=True); its "
            "saved fc1 output was turned into its gradient by the first backward. Run the "
            "forward again for a second backward.")
    rows, tokens, sorted_indices, weight1, weight2, offsets, probs, a = ctx.saved_tensors
    need_rows, need_w1, need_w2, need_probs = (ctx.need_rows, ctx.needs_input_grad[1],
                                               ctx.needs_input_grad[2], ctx.needs_input_grad[4])
    dtype = weight2.dtype
    g_index = None
    # the room a transient [R, H] may take: the weight gradients this backward makes (_copies)
    E, H, F = weight2.shape
    R, F1 = a.shape
    room = (E * F1 * H if need_w1 else 0) + (E * H * F if need_w2 else 0)
    if grad_y is None:  # only fc1's output was used (a caller of the raw op): fc1's part alone
        g = h = grad_probs = None
        grad_a, need_w2 = grad_a_out.to(a.dtype), False
    elif ctx.combine and ctx.gathered:  # the GEMMs read each row's token's gradient by index
        g, g_index = grad_y.to(dtype).contiguous(), sorted_indices
    elif ctx.combine:  # the rows' gradient, ours to free once fc2's backward is done with it
        g = _gather_rows(grad_y, sorted_indices).to(dtype)
    else:
        g = grad_y.to(dtype).contiguous()
    del grad_y
    if g is not None:
        if g_index is not None and _copies(a.device, R, H, F1, F, room):
            g_rows = _gather_rows(g, g_index)  # fc2's dgrad on a transient copy of its rows
            grad_h = _DGRAD(g_rows, weight2, offsets, True, dtype)
            del g_rows
        else:
            grad_h = _DGRAD(g, weight2, offsets, True, dtype, g_index)
        if grad_a_out is None:
            ctx.consumed = True
            # a := grad_a, grad_h := h; compiled, maybe a new grad_a (see the module docstring)
            new = _traced(a) and _new_grad_a_fits(a, grad_h, weight2, need_w1, need_w2)
            grad_a = torch.empty_like(a) if new else a
            grad_probs = _GLU_BWD_(grad_h, a, grad_a, probs, *ctx.glu_opts)
            h = grad_h
        else:  # a was used elsewhere: keep it, and add the gradient it got there
            grad_a, grad_probs = _GLU_BWD(grad_h, a, probs, *ctx.glu_opts)
            grad_a = grad_a + grad_a_out.to(a.dtype)
            h = torch.ops.moe_core.glu_probs(a, probs, *ctx.glu_opts)
        del grad_h
    if probs is None or not need_probs:
        grad_probs = None
    if ctx.gathered:
        # by index: the tokens' gradient first (whole where [R, H] fits in the room, else in
        # row chunks; either way before any weight gradient exists), then dW1, the last reader
        # of grad_a, whose storage (the saved a) is then released, so dW2's buffer never
        # coexists with it
        d_tokens = (_tokens_grad(grad_a, weight1, offsets, sorted_indices, ctx.num_tokens, dtype,
                                 whole=_fits(R, H, F1, room))
                    if need_rows else None)
        dw1 = None
        if need_w1 and _copies(a.device, R, H, F1, F1, E * H * F if need_w2 else 0):
            # on a transient copy of its rows, beside grad_a, while dW2 does not exist yet
            x = _gather_rows(tokens, sorted_indices)
            dw1 = _WGRAD(x, grad_a, offsets, True, dtype)
            del x
        elif need_w1:
            dw1 = _WGRAD(tokens, grad_a, offsets, True, dtype, sorted_indices)
        if ctx.consumed:
            _release(grad_a)
        del grad_a, a
        dw2 = _WGRAD(h, g, offsets, True, dtype, None, g_index) if need_w2 else None
        return (None, dw1, dw2, None, grad_probs, d_tokens, None, None, None, None, None, None,
                None, None)
    # rows given or gathered again: dW2 first frees h and the rows' gradient before the
    # [R, H] buffers of dW1's rows and of d_rows (which autograd holds to the end) are made
    dw2 = _WGRAD(h, g, offsets, True, dtype, None, g_index) if need_w2 else None
    del h, g
    dw1 = None
    if need_w1:
        if rows is not None:
            dw1 = _WGRAD(rows, grad_a, offsets, True, dtype)
        else:  # the rows gathered again (not saved)
            x = _gather_rows(tokens, sorted_indices)
            dw1 = _WGRAD(x, grad_a, offsets, True, dtype)
            del x
    d_rows = _DGRAD(grad_a, weight1, offsets, True, dtype) if need_rows else None
    return d_rows, dw1, dw2, None, grad_probs, None, None, None, None, None, None, None, None, None


# Tensors sharing the saved a's storage inside the backward: autograd's saved copy, the one
# unpacked from it, and the storage object _release takes. One more is a caller's: the raw op's
# second output kept (its values are consumed anyway), which must stay readable.
_SAVED_A_USES = 3


def _new_grad_a_fits(a: torch.Tensor, grad_h: torch.Tensor, weight2: torch.Tensor,
                     need_w1: bool, need_w2: bool) -> bool:
    """Whether ``a`` and a new ``grad_a`` ``[R, F1]`` held together (with ``grad_h`` ``[R, F]``)
    stay within what the step holds at its end anyway, the weight gradients it makes (dW1
    ``[E, F1, H]``, dW2 ``[E, H, F]``) and ``h``: 2·R·F1 <= |dW1| + |dW2|. So at the reference
    shapes, not when the rows outnumber three quarters of E·H. Under dynamic shapes it is
    decided at the sizes the graph is traced with (no guard: either choice gives the same
    values)."""
    r, f1, f = _size_hint(a.shape[0]), _size_hint(a.shape[1]), _size_hint(grad_h.shape[1])
    w2 = _size_hint(weight2.numel())
    grads = (w2 * f1 // max(f, 1) if need_w1 else 0) + (w2 if need_w2 else 0)
    return 2 * r * f1 <= grads


def _traced(t: torch.Tensor) -> bool:
    """Whether the backward is being traced for a compiled graph: by dynamo, or by AOTAutograd,
    which runs it on fake / functional tensor subclasses."""
    return torch.compiler.is_compiling() or type(t) is not torch.Tensor


def _release(t: torch.Tensor) -> None:
    """Frees the memory of ``t``'s storage now (``t`` spans all of it; the saved ``a``, turned
    into ``grad_a`` in place and read for the last time): autograd holds saved tensors until the
    backward returns. Not while compiling (the compiled graph frees what it no longer reads on
    its own), nor during CUDA-graph capture (the captured step keeps its own memory), nor while
    a tensor outside the backward shares the storage (a tensor whose storage is resized to 0
    cannot be read safely)."""
    # a traced backward has no storage to free, and its graph frees what it no longer reads
    if _traced(t):
        return
    if t.is_cuda and torch.cuda.is_current_stream_capturing():
        return
    use_count = getattr(torch._C, "_storage_Use_Count", None)
    storage = t.untyped_storage()
    if (use_count is None or use_count(storage._cdata) > _SAVED_A_USES
            or t.storage_offset() != 0 or storage.nbytes() != t.numel() * t.element_size()):
        return
    storage.resize_(0)


register_autograd("moe_core::expert_mlp", _backward, setup_context=_setup_context)
