"""Plain-torch references of the Hugging Face MoE families' router math, written from
transformers' modeling code (DeepSeek-V2 / V3, Ernie-4.5-MoE, Qwen-MoE / Mixtral, GPT-OSS): each
takes ``[T, E]`` logits and returns ``(weights [T, k] in the logits' dtype, expert ids [T, k])``,
best first. Used by tests/router/test_hf_rules.py (against moe-core's routing rules) and
tests/hf/test_blocks.py (an fp64 truth for HF's fp32-casting routers).
"""
from typing import Tuple

import torch

Pair = Tuple[torch.Tensor, torch.Tensor]


def _compute(logits: torch.Tensor) -> torch.dtype:
    return torch.float64 if logits.dtype == torch.float64 else torch.float32


def _group_keep(sel: torch.Tensor, num_groups: int, group_topk: int, group_score) -> torch.Tensor:
    """[T, E] bool: the experts of each token's group_topk best groups, a group scored by
    group_score([T, G, E/G] selection values) -> [T, G]."""
    T, E = sel.shape
    scores = group_score(sel.view(T, num_groups, E // num_groups))
    kept = torch.zeros(T, num_groups, dtype=torch.bool, device=sel.device)
    kept.scatter_(1, scores.topk(group_topk, dim=-1).indices, True)
    return kept.unsqueeze(-1).expand(T, num_groups, E // num_groups).reshape(T, E)


def hf_deepseek_v2(logits: torch.Tensor, k: int, method: str, num_groups: int, group_topk: int,
                   scale: float) -> Pair:
    """softmax over all experts; greedy top-k, or group_limited_greedy: groups ranked by their
    best expert, the others' scores zeroed; weights times routed_scaling_factor."""
    s = logits.softmax(dim=-1, dtype=_compute(logits))
    if method == "group_limited_greedy":
        keep = _group_keep(s, num_groups, group_topk, lambda g: g.max(dim=-1).values)
        s = s.masked_fill(~keep, 0.0)
    w, idx = s.topk(k, dim=-1)
    return (w * scale).to(logits.dtype), idx


def hf_deepseek_v3(logits: torch.Tensor, k: int, bias: torch.Tensor, num_groups: int,
                   group_topk: int, norm_topk_prob: bool, scale: float) -> Pair:
    """sigmoid scores; the choice ranks score + bias, groups by the sum of their top two;
    weights: the unbiased scores, divided by (sum + 1e-20) when norm_topk_prob, times the
    routed_scaling_factor."""
    s = torch.sigmoid(logits.to(_compute(logits)))
    sel = s + bias.to(s.dtype)
    keep = _group_keep(sel, num_groups, group_topk, lambda g: g.topk(2, dim=-1).values.sum(-1))
    idx = sel.masked_fill(~keep, float("-inf")).topk(k, dim=-1).indices
    w = s.gather(1, idx)
    if norm_topk_prob:
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
    return (w * scale).to(logits.dtype), idx


def hf_ernie45(logits: torch.Tensor, k: int, bias: torch.Tensor, norm_min: float) -> Pair:
    """softmax over all experts; the choice ranks softmax + e_score_correction_bias; weights:
    the unbiased softmax values divided by max(sum, norm_min)."""
    s = logits.softmax(dim=-1, dtype=_compute(logits))
    idx = (s + bias.to(s.dtype)).topk(k, dim=-1).indices
    w = s.gather(1, idx)
    return (w / w.sum(dim=-1, keepdim=True).clamp(min=norm_min)).to(logits.dtype), idx


def hf_qwen(logits: torch.Tensor, k: int, norm_topk_prob: bool) -> Pair:
    """Qwen2/3-MoE, OLMoE, Mixtral (norm_topk_prob=True): softmax over all experts in fp32,
    top-k, renormalised by the sum."""
    s = logits.softmax(dim=-1, dtype=_compute(logits))
    w, idx = s.topk(k, dim=-1)
    if norm_topk_prob:
        w = w / w.sum(dim=-1, keepdim=True)
    return w.to(logits.dtype), idx


def hf_gpt_oss(logits: torch.Tensor, k: int) -> Pair:
    """top-k of the (router-bias included) logits, softmax over the k."""
    v, idx = logits.topk(k, dim=-1)
    return v.softmax(dim=-1, dtype=_compute(logits)).to(logits.dtype), idx
