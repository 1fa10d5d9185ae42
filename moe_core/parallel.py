"""Expert-parallel training utilities: the gradient reduction, clipping and state dict of a model
whose MoE layers split their experts over ranks (the groups themselves: ``moe_core.groups``,
whose names are re-exported here).

Gradients, after the backward: replicated (dense) parameters are averaged over the data-parallel
group (every rank), expert parameters summed over the expert-data-parallel group (the ranks that
hold the same experts) and divided by the data-parallel size, so both equal the gradients of one
process running the whole global batch (:func:`all_reduce_gradients`).
"""
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from moe_core.groups import (  # re-exported: moe_core.parallel's public names
    ExpertParallelGroups,
    GroupLike,
    as_group,
    expert_parallel_groups,
    group_size,
    megatron_groups,
)
from moe_core.layer import moe_layers

__all__ = ["ExpertParallelGroups", "GroupLike", "as_group", "expert_parallel_groups", "group_size",
           "megatron_groups", "is_expert_parameter", "all_reduce_gradients", "clip_grad_norm_",
           "full_state_dict"]

def is_expert_parameter(param: nn.Parameter) -> bool:
    """True for the parameters an EP layer splits over more than one rank (its routed experts');
    a layer without expert parallelism holds replicated experts."""
    return getattr(param, "expert_parallel_size", 1) > 1


def _ep_group_of(model: nn.Module) -> Optional[dist.ProcessGroup]:
    """The EP group of the model's expert-parallel MoE layers (one group for all of them)."""
    groups = {id(l.ep_group): l.ep_group for l in moe_layers(model)
              if l.dispatcher is not None and l.dispatcher.ep_size > 1}
    if len(groups) > 1:
        raise ValueError("the model's MoE layers use different expert-parallel groups; "
                         "moe_core.parallel handles one")
    return next(iter(groups.values()), None)


@torch.no_grad()
def all_reduce_gradients(model: nn.Module, dp_group: GroupLike = None,
                         expert_dp_group: GroupLike = None) -> None:
    """Megatron's gradient reduction for EP x DP, after ``backward()``: every replicated
    parameter's gradient is averaged over ``dp_group`` (default: the world); every expert
    parameter's gradient is summed over ``expert_dp_group`` (None: no other rank holds these
    experts) and divided by the size of ``dp_group``. The result is the gradient of the mean of
    the ranks' losses, as one process would compute it on the global batch.

    Parameters already managed by FSDP2 (``fully_shard``, DTensor gradients) are left alone.
    Reductions run in a fixed order of parameters (deterministic)."""
    dp = as_group(dp_group, "dp_group") or dist.group.WORLD
    edp = as_group(expert_dp_group, "expert_dp_group")
    dp_size = group_size(dp)
    for p in model.parameters():
        g = p.grad
        if g is None or type(g) is not torch.Tensor:
            continue
        if is_expert_parameter(p):
            holders = dp_size // p.expert_parallel_size  # ranks holding the same experts
            if holders != group_size(edp):
                raise ValueError(
                    f"expert_dp_group has {group_size(edp)} ranks, but with {dp_size} data-"
                    f"parallel ranks and expert parallelism {p.expert_parallel_size} each expert "
                    f"is held by {holders}: pass the expert-data-parallel group "
                    f"(moe_core.parallel.expert_parallel_groups)")
            if holders > 1:
                dist.all_reduce(g, group=edp)
            g.div_(dp_size)
        elif dp_size > 1:
            dist.all_reduce(g, group=dp)
            g.div_(dp_size)


@torch.no_grad()
def clip_grad_norm_(model: nn.Module, max_norm: float, ep_group: GroupLike = None) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` over the whole model when its experts are split: each
    expert parameter's squared norm is summed over the EP group (``None``: the model's MoE
    layers' group), so every rank computes the global 2-norm and the same scale, and replicated
    parameters stay equal across ranks (clipping by each rank's own norm would not). Call it
    after :func:`all_reduce_gradients`. Returns the total norm (fp32, on the gradients' device).

    A collective over the EP group whenever the model has expert parameters, entered by every
    rank whatever gradients it holds: the reduced vector has one entry per expert parameter of
    the model (zero where a rank has no gradient), so a rank without gradients (a skipped
    backward) still joins with a vector of the others' length instead of leaving them waiting."""
    group = as_group(ep_group, "ep_group") or _ep_group_of(model)
    all_params = list(model.parameters())
    params = [p for p in all_params if p.grad is not None]
    experts = [p for p in all_params if is_expert_parameter(p)]
    device = params[0].grad.device if params else (all_params[0].device if all_params
                                                   else torch.device("cpu"))
    norms = {id(p): torch.linalg.vector_norm(p.grad.float()).square() for p in params}
    if group is not None and experts:
        zero = torch.zeros((), device=device)
        expert_sq = torch.stack([norms.get(id(p), zero) for p in experts])
        dist.all_reduce(expert_sq, group=group)
        norms.update((id(p), sq) for p, sq in zip(experts, expert_sq.unbind()))
    if not params:
        total = torch.zeros((), device=device)
        if group is not None and experts:  # the other ranks' experts still count
            total = torch.stack([norms[id(p)] for p in experts]).sum().sqrt()
        return total
    total = torch.stack([norms[id(p)] for p in params]).sum().sqrt()
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total


def full_state_dict(model: nn.Module, ep_group: GroupLike = None) -> dict:
    """The single-process state dict of an expert-parallel model: every expert parameter
    all-gathered over the EP group (rank order is expert order). A collective: every rank of the
    group calls it."""
    sd = model.state_dict()
    group = as_group(ep_group, "ep_group") or _ep_group_of(model)
    if group is None:
        return sd
    for name, p in model.named_parameters():
        if is_expert_parameter(p):
            parts = [torch.empty_like(p) for _ in range(group_size(group))]
            dist.all_gather(parts, p.detach().contiguous(), group=group)
            sd[name] = torch.cat(parts)
    return sd
