"""Process groups: the ones a MoE layer reduces over, and Megatron's expert-parallel layout.

Expert parallelism (EP) splits the experts of every MoE layer over the ``N`` ranks of an EP group:
rank r holds the contiguous experts ``[r·E/N, (r+1)·E/N)``; the router and the shared expert are
replicated. Besides the EP group, a layer reduces over two of Megatron's groups (its names):

* ``tp_cp_group``: the aux losses' token counts (and the z-loss scale). Size 1 without tensor or
  context parallelism, hence ``None`` by default.
* ``tp_dp_cp_group``: the global aux loss's counts and the expert-bias counts. Every rank that
  shares the router: under pure EP + DP, and under plain data parallelism (DDP, FSDP2), that is
  the whole data-parallel world. ``None`` means exactly that once ``torch.distributed`` is
  initialised (:func:`default_data_parallel_group`, resolved at the first reduction, since models
  are often built before ``init_process_group``); a group of one rank
  (``torch.distributed.new_subgroups(1)[0]``) keeps every rank's counts its own.

Wherever a group is taken, a ``torch.distributed.device_mesh.DeviceMesh`` of one dimension (or a
``(mesh, dim_name)`` pair) is accepted too. The model-wide utilities that use these groups
(gradient reduction, clipping, the gathered state dict) are in ``moe_core.parallel``.
"""
import dataclasses
import datetime
from typing import Optional, Tuple, Union

import torch  # noqa: F401  (GroupLike names torch.distributed.device_mesh.DeviceMesh)
import torch.distributed as dist

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


def default_data_parallel_group(param: torch.Tensor) -> Optional[dist.ProcessGroup]:
    """The data-parallel world of a replicated module whose ``tp_dp_cp_group`` was not given:
    None (this rank alone) without ``torch.distributed`` initialised; the mesh ``param`` was
    sharded over when it is a DTensor (``fully_shard`` keeps the sharded DTensor between steps),
    the whole mesh's ranks being the default group's when it has several dimensions (HSDP); else
    the default group. A mesh of several dimensions over part of the world names no single
    group: ValueError, pass the group explicitly.

    Args:
        param: one of the module's parameters (a tensor or a DTensor).
    """
    if not (dist.is_available() and dist.is_initialized()):
        return None
    mesh = getattr(param, "device_mesh", None)
    if mesh is None:
        return dist.group.WORLD
    if mesh.ndim == 1:
        return mesh.get_group()
    if mesh.size() == dist.get_world_size():
        return dist.group.WORLD
    raise ValueError(f"the parameters are sharded over a {mesh.ndim}-D mesh of {mesh.size()} of "
                     f"the {dist.get_world_size()} ranks: pass tp_dp_cp_group (the ranks that "
                     f"share the router) explicitly")


@dataclasses.dataclass
class ExpertParallelGroups:
    """The groups of a pure EP x DP run (Megatron's layout with TP = ETP = CP = 1)."""
    ep_group: dist.ProcessGroup          # the N ranks that split the experts
    expert_dp_group: dist.ProcessGroup   # the ranks that hold the same experts
    dp_group: dist.ProcessGroup          # every rank (the replicated parameters' data parallelism)

    def layer_kwargs(self) -> dict:
        """Keyword arguments for ``MoELayer`` (``ep_group``, ``tp_dp_cp_group``)."""
        return dict(ep_group=self.ep_group, tp_dp_cp_group=self.dp_group)


def expert_parallel_groups(ep_size: int, timeout: Optional[datetime.timedelta] = None
                           ) -> ExpertParallelGroups:
    """Build the groups of EP = ``ep_size`` over the default group, Megatron's order: EP groups
    are blocks of consecutive ranks (``[0..N-1], [N..2N-1], ...``), the expert-data-parallel
    groups take one rank of each block (``[0, N, 2N, ...]``). Every rank must call it.

    ``timeout``: how long a collective of the EP and expert-DP groups waits for the other ranks
    before it raises (None: the default group's, 30 minutes by default). A step that raised on
    one rank leaves the others in the layer's next exchange; with a timeout of a few times a
    step they raise an error naming that exchange instead of waiting half an hour."""
    if not dist.is_initialized():
        raise RuntimeError("expert_parallel_groups needs torch.distributed initialised")
    world = dist.get_world_size()
    if isinstance(ep_size, bool) or not isinstance(ep_size, int) or ep_size < 1 or world % ep_size:
        raise ValueError(f"ep_size={ep_size!r}: must be a positive divisor of the world size "
                         f"{world}")
    rank = dist.get_rank()
    ep_group = edp_group = None
    for start in range(0, world, ep_size):  # every rank creates every group, in the same order
        g = dist.new_group(list(range(start, start + ep_size)), timeout=timeout)
        if start <= rank < start + ep_size:
            ep_group = g
    for pos in range(ep_size):
        g = dist.new_group(list(range(pos, world, ep_size)), timeout=timeout)
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
