"""Whole-block swap: moe-core's ``MoELayer`` in place of a Hugging Face sparse-MoE block.

:func:`replace_moe_blocks` replaces every sparse-MoE block of a supported family by a
:class:`MoECoreSparseMoeBlock`: a ``MoELayer`` (moe-core's router, permute, grouped experts,
unpermute) that runs on the HF block's own parameters, registered under HF's names:

    gate.weight                [E, H]       the router (MoE-core's TopKRouter; its class is also a
                                            subclass of the family's router class, so HF's output
                                            recording of ``router_logits`` sees it)
    gate.e_score_correction_bias [E]        DeepSeek-V3's expert bias (a buffer, as in HF)
    experts.gate_up_proj       [E, 2F, H]   gate rows first: GroupedMLP's ``weight1`` as is
    experts.down_proj          [E, H, F]    GroupedMLP's ``weight2``
    shared_expert.*, shared_expert_gate.*   Qwen2-MoE's shared expert and its sigmoid gate
    shared_experts.*                        DeepSeek's shared experts

The Parameter objects are HF's (nothing is copied), so ``state_dict()`` has the HF block's keys
and shapes and loads both ways, and PEFT's ``target_parameters`` LoRA (a parametrization of
``experts.gate_up_proj`` / ``experts.down_proj``) is read at every forward. The block returns what
the HF block returns (a tensor of the input's shape) and the router returns HF's
``(router_logits, probs, routing_map)``, so ``output_router_logits=True`` records the same
logits and HF's ``load_balancing_loss_func`` gives the same aux loss.

Routing rules per family, each exactly one of Megatron's (moe-core's) rules:

==============  ==================================================================================
Mixtral         softmax over the top-k logits (= top-k of softmax, renormalised)
Qwen2-MoE,      ``norm_topk_prob``: as Mixtral; else softmax over all experts, then top-k
Qwen3-MoE,      (``moe_router_pre_softmax``); Qwen2-MoE adds ``sigmoid(x·g) * shared(x)``
OLMoE
DeepSeek-V2     ``topk_method="greedy"``: pre-softmax top-k times ``routed_scaling_factor``;
                ``"group_limited_greedy"`` when ``top_k // topk_group == 1`` (a group's score is
                its best expert: Megatron's sum of the top ``top_k // topk_group``); fp32 logits
DeepSeek-V3     sigmoid scores plus ``e_score_correction_bias`` for the choice, groups scored by
                their top-2 sum (``top_k // topk_group == 2``, or no group limit), probs
                renormalised (``norm_topk_prob``) then times ``routed_scaling_factor``; fp32
==============  ==================================================================================

Anything else raises :class:`UnsupportedMoEBlockError` naming the family and the rule moe-core
lacks (nothing is approximated). moe-core's own aux loss and z-loss can be switched on
(``aux_loss_coeff``, ``z_loss_coeff``): their gradients reach the routers through moe-core's
autoscaler, and their values are put on the model's output as ``moe_core_losses``.
"""
import functools
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from moe_core import ops
from moe_core.config import MoEConfig
from moe_core.experts import GroupedMLP
from moe_core.hf.backend import activation_of
from moe_core.layer import MoELayer
from moe_core.router import TopKRouter

_ACTIVATION_FUNCS: Dict[str, Callable] = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_tanh": functools.partial(F.gelu, approximate="tanh"),
    "relu": F.relu,
}


class UnsupportedMoEBlockError(ValueError):
    """A sparse-MoE block whose routing or expert layout moe-core's MoELayer cannot reproduce
    exactly."""


# ---- the router: TopKRouter, visible to HF as the family's router class ---------------------
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
    Instances are made by :func:`_router_class`, whose class also derives from the family's HF
    router class.
    """

    @property
    def expert_bias(self) -> Optional[torch.Tensor]:
        # HF's name for DeepSeek-V3's expert bias (a buffer of the HF router, loaded as is);
        # HF keeps it fp32, but a model cast with .to(dtype) rounds it: the score math is fp32
        bias = self._buffers.get("e_score_correction_bias")
        return bias if bias is None or bias.dtype == torch.float32 else bias.float()

    @expert_bias.setter
    def expert_bias(self, value: Optional[torch.Tensor]) -> None:
        if value is not None:
            raise AttributeError("the expert bias of an HF router is its e_score_correction_bias "
                                 "buffer")

    def gating(self, inp: torch.Tensor) -> torch.Tensor:
        logits = super().gating(inp)
        self._logits = logits  # handed to HF by forward (TopKRouter.forward keeps them local)
        return logits

    def forward(self, hidden: torch.Tensor, padding_mask: Optional[torch.Tensor] = None
                ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Route ``hidden`` ``[T, H]``; see the class docstring for the outputs."""
        probs, routing_map = TopKRouter.forward(self, hidden, padding_mask)
        logits, self._logits = self._logits, None
        return logits.reshape(-1, self.config.num_moe_experts), probs, routing_map


