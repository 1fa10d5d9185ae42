"""Registration helpers shared by every op.

Every ``torch.ops.moe_core`` op registers its fake (meta) kernel with :func:`register_fake` from
this module, never with ``torch.library``'s directly, so the guard below holds for all of them.

One device per call
-------------------
The dispatcher picks the Meta kernel when any argument is a meta tensor, so a call mixing meta
and CPU (or CUDA) tensors reaches the fake kernel, which would return an uninitialised tensor on
the real device. The fake kernels therefore first check that every tensor argument is on the
device of the first one and raise ``ValueError("<op>: <arg> is on <device> but <first arg> is on
<device>; all tensors must be on one device")`` otherwise (the message of the C++ binding's own
device check). Calls with every tensor on meta, and FakeTensor tracing (``torch.compile``,
``opcheck``), where the fake tensors of one call share a device, pass unchanged.
"""
import functools
from typing import Any, Callable, Dict, Iterator, Optional, Sequence, Set, Tuple

import torch

_NAMESPACE = "moe_core::"

# The ops registered through this module (qualified names), so a test can tell that none was
# registered around it.
DEVICE_CHECKED: Set[str] = set()


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
