"""moe-core's grouped experts on a Hugging Face experts module's own Parameters.

:class:`HFGroupedMLP` is GroupedMLP reading its weights from HF's ``gate_up_proj`` / ``down_proj``
(the ``[E, 2F, H]`` / ``[E, H, F]`` layout, gate rows first); :class:`HFTransposedGroupedMLP` runs
GPT-OSS's transposed, interleaved weights with their biases and the clamped SwiGLU, and
:class:`HFLlama4GroupedMLP` Llama-4's ``[E, in, out]`` weights with the probs on the input. The
Parameters are HF's objects under HF's names, read at every forward, so state dicts load both
ways and a PEFT parametrization of them is used.

:func:`_experts_class` makes, once per pair, a class that is both such an MLP and the family's HF
experts class (the patch-mapping route, where HF's weight initialisation must reach the experts).
That class is made at run time; its name encodes both classes, and this module's ``__getattr__``
makes it again from the name when a pickled model is loaded.
"""
import functools
from typing import Optional

import torch
from torch import nn

from moe_core import ops
from moe_core.config import MoEConfig
from moe_core.experts import GroupedMLP, autocast_dtype, autocast_to
from moe_core.hf.router import _StopInit, decode_class, encode_class, made_class


class HFGroupedMLP(GroupedMLP):
    """GroupedMLP whose weights are an HF experts module's Parameters, under HF's names.

    Parameters: ``gate_up_proj`` ``[E, 2F, H]`` (gate rows first; GroupedMLP's ``weight1``) and
    ``down_proj`` ``[E, H, F]`` (``weight2``), in the model's dtype. ``weight1`` / ``weight2`` read
    the attributes at every call, so a parametrization (PEFT LoRA) of them is used.
    """

    def __init__(self, config: MoEConfig, gate_up_proj: nn.Parameter, down_proj: nn.Parameter):
        self._hold(config, gate_up_proj=gate_up_proj, down_proj=down_proj)
        self.register_parameter("bias1", None)
        self.register_parameter("bias2", None)

    def _hold(self, config: MoEConfig, **params: nn.Parameter) -> None:
        """The module's state around HF's own Parameters, registered under HF's names
        (GroupedMLP.__init__ would allocate and initialise a second copy of the weights)."""
        nn.Module.__init__(self)
        self.config = config
        self.ep_size, self.ep_rank = 1, 0
        self.num_local_experts = config.num_moe_experts
        self.input_size, self.ffn_size = config.hidden_size, config.moe_ffn_hidden_size
        for name, p in params.items():
            setattr(self, name, p)
            p.expert_parallel_size = 1  # read by moe_core.parallel.all_reduce_gradients

    @property
    def weight1(self) -> torch.Tensor:
        return self.gate_up_proj

    @property
    def weight2(self) -> torch.Tensor:
        return self.down_proj

    def reset_parameters(self) -> None:
        raise RuntimeError("HFGroupedMLP holds an HF model's weights: initialise them in HF")


