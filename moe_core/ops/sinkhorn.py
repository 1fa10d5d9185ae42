"""sinkhorn: Sinkhorn normalisation and Megatron's Sinkhorn routing (an alternative router).

Precision contract
------------------
* ``sinkhorn``: Megatron's iteration, each step rounded where Megatron's fp32 tensors round
  (fp64 for fp64 input), sums accumulated in fp64 in ascending index order; the result is fp32
  (fp64 for fp64 cost). Megatron iterates in the cost's dtype (its router always passes fp32);
  half inputs are computed in fp32 here. Optional ``max_iters`` cap (0 = none, as Megatron).
* ``sinkhorn_load_balancing``: training selects the top-k of ``sinkhorn(logits)``, evaluation the
  top-k of the activation; the activation is ``sigmoid(logits)`` for topk = 1 and
  ``softmax(logits)`` in fp32 (fp64 for fp64 logits), rounded to the logits' dtype, for topk > 1;
  probs are the activation on the picked experts, 0 elsewhere. Ties go to the lowest expert index.
* Backward: through the activation of the picked experts only (the selection is piecewise
  constant), in the logits' dtype. Deterministic.
"""
from typing import Tuple

import torch

from moe_core.ops._guards import int64_checked, register_autograd, register_fake

_SINKHORN = int64_checked(torch.ops.moe_core.sinkhorn)
_OP = int64_checked(torch.ops.moe_core.sinkhorn_routing)
_BWD = int64_checked(torch.ops.moe_core.sinkhorn_routing_bwd)


def sinkhorn(cost: torch.Tensor, tol: float = 0.0001, max_iters: int = 0) -> torch.Tensor:
    """Megatron's ``sinkhorn(cost, tol)``: a doubly balanced version of ``exp(cost)``.

    Args:
        cost: ``[num_tokens, num_experts]`` float.
        tol: stop when the mean change of the expert scaling is at most ``tol`` (>= 0).
        max_iters: iteration cap (0: none, as Megatron).

    Returns:
        ``[num_tokens, num_experts]`` fp32 (fp64 for fp64 cost), no gradient.
    """
    return _SINKHORN(cost.detach(), float(tol), int(max_iters))


def sinkhorn_load_balancing(logits: torch.Tensor, topk: int, training: bool = True,
                            tol: float = 0.0001) -> Tuple[torch.Tensor, torch.Tensor]:
    """Megatron's ``TopKRouter.sinkhorn_load_balancing``.

    Args:
        logits: ``[num_tokens, num_experts]`` float (the router dtype).
        topk: experts per token, ``1 <= topk <= num_experts``.
        training: select with Sinkhorn (True) or by the activation (False), as the router's mode.
        tol: Sinkhorn tolerance.

    Returns:
        ``(probs [num_tokens, num_experts] in logits.dtype, routing_map [num_tokens, num_experts]
        bool)``; probs carry gradients to the logits.
    """
    if not isinstance(topk, int) or isinstance(topk, bool):
        raise TypeError(f"topk must be an int, got {topk!r}")
    return _OP(logits, topk, bool(training), float(tol))


sinkhorn_routing = sinkhorn_load_balancing


@register_fake("moe_core::sinkhorn")
def _(cost, tol, max_iters):
    dtype = torch.float64 if cost.dtype == torch.float64 else torch.float32
    return cost.new_empty(cost.shape, dtype=dtype)


@register_fake("moe_core::sinkhorn_routing")
def _(logits, topk, training, tol):
    return torch.empty_like(logits), logits.new_empty(logits.shape, dtype=torch.bool)


@register_fake("moe_core::sinkhorn_routing_bwd")
def _(grad_probs, logits, routing_map, topk):
    return torch.empty_like(logits)


def _setup_context(ctx, inputs, output):
    logits, topk, _training, _tol = inputs
    _probs, routing_map = output
    ctx.topk = topk
    ctx.save_for_backward(logits, routing_map)


def _backward(ctx, grad_probs, _grad_map):
    logits, routing_map = ctx.saved_tensors
    return _BWD(grad_probs.contiguous(), logits, routing_map, ctx.topk), None, None, None


register_autograd("moe_core::sinkhorn_routing", _backward, setup_context=_setup_context)
