"""The core's run-time tuning switches (``csrc/tuning.h``): read them, or have the core read the
environment again.

The C core reads its ``MOE_CORE_*`` / ``MOE_GG_*`` variables once, at its first op, and never
again on its own. A test or an A/B tool that changes a switch inside one process calls
:func:`reload` afterwards, or wraps the change in :func:`environment`, which also restores the
variables and the values the core holds when the block ends. The README's "Tuning switches"
table says what each switch trades; every setting computes the same op.

The values come straight through the C ABI (ctypes on the loaded extension): the switches hold no
tensors, so they are not torch ops. Each value is a member of its switch's :class:`Setting` (an
``IntEnum``: it prints its name, e.g. ``auto``, and still equals the number ``tuning.h`` defines).
"""
import contextlib
import ctypes
import enum
import os
from typing import Dict, Iterator, Optional, Type

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



class Setting(enum.IntEnum):
    """A switch's value: equal to the int the core holds (``tuning.h``'s constants), printed by
    its name (``str(CopyRows.AUTO) == "auto"``)."""

    def __str__(self) -> str:
        return self.name.lower()


def _setting(name: str, **members: int) -> type:
    """A :class:`Setting` named ``name`` of ``members`` (NAME=number)."""
    return Setting(name, list(members.items()), module=__name__, qualname=name)


# tuning.h's constants, by field: MOE_TUNING_GEMM_*, the on/off switches (pdl, router_lanes,
# unpermute_slots, gg_expert_maps), MOE_TUNING_SPLIT_*, the sm90 tile width and wgrad rows per
# stage (0: chosen per GEMM), MOE_TUNING_COPY_*.
GemmKernel = _setting("GemmKernel", AUTO=0, GENERIC=1, AVX512=2)
OnOff = _setting("OnOff", OFF=0, ON=1)
SplitTail = _setting("SplitTail", NEVER=0, AUTO=1, ALWAYS=2)
Tile = _setting("Tile", AUTO=0, WIDTH_128=128, WIDTH_256=256)
WgradRows = _setting("WgradRows", AUTO=0, ROWS_32=32, ROWS_64=64)
CopyRows = _setting("CopyRows", NEVER=0, AUTO=1, ALWAYS=2)

# Each field's values.
SETTINGS: Dict[str, Type[Setting]] = {
    "cpu_gemm_kernel": GemmKernel,
    "pdl": OnOff,
    "router_lanes": OnOff,
    "unpermute_slots": OnOff,
    "gg_split_tail": SplitTail,
    "gg_expert_maps": OnOff,
    "gg_tile": Tile,
    "gg_wgrad_bk": WgradRows,
    "expert_copy_rows": CopyRows,
}

# The values of an unset environment.
DEFAULTS: Dict[str, Setting] = {
    "cpu_gemm_kernel": GemmKernel.AUTO,
    "pdl": OnOff.ON,
    "router_lanes": OnOff.ON,
    "unpermute_slots": OnOff.ON,
    "gg_split_tail": SplitTail.AUTO,
    "gg_expert_maps": OnOff.ON,
    "gg_tile": Tile.AUTO,
    "gg_wgrad_bk": WgradRows.AUTO,
    "expert_copy_rows": CopyRows.AUTO,
}


class _Tuning(ctypes.Structure):
    """moe_tuning_t."""

    _fields_ = [(field, ctypes.c_int) for field in SWITCHES]


_lib = ctypes.CDLL(_C.__file__)  # the extension already loaded: the same library, the same state
_lib.moe_tuning_get.argtypes = []
_lib.moe_tuning_get.restype = _Tuning
_lib.moe_tuning_reload.argtypes = []
_lib.moe_tuning_reload.restype = None


def _as_dict(t: _Tuning) -> Dict[str, Setting]:
    return {field: _named(field, getattr(t, field)) for field in SWITCHES}


def _named(field: str, value: int) -> Setting:
    try:
        return SETTINGS[field](value)
    except ValueError:  # a value tuning.h has and SETTINGS lacks: still the number
        return value


def current() -> Dict[str, Setting]:
    """The values the core runs with, by field of moe_tuning_t (``csrc/tuning.h`` documents each
    value), each a member of its :data:`SETTINGS` class, e.g. ``{"gg_tile": Tile.AUTO, ...,
    "expert_copy_rows": CopyRows.AUTO}``: ``str`` gives its name (``auto``), ``==`` compares it
    with the number the core holds (``CopyRows.AUTO == 1``)."""
    return _as_dict(_lib.moe_tuning_get())


def reload() -> Dict[str, Setting]:
    """Has the core read its environment variables again; returns the new values (as
    :func:`current`). An op running on another thread meanwhile may see the old or the new."""
    _lib.moe_tuning_reload()
    return current()


@contextlib.contextmanager
def environment(**variables: Optional[str]) -> Iterator[Dict[str, Setting]]:
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
