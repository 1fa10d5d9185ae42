"""tokens_per_expert: how many unpadded tokens each expert receives in a routing map.

Precision contract
------------------
* Exact int64 counts (integers: any summation order gives the same result); padded tokens
  (padding_mask True) are not counted. Not differentiable (counts are piecewise constant).
"""
from typing import Optional

import torch

from moe_core.ops._guards import int64_checked, register_fake
from moe_core.ops._padding_mask import flat_padding_mask

_OP = int64_checked(torch.ops.moe_core.tokens_per_expert)


def tokens_per_expert(routing_map: torch.Tensor,
                      padding_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Tokens per expert of a routing map.

    Args:
        routing_map: ``[num_tokens, num_experts]`` bool.
        padding_mask: bool with ``num_tokens`` elements, True = padding, or None.

    Returns:
        ``[num_experts]`` int64 counts (``routing_map[~padding].sum(0)``), on the map's device.
    """
    if not isinstance(routing_map, torch.Tensor) or routing_map.dim() != 2:
        shape = (tuple(routing_map.shape) if isinstance(routing_map, torch.Tensor)
                 else type(routing_map).__name__)
        raise ValueError(f"routing_map must be 2-D [num_tokens, num_experts], got {shape}")
    return _OP(routing_map, flat_padding_mask(padding_mask, routing_map.shape[0]))


@register_fake("moe_core::tokens_per_expert")
def _(routing_map, padding_mask):
    return routing_map.new_empty((routing_map.shape[1],), dtype=torch.long)
