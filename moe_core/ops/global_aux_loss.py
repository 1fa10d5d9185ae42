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
"""
from typing import Optional

import torch

from moe_core.ops.aux_loss_scores import flat_padding_mask
from moe_core.ops.switch_aux_loss import (
    _masked,
    get_tokens_per_expert_and_token_count,
    switch_load_balancing_loss_func,
)


class GlobalAuxLossBuffer:
    """Running per-expert token counts of the current global batch (one per router).

    Args:
        num_experts: experts of the router.
        device: where the buffer lives (the router's device).
    """

    def __init__(self, num_experts: int, device=None):
        if not isinstance(num_experts, int) or isinstance(num_experts, bool) or num_experts < 1:
            raise ValueError(f"num_experts must be an int >= 1, got {num_experts!r}")
        self.tokens_per_expert = torch.zeros(num_experts, dtype=torch.float32, device=device)
        self.steps = torch.zeros((), dtype=torch.float32, device=device)

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

    def state_dict(self) -> dict:
        return {"tokens_per_expert": self.tokens_per_expert, "steps": self.steps}


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
