"""The padding mask as the ops take it: every op with a ``padding_mask`` argument flattens and
checks it here, before the C++ binding sees it.

A module of its own (importing no op) so that the router and the loss ops can both use it.
"""
from typing import Optional

import torch


def flat_padding_mask(padding_mask: Optional[torch.Tensor], num_tokens: int,
                      name: str = "padding_mask") -> Optional[torch.Tensor]:
    """A padding mask (True = padding) of any shape with ``num_tokens`` elements, as ``[T]``.

    Megatron's router receives ``[S, B]`` and flattens it the same way; the tokens of the logits
    are in that flattened order.
    """
    if padding_mask is None:
        return None
    if not isinstance(padding_mask, torch.Tensor):
        raise TypeError(f"{name} must be a bool tensor or None, got {type(padding_mask).__name__}")
    if padding_mask.dtype != torch.bool:
        raise TypeError(f"{name} must be a bool tensor (True = padding), got {padding_mask.dtype}")
    if padding_mask.numel() != num_tokens:
        raise ValueError(
            f"{name} must have num_tokens={num_tokens} elements, got shape "
            f"{tuple(padding_mask.shape)}"
        )
    return padding_mask.reshape(-1)
