"""global_aux_loss: the global-batch load-balancing loss and its running token-count buffer.

Megatron's "global_aux_loss" balances over the whole global batch rather than one micro-batch:
each micro-batch adds its (TP x DP x CP all-reduced) counts to a running buffer, the loss uses
the running average ``buffer / steps`` as ``tokens_per_expert``, and the buffer is zeroed once per
global batch (Megatron does it in ``finalize_model_grads``; here the training loop calls
:meth:`GlobalAuxLossBuffer.reset` at the same point).

Precision contract
------------------
* The buffer and the step count are fp32 device tensors, as Megatron's; the running average is
  ``buffer / steps`` in fp32. The loss is :func:`switch_load_balancing_loss_func`'s. No host sync.

State
-----
:class:`GlobalAuxLossBuffer` is an ``nn.Module`` whose counts are persistent buffers, so they are
in the router's ``state_dict()`` (``global_aux_buffer.tokens_per_expert``, ``.steps``): a
checkpoint taken in the middle of a global batch resumes with the same running average. Megatron
keeps them in non-persistent buffers, so its state dicts lack them: a load without them keeps the
current counts and does not report them missing.
"""
from typing import Optional

import torch
from torch import nn

from moe_core.ops._padding_mask import flat_padding_mask
from moe_core.ops.switch_aux_loss import (
    _masked,
    get_tokens_per_expert_and_token_count,
    switch_load_balancing_loss_func,
)


def apply_keeping_fp32_buffers(module: nn.Module, apply, fn, recurse: bool):
    """``nn.Module._apply`` for a module whose own buffers are fp32 running state (counts,
    biases): they follow ``fn``'s device but keep fp32 and their values when the model is cast
    to a half dtype. ``apply`` is the parent class's bound ``_apply``."""
    before = {n: b for n, b in module._buffers.items() if b is not None}
    apply(fn, recurse)
    for name, old in before.items():
        new = module._buffers[name]
        if new.dtype != torch.float32:
            module._buffers[name] = old.to(device=new.device)
    return module


class GlobalAuxLossBuffer(nn.Module):
    """Running per-expert token counts of the current global batch (one per router).

    Buffers (persistent, fp32 whatever dtype the model is cast to): ``tokens_per_expert``
    ``[num_experts]``, the summed counts, and ``steps`` ``[]``, the micro-batches added since the
    last :meth:`reset`.

    Args:
        num_experts: experts of the router.
        device: where the buffer lives (the router's device).
    """

    def __init__(self, num_experts: int, device=None):
        if not isinstance(num_experts, int) or isinstance(num_experts, bool) or num_experts < 1:
            raise ValueError(f"num_experts must be an int >= 1, got {num_experts!r}")
        super().__init__()
        self.register_buffer("tokens_per_expert",
                             torch.zeros(num_experts, dtype=torch.float32, device=device))
        self.register_buffer("steps", torch.zeros((), dtype=torch.float32, device=device))

    def update(self, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """Adds one micro-batch's counts; returns the running average ``[E]`` fp32."""
        with torch.no_grad():
            self.tokens_per_expert += tokens_per_expert
            self.steps += 1
            return self.tokens_per_expert / self.steps

    def reset(self) -> None:
        """Zeroes the buffer: call once per global batch (Megatron: finalize_model_grads)."""
        self.tokens_per_expert.zero_()
        self.steps.zero_()

    def _apply(self, fn, recurse: bool = True):
        # integer counts past 256 are not exact in bf16
        return apply_keeping_fp32_buffers(self, super()._apply, fn, recurse)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)
        # Megatron does not save these counts (non-persistent buffers): a state dict without
        # them (Megatron's, or one saved before they were persistent) keeps the current counts.
        for name in self._buffers:
            if prefix + name in missing_keys:
                missing_keys.remove(prefix + name)


def global_load_balancing_loss(
    scores: torch.Tensor,
    routing_map: torch.Tensor,
    topk: int,
    num_experts: int,
    moe_aux_loss_coeff: float,
    buffer: GlobalAuxLossBuffer,
    padding_mask: Optional[torch.Tensor] = None,
    reduce_group=None,
) -> torch.Tensor:
    """Global-batch aux loss ("global_aux_loss"): Megatron's ``_apply_global_aux_loss`` value.

    Args:
        scores, routing_map: ``[num_tokens, num_experts]`` from
            :func:`compute_routing_scores_for_aux_loss`.
        topk, num_experts, moe_aux_loss_coeff: as Megatron's config.
        buffer: this router's running counts; updated in place by this call.
        padding_mask: bool, ``num_tokens`` elements, True = padding, or None.
        reduce_group: Megatron's TP x DP x CP group (counts are summed over it), or None.

    Returns:
        A 0-d fp32 loss.
    """
    if not isinstance(buffer, GlobalAuxLossBuffer):
        raise TypeError(f"buffer must be a GlobalAuxLossBuffer, got {type(buffer).__name__}")
    mask = flat_padding_mask(padding_mask, scores.shape[0])
    scores, routing_map = _masked(scores, routing_map, mask)
    counts, _, total = get_tokens_per_expert_and_token_count(
        routing_map, reduce_group, topk, with_padding_mask=mask is not None
    )
    averaged = buffer.update(counts)
    return switch_load_balancing_loss_func(scores, averaged, total, topk, num_experts,
                                           moe_aux_loss_coeff)
