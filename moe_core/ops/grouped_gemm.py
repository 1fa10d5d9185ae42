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

Gathered operand
----------------
``grouped_gemm(x, ..., x_index=idx)`` reads its rows as ``x[idx]`` (an index of -1 is a zero
row) without materialising them: ``x`` is then the source ``[S, K]`` and the output has
``idx.shape[0]`` rows. The result is bit for bit that of materialising the rows and calling the op
on them. ``grouped_gemm_dgrad`` gathers ``grad_y`` (``grad_y_index``), ``grouped_gemm_wgrad``
either operand (``x_index`` or ``grad_y_index``, at most one). On the CPU an index outside
``[-1, S)`` raises; on CUDA its values are not read on the host (that would need a sync), and one
outside ``[0, S)`` reads a zero row. With ``x_index`` the backward's ``dx`` of the source is
``permute``'s backward with ``sorted_indices = x_index``: each source row gets the sum, in
ascending row order in fp32 (fp64 for fp64) rounded once, of the rows that read it; a source row
that no row reads gets zeros. ``dW`` is ``grouped_gemm_wgrad`` with the same ``x_index``.
"""
from typing import Optional, Union

import torch

from moe_core.ops.permute import _BWD as _PERMUTE_BWD
from moe_core.ops.permute import _BWD_SYMINT as _PERMUTE_BWD_SYMINT
from moe_core.ops.permute import _tracing
from moe_core.ops._guards import int64_checked, register_autograd, register_fake

_FWD = int64_checked(torch.ops.moe_core.grouped_gemm)
_DGRAD = int64_checked(torch.ops.moe_core.grouped_gemm_dgrad)
_WGRAD = int64_checked(torch.ops.moe_core.grouped_gemm_wgrad)


def gathered_rows_grad(grad_rows: torch.Tensor, index: torch.Tensor,
                       expert_offsets: torch.Tensor,
                       num_src: Union[int, torch.SymInt]) -> torch.Tensor:
    """The gradient of a gathered operand's source from its rows' gradient.

    Args:
        grad_rows: ``[R, C]`` float, the gradient of the gathered rows ``src[index]``.
        index: ``[R]`` int64, the gather index (-1: a zero row, which gets no gradient).
        expert_offsets: ``[E + 1]`` int64 (permute_bwd's argument; only its length is used here).
        num_src: rows of the source (an int, symbolic while tracing).

    Returns:
        ``[num_src, C]`` in grad_rows' dtype: row ``s`` is the sum of the rows ``r`` with
        ``index[r] == s`` in ascending ``r``, in fp32 (fp64 for fp64), rounded once; zeros where
        no row reads ``s``. That is ``permute``'s backward with ``sorted_indices = index``.
    """
    if grad_rows.shape[1] == 0:  # permute_bwd needs a hidden size >= 1; nothing to sum
        return grad_rows.new_zeros((num_src, 0))
    # a symbolic source row count (dynamic-shape tracing) needs the SymInt schema, as in permute
    bwd = _PERMUTE_BWD_SYMINT if _tracing(num_src) else _PERMUTE_BWD
    return bwd(grad_rows.contiguous(), None, index, expert_offsets, num_src)[0]


def grouped_gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    expert_offsets: torch.Tensor,
    trans_w: bool = False,
    out_dtype: Optional[torch.dtype] = None,
    x_index: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Per-expert matmul over contiguous row groups, differentiable in ``x`` and ``weight``.

    Args:
        x: ``[num_rows, K]``, float32 / bfloat16 / float16 / float64; expert ``e``'s rows are
            ``x[expert_offsets[e]:expert_offsets[e + 1]]``. With ``x_index``: the source
            ``[S, K]`` whose rows ``x[x_index]`` are the GEMM's rows.
        weight: ``[num_experts, K, N]`` (``trans_w=False``) or ``[num_experts, N, K]``
            (``trans_w=True``, Megatron / ``nn.Linear`` layout), same dtype as ``x``.
        expert_offsets: ``[num_experts + 1]`` int64 on x's device: 0, then the running sum of
            the rows per expert, ending at ``num_rows`` (non-decreasing; empty experts allowed).
        trans_w: weight layout, see above.
        out_dtype: dtype of the result (default ``x.dtype``); the math is fp32 either way.
        x_index: ``[num_rows]`` int64 on x's device, or None: row ``r`` of the GEMM is
            ``x[x_index[r]]``, a zero row where ``x_index[r] == -1`` (see "Gathered operand").

    Returns:
        ``[num_rows, N]`` in ``out_dtype``: ``y[rows of e] = x[rows of e] @ W_e`` (``W_eᵀ`` when
        ``trans_w``); ``num_rows = x_index.shape[0]`` with an index.
    """
    return _FWD(x, weight, expert_offsets, trans_w, out_dtype, x_index)


def grouped_gemm_dgrad(grad_y, weight, expert_offsets, trans_w=False, out_dtype=None,
                       grad_y_index=None):
    """``dx_e = dy_e · W_eᵀ`` (``dy_e · W_e`` when ``trans_w``): ``[num_rows, K]``.

    ``grad_y``: ``[num_rows, N]``, or with ``grad_y_index`` (``[num_rows]`` int64) the source
    ``[S, N]`` whose rows ``grad_y[grad_y_index]`` (-1: a zero row) are read."""
    return _DGRAD(grad_y, weight, expert_offsets, trans_w, out_dtype, grad_y_index)


def grouped_gemm_wgrad(x, grad_y, expert_offsets, trans_w=False, out_dtype=None, x_index=None,
                       grad_y_index=None):
    """``dW_e = x_eᵀ · dy_e`` (``[E, K, N]``; ``dy_eᵀ · x_e``, ``[E, N, K]``, when ``trans_w``);
    zero for an expert with no rows.

    At most one operand is gathered: ``x_index`` (``x`` is then the source ``[S, K]``, read as
    ``x[x_index]``) or ``grad_y_index`` (``grad_y`` the source ``[S, N]``); both raise a
    ValueError."""
    return _WGRAD(x, grad_y, expert_offsets, trans_w, out_dtype, x_index, grad_y_index)


@register_fake("moe_core::grouped_gemm")
def _(x, weight, expert_offsets, trans_w=False, out_dtype=None, x_index=None):
    n = weight.shape[1] if trans_w else weight.shape[2]
    rows = x.shape[0] if x_index is None else x_index.shape[0]
    return x.new_empty((rows, n), dtype=x.dtype if out_dtype is None else out_dtype)


@register_fake("moe_core::grouped_gemm_dgrad")
def _(grad_y, weight, expert_offsets, trans_w=False, out_dtype=None, grad_y_index=None):
    k = weight.shape[2] if trans_w else weight.shape[1]
    dtype = grad_y.dtype if out_dtype is None else out_dtype
    rows = grad_y.shape[0] if grad_y_index is None else grad_y_index.shape[0]
    return grad_y.new_empty((rows, k), dtype=dtype)


@register_fake("moe_core::grouped_gemm_wgrad")
def _(x, grad_y, expert_offsets, trans_w=False, out_dtype=None, x_index=None, grad_y_index=None):
    if x_index is not None and grad_y_index is not None:
        raise ValueError("grouped_gemm_wgrad gathers at most one operand: pass x_index or "
                         "grad_y_index, not both")
    e, k, n = expert_offsets.shape[0] - 1, x.shape[1], grad_y.shape[1]
    dtype = x.dtype if out_dtype is None else out_dtype
    return x.new_empty((e, n, k) if trans_w else (e, k, n), dtype=dtype)


def _setup_context(ctx, inputs, output):
    x, weight, expert_offsets, trans_w, _out_dtype, x_index = inputs
    ctx.trans_w = trans_w
    ctx.num_src = x.shape[0]
    ctx.save_for_backward(x if ctx.needs_input_grad[1] else None,
                          weight if ctx.needs_input_grad[0] else None, expert_offsets, x_index)


def _backward(ctx, grad_y):
    x, weight, expert_offsets, x_index = ctx.saved_tensors
    dtype = (x if x is not None else weight).dtype
    g = grad_y.to(dtype)
    dx = dw = None
    if ctx.needs_input_grad[0]:
        dx = _DGRAD(g, weight, expert_offsets, ctx.trans_w, dtype)
        if x_index is not None:  # the rows' gradient, summed into the source rows they read
            dx = gathered_rows_grad(dx, x_index, expert_offsets, ctx.num_src)
    if ctx.needs_input_grad[1]:
        dw = _WGRAD(x, g, expert_offsets, ctx.trans_w, dtype, x_index)
    return dx, dw, None, None, None, None


register_autograd("moe_core::grouped_gemm", _backward, setup_context=_setup_context)
