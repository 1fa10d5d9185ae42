"""Routing replay: record the routers' top-k choices in one forward, route a later one by them.

With ``MoEConfig(moe_enable_routing_replay=True)`` each router holds a :class:`RouterReplay`
(``layer.router.router_replay``), the API of Megatron-Core's ``RouterReplay`` (same names, same
actions, same "global" static methods over every live instance in construction order):

* ``RECORD``: the router routes as usual and keeps its top-k indices ``[T, k]`` int64 (best
  first) for :meth:`RouterReplay.get_recorded_indices` / :meth:`RouterReplay.get_recorded_data`:
  a reference to the routing's own tensor (no copy, no host read), or a copy into a static buffer
  when one is set (CUDA graphs).
* ``REPLAY_FORWARD``: the router takes the indices given by :meth:`RouterReplay.set_target_indices`
  (or ``set_replay_data``) instead of choosing: the probs are the score function's values at
  those experts, normalised and scaled as the routing would (:func:`routing_at_indices`). RL
  training replays the rollout's routing this way.
* ``REPLAY_BACKWARD``: the same, with the indices taken in turn from the list every
  ``set_target_indices`` appended to: the recompute of an activation checkpoint (Megatron's
  name; the recomputes of several micro-batches pop their indices in order).
* None (the default): routing as without replay.

A replayed forward computes the aux losses and the z-loss from the router's logits, as Megatron
does (the replay changes the choice, not the balancing statistics), and counts the replayed choice
for the expert bias. Group limits and the expert bias do not constrain a replayed choice.
Sinkhorn routing has no top-k to replay (``MoEConfig`` refuses the combination).

Differences from Megatron, by design: instances are held weakly (a router that is gone leaves the
global list by itself, where Megatron's list keeps it until
``clear_global_router_replay_instances``), and every static method takes an optional ``model``:
then it acts on that model's routers in module order instead of every live instance.
"""
import enum
import weakref
from typing import List, Optional

import torch
from torch import nn

from moe_core.ops.names import SCORE_FUNCTIONS


class RouterReplayAction(enum.Enum):
    """What a router with a :class:`RouterReplay` does with its top-k choice."""

    RECORD = "record"
    REPLAY_FORWARD = "replay_forward"
    REPLAY_BACKWARD = "replay_backward"


# every live RouterReplay, in construction order (weak: a deleted model's routers drop out)
_INSTANCES: List["weakref.ref[RouterReplay]"] = []


def _live() -> List["RouterReplay"]:
    alive = [r for r in (ref() for ref in _INSTANCES) if r is not None]
    _INSTANCES[:] = [weakref.ref(r) for r in alive]
    return alive


