"""permute_bwd_accumulate_: permute's backward (the tokens' gradient) one chunk of rows at a time.

``permute_bwd`` turns the rows' gradient ``[R, H]`` into the tokens' gradient ``[T, H]``: each
token's rows summed in ascending row order in fp32, rounded once. An expert MLP whose backward
makes the rows' gradient in row chunks ``[lo, hi)`` can add each chunk into an fp32 accumulator
as it goes, so the ``[R, H]`` buffer never exists whole::

    acc = permute_bwd_accumulator(T, H, device)            # fp32 zeros
    for lo, hi in chunks:                                    # ascending, covering [0, R)
        permute_bwd_accumulate_(acc, grad_rows[lo:hi], sorted_indices, lo)
    grad_tokens = acc.to(dtype)                              # == permute_bwd(grad_rows)[0]

Precision contract
------------------
For every row ``r`` of the chunk with token ``t = sorted_indices[r] >= 0``, in ascending ``r``::

    acc[t] = acc[t] + grad_rows_chunk[r - row_lo].float()    (one fp32 add, never fused)

``permute_bwd`` starts each token's fp32 sum at +0.0 and adds all of its rows in ascending order
(CPU and CUDA alike), so an accumulator that starts at +0.0 (:func:`permute_bwd_accumulator`:
zeros, not -0.0) and receives the chunks in ascending row order, however they are split (empty
chunks included), holds exactly that sum. ``acc.to(dtype)`` (round to nearest even) is then
bitwise ``permute_bwd``'s ``grad_tokens`` for bf16, fp16 and fp32, tokens without rows included
(+0.0 on both sides). The one exception: a NaN sum is NaN on both sides, but torch's cast may
canonicalise its payload and sign where ``permute_bwd`` keeps them. Deterministic, no atomics on
data, no host synchronisation; CPU and CUDA give the same bits.

``sorted_indices`` is the whole layout as ``permute`` returns it (``-1``: padding row, skipped);
only the chunk's entries are read. An entry outside ``[-1, T)`` raises on the CPU (as
``permute_bwd``) and is skipped on CUDA (which cannot check without a host sync).
"""
from typing import Optional, Union

import torch

from moe_core.ops._guards import int64_checked, register_fake

_OP = int64_checked(torch.ops.moe_core.permute_bwd_accumulate_)


def permute_bwd_accumulator(num_tokens: int, hidden: int,
                            device: Optional[Union[str, torch.device]] = None) -> torch.Tensor:
    """The accumulator :func:`permute_bwd_accumulate_` adds into, correctly initialised.

    Args:
        num_tokens: ``T``, tokens of the forward input.
        hidden: ``H``.
        device: the device of the rows' gradient.

    Returns:
        ``[num_tokens, hidden]`` fp32 zeros (+0.0: ``permute_bwd``'s sums start there).
    """
    return torch.zeros((num_tokens, hidden), dtype=torch.float32, device=device)


def permute_bwd_accumulate_(acc: torch.Tensor, grad_rows_chunk: torch.Tensor,
                            sorted_indices: torch.Tensor, row_lo: int) -> None:
    """Add the rows' gradient of rows ``[row_lo, row_lo + n)`` into the tokens' accumulator.

    Args:
        acc: ``[T, H]`` fp32, contiguous, updated in place. Start it with
            :func:`permute_bwd_accumulator` (zeros) and read the result as ``acc.to(dtype)``.
        grad_rows_chunk: ``[n, H]`` bf16, fp16 or fp32 (n may be 0): the rows' gradient of rows
            ``[row_lo, row_lo + n)``.
        sorted_indices: ``[R]`` int64, ``permute``'s (the whole layout; -1: padding row).
        row_lo: first row of the chunk, ``0 <= row_lo`` and ``row_lo + n <= R``.

    Chunks must be added in ascending row order for the result to equal ``permute_bwd``'s bits.
    Not differentiable (a backward helper). Raises ValueError naming the argument for a bad
    dtype, shape, device or row range.
    """
    _OP(acc, grad_rows_chunk, sorted_indices, row_lo)


@register_fake("moe_core::permute_bwd_accumulate_")
def _(acc, grad_rows_chunk, sorted_indices, row_lo):
    return None
