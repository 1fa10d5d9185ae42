"""Process groups for expert parallelism, and the gradient reduction that goes with them.

Expert parallelism (EP) splits the experts of every MoE layer over the ``N`` ranks of an EP group:
rank r holds the contiguous experts ``[r·E/N, (r+1)·E/N)``; the router and the shared expert are
replicated. Besides the EP group, a layer reduces over two of Megatron's groups (its names):

* ``tp_cp_group``: the aux losses' token counts (and the z-loss scale). Size 1 without tensor or
  context parallelism, hence ``None`` by default.
* ``tp_dp_cp_group``: the global aux loss's counts and the expert-bias counts. Every rank that
  shares the router: under pure EP + DP that is the whole world (the default of an EP layer).

Gradients, after the backward: replicated (dense) parameters are averaged over the data-parallel
group (every rank), expert parameters summed over the expert-data-parallel group (the ranks that
hold the same experts) and divided by the data-parallel size, so both equal the gradients of one
process running the whole global batch (:func:`all_reduce_gradients`).

Wherever a group is taken, a ``torch.distributed.device_mesh.DeviceMesh`` of one dimension (or a
``(mesh, dim_name)`` pair) is accepted too.
"""
import dataclasses
from typing import Optional, Tuple, Union

import torch
import torch.distributed as dist
from torch import nn

GroupLike = Union[None, dist.ProcessGroup, "torch.distributed.device_mesh.DeviceMesh", Tuple]


def as_group(group: GroupLike, name: str = "group") -> Optional[dist.ProcessGroup]:
    """A ProcessGroup from a ProcessGroup, a 1-D DeviceMesh or a ``(mesh, dim_name)`` pair;
    None stays None."""
    if group is None or isinstance(group, dist.ProcessGroup):
        return group
    from torch.distributed.device_mesh import DeviceMesh

    if isinstance(group, DeviceMesh):
        if group.ndim != 1:
            raise ValueError(f"{name}: a DeviceMesh of {group.ndim} dimensions names no single "
                             f"group; pass (mesh, dim_name) or mesh[dim_name]")
        return group.get_group()
    if (isinstance(group, tuple) and len(group) == 2 and isinstance(group[0], DeviceMesh)):
        return group[0].get_group(group[1])
    raise TypeError(f"{name} must be a ProcessGroup, a 1-D DeviceMesh or (mesh, dim_name), "
                    f"got {type(group).__name__}")


def group_size(group: Optional[dist.ProcessGroup]) -> int:
    return 1 if group is None else dist.get_world_size(group)


@dataclasses.dataclass
class ExpertParallelGroups:
    """The groups of a pure EP x DP run (Megatron's layout with TP = ETP = CP = 1)."""
    ep_group: dist.ProcessGroup          # the N ranks that split the experts
    expert_dp_group: dist.ProcessGroup   # the ranks that hold the same experts
    dp_group: dist.ProcessGroup          # every rank (the replicated parameters' data parallelism)

    def layer_kwargs(self) -> dict:
        """Keyword arguments for ``MoELayer`` (``ep_group``, ``tp_dp_cp_group``)."""
        return dict(ep_group=self.ep_group, tp_dp_cp_group=self.dp_group)


def expert_parallel_groups(ep_size: int) -> ExpertParallelGroups:
    """Build the groups of EP = ``ep_size`` over the default group, Megatron's order: EP groups
    are blocks of consecutive ranks (``[0..N-1], [N..2N-1], ...``), the expert-data-parallel
    groups take one rank of each block (``[0, N, 2N, ...]``). Every rank must call it."""
    if not dist.is_initialized():
        raise RuntimeError("expert_parallel_groups needs torch.distributed initialised")
    world = dist.get_world_size()
    if isinstance(ep_size, bool) or not isinstance(ep_size, int) or ep_size < 1 or world % ep_size:
        raise ValueError(f"ep_size={ep_size!r}: must be a positive divisor of the world size "
                         f"{world}")
    rank = dist.get_rank()
    ep_group = edp_group = None
    for start in range(0, world, ep_size):  # every rank creates every group, in the same order
        g = dist.new_group(list(range(start, start + ep_size)))
        if start <= rank < start + ep_size:
            ep_group = g
    for pos in range(ep_size):
        g = dist.new_group(list(range(pos, world, ep_size)))
        if rank % ep_size == pos:
            edp_group = g
    return ExpertParallelGroups(ep_group, edp_group, dist.group.WORLD)


def megatron_groups() -> dict:
    """``MoELayer`` keyword arguments from Megatron's ``parallel_state`` (a script that owns it):
    ``ep_group``, ``tp_cp_group``, ``tp_dp_cp_group``."""
    from megatron.core import parallel_state as ps

    return dict(ep_group=ps.get_expert_model_parallel_group(),
                tp_cp_group=ps.get_tensor_and_context_parallel_group(),
                tp_dp_cp_group=ps.get_tensor_and_data_parallel_group(with_context_parallel=True))


def is_expert_parameter(param: nn.Parameter) -> bool:
    """True for the parameters an EP layer splits over more than one rank (its routed experts');
    a layer without expert parallelism holds replicated experts."""
    return getattr(param, "expert_parallel_size", 1) > 1


def _ep_group_of(model: nn.Module) -> Optional[dist.ProcessGroup]:
    """The EP group of the model's expert-parallel MoE layers (one group for all of them)."""
    from moe_core.layer import moe_layers

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
    after :func:`all_reduce_gradients`. Returns the total norm (fp32, on the gradients' device)."""
    params = [p for p in model.parameters() if p.grad is not None]
    if not params:
        return torch.zeros(())
    group = as_group(ep_group, "ep_group") or _ep_group_of(model)
    sq = torch.stack([torch.linalg.vector_norm(p.grad.float()) for p in params]).square()
    expert = torch.tensor([is_expert_parameter(p) for p in params], device=sq.device)
    if group is not None and expert.any():
        expert_sq = torch.where(expert, sq, 0.0)
        dist.all_reduce(expert_sq, group=group)
        sq = torch.where(expert, expert_sq, sq)
    total = sq.sum().sqrt()
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
