"""Torch references of glu_probs (the gated activation, then the router-probs multiply), shared by
tests/experts/test_glu_probs.py and tests/fuzz/test_fuzz_experts_losses.py.

``reference`` is the unfused sequence the op replaces (moe_core.experts.apply_activation, then
(h * p).to(h.dtype)). With scalar=True the activation is fed a strided (non-contiguous) view, which
sends torch's CPU kernels down their scalar path (libm's exp/erf/tanh, like our C): the op must
equal that bit for bit. With scalar=False it runs as the layer would (vectorised kernels).
"""
import functools
import math

import torch
import torch.nn.functional as F

from moe_core import MoEConfig
from moe_core.experts import apply_activation
from moe_core.ops import ACTIVATIONS

ACTS = list(ACTIVATIONS)


def strided(x: torch.Tensor) -> torch.Tensor:
    """x's values in a non-contiguous view (last-dim stride 2), differentiable."""
    buf = x.new_empty(*x.shape[:-1], 2 * x.shape[-1])
    return buf[..., ::2].copy_(x) if not x.requires_grad else \
        torch.as_strided(buf, x.shape, (buf.stride(0), 2)).copy_(x)


def act_fn(name: str, scalar: bool):
    base = {"silu": F.silu, "gelu": F.gelu, "gelu_tanh": functools.partial(F.gelu, approximate="tanh"),
            "relu": F.relu, "squared_relu": lambda x: torch.pow(F.relu(x), 2)}
    wrap = strided if scalar else (lambda x: x)
    if name == "quick_gelu":
        return lambda x: x * torch.sigmoid(wrap(1.702 * x))
    return lambda x: base[name](wrap(x))


def reference(a, probs, act, gated, offset=0.0, clamp=None, scalar=True):
    """The unfused torch sequence (Megatron's MLP activation, then the probs multiply)."""
    cfg = MoEConfig(hidden_size=8, num_moe_experts=2, moe_router_topk=2, gated_linear_unit=gated,
                    activation_func=act_fn(act, scalar), glu_linear_offset=offset,
                    activation_func_clamp_value=clamp)
    h = apply_activation(cfg, a)
    return h if probs is None else (h * probs.unsqueeze(-1)).to(h.dtype)


def autograd_grads(a, probs, dy, act, gated, offset, clamp, scalar=True):
    """The gradients of a and probs (None without probs) of reference(...).backward(dy)."""
    aa = a.clone().requires_grad_()
    pp = None if probs is None else probs.clone().requires_grad_()
    reference(aa, pp, act, gated, offset, clamp, scalar=scalar).backward(dy)
    return aa.grad, None if pp is None else pp.grad


def grad_probs_truth(a, probs, dy, act, gated, offset, clamp):
    """Σ_f of the product-dtype-rounded terms grad_h·h0, summed exactly (fsum) in fp64."""
    h0 = reference(a, None, act, gated, offset, clamp)
    pt = torch.promote_types(a.dtype, probs.dtype)
    terms = (dy.to(pt) * h0).double()
    return torch.tensor([math.fsum(r) for r in terms.tolist()], dtype=torch.float64), terms


def off_rounded_clamp(a: torch.Tensor, clamp) -> torch.Tensor:
    """a with the values whose magnitude is exactly dtype(clamp) moved to 0.5 (the one input
    where torch versions disagree on the clamp's gradient, and where the fp64 truth, whose bound
    is not rounded, disagrees with every dtype; test_clamp_boundaries in
    tests/experts/test_glu_probs.py covers it)."""
    if clamp is None:
        return a
    v = float(torch.tensor(clamp, dtype=a.dtype))  # compared as a Python float: no dtype cast
    return torch.where(a.abs().double() == v, torch.full_like(a, 0.5), a)
