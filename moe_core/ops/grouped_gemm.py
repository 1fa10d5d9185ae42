"""grouped_gemm: the experts' GEMMs, ``y_e = x_e · W_e`` over each expert's contiguous rows.

Rows of ``x`` are grouped by expert (as after ``permute``): expert ``e`` owns rows
``expert_offsets[e]:expert_offsets[e + 1]``. The offsets are an int64 tensor on x's device, so no
count ever has to reach the host (the CUDA kernels read them from device memory).

Weight layout
-------------
``trans_w=False``: ``weight`` is ``[num_experts, K, N]`` and ``y_e = x_e @ weight[e]`` (the layout
of ``torch._grouped_mm``). ``trans_w=True``: ``weight`` is ``[num_experts, N, K]``, the
``nn.Linear`` layout in which Megatron's SequentialMLP / TEGroupedMLP store each expert's
``linear_fc1`` / ``linear_fc2`` weight, and ``y_e = x_e @ weight[e].T``; a stack of Megatron's
per-expert weights can be used as is.

Precision contract
------------------
* ``x`` and ``weight`` share one dtype: float32, bfloat16, float16 (or float64). Every element is
  widened exactly to fp32 (fp64 for fp64 inputs), products are summed in an fp32 (fp64)
  accumulator, and each output element is rounded once to ``out_dtype`` (default: the input dtype).
  That is the contract of a bf16 tensor-core GEMM with fp32 accumulation, and the tests bound our
  error against an fp64 truth by 2x torch's own per-expert matmul error in the same dtype.
* Deterministic: each output element is one running fp32 sum by one thread in ascending order
  along the reduction, whatever the blocking and the thread count; no floating-point atomics.
  wgrad is parallel over (expert, output tile), never over rows. One exception, on Hopper
  (bf16/fp16, fwd/dgrad, a reduction of 64+ blocks of 64): when the tiles leave a partial last
  wave, those tiles are cut along the reduction into up to 16 segments on otherwise idle SMs, and
  their fp32 partial sums are added in reduction order (``MOE_GG_SM90_SPLIT_TAIL=0`` turns this
  off). Which tiles split depends on the counts and the SM count, never on timing. The CPU kernel
  is picked by the CPU's features (AVX-512 FMA or portable), so bits can differ between machines,
  never between runs.
* bf16 on a CPU with AVX512_BF16 uses its bf16 dot-product instruction: bit for bit the same sums
  as the fp32 kernel, except that bf16 subnormal inputs (``|x| < 2**-126``) and fp32 subnormal
  partial sums are flushed to zero.
* Backward (registered autograd): ``grad_y`` is cast to the input dtype (as a same-dtype GEMM's
  backward sees it), then ``dx = grouped_gemm_dgrad(grad_y, weight)`` in ``x.dtype`` and
  ``dW = grouped_gemm_wgrad(x, grad_y)`` in ``weight.dtype`` (fp32 accumulation over all of an
  expert's rows, rounded once); an expert with no rows gets ``dW_e = 0``. Only the gradients that
  ``ctx.needs_input_grad`` asks for are computed.
"""
from typing import Optional

import torch

from moe_core.ops._guards import register_autograd, register_fake

_FWD = torch.ops.moe_core.grouped_gemm
_DGRAD = torch.ops.moe_core.grouped_gemm_dgrad
_WGRAD = torch.ops.moe_core.grouped_gemm_wgrad


def grouped_gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    expert_offsets: torch.Tensor,
    trans_w: bool = False,
    out_dtype: Optional[torch.dtype] = None,
) -> torch.Tensor:
    """Per-expert matmul over contiguous row groups, differentiable in ``x`` and ``weight``.

    Args:
        x: ``[num_rows, K]``, float32 / bfloat16 / float16 / float64; expert ``e``'s rows are
            ``x[expert_offsets[e]:expert_offsets[e + 1]]``.
        weight: ``[num_experts, K, N]`` (``trans_w=False``) or ``[num_experts, N, K]``
            (``trans_w=True``, Megatron / ``nn.Linear`` layout), same dtype as ``x``.
        expert_offsets: ``[num_experts + 1]`` int64 on x's device: 0, then the running sum of
            the rows per expert, ending at ``num_rows`` (non-decreasing; empty experts allowed).
        trans_w: weight layout, see above.
        out_dtype: dtype of the result (default ``x.dtype``); the math is fp32 either way.

    Returns:
        ``[num_rows, N]`` in ``out_dtype``: ``y[rows of e] = x[rows of e] @ W_e`` (``W_eᵀ`` when
        ``trans_w``).
    """
    return _FWD(x, weight, expert_offsets, trans_w, out_dtype)


def grouped_gemm_dgrad(grad_y, weight, expert_offsets, trans_w=False, out_dtype=None):
    """``dx_e = dy_e · W_eᵀ`` (``dy_e · W_e`` when ``trans_w``): ``[num_rows, K]``."""
    return _DGRAD(grad_y, weight, expert_offsets, trans_w, out_dtype)


def grouped_gemm_wgrad(x, grad_y, expert_offsets, trans_w=False, out_dtype=None):
    """``dW_e = x_eᵀ · dy_e`` (``[E, K, N]``; ``dy_eᵀ · x_e``, ``[E, N, K]``, when ``trans_w``);
    zero for an expert with no rows."""
    return _WGRAD(x, grad_y, expert_offsets, trans_w, out_dtype)


@register_fake("moe_core::grouped_gemm")
def _(x, weight, expert_offsets, trans_w=False, out_dtype=None):
    n = weight.shape[1] if trans_w else weight.shape[2]
    return x.new_empty((x.shape[0], n), dtype=x.dtype if out_dtype is None else out_dtype)


@register_fake("moe_core::grouped_gemm_dgrad")
def _(grad_y, weight, expert_offsets, trans_w=False, out_dtype=None):
    k = weight.shape[2] if trans_w else weight.shape[1]
    dtype = grad_y.dtype if out_dtype is None else out_dtype
    return grad_y.new_empty((grad_y.shape[0], k), dtype=dtype)


@register_fake("moe_core::grouped_gemm_wgrad")
def _(x, grad_y, expert_offsets, trans_w=False, out_dtype=None):
    e, k, n = expert_offsets.shape[0] - 1, x.shape[1], grad_y.shape[1]
    dtype = x.dtype if out_dtype is None else out_dtype
    return x.new_empty((e, n, k) if trans_w else (e, k, n), dtype=dtype)


def _setup_context(ctx, inputs, output):
    x, weight, expert_offsets, trans_w, _out_dtype = inputs
    ctx.trans_w = trans_w
    ctx.save_for_backward(x if ctx.needs_input_grad[1] else None,
                          weight if ctx.needs_input_grad[0] else None, expert_offsets)


def _backward(ctx, grad_y):
    x, weight, expert_offsets = ctx.saved_tensors
    dtype = (x if x is not None else weight).dtype
    g = grad_y.to(dtype)
    dx = dw = None
    if ctx.needs_input_grad[0]:
        dx = _DGRAD(g, weight, expert_offsets, ctx.trans_w, dtype)
    if ctx.needs_input_grad[1]:
        dw = _WGRAD(x, g, expert_offsets, ctx.trans_w, dtype)
    return dx, dw, None, None, None


register_autograd("moe_core::grouped_gemm", _backward, setup_context=_setup_context)
