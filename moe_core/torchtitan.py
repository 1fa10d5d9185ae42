"""torchtitan integration: :func:`replace_moe` swaps the MoE modules of torchtitan's models
(``torchtitan.models.common.moe.MoE``: ``TokenChoiceTopKRouter`` + ``GroupedExperts``, the
Qwen3 / DeepSeek-V3 / Llama-4-style models) for moe-core's layer, weights and routing included.

    from moe_core.torchtitan import replace_moe

    model = model_config.build()           # torchtitan's model, its weights initialised or loaded
    replace_moe(model)                     # -> the number of MoE modules replaced

What is mapped, option by option (torchtitan's name -> moe-core's ``MoEConfig``):

* router: ``gate`` (no bias) -> ``router.weight``, computed in fp32 (``moe_router_dtype="fp32"``);
  ``score_func`` "softmax" (over all experts, before the top-k: ``moe_router_pre_softmax``) or
  "sigmoid"; ``route_norm`` -> ``moe_router_norm_topk_prob`` (the top-k scores over their sum +
  1e-20); ``route_scale`` -> ``moe_router_topk_scaling_factor``; ``num_expert_groups`` /
  ``num_limited_groups`` -> ``moe_router_num_groups`` / ``moe_router_group_topk`` with a group
  scored by its top-2 sum (``moe_router_group_score_topk=2``).
* load balancing: torchtitan's is auxiliary-loss free: ``load_balance_coeff`` -> an expert bias
  (``moe_router_enable_expert_bias``; ``expert_bias_E`` -> ``router.expert_bias``) added to the
  scores for the choice only. The swapped module keeps torchtitan's names for it
  (``expert_bias_E``, ``tokens_per_expert_E``, ``load_balance_coeff``), so torchtitan's
  optimizer pre-step hook (``register_moe_load_balancing_hook``) updates the bias with its own
  rule, as before the swap.
* experts: ``GroupedExperts`` SwiGLU ``w2(silu(w1 x) * w3 x)`` -> ``experts.weight1 = cat(w1, w3)``
  (``[E, 2F, D]``: gate half, then up half) and ``experts.weight2 = w2`` (``[E, D, F]``).
  torchtitan runs the expert GEMMs in bf16 whatever the parameters' dtype; moe-core runs them in
  the parameters' dtype (under ``torch.autocast``, in its dtype).
* shared experts: ``FeedForward`` (``w1``, ``w2``, ``w3``) -> ``shared_experts.linear_fc1.weight =
  cat(w1, w3)``, ``linear_fc2.weight = w2``.

Weights go both ways: the swap copies torchtitan's weights in; ``load_state_dict`` of a swapped
module also takes torchtitan's keys (a torchtitan checkpoint of the original model loads into the
swapped one), and :func:`torchtitan_state_dict` gives a swapped model's state dict in torchtitan's
keys and layout (for torchtitan's own checkpoints and state-dict adapters).

Parallelism: torchtitan's FSDP2 (``apply_fsdp_to_decoder``) shards the swapped module as it
shards its own MoE (the routed experts' parameters are reached as
``moe.routed_experts.inner_experts``); expert parallelism: ``replace_moe(model, ep_mesh=...)``
with torchtitan's EP mesh dimension (``parallel_dims.get_mesh("ep")``) keeps each rank's experts
(contiguous blocks, torchtitan's order) and runs moe-core's all-to-all dispatcher over it; swap
before torchtitan's ``parallelize`` (which then leaves the swapped modules' experts alone), with
its ``spmd_backend="partial_dtensor"``: its full-DTensor backends ("spmd_types", the default, and
"full_dtensor") want every parameter a DTensor on the whole mesh, which moe-core's ops do not
take.

Refused (``UnsupportedTorchtitanMoEError``, naming the option): MoE subclasses (GPT-OSS's
``GptOssMoE``: clamped SwiGLU with biases), other experts (fused / low-precision overrides) or
shared-expert classes, a router gate with a bias, ``_debug_force_load_balance``,
``route_norm`` with ``top_k=1``, DeepEP /
HybridEP dispatchers, modules already parallelised (DTensor weights) and expert groups of
fewer than two experts.
"""
import types
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from moe_core.config import MoEConfig
from moe_core.groups import GroupLike, as_group, group_size
from moe_core.layer import MoELayer


class UnsupportedTorchtitanMoEError(ValueError):
    """A torchtitan MoE module (or one of its options) that moe-core does not replace."""


