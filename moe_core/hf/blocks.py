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

Routing rules per family, each one of moe-core's rules (MoEConfig), op for op HF's:

==============  ==================================================================================
Mixtral         softmax over all experts, top-k, renormalised (``moe_router_pre_softmax`` +
                ``moe_router_norm_topk_prob=True``); ``router_jitter_noise`` is
                ``moe_input_jitter_eps`` with ``moe_input_jitter_mode="layer"`` (router and
                experts see the same jittered input, in training only, HF's draw)
Qwen2-MoE,      ``norm_topk_prob``: as Mixtral; else softmax over all experts, then top-k
Qwen3-MoE,      (``moe_router_pre_softmax``); Qwen2-MoE adds ``sigmoid(x·g) * shared(x)``
OLMoE
DeepSeek-V2     ``topk_method="greedy"``: pre-softmax top-k times ``routed_scaling_factor``;
                ``"group_limited_greedy"``: groups scored by their best expert
                (``moe_router_group_score_topk=1``, any top_k); fp32 logits
DeepSeek-V3,     sigmoid scores plus ``e_score_correction_bias`` for the choice, groups scored by
GLM-4.5         their top-2 sum (``moe_router_group_score_topk=2``, any top_k), probs divided by
                their sum + 1e-20 or not (``norm_topk_prob`` -> ``moe_router_norm_topk_prob``)
                then times ``routed_scaling_factor``; fp32
GPT-OSS         top-k of the logits of the router linear with its bias (``add_bias_linear``),
                softmax over the k (post-softmax); the experts run on HF's transposed,
                interleaved weights with their biases and the clamped SwiGLU
Ernie-4.5-MoE   fp32 softmax over all experts, ``e_score_correction_bias`` added for the choice
                only (softmax-pre with a selection bias), the chosen probs renormalised; HF
                divides by ``max(sum, moe_norm_min)``, moe-core by ``sum + 1e-20``: the same
                wherever the sum reaches ``moe_norm_min`` (a documented difference below it,
                see :func:`_ernie45_rules`); shared experts
Llama-4         top-1 (``num_experts_per_tok > 1`` is refused), sigmoid of the chosen logit,
                not renormalised, applied to the expert's input (``moe_apply_probs_on_input``);
                experts on HF's [E, in, out] weights as they are; the shared expert. HF ranks
                logits, moe-core fp32 sigmoid scores: tokens whose best two logits share an
                fp32 sigmoid go to the lower index (a documented difference, see
                :func:`_llama4_rules`)
==============  ==================================================================================

Anything else raises :class:`UnsupportedMoEBlockError` naming the family and the rule moe-core
lacks (nothing is approximated beyond the two documented corner cases above, each pinned by a
test in tests/hf/test_blocks.py). moe-core's own aux loss and z-loss can be switched on
(``aux_loss_coeff``, ``z_loss_coeff``): their gradients reach the routers through moe-core's
autoscaler, and their values are put on the model's output as ``moe_core_losses``.

:func:`register_patch_mapping` (transformers' ``register_patch_mapping`` with
:func:`patch_mapping`) builds the same blocks inside ``from_pretrained`` / ``from_config``: each
family's block class name maps to a class that builds HF's block and returns it swapped.
"""
import functools
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from moe_core import ops
from moe_core.config import MoEConfig
from moe_core.hf.backend import activation_of, gate_spec
from moe_core.hf.experts import (HFGroupedMLP, HFLlama4GroupedMLP, HFTransposedGroupedMLP,
                                 _experts_class)
from moe_core.hf.router import MoECoreRouter, _router_class
from moe_core.layer import MoELayer

_ACTIVATION_FUNCS: Dict[str, Callable] = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_tanh": functools.partial(F.gelu, approximate="tanh"),
    "relu": F.relu,
}


class UnsupportedMoEBlockError(ValueError):
    """A sparse-MoE block whose routing or expert layout moe-core's MoELayer cannot reproduce
    exactly."""


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
        rows, row_probs, sorted_indices, offsets, _ = ops.permute(
            x, routing_map, probs, num_out_tokens=self.num_permuted_rows(x.shape[0]))
        y = self.experts(rows, offsets, row_probs, x, sorted_indices)
        out = ops.unpermute(y, sorted_indices, restore_shape=x.shape)
        if self.shared_kind == "gated":  # Qwen2-MoE: sigmoid(x·g) * shared(x)
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        elif self.shared_kind == "plain":  # DeepSeek, Ernie, Llama-4: added as they are
            out = out + self._modules[self._plain_shared](x)
        if self.family == "gpt_oss":  # HF's MLP also returns the scores, in its top-k order
            order = logits.topk(self.config.moe_router_topk, dim=-1).indices
            return out.reshape(shape), probs.gather(1, order)
        if self.family == "llama4":  # HF's block returns the flat tokens and the logits
            return out, logits
        return out.reshape(shape)

    def extra_repr(self) -> str:
        return f"family={self.family}, " + super().extra_repr()


# ---- per-family rules -------------------------------------------------------------------------
def _unsupported(family: str, why: str) -> UnsupportedMoEBlockError:
    return UnsupportedMoEBlockError(
        f"replace_moe_blocks: {family} cannot be swapped exactly: {why}. Use the experts backend "
        f"(moe_core.hf.register_experts_backend(); experts_implementation='moe_core'), which keeps "
        f"HF's router, for this family.")


def _sigmoid_gate(x: torch.Tensor, alpha: float) -> torch.Tensor:
    """GPT-OSS's gate activation ``x * sigmoid(alpha x)`` (MoEConfig's description of the
    experts; HFTransposedGroupedMLP computes it with ops.glu_probs or HF's own code)."""
    return x * torch.sigmoid(alpha * x)


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
    # HF: softmax over all experts in fp32, top-k, divided by the sum when normalising (the
    # + 1e-20 of moe-core's renormalisation leaves an fp32 sum >= 1/E unchanged)
    return dict(moe_router_score_function="softmax", moe_router_pre_softmax=True,
                moe_router_norm_topk_prob=True if normalize else None)


def _mixtral_rules(block: nn.Module) -> dict:
    rules = _softmax_rules("mixtral", block, normalize=True)
    eps = float(getattr(block, "jitter_noise", 0.0) or 0.0)
    if eps:
        if not 0.0 < eps < 1.0:
            raise _unsupported("mixtral", f"router_jitter_noise={eps} is outside (0, 1)")
        rules.update(moe_input_jitter_eps=eps, moe_input_jitter_mode="layer")
    return rules


def _qwen_olmoe_rules(family: str) -> Callable[[nn.Module], dict]:
    def rules(block: nn.Module) -> dict:
        return _softmax_rules(family, block, normalize=bool(block.gate.norm_topk_prob))
    return rules


def _kept_groups(family: str, E: int, k: int, G: int, gk: int) -> None:
    """HF masks the experts of the dropped groups (to 0 or -inf) and still takes k: with fewer
    than k experts in the kept groups it would route to masked ones, which moe-core refuses."""
    if E % G != 0 or gk * (E // G) < k:
        raise _unsupported(family, f"n_group={G}, topk_group={gk}: the kept groups hold "
                                   f"{gk * (E // G) if E % G == 0 else '?'} of {E} experts, "
                                   f"fewer than num_experts_per_tok={k}")


def _deepseek_v2_rules(block: nn.Module) -> dict:
    gate = block.gate
    rules = dict(moe_router_score_function="softmax", moe_router_pre_softmax=True,
                 moe_router_dtype="fp32",
                 moe_router_topk_scaling_factor=float(gate.routed_scaling_factor))
    if gate.topk_method == "greedy":
        return rules
    if gate.topk_method == "group_limited_greedy":
        G, gk = int(gate.num_group), int(gate.topk_group)
        _kept_groups("deepseek_v2", int(gate.num_experts), int(gate.top_k), G, gk)
        if gk >= G:  # every group kept: greedy
            return rules
        # a group's score is its best expert
        return dict(rules, moe_router_num_groups=G, moe_router_group_topk=gk,
                    moe_router_group_score_topk=1)
    raise _unsupported("deepseek_v2", f"topk_method={gate.topk_method!r} has no moe-core rule")


def _deepseek_v3_rules(block: nn.Module, family: str = "deepseek_v3") -> dict:
    """DeepSeek-V3's router, also GLM-4.5's (Glm4MoeTopkRouter: the same math)."""
    gate = block.gate
    k = int(gate.top_k)
    if k == 1 and gate.norm_topk_prob:
        raise _unsupported(family, "top-1 routing with norm_topk_prob gives every token the prob "
                                   "1.0 (no router gradient); moe-core rejects that config")
    # HF divides by (sum + 1e-20) for every top_k when norm_topk_prob (Megatron only for k > 1)
    rules = dict(moe_router_score_function="sigmoid", moe_router_dtype="fp32",
                 moe_router_topk_scaling_factor=float(gate.routed_scaling_factor),
                 moe_router_norm_topk_prob=bool(gate.norm_topk_prob))
    G, gk = int(gate.num_group), int(gate.topk_group)
    if G > 1 and gk < G:
        _kept_groups(family, int(gate.num_experts), k, G, gk)
        # groups scored by the sum of their top two, whatever top_k is
        rules.update(moe_router_num_groups=G, moe_router_group_topk=gk,
                     moe_router_group_score_topk=2)
    return rules


def _gpt_oss_rules(block: nn.Module) -> dict:
    # the top-k of the biased logits, then a softmax over the k (post-softmax, Megatron's
    # default); the router linear's bias comes with add_bias_linear (the experts' biases too)
    if block.router.top_k == 1:
        raise _unsupported("gpt_oss", "top-1 routing gives every token the prob 1.0 (a softmax "
                                      "over one logit: no router gradient); moe-core rejects "
                                      "that config")
    return dict(moe_router_score_function="softmax", moe_router_pre_softmax=False)


def _ernie45_rules(block: nn.Module) -> dict:
    """Ernie-4.5-MoE's router (Ernie4_5_MoeTopKRouter): fp32 logits, a softmax over all experts,
    the top-k of the softmax plus ``e_score_correction_bias`` (the bias for the choice only), the
    chosen experts' unbiased softmax values divided by ``clamp(sum, min=moe_norm_min)``: moe-core's
    softmax-pre with a selection bias (``moe_router_pre_softmax``, the bias read from HF's
    ``moe_statics``) and ``moe_router_norm_topk_prob=True``, in fp32.

    A documented difference: moe-core divides by ``sum + 1e-20`` (Megatron's renormalisation),
    not by ``max(sum, moe_norm_min)``. In fp32 the 1e-20 is below half an ulp of any sum from
    2**-42 (2.3e-13) up, so the two agree exactly wherever the chosen probs sum to at least
    ``moe_norm_min`` (HF's default, 1e-12, included). Below it, HF's weights sum to
    ``sum / moe_norm_min < 1`` and moe-core's to 1. Without the bias the chosen probs sum to at
    least ``top_k / num_experts``, so that happens only where the bias picks experts the softmax
    gives almost nothing (with 1e-12: about 28 nats below the best expert's logit). A
    ``moe_norm_min`` above ``top_k / num_experts`` would change ordinary tokens too, and is
    refused.
    """
    gate = block.gate
    k, E, norm_min = int(gate.top_k), int(gate.num_experts), float(gate.norm_min)
    if k == 1:
        raise _unsupported("ernie4_5_moe", "top-1 routing renormalised by its own prob gives every "
                                           "token the prob 1.0 (no router gradient); moe-core "
                                           "rejects that config")
    if norm_min > k / E:
        raise _unsupported("ernie4_5_moe", f"moe_norm_min={norm_min} is above top_k / num_experts "
                                           f"= {k / E:g}: HF's clamp of the renormalising sum "
                                           f"would act on ordinary tokens, and moe-core "
                                           f"renormalises by sum + 1e-20")
    return dict(moe_router_score_function="softmax", moe_router_pre_softmax=True,
                moe_router_dtype="fp32", moe_router_norm_topk_prob=True)


def _llama4_rules(block: nn.Module) -> dict:
    """Llama-4's router (Llama4Router) and block (Llama4TextMoe): the top-1 logit's sigmoid (in
    fp32, cast to the model's dtype, not renormalised) scales the chosen expert's input; HF runs
    every expert on every token, but the others' inputs are scaled by sigmoid(-inf) = 0 and an
    expert without biases maps 0 to 0, so that is top-1 routing with the probs on the input:
    ``moe_router_score_function="sigmoid"``, ``moe_router_norm_topk_prob=False``,
    ``moe_apply_probs_on_input``. The shared expert is added to the output.

    A documented difference: HF ranks the logits, moe-core the fp32 sigmoid scores (Megatron's
    order), with ties to the lower expert index. A token whose two best logits have the same fp32
    sigmoid (both above ~16.6, where it rounds to 1.0, or, below that, closer than the sigmoid's
    rounding resolves) goes to the lower-indexed of the two, with the same weight, where HF takes
    the larger logit. HF allows ``num_experts_per_tok > 1`` (each chosen expert's input scaled by
    its own sigmoid); moe-core applies probs on the input for top-1 only, so that is refused.
    """
    k = int(block.router.top_k)
    if k != 1:
        raise _unsupported("llama4", f"num_experts_per_tok={k}: HF scales the input of each of "
                                     f"the k chosen experts by its sigmoid score, and moe-core "
                                     f"applies the probs on the input (moe_apply_probs_on_input) "
                                     f"for top-1 routing only")
    return dict(moe_router_score_function="sigmoid", moe_router_norm_topk_prob=False,
                moe_apply_probs_on_input=True)


# block class name -> (family, routing rules, shared modules)
_FAMILIES: Dict[str, Tuple[str, Callable[[nn.Module], dict], Tuple[str, ...]]] = {
    "MixtralSparseMoeBlock": ("mixtral", _mixtral_rules, ()),
    "Qwen2MoeSparseMoeBlock": ("qwen2_moe", _qwen_olmoe_rules("qwen2_moe"),
                               ("shared_expert", "shared_expert_gate")),
    "Qwen3MoeSparseMoeBlock": ("qwen3_moe", _qwen_olmoe_rules("qwen3_moe"), ()),
    "OlmoeSparseMoeBlock": ("olmoe", _qwen_olmoe_rules("olmoe"), ()),
    "DeepseekV2Moe": ("deepseek_v2", _deepseek_v2_rules, ("shared_experts",)),
    "DeepseekV3MoE": ("deepseek_v3", _deepseek_v3_rules, ("shared_experts",)),
    "Glm4MoeMoE": ("glm4_moe", functools.partial(_deepseek_v3_rules, family="glm4_moe"),
                   ("shared_experts",)),
    "GptOssMLP": ("gpt_oss", _gpt_oss_rules, ()),
    "Ernie4_5_MoeSparseMoeBlock": ("ernie4_5_moe", _ernie45_rules, ("shared_experts",)),
    "Llama4TextMoe": ("llama4", _llama4_rules, ("shared_expert",)),
}

# the families whose router is not called "gate"
_GATE_NAMES = {"gpt_oss": "router", "llama4": "router"}

# the families whose experts module HF does not dispatch through its experts interface (no
# use_experts_implementation flags): the class it must be
_UNDISPATCHED_EXPERTS = {"llama4": "Llama4TextExperts"}

# the families whose router returns the logits second (HF's output recording index)
_LOGITS_INDEX = {"llama4": 1}


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
                       drop_policy: str = "probs") -> int:
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
            if cls in _FAMILIES:
                family, rule, shared_names = _FAMILIES[cls]
                found.append((parent, name, child, family, rule(child), shared_names))
            elif _is_sparse_moe_block(child):
                model_type = getattr(getattr(model, "config", None), "model_type", "?")
                raise _unsupported(f"{cls} (model_type {model_type!r})",
                                   "moe-core has no routing rule registered for this block")
    # every check passes before anything is replaced
    capacity = _capacity_fields(capacity_factor, pad_to_capacity, drop_policy)
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


# ---- the register_patch_mapping route -----------------------------------------------------------
def _family_block_class(block_class_name: str) -> type:
    import importlib

    family = _FAMILIES[block_class_name][0]
    module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    return getattr(module, block_class_name)


def patch_mapping(families: Optional[List[str]] = None, aux_loss_coeff: float = 0.0,
                  z_loss_coeff: Optional[float] = None, capacity_factor: Optional[float] = None,
                  pad_to_capacity: bool = False, drop_policy: str = "probs") -> Dict[str, type]:
    """``{HF sparse-MoE block class name: replacement class}`` for transformers'
    ``register_patch_mapping`` / ``apply_patches``.

    A replacement class, called as HF calls its block (``Block(config)``), builds HF's block and
    returns it swapped: the :class:`MoECoreSparseMoeBlock` that :func:`replace_moe_blocks` would
    make (same rules, refusals, names and options), so ``from_pretrained`` / ``from_config``
    build the model with moe-core blocks directly and load checkpoints into them. Its experts
    module is also an instance of the family's HF experts class, so HF's weight initialisation
    reaches it. moe-core's losses (when switched on) are read with :func:`moe_core_losses`; on
    the model's output only after a :func:`replace_moe_blocks` call.

    Args:
        families: model types (``"mixtral"``, ``"qwen3_moe"``, ..., a config's ``model_type``;
            see the family table of the module docstring); None: all.
        aux_loss_coeff, z_loss_coeff, capacity_factor, pad_to_capacity, drop_policy: as for
            :func:`replace_moe_blocks`.

    Raises:
        ValueError: an unknown family.
    """
    known = {fam: cls_name for cls_name, (fam, _, _) in _FAMILIES.items()}
    # Llama-4's text model's config says "llama4_text"
    wanted = list(known) if families is None else [
        {"llama4_text": "llama4"}.get(f, f) for f in families]
    unknown = [f for f in wanted if f not in known]
    if unknown:
        raise ValueError(f"patch_mapping: families {unknown} are not among {sorted(known)}")
    options = dict(aux_loss_coeff=float(aux_loss_coeff), z_loss_coeff=z_loss_coeff,
                   capacity=_capacity_fields(capacity_factor, pad_to_capacity, drop_policy))
    mapping = {}
    for family in wanted:
        cls_name = known[family]
        hf_cls = _family_block_class(cls_name)
        _, rule, shared_names = _FAMILIES[cls_name]

        def __new__(cls, *args, _hf_cls=hf_cls, _family=family, _rule=rule,
                    _shared=shared_names, **kwargs):
            block = _hf_cls(*args, **kwargs)
            return _build_block(block, _family, _rule(block), _shared, hf_experts_class=True,
                                **options)

        name = "MoECore" + cls_name
        # __new__ returns a MoECoreSparseMoeBlock (not of this class: __init__ is not run again)
        mapping[cls_name] = type(name, (MoECoreSparseMoeBlock,),
                                 {"__new__": __new__, "__module__": __name__, "__qualname__": name})
    return mapping


def register_patch_mapping(families: Optional[List[str]] = None, overwrite: bool = False,
                           **options) -> List[str]:
    """Register :func:`patch_mapping` with transformers (``transformers.monkey_patching.
    register_patch_mapping``): afterwards ``from_pretrained`` / ``from_config`` build every
    sparse-MoE block of those families as a moe-core block. Undo with transformers'
    ``unregister_patch_mapping(names)``.

    Args:
        families: as for :func:`patch_mapping`.
        overwrite: transformers' flag (a second registration of a class name raises without it).
        options: :func:`patch_mapping`'s loss and capacity options.

    Returns:
        The HF block class names registered.
    """
    from transformers.monkey_patching import register_patch_mapping as hf_register

    mapping = patch_mapping(families, **options)
    hf_register(mapping, overwrite=overwrite)
    return list(mapping)
