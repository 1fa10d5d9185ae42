"""moe-core's router behind a Hugging Face router's interface, for the whole-block swap.

:class:`MoECoreRouter` is moe-core's TopKRouter whose forward returns what an HF sparse-MoE router
returns (``(router_logits, probs, routing_map)``; Llama-4: the logits second) and whose expert bias
is HF's ``e_score_correction_bias`` as loaded. :func:`_router_class` makes, once per HF router
class, a class deriving from both, so that HF's output recording (which finds routers by class)
sees the swapped router. That class is made at run time; its name encodes the HF class, and this
module's ``__getattr__`` makes it again from the name when a pickled model is loaded.
"""
import functools
from typing import Optional, Tuple

import torch
from torch import nn

from moe_core.router import TopKRouter


class _StopInit(nn.Module):
    """Ends the ``__init__`` chain before the HF router class (whose ``__init__`` wants an HF
    config and would create a second weight)."""

    def __init__(self, *args, **kwargs):
        nn.Module.__init__(self)


class MoECoreRouter(TopKRouter):
    """moe-core's TopKRouter with HF's router interface.

    ``forward(hidden [T, H]) -> (router_logits [T, E], probs [T, E], routing_map [T, E] bool)``:
    the logits in the router dtype (what HF records for ``output_router_logits``), the probs in the
    router dtype (zero off the map; moe-core's aux / z losses attached) and the routing map.
    With ``logits_index`` 1 (Llama-4, whose router returns ``(router_scores, router_logits)`` and
    whose recorder reads index 1) the first two swap places: ``(probs, router_logits,
    routing_map)``, the probs being HF's dense router scores. Instances are made by
    :func:`_router_class`, whose class also derives from the family's HF router class.
    """

    # where the logits are in forward's output: HF's output recording index for the family
    logits_index = 0

    @property
    def expert_bias(self) -> Optional[torch.Tensor]:
        # HF's e_score_correction_bias, loaded as is: DeepSeek-V3's buffer of the router [E], or
        # Ernie-4.5's Parameter [1, E] (requires_grad=False) of the router's moe_statics module.
        # HF keeps it fp32, but a model cast with .to(dtype) rounds it: the score math is fp32
        bias = self._buffers.get("e_score_correction_bias")
        statics = self._modules.get("moe_statics")
        if bias is None and statics is not None:
            bias = statics.e_score_correction_bias.reshape(-1)
        return bias if bias is None or bias.dtype == torch.float32 else bias.float()

    @expert_bias.setter
    def expert_bias(self, value: Optional[torch.Tensor]) -> None:
        if value is not None:
            raise AttributeError("the expert bias of an HF router is its e_score_correction_bias "
                                 "buffer")

    def update_expert_bias(self, group=None) -> None:
        """Nothing to do: the HF router's expert bias is a checkpoint constant that HF never
        updates, and this router counts no tokens for it (``moe_router_enable_expert_bias`` is
        off), so ``moe_core.finalize_step`` leaves it as loaded."""

    def gating(self, inp: torch.Tensor) -> torch.Tensor:
        logits = super().gating(inp)
        self._logits = logits  # handed to HF by forward (TopKRouter.forward keeps them local)
        return logits

    def forward(self, hidden: torch.Tensor, padding_mask: Optional[torch.Tensor] = None
                ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Route ``hidden`` ``[T, H]``; see the class docstring for the outputs."""
        probs, routing_map = TopKRouter.forward(self, hidden, padding_mask)
        logits, self._logits = self._logits, None
        logits = logits.reshape(-1, self.config.num_moe_experts)
        if self.logits_index == 1:
            return probs, logits, routing_map
        return logits, probs, routing_map


_ROUTER_PREFIX = "MoECoreRouter__"


@functools.lru_cache(maxsize=None)
def _router_class(hf_router_cls: type) -> type:
    """The router class for one HF router class: ``MoECoreRouter`` first (its forward and
    TopKRouter's state), the HF class last (for ``isinstance``, which HF's output recording
    uses). Its name encodes the HF class's module and name, so pickle finds it again
    (see ``__getattr__``)."""
    return made_class(_ROUTER_PREFIX + encode_class(hf_router_cls),
                      (MoECoreRouter, _StopInit, hf_router_cls), __name__,
                      f"MoECoreRouter[{hf_router_cls.__name__}]")


def encode_class(cls: type) -> str:
    """``cls``'s module and name as a part of an identifier (:func:`decode_class` inverts it):
    a class made at run time is named with it, so pickle finds it again by name."""
    return cls.__module__.replace(".", "__DOT__") + "__CLS__" + cls.__name__


def decode_class(encoded: str) -> type:
    """The class :func:`encode_class` named, imported again."""
    import importlib

    module, _, name = encoded.partition("__CLS__")
    return getattr(importlib.import_module(module.replace("__DOT__", ".")), name)


def made_class(name: str, bases: tuple, module: str, display: str) -> type:
    """A class made at run time, named ``name`` in ``module`` (whose ``__getattr__`` makes it
    again when pickle looks it up). ``repr`` of a module tree shows it as ``display`` (e.g.
    ``MoECoreRouter[MixtralTopKRouter]``): the encoded name is for pickle, not for readers."""

    def _get_name(self) -> str:
        return display

    cls = type(name, bases, {"__module__": module, "_get_name": _get_name})
    cls.__qualname__ = name
    return cls


def __getattr__(name: str):
    # a pickled swapped model names its router class; make it again from that name
    if name.startswith(_ROUTER_PREFIX):
        return _router_class(decode_class(name[len(_ROUTER_PREFIX):]))
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