_ROUTER_PREFIX = "MoECoreRouter__"


@functools.lru_cache(maxsize=None)
def _router_class(hf_router_cls: type) -> type:
    """The router class for one HF router class: ``MoECoreRouter`` first (its forward and
    TopKRouter's state), the HF class last (for ``isinstance``, which HF's output recording
    uses). Its name encodes the HF class's module and name, so pickle finds it again
    (see ``__getattr__``)."""
    name = (_ROUTER_PREFIX + hf_router_cls.__module__.replace(".", "__DOT__") + "__CLS__"
            + hf_router_cls.__name__)
    cls = type(name, (MoECoreRouter, _StopInit, hf_router_cls), {"__module__": __name__})
    cls.__qualname__ = name
    return cls


def __getattr__(name: str):
    # a pickled swapped model names its router class; make it again from that name
    if name.startswith(_ROUTER_PREFIX):
        import importlib

        module, _, cls = name[len(_ROUTER_PREFIX):].partition("__CLS__")
        hf_cls = getattr(importlib.import_module(module.replace("__DOT__", ".")), cls)
        return _router_class(hf_cls)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ---- the experts: GroupedMLP on HF's parameters ----------------------------------------------
class HFGroupedMLP(GroupedMLP):
    """GroupedMLP whose weights are an HF experts module's Parameters, under HF's names.

    Parameters: ``gate_up_proj`` ``[E, 2F, H]`` (gate rows first; GroupedMLP's ``weight1``) and
    ``down_proj`` ``[E, H, F]`` (``weight2``), in the model's dtype. ``weight1`` / ``weight2`` read
    the attributes at every call, so a parametrization (PEFT LoRA) of them is used.
    """

    def __init__(self, config: MoEConfig, gate_up_proj: nn.Parameter, down_proj: nn.Parameter):
        # GroupedMLP.__init__ would allocate and initialise a second copy of the weights
        nn.Module.__init__(self)
        self.config = config
        self.ep_size, self.ep_rank = 1, 0
        self.num_local_experts = config.num_moe_experts
        self.gate_up_proj = gate_up_proj
        self.down_proj = down_proj
        self.register_parameter("bias1", None)
        self.register_parameter("bias2", None)
        for p in (gate_up_proj, down_proj):
            p.expert_parallel_size = 1  # read by moe_core.parallel.all_reduce_gradients

    @property
    def weight1(self) -> torch.Tensor:
        return self.gate_up_proj

    @property
    def weight2(self) -> torch.Tensor:
        return self.down_proj

    def reset_parameters(self) -> None:
        raise RuntimeError("HFGroupedMLP holds an HF model's weights: initialise them in HF")