class RouterReplay:
    """One router's recorded and target top-k indices and its replay action.

    Attributes:
        target_topk_idx: ``[T, k]`` integer indices REPLAY_FORWARD routes by, or None.
        recorded_topk_idx: ``[T, k]`` int64 indices the last RECORD forward chose, or None.
        router_replay_action: a :class:`RouterReplayAction`, or None (route as usual).
        replay_backward_list: the indices REPLAY_BACKWARD takes, first in first out.
        static_buffer: ``[max_tokens, k]`` integer tensor RECORD copies into, or None.
        layer_number: the router's layer number (set by the layer; informational).
    """

    def __init__(self) -> None:
        self.target_topk_idx: Optional[torch.Tensor] = None
        self.recorded_topk_idx: Optional[torch.Tensor] = None
        self.router_replay_action: Optional[RouterReplayAction] = None
        self.replay_backward_list: List[torch.Tensor] = []
        self.static_buffer: Optional[torch.Tensor] = None
        self.layer_number: Optional[int] = None
        _INSTANCES.append(weakref.ref(self))

    def __setstate__(self, state: dict) -> None:
        # a deep copy of a model is a model of its own: its routers' replays join the list too
        self.__dict__.update(state)
        _INSTANCES.append(weakref.ref(self))

    # ---- every router at once (Megatron's static methods; ``model`` narrows them) -------------
    @staticmethod
    def instances(model: Optional[nn.Module] = None) -> List["RouterReplay"]:
        """The replays the static methods act on: ``model``'s routers' in module order, or every
        live instance in construction order (Megatron's ``global_router_replay_instances``)."""
        if model is None:
            return _live()
        return [m.router_replay for m in model.modules()
                if isinstance(getattr(m, "router_replay", None), RouterReplay)]

    @staticmethod
    def set_replay_data(all_layers_topk_indices: List[torch.Tensor],
                        model: Optional[nn.Module] = None) -> None:
        """Give each router its target indices, one ``[T, k]`` tensor per router, in the order of
        :meth:`instances`.

        Raises:
            ValueError: the list's length is not the number of routers.
        """
        routers = RouterReplay.instances(model)
        if len(all_layers_topk_indices) != len(routers):
            raise ValueError(f"all_layers_topk_indices has {len(all_layers_topk_indices)} "
                             f"tensors for {len(routers)} routers with routing replay")
        for router, indices in zip(routers, all_layers_topk_indices):
            router.set_target_indices(indices)

    @staticmethod
    def get_recorded_data(model: Optional[nn.Module] = None) -> List[Optional[torch.Tensor]]:
        """Each router's recorded ``[T, k]`` indices (None where nothing was recorded), in the
        order of :meth:`instances`."""
        return [router.get_recorded_indices() for router in RouterReplay.instances(model)]

    @staticmethod
    def clear_global_indices(model: Optional[nn.Module] = None) -> None:
        """Forget every router's recorded and target indices."""
        for router in RouterReplay.instances(model):
            router.clear_indices()

    @staticmethod
    def set_global_router_replay_action(router_replay_action: RouterReplayAction,
                                        model: Optional[nn.Module] = None) -> None:
        """Set every router's action."""
        for router in RouterReplay.instances(model):
            router.set_router_replay_action(router_replay_action)

    @staticmethod
    def clear_global_router_replay_action(model: Optional[nn.Module] = None) -> None:
        """Every router routes as usual again."""
        for router in RouterReplay.instances(model):
            router.clear_router_replay_action()

    @staticmethod
    def clear_global_router_replay_instances() -> None:
        """Empty the global list (its routers keep their replays; ``model=`` still finds them)."""
        _INSTANCES.clear()

    @staticmethod
    def set_global_static_buffers(static_buffer: torch.Tensor,
                                  model: Optional[nn.Module] = None) -> None:
        """Give router ``i`` (order of :meth:`instances`) the view ``static_buffer[:, i, :]`` of a
        ``[max_tokens, num_routers, k]`` buffer to record into.

        Raises:
            ValueError: the buffer is not 3-D with one column per router.
        """
        routers = RouterReplay.instances(model)
        if static_buffer.dim() != 3 or static_buffer.shape[1] != len(routers):
            raise ValueError(f"static_buffer must be [max_tokens, {len(routers)}, topk] (one "
                             f"column per router), got {tuple(static_buffer.shape)}")
        for i, router in enumerate(routers):
            router.set_static_buffer(static_buffer[:, i, :])

    @staticmethod
    def clear_global_static_buffers(model: Optional[nn.Module] = None) -> None:
        """Every router records by reference again."""
        for router in RouterReplay.instances(model):
            router.clear_static_buffer()

    # ---- this router ---------------------------------------------------------------------------
    def set_target_indices(self, topk_indices: torch.Tensor) -> None:
        """Route the next REPLAY_FORWARD forwards by ``topk_indices`` (``[T, k]``, integer, any
        device: moved to the logits' when used) and queue them for one REPLAY_BACKWARD.

        Raises:
            TypeError: not an integer tensor.
            ValueError: not 2-D.
        """
        _check_indices(topk_indices, "topk_indices")
        self.target_topk_idx = topk_indices
        self.replay_backward_list.append(topk_indices)

    def get_recorded_indices(self) -> Optional[torch.Tensor]:
        """The ``[T, k]`` int64 indices of the last RECORD forward, or None."""
        return self.recorded_topk_idx

    def clear_indices(self) -> None:
        """Forget the recorded and target indices and the REPLAY_BACKWARD queue."""
        self.recorded_topk_idx = None
        self.target_topk_idx = None
        self.replay_backward_list = []

    def set_router_replay_action(self, router_replay_action: RouterReplayAction) -> None:
        """Set this router's action (a :class:`RouterReplayAction`)."""
        if not isinstance(router_replay_action, RouterReplayAction):
            raise TypeError(f"router_replay_action must be a RouterReplayAction, got "
                            f"{router_replay_action!r}")
        self.router_replay_action = router_replay_action

    def clear_router_replay_action(self) -> None:
        """Route as usual."""
        self.router_replay_action = None

    def set_static_buffer(self, buffer: torch.Tensor) -> None:
        """Record into ``buffer[:T]`` (``[max_tokens, k]``, integer) instead of keeping a
        reference: the recorded tensor's address is then fixed (CUDA-graph capture)."""
        _check_indices(buffer, "buffer")
        self.static_buffer = buffer

    def clear_static_buffer(self) -> None:
        """Record by reference again."""
        self.static_buffer = None

    def record_indices(self, topk_indices: torch.Tensor) -> None:
        """Keep ``topk_indices`` ``[T, k]`` as the recorded choice (into the static buffer when
        one is set).

        Raises:
            ValueError: a static buffer with fewer rows than T or another k.
        """
        buffer = self.static_buffer
        if buffer is None:
            self.recorded_topk_idx = topk_indices
            return
        T, k = topk_indices.shape
        if buffer.shape[0] < T or buffer.shape[1] != k:
            raise ValueError(f"static buffer {tuple(buffer.shape)} cannot hold the indices "
                             f"[{T}, {k}] (needs >= {T} rows and {k} columns)")
        buffer[:T].copy_(topk_indices)
        self.recorded_topk_idx = buffer[:T]

    def replay_indices(self, num_tokens: int, topk: int,
                       device: torch.device) -> Optional[torch.Tensor]:
        """The indices this forward routes by: ``[num_tokens, topk]`` int64 on ``device`` for a
        replay action (REPLAY_BACKWARD takes the queue's first), None for RECORD or no action.

        Raises:
            ValueError: a replay action without indices, or indices of another shape.
        """
        action = self.router_replay_action
        if action is RouterReplayAction.REPLAY_FORWARD:
            indices = self.target_topk_idx
            if indices is None:
                raise ValueError("REPLAY_FORWARD without target indices: call "
                                 "set_target_indices (or RouterReplay.set_replay_data) first")
        elif action is RouterReplayAction.REPLAY_BACKWARD:
            if not self.replay_backward_list:
                raise ValueError("REPLAY_BACKWARD with an empty replay_backward_list: every "
                                 "replayed forward takes one set_target_indices")
            indices = self.replay_backward_list.pop(0)
        else:
            return None
        if tuple(indices.shape) != (num_tokens, topk):
            raise ValueError(f"replayed indices must be [num_tokens, topk] = [{num_tokens}, "
                             f"{topk}], got {tuple(indices.shape)}")
        return indices.to(device=device, dtype=torch.long, non_blocking=True)