def _torchtitan():
    from torchtitan.models.common import feed_forward, moe, token_dispatcher

    return types.SimpleNamespace(MoE=moe.MoE, GroupedExperts=moe.GroupedExperts,
                                 RoutedExperts=moe.RoutedExperts,
                                 Router=moe.TokenChoiceTopKRouter,
                                 FeedForward=feed_forward.FeedForward,
                                 LocalDispatcher=token_dispatcher.LocalTokenDispatcher,
                                 AllToAllDispatcher=getattr(token_dispatcher,
                                                            "AllToAllTokenDispatcher", None))


def _refuse(path: str, what: str) -> None:
    raise UnsupportedTorchtitanMoEError(f"{path}: {what} is not supported by moe-core's "
                                        f"torchtitan swap")


def _check_supported(tt, path: str, module: nn.Module) -> None:
    if type(module) is not tt.MoE:
        _refuse(path, f"MoE class {type(module).__name__} (only torchtitan's "
                      f"torchtitan.models.common.moe.MoE)")
    routed = module.routed_experts
    if type(routed) is not tt.RoutedExperts:
        _refuse(path, f"routed_experts class {type(routed).__name__}")
    if type(routed.inner_experts) is not tt.GroupedExperts:
        _refuse(path, f"experts class {type(routed.inner_experts).__name__} (only "
                      f"GroupedExperts' SwiGLU)")
    dispatcher = routed.token_dispatcher
    allowed = tuple(c for c in (tt.LocalDispatcher, tt.AllToAllDispatcher) if c is not None)
    if type(dispatcher) not in allowed:
        _refuse(path, f"token dispatcher {type(dispatcher).__name__} (the local and standard "
                      f"all-to-all dispatchers only)")
    router = module.router
    if type(router) is not tt.Router:
        _refuse(path, f"router class {type(router).__name__}")
    if router.gate.bias is not None:
        _refuse(path, "a router gate with a bias")
    if router._debug_force_load_balance:
        _refuse(path, "_debug_force_load_balance=True (round-robin routing)")
    if router.route_norm and router.top_k == 1:
        _refuse(path, "route_norm=True with top_k=1 (each token's one score divided by itself: "
                      "the router gets no gradient)")
    if router.score_func not in ("softmax", "sigmoid"):
        _refuse(path, f"score_func={router.score_func!r}")
    if router.num_expert_groups is not None:
        if router.num_limited_groups is None:
            _refuse(path, "num_expert_groups without num_limited_groups")
        if router.num_experts // router.num_expert_groups < 2:
            _refuse(path, f"expert groups of {router.num_experts // router.num_expert_groups} "
                          f"expert (torchtitan scores a group by its top 2)")
    shared = module.shared_experts
    if shared is not None:
        if type(shared) is not tt.FeedForward:
            _refuse(path, f"shared_experts class {type(shared).__name__} (only FeedForward)")
        if any(lin.bias is not None for lin in (shared.w1, shared.w2, shared.w3)):
            _refuse(path, "shared experts with biases")
    for name, tensor in list(module.named_parameters()) + list(module.named_buffers()):
        if hasattr(tensor, "device_mesh"):
            _refuse(path, f"{name} is a {type(tensor).__name__} (swap before torchtitan's "
                          f"parallelize and FSDP)")


def moe_config_of(module: nn.Module, ep_size: int = 1) -> MoEConfig:
    """The ``MoEConfig`` of a torchtitan ``MoE`` module (module docstring: the mapping)."""
    router, experts = module.router, module.routed_experts.inner_experts
    E, F_, D = experts.w1_EFD.shape
    groups = router.num_expert_groups
    coeff = module.load_balance_coeff
    shared = module.shared_experts
    return MoEConfig(
        hidden_size=D, num_moe_experts=E, moe_ffn_hidden_size=F_, ffn_hidden_size=F_,
        moe_router_topk=router.top_k, add_bias_linear=False, gated_linear_unit=True,
        activation_func=F.silu, params_dtype=experts.w1_EFD.dtype,
        moe_router_score_function=router.score_func,
        moe_router_pre_softmax=router.score_func == "softmax",
        moe_router_norm_topk_prob=bool(router.route_norm),
        moe_router_topk_scaling_factor=(None if router.route_scale == 1.0
                                        else float(router.route_scale)),
        moe_router_num_groups=groups, moe_router_group_topk=router.num_limited_groups if groups
        else None, moe_router_group_score_topk=2 if groups else None,
        moe_router_dtype="fp32", moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
        moe_router_enable_expert_bias=coeff is not None,
        moe_router_bias_update_rate=float(coeff) if coeff is not None else 1e-3,
        moe_shared_expert_intermediate_size=(shared.w1.weight.shape[0] if shared is not None
                                             else None),
        expert_model_parallel_size=ep_size,
        moe_token_dispatcher_type="alltoall")


