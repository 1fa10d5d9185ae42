"""topk_to_dense: compact routing ``[T, topk]`` → Megatron's dense ``[T, E]`` probs and routing map.

Precision contract
------------------
A pure data movement: probs are copied bit for bit into zeros of the same dtype; the backward is
the matching gather. Deterministic (each output element has one writer).
"""
import operator
from typing import Tuple

import torch

from moe_core.ops._guards import int64_checked, register_autograd, register_fake

_OP = int64_checked(torch.ops.moe_core.topk_to_dense)
_BWD = int64_checked(torch.ops.moe_core.topk_to_dense_bwd)


def topk_to_dense(
    topk_probs: torch.Tensor, topk_indices: torch.Tensor, num_experts: int
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Scatter compact routing into dense form.

    Args:
        topk_probs: ``[num_tokens, topk]`` float.
        topk_indices: ``[num_tokens, topk]`` int64, distinct per row, in ``[0, num_experts)``.
        num_experts: E.

    Returns:
        ``(probs [num_tokens, num_experts] in topk_probs.dtype, routing_map [num_tokens,
        num_experts] bool)``.
    """
    if not isinstance(num_experts, torch.SymInt):  # a traced size is checked by the kernel
        if isinstance(num_experts, bool):
            raise TypeError("num_experts must be an int, got bool")
        try:
            num_experts = operator.index(num_experts)
        except TypeError:
            raise TypeError(f"num_experts must be an int, got {type(num_experts).__name__}") \
                from None
        dims = topk_probs.shape if isinstance(topk_probs, torch.Tensor) else ()
        T, k = (dims[0], dims[-1]) if len(dims) == 2 else (0, 0)
        if num_experts < max(k, 1) or T * num_experts >= 2 ** 62:
            raise ValueError(f"topk_to_dense: num_experts={num_experts}: must be >= 1 and >= "
                             f"topk ({k}), with [num_tokens, num_experts] = [{T}, {num_experts}] "
                             f"addressable")
    return _OP(topk_probs, topk_indices, num_experts)


@register_fake("moe_core::topk_to_dense")
def _(topk_probs, topk_indices, num_experts):
    shape = (topk_probs.shape[0], num_experts)
    return topk_probs.new_empty(shape), topk_probs.new_empty(shape, dtype=torch.bool)


@register_fake("moe_core::topk_to_dense_bwd")
def _(grad_probs, topk_indices):
    return grad_probs.new_empty(topk_indices.shape)


def _setup_context(ctx, inputs, output):
    _probs, topk_indices, _num_experts = inputs
    ctx.save_for_backward(topk_indices)


def _backward(ctx, grad_probs, _grad_map):
    (topk_indices,) = ctx.saved_tensors
    return _BWD(grad_probs.contiguous(), topk_indices), None, None


register_autograd("moe_core::topk_to_dense", _backward, setup_context=_setup_context)