# ---- the block --------------------------------------------------------------------------------
class MoECoreSparseMoeBlock(MoELayer):
    """A MoELayer standing in for an HF sparse-MoE block (see the module docstring).

    ``forward(hidden_states [B, S, H]) -> [B, S, H]`` in the input's dtype, as the HF block.
    Submodules (HF's names): ``gate`` (the router; also reachable as ``router``, MoELayer's name),
    ``experts``, and the family's shared expert modules, which are HF's own.
    """

    def __init__(self, config: MoEConfig, gate: MoECoreRouter, experts: HFGroupedMLP,
                 family: str, shared: Optional[Dict[str, nn.Module]] = None):
        # MoELayer's own router and experts are built on the meta device (no memory, no init
        # work) and replaced by the ones holding HF's parameters
        with torch.device("meta"):
            super().__init__(config)
        del self.router
        self.gate = gate
        self.experts = experts
        self.family = family
        self.shared_kind = None
        for name, module in (shared or {}).items():
            setattr(self, name, module)
        if shared:
            self.shared_kind = "gated" if "shared_expert_gate" in shared else "plain"

    @property
    def router(self) -> MoECoreRouter:
        """MoELayer's name for the router (what moe_core.finalize_step reads)."""
        return self.gate

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        _, probs, routing_map = self.gate(x)
        rows, row_probs, sorted_indices, offsets, _ = ops.permute(
            x, routing_map, probs, num_out_tokens=self.num_permuted_rows(x.shape[0]))
        y = self.experts(rows, offsets, row_probs, x, sorted_indices)
        out = ops.unpermute(y, sorted_indices, restore_shape=x.shape)
        if self.shared_kind == "gated":  # Qwen2-MoE: sigmoid(x·g) * shared(x)
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        elif self.shared_kind == "plain":  # DeepSeek: shared experts added as they are
            out = out + self.shared_experts(x)
        return out.reshape(shape)

    def extra_repr(self) -> str:
        return f"family={self.family}, " + super().extra_repr()


# ---- per-family rules -------------------------------------------------------------------------
def _unsupported(family: str, why: str) -> UnsupportedMoEBlockError:
    return UnsupportedMoEBlockError(
        f"replace_moe_blocks: {family} cannot be swapped exactly: {why}. Use the experts backend "
        f"(moe_core.hf.register_experts_backend(); experts_implementation='moe_core'), which keeps "
        f"HF's router, for this family.")


def _activation(family: str, experts: nn.Module) -> Callable:
    name = activation_of(getattr(experts, "act_fn", None))
    if name not in _ACTIVATION_FUNCS:
        raise _unsupported(family, f"its expert activation {type(experts.act_fn).__name__} has no "
                                   f"exact moe-core counterpart (known: {sorted(_ACTIVATION_FUNCS)})")
    return _ACTIVATION_FUNCS[name]


def _softmax_rules(family: str, block: nn.Module, normalize: bool) -> dict:
    k = block.gate.top_k
    if k == 1 and normalize:
        raise _unsupported(family, "top-1 routing with renormalised probs gives every token the "
                                   "prob 1.0 (no router gradient); moe-core rejects that config")
    return dict(moe_router_score_function="softmax", moe_router_pre_softmax=not normalize)


def _mixtral_rules(block: nn.Module) -> dict:
    if getattr(block, "jitter_noise", 0.0):
        raise _unsupported("mixtral", f"router_jitter_noise={block.jitter_noise} jitters the "
                                      "experts' input too, while moe-core's input jitter "
                                      "(moe_input_jitter_eps) jitters the router's input only")
    return _softmax_rules("mixtral", block, normalize=True)


def _qwen_olmoe_rules(family: str) -> Callable[[nn.Module], dict]:
    def rules(block: nn.Module) -> dict:
        return _softmax_rules(family, block, normalize=bool(block.gate.norm_topk_prob))
    return rules


def _deepseek_v2_rules(block: nn.Module) -> dict:
    gate = block.gate
    rules = dict(moe_router_score_function="softmax", moe_router_pre_softmax=True,
                 moe_router_dtype="fp32",
                 moe_router_topk_scaling_factor=float(gate.routed_scaling_factor))
    if gate.topk_method == "greedy":
        return rules
    if gate.topk_method == "group_limited_greedy":
        if gate.top_k // gate.topk_group != 1:
            raise _unsupported("deepseek_v2", f"group_limited_greedy scores a group by its best "
                               f"expert; moe-core sums the top top_k // topk_group = "
                               f"{gate.top_k // gate.topk_group} experts of each group")
        return dict(rules, moe_router_num_groups=int(gate.num_group),
                    moe_router_group_topk=int(gate.topk_group))
    raise _unsupported("deepseek_v2", f"topk_method={gate.topk_method!r} has no moe-core rule")


def _deepseek_v3_rules(block: nn.Module) -> dict:
    gate = block.gate
    if gate.top_k > 1 and not gate.norm_topk_prob:
        raise _unsupported("deepseek_v3", "norm_topk_prob=False: moe-core (as Megatron) always "
                                          "renormalises sigmoid top-k probs")
    rules = dict(moe_router_score_function="sigmoid", moe_router_dtype="fp32",
                 moe_router_topk_scaling_factor=float(gate.routed_scaling_factor))
    G, gk = int(gate.num_group), int(gate.topk_group)
    if G > 1 and gk < G:
        if gate.top_k // gk != 2:
            raise _unsupported("deepseek_v3", f"groups are scored by their top-2 sum; moe-core "
                               f"sums the top top_k // topk_group = {gate.top_k // gk}")
        rules.update(moe_router_num_groups=G, moe_router_group_topk=gk)
    return rules


