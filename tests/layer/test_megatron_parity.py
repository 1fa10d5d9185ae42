"""MoELayer: the same weights and inputs through megatron-core's real MoELayer (world size
1, allgather dispatcher, local SequentialMLP experts) and through ours, forward and backward.

Compared: routing maps exactly; probs, outputs, input gradients, router, expert and shared-expert
weight gradients within two bf16 roundings (2 x 2^-8) of Megatron's at the tensor's scale: both
sides round the same bf16 GEMMs, only their summation order differs (ours accumulates each
output in fp32 in one fixed order); expert-bias token counts exactly.
"""
import pytest
import torch
import torch.nn.functional as F

from helpers import megatron_layer
from moe_core import MoEConfig, MoELayer, load_megatron_state_dict
from moe_core.ops import AuxLossScale

H, FFN, S, B = 64, 96, 16, 2

BASE = dict(hidden_size=H, moe_ffn_hidden_size=FFN, num_moe_experts=8, moe_router_topk=2,
            add_bias_linear=False, gated_linear_unit=True, activation_func=F.silu, bf16=True,
            params_dtype=torch.bfloat16, moe_router_dtype="fp32", moe_aux_loss_coeff=1e-2)

CASES = {
    "softmax_top2": dict(),
    "pre_softmax": dict(moe_router_pre_softmax=True),
    "dsv3_sigmoid_groups_bias_scaling": dict(
        num_moe_experts=32, moe_router_topk=4, moe_router_score_function="sigmoid",
        moe_router_num_groups=8, moe_router_group_topk=2, moe_router_enable_expert_bias=True,
        moe_router_topk_scaling_factor=2.5, moe_aux_loss_coeff=0.0,
        moe_router_load_balancing_type="none"),
    "seq_aux_loss": dict(moe_router_load_balancing_type="seq_aux_loss"),
    "global_aux_loss": dict(moe_router_load_balancing_type="global_aux_loss"),
    "capacity_drop_and_pad": dict(moe_expert_capacity_factor=1.0,
                                  moe_pad_expert_input_to_capacity=True),
    "capacity_drop_no_pad": dict(moe_expert_capacity_factor=0.5),
    "shared_expert_gate": dict(moe_shared_expert_intermediate_size=128, moe_shared_expert_gate=True),
    "probs_on_input_top1": dict(moe_router_topk=1, moe_router_pre_softmax=True,
                                moe_apply_probs_on_input=True),
    "z_loss": dict(moe_z_loss_coeff=1e-3),
    "sqrtsoftplus_top4": dict(moe_router_score_function="sqrtsoftplus", moe_router_topk=4),
    "per_token_loss": dict(calculate_per_token_loss=True, moe_z_loss_coeff=1e-3),
    "sinkhorn_top1": dict(moe_router_load_balancing_type="sinkhorn", moe_aux_loss_coeff=0.0,
                          moe_router_topk=1),
    "sinkhorn_top2": dict(moe_router_load_balancing_type="sinkhorn", moe_aux_loss_coeff=0.0),
    "router_dtype_input_bf16": dict(moe_router_dtype=None, moe_router_pre_softmax=True),
    "router_dtype_fp64_two_losses": dict(moe_router_dtype="fp64",
                                         moe_router_load_balancing_type=["aux_loss", "seq_aux_loss"],
                                         moe_aux_loss_coeff=[1e-2, 1e-3]),
}


def build_pair(case):
    kwargs = dict(BASE)
    kwargs.update(CASES[case])
    torch.manual_seed(0)
    meg = megatron_layer.build(**kwargs)
    ours = MoELayer(MoEConfig.from_megatron(meg.config))
    sd = meg.state_dict()
    if kwargs.get("moe_router_enable_expert_bias"):
        sd["router.expert_bias"].copy_(torch.randn(kwargs["num_moe_experts"]) * 0.05)
        meg.router.expert_bias.copy_(sd["router.expert_bias"])
    load_megatron_state_dict(ours, sd)
    if kwargs.get("add_bias_linear"):
        with torch.no_grad():  # Megatron zero-inits biases: give them values that matter
            for p in (ours.experts.bias1, ours.experts.bias2, ours.router.bias):
                p.copy_(torch.randn_like(p.float()) * 0.1)
            for i, expert in enumerate(meg.experts.local_experts):
                expert.linear_fc1.bias.copy_(ours.experts.bias1[i])
                expert.linear_fc2.bias.copy_(ours.experts.bias2[i])
            meg.router.bias.copy_(ours.router.bias)
    return meg, ours


def routing_of(router):
    seen = {}
    router.register_forward_hook(lambda m, i, o: seen.update(probs=o[0].detach(), map=o[1]))
    return seen


def megatron_expert_grads(meg, name):
    experts = meg.experts.local_experts
    fc, kind = {"weight1": ("linear_fc1", "weight"), "weight2": ("linear_fc2", "weight"),
                "bias1": ("linear_fc1", "bias"), "bias2": ("linear_fc2", "bias")}[name]
    return torch.stack([getattr(getattr(e, fc), kind).grad for e in experts])


