"""permute: tokens → rows grouped by expert (Megatron's ``permute``), with counts and offsets.

Precision contract
------------------
A pure data movement: rows and probs are copied bit for bit. Row order is Megatron's: experts in
ascending id, tokens ascending within an expert; the drop-and-pad layout ``[E * capacity]`` takes
each expert's first ``capacity`` tokens of a stable descending sort of its map column (routed
tokens ascending, then unrouted ones), exactly as Megatron. The backward sums each token's row
gradients in ascending row order in fp32 (fp64 for fp64) and rounds once: bitwise Megatron's for
up to two rows per token, deterministic always. No host synchronisation: the row count is a
static bound from the arguments; the used count lives in ``expert_offsets[-1]`` on the device.

Returns Megatron's 5-tuple ``(permuted_tokens, permuted_probs, sorted_indices, pad_offsets,
tokens_per_expert)``, with these deliberate differences:

* the 4th output is always ``expert_offsets`` ``[E + 1]`` int64 (block starts; the last entry is
  the used row count), and the 5th is always ``tokens_per_expert`` ``[E]`` int64 (rows of each
  block, padding included), both computed here on the tokens' device for the grouped GEMM.
  Megatron returns ``None`` and the ``tokens_per_expert`` it was given; that argument is ignored.
* ``num_out_tokens`` is a row *bound*: when the map has fewer routed pairs (capacity dropping
  without padding, buffers sized ``T * topk``), the rows past the used count are zero and their
  ``sorted_indices`` are -1 (Megatron fills them with unrouted tokens and needs the exact count,
  a host sync). When it has more, the rows past the bound are cut off, as in Megatron.
* ``align_size > 1`` pads every expert block with zero rows (index -1) to a multiple of
  ``align_size`` (Megatron does this only in its fused TE kernel); the buffer then has
  ``num_out_tokens + E * (align_size - 1)`` rows. Pass ``expert_offsets`` to ``unpermute`` as
  ``pad_offsets`` when combining with probs.
* ``drop_and_pad`` with ``capacity > T`` (Megatron crashes): each block holds all T tokens then
  ``capacity - T`` zero rows with index -1.
* ``fused`` is accepted and ignored (this is the fused kernel). ``num_out_tokens`` is required, as
  in Megatron's unfused path.

Dynamic shapes
--------------
The C++ schemas take the row bound and the token count as ``int``, which the tracer specialises
to one value. While tracing (``torch.compile``, where dynamo shows a symbolic size to Python as a
plain ``int``, or any ``torch.SymInt`` size), the calls go through ``permute_symint`` /
``permute_bwd_symint`` (``permute_layout_symint`` / ``permute_layout_bwd_symint`` for
:func:`permute_layout`): Python-defined ops with a ``SymInt`` in that place that run the same C++
kernels, so with a dynamic token dimension one graph serves every token count. Eager calls run the
C++ ops directly, as before.

:func:`permute_layout` is permute without the rows (the C core's layout-only mode): the same
indices, offsets, counts and row probs, for callers that read the tokens by index themselves.
"""
from typing import Optional, Tuple, Union

import torch

from moe_core.ops._guards import int64_checked, register_autograd, register_fake

_OP = int64_checked(torch.ops.moe_core.permute)
_BWD = int64_checked(torch.ops.moe_core.permute_bwd)


def num_permuted_rows(num_experts: int, num_out_tokens: Union[int, torch.SymInt],
                      drop_and_pad: bool = False,
                      align_size: int = 0) -> Union[int, torch.SymInt]:
    """Rows of permute's output buffer (the static bound), as ``moe_permute_num_rows`` in C.

    Integer arithmetic only, so a symbolic ``num_out_tokens`` gives a symbolic row count."""
    if drop_and_pad:
        block = num_out_tokens // num_experts
        if align_size > 1:
            block = (block + align_size - 1) // align_size * align_size
        return num_experts * block
    return num_out_tokens + (num_experts * (align_size - 1) if align_size > 1 else 0)