# block class name -> (family, routing rules, expert-count attribute of the router, shared modules)
_FAMILIES: Dict[str, Tuple[str, Callable[[nn.Module], dict], Tuple[str, ...]]] = {
    "MixtralSparseMoeBlock": ("mixtral", _mixtral_rules, ()),
    "Qwen2MoeSparseMoeBlock": ("qwen2_moe", _qwen_olmoe_rules("qwen2_moe"),
                               ("shared_expert", "shared_expert_gate")),
    "Qwen3MoeSparseMoeBlock": ("qwen3_moe", _qwen_olmoe_rules("qwen3_moe"), ()),
    "OlmoeSparseMoeBlock": ("olmoe", _qwen_olmoe_rules("olmoe"), ()),
    "DeepseekV2Moe": ("deepseek_v2", _deepseek_v2_rules, ("shared_experts",)),
    "DeepseekV3MoE": ("deepseek_v3", _deepseek_v3_rules, ("shared_experts",)),
}

# blocks known not to fit, with the rule moe-core lacks
_UNSUPPORTED: Dict[str, Tuple[str, str]] = {
    "GptOssMLP": ("gpt_oss", "its experts are stored transposed ([E, H, 2F]) with gate and up "
                  "columns interleaved and biases, while MoELayer's GroupedMLP takes [E, 2F, H] "
                  "gate-first weights; its router's bias would also need add_bias_linear on the "
                  "experts' layout"),
    "Llama4TextMoe": ("llama4", "it runs every expert on every token with the input scaled by "
                      "sigmoid(top-1 logit) and stores gate_up_proj as [E, H, 2F]; MoELayer's "
                      "GroupedMLP takes [E, 2F, H]"),
}


def _is_sparse_moe_block(module: nn.Module) -> bool:
    """A block holding an HF experts module (one that HF's experts interface dispatches)."""
    experts = module._modules.get("experts")
    return experts is not None and "_is_expert_parallel" in experts.__dict__


def _build_block(block: nn.Module, family: str, rules: dict, shared_names: Tuple[str, ...],
                 aux_loss_coeff: float, z_loss_coeff: Optional[float]) -> MoECoreSparseMoeBlock:
    gate, experts = block.gate, block.experts
    if "_is_expert_parallel" not in experts.__dict__:
        raise UnsupportedMoEBlockError(
            f"replace_moe_blocks: the experts of a {family} block are a {type(experts).__name__}, "
            f"not HF's experts module (a PEFT or other wrapper?): swap the blocks first, then wrap "
            f"the model")
    if experts._is_expert_parallel:
        raise _unsupported(family, "the block is sharded by HF's expert parallelism; moe-core's "
                                   "own (MoEConfig.expert_model_parallel_size) is separate")
    W1, W2 = experts.gate_up_proj, experts.down_proj
    E, F1, H = W1.shape
    if getattr(gate, "bias", None) is not None:
        raise _unsupported(family, "its router has a bias; moe-core's router bias comes with "
                                   "add_bias_linear, which also adds expert biases")
    cfg = MoEConfig(
        hidden_size=H, num_moe_experts=E, moe_ffn_hidden_size=F1 // 2,
        moe_router_topk=int(gate.top_k), add_bias_linear=False, gated_linear_unit=True,
        activation_func=_activation(family, experts), params_dtype=W1.dtype,
        moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=float(aux_loss_coeff),
        moe_z_loss_coeff=z_loss_coeff, **rules)
    with torch.device(gate.weight.device):
        router = _router_class(type(gate))(cfg)
    router.weight = gate.weight  # HF's Parameter object (and its dtype: fp32 for DeepSeek)
    bias = gate._buffers.get("e_score_correction_bias")
    if bias is not None:
        router.register_buffer("e_score_correction_bias", bias)
    shared = {n: getattr(block, n) for n in shared_names}
    new = MoECoreSparseMoeBlock(cfg, router, HFGroupedMLP(cfg, W1, W2), family, shared)
    # the HF block's child order, so that state_dict() lists the keys in HF's order
    order = [n for n, _ in block.named_children() if n in new._modules]
    new._modules = type(new._modules)((n, new._modules[n]) for n in
                                      order + [n for n in new._modules if n not in order])
    new.train(block.training)
    return new


