"""glu_probs: the experts' activation (GLU-aware) and the router-probs multiply in one pass.

Precision contract
------------------
The result is Megatron's unfused sequence, evaluated as PyTorch's eager ops do it::

    g, l = a.chunk(2, -1)                                   (gated_linear_unit; else g = a;
                                                             interleaved: blocks of s, below)
    g, l = g.clamp(max=v), l.clamp(-v, v)                   (clamp_value v, GLU only)
    h0 = act(g) * (l + linear_offset)                       (GLU; else h0 = act(g))
    h = (h0 * probs.unsqueeze(-1)).to(a.dtype)              (probs given)

with every intermediate rounded to its tensor's dtype where that sequence rounds it (act(g),
l + offset, the product; then h0 * p in ``promote(a.dtype, probs.dtype)`` and the cast back).

* CPU: bit for bit equal to that sequence run through torch's scalar CPU kernels (libm's
  exp/erf/tanh) in every dtype, forward and backward. torch's own *vectorised* CPU kernels use
  SLEEF for exp/erf/tanh, which can differ from libm by one fp32/fp64 ulp before rounding (so the
  same torch op gives position-dependent results in fp32); in bf16/fp16 the rounding absorbs it
  for every input the tests enumerate, and ReLU / squared ReLU have no transcendental at all.
* grad_a follows autograd's graph of the sequence exactly (MulBackward, the activation's backward
  kernel, ClampBackward's masks). The masks are torch 2.14's: an input equal to the clamp bound
  rounded to its dtype (e.g. bf16(2.01) = 2.015625) gets no gradient; torch 2.11 passed it there.
  That one input per bound is the only place the versions, and so the op and torch 2.11, differ. grad_probs[r] = Σ_f grad_h·h0, each product rounded to the
  product dtype as MulBackward does, summed in fp64 in a fixed order (32 lanes folded like a warp
  butterfly; see csrc/glu_probs_math.h), then rounded to the product dtype and to probs.dtype.
  torch sums those products with its fp32 cascade sum, so grad_probs differs from autograd's by
  that sum's rounding (a few fp32 ulps, ours being the more accurate).
* CUDA: the same element functions (no FMA contraction), so it differs from the CPU only where
  CUDA's expf/erff/tanhf differ from glibc's (2 ulps of the activation's φ(g), so ulps of |g|
  where act(g) = g·φ(g) cancels, as gelu's 1 + erf does for g < 0); grad_probs uses the same order, so it equals the CPU
  bit for bit whenever the terms do. Deterministic, no atomics.
* ``torch.ops.moe_core.glu_probs_bwd_(grad_h, a, grad_a, probs, ...)`` is the backward in place:
  ``grad_h`` becomes the forward's ``h`` (recomputed from ``a``, the same bits as
  :func:`glu_probs`), ``grad_a`` gets ``a``'s gradient, and it returns ``grad_probs``. ``grad_a``
  may be ``a`` itself: ``ops.expert_mlp``'s eager backward then keeps neither ``h`` nor a buffer
  for ``grad_a``; its compiled backward passes a new buffer (mutating the saved ``a``, an input
  of the compiled graph, would make inductor copy it first). All three must be contiguous;
  ``grad_h`` shares no memory with the others, ``grad_a`` is ``a`` or shares none with it. (NaN results are NaN on both paths; on the CPU their sign can differ, as
  it can between any two compiled copies of a product.)
"""
import functools
from typing import Callable, Optional, Tuple

import torch
import torch.nn.functional as F

from moe_core.ops._guards import int64_checked, register_autograd, register_fake
from moe_core.ops.names import ACTIVATIONS  # noqa: F401  (moe_core.ops.glu_probs.ACTIVATIONS)

_OP = int64_checked(torch.ops.moe_core.glu_probs)
_BWD = int64_checked(torch.ops.moe_core.glu_probs_bwd)


def activation_name(fn: Callable) -> Optional[str]:
    """The glu_probs name of an activation callable, or None when the op does not know it.

    Recognised: ``F.silu``, ``F.gelu`` (and ``functools.partial(F.gelu, approximate="tanh" or
    "none")``), ``F.relu`` / ``torch.relu``, and Megatron's ``squared_relu``
    (``megatron.core.activations``, ``torch.pow(F.relu(x), 2)``: compiled or eager it rounds once).
    Megatron's ``quick_gelu`` is *not* matched: it is a ``torch.compile``-d function that rounds
    once, while the op's ``"quick_gelu"`` is the eager three-rounding form. Anything else (a user's
    callable) returns None and the layer keeps the unfused torch path.
    """
    if fn is F.silu:
        return "silu"
    if fn is F.gelu:
        return "gelu"
    if fn is F.relu or fn is torch.relu:
        return "relu"
    if isinstance(fn, functools.partial) and fn.func is F.gelu and not fn.args:
        approx = fn.keywords.get("approximate", "none")
        if set(fn.keywords) <= {"approximate"} and approx in ("none", "tanh"):
            return "gelu" if approx == "none" else "gelu_tanh"
        return None
    if getattr(fn, "__module__", None) == "megatron.core.activations" and \
            getattr(fn, "__name__", None) == "squared_relu":
        return "squared_relu"
    return None


