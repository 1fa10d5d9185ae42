"""expert_bias: aux-loss-free load balancing (DeepSeek-V3 style), Megatron's rules.

A per-expert fp32 bias is added to the router's selection scores (sigmoid / sqrtsoftplus only:
``router_topk(..., expert_bias=...)``) and affects which experts are selected, never the probs.
During training the router counts the tokens each expert receives (only when grad is enabled,
never from padding); once per global batch the counts are all-reduced and the bias moves one
step of ``update_rate`` towards balance.

Precision contract
------------------
* ``updated = bias + sign(mean(counts) - counts) * rate`` with Megatron's fp32 rounding points
  (sign(0) = 0, NaN propagates): bit for bit Megatron's update whenever the row sums of the
  counts are exact in fp32 (integer counts below 2**24). Counts are read as fp32.
* Not differentiable (runs under no_grad, like Megatron's).
"""
from typing import Optional

import torch
import torch.distributed as dist

from moe_core.ops._guards import int64_checked, register_fake
from moe_core.ops.tokens_per_expert import tokens_per_expert as _tokens_per_expert

_OP = int64_checked(torch.ops.moe_core.expert_bias_update)


def accumulate_tokens_per_expert(local_tokens_per_expert: torch.Tensor,
                                 routing_map: torch.Tensor,
                                 padding_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Adds this micro-batch's counts to the router's buffer, in place (Megatron's
    ``TopKRouter._apply_expert_bias``).

    Nothing is counted when grad is disabled (evaluation, activation recomputation), nor from
    padded tokens.

    Args:
        local_tokens_per_expert: ``[num_experts]`` fp32 buffer, updated in place.
        routing_map: ``[num_tokens, num_experts]`` bool, the final (post-dropping) routing.
        padding_mask: bool with ``num_tokens`` elements, True = padding, or None.

    Returns:
        ``local_tokens_per_expert``.

    Raises:
        ValueError: the map on another device than the buffer (a meta map: shapes only, nothing
            to count), or shapes that do not match.
    """
    for name, t in (("local_tokens_per_expert", local_tokens_per_expert),
                    ("routing_map", routing_map)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")
    if routing_map.device != local_tokens_per_expert.device:
        # an in-place add of a meta tensor into a real one is a silent no-op in torch
        raise ValueError(f"routing_map is on {routing_map.device} but local_tokens_per_expert "
                         f"on {local_tokens_per_expert.device}: the counts would not be added")
    if routing_map.dim() != 2 or local_tokens_per_expert.shape != routing_map.shape[1:]:
        raise ValueError(f"local_tokens_per_expert must be [num_experts] for routing_map "
                         f"[num_tokens, num_experts], got {tuple(local_tokens_per_expert.shape)} "
                         f"and {tuple(routing_map.shape)}")
    if torch.is_grad_enabled():
        with torch.no_grad():
            local_tokens_per_expert += _tokens_per_expert(routing_map, padding_mask)
    return local_tokens_per_expert


def get_updated_expert_bias(
    tokens_per_expert: torch.Tensor,
    expert_bias: torch.Tensor,
    expert_bias_update_rate: float,
    tp_dp_cp_group=None,
) -> torch.Tensor:
    """Megatron's ``get_updated_expert_bias`` (same arguments).

    Args:
        tokens_per_expert: ``[num_experts]`` or ``[num_layers, num_experts]`` counts. When a group
            is given they are all-reduced (sum) **in place** over it first, as Megatron does.
        expert_bias: fp32, the same shape.
        expert_bias_update_rate: the step (Megatron's ``moe_router_bias_update_rate``).
        tp_dp_cp_group: process group spanning the ranks that share the router, or None for
            this rank's counts only (Megatron defaults to its global TP x DP x CP group).

    Returns:
        The updated bias, a new fp32 tensor of ``expert_bias``'s shape.
    """
    with torch.no_grad():
        if tp_dp_cp_group is not None:
            dist.all_reduce(tokens_per_expert, group=tp_dp_cp_group)
        return _OP(tokens_per_expert, expert_bias, float(expert_bias_update_rate))


@register_fake("moe_core::expert_bias_update")
def _(tokens_per_expert, expert_bias, update_rate):
    return torch.empty_like(expert_bias)
