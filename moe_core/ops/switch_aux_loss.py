"""switch_aux_loss: the Switch-Transformer load-balancing loss, micro-batch and sequence level.

Precision contract
------------------
* ``loss = sum_c (sum_t probs[t, c]) * tokens_per_expert[c] * E * coeff / (topk * total**2)``,
  every sum accumulated in fp64 in a fixed order (tokens ascending per column, then columns)
  and rounded once: an fp32 scalar (fp64 for fp64 probs), deterministic, within a few fp32 ulps
  of Megatron's fp32 result. Counts are read as fp32 (as Megatron's fp32 buffers), the total as
  fp64, both from device tensors: no host sync.
* ``padding_mask`` is True = padding everywhere in moe_core. (Megatron's own
  ``switch_load_balancing_loss_func`` takes True = valid, but its router never passes a mask;
  this is a deliberate difference so one convention holds across the package.)
* Backward: ``grad_probs[t, c] = grad * tokens_per_expert[c] * E * coeff / (topk * total**2)``,
  zero on padded rows, in the probs' dtype. Counts and total get no gradient.
"""
from typing import Optional, Tuple, Union

import torch
import torch.distributed as dist

from moe_core.ops._guards import int64_checked, register_autograd, register_fake
from moe_core.ops._padding_mask import flat_padding_mask
from moe_core.ops.tokens_per_expert import tokens_per_expert as _tokens_per_expert

_OP = int64_checked(torch.ops.moe_core.switch_aux_loss)
_BWD = int64_checked(torch.ops.moe_core.switch_aux_loss_bwd)

Number = Union[int, float, torch.Tensor]


def _as_total(total_num_tokens: Number, device: torch.device) -> torch.Tensor:
    if isinstance(total_num_tokens, torch.Tensor):
        return total_num_tokens
    # a symbolic count (a token dimension traced as dynamic) is a number too; sym_float keeps it
    # symbolic where float() would pin it, and is float() for a plain number
    numbers = (int, float, torch.SymInt, torch.SymFloat)
    if isinstance(total_num_tokens, bool) or not isinstance(total_num_tokens, numbers):
        raise TypeError(f"total_num_tokens must be a number or a tensor, got {total_num_tokens!r}")
    # a fill, not a host-to-device copy: legal inside CUDA-graph capture
    return torch.full((), torch.sym_float(total_num_tokens), dtype=torch.float64, device=device)