class HFTransposedGroupedMLP(HFGroupedMLP):
    """GPT-OSS's experts module as MoELayer's experts: its own Parameters, under HF's names.

    Parameters: ``gate_up_proj`` ``[E, H, 2F]`` (gate and up columns interleaved),
    ``gate_up_proj_bias`` ``[E, 2F]``, ``down_proj`` ``[E, F, H]``, ``down_proj_bias`` ``[E, H]``.
    The grouped GEMMs read the ``[E, in, out]`` weights as they are (``trans_w=False``), and
    ``ops.glu_probs`` the fc1 output's interleaved columns where they are
    (``glu_interleave_size=1``). Then GroupedMLP's order:
    ``h = act(gate) * (up + 1)`` (gate clamped to ``max=limit``, up to ``[-limit, limit]``,
    ``act(g) = g * sigmoid(alpha g)``) times the probs: ``ops.glu_probs``' clamped quick-GELU
    when ``alpha`` is 1.702, else torch ops; then ``y = h @ W2 + b2 * p``. Under autocast the
    biases are cast with the weights, as GroupedMLP's (``nn.Linear``'s rule; HF eager adds them
    in fp32 after its bf16 matmuls, which the experts backend route follows).
    """

    # HF's flag on its experts module: PEFT's parameter LoRA reads it for the [E, in, out] layout
    is_transposed = True

    def __init__(self, config: MoEConfig, module: nn.Module, spec: Optional[tuple]):
        self._hold(config, gate_up_proj=module.gate_up_proj,
                   gate_up_proj_bias=module.gate_up_proj_bias, down_proj=module.down_proj,
                   down_proj_bias=module.down_proj_bias)
        self._spec = spec
        self.alpha, self.limit = float(module.alpha), float(module.limit)

    @property
    def bias1(self) -> torch.Tensor:
        return self.gate_up_proj_bias

    @property
    def bias2(self) -> torch.Tensor:
        return self.down_proj_bias

    def forward_rows(self, x: torch.Tensor, expert_offsets: torch.Tensor,
                     probs: torch.Tensor) -> torch.Tensor:
        """As :meth:`GroupedMLP.forward_rows`."""
        dtype = autocast_dtype(x)
        x = autocast_to(x, dtype)
        w1, w2 = autocast_to(self.gate_up_proj, dtype), autocast_to(self.down_proj, dtype)
        b1, b2 = autocast_to(self.gate_up_proj_bias, dtype), autocast_to(self.down_proj_bias, dtype)
        row_expert = self._row_expert(expert_offsets, x.shape[0])
        a = ops.grouped_gemm(x, w1.contiguous(), expert_offsets, trans_w=False)
        a = a + b1[row_expert]
        if self._spec is not None:
            # GPT-OSS's gate, up, gate, up, ... columns: interleave size 1, read in place
            h = ops.glu_probs(a, probs, *self._spec, glu_interleave_size=1)
        else:  # another alpha: the same formula in torch ops
            gate = a[:, 0::2].clamp(max=self.limit)
            up = a[:, 1::2].clamp(min=-self.limit, max=self.limit)
            h = (up + 1) * (gate * torch.sigmoid(gate * self.alpha))
            h = (h * probs.unsqueeze(-1)).to(h.dtype)
        y = ops.grouped_gemm(h, w2.contiguous(), expert_offsets, trans_w=False)
        return y + (b2[row_expert] * probs.unsqueeze(-1)).to(y.dtype)


class HFLlama4GroupedMLP(HFGroupedMLP):
    """Llama-4's experts module as MoELayer's experts: its own Parameters, under HF's names.

    Parameters: ``gate_up_proj`` ``[E, H, 2F]`` (the gate columns, then the up columns) and
    ``down_proj`` ``[E, F, H]``: ``[E, in, out]``, which the grouped GEMMs read as they are
    (``trans_w=False``, no copy). fc1's output then has the gate half first, GroupedMLP's order,
    so nothing is rearranged either: ``x <- p * x`` (``moe_apply_probs_on_input``, top-1), ``h =
    act(x @ W1[:, :F]) * (x @ W1[:, F:])`` in ``ops.grouped_gemm_glu_probs``, ``y = h @ W2``.
    HF's experts module has no ``is_transposed`` flag, so neither has this one: PEFT's parameter
    LoRA gives both the same adapter shapes.
    """

    def forward_rows(self, x: torch.Tensor, expert_offsets: torch.Tensor,
                     probs: torch.Tensor) -> torch.Tensor:
        """As :meth:`GroupedMLP.forward_rows`."""
        cfg = self.config
        dtype = autocast_dtype(x)
        x = autocast_to(x, dtype)
        if cfg.moe_apply_probs_on_input:
            x = (probs.unsqueeze(-1) * x).to(x.dtype)
            probs = torch.ones_like(probs)
        h, _ = ops.grouped_gemm_glu_probs(
            x, autocast_to(self.gate_up_proj, dtype).contiguous(), expert_offsets, probs,
            ops.activation_name(cfg.activation_func), True, 0.0, None, trans_w=False)
        return ops.grouped_gemm(h, autocast_to(self.down_proj, dtype).contiguous(),
                                expert_offsets, trans_w=False)


_EXPERTS_PREFIX = "MoECoreExperts__"


@functools.lru_cache(maxsize=None)
def _experts_class(mlp_cls: type, hf_experts_cls: type) -> type:
    """``mlp_cls`` (forward, parameters) that is also an instance of the family's HF experts
    class, so that HF's ``_init_weights`` initialises its parameters (same names) when
    ``from_config`` / ``from_pretrained`` build the swapped block directly."""
    name = _EXPERTS_PREFIX + mlp_cls.__name__ + "__MOD__" + encode_class(hf_experts_cls)
    return made_class(name, (mlp_cls, _StopInit, hf_experts_cls), __name__,
                      f"{mlp_cls.__name__}[{hf_experts_cls.__name__}]")


def __getattr__(name: str):
    # a swapped model built through the patch mapping and pickled names its experts class; make
    # it again from that name
    if name.startswith(_EXPERTS_PREFIX):
        mlp, _, rest = name[len(_EXPERTS_PREFIX):].partition("__MOD__")
        return _experts_class(globals()[mlp], decode_class(rest))
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
