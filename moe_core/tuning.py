"""The core's run-time tuning switches (``csrc/tuning.h``): read them, or have the core read the
environment again.

The C core reads its ``MOE_CORE_*`` / ``MOE_GG_*`` variables once, at its first op, and never
again on its own. A test or an A/B tool that changes a switch inside one process calls
:func:`reload` afterwards, or wraps the change in :func:`environment`, which also restores the
variables and the values the core holds when the block ends. The README's "Tuning switches"
table says what each switch trades; every setting computes the same op.

The values come straight through the C ABI (ctypes on the loaded extension): the switches hold no
tensors, so they are not torch ops.
"""
import contextlib
import ctypes
import os
from typing import Dict, Iterator, Optional

from moe_core import _C

# Each field of moe_tuning_t, in the struct's order, and the environment variable it comes from.
SWITCHES: Dict[str, str] = {
    "cpu_gemm_kernel": "MOE_CORE_GEMM_KERNEL",
    "pdl": "MOE_CORE_PDL",
    "router_lanes": "MOE_CORE_ROUTER_LANES",
    "unpermute_slots": "MOE_CORE_UNPERMUTE_SLOTS",
    "gg_split_tail": "MOE_GG_SM90_SPLIT_TAIL",
    "gg_expert_maps": "MOE_GG_SM90_EXPERT_MAPS",
    "gg_tile": "MOE_GG_SM90_TILE",
    "gg_wgrad_bk": "MOE_GG_SM90_WGRAD_BK",
    "expert_copy_rows": "MOE_CORE_EXPERT_COPY_ROWS",
}

# The values of an unset environment (tuning.h: MOE_TUNING_GEMM_AUTO is 0, MOE_TUNING_SPLIT_AUTO and
# MOE_TUNING_COPY_AUTO 1).
DEFAULTS: Dict[str, int] = {
    "cpu_gemm_kernel": 0,
    "pdl": 1,
    "router_lanes": 1,
    "unpermute_slots": 1,
    "gg_split_tail": 1,
    "gg_expert_maps": 1,
    "gg_tile": 0,
    "gg_wgrad_bk": 0,
    "expert_copy_rows": 1,
}


class _Tuning(ctypes.Structure):
    """moe_tuning_t."""

    _fields_ = [(field, ctypes.c_int) for field in SWITCHES]


_lib = ctypes.CDLL(_C.__file__)  # the extension already loaded: the same library, the same state
_lib.moe_tuning_get.argtypes = []
_lib.moe_tuning_get.restype = _Tuning
_lib.moe_tuning_reload.argtypes = []
_lib.moe_tuning_reload.restype = None


def _as_dict(t: _Tuning) -> Dict[str, int]:
    return {field: getattr(t, field) for field in SWITCHES}


def current() -> Dict[str, int]:
    """The values the core runs with, by field of moe_tuning_t (``csrc/tuning.h`` documents each
    value), e.g. ``{"gg_tile": 0, ...}``."""
    return _as_dict(_lib.moe_tuning_get())


def reload() -> Dict[str, int]:
    """Has the core read its environment variables again; returns the new values (as
    :func:`current`). An op running on another thread meanwhile may see the old or the new."""
    _lib.moe_tuning_reload()
    return current()


@contextlib.contextmanager
def environment(**variables: Optional[str]) -> Iterator[Dict[str, int]]:
    """Sets the given switches for the block, e.g. ``environment(MOE_GG_SM90_TILE="128")``
    (``None`` unsets one), and has the core read them; yields the values it then holds. On exit
    the variables are as before and the core reads them again.

    Raises ValueError naming a variable that is no switch of the core, TypeError naming a value
    that is not a string.
    """
    known = set(SWITCHES.values())
    for name, value in variables.items():
        if name not in known:
            raise ValueError(f"environment: {name!r} is not a tuning switch; known: "
                             f"{', '.join(sorted(known))}")
        if value is not None and not isinstance(value, str):
            raise TypeError(f"environment: {name}={value!r} must be a string or None")
    saved = {name: os.environ.get(name) for name in variables}
    try:
        for name, value in variables.items():
            _set(name, value)
        yield reload()
    finally:
        for name, value in saved.items():
            _set(name, value)
        reload()


def _set(name: str, value: Optional[str]) -> None:
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value
