"""sort_chunks_by_idxs: reorder row chunks (Megatron's ``sort_chunks_by_idxs``, used by EP).

Precision contract
------------------
A pure data movement: rows are copied bit for bit; the backward is the inverse move. The split
sizes are read where they live (the tensors' device), never with ``.tolist()``, so the op needs no
host synchronisation. ``split_sizes`` must sum to ``input.shape[0]`` and ``sorted_idxs`` must be a
permutation of the chunk ids (Megatron's EP always passes one). ``fused`` is ignored.
"""
from typing import Optional, Tuple

import torch

from moe_core.ops._guards import int64_checked, register_autograd, register_fake

_OP = int64_checked(torch.ops.moe_core.sort_chunks_by_idxs)
_BWD = int64_checked(torch.ops.moe_core.sort_chunks_by_idxs_bwd)


def _as_index(t, device, name: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        t = torch.as_tensor(t, dtype=torch.long)
    if t.device != device and t.device.type == "meta":
        # moving a meta tensor to a real device has no data to copy
        raise ValueError(f"{name} is on meta but input is on {device}: a meta tensor holds no "
                         f"values to sort by")
    if t.dtype != torch.long:
        if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
            raise TypeError(f"{name} must be an integer tensor, got {t.dtype}")
        t = t.long()
    return t.to(device)


def sort_chunks_by_idxs(
    input: torch.Tensor,
    split_sizes: torch.Tensor,
    sorted_idxs: torch.Tensor,
    probs: Optional[torch.Tensor] = None,
    fused: bool = False,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Split ``input`` (and ``probs``) into chunks along dim 0, concatenate in ``sorted_idxs`` order.

    Args:
        input: ``[rows, ...]`` any dtype.
        split_sizes: ``[num_chunks]`` integer, summing to ``rows``.
        sorted_idxs: ``[num_chunks]`` integer, a permutation of ``range(num_chunks)``.
        probs: ``[rows, ...]`` or None, moved the same way.
        fused: ignored.

    Returns:
        ``(output [rows, ...], permuted probs or None)``; both carry gradients.
    """
    del fused
    split_sizes = _as_index(split_sizes, input.device, "split_sizes")
    sorted_idxs = _as_index(sorted_idxs, input.device, "sorted_idxs")
    out = _OP(input, split_sizes, sorted_idxs)
    return out, (_OP(probs, split_sizes, sorted_idxs) if probs is not None else None)


@register_fake("moe_core::sort_chunks_by_idxs")
def _(input, split_sizes, sorted_idxs):
    return torch.empty_like(input)


@register_fake("moe_core::sort_chunks_by_idxs_bwd")
def _(grad_output, split_sizes, sorted_idxs):
    return torch.empty_like(grad_output)


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(inputs[1], inputs[2])


def _backward(ctx, grad_output):
    split_sizes, sorted_idxs = ctx.saved_tensors
    return _BWD(grad_output.contiguous(), split_sizes, sorted_idxs), None, None


register_autograd("moe_core::sort_chunks_by_idxs", _backward, setup_context=_setup_context)
