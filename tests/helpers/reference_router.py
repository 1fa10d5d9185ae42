"""Pure-PyTorch references of the router ops, written from the spec (not from our kernels).

They follow Megatron-Core's unfused code step by step, with one change: every top-k ranks by
descending value with ties to the lowest index and NaN first (a stable descending sort), which is
moe-core's documented rule; torch.topk leaves ties unspecified.
"""
from typing import Optional, Tuple

import torch

from moe_core.ops import SCORE_FUNCTIONS

# (score_function, use_pre_softmax): every score function, and softmax before the top-k too
ROUTING_MODES = [("softmax", False), ("softmax", True)] + \
    [(s, False) for s in SCORE_FUNCTIONS if s != "softmax"]


def ranked_topk(values: torch.Tensor, k: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Top-k along dim 1: descending, NaN first, ties to the lowest index."""
    idx = torch.sort(values, dim=1, descending=True, stable=True).indices[:, :k]
    return values.gather(1, idx), idx


def group_limited_topk(scores, topk, num_groups, group_topk):
    T, E = scores.shape
    per_group = E // num_groups
    n = topk // group_topk
    grouped = torch.sort(scores.view(T, num_groups, per_group), dim=-1, descending=True, stable=True)
    group_scores = grouped.values[..., :n].sum(dim=-1)
    _, group_idx = ranked_topk(group_scores, group_topk)
    keep = torch.zeros(T, num_groups, dtype=torch.bool, device=scores.device)
    keep.scatter_(1, group_idx, True)
    keep = keep.unsqueeze(-1).expand(T, num_groups, per_group).reshape(T, E)
    return ranked_topk(scores.masked_fill(~keep, float("-inf")), topk)


def topk_routing(
    logits: torch.Tensor,
    topk: int,
    use_pre_softmax: bool = False,
    num_groups: Optional[int] = None,
    group_topk: Optional[int] = None,
    scaling_factor: Optional[float] = None,
    score_function: str = "softmax",
    expert_bias: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Compact routing (probs [T, k] in logits.dtype, indices [T, k]), differentiable in logits.

    Score math in fp32, or fp64 for fp64 logits (moe-core keeps fp64 there).
    """
    compute = torch.float64 if logits.dtype == torch.float64 else torch.float32

    def select(s):
        if group_topk:
            return group_limited_topk(s, topk, num_groups, group_topk)
        return ranked_topk(s, topk)

    if score_function == "softmax":
        if use_pre_softmax:
            probs, idx = select(torch.softmax(logits, dim=-1, dtype=compute))
        else:
            vals, idx = select(logits)
            probs = torch.softmax(vals, dim=-1, dtype=compute)
    else:
        x = logits.to(compute)
        scores = torch.sigmoid(x) if score_function == "sigmoid" else torch.nn.functional.softplus(x).sqrt()
        if expert_bias is not None:
            _, idx = select(scores + expert_bias.to(compute))
            vals = scores.gather(1, idx)
        else:
            vals, idx = select(scores)
        probs = vals / (vals.sum(dim=-1, keepdim=True) + 1e-20) if topk > 1 else vals
    if scaling_factor:
        probs = probs * scaling_factor
    return probs.to(logits.dtype), idx


def to_dense(probs: torch.Tensor, idx: torch.Tensor, num_experts: int):
    dense = torch.zeros(probs.shape[0], num_experts, dtype=probs.dtype, device=probs.device)
    dense = dense.scatter(1, idx, probs)
    routing_map = torch.zeros_like(dense, dtype=torch.bool).scatter(1, idx, True)
    return dense, routing_map


def gating_linear(inp, weight, bias, router_dtype):
    """Megatron's RouterGatingLinearFunction forward, via autograd of the upcast matmul."""
    out = inp.to(router_dtype) @ weight.to(router_dtype).t()
    if bias is not None:
        out = out + bias.to(router_dtype)
    return out
