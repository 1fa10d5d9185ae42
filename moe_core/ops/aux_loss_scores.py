"""aux_loss_scores: the scores and top-k map the load-balancing losses are computed from.

Precision contract
------------------
* Megatron's ``compute_routing_scores_for_aux_loss``: softmax over all experts (softmax), or
  sigmoid / sqrt(softplus) normalised over all experts as ``s / (sum(s) + 1e-20)``; each value
  Megatron materialises is computed in double and rounded once to fp32, sums accumulate in fp64
  in ascending expert order. Scores are fp32 for fp32/fp16/bf16 logits; fp64 logits keep fp64
  (Megatron computes fp32 there: a deliberate difference, so fp64 gradcheck is meaningful).
* The map is the top-k of exactly the scores returned (no groups, no expert bias); ties go to
  the lowest expert index (torch.topk leaves them unspecified).
* Padded tokens (padding_mask True) get all-zero scores and map rows, and a zero gradient.
* Backward: the exact derivative of the scores w.r.t. the logits, returned in the logits' dtype;
  the map is piecewise constant. Deterministic.
"""
from typing import Optional, Tuple

import torch

from moe_core.ops._guards import int64_checked, register_autograd, register_fake
from moe_core.ops._padding_mask import flat_padding_mask
from moe_core.ops.names import SCORE_FUNCTIONS

_OP = int64_checked(torch.ops.moe_core.aux_loss_scores)
_BWD = int64_checked(torch.ops.moe_core.aux_loss_scores_bwd)


def compute_routing_scores_for_aux_loss(
    logits: torch.Tensor,
    topk: int,
    score_function: str,
    fused: bool = False,
    padding_mask: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Megatron's ``compute_routing_scores_for_aux_loss`` (same arguments, map first).

    Args:
        logits: ``[num_tokens, num_experts]``, float dtype.
        topk: experts per token in the map, ``1 <= topk <= num_experts``.
        score_function: one of :data:`~moe_core.ops.names.SCORE_FUNCTIONS`.
        fused: accepted for signature compatibility and ignored (this is always one kernel).
        padding_mask: bool, ``num_tokens`` elements (e.g. ``[S, B]`` or ``[T]``), True = padding;
            padded rows are zero in both outputs.

    Returns:
        ``(routing_map [num_tokens, num_experts] bool, scores [num_tokens, num_experts] fp32)``
        (fp64 scores for fp64 logits); scores carry gradients to the logits.
    """
    del fused
    if score_function not in SCORE_FUNCTIONS:
        raise ValueError(f"score_function must be one of {SCORE_FUNCTIONS}, got {score_function!r}")
    if not isinstance(topk, int) or isinstance(topk, bool):
        raise TypeError(f"topk must be an int, got {topk!r}")
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2:
        shape = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
        raise ValueError(f"logits must be 2-D [num_tokens, num_experts], got {shape}")
    mask = flat_padding_mask(padding_mask, logits.shape[0])
    # the op returns the float output first (autograd tooling sums outputs in order)
    scores, routing_map = _OP(logits, topk, score_function, mask)
    return routing_map, scores


@register_fake("moe_core::aux_loss_scores")
def _(logits, topk, score_function, padding_mask):
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    return logits.new_empty(logits.shape, dtype=dtype), logits.new_empty(logits.shape,
                                                                         dtype=torch.bool)


@register_fake("moe_core::aux_loss_scores_bwd")
def _(grad_scores, logits, score_function, padding_mask):
    return torch.empty_like(logits)


def _setup_context(ctx, inputs, output):
    logits, _topk, score_function, padding_mask = inputs
    ctx.score_function = score_function
    ctx.save_for_backward(logits, padding_mask)


def _backward(ctx, grad_scores, _grad_map):
    logits, padding_mask = ctx.saved_tensors
    grad_logits = _BWD(grad_scores.contiguous(), logits, ctx.score_function, padding_mask)
    return grad_logits, None, None, None


register_autograd("moe_core::aux_loss_scores", _backward, setup_context=_setup_context)