def switch_load_balancing_loss_func(
    probs: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    total_num_tokens: Number,
    topk: int,
    num_experts: int,
    moe_aux_loss_coeff: float,
    fused: bool = False,
    padding_mask: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Megatron's ``switch_load_balancing_loss_func`` (same arguments).

    Args:
        probs: ``[num_tokens, num_columns]`` float: the aux-loss scores (``num_columns`` is
            ``num_experts``, or ``B * num_experts`` for the sequence-level loss).
        tokens_per_expert: ``[num_columns]`` counts (any real dtype, read as fp32).
        total_num_tokens: int, float or a one-element tensor (kept on its device).
        topk, num_experts, moe_aux_loss_coeff: the scalars of the formula.
        fused: accepted for signature compatibility and ignored.
        padding_mask: bool with ``num_tokens`` elements, **True = padding**, or None.

    Returns:
        A 0-d fp32 loss (fp64 for fp64 probs) with a gradient to ``probs``.
    """
    del fused
    for name, v in (("topk", topk), ("num_experts", num_experts)):
        if not isinstance(v, int) or isinstance(v, bool):
            raise TypeError(f"{name} must be an int, got {v!r}")
    if not isinstance(probs, torch.Tensor) or probs.dim() != 2:
        shape = tuple(probs.shape) if isinstance(probs, torch.Tensor) else type(probs).__name__
        raise ValueError(f"probs must be 2-D [num_tokens, num_columns], got {shape}")
    total = _as_total(total_num_tokens, probs.device)
    mask = flat_padding_mask(padding_mask, probs.shape[0])
    return _OP(probs, tokens_per_expert, total, topk, num_experts, float(moe_aux_loss_coeff), mask)


def _group_size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def get_tokens_per_expert_and_token_count(
    routing_map: torch.Tensor,
    reduce_group=None,
    topk: Optional[int] = None,
    with_padding_mask: bool = False,
) -> Tuple[torch.Tensor, Union[int, torch.Tensor], Union[int, torch.Tensor]]:
    """Megatron's ``get_tokens_per_expert_and_token_count``.

    Args:
        routing_map: ``[num_tokens, num_columns]`` bool (padded rows already cleared).
        reduce_group: process group the counts are summed over, or None for this rank only.
        topk: experts per token in the counts (needed with a padding mask).
        with_padding_mask: token counts from the map (tensors) instead of its shape (ints).

    Returns:
        ``(global_tokens_per_expert int64 [num_columns], local_num_tokens, total_num_tokens)``;
        the counts are all-reduced (sum) over ``reduce_group``.
    """
    local = _tokens_per_expert(routing_map)
    global_counts = local
    if _group_size(reduce_group) > 1:
        global_counts = local.clone()
        dist.all_reduce(global_counts, group=reduce_group)
    if with_padding_mask:
        if topk is None:
            raise ValueError("topk is required when with_padding_mask is True, got None")
        return global_counts, local.sum() / topk, global_counts.sum() / topk
    local_num_tokens = routing_map.shape[0]
    return global_counts, local_num_tokens, local_num_tokens * _group_size(reduce_group)


def _masked(scores, routing_map, padding_mask):
    """Clears padded rows of the map and the scores (no-op when they came cleared)."""
    if padding_mask is None:
        return scores, routing_map
    pad = padding_mask.reshape(-1, 1)
    return scores.masked_fill(pad, 0.0), routing_map & ~pad


def load_balancing_loss(
    scores: torch.Tensor,
    routing_map: torch.Tensor,
    topk: int,
    num_experts: int,
    moe_aux_loss_coeff: float,
    padding_mask: Optional[torch.Tensor] = None,
    reduce_group=None,
) -> torch.Tensor:
    """Micro-batch aux loss ("aux_loss"): Megatron's ``TopKRouter._apply_aux_loss`` value.

    Args:
        scores, routing_map: ``[num_tokens, num_experts]`` from
            :func:`compute_routing_scores_for_aux_loss`.
        topk, num_experts, moe_aux_loss_coeff: as Megatron's config.
        padding_mask: bool, ``num_tokens`` elements, True = padding, or None.
        reduce_group: Megatron's TP x CP group (counts are summed over it), or None.

    Returns:
        A 0-d fp32 loss (not yet scaled for per-token loss; logged value = loss / coeff).
    """
    mask = flat_padding_mask(padding_mask, scores.shape[0])
    scores, routing_map = _masked(scores, routing_map, mask)
    counts, _, total = get_tokens_per_expert_and_token_count(
        routing_map, reduce_group, topk, with_padding_mask=mask is not None
    )
    return switch_load_balancing_loss_func(scores, counts, total, topk, num_experts,
                                           moe_aux_loss_coeff)


def seq_load_balancing_loss(
    scores: torch.Tensor,
    routing_map: torch.Tensor,
    seq_length: int,
    bsz: int,
    topk: int,
    num_experts: int,
    moe_aux_loss_coeff: float,
    padding_mask: Optional[torch.Tensor] = None,
    reduce_group=None,
) -> torch.Tensor:
    """Sequence-level aux loss ("seq_aux_loss"): Megatron's ``_apply_seq_aux_loss`` value.

    Each (sequence, expert) pair is one column: scores and map ``[S * B, E]`` (tokens in
    ``[S, B]`` order) are viewed as ``[S, B * E]``; the loss is the switch loss of that view
    with ``topk * B`` in the token counts, divided by ``B`` (the mean over sequences).

    Args:
        scores, routing_map: ``[seq_length * bsz, num_experts]``.
        seq_length, bsz: the ``[S, B]`` layout of the tokens.
        topk, num_experts, moe_aux_loss_coeff, padding_mask, reduce_group: as
            :func:`load_balancing_loss`.

    Returns:
        A 0-d fp32 loss.
    """
    if scores.dim() != 2 or scores.shape[0] != seq_length * bsz:
        raise ValueError(
            f"scores must be [seq_length * bsz, num_experts] = [{seq_length} * {bsz}, E], got "
            f"{tuple(scores.shape)}"
        )
    mask = flat_padding_mask(padding_mask, scores.shape[0])
    scores, routing_map = _masked(scores, routing_map, mask)
    scores = scores.reshape(seq_length, -1)
    routing_map = routing_map.reshape(seq_length, -1)
    counts, _, total = get_tokens_per_expert_and_token_count(
        routing_map, reduce_group, topk * bsz, with_padding_mask=mask is not None
    )
    # Megatron divides the loss by bsz afterwards; folding it into the coefficient rounds once.
    return switch_load_balancing_loss_func(scores, counts, total, topk, num_experts,
                                           moe_aux_loss_coeff / bsz)


@register_fake("moe_core::switch_aux_loss")
def _(probs, tokens_per_expert, total_num_tokens, topk, num_experts, coeff, padding_mask):
    dtype = torch.float64 if probs.dtype == torch.float64 else torch.float32
    return probs.new_empty((), dtype=dtype)


@register_fake("moe_core::switch_aux_loss_bwd")
def _(grad_loss, probs, tokens_per_expert, total_num_tokens, topk, num_experts, coeff,
      padding_mask):
    return torch.empty_like(probs)


def _setup_context(ctx, inputs, output):
    probs, tpe, total, topk, num_experts, coeff, padding_mask = inputs
    ctx.options = (topk, num_experts, coeff)
    ctx.save_for_backward(probs, tpe, total, padding_mask)


def _backward(ctx, grad_loss):
    probs, tpe, total, padding_mask = ctx.saved_tensors
    grad_probs = _BWD(grad_loss, probs, tpe, total, *ctx.options, padding_mask)
    return grad_probs, None, None, None, None, None, None


register_autograd("moe_core::switch_aux_loss", _backward, setup_context=_setup_context)