class _RoutedExpertsView:
    """``moe.routed_experts`` of a swapped module. Called, it is ``MoELayer.routed_experts``
    (layout, experts, combine), which the attribute hides; read, it gives torchtitan's FSDP2
    helper what it looks for, ``inner_experts``: the routed experts (``parameters()``) with
    ``num_experts`` (the global count). Not a module: the parameters stay registered under
    ``experts``."""

    def __init__(self, layer: MoELayer):
        self._layer = layer
        self.inner_experts = layer.experts
        layer.experts.num_experts = layer.config.num_moe_experts

    def __call__(self, *args, **kwargs):
        return MoELayer.routed_experts(self._layer, *args, **kwargs)


class MoECoreTorchtitanMoE(MoELayer):
    """moe-core's MoELayer with the interface of torchtitan's ``MoE``: ``forward(x [B, L, D]) ->
    [B, L, D]``, and torchtitan's load-balancing names (``load_balance_coeff``,
    ``expert_bias_E``, ``tokens_per_expert_E``). Build it with :func:`replace_moe`."""

    def __init__(self, config: MoEConfig, load_balance_coeff: Optional[float],
                 ep_group: GroupLike = None, *, device: Optional[torch.device] = None):
        super().__init__(config, ep_group=ep_group, device=device)
        self.load_balance_coeff = load_balance_coeff
        self.routed_experts = _RoutedExpertsView(self)
        self._register_load_state_dict_pre_hook(self._torchtitan_keys_hook)

    @property
    def expert_bias_E(self) -> Optional[torch.Tensor]:  # noqa: N802 (torchtitan's name)
        """torchtitan's name of the expert bias ``[E]`` fp32 (``router.expert_bias``)."""
        return self.router.expert_bias

    @property
    def tokens_per_expert_E(self) -> Optional[torch.Tensor]:  # noqa: N802
        """torchtitan's name of the tokens routed to each expert since the last bias update
        ``[E]`` fp32 (``router.local_tokens_per_expert``), which its optimizer hook reads and
        zeroes."""
        return self.router.local_tokens_per_expert

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """torchtitan's MoE call: ``x`` ``[B, L, D]`` -> ``[B, L, D]`` (the routed experts' sum
        plus the shared experts')."""
        B, L, D = x.shape
        return super().forward(x.reshape(B * L, D)).view(B, L, D)

    # ---- weights -------------------------------------------------------------------------
    def load_torchtitan(self, module: nn.Module) -> None:
        """Copy a torchtitan ``MoE``'s weights and load-balancing state into this module (its
        rank's experts under expert parallelism)."""
        self.load_state_dict(module.state_dict(), strict=True)  # through _torchtitan_keys_hook
        if self.router.local_tokens_per_expert is not None:
            with torch.no_grad():
                self.router.local_tokens_per_expert.copy_(module.tokens_per_expert_E)

    def _torchtitan_keys_hook(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs) -> None:
        """Before loading: torchtitan's keys under ``prefix`` become moe-core's (the full expert
        stacks sliced to this rank's experts); other keys pass."""
        mine = {k[len(prefix):]: v for k, v in state_dict.items() if k.startswith(prefix)}
        if not any(k in _TORCHTITAN_KEYS or k.startswith("routed_experts.") for k in mine):
            return
        for k in mine:
            del state_dict[prefix + k]
        lo = self.experts.ep_rank * self.experts.num_local_experts
        hi = lo + self.experts.num_local_experts
        for k, v in _torchtitan_weights(mine).items():
            if k.startswith("experts.") and v.shape[0] == self.config.num_moe_experts:
                v = v[lo:hi]
            state_dict[prefix + k] = v


_TORCHTITAN_KEYS = ("router.gate.weight", "expert_bias_E", "shared_experts.w1.weight",
                    "shared_experts.w2.weight", "shared_experts.w3.weight")


