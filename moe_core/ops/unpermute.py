"""unpermute: the combine, rows grouped by expert → tokens (Megatron's ``unpermute``).

Precision contract
------------------
* A per-token gather-sum over that token's rows in ascending row order (ascending expert id):
  never a scatter-add, so the result is bitwise the same run after run and, on the GPU, free of
  atomics.
* With probs, each row is multiplied by ``probs[token, expert]`` and rounded to
  ``P = torch.promote_types(rows dtype, probs dtype)`` (where Megatron materialises
  ``permuted_tokens * probs``); the sum runs in fp32 (fp64 when P is fp64), is rounded to P and
  then to the rows' dtype, as Megatron's ``.to(input_dtype)``. Without probs, P is the rows' dtype.
  For at most two rows per token this is bitwise Megatron's result; for more it differs by the
  summation order and by the wider accumulator (at least as accurate).
* Backward: ``grad_rows = grad_out[token] * prob`` (rounded to P, then the rows' dtype);
  ``grad_probs[t, e] = sum_h grad_out[t, h] * rows[r, h]`` (products rounded to P, summed in
  fp32/fp64 in ascending h); deterministic.

Arguments are Megatron's. What permute hands over: ``sorted_indices`` (the token of each row, -1
for padding rows, which are skipped). With probs, the expert of each row comes from
``pad_offsets`` when given (pass permute's ``expert_offsets``, required after ``align_size > 1``),
else from ``routing_map`` (column counts; ``drop_and_pad``: blocks of ``rows // E``). ``fused`` is
ignored.

Dynamic shapes: the C++ schema takes ``num_tokens`` as an ``int``, which the tracer specialises.
While tracing (``torch.compile``, or a ``torch.SymInt`` size) the call goes through
``unpermute_symint``, the same kernel behind a ``SymInt`` schema, so with a dynamic token
dimension one graph serves every token count. Eager calls run the C++ op directly.
"""
from typing import Optional, Sequence, Union

import torch

from moe_core.ops._guards import int64_checked, register_autograd, register_fake

_OP = int64_checked(torch.ops.moe_core.unpermute)
_BWD = int64_checked(torch.ops.moe_core.unpermute_bwd)


def _expert_offsets(routing_map: torch.Tensor, num_rows: int, drop_and_pad: bool) -> torch.Tensor:
    """Block starts of the experts, ``[E + 1]`` int64 on the map's device (no host sync)."""
    num_experts = routing_map.shape[1]
    if drop_and_pad:
        block = num_rows // num_experts
        return torch.arange(num_experts + 1, device=routing_map.device, dtype=torch.long) * block
    counts = routing_map.sum(dim=0, dtype=torch.long)
    return torch.cat([counts.new_zeros(1), counts.cumsum(0)])


