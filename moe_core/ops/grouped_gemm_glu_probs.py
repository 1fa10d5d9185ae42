"""grouped_gemm_glu_probs: the experts' fc1 with the gated activation and the router-probs
multiply, as one op, returning ``h`` and fc1's output ``a``.

It is ``grouped_gemm`` followed by ``glu_probs``, as one op::

    a = grouped_gemm(x, weight, expert_offsets, trans_w)          # [rows, 2F] (GLU) or [rows, F]
    h = glu_probs(a, probs, activation, gated_linear_unit, linear_offset, clamp_value)

With ``gated_linear_unit`` the gate half is ``a[:, :F]`` and the linear half ``a[:, F:]``
(``torch.chunk(a, 2, -1)``, Megatron's fc1 layout ``[E, 2F, H]``), column ``j`` pairing with
``j + F``. ``a`` is returned because the backward needs it (it is also what a caller of the two ops
would hold).

Precision contract
------------------
* ``h`` and ``a`` are bit for bit those of the composition above (``ops.grouped_gemm`` then
  ``ops.glu_probs``) on the same device, so every statement of those two ops' contracts holds
  unchanged: fp32 accumulation and one rounding of ``a`` to ``x.dtype``; ``h`` from those rounded
  values with every intermediate rounded where torch's eager sequence rounds it.
  It is the composition on every device: on the CPU the two C functions called in turn, on CUDA
  the grouped GEMM kernel then the glu_probs kernel on the stream. (Computing ``h`` inside the
  Hopper GEMM's epilogue would save a write and a re-read of ``a``, but runs slower: the
  activation's fp64 element math then holds up the tensor cores.)
* Rows past ``expert_offsets[-1]`` (a buffer sized by a static bound): ``a`` is 0 there and ``h``
  is glu_probs of a zero row (0 for every activation, up to the sign that a negative
  ``linear_offset`` gives and NaN for a non-finite prob), as composed.
* Backward (registered autograd) is the composition's: ``grad_a, grad_probs = glu_probs_bwd(grad_h,
  a, probs)`` (plus the gradient reaching ``a`` directly, if any), then ``dx =
  grouped_gemm_dgrad(grad_a, weight)`` and ``dW = grouped_gemm_wgrad(x, grad_a)``; so gradients
  equal autograd's through the two unfused ops bit for bit. Only what ``needs_input_grad`` asks
  for is computed. Deterministic, no atomics, no host synchronisation.
* ``x_index`` (optional, ``[rows]`` int64): fc1 reads its rows as ``x[x_index]`` (-1: a zero row)
  from the source ``x`` ``[S, H]`` without materialising them, bit for bit as
  :func:`~moe_core.ops.grouped_gemm.grouped_gemm` with ``x_index``; ``probs``, ``h`` and ``a``
  have ``x_index.shape[0]`` rows. The source's gradient sums the rows' gradients into the rows
  they read (``permute``'s backward with ``sorted_indices = x_index``), ``dW`` gathers ``x``.
"""
from typing import Optional, Tuple

import torch

from moe_core.ops._guards import int64_checked, register_autograd, register_fake
from moe_core.ops.glu_probs import glu_options, interleave_size
from moe_core.ops.grouped_gemm import gathered_rows_grad

_OP = int64_checked(torch.ops.moe_core.grouped_gemm_glu_probs)
_GLU_BWD = int64_checked(torch.ops.moe_core.glu_probs_bwd)
_DGRAD = int64_checked(torch.ops.moe_core.grouped_gemm_dgrad)
_WGRAD = int64_checked(torch.ops.moe_core.grouped_gemm_wgrad)