def _tracing(size: Union[int, torch.SymInt]) -> bool:
    """Whether ``size`` may be symbolic: under dynamo (which presents a SymInt to Python code as
    an ``int``, so ``isinstance`` cannot tell) or when it is a ``torch.SymInt`` (make_fx, AOT
    autograd tracing the backward)."""
    return torch.compiler.is_compiling() or isinstance(size, torch.SymInt)


def permute(
    tokens: torch.Tensor,
    routing_map: torch.Tensor,
    probs: Optional[torch.Tensor] = None,
    num_out_tokens: Optional[int] = None,
    fused: bool = False,
    drop_and_pad: bool = False,
    tokens_per_expert: Optional[torch.Tensor] = None,
    align_size: int = 0,
) -> Tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group the tokens' rows by expert.

    Args:
        tokens: ``[num_tokens, hidden]`` float.
        routing_map: ``[num_tokens, num_experts]`` bool.
        probs: ``[num_tokens, num_experts]`` float, or None.
        num_out_tokens: dropless: the row bound (``num_tokens * topk``, or the exact routed count);
            drop_and_pad: ``num_experts * capacity``. A Python int, or a ``torch.SymInt`` while
            tracing with dynamic shapes (a 0-d tensor is accepted and read with ``int()``, a host
            sync, as Megatron does).
        fused: ignored.
        drop_and_pad: the ``[E * capacity]`` layout, ``capacity = num_out_tokens // E``.
        tokens_per_expert: ignored (the counts are computed and returned).
        align_size: 0/1 for none, else pad each expert block to a multiple of it.

    Returns:
        ``(permuted_tokens [R, hidden] tokens.dtype, permuted_probs [R] probs.dtype or None,
        sorted_indices [R] int64 (-1: padding row), expert_offsets [E + 1] int64,
        tokens_per_expert [E] int64)`` with ``R = num_permuted_rows(...)``.
    """
    del fused, tokens_per_expert
    num_out_tokens, symbolic = _row_bound(num_out_tokens, align_size)
    op = _OP_SYMINT if symbolic else _OP
    pt, pp, idx, offsets, counts = op(tokens, routing_map, probs, num_out_tokens,
                                      bool(drop_and_pad), align_size)
    return pt, (pp if probs is not None else None), idx, offsets, counts


def _row_bound(num_out_tokens: Union[int, torch.SymInt, torch.Tensor, None],
               align_size: int) -> Tuple[Union[int, torch.SymInt], bool]:
    """The argument checks of :func:`permute` and :func:`permute_layout`: ``num_out_tokens`` is
    required, ``align_size`` an int >= 0 (the C++ op checks the rest). Returns the bound as the op
    takes it (a 0-d tensor read with ``int()``) and whether it may be symbolic, which needs the
    ``SymInt`` schema of the ``*_symint`` op: the C++ schema's int would pin the graph to the
    first token count."""
    if num_out_tokens is None:
        raise ValueError("num_out_tokens is required (as in Megatron's argsort-based permute): "
                         "pass num_tokens * topk for dropless routing, E * capacity with "
                         "drop_and_pad")
    if isinstance(align_size, bool) or not isinstance(align_size, int) or align_size < 0:
        raise ValueError(f"align_size must be an int >= 0, got {align_size!r}")
    if isinstance(num_out_tokens, torch.Tensor):
        num_out_tokens = int(num_out_tokens)  # a host read, as Megatron's
    if _tracing(num_out_tokens):
        return num_out_tokens, True
    return int(num_out_tokens), False


@torch.library.custom_op("moe_core::permute_symint", mutates_args=())
def permute_symint(tokens: torch.Tensor, routing_map: torch.Tensor, probs: Optional[torch.Tensor],
                   num_out_tokens: int, drop_and_pad: bool, align_size: int
                   ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``moe_core::permute`` with ``num_out_tokens`` a ``SymInt`` in the schema (the op that
    dynamic-shape graphs record). Same arguments, outputs and kernels: at run time the bound is
    a concrete int and the C++ op runs.

    Args:
        tokens: ``[num_tokens, hidden]`` float.
        routing_map: ``[num_tokens, num_experts]`` bool.
        probs: ``[num_tokens, num_experts]`` float, or None.
        num_out_tokens: the row bound (an int, symbolic while tracing).
        drop_and_pad, align_size: as :func:`permute`.

    Returns:
        ``(permuted_tokens [R, hidden], permuted_probs [R] or [0] without probs,
        sorted_indices [R] int64, expert_offsets [E + 1] int64, tokens_per_expert [E] int64)``.
    """
    return _OP(tokens, routing_map, probs, num_out_tokens, drop_and_pad, align_size)


