"""The experts' and the shared expert's interleaved GLU rows (moe_mlp_glu_interleave_size,
moe_shared_expert_glu_interleave_size) against Megatron's layer, and Megatron's state-dict
layouts of the experts (local, TE grouped per expert, TE single grouped weight / bias) written by
megatron_state_dict and read back by load_megatron_state_dict.

Megatron's local experts (the ones that run on the CPU) read fc1 as gate half, linear half; its
TE grouped experts de-interleave fc1's output with ``TEGroupedMLP._remove_glu_interleaving``. So
the interleaved layer gets Megatron's weights with their fc1 rows interleaved (checked to be what
that function undoes), and its gradients, de-interleaved by that function, must be Megatron's.
"""
import dataclasses

import pytest
import torch
import torch.nn.functional as F

from helpers import megatron_layer
from megatron.core.transformer.moe.experts import TEGroupedMLP
from moe_core import (MoEConfig, MoELayer, load_megatron_state_dict, megatron_state_dict)
from moe_core.ops import AuxLossScale

H, FFN, SHARED, S, B = 32, 24, 16, 8, 2


def rows_interleaved(w: torch.Tensor, size: int) -> torch.Tensor:
    """fc1 weight ``[..., 2F, H]`` with its rows in blocks of ``size`` gate, ``size`` linear."""
    t = w.transpose(-1, -2)
    shape = t.shape
    t = t.reshape(-1, 2, shape[-1] // (2 * size), size).transpose(1, 2).reshape(shape)
    return t.transpose(-1, -2).contiguous()


def rows_deinterleaved(w: torch.Tensor, size: int) -> torch.Tensor:
    """Megatron's ``_remove_glu_interleaving`` applied to fc1's rows."""
    t = w.transpose(-1, -2).contiguous()
    return TEGroupedMLP._remove_glu_interleaving(t, size).transpose(-1, -2)


def user_silu(x):  # an activation glu_probs does not know: the layer's unfused torch path
    return F.silu(x)


def close(ours, meg, name):
    ours, meg = ours.detach().double(), meg.detach().double()
    scale = max(meg.abs().max().item(), 1e-30)
    assert (ours - meg).abs().max().item() <= 64 * 2.0**-24 * scale, name


@pytest.mark.megatron
@pytest.mark.parametrize("size", [1, 4])
@pytest.mark.parametrize("path", ["rows_by_index", "rows_made", "user_activation"])
def test_interleaved_layer_matches_megatron(size, path):
    kw = dict(hidden_size=H, moe_ffn_hidden_size=FFN, num_moe_experts=4, moe_router_topk=2,
              add_bias_linear=False, gated_linear_unit=True,
              activation_func=user_silu if path == "user_activation" else F.silu,
              moe_aux_loss_coeff=1e-2, moe_shared_expert_intermediate_size=SHARED)
    torch.manual_seed(0)
    meg = megatron_layer.build(**kw)
    cfg = dataclasses.replace(MoEConfig.from_megatron(meg.config),
                              moe_mlp_glu_interleave_size=size,
                              moe_shared_expert_glu_interleave_size=size,
                              moe_expert_rows_by_index=path != "rows_made")
    ours = MoELayer(cfg)
    sd = dict(meg.state_dict())
    for key in [k for k in sd if k.endswith("linear_fc1.weight")]:
        sd[key] = rows_interleaved(sd[key], size)
        assert torch.equal(rows_deinterleaved(sd[key], size), meg.state_dict()[key])
    load_megatron_state_dict(ours, sd)
    meg.train(), ours.train()
    x, g = torch.randn(S, B, H), torch.randn(S, B, H)
    x_meg, x_ours = x.clone().requires_grad_(), x.clone().requires_grad_()
    megatron_layer.set_loss_scale(1.0)
    out_meg, _ = meg(x_meg)
    with AuxLossScale(1.0):
        out_ours = ours(x_ours)
    close(out_ours, out_meg, "output")
    out_meg.backward(g)
    out_ours.backward(g)
    close(x_ours.grad, x_meg.grad, "input grad")
    close(ours.router.weight.grad, meg.router.weight.grad, "router grad")
    want_w1 = torch.stack([e.linear_fc1.weight.grad for e in meg.experts.local_experts])
    close(rows_deinterleaved(ours.experts.weight1.grad, size), want_w1, "experts fc1 grad")
    want_w2 = torch.stack([e.linear_fc2.weight.grad for e in meg.experts.local_experts])
    close(ours.experts.weight2.grad, want_w2, "experts fc2 grad")
    close(rows_deinterleaved(ours.shared_experts.linear_fc1.weight.grad, size),
          meg.shared_experts.linear_fc1.weight.grad, "shared fc1 grad")


def test_interleaved_biased_experts_equal_the_halves_layout_bitwise():
    """With biases (Megatron's local experts fail there): the interleaved layer equals the plain
    one given the de-interleaved weights and bias, bit for bit, the weight gradients included;
    the input's gradient sums over fc1's 2F outputs in the layout's order (within its rounding)."""
    base = dict(hidden_size=H, moe_ffn_hidden_size=FFN, num_moe_experts=4, moe_router_topk=2,
                add_bias_linear=True, gated_linear_unit=True, activation_func=F.silu,
                glu_linear_offset=1.0, activation_func_clamp_value=7.0)
    torch.manual_seed(0)
    plain = MoELayer(MoEConfig(**base))
    inter = MoELayer(MoEConfig(moe_mlp_glu_interleave_size=2, **base))
    with torch.no_grad():
        plain.experts.bias1.normal_()
        plain.experts.bias2.normal_()
        sd = plain.state_dict()
        sd["experts.weight1"] = rows_interleaved(sd["experts.weight1"], 2)
        sd["experts.bias1"] = rows_interleaved(sd["experts.bias1"].unsqueeze(-1), 2).squeeze(-1)
    inter.load_state_dict(sd)
    x = torch.randn(12, H)
    outs = []
    for layer in (plain, inter):
        xs = x.clone().requires_grad_()
        out = layer(xs)
        out.square().sum().backward()
        outs.append((out, xs.grad))
    assert torch.equal(outs[0][0], outs[1][0])
    close(outs[1][1], outs[0][1], "input grad")
    assert torch.equal(rows_deinterleaved(inter.experts.weight1.grad, 2), plain.experts.weight1.grad)
    assert torch.equal(rows_deinterleaved(inter.experts.bias1.grad.unsqueeze(-1), 2).squeeze(-1),
                       plain.experts.bias1.grad)
    assert torch.equal(inter.experts.weight2.grad, plain.experts.weight2.grad)


@pytest.mark.parametrize("by_index", [True, False])
def test_interleaved_layer_compiles_fullgraph(by_index):
    """The interleave size reaches the fused ops through a compiled graph: the compiled layer
    gives the eager layer's output and gradients."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    layer = MoELayer(MoEConfig(hidden_size=H, num_moe_experts=4, moe_ffn_hidden_size=FFN,
                               add_bias_linear=False, gated_linear_unit=True,
                               activation_func=F.silu, moe_mlp_glu_interleave_size=2,
                               moe_shared_expert_intermediate_size=SHARED,
                               moe_shared_expert_glu_interleave_size=4,
                               moe_expert_rows_by_index=by_index))
    x = torch.randn(12, H, requires_grad=True)
    eager = layer(x)
    eager.sum().backward()
    grads = [p.grad.clone() for p in layer.parameters()] + [x.grad.clone()]
    layer.zero_grad(set_to_none=True)
    x.grad = None
    out = torch.compile(layer, fullgraph=True, backend="aot_eager")(x)
    out.sum().backward()
    assert torch.equal(out, eager)
    for a, b in zip([p.grad for p in layer.parameters()] + [x.grad], grads):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("kw,field,message", [
    (dict(moe_mlp_glu_interleave_size=2, gated_linear_unit=False), "moe_mlp_glu_interleave_size",
     "needs gated_linear_unit=True"),
    (dict(moe_mlp_glu_interleave_size=5), "moe_mlp_glu_interleave_size",
     "must divide moe_ffn_hidden_size=24"),
    (dict(moe_mlp_glu_interleave_size=0), "moe_mlp_glu_interleave_size", "must be >= 1"),
    (dict(moe_shared_expert_glu_interleave_size=2), "moe_shared_expert_glu_interleave_size",
     "needs moe_shared_expert_intermediate_size"),
    (dict(moe_shared_expert_glu_interleave_size=3, moe_shared_expert_intermediate_size=16),
     "moe_shared_expert_glu_interleave_size", "must divide moe_shared_expert_intermediate_size"),
    (dict(moe_single_grouped_weight=True), "moe_single_grouped_weight",
     "needs moe_grouped_gemm=True"),
    (dict(moe_single_grouped_bias=True, moe_grouped_gemm=True), "moe_single_grouped_bias",
     "needs add_bias_linear=True"),
])
def test_bad_configs_name_the_field(kw, field, message):
    args = dict(hidden_size=H, num_moe_experts=4, moe_ffn_hidden_size=FFN, add_bias_linear=False,
                gated_linear_unit=True)
    args.update(kw)
    with pytest.raises(ValueError, match=f"{field}=.*{message}"):
        MoEConfig(**args)


def test_from_megatron_drops_interleaves_megatron_does_not_read():
    class Megatronish:
        hidden_size, num_moe_experts, moe_ffn_hidden_size = 16, 4, 8
        gated_linear_unit, add_bias_linear = True, False
        moe_shared_expert_intermediate_size = 8
        moe_mlp_glu_interleave_size = moe_shared_expert_glu_interleave_size = 4
        use_grouped_gemm_for_shared_expert = False

    cfg = MoEConfig.from_megatron(Megatronish())
    assert cfg.moe_mlp_glu_interleave_size == 4 and cfg.moe_shared_expert_glu_interleave_size is None
    Megatronish.use_grouped_gemm_for_shared_expert = True
    assert MoEConfig.from_megatron(Megatronish()).moe_shared_expert_glu_interleave_size == 4
    Megatronish.gated_linear_unit = False  # Megatron ignores both without a GLU
    Megatronish.moe_shared_expert_glu_interleave_size = None
    assert MoEConfig.from_megatron(Megatronish()).moe_mlp_glu_interleave_size is None


LAYOUTS = {  # (moe_grouped_gemm, single weight, single bias): the expert keys megatron_state_dict writes
    "local": ((False, False, False), {"experts.local_experts.0.linear_fc1.weight",
                                      "experts.local_experts.3.linear_fc2.bias"}),
    "te_per_expert": ((True, False, False), {"experts.linear_fc1.weight0",
                                             "experts.linear_fc2.bias3"}),
    "te_single_weight": ((True, True, False), {"experts.linear_fc1.weight",
                                               "experts.linear_fc2.bias3"}),
    "te_single_weight_and_bias": ((True, True, True), {"experts.linear_fc1.weight",
                                                       "experts.linear_fc2.bias"}),
}


def layout_layer(layout, seed, **extra):
    (grouped, single_w, single_b), _ = LAYOUTS[layout]
    torch.manual_seed(seed)
    layer = MoELayer(MoEConfig(hidden_size=H, num_moe_experts=4, moe_ffn_hidden_size=FFN,
                               gated_linear_unit=True, activation_func=F.silu,
                               moe_grouped_gemm=grouped, moe_single_grouped_weight=single_w,
                               moe_single_grouped_bias=single_b,
                               moe_router_enable_expert_bias=True,
                               moe_router_score_function="sigmoid", **extra))
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_()
        layer.router.expert_bias.normal_()
    return layer


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_each_layout_round_trips(layout):
    src = layout_layer(layout, 1)
    sd = megatron_state_dict(src)
    assert LAYOUTS[layout][1] <= set(sd)
    assert not any(k.startswith("experts.") and k[len("experts."):] in
                   ("weight1", "weight2", "bias1", "bias2") for k in sd)
    assert "router.local_tokens_per_expert" not in sd and "router.expert_bias" in sd
    if layout == "te_single_weight_and_bias":
        assert sd["experts.linear_fc1.weight"].shape == (4, 2 * FFN, H)
        assert sd["experts.linear_fc1.bias"].shape == (4, 2 * FFN)
    dst = layout_layer(layout, 2)
    load_megatron_state_dict(dst, sd)
    for (name, p), q in zip(src.state_dict().items(), dst.state_dict().values()):
        if name != "router.local_tokens_per_expert":
            assert torch.equal(p, q), name
    # every layout loads into a layer of any other (Megatron's loader bridges them too)
    other = layout_layer("local", 3)
    load_megatron_state_dict(other, sd)
    assert torch.equal(other.experts.weight1, src.experts.weight1)
    assert torch.equal(other.experts.bias2, src.experts.bias2)


def test_concatenated_grouped_tensor_and_bad_ones():
    src = layout_layer("te_single_weight_and_bias", 1)
    sd = megatron_state_dict(src)
    flat = dict(sd)
    flat["experts.linear_fc1.weight"] = sd["experts.linear_fc1.weight"].reshape(4 * 2 * FFN, H)
    flat["experts.linear_fc2.bias"] = sd["experts.linear_fc2.bias"].reshape(-1)
    dst = layout_layer("local", 2)
    load_megatron_state_dict(dst, flat)
    assert torch.equal(dst.experts.weight1, src.experts.weight1)
    assert torch.equal(dst.experts.bias2, src.experts.bias2)
    bad = dict(sd, **{"experts.linear_fc2.weight": torch.zeros(7, H)})
    with pytest.raises(ValueError, match=r"experts.linear_fc2.weight: a grouped tensor of shape "
                                         r"\(7, 32\) does not split into 4 local experts"):
        load_megatron_state_dict(dst, bad)
    both = dict(sd, **{"experts.linear_fc1.weight0": sd["experts.linear_fc1.weight"][0]})
    with pytest.raises(ValueError, match="experts.weight1: the state dict holds it both grouped"):
        load_megatron_state_dict(dst, both)


@pytest.mark.megatron
def test_local_layout_loads_into_megatrons_layer():
    src = layout_layer("local", 1, add_bias_linear=False)
    meg = megatron_layer.build(hidden_size=H, moe_ffn_hidden_size=FFN, num_moe_experts=4,
                               moe_router_topk=2, add_bias_linear=False, gated_linear_unit=True,
                               activation_func=F.silu, moe_router_enable_expert_bias=True,
                               moe_router_score_function="sigmoid", moe_aux_loss_coeff=0.0)
    result = meg.load_state_dict(megatron_state_dict(src), strict=False)
    assert result.unexpected_keys == []
    assert all(k.endswith("_extra_state") for k in result.missing_keys), result.missing_keys
    meg.eval(), src.eval()
    x = torch.randn(S, B, H)
    with torch.no_grad():
        close(src(x), meg(x)[0], "output")