def grouped_gemm_glu_probs(
    x: torch.Tensor,
    weight: torch.Tensor,
    expert_offsets: torch.Tensor,
    probs: Optional[torch.Tensor],
    activation: str,
    gated_linear_unit: bool,
    linear_offset: float = 0.0,
    clamp_value: Optional[float] = None,
    trans_w: bool = True,
    x_index: Optional[torch.Tensor] = None,
    glu_interleave_size: int = 0,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """fc1 of every expert, then its activation times the router probs, in one op.

    Args:
        x: ``[rows, H]`` expert-sorted rows, bfloat16 / float16 (float32 / float64 also work,
            through the unfused kernels); expert ``e`` owns ``x[expert_offsets[e]:
            expert_offsets[e + 1]]``.
        weight: ``[E, F1, H]`` with ``trans_w=True`` (Megatron's ``linear_fc1.weight`` stacked;
            the default) or ``[E, H, F1]`` with ``trans_w=False``; ``F1 = 2F`` with
            ``gated_linear_unit`` (gate rows first, then linear rows), else ``F``. x's dtype.
        expert_offsets: ``[E + 1]`` int64 on x's device (0, running row counts, non-decreasing,
            last <= rows; rows past it belong to no expert).
        probs: ``[rows]`` router probs of each row (any float dtype; the multiply happens in
            ``promote(x.dtype, probs.dtype)``), or None for no multiply.
        activation: one of ``moe_core.ops.ACTIVATIONS`` (``"silu"``, ``"gelu"``, ...).
        gated_linear_unit: Megatron's ``gated_linear_unit``.
        linear_offset: ``glu_linear_offset`` (GLU only).
        clamp_value: ``activation_func_clamp_value`` (GLU only), or None.
        trans_w: weight layout, as for :func:`grouped_gemm`.
        x_index: ``[rows]`` int64 on x's device, or None: fc1's row ``r`` is ``x[x_index[r]]``
            (-1: a zero row); ``x`` is then the source ``[S, H]``.
        glu_interleave_size: as for ``glu_probs``: 0 for fc1's rows as gate rows then linear
            rows, ``s`` for blocks of s gate and s linear rows alternating (``a``'s columns
            likewise).

    Returns:
        ``(h, a)``: ``h`` ``[rows, F]`` and fc1's output ``a`` ``[rows, F1]``, both in x's dtype.
        Differentiable in ``x``, ``weight`` and ``probs``.
    """
    return _OP(x, weight, expert_offsets, probs, activation, bool(gated_linear_unit),
               float(linear_offset), None if clamp_value is None else float(clamp_value),
               bool(trans_w), x_index, interleave_size(glu_interleave_size))


@register_fake("moe_core::grouped_gemm_glu_probs")
def _(x, weight, expert_offsets, probs, activation, gated_linear_unit, linear_offset=0.0,
      clamp_value=None, trans_w=True, x_index=None, glu_interleave_size=0):
    n = weight.shape[1] if trans_w else weight.shape[2]
    f = n // 2 if gated_linear_unit else n
    rows = x.shape[0] if x_index is None else x_index.shape[0]
    return x.new_empty((rows, f)), x.new_empty((rows, n))


def _setup_context(ctx, inputs, output):
    x, weight, expert_offsets, probs = inputs[:4]
    trans_w = inputs[8] if len(inputs) > 8 else True
    x_index = inputs[9] if len(inputs) > 9 else None
    _h, a = output
    need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    ctx.save_for_backward(x if need_w else None, weight if need_x else None, expert_offsets,
                          probs, a, x_index)
    ctx.num_src = x.shape[0]
    ctx.glu_opts = glu_options(inputs[:8] + inputs[10:11], 4)
    ctx.trans_w = trans_w
    ctx.num_inputs = len(inputs)


def _backward(ctx, grad_h, grad_a_out):
    # an unused output's gradient is None (ops/_guards.py, which runs this only when one of the
    # two is not), not zeros: adding zeros would turn a -0 of grad_a into +0, and the
    # composition's autograd adds nothing there
    x, weight, expert_offsets, probs, a, x_index = ctx.saved_tensors
    grad_a = grad_probs = None
    if grad_h is not None:
        grad_a, grad_probs = _GLU_BWD(grad_h.contiguous(), a, probs, *ctx.glu_opts)
    if grad_a_out is not None:
        g = grad_a_out.to(a.dtype)
        grad_a = g if grad_a is None else grad_a + g
    if probs is None or grad_h is None or not ctx.needs_input_grad[3]:
        grad_probs = None
    dx = dw = None
    if ctx.needs_input_grad[0]:
        dx = _DGRAD(grad_a, weight, expert_offsets, ctx.trans_w, weight.dtype)
        if x_index is not None:  # the rows' gradient, summed into the source rows they read
            dx = gathered_rows_grad(dx, x_index, expert_offsets, ctx.num_src)
    if ctx.needs_input_grad[1]:
        dw = _WGRAD(x, grad_a, expert_offsets, ctx.trans_w, x.dtype, x_index)
    return (dx, dw, None, grad_probs) + (None,) * (ctx.num_inputs - 4)


register_autograd("moe_core::grouped_gemm_glu_probs", _backward, setup_context=_setup_context)