def unpermute(
    permuted_tokens: torch.Tensor,
    sorted_indices: torch.Tensor,
    restore_shape: Sequence[int],
    probs: Optional[torch.Tensor] = None,
    routing_map: Optional[torch.Tensor] = None,
    fused: bool = False,
    drop_and_pad: bool = False,
    pad_offsets: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Sum each token's rows back into ``[num_tokens, hidden]``, optionally weighted by probs.

    Args:
        permuted_tokens: ``[R, hidden]`` float (the expert outputs, in permute's row order).
        sorted_indices: ``[R]`` int64 from permute (-1 rows are skipped).
        restore_shape: ``(num_tokens, hidden)``.
        probs: ``[num_tokens, num_experts]`` float, or None.
        routing_map: ``[num_tokens, num_experts]`` bool; required with probs unless
            ``pad_offsets`` is given.
        fused: ignored.
        drop_and_pad: permute's drop-and-pad layout (only used to place rows when probs are given).
        pad_offsets: ``[E + 1]`` int64, permute's ``expert_offsets``.

    Returns:
        ``[num_tokens, hidden]`` in ``permuted_tokens.dtype``; tokens without rows are zero.
    """
    del fused
    if len(restore_shape) != 2:
        raise ValueError(f"restore_shape must be (num_tokens, hidden), got {tuple(restore_shape)}")
    # under tracing the sizes may be symbolic (dynamo shows a SymInt as an int): int() would pin
    # the graph to one token count
    tracing = torch.compiler.is_compiling() or isinstance(restore_shape[0], torch.SymInt)
    num_tokens, hidden = (s if tracing else int(s) for s in restore_shape)
    if permuted_tokens.dim() != 2 or permuted_tokens.shape[1] != hidden:
        raise ValueError(
            f"restore_shape {tuple(restore_shape)} must have the hidden size of permuted_tokens "
            f"{tuple(permuted_tokens.shape)}"
        )
    offsets = None
    if probs is not None:
        if pad_offsets is not None:
            offsets = pad_offsets
        elif routing_map is None:
            raise ValueError("routing_map (or pad_offsets) is required when probs are given")
        else:
            offsets = _expert_offsets(routing_map, permuted_tokens.shape[0], drop_and_pad)
    op = _OP_SYMINT if tracing else _OP
    return op(permuted_tokens, sorted_indices, num_tokens, probs, offsets)


@torch.library.custom_op("moe_core::unpermute_symint", mutates_args=())
def unpermute_symint(permuted_tokens: torch.Tensor, sorted_indices: torch.Tensor,
                     num_tokens: int, probs: Optional[torch.Tensor],
                     expert_offsets: Optional[torch.Tensor]) -> torch.Tensor:
    """``moe_core::unpermute`` with ``num_tokens`` a ``SymInt`` in the schema (the op that
    dynamic-shape graphs record); at run time the count is a concrete int and the C++ op runs.

    Args:
        permuted_tokens: ``[R, hidden]`` float.
        sorted_indices: ``[R]`` int64 (-1 rows are skipped).
        num_tokens: rows of the output (an int, symbolic while tracing).
        probs: ``[num_tokens, num_experts]`` float, or None.
        expert_offsets: ``[E + 1]`` int64 (required with probs), or None.

    Returns:
        ``[num_tokens, hidden]`` in ``permuted_tokens.dtype``.
    """
    return _OP(permuted_tokens, sorted_indices, num_tokens, probs, expert_offsets)


def _unpermute_fake(permuted_tokens, sorted_indices, num_tokens: Union[int, torch.SymInt],
                    probs, expert_offsets):
    return permuted_tokens.new_empty((num_tokens, permuted_tokens.shape[1]))


_OP_SYMINT = int64_checked(torch.ops.moe_core.unpermute_symint)
for _name in ("moe_core::unpermute", "moe_core::unpermute_symint"):
    register_fake(_name)(_unpermute_fake)


@register_fake("moe_core::unpermute_bwd")
def _(grad_output, sorted_indices, probs, expert_offsets, permuted_tokens):
    grad_rows = grad_output.new_empty((sorted_indices.shape[0], grad_output.shape[1]))
    if permuted_tokens is None:
        return grad_rows, grad_output.new_empty((0,))
    return grad_rows, probs.new_empty(probs.shape)


def _setup_context(ctx, inputs, output):
    permuted_tokens, sorted_indices, _num_tokens, probs, offsets = inputs
    ctx.want_probs = probs is not None and ctx.needs_input_grad[3]
    # The rows are kept only when the probs need their gradient.
    ctx.save_for_backward(sorted_indices, probs, offsets,
                          permuted_tokens if ctx.want_probs else None)


def _backward(ctx, grad_output):
    sorted_indices, probs, offsets, permuted_tokens = ctx.saved_tensors
    grad_rows, grad_probs = _BWD(grad_output.contiguous(), sorted_indices, probs, offsets,
                                 permuted_tokens)
    return grad_rows, None, None, (grad_probs if ctx.want_probs else None), None


for _name in ("moe_core::unpermute", "moe_core::unpermute_symint"):
    register_autograd(_name, _backward, setup_context=_setup_context)
