"""MoEAuxLossAutoScaler: attach an auxiliary loss to an activation without touching the loss.

The forward pass returns ``output`` unchanged and keeps ``aux_loss``; the backward pass passes
``output``'s gradient through and gives ``aux_loss`` the gradient ``scale`` (``ones * scale``),
so ``d(aux)/dθ · scale`` reaches every parameter upstream of ``aux_loss`` in the same backward
pass: no second ``.backward()`` and no adding to the main loss.

Where the scale comes from (the difference from Megatron)
---------------------------------------------------------
Megatron keeps the scale in a class attribute shared by every layer, every model and every test
in the process. Here a scale is an :class:`AuxLossScale` object, a holder of a 0-d fp32 tensor
that is updated in place (no host sync). Each ``apply`` binds its backward to one holder, chosen
at forward time:

1. ``MoEAuxLossAutoScaler.apply(output, aux_loss, scale)``: an explicit holder (or a number or
   tensor, wrapped in a fresh holder). A layer or router that owns a holder passes it here.
2. otherwise the innermost ``with holder:`` block active on this thread (context-managed: a
   training loop wraps each micro-batch's forward in ``with scale:`` and calls
   ``scale.set(...)``, or Megatron's ``set_loss_scale``, before the backward).
3. otherwise the process default holder, which only Megatron-style code touches: the unscoped
   ``MoEAuxLossAutoScaler.set_loss_scale(t)`` writes it and ``reset_loss_scale()`` restores 1.

The backward reads the bound holder's value when it runs, so in eager mode setting the scale
after the forward and before the backward (Megatron's schedule) works. Under ``torch.compile``
the compiled graph takes the value when the forward runs: set the scale before the forward
there (Megatron sets the same value every micro-batch, so the schedule is unaffected in
practice). Scoped and explicit holders never read or write the default, so they cannot leak
into, or be leaked into by, unrelated code.
"""
import threading
from typing import Optional, Union

import torch

ScaleLike = Union["AuxLossScale", float, int, torch.Tensor]


class AuxLossScale:
    """The backward scale of the aux losses attached while it is bound.

    Args:
        value: initial scale (a number or a one-element tensor), 1.0 by default.
        device: device of the holder's tensor (default: the value's, else CPU).
    """

    def __init__(self, value: Union[float, int, torch.Tensor] = 1.0, device=None):
        if isinstance(value, torch.Tensor):
            self._value = value.detach().to(device=device or value.device,
                                            dtype=torch.float32).reshape(()).clone()
        else:
            self._value = torch.full((), _as_float(value), dtype=torch.float32, device=device)

    @property
    def value(self) -> torch.Tensor:
        """The 0-d fp32 scale tensor (read by the backward pass when it runs)."""
        return self._value

    def set(self, value: Union[float, int, torch.Tensor]) -> None:
        """Sets the scale in place (a tensor is copied on its device: no host sync)."""
        if isinstance(value, torch.Tensor):
            if value.numel() != 1:
                raise ValueError(f"scale must have one element, got shape {tuple(value.shape)}")
            if value.device != self._value.device:
                self._value = value.detach().to(torch.float32).reshape(()).clone()
            else:
                self._value.copy_(value.detach().reshape(()))
        else:
            self._value.fill_(_as_float(value))

    def __enter__(self) -> "AuxLossScale":
        _stack().append(self)
        return self

    def __exit__(self, *exc) -> None:
        stack = _stack()
        if not stack or stack[-1] is not self:
            raise RuntimeError("AuxLossScale blocks must be exited in the order they were entered")
        stack.pop()

    def __repr__(self) -> str:
        return f"AuxLossScale(device={self._value.device})"


def _as_float(value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"scale must be a number or a tensor, got {value!r}")
    return float(value)


class _ThreadScales(threading.local):
    """Per-thread stack of the active ``with`` holders. It exists from a thread's first access
    on, so reading it never creates it: a compiled forward then guards on a fixed attribute and
    its first call does not change what the next call sees (no recompile)."""

    def __init__(self) -> None:
        self.stack: list = []


_LOCAL = _ThreadScales()
_DEFAULT = AuxLossScale(1.0)


def _stack() -> list:
    return _LOCAL.stack


def current_aux_loss_scale() -> AuxLossScale:
    """The holder an unbound ``apply`` would use now: innermost ``with`` block, else the default."""
    stack = _stack()
    return stack[-1] if stack else _DEFAULT


def _resolve(scale: Optional[ScaleLike]) -> AuxLossScale:
    if scale is None:
        return current_aux_loss_scale()
    if isinstance(scale, AuxLossScale):
        return scale
    return AuxLossScale(scale)


class MoEAuxLossAutoScaler(torch.autograd.Function):
    """Identity on ``output`` that injects ``scale * d(aux_loss)`` in the backward pass.

    ``MoEAuxLossAutoScaler.apply(output, aux_loss)`` is Megatron's call;
    ``MoEAuxLossAutoScaler.apply(output, aux_loss, scale)`` binds an explicit scale.

    Args (of ``apply``):
        output: any tensor on the path to the main loss (returned unchanged).
        aux_loss: a scalar loss tensor with a graph to the parameters it regularises.
        scale: an :class:`AuxLossScale`, a number, a tensor, or None (see the module docstring).
    """

    @staticmethod
    def forward(ctx, output: torch.Tensor, aux_loss: torch.Tensor,
                scale: Optional[ScaleLike] = None) -> torch.Tensor:
        ctx.scale_holder = _resolve(scale)
        ctx.save_for_backward(aux_loss)
        return output

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (aux_loss,) = ctx.saved_tensors
        scaled_aux_loss_grad = torch.ones_like(aux_loss) * ctx.scale_holder.value
        return grad_output, scaled_aux_loss_grad, None

    @staticmethod
    def set_loss_scale(scale: Union[float, torch.Tensor]) -> None:
        """Megatron's entry: sets the current scale (innermost ``with`` block, else the default).

        Args:
            scale: the main loss's backward scale (a number or a one-element tensor).
        """
        current_aux_loss_scale().set(scale)

    @staticmethod
    def reset_loss_scale() -> None:
        """Restores the process default scale to 1 (for Megatron-style, unscoped code)."""
        _DEFAULT.set(1.0)
