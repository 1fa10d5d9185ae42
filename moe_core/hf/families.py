"""Per-family routing rules of the whole-block swap: which Hugging Face sparse-MoE blocks
moe-core swaps, the MoEConfig fields that reproduce each one's router, and what it refuses.

``_FAMILIES`` maps an HF block class name to its family (the config's ``model_type``), its rules
(a function of the HF block returning MoEConfig's routing fields, or raising
:class:`UnsupportedMoEBlockError`) and the names of its shared-expert modules. The experts'
activation is HF's ``act_fn`` as the torch function MoEConfig takes (``_ACTIVATION_FUNCS``;
GPT-OSS's clamped gate: ``_sigmoid_gate``).

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
test in tests/hf/test_blocks.py).
"""
import functools
from typing import Callable, Dict, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from moe_core.hf.backend import activation_of

_ACTIVATION_FUNCS: Dict[str, Callable] = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_tanh": functools.partial(F.gelu, approximate="tanh"),
    "relu": F.relu,
}


class UnsupportedMoEBlockError(ValueError):
    """A sparse-MoE block whose routing or expert layout moe-core's MoELayer cannot reproduce
    exactly."""


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
