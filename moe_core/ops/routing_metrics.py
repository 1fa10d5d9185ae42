"""routing_metrics: load-balance and route-drift metrics of a routing, kept on the device.

Precision contract
------------------
* Counts are exact int64; the derived metrics are computed in fp64 from them (and, for the
  score entropy, from per-token fp64 sums added in token order) and returned as fp32 0-d
  tensors on the routing's device. Nothing is read back to the host: call ``.item()`` (or
  :meth:`moe_core.metrics.MoEMetricsTracker.report`) when you want to log.
* Padded tokens (padding_mask True) are left out of every metric. Not differentiable.

Definitions (n_e = tokens per expert, mean = sum(n) / E):
  max_over_mean  max(n) / mean                         1 = perfectly balanced; 0 if nothing routed
  load_cv        population std(n) / mean              0 = perfectly balanced; 0 if nothing routed
  load_entropy   -sum f ln f, f = n / sum(n) (nats)   ln(E) = perfectly balanced
  score_entropy  mean over tokens of -sum s ln s of the router scores (nats; None without scores)
  topk overlap   mean over tokens of |A_t ∩ B_t| / k   1 = the same experts, 0 = disjoint
"""
from typing import NamedTuple, Optional

import torch

from moe_core.ops._guards import int64_checked, register_fake
from moe_core.ops._padding_mask import flat_padding_mask

_OP = int64_checked(torch.ops.moe_core.routing_metrics)
_OVERLAP = int64_checked(torch.ops.moe_core.topk_overlap)


class RoutingMetrics(NamedTuple):
    """Metrics of one routing; every field is a device tensor."""

    tokens_per_expert: torch.Tensor  # [num_experts] int64
    max_over_mean: torch.Tensor  # 0-d fp32
    load_cv: torch.Tensor  # 0-d fp32
    load_entropy: torch.Tensor  # 0-d fp32
    score_entropy: Optional[torch.Tensor]  # 0-d fp32, None when no scores were given


def routing_metrics(routing_map: torch.Tensor, scores: Optional[torch.Tensor] = None,
                    padding_mask: Optional[torch.Tensor] = None) -> RoutingMetrics:
    """Load-balance metrics of a routing map, on its device.

    Args:
        routing_map: ``[num_tokens, num_experts]`` bool.
        scores: ``[num_tokens, num_experts]`` float router scores (e.g. the aux-loss scores, a
            distribution per token) for the score entropy, or None.
        padding_mask: bool with ``num_tokens`` elements, True = padding, or None.

    Returns:
        :class:`RoutingMetrics`.
    """
    if not isinstance(routing_map, torch.Tensor) or routing_map.dim() != 2:
        shape = (tuple(routing_map.shape) if isinstance(routing_map, torch.Tensor)
                 else type(routing_map).__name__)
        raise ValueError(f"routing_map must be 2-D [num_tokens, num_experts], got {shape}")
    mask = flat_padding_mask(padding_mask, routing_map.shape[0])
    counts, stats = _OP(routing_map, None if scores is None else scores.detach(), mask)
    return RoutingMetrics(counts, stats[0], stats[1], stats[2],
                          None if scores is None else stats[3])


def topk_overlap(indices_a: torch.Tensor, indices_b: torch.Tensor, num_experts: int,
                 padding_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Top-k overlap of two routings of the same tokens (route drift between steps or layers).

    Args:
        indices_a, indices_b: ``[num_tokens, topk]`` int64 expert ids (distinct within a row),
            e.g. ``router_topk``'s indices at two training steps.
        num_experts: the id range, ``[0, num_experts)``.
        padding_mask: bool with ``num_tokens`` elements, True = padding, or None.

    Returns:
        0-d fp32: mean over unpadded tokens of ``|A_t ∩ B_t| / topk``.
    """
    if not isinstance(num_experts, int) or isinstance(num_experts, bool):
        raise TypeError(f"num_experts must be an int, got {num_experts!r}")
    if not isinstance(indices_a, torch.Tensor) or indices_a.dim() != 2:
        shape = (tuple(indices_a.shape) if isinstance(indices_a, torch.Tensor)
                 else type(indices_a).__name__)
        raise ValueError(f"indices_a must be 2-D [num_tokens, topk], got {shape}")
    mask = flat_padding_mask(padding_mask, indices_a.shape[0])
    return _OVERLAP(indices_a, indices_b, num_experts, mask)


@register_fake("moe_core::routing_metrics")
def _(routing_map, scores, padding_mask):
    return (routing_map.new_empty((routing_map.shape[1],), dtype=torch.long),
            routing_map.new_empty((4,), dtype=torch.float32))


@register_fake("moe_core::topk_overlap")
def _(indices_a, indices_b, num_experts, padding_mask):
    return indices_a.new_empty((), dtype=torch.float32)
