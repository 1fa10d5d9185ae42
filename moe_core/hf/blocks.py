"""Whole-block swap: moe-core's ``MoELayer`` in place of a Hugging Face sparse-MoE block.

:func:`replace_moe_blocks` replaces every sparse-MoE block of a supported family by a
:class:`MoECoreSparseMoeBlock`: a ``MoELayer`` (moe-core's router, permute, grouped experts,
unpermute) that runs on the HF block's own parameters, registered under HF's names:

    gate.weight                [E, H]       the router (MoE-core's TopKRouter; its class is also a
                                            subclass of the family's router class, so HF's output
                                            recording of ``router_logits`` sees it); GPT-OSS and
                                            Llama-4 name it ``router``, GPT-OSS adds
                                            ``router.bias`` [E]
    gate.e_score_correction_bias [E]        DeepSeek-V3's expert bias (a buffer, as in HF)
    gate.moe_statics.e_score_correction_bias [1, E]
                                            Ernie-4.5's (a frozen Parameter of HF's own
                                            moe_statics module)
    experts.gate_up_proj       [E, 2F, H]   gate rows first: GroupedMLP's ``weight1`` as is
                                            (GPT-OSS: [E, H, 2F], gate and up columns interleaved,
                                            with ``gate_up_proj_bias`` [E, 2F]; Llama-4:
                                            [E, H, 2F], gate columns then up columns)
    experts.down_proj          [E, H, F]    GroupedMLP's ``weight2`` (GPT-OSS: [E, F, H], with
                                            ``down_proj_bias`` [E, H]; Llama-4: [E, F, H])
    shared_expert.*, shared_expert_gate.*   Qwen2-MoE's shared expert and its sigmoid gate;
                                            Llama-4's shared expert (no gate)
    shared_experts.*                        DeepSeek's and Ernie-4.5's shared experts

The Parameter objects are HF's (nothing is copied), so ``state_dict()`` has the HF block's keys
and shapes and loads both ways, and PEFT's ``target_parameters`` LoRA (a parametrization of
``experts.gate_up_proj`` / ``experts.down_proj``) is read at every forward. The block returns what
the HF block returns (a tensor of the input's shape; GPT-OSS: with the router scores; Llama-4:
the flat tokens with the router logits) and the router returns HF's ``(router_logits, probs,
routing_map)`` (Llama-4: ``(probs, router_logits, routing_map)``, as its HF router puts the
logits second), so ``output_router_logits=True`` records the same logits and HF's
``load_balancing_loss_func`` gives the same aux loss.

The routing rules of each family, and what the swap refuses (raising
:class:`UnsupportedMoEBlockError`), are in :mod:`moe_core.hf.families`. moe-core's own aux loss
and z-loss can be switched on (``aux_loss_coeff``, ``z_loss_coeff``): their gradients reach the
routers through moe-core's autoscaler, and their values are put on the model's output as
``moe_core_losses``. :mod:`moe_core.hf.patching` has ``from_pretrained`` / ``from_config``
build these blocks directly.
"""
import functools
import warnings
from typing import Dict, List, Optional, Tuple

import torch
from torch import nn

from moe_core.config import MoEConfig
from moe_core.hf.backend import gate_spec
from moe_core.hf.experts import (HFGroupedMLP, HFLlama4GroupedMLP, HFTransposedGroupedMLP,
                                 _experts_class)
from moe_core.hf.families import (_FAMILIES, _GATE_NAMES, _LOGITS_INDEX, _UNDISPATCHED_EXPERTS,
                                  UnsupportedMoEBlockError, _activation, _sigmoid_gate,
                                  _unsupported)
from moe_core.hf.router import MoECoreRouter, _router_class
from moe_core.layer import MoELayer, unflattened