@torch.library.custom_op("moe_core::permute_bwd_symint", mutates_args=())
def permute_bwd_symint(grad_permuted_tokens: torch.Tensor,
                       grad_permuted_probs: Optional[torch.Tensor],
                       sorted_indices: torch.Tensor, expert_offsets: torch.Tensor,
                       num_tokens: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """``moe_core::permute_bwd`` with ``num_tokens`` a ``SymInt`` in the schema.

    Args:
        grad_permuted_tokens: ``[R, hidden]`` float.
        grad_permuted_probs: ``[R]`` float, or None.
        sorted_indices: ``[R]`` int64, permute's.
        expert_offsets: ``[E + 1]`` int64, permute's.
        num_tokens: tokens of the forward input (an int, symbolic while tracing).

    Returns:
        ``(grad_tokens [num_tokens, hidden], grad_probs [num_tokens, E] or [0] without probs)``.
    """
    return _BWD(grad_permuted_tokens, grad_permuted_probs, sorted_indices, expert_offsets,
                num_tokens)


def _permute_fake(tokens, routing_map, probs, num_out_tokens, drop_and_pad, align_size):
    # the layout's outputs, and the rows of the tokens' width and dtype beside them
    pp, idx, offsets, counts = _permute_layout_fake(routing_map, probs, num_out_tokens,
                                                    drop_and_pad, align_size)
    if probs is None:
        pp = tokens.new_empty((0,))
    return tokens.new_empty((idx.shape[0], tokens.shape[1])), pp, idx, offsets, counts


def _permute_bwd_fake(grad_permuted_tokens, grad_permuted_probs, sorted_indices, expert_offsets,
                      num_tokens):
    grad_tokens = grad_permuted_tokens.new_empty((num_tokens, grad_permuted_tokens.shape[1]))
    if grad_permuted_probs is None:
        return grad_tokens, grad_permuted_tokens.new_empty((0,))
    return grad_tokens, grad_permuted_probs.new_empty((num_tokens, expert_offsets.shape[0] - 1))


_OP_SYMINT = int64_checked(torch.ops.moe_core.permute_symint)
_BWD_SYMINT = int64_checked(torch.ops.moe_core.permute_bwd_symint)


def _register_fake(fake, *names: str) -> None:
    """One fake kernel for an op and its ``_symint`` twin (the same outputs)."""
    for name in names:
        register_fake(name)(fake)


_register_fake(_permute_fake, "moe_core::permute", "moe_core::permute_symint")
_register_fake(_permute_bwd_fake, "moe_core::permute_bwd", "moe_core::permute_bwd_symint")


def _setup_context(ctx, inputs, output):
    tokens, _map, probs, _n, _dap, _align = inputs
    ctx.num_tokens = tokens.shape[0]
    ctx.has_probs = probs is not None
    ctx.save_for_backward(output[2], output[3])


def _backward(ctx, grad_tokens, grad_probs, _gi, _go, _gc):
    sorted_indices, expert_offsets = ctx.saved_tensors
    want_probs = ctx.has_probs and ctx.needs_input_grad[2]
    grad_probs = grad_probs.contiguous() if grad_probs is not None and want_probs else None
    if grad_tokens is None:  # the rows unused (ops/_guards.py): the probs' gradient alone
        if grad_probs is None:
            return None, None, None, None, None, None
        return None, None, _probs_grad(grad_probs, sorted_indices, expert_offsets,
                                       ctx.num_tokens), None, None, None
    # a symbolic token count (dynamic-shape tracing) needs the SymInt schema, as in the forward
    bwd = _BWD_SYMINT if _tracing(ctx.num_tokens) else _BWD
    g_tokens, g_probs = bwd(grad_tokens.contiguous(), grad_probs, sorted_indices,
                            expert_offsets, ctx.num_tokens)
    return g_tokens, None, (g_probs if grad_probs is not None else None), None, None, None


for _name in ("moe_core::permute", "moe_core::permute_symint"):
    register_autograd(_name, _backward, setup_context=_setup_context)


# ---- permute_layout: the layout alone ------------------------------------------------------------

_LAYOUT = int64_checked(torch.ops.moe_core.permute_layout)
_LAYOUT_BWD = int64_checked(torch.ops.moe_core.permute_layout_bwd)


def permute_layout(
    routing_map: torch.Tensor,
    probs: Optional[torch.Tensor] = None,
    num_out_tokens: Optional[int] = None,
    drop_and_pad: bool = False,
    align_size: int = 0,
) -> Tuple[Optional[torch.Tensor], torch.Tensor, torch.Tensor, torch.Tensor]:
    """The layout :func:`permute` would make, without moving any row: each row's prob, its
    source token, the experts' block starts and block sizes, bitwise permute's.

    For callers that read the tokens' rows by index themselves (a gathered grouped GEMM): the
    C core runs permute's plan and index pass and no data pass. The gradient flows to ``probs``
    only, bitwise permute's.

    Args:
        routing_map: ``[num_tokens, num_experts]`` bool.
        probs: ``[num_tokens, num_experts]`` float, or None.
        num_out_tokens: the row bound, as :func:`permute` (an int, a ``torch.SymInt`` while
            tracing, or a 0-d tensor read with ``int()``).
        drop_and_pad: the ``[E * capacity]`` layout, ``capacity = num_out_tokens // E``.
        align_size: 0/1 for none, else pad each expert block to a multiple of it.

    Returns:
        ``(row_probs [R] probs.dtype or None, sorted_indices [R] int64 (-1: padding row),
        expert_offsets [E + 1] int64, tokens_per_expert [E] int64)`` with
        ``R = num_permuted_rows(...)``, on the map's device.
    """
    num_out_tokens, symbolic = _row_bound(num_out_tokens, align_size)
    op = _LAYOUT_SYMINT if symbolic else _LAYOUT
    pp, idx, offsets, counts = op(routing_map, probs, num_out_tokens, bool(drop_and_pad),
                                  align_size)
    return (pp if probs is not None else None), idx, offsets, counts


@torch.library.custom_op("moe_core::permute_layout_symint", mutates_args=())
def permute_layout_symint(routing_map: torch.Tensor, probs: Optional[torch.Tensor],
                          num_out_tokens: int, drop_and_pad: bool, align_size: int
                          ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``moe_core::permute_layout`` with ``num_out_tokens`` a ``SymInt`` in the schema (the op
    that dynamic-shape graphs record). Same arguments, outputs and kernels.

    Args:
        routing_map: ``[num_tokens, num_experts]`` bool.
        probs: ``[num_tokens, num_experts]`` float, or None.
        num_out_tokens: the row bound (an int, symbolic while tracing).
        drop_and_pad, align_size: as :func:`permute_layout`.

    Returns:
        ``(permuted_probs [R] probs.dtype, or fp32 [0] without probs, sorted_indices [R] int64,
        expert_offsets [E + 1] int64, tokens_per_expert [E] int64)``.
    """
    return _LAYOUT(routing_map, probs, num_out_tokens, drop_and_pad, align_size)


@torch.library.custom_op("moe_core::permute_layout_bwd_symint", mutates_args=())
def permute_layout_bwd_symint(grad_permuted_probs: torch.Tensor, sorted_indices: torch.Tensor,
                              expert_offsets: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """``moe_core::permute_layout_bwd`` with ``num_tokens`` a ``SymInt`` in the schema.

    Args:
        grad_permuted_probs: ``[R]`` float.
        sorted_indices: ``[R]`` int64, permute_layout's.
        expert_offsets: ``[E + 1]`` int64, permute_layout's.
        num_tokens: tokens of the forward's map (an int, symbolic while tracing).

    Returns:
        ``grad_probs [num_tokens, E]`` grad_permuted_probs.dtype.
    """
    return _LAYOUT_BWD(grad_permuted_probs, sorted_indices, expert_offsets, num_tokens)


def _permute_layout_fake(routing_map, probs, num_out_tokens, drop_and_pad, align_size):
    # sizes from the input shapes and the (possibly symbolic) bound, never int() of them
    E = routing_map.shape[1]
    R = num_permuted_rows(E, num_out_tokens, drop_and_pad, align_size)
    pp = (probs.new_empty((R,)) if probs is not None
          else routing_map.new_empty((0,), dtype=torch.float32))
    return (pp, routing_map.new_empty((R,), dtype=torch.long),
            routing_map.new_empty((E + 1,), dtype=torch.long),
            routing_map.new_empty((E,), dtype=torch.long))


def _permute_layout_bwd_fake(grad_permuted_probs, sorted_indices, expert_offsets, num_tokens):
    return grad_permuted_probs.new_empty((num_tokens, expert_offsets.shape[0] - 1))


_LAYOUT_SYMINT = int64_checked(torch.ops.moe_core.permute_layout_symint)
_LAYOUT_BWD_SYMINT = int64_checked(torch.ops.moe_core.permute_layout_bwd_symint)
_register_fake(_permute_layout_fake, "moe_core::permute_layout", "moe_core::permute_layout_symint")
_register_fake(_permute_layout_bwd_fake, "moe_core::permute_layout_bwd",
               "moe_core::permute_layout_bwd_symint")


def _layout_setup_context(ctx, inputs, output):
    routing_map, probs, _n, _dap, _align = inputs
    ctx.num_tokens = routing_map.shape[0]
    ctx.has_probs = probs is not None
    ctx.save_for_backward(output[1], output[2])


def _layout_backward(ctx, grad_probs, _gi, _go, _gc):
    if grad_probs is None or not (ctx.has_probs and ctx.needs_input_grad[1]):
        return None, None, None, None, None
    sorted_indices, expert_offsets = ctx.saved_tensors
    return (None, _probs_grad(grad_probs.contiguous(), sorted_indices, expert_offsets,
                              ctx.num_tokens), None, None, None)


def _probs_grad(grad_row_probs: torch.Tensor, sorted_indices: torch.Tensor,
                expert_offsets: torch.Tensor, num_tokens) -> torch.Tensor:
    """``[T, E]``: the row probs' gradient scattered back to the probs (permute's layout-only
    backward, no rows); bitwise the probs part of ``permute_bwd``."""
    # a symbolic token count (dynamic-shape tracing) needs the SymInt schema, as in the forward
    bwd = _LAYOUT_BWD_SYMINT if _tracing(num_tokens) else _LAYOUT_BWD
    return bwd(grad_row_probs, sorted_indices, expert_offsets, num_tokens)


for _name in ("moe_core::permute_layout", "moe_core::permute_layout_symint"):
    register_autograd(_name, _layout_backward, setup_context=_layout_setup_context)
