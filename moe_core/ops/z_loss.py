"""z_loss: the router z-loss of ST-MoE, ``coeff * mean_t(logsumexp(logits[t])**2)``.

Precision contract
------------------
* logsumexp, its square and the mean are computed in fp64 (tokens summed in ascending order)
  and rounded once: an fp32 scalar for fp32/fp16/bf16 logits, fp64 for fp64 logits. Megatron
  computes in the logits' dtype (bf16 logits give a bf16 loss there); ours is never less
  accurate, a deliberate difference.
* With a padding mask (True = padding): ``sum over unpadded / max(n_unpadded, 1) * coeff``;
  without one, the plain mean (NaN for zero tokens, as torch.mean).
* Backward: ``grad * coeff * 2 * lse_t * softmax(logits[t]) / n`` in the logits' dtype, zero on
  padded rows. Deterministic.
"""
from typing import Optional

import torch

from moe_core.ops._guards import int64_checked, register_autograd, register_fake
from moe_core.ops._padding_mask import flat_padding_mask

_OP = int64_checked(torch.ops.moe_core.z_loss)
_BWD = int64_checked(torch.ops.moe_core.z_loss_bwd)


def z_loss_func(logits: torch.Tensor, z_loss_coeff: float,
                padding_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Megatron's ``z_loss_func`` (same arguments).

    Args:
        logits: ``[num_tokens, num_experts]`` float.
        z_loss_coeff: the coefficient (Megatron's router passes ``moe_z_loss_coeff / |TP x CP|``).
        padding_mask: bool with ``num_tokens`` elements, True = padding, or None.

    Returns:
        A 0-d fp32 loss (fp64 for fp64 logits) with a gradient to ``logits``.
    """
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2:
        shape = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
        raise ValueError(f"logits must be 2-D [num_tokens, num_experts], got {shape}")
    return _OP(logits, float(z_loss_coeff), flat_padding_mask(padding_mask, logits.shape[0]))


@register_fake("moe_core::z_loss")
def _(logits, coeff, padding_mask):
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    return logits.new_empty((), dtype=dtype)


@register_fake("moe_core::z_loss_bwd")
def _(grad_loss, logits, coeff, padding_mask):
    return torch.empty_like(logits)


def _setup_context(ctx, inputs, output):
    logits, coeff, padding_mask = inputs
    ctx.coeff = coeff
    ctx.save_for_backward(logits, padding_mask)


def _backward(ctx, grad_loss):
    logits, padding_mask = ctx.saved_tensors
    return _BWD(grad_loss, logits, ctx.coeff, padding_mask), None, None


register_autograd("moe_core::z_loss", _backward, setup_context=_setup_context)
