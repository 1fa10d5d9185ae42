"""Registration helpers shared by every op: one device per call, no silent double backward, no
zero tensors for unused gradients.

Every ``torch.ops.moe_core`` op registers its fake (meta) kernel with :func:`register_fake` and
its autograd formula with :func:`register_autograd` from this module, never with
``torch.library``'s directly, so the two guards below hold for all of them.

One device per call
-------------------
The dispatcher picks the Meta kernel when any argument is a meta tensor, so a call mixing meta
and CPU (or CUDA) tensors reaches the fake kernel, which would return an uninitialised tensor on
the real device. The fake kernels therefore first check that every tensor argument is on the
device of the first one and raise ``ValueError("<op>: <arg> is on <device> but <first arg> is on
<device>; all tensors must be on one device")`` otherwise (the message of the C++ binding's own
device check). Calls with every tensor on meta, and FakeTensor tracing (``torch.compile``,
``opcheck``), where the fake tensors of one call share a device, pass unchanged.

No double backward
------------------
The backward formulas run the ``*_bwd`` kernels, which have no derivatives of their own, so a
graph built through them (``create_graph=True``) would give wrong second derivatives. The
registered backward therefore raises ``RuntimeError("moe_core.<op>: double backward
(create_graph=True) is not supported ...")`` when grad mode is on (only ``create_graph=True``
turns it on inside a backward) and its result would carry a graph: an incoming gradient requires
grad (checked first), or a returned gradient does (it depends on a saved tensor that requires
grad). With grad mode on but nothing requiring grad, the gradients are constants and correct, so
that passes. ``torch.compile`` traces the backward with grad mode off, so compiled graphs are not
affected.

The backward kernels themselves (the ``*_bwd`` ops, ``grouped_gemm_dgrad`` / ``_wgrad``) are
registered with :func:`register_no_derivative`: called directly on tensors that require grad,
their outputs carry a graph node that raises ``RuntimeError("moe_core.<op>: has no derivative
...")`` when differentiated, instead of torch's fallback, which only warns and drops the
gradient. Outside grad mode, or with no input requiring grad, the call is unchanged.

Unused outputs
--------------
Autograd hands a formula a zero tensor for each output whose gradient is undefined (an index or
mask output, a float output nobody used), an allocation and a fill kernel on every backward.
:func:`register_autograd` turns that off (``ctx.set_materialize_grads(False)``): a formula sees
such a gradient as None. One whose every incoming gradient is None is not run at all and returns
None for every input (a backward is linear in its incoming gradients, so that is exact); the
formulas of ops with several float outputs handle the rest.
"""
import functools
from typing import Any, Callable, Dict, Iterator, Optional, Sequence, Set, Tuple

import torch

_NAMESPACE = "moe_core::"

# The ops registered through this module (qualified names), so a test can tell that none was
# registered around it.
DEVICE_CHECKED: Set[str] = set()
DOUBLE_BACKWARD_GUARDED: Set[str] = set()
NO_DERIVATIVE: Set[str] = set()


def op_label(qualname: str) -> str:
    """The op's name for messages: ``moe_core::permute_symint`` -> ``permute`` (the ``_symint``
    variants are the same op with a symbolic size in the schema)."""
    name = qualname[len(_NAMESPACE):] if qualname.startswith(_NAMESPACE) else qualname
    return name[:-len("_symint")] if name.endswith("_symint") else name


def _argument_names(qualname: str) -> Tuple[str, ...]:
    """The schema's argument names in order (for both C++ and Python-defined ops)."""
    name = qualname[len(_NAMESPACE):]
    return tuple(a.name for a in getattr(torch.ops.moe_core, name).default._schema.arguments)


def _tensors(name: str, value: Any) -> Iterator[Tuple[str, torch.Tensor]]:
    if isinstance(value, torch.Tensor):
        yield name, value
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            if isinstance(v, torch.Tensor):
                yield f"{name}[{i}]", v


def check_one_device(op: str, names: Sequence[str], args: Sequence[Any],
                     kwargs: Dict[str, Any]) -> None:
    """Raise ValueError unless every tensor argument is on the first tensor argument's device.

    Args:
        op: the op's name for the message.
        names: the schema's argument names, in order.
        args, kwargs: the call's arguments as the dispatcher passes them (positional first, then
            by name).
    """
    ref: Optional[Tuple[str, torch.device]] = None
    for i, name in enumerate(names):
        value = args[i] if i < len(args) else kwargs.get(name)
        for label, t in _tensors(name, value):
            if ref is None:
                ref = (label, t.device)
            elif t.device != ref[1]:
                raise ValueError(f"{op}: {label} is on {t.device} but {ref[0]} is on {ref[1]}; "
                                 "all tensors must be on one device")


_INT64_MIN, _INT64_MAX = -2 ** 63, 2 ** 63 - 1


def _outside_int64(value: Any) -> bool:
    if type(value) is int:
        return not _INT64_MIN <= value <= _INT64_MAX
    if isinstance(value, (list, tuple)):
        return any(type(v) is int and not _INT64_MIN <= v <= _INT64_MAX for v in value)
    return False