def check_close(ours, meg, name):
    """Within a couple of bf16 roundings of Megatron, at the tensor's scale."""
    ours, meg = ours.detach().double(), meg.detach().double()
    assert ours.shape == meg.shape, name
    scale = meg.abs().max().item()
    diff = (ours - meg).abs().max().item()
    assert diff <= 2 * 2.0**-8 * max(scale, 1e-30), f"{name}: max diff {diff:.3e} at scale {scale:.3e}"


@pytest.mark.megatron
@pytest.mark.parametrize("case", sorted(CASES))
def test_layer_matches_megatron(case):
    meg, ours = build_pair(case)
    meg.train(), ours.train()
    seen_meg, seen_ours = routing_of(meg.router), routing_of(ours.router)
    x = torch.randn(S, B, H).to(torch.bfloat16)
    pad = torch.zeros(B, S, dtype=torch.bool)
    pad[1, -3:] = True  # the last three tokens of the second sequence are padding
    x_meg, x_ours = x.clone().requires_grad_(), x.clone().requires_grad_()
    g = torch.randn(S, B, H).to(torch.bfloat16)

    megatron_layer.set_loss_scale(2.0)
    out_meg, bias = meg(x_meg, padding_mask=pad)
    assert bias is None
    with AuxLossScale(2.0):
        out_ours = ours(x_ours, padding_mask=pad)
    assert out_ours.shape == out_meg.shape and out_ours.dtype == out_meg.dtype
    if CASES[case].get("moe_pad_expert_input_to_capacity"):
        # Filler tokens (prob 0) are picked among ties, which torch.topk leaves unspecified:
        # compare the real assignments; fillers contribute nothing to the output.
        real_meg = seen_meg["map"] & (seen_meg["probs"] != 0)
        real_ours = seen_ours["map"] & (seen_ours["probs"] != 0)
        assert torch.equal(real_meg, real_ours), "routing maps differ"
        assert torch.equal(seen_meg["map"].sum(0), seen_ours["map"].sum(0))
    else:
        assert torch.equal(seen_meg["map"], seen_ours["map"]), "routing maps differ"
    check_close(seen_ours["probs"], seen_meg["probs"], "probs")
    check_close(out_ours, out_meg, "output")

    out_meg.backward(g)
    out_ours.backward(g)
    check_close(x_ours.grad, x_meg.grad, "input grad")
    check_close(ours.router.weight.grad, meg.router.weight.grad, "router weight grad")
    for name in ("weight1", "weight2", "bias1", "bias2"):
        p = getattr(ours.experts, name)
        if p is not None:
            check_close(p.grad, megatron_expert_grads(meg, name), f"experts.{name} grad")
    if ours.shared_experts is not None:
        for n in ("linear_fc1.weight", "linear_fc2.weight", "gate_weight"):
            ours_p = ours.shared_experts.get_parameter(n)
            meg_p = meg.shared_experts.get_parameter(n)
            check_close(ours_p.grad, meg_p.grad, f"shared_experts.{n} grad")
    if ours.router.local_tokens_per_expert is not None:
        # Megatron masks with `routing_map & ~padding_mask`, a [T] mask broadcast along the
        # *expert* axis (it runs only because T == E here); ours excludes the padded tokens.
        pad_t = pad.t().reshape(-1, 1)
        want = (seen_ours["map"] & ~pad_t).sum(0).float()
        assert torch.equal(ours.router.local_tokens_per_expert, want)
        assert not torch.equal(meg.router.local_tokens_per_expert, want), "Megatron fixed its mask?"


@pytest.mark.megatron
@pytest.mark.parametrize("S,B,E,k,hidden", [(7, 3, 1, 1, 16), (5, 1, 4, 4, 24), (1, 1, 8, 2, 32),
                                            (9, 2, 6, 3, 40), (33, 1, 16, 8, 64)])
@pytest.mark.parametrize("variant", ["softmax", "sigmoid_capacity"])
def test_layer_odd_sizes_match_megatron(S, B, E, k, hidden, variant):
    """One expert, topk = E, a single token, sizes that are no multiple of anything."""
    kw = dict(BASE)
    kw.update(hidden_size=hidden, num_moe_experts=E, moe_router_topk=k)
    if variant == "softmax" and k == 1:
        kw["moe_router_pre_softmax"] = True
    if variant == "sigmoid_capacity":
        kw.update(moe_router_score_function="sigmoid", moe_expert_capacity_factor=1.5)
    torch.manual_seed(S * 100 + E)
    meg = megatron_layer.build(**kw)
    ours = MoELayer(MoEConfig.from_megatron(meg.config))
    load_megatron_state_dict(ours, meg.state_dict())
    x = torch.randn(S, B, hidden).to(torch.bfloat16)
    x_meg, x_ours = x.clone().requires_grad_(), x.clone().requires_grad_()
    megatron_layer.set_loss_scale(1.0)
    out_meg, _ = meg(x_meg)
    with AuxLossScale(1.0):
        out_ours = ours(x_ours)
    g = torch.randn_like(out_meg)
    out_meg.backward(g)
    out_ours.backward(g)
    check_close(out_ours, out_meg, "output")
    check_close(x_ours.grad, x_meg.grad, "input grad")
    check_close(ours.router.weight.grad, meg.router.weight.grad, "router weight grad")
    check_close(ours.experts.weight1.grad, megatron_expert_grads(meg, "weight1"), "fc1 grad")
