"""The routing layout: what routing decided for the experts, as one value.

A :class:`RoutingLayout` holds the row order ``permute`` defines (every kept (token, expert) pair
is one row; rows grouped by expert ascending, tokens ascending inside an expert; padding rows
index -1) and the routing decision it came from. Every step of the data path after the router
reads it, and nothing else, to know where a token's rows are::

    layout = routing_layout(routing_map, probs, num_out_tokens)     permute's layout-only mode
    rows, layout = permute_tokens(x, routing_map, probs, num_out_tokens)    the rows in the same
                                                                    pass (permute's full mode)
    out = combine(y, layout)                                        each token's rows summed

The layer chooses which of the first two it calls from what the next step needs (the experts
that read rows by index need no rows; the all-to-all dispatcher sends rows), so the rows are made
at most once, in the pass that plans them.

Precision contract
------------------
Pure data movement and integer planning: ``routing_layout`` and ``permute_tokens`` give bitwise
``permute``'s outputs (the same kernels); ``combine`` is ``unpermute``. No host synchronisation:
the row count is a static bound, the used count stays in ``expert_offsets[-1]`` on the device.

A ``RoutingLayout`` is a ``NamedTuple`` of tensors, ints and bools, so ``torch.compile`` traces it
as a plain value (no graph break), and its integer fields stay symbolic under dynamic shapes.
"""
from typing import NamedTuple, Optional, Tuple, Union

import torch

from moe_core.ops.permute import permute, permute_layout
from moe_core.ops.unpermute import unpermute


class RoutingLayout(NamedTuple):
    """Where each token's rows are, in permute's row order (``R`` rows, ``E`` experts, ``T``
    tokens).

    Attributes:
        sorted_indices: ``[R]`` int64, the token of each row (-1: a padding row).
        expert_offsets: ``[E + 1]`` int64, expert ``e`` owns rows
            ``[expert_offsets[e], expert_offsets[e + 1])``; the last entry is the used row count
            (rows past it are padding of the static bound).
        tokens_per_expert: ``[E]`` int64, rows of each expert's block (padding included).
        row_probs: ``[R]`` the router prob of each row (``probs``' dtype; 0 on padding rows),
            or None when the layout was made without probs.
        routing_map: ``[T, E]`` bool, the routing decision the layout was made from.
        probs: ``[T, E]`` the router probs (the router dtype), or None.
        drop_and_pad: every expert's block holds ``num_out_tokens // E`` rows (Megatron's
            drop-and-pad layout), not its routed count.
        align_size: every block padded to a multiple of it (0 / 1: none).
    """

    sorted_indices: torch.Tensor
    expert_offsets: torch.Tensor
    tokens_per_expert: torch.Tensor
    row_probs: Optional[torch.Tensor]
    routing_map: torch.Tensor
    probs: Optional[torch.Tensor]
    drop_and_pad: bool = False
    align_size: int = 0

    @property
    def num_rows(self) -> Union[int, torch.SymInt]:
        """``R``: the rows of the layout's buffers (the static bound, padding included)."""
        return self.sorted_indices.shape[0]

    @property
    def num_tokens(self) -> Union[int, torch.SymInt]:
        """``T``: the tokens the layout routes."""
        return self.routing_map.shape[0]

    @property
    def num_experts(self) -> int:
        """``E``: the experts the rows are grouped by."""
        return self.routing_map.shape[1]


def routing_layout(routing_map: torch.Tensor, probs: Optional[torch.Tensor],
                   num_out_tokens: Union[int, torch.SymInt], drop_and_pad: bool = False,
                   align_size: int = 0) -> RoutingLayout:
    """The layout of ``routing_map`` without moving any token (permute's layout-only mode).

    Args:
        routing_map: ``[T, E]`` bool.
        probs: ``[T, E]`` float (the router dtype), or None. The layout's ``row_probs`` carry
            its gradient back to ``probs``.
        num_out_tokens, drop_and_pad, align_size: as for :func:`moe_core.ops.permute`.

    Returns:
        The :class:`RoutingLayout`; its tensors are bitwise those ``permute`` returns.
    """
    row_probs, sorted_indices, offsets, counts = permute_layout(
        routing_map, probs, num_out_tokens, drop_and_pad, align_size)
    return RoutingLayout(sorted_indices, offsets, counts, row_probs, routing_map, probs,
                         bool(drop_and_pad), int(align_size))


def permute_tokens(tokens: torch.Tensor, routing_map: torch.Tensor, probs: Optional[torch.Tensor],
                   num_out_tokens: Union[int, torch.SymInt], drop_and_pad: bool = False,
                   align_size: int = 0) -> Tuple[torch.Tensor, RoutingLayout]:
    """The tokens' rows and their layout, in one pass (permute's full mode: each token's row is
    read once and written to all of its rows).

    Args:
        tokens: ``[T, H]`` float.
        routing_map, probs, num_out_tokens, drop_and_pad, align_size: as for
            :func:`routing_layout`.

    Returns:
        ``(rows [R, H] tokens.dtype, layout)``; ``rows`` carries the gradient to ``tokens``,
        ``layout.row_probs`` the gradient to ``probs``.
    """
    rows, row_probs, sorted_indices, offsets, counts = permute(
        tokens, routing_map, probs, num_out_tokens=num_out_tokens, drop_and_pad=drop_and_pad,
        align_size=align_size)
    return rows, RoutingLayout(sorted_indices, offsets, counts, row_probs, routing_map, probs,
                               bool(drop_and_pad), int(align_size))


def combine(rows: torch.Tensor, layout: RoutingLayout,
            probs: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Each token's rows summed back into ``[T, H]``: ``unpermute``, a per-token gather-sum in
    ascending row order in fp32, no atomics.

    Args:
        rows: ``[R, H]`` float, in the layout's row order (the experts' outputs).
        layout: the :class:`RoutingLayout` the rows follow.
        probs: ``[T, E]`` float, or None: each row multiplied by its token's prob for its expert
            before the sum (the probs applied after the experts, as Hugging Face's experts do;
            Megatron's apply them inside the experts and combine without).

    Returns:
        ``[T, H]`` in ``rows.dtype``; a token without rows is zero.
    """
    shape = (layout.num_tokens, rows.shape[1])
    if probs is None:
        return unpermute(rows, layout.sorted_indices, restore_shape=shape)
    return unpermute(rows, layout.sorted_indices, restore_shape=shape, probs=probs,
                     pad_offsets=layout.expert_offsets)