def glu_probs(
    a: torch.Tensor,
    probs: Optional[torch.Tensor],
    activation: str,
    gated_linear_unit: bool,
    linear_offset: float = 0.0,
    clamp_value: Optional[float] = None,
    glu_interleave_size: int = 0,
) -> torch.Tensor:
    """Activation of fc1's output times the router probs, in one pass.

    Args:
        a: ``[rows, 2F]`` (``gated_linear_unit``: gate half then linear half) or ``[rows, F]``;
            bf16, fp16, fp32 or fp64.
        probs: ``[rows]`` router probs (any float dtype; the multiply happens in
            ``promote(a.dtype, probs.dtype)``), or None for no multiply.
        activation: one of :data:`ACTIVATIONS`.
        gated_linear_unit: Megatron's ``gated_linear_unit``.
        linear_offset: ``glu_linear_offset`` (GLU only).
        clamp_value: ``activation_func_clamp_value`` (GLU only): gate ``clamp(max=v)``, linear
            half ``clamp(-v, v)``; None for no clamp.
        glu_interleave_size: GLU only: 0 (or None) for ``a = [gate | linear]``; ``s`` (dividing
            F) for Megatron's interleaved layout ``moe_mlp_glu_interleave_size``: blocks of s
            gate and s linear columns alternate, ``a.view(rows, F // s, 2, s)[:, :, 0]`` the
            gates; the same values, read where they are (no copy).

    Returns:
        ``h`` ``[rows, F]`` in ``a.dtype``. Differentiable in ``a`` and ``probs``.
    """
    return _OP(a, probs, activation, bool(gated_linear_unit), float(linear_offset),
               None if clamp_value is None else float(clamp_value),
               interleave_size(glu_interleave_size))


def interleave_size(size: Optional[int]) -> int:
    """A GLU interleave size as the ops take it: None as 0 (the halves), else the int itself
    (the core checks that it divides F and needs gated_linear_unit).

    Raises:
        ValueError: not None or an int >= 0.
    """
    if size is None:
        return 0
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise ValueError(f"glu_interleave_size must be None or an int >= 0, got {size!r}")
    return size


@register_fake("moe_core::glu_probs")
def _(a, probs, activation, gated_linear_unit, linear_offset=0.0, clamp_value=None,
      glu_interleave_size=0):
    f = a.shape[1] // 2 if gated_linear_unit else a.shape[1]
    return a.new_empty((a.shape[0], f))


@register_fake("moe_core::glu_probs_bwd")
def _(grad_h, a, probs, activation, gated_linear_unit, linear_offset=0.0, clamp_value=None,
      glu_interleave_size=0):
    grad_probs = probs.new_empty(probs.shape) if probs is not None else a.new_empty((0,))
    return torch.empty_like(a), grad_probs


def glu_options(inputs: tuple, at: int) -> tuple:
    """``(activation, gated_linear_unit, linear_offset, clamp_value, glu_interleave_size)`` of an
    op's inputs from position ``at`` (the dispatcher leaves out trailing arguments equal to their
    schema defaults): the glu_probs kernels' options, in their schemas' order."""
    defaults = (0.0, None, 0)  # linear_offset, clamp_value, glu_interleave_size
    given = tuple(inputs[at:at + 5])
    return given + defaults[len(given) - 2:]


def _setup_context(ctx, inputs, output):
    a, probs = inputs[:2]
    ctx.save_for_backward(a, probs)
    ctx.opts = glu_options(inputs, 2)
    ctx.num_inputs = len(inputs)


def _backward(ctx, grad_h) -> Tuple[Optional[torch.Tensor], ...]:
    a, probs = ctx.saved_tensors
    grad_a, grad_probs = _BWD(grad_h.contiguous(), a, probs, *ctx.opts)
    if probs is None or not ctx.needs_input_grad[1]:
        grad_probs = None
    return (grad_a, grad_probs) + (None,) * (ctx.num_inputs - 2)


register_autograd("moe_core::glu_probs", _backward, setup_context=_setup_context)


@register_fake("moe_core::glu_probs_bwd_")
def _(grad_h, a, grad_a, probs, activation, gated_linear_unit, linear_offset=0.0,
      clamp_value=None, glu_interleave_size=0):
    return probs.new_empty(probs.shape) if probs is not None else a.new_empty((0,))