def _torchtitan_weights(sd: dict) -> dict:
    """A torchtitan MoE state dict (keys relative to the module) in moe-core's names."""
    out = {}
    for key, value in sd.items():
        if key == "router.gate.weight":
            out["router.weight"] = value
        elif key == "expert_bias_E":
            out["router.expert_bias"] = value
        elif key.startswith("routed_experts.inner_experts.") or key.startswith("shared_experts.w"):
            continue  # below, as pairs
        else:
            out[key] = value
    pre = "routed_experts.inner_experts."
    if pre + "w1_EFD" in sd:
        out["experts.weight1"] = torch.cat([sd[pre + "w1_EFD"], sd[pre + "w3_EFD"]], dim=1)
        out["experts.weight2"] = sd[pre + "w2_EDF"]
    if "shared_experts.w1.weight" in sd:
        out["shared_experts.linear_fc1.weight"] = torch.cat(
            [sd["shared_experts.w1.weight"], sd["shared_experts.w3.weight"]], dim=0)
        out["shared_experts.linear_fc2.weight"] = sd["shared_experts.w2.weight"]
    return out


def torchtitan_state_dict(model: nn.Module) -> dict:
    """``model.state_dict()`` with every swapped module's entries in torchtitan's keys and
    layout (``router.gate.weight``, ``routed_experts.inner_experts.w1_EFD / w2_EDF / w3_EFD``,
    ``expert_bias_E``, ``shared_experts.w{1,2,3}.weight``); moe-core's running counts are left
    out (torchtitan does not save ``tokens_per_expert_E``). Under expert parallelism the expert
    stacks are this rank's experts."""
    sd = model.state_dict()
    out = dict(sd)
    for name, module in model.named_modules():
        if not isinstance(module, MoECoreTorchtitanMoE):
            continue
        p = f"{name}." if name else ""
        for key in [k for k in out if k.startswith(p)]:
            del out[key]
        F_ = module.config.moe_ffn_hidden_size
        w1 = sd[p + "experts.weight1"]
        out[p + "router.gate.weight"] = sd[p + "router.weight"]
        if module.router.expert_bias is not None:
            out[p + "expert_bias_E"] = sd[p + "router.expert_bias"]
        out[p + "routed_experts.inner_experts.w1_EFD"] = w1[:, :F_]
        out[p + "routed_experts.inner_experts.w3_EFD"] = w1[:, F_:]
        out[p + "routed_experts.inner_experts.w2_EDF"] = sd[p + "experts.weight2"]
        if module.shared_experts is not None:
            fc1 = sd[p + "shared_experts.linear_fc1.weight"]
            S = module.config.moe_shared_expert_intermediate_size
            out[p + "shared_experts.w1.weight"] = fc1[:S]
            out[p + "shared_experts.w3.weight"] = fc1[S:]
            out[p + "shared_experts.w2.weight"] = sd[p + "shared_experts.linear_fc2.weight"]
    return out


def replace_moe(model: nn.Module, ep_mesh: GroupLike = None) -> int:
    """Replace every torchtitan ``MoE`` module of ``model`` with moe-core's layer, in place,
    copying its weights and expert-bias state (module docstring: what is mapped, what is
    refused).

    Args:
        model: a torchtitan model (or any module holding torchtitan ``MoE`` modules), on a real
            device, before torchtitan's ``parallelize`` / FSDP.
        ep_mesh: the expert-parallel group (torchtitan's ``parallel_dims.get_mesh("ep")``, a
            ProcessGroup or ``(mesh, dim_name)``); None: no expert parallelism. Each rank keeps
            its contiguous block of experts.

    Returns:
        The number of MoE modules replaced (at least 1).

    Raises:
        ValueError: ``model`` holds no torchtitan MoE module.
        UnsupportedTorchtitanMoEError: a MoE module, or one of its options, that moe-core does
            not replace (nothing is replaced then).
    """
    tt = _torchtitan()
    group = as_group(ep_mesh, "ep_mesh")
    ep_size = group_size(group) if group is not None else 1
    found = [(name, m) for name, m in model.named_modules() if isinstance(m, tt.MoE)]
    if not found:
        raise ValueError(f"{type(model).__name__} holds no torchtitan MoE module "
                         f"(torchtitan.models.common.moe.MoE): nothing to replace")
    for name, module in found:  # every check before any swap
        _check_supported(tt, name or type(model).__name__, module)
    for name, module in found:
        ours = MoECoreTorchtitanMoE(moe_config_of(module, ep_size), module.load_balance_coeff,
                                    ep_group=group,
                                    device=module.router.gate.weight.device)
        ours.load_torchtitan(module)
        ours.train(module.training)
        if not name:
            raise ValueError("replace_moe replaces MoE modules inside a model; the model "
                             "itself is a MoE module (use MoECoreTorchtitanMoE directly)")
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, ours)
    return len(found)