def _check_indices(t: torch.Tensor, name: str) -> None:
    if not isinstance(t, torch.Tensor) or t.dtype.is_floating_point or t.dtype.is_complex \
            or t.dtype == torch.bool:
        got = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
        raise TypeError(f"{name} must be an integer tensor, got {got}")
    if t.dim() != 2:
        raise ValueError(f"{name} must be 2-D [tokens, topk], got {tuple(t.shape)}")


def routing_at_indices(logits: torch.Tensor, indices: torch.Tensor, use_pre_softmax: bool = False,
                       scaling_factor: Optional[float] = None, score_function: str = "softmax",
                       normalize: Optional[bool] = None):
    """The routing of ``topk_routing_with_score_function`` with the choice given: the probs the
    score function gives the experts ``indices`` names, normalised and scaled by the same rules
    (softmax-post: a softmax over the picked logits; softmax-pre: the full softmax's values;
    sigmoid / sqrtsoftplus: the picked scores, renormalised over them when topk > 1 or as
    ``normalize`` says). The math runs in fp32 (fp64 for fp64 logits), as the fused router's.

    Args:
        logits: ``[T, E]`` float, the router's logits.
        indices: ``[T, k]`` int64 on the logits' device, each in ``[0, E)`` (not checked on the
            host: that would be a device read).
        use_pre_softmax, scaling_factor, score_function, normalize: as ``router_topk``.

    Returns:
        ``(probs [T, E] in logits.dtype, zero off the choice, routing_map [T, E] bool)``;
        probs carry gradients to ``logits``.
    """
    if score_function not in SCORE_FUNCTIONS:
        raise ValueError(f"score_function must be one of {SCORE_FUNCTIONS}, got {score_function!r}")
    k = indices.shape[1]
    math = torch.float64 if logits.dtype == torch.float64 else torch.float32
    if score_function == "softmax":
        if use_pre_softmax:
            picked = torch.softmax(logits, dim=-1, dtype=math).gather(1, indices)
            renormalise = normalize is True
        else:
            picked = torch.softmax(logits.gather(1, indices), dim=-1, dtype=math)
            renormalise = False
    else:
        x = logits.to(math)
        scores = torch.sigmoid(x) if score_function == "sigmoid" else _sqrtsoftplus(x)
        picked = scores.gather(1, indices)
        renormalise = k > 1 if normalize is None else normalize
    if renormalise:
        picked = picked / (picked.sum(dim=-1, keepdim=True) + 1e-20)
    if scaling_factor:
        picked = picked * scaling_factor
    probs = torch.zeros_like(logits).scatter(1, indices, picked.to(logits.dtype))
    routing_map = torch.zeros(logits.shape, dtype=torch.bool, device=logits.device)
    routing_map = routing_map.scatter(1, indices, True)
    return probs, routing_map


def _sqrtsoftplus(x: torch.Tensor) -> torch.Tensor:
    """The sqrtsoftplus score: ``sqrt(softplus(x))``."""
    return torch.nn.functional.softplus(x).sqrt()
