"""topk_to_dense: compact routing ``[T, topk]`` → Megatron's dense ``[T, E]`` probs and routing map.

Precision contract
------------------
A pure data movement: probs are copied bit for bit into zeros of the same dtype; the backward is
the matching gather. Deterministic (each output element has one writer).
"""
from typing import Tuple

import torch

from moe_core.ops._guards import register_autograd, register_fake

_OP = torch.ops.moe_core.topk_to_dense
_BWD = torch.ops.moe_core.topk_to_dense_bwd


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
    return _OP(topk_probs, topk_indices, int(num_experts))


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
