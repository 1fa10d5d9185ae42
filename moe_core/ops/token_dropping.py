"""Expert capacity: Megatron's ``get_capacity`` and ``apply_router_token_dropping``.

Precision contract
------------------
* ``get_capacity`` is Megatron's formula in Python floats: ``max(ceil(T / E * factor), min)``.
* ``apply_router_token_dropping`` is a selection plus ``final_probs = routing_probs * final_map``
  in the probs' dtype, so kept probs are bit for bit the inputs (NaN·0 stays NaN, as in torch).
  The backward is ``grad * final_map``. Deterministic; no host synchronisation (the capacity comes
  from the shapes).

Selection (per expert column, among all tokens): a stable descending sort of the key, keep the
first ``capacity``. Ties go to the lower token index. This defines what Megatron leaves to
``torch.topk``'s unspecified tie-breaking:

* ``"probs"``: the ``capacity`` largest probs (NaN ranks first, as in torch.topk); equal probs
  keep the lower token. With ``pad_to_capacity`` the filler tokens of a short column (prob 0) are
  the lowest unrouted token indices.
* ``"position"``: the first ``capacity`` routed tokens in ascending token order, which is what
  Megatron computes on CUDA. Megatron's own code on the CPU keeps a different, non-prefix set of
  routed tokens (torch.topk over equal int keys on the CPU does not prefer low indices): a
  deliberate difference. With ``pad_to_capacity`` a short column is filled with its first
  unrouted tokens.

Differences from Megatron, on purpose: ``capacity_factor < 0`` and ``num_experts < 1`` raise
``ValueError`` (Megatron fails later or divides by zero); the tie rules above.
"""
import math
from typing import Optional, Tuple

import torch

from moe_core.ops._guards import int64_checked, register_autograd, register_fake
from moe_core.ops.permute import _tracing

_OP = int64_checked(torch.ops.moe_core.token_dropping)
_BWD = int64_checked(torch.ops.moe_core.token_dropping_bwd)
DROP_POLICIES = ("probs", "position")


def get_capacity(
    num_tokens: int, num_experts: int, capacity_factor: float, min_capacity: Optional[int] = None
) -> int:
    """Capacity of each expert: ``max(ceil((num_tokens / num_experts) * capacity_factor),
    min_capacity)``, exactly Megatron's rounding (a Python float product, then ``math.ceil``).

    Args:
        num_tokens: tokens to place (the router passes ``T * topk``), ``>= 0``.
        num_experts: ``>= 1``.
        capacity_factor: finite, ``>= 0``.
        min_capacity: optional lower bound.

    Returns:
        The capacity, a Python int (no tensor, no host synchronisation).
    """
    if num_experts < 1:
        raise ValueError(f"num_experts must be >= 1, got {num_experts!r}")
    if num_tokens < 0:
        raise ValueError(f"num_tokens must be >= 0, got {num_tokens!r}")
    if not capacity_factor >= 0 or capacity_factor == math.inf:
        raise ValueError(f"capacity_factor must be a finite number >= 0, got {capacity_factor!r}")
    capacity = math.ceil((num_tokens / num_experts) * capacity_factor)
    if min_capacity is not None and capacity < min_capacity:
        capacity = min_capacity
    return capacity


def apply_router_token_dropping(
    routing_probs: torch.Tensor,
    routing_map: torch.Tensor,
    router_topk: int,
    capacity_factor: float,
    drop_policy: str = "probs",
    pad_to_capacity: bool = False,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Megatron's ``apply_router_token_dropping``: enforce each expert's capacity.

    The capacity is ``get_capacity(T * router_topk, E, capacity_factor)``; when it exceeds T
    nothing is dropped (and with padding every token is in every expert's map).

    Args:
        routing_probs: ``[num_tokens, num_experts]`` float (zero where not routed).
        routing_map: ``[num_tokens, num_experts]`` bool.
        router_topk: experts per token (only scales the capacity).
        capacity_factor: finite, ``>= 0``.
        drop_policy: ``"probs"`` or ``"position"`` (see the module docstring).
        pad_to_capacity: the map becomes the capacity mask (every column has ``capacity`` tokens
            when ``capacity <= T``); probs of filler tokens are zero.

    Returns:
        ``(final_probs [T, E] in routing_probs.dtype, final_map [T, E] bool)``; ``final_probs``
        carries gradients to ``routing_probs``.
    """
    if drop_policy not in DROP_POLICIES:
        raise ValueError(f"drop_policy must be one of {DROP_POLICIES}, got {drop_policy!r}")
    if not isinstance(routing_probs, torch.Tensor) or routing_probs.dim() != 2:
        shape = (tuple(routing_probs.shape) if isinstance(routing_probs, torch.Tensor)
                 else type(routing_probs).__name__)
        raise ValueError(f"routing_probs must be 2-D [num_tokens, num_experts], got {shape}")
    if isinstance(router_topk, bool) or not isinstance(router_topk, int) or router_topk < 1:
        raise ValueError(f"router_topk must be an int >= 1, got {router_topk!r}")
    num_tokens, num_experts = routing_probs.shape
    capacity = get_capacity(num_tokens * router_topk, num_experts, capacity_factor)
    # every capacity >= T keeps every token (the op's rule); a large factor's capacity (a Python
    # int) may not fit the op's int64 argument, T always does. The builtin min: dynamo traces it
    # on ints and SymInts alike, where some torch versions refuse torch.sym_min on two ints.
    capacity = min(capacity, num_tokens)
    # a capacity that may be symbolic (a dynamic token count) goes through the SymInt schema: the
    # C++ schema's int would pin the graph to the first token count
    op = _OP_SYMINT if _tracing(capacity) else _OP
    return op(routing_probs, routing_map, capacity, drop_policy, bool(pad_to_capacity))


@torch.library.custom_op("moe_core::token_dropping_symint", mutates_args=())
def token_dropping_symint(routing_probs: torch.Tensor, routing_map: torch.Tensor, capacity: int,
                          drop_policy: str, pad_to_capacity: bool
                          ) -> Tuple[torch.Tensor, torch.Tensor]:
    """``moe_core::token_dropping`` with ``capacity`` a ``SymInt`` in the schema (the op that
    dynamic-shape graphs record); at run time the capacity is a concrete int and the C++ op runs.

    Args:
        routing_probs: ``[num_tokens, num_experts]`` float.
        routing_map: ``[num_tokens, num_experts]`` bool.
        capacity: tokens kept per expert (an int, symbolic while tracing).
        drop_policy, pad_to_capacity: as :func:`apply_router_token_dropping`.

    Returns:
        ``(final_probs [T, E], final_map [T, E] bool)``.
    """
    return _OP(routing_probs, routing_map, capacity, drop_policy, pad_to_capacity)


_OP_SYMINT = int64_checked(torch.ops.moe_core.token_dropping_symint)


def _token_dropping_fake(routing_probs, routing_map, capacity, drop_policy, pad_to_capacity):
    return torch.empty_like(routing_probs), torch.empty_like(routing_map)


for _name in ("moe_core::token_dropping", "moe_core::token_dropping_symint"):
    register_fake(_name)(_token_dropping_fake)


@register_fake("moe_core::token_dropping_bwd")
def _(grad_final_probs, final_map):
    return torch.empty_like(grad_final_probs)


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(output[1])


def _backward(ctx, grad_final_probs, _grad_map):
    (final_map,) = ctx.saved_tensors
    return _BWD(grad_final_probs.contiguous(), final_map), None, None, None, None


for _name in ("moe_core::token_dropping", "moe_core::token_dropping_symint"):
    register_autograd(_name, _backward, setup_context=_setup_context)