def int64_checked(packet: Any) -> Callable:
    """``torch.ops.moe_core.<op>`` with its Python int arguments checked against int64 first:
    the schema's cast of an int of 2**63 or more fails with a message that names neither the
    argument nor the range; this raises ``ValueError("<op>: <arg>=<value> is outside int64")``.
    Symbolic sizes (``torch.compile``) pass through unchecked. An op without int arguments is
    returned as it is."""
    qualname = packet._qualified_op_name
    types = [str(a.type) for a in packet.default._schema.arguments]
    if not any("int" in t.lower() for t in types):
        return packet

    def call(*args, **kwargs):
        for i, a in enumerate(args):
            if _outside_int64(a):
                raise ValueError(f"{op_label(qualname)}: {_argument_names(qualname)[i]}={a} is "
                                 f"outside int64 [-2**63, 2**63 - 1]")
        for name, a in kwargs.items():
            if _outside_int64(a):
                raise ValueError(f"{op_label(qualname)}: {name}={a} is outside int64 "
                                 f"[-2**63, 2**63 - 1]")
        return packet(*args, **kwargs)

    call.__name__ = call.__qualname__ = op_label(qualname)
    call.__doc__ = f"torch.ops.{qualname.replace('::', '.')}, int arguments checked"
    return call


def register_fake(qualname: str) -> Callable[[Callable], Callable]:
    """``torch.library.register_fake(qualname)`` for a kernel that first runs
    :func:`check_one_device`. Used as a decorator; returns the kernel unchanged, so one kernel can
    be registered for several ops."""
    op, names = op_label(qualname), _argument_names(qualname)

    def decorate(fake: Callable) -> Callable:
        @functools.wraps(fake)
        def checked(*args, **kwargs):
            check_one_device(op, names, args, kwargs)
            return fake(*args, **kwargs)

        torch.library.register_fake(qualname, checked)
        DEVICE_CHECKED.add(qualname)
        return fake

    return decorate


def double_backward_error(op: str) -> RuntimeError:
    return RuntimeError(
        f"moe_core.{op}: double backward (create_graph=True) is not supported: its backward "
        "runs kernels that have no derivatives of their own, so a second derivative through it "
        "would be wrong. Differentiate without create_graph=True, or keep this op out of the "
        "part of the graph that is differentiated twice.")


def _requires_grad(values: Any) -> bool:
    return any(isinstance(v, torch.Tensor) and v.requires_grad for v in values)


def guard_double_backward(op: str, backward: Callable) -> Callable:
    """Wrap an autograd formula ``backward(ctx, *grads) -> grads`` so that it raises
    :func:`double_backward_error` where its result would carry a graph (see the module
    docstring). Outside ``create_graph=True`` it costs one grad-mode test."""

    @functools.wraps(backward)
    def guarded(ctx, *grads):
        if not torch.is_grad_enabled():
            return backward(ctx, *grads)
        if _requires_grad(grads):
            raise double_backward_error(op)
        out = backward(ctx, *grads)
        if _requires_grad(out if isinstance(out, (tuple, list)) else (out,)):
            raise double_backward_error(op)
        return out

    return guarded


def _unused_grads_as_none(backward: Callable, setup_context: Callable
                          ) -> Tuple[Callable, Callable]:
    """``(backward, setup_context)`` with unused outputs' gradients left None (see the module
    docstring): all None returns None for every input without running ``backward``."""

    @functools.wraps(setup_context)
    def setup(ctx, inputs, output):
        setup_context(ctx, inputs, output)
        ctx.set_materialize_grads(False)

    @functools.wraps(backward)
    def formula(ctx, *grads):
        if all(g is None for g in grads):
            return (None,) * len(ctx.needs_input_grad)
        return backward(ctx, *grads)

    return formula, setup


def register_autograd(qualname: str, backward: Callable, *, setup_context: Callable) -> None:
    """``torch.library.register_autograd`` with unused outputs' gradients left None and the
    backward wrapped by :func:`guard_double_backward`."""
    backward, setup_context = _unused_grads_as_none(backward, setup_context)
    torch.library.register_autograd(qualname, guard_double_backward(op_label(qualname), backward),
                                    setup_context=setup_context)
    DOUBLE_BACKWARD_GUARDED.add(qualname)


def no_derivative_error(op: str) -> RuntimeError:
    return RuntimeError(
        f"moe_core.{op}: has no derivative: it is a backward kernel, so differentiating its "
        "output (a double backward, create_graph=True) is not supported.")


def register_no_derivative(qualname: str) -> None:
    """Register an autograd formula for a backward kernel that raises
    :func:`no_derivative_error` when its output is differentiated (see the module docstring)."""
    op = op_label(qualname)

    def backward(ctx, *grads):
        raise no_derivative_error(op)

    def setup_context(ctx, inputs, output):
        pass

    torch.library.register_autograd(qualname, backward, setup_context=setup_context)
    NO_DERIVATIVE.add(qualname)