def replace_moe_blocks(model: nn.Module, aux_loss_coeff: float = 0.0,
                       z_loss_coeff: Optional[float] = None) -> int:
    """Swap every sparse-MoE block of a supported family for a :class:`MoECoreSparseMoeBlock`.

    Args:
        model: an HF model (any module tree holding the blocks).
        aux_loss_coeff: moe-core's micro-batch load-balancing loss coefficient on each swapped
            block (0: off; HF's own ``router_aux_loss_coef`` is unaffected either way).
        z_loss_coeff: moe-core's router z-loss coefficient, or None for off.

    Returns:
        The number of blocks replaced (0 when the model has no sparse-MoE block).

    Raises:
        UnsupportedMoEBlockError: a block of a family (or a configuration) moe-core cannot swap
            exactly; nothing is replaced then.
    """
    found: List[Tuple[nn.Module, str, nn.Module, str, dict, Tuple[str, ...]]] = []
    for parent_name, parent in model.named_modules():
        for name, child in parent.named_children():
            cls = type(child).__name__
            if isinstance(child, MoECoreSparseMoeBlock):
                continue
            if cls in _UNSUPPORTED:
                raise _unsupported(*_UNSUPPORTED[cls])
            if cls in _FAMILIES:
                family, rule, shared_names = _FAMILIES[cls]
                found.append((parent, name, child, family, rule(child), shared_names))
            elif _is_sparse_moe_block(child):
                model_type = getattr(getattr(model, "config", None), "model_type", "?")
                raise _unsupported(f"{cls} (model_type {model_type!r})",
                                   "moe-core has no routing rule registered for this block")
    # every check passes before anything is replaced
    built = [(parent, name, _build_block(child, family, rules, shared_names, aux_loss_coeff,
                                         z_loss_coeff))
             for parent, name, child, family, rules, shared_names in found]
    for parent, name, new in built:
        setattr(parent, name, new)
    if built:
        _after_swap(model, [new for _, _, new in built])
    return len(built)


# ---- HF's output recording and the reported losses ----------------------------------------------
def _after_swap(model: nn.Module, blocks: List[MoECoreSparseMoeBlock]) -> None:
    """Keep ``output_router_logits`` working and report moe-core's losses on the output."""
    from transformers.utils.output_capturing import install_output_capuring_hook

    hooked = set()
    for sub in model.modules():
        # HF installs its recording hooks once per model; where that already happened, the new
        # routers get theirs now (elsewhere they get them with the rest, by class), once each
        if getattr(sub, "_output_capturing_hooks_installed", False):
            inside = {id(m) for m in sub.modules()}
            for block in blocks:
                if id(block) in inside and id(block) not in hooked:
                    install_output_capuring_hook(block.gate, "router_logits", 0)
                    hooked.add(id(block))
    if any(b.config.moe_z_loss_coeff is not None or any(b.config.aux_loss_coeffs)
           for b in blocks) and not getattr(model, "_moe_core_loss_hook", False):
        model.register_forward_hook(_report_losses)
        model._moe_core_loss_hook = True


def moe_core_losses(model: nn.Module) -> Dict[str, torch.Tensor]:
    """moe-core's losses of the last forward, summed over the swapped blocks.

    Returns:
        ``{name: 0-d fp32 tensor}`` (``load_balancing_loss``, ``z_loss``), each divided by its
        coefficient as moe-core logs them; detached (their gradients were already applied to the
        routers through moe-core's autoscaler in the backward of the main loss).
    """
    out: Dict[str, torch.Tensor] = {}
    for m in model.modules():
        if isinstance(m, MoECoreSparseMoeBlock):
            for name, value in m.gate.last_losses.items():
                out[name] = out[name] + value.float() if name in out else value.float()
    return out


def _report_losses(module: nn.Module, args, output):
    losses = moe_core_losses(module)
    if losses and isinstance(output, dict):
        output["moe_core_losses"] = losses
    return output