def __getattr__(name: str):
    # a swapped model pickled when this module made the run-time router and experts classes
    # names them here: the modules that make them resolve those names
    from moe_core.hf import experts, router

    if name.startswith(router._ROUTER_PREFIX):
        return getattr(router, name)
    if name.startswith(experts._EXPERTS_PREFIX):
        return getattr(experts, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ---- the block --------------------------------------------------------------------------------
class MoECoreSparseMoeBlock(MoELayer):
    """A MoELayer standing in for an HF sparse-MoE block (see the module docstring).

    ``forward(hidden_states [B, S, H]) -> [B, S, H]`` in the input's dtype, as the HF block
    (GPT-OSS and Llama-4 return a pair, as theirs do). Submodules (HF's names): ``gate`` (the
    router; also reachable as ``router``, MoELayer's name; GPT-OSS and Llama-4 call it
    ``router``), ``experts``, and the family's shared expert modules, which are HF's own.
    """

    def __init__(self, config: MoEConfig, gate: MoECoreRouter, experts: HFGroupedMLP,
                 family: str, shared: Optional[Dict[str, nn.Module]] = None,
                 gate_name: str = "gate"):
        # MoELayer's own router and experts are built on the meta device (no memory, no init
        # work) and replaced by the ones holding HF's parameters
        with torch.device("meta"):
            super().__init__(config)
        del self.router
        self._gate_name = gate_name  # HF's name of the router: "gate", GPT-OSS's "router"
        self._modules[gate_name] = gate
        self.experts = experts
        self.family = family
        self.shared_kind = None
        shared = {n: m for n, m in (shared or {}).items() if m is not None}
        for name, module in shared.items():
            setattr(self, name, module)
        if shared:
            self.shared_kind = "gated" if "shared_expert_gate" in shared else "plain"
        # the one plain shared module: DeepSeek's / Ernie's shared_experts, Llama-4's shared_expert
        self._plain_shared = next(iter(shared)) if self.shared_kind == "plain" else None

    @property
    def router(self) -> MoECoreRouter:
        """MoELayer's name for the router (what moe_core.finalize_step reads), whatever HF's
        name of it is."""
        return self._modules[self._gate_name]

    def forward(self, hidden_states: torch.Tensor):
        """``[B, S, H] -> [B, S, H]``; GPT-OSS: ``(out, router_scores [B·S, k])`` and Llama-4:
        ``(out [B·S, H], router_logits [B·S, E])``, as HF's."""
        hidden_states = self.router.apply_layer_jitter(hidden_states)
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        routed = self.router(x)
        li = self.router.logits_index
        logits, probs, routing_map = routed[li], routed[1 - li], routed[2]
        out = self.routed_experts(x, probs, routing_map)
        if self.shared_kind == "gated":  # Qwen2-MoE: sigmoid(x·g) * shared(x)
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        elif self.shared_kind == "plain":  # DeepSeek, Ernie, Llama-4: added as they are
            out = out + self._modules[self._plain_shared](x)
        if self.family == "gpt_oss":  # HF's MLP also returns the scores, in its top-k order
            order = logits.topk(self.config.moe_router_topk, dim=-1).indices
            return unflattened(out, shape), probs.gather(1, order)
        if self.family == "llama4":  # HF's block returns the flat tokens and the logits
            return out, logits
        return unflattened(out, shape)

    def extra_repr(self) -> str:
        return f"family={self.family}, " + super().extra_repr()


# ---- the swap ---------------------------------------------------------------------------------
# config fields that count a model's routed experts, across HF's families
_EXPERT_COUNT_FIELDS = ("num_experts", "num_local_experts", "moe_num_experts", "n_routed_experts")


def _declared_experts(config, depth: int = 2) -> Optional[Tuple[str, int]]:
    """``(field, count)`` of the first expert-count field above 1 in an HF config or one of its
    sub-configs (DBRX keeps it in ``ffn_config``), or None (a dense model)."""
    if config is None or depth < 0:
        return None
    for field in _EXPERT_COUNT_FIELDS:
        n = getattr(config, field, None)
        if isinstance(n, int) and not isinstance(n, bool) and n > 1:
            return field, n
    for name, sub in vars(config).items():
        if hasattr(sub, "to_dict") and not isinstance(sub, type):
            found = _declared_experts(sub, depth - 1)
            if found is not None:
                return f"{name}.{found[0]}", found[1]
    return None


def _is_sparse_moe_block(module: nn.Module) -> bool:
    """A block holding an HF experts module (one that HF's experts interface dispatches)."""
    experts = module._modules.get("experts")
    return experts is not None and "_is_expert_parallel" in experts.__dict__


def _build_block(block: nn.Module, family: str, rules: dict, shared_names: Tuple[str, ...],
                 aux_loss_coeff: float, z_loss_coeff: Optional[float],
                 capacity: Optional[dict] = None,
                 hf_experts_class: bool = False) -> MoECoreSparseMoeBlock:
    gate_name = _GATE_NAMES.get(family, "gate")
    gate, experts = getattr(block, gate_name), block.experts
    undispatched = _UNDISPATCHED_EXPERTS.get(family)
    if (type(experts).__name__ != undispatched if undispatched
            else "_is_expert_parallel" not in experts.__dict__):
        raise UnsupportedMoEBlockError(
            f"replace_moe_blocks: the experts of a {family} block are a {type(experts).__name__}, "
            f"not HF's experts module (a PEFT or other wrapper?): swap the blocks first, then wrap "
            f"the model")
    if getattr(experts, "_is_expert_parallel", False):
        raise _unsupported(family, "the block is sharded by HF's expert parallelism; moe-core's "
                                   "own (MoEConfig.expert_model_parallel_size) is separate")
    W1, W2 = experts.gate_up_proj, experts.down_proj
    transposed = getattr(experts, "is_transposed", False)
    if transposed or family == "llama4":  # [E, H, 2F]; GPT-OSS's interleaved, with biases
        E, H, F1 = W1.shape
    else:
        E, F1, H = W1.shape
    router_bias = getattr(gate, "bias", None)
    biased = router_bias is not None or getattr(experts, "has_bias", False)
    if biased and not (transposed and router_bias is not None and experts.has_bias):
        raise _unsupported(family, "its router or its experts have a bias without the other; "
                                   "moe-core's biases come with add_bias_linear, on both")
    spec = None
    if transposed:
        spec = gate_spec(experts)
        glu = dict(activation_func=functools.partial(_sigmoid_gate, alpha=float(experts.alpha)),
                   glu_linear_offset=1.0, activation_func_clamp_value=float(experts.limit))
    else:
        glu = dict(activation_func=_activation(family, experts))
    cfg = MoEConfig(
        hidden_size=H, num_moe_experts=E, moe_ffn_hidden_size=F1 // 2,
        moe_router_topk=int(gate.top_k), add_bias_linear=biased, gated_linear_unit=True,
        params_dtype=W1.dtype, moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=float(aux_loss_coeff), moe_z_loss_coeff=z_loss_coeff, **glu, **rules,
        **(capacity or {}))
    with torch.device(gate.weight.device):
        router = _router_class(type(gate))(cfg)
    router.weight = gate.weight  # HF's Parameter object (and its dtype: fp32 for DeepSeek)
    if router_bias is not None:
        router.bias = router_bias
    bias = gate._buffers.get("e_score_correction_bias")
    if bias is not None:
        router.register_buffer("e_score_correction_bias", bias)
    for name, child in gate.named_children():  # Ernie's moe_statics (its expert bias)
        router.add_module(name, child)
    if family in _LOGITS_INDEX:
        router.logits_index = _LOGITS_INDEX[family]
    shared = {n: getattr(block, n) for n in shared_names}
    if transposed:
        mlp = HFTransposedGroupedMLP(cfg, experts, spec)
    elif family == "llama4":
        mlp = HFLlama4GroupedMLP(cfg, W1, W2)
    else:
        mlp = HFGroupedMLP(cfg, W1, W2)
    if hf_experts_class:
        mlp.__class__ = _experts_class(type(mlp), type(experts))
    new = MoECoreSparseMoeBlock(cfg, router, mlp, family, shared, gate_name)
    # the HF block's child order, so that state_dict() lists the keys in HF's order
    order = [n for n, _ in block.named_children() if n in new._modules]
    new._modules = type(new._modules)((n, new._modules[n]) for n in
                                      order + [n for n in new._modules if n not in order])
    new.train(block.training)
    return new


def _capacity_fields(capacity_factor: Optional[float], pad_to_capacity: bool,
                     drop_policy: str) -> dict:
    """The MoEConfig fields of the swap's capacity options."""
    return dict(moe_expert_capacity_factor=capacity_factor,
                moe_pad_expert_input_to_capacity=bool(pad_to_capacity),
                moe_token_drop_policy=drop_policy)


def replace_moe_blocks(model: nn.Module, aux_loss_coeff: float = 0.0,
                       z_loss_coeff: Optional[float] = None,
                       capacity_factor: Optional[float] = None, pad_to_capacity: bool = False,
                       drop_policy: str = "probs", strict: bool = False) -> int:
    """Swap every sparse-MoE block of a supported family for a :class:`MoECoreSparseMoeBlock`.

    Args:
        model: an HF model (any module tree holding the blocks).
        aux_loss_coeff: moe-core's micro-batch load-balancing loss coefficient on each swapped
            block (0: off; HF's own ``router_aux_loss_coef`` is unaffected either way).
        z_loss_coeff: moe-core's router z-loss coefficient, or None for off.
        capacity_factor: moe-core's expert capacity (``moe_expert_capacity_factor``): each
            expert keeps at most ``ceil(T * k / E * capacity_factor)`` of a forward's T tokens,
            the others' routes are dropped (HF has no such rule: with dropping the block is no
            longer HF's math). None: dropless, as HF.
        pad_to_capacity: ``moe_pad_expert_input_to_capacity``: every expert's rows padded to the
            capacity, so the expert GEMMs' shapes depend on T only (needs ``capacity_factor``).
        drop_policy: ``moe_token_drop_policy``, ``"probs"`` or ``"position"``.
        strict: a model without a sparse-MoE block (nor one swapped before) raises instead of
            warning.

    Returns:
        The number of blocks replaced (0 when the model has no sparse-MoE block, with a
        ``UserWarning`` naming its class and model type: a dense model, or a MoE model whose
        blocks HF names otherwise, is then left as it was).

    Raises:
        UnsupportedMoEBlockError: a block of a family (or a configuration) moe-core cannot swap
            exactly; nothing is replaced then.
        ValueError: ``strict`` and the model has no sparse-MoE block.
    """
    found: List[Tuple[nn.Module, str, nn.Module, str, dict, Tuple[str, ...]]] = []
    swapped_before = False
    for parent_name, parent in model.named_modules():
        for name, child in parent.named_children():
            cls = type(child).__name__
            if isinstance(child, MoECoreSparseMoeBlock):
                swapped_before = True
                continue
            if cls in _FAMILIES:
                family, rule, shared_names = _FAMILIES[cls]
                found.append((parent, name, child, family, rule(child), shared_names))
            elif _is_sparse_moe_block(child):
                model_type = getattr(getattr(model, "config", None), "model_type", "?")
                raise _unsupported(f"{cls} (model_type {model_type!r})",
                                   "moe-core has no routing rule registered for this block")
    # every check passes before anything is replaced
    capacity = _capacity_fields(capacity_factor, pad_to_capacity, drop_policy)
    if not found and not swapped_before:
        model_type = getattr(getattr(model, "config", None), "model_type", None)
        what = f"{type(model).__name__} (model_type {model_type!r})"
        declared = _declared_experts(getattr(model, "config", None))
        if declared is not None:  # a MoE model whose blocks HF builds its own way
            field, n = declared
            experts = sorted({type(m).__name__ for m in model.modules()
                              if "expert" in type(m).__name__.lower()})
            raise UnsupportedMoEBlockError(
                f"replace_moe_blocks: {what} declares {n} experts ({field}) but holds none of "
                f"the sparse-MoE blocks moe-core swaps (its expert modules: {experts}): moe-core "
                f"has no rule for this family, and HF does not run its experts through the "
                f"experts interface, so the experts backend does not apply either")
        if strict:
            raise ValueError(f"replace_moe_blocks: {what} has no sparse-MoE block to replace")
        warnings.warn(f"replace_moe_blocks: {what} has no sparse-MoE block; nothing replaced "
                      f"(strict=True raises instead)", UserWarning, stacklevel=2)
    built = [(parent, name, _build_block(child, family, rules, shared_names, aux_loss_coeff,
                                         z_loss_coeff, capacity))
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
                    install_output_capuring_hook(block.router, "router_logits",
                                                 block.router.logits_index)
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
            for name, value in m.router.last_losses.items():
                out[name] = out[name] + value.float() if name in out else value.float()
    return out


def _report_losses(module: nn.Module, args, output):
    losses = moe_core_losses(module)
    if losses and isinstance(output, dict):
        output["moe_core_losses"] = losses
    return output
