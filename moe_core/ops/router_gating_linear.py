"""router_gating_linear: the router's logits, ``inp · weightᵀ (+ bias)``, in the router dtype.

Precision contract
------------------
* ``inp`` (bf16/fp16/fp32/fp64) is saved for backward in its own dtype; each element is widened to
  ``router_dtype`` inside the kernel, so no upcast copy of the activations is ever stored.
* Sums run in a fixed order with an fp64 accumulator for fp32/fp64 router dtypes (fp32 for half
  router dtypes) and are rounded once to ``router_dtype``: bitwise deterministic, and at least as
  accurate as Megatron's ``torch.mm`` in the router dtype (it is compared within that GEMM's error).
* Backward (Megatron's RouterGatingLinearFunction): ``grad_inp = (g · W).to(inp.dtype)``,
  ``grad_weight = (gᵀ · inp).to(weight.dtype)``, ``grad_bias = Σ_t g`` cast to ``weight.dtype``,
  all computed from ``g`` in the router dtype.
"""
from typing import Optional

import torch

from moe_core.ops._guards import int64_checked, register_autograd, register_fake

_OP = int64_checked(torch.ops.moe_core.router_gating_linear)
_BWD = int64_checked(torch.ops.moe_core.router_gating_linear_bwd)


def router_gating_linear(
    inp: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    router_dtype: torch.dtype,
) -> torch.Tensor:
    """Router logits in ``router_dtype``.

    Args:
        inp: ``[..., hidden]``, float dtype.
        weight: ``[num_experts, hidden]``, float dtype.
        bias: ``[num_experts]`` in ``weight.dtype``, or None.
        router_dtype: dtype of the logits and of the math (torch.float32 or torch.float64 as in
            Megatron's ``moe_router_dtype``; half dtypes are accepted too).

    Returns:
        logits ``[..., num_experts]`` in ``router_dtype``.
    """
    if not isinstance(inp, torch.Tensor) or inp.dim() < 1:
        raise ValueError(f"inp must be a tensor of shape [..., hidden], got {type(inp).__name__}"
                         + (f" of shape {tuple(inp.shape)}" if isinstance(inp, torch.Tensor) else ""))
    if inp.shape[-1] == 0:
        raise ValueError(f"inp has hidden size 0 (shape {tuple(inp.shape)}): the router needs "
                         f"hidden >= 1")
    lead = inp.shape[:-1]
    logits = _OP(inp.reshape(-1, inp.shape[-1]), weight, bias, router_dtype)
    return logits.reshape(*lead, weight.shape[0])


@register_fake("moe_core::router_gating_linear")
def _(inp, weight, bias, router_dtype):
    return inp.new_empty((inp.shape[0], weight.shape[0]), dtype=router_dtype)


@register_fake("moe_core::router_gating_linear_bwd")
def _(grad_logits, inp, weight):
    return torch.empty_like(inp), torch.empty_like(weight), weight.new_empty((weight.shape[0],))


def _setup_context(ctx, inputs, output):
    inp, weight, bias, _router_dtype = inputs
    ctx.has_bias = bias is not None
    ctx.save_for_backward(inp, weight)


def _backward(ctx, grad_logits):
    inp, weight = ctx.saved_tensors
    grad_inp, grad_weight, grad_bias = _BWD(grad_logits, inp, weight)
    return grad_inp, grad_weight, (grad_bias if ctx.has_bias else None), None


register_autograd("moe_core::router_gating_linear", _backward, setup_context=_setup_context)
