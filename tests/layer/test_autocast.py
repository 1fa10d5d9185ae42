"""MoELayer under torch.autocast (the "bf16-mixed" recipe): fp32 parameters, the experts' GEMMs in
the autocast dtype as nn.Linear's, the router in moe_router_dtype, the aux losses fp32; and the
input-dtype check outside autocast.

The reference for the values is the layer's own path on explicitly cast copies: the fp32 router
(outside autocast) routes, then a bf16 copy of the rest of the layer (same weights, rounded once)
runs routed_experts, the latent projections and the shared expert on the input cast to bf16. That
is what autocast must do, op for op, so output and gradients are compared bitwise (the fp32
parameters' gradients against the bf16 copy's, widened).
"""
import copy

import pytest
import torch
import torch.nn.functional as F

from helpers.world_group import world_group  # noqa: F401  (fixture)
from moe_core import MoEConfig, MoELayer

H = 32
BF16 = torch.bfloat16

CASES = {
    # the fused expert_mlp path (no bias, a known activation)
    "fused": dict(),
    # the unfused path: biases, grouped_gemm + glu_probs
    "bias": dict(add_bias_linear=True),
    # the shared expert with its gate, and the z-loss
    "shared": dict(moe_shared_expert_intermediate_size=24, moe_shared_expert_gate=True,
                   moe_z_loss_coeff=1e-3),
    # latent projections (nn.Linear) around the experts
    "latent": dict(moe_latent_size=16),
    # probs on the input (top-1)
    "probs_on_input": dict(moe_router_topk=1, moe_apply_probs_on_input=True,
                           moe_router_pre_softmax=True),
}


def config(**kw) -> MoEConfig:
    base = dict(hidden_size=H, moe_ffn_hidden_size=48, num_moe_experts=8, moe_router_topk=2,
                add_bias_linear=False, gated_linear_unit=True, activation_func=F.silu,
                moe_router_dtype="fp32", moe_aux_loss_coeff=1e-2)
    base.update(kw)
    return MoEConfig(**base)


def _layer(device: str, **kw) -> MoELayer:
    layer = MoELayer(config(**kw), device=device, dtype=torch.float32)
    with torch.no_grad():  # biases start at zero: give them values so that they count
        for name, p in layer.named_parameters():
            if "bias" in name:
                p.normal_(0.0, 0.1)
    return layer


def _reference(layer: MoELayer, x: torch.Tensor):
    """(output, {param name: grad in fp32}, input grad) of the explicit casts (module docstring)."""
    router = copy.deepcopy(layer.router)
    low = copy.deepcopy(layer).to(BF16)
    x = x.detach().clone().requires_grad_(True)
    probs, routing_map = router(x)
    h = x.to(BF16)
    t = h.reshape(-1, H)
    if low.fc1_latent_proj is not None:
        t = low.fc1_latent_proj(t)
    out = low.routed_experts(t, probs, routing_map)
    if low.fc2_latent_proj is not None:
        out = low.fc2_latent_proj(out)
    out = out.reshape(h.shape)
    if low.shared_experts is not None:
        out = out + low.shared_experts(h)
    out.float().square().sum().backward()
    grads = {n: p.grad.float() for n, p in low.named_parameters() if not n.startswith("router.")}
    grads.update({f"router.{n}": p.grad for n, p in router.named_parameters()})
    return out.detach(), grads, x.grad


@pytest.mark.parametrize("case", sorted(CASES))
def test_autocast_equals_explicit_bf16_casts(device, case):
    layer = _layer(device, **CASES[case])
    x = torch.randn(6, 2, H, device=device, requires_grad=True)
    want, want_grads, want_dx = _reference(layer, x)
    with torch.autocast(device, dtype=BF16):
        out = layer(x)
        assert out.dtype == BF16 and out.shape == x.shape
    out.float().square().sum().backward()  # outside the region, as torch.autocast advises
    assert torch.equal(out.detach(), want)
    grads = {n: p.grad for n, p in layer.named_parameters()}
    assert sorted(grads) == sorted(want_grads)
    for name, g in grads.items():
        assert g.dtype == torch.float32, name
        assert g.abs().sum() > 0, name
        assert torch.equal(g, want_grads[name]), name
    assert x.grad.dtype == torch.float32
    # the input's gradient sums the router's and the experts' (and the shared expert's) parts in
    # the order autograd meets them: equal up to that order's rounding
    torch.testing.assert_close(x.grad, want_dx, rtol=1e-6, atol=1e-7)


def test_autocast_bf16_input_to_fp32_layer(device):
    """The input a preceding autocast op hands over is already bf16: the router computes in its
    fp32 moe_router_dtype on it, the experts in bf16."""
    layer = _layer(device)
    x = torch.randn(10, H, device=device).to(BF16).requires_grad_(True)
    with torch.autocast(device, dtype=BF16):
        out = layer(x)
    want, _, _ = _reference(layer, x.detach().float())  # exact: x is bf16-valued
    assert out.dtype == BF16
    assert torch.equal(out.detach(), want)
    out.float().sum().backward()
    assert x.grad.dtype == BF16 and layer.experts.weight1.grad.dtype == torch.float32


@pytest.mark.parametrize("router_dtype", ["fp32", "fp64"])
def test_router_keeps_its_dtype_under_autocast(device, router_dtype):
    layer = _layer(device, moe_router_dtype=router_dtype, moe_z_loss_coeff=1e-3)
    x = torch.randn(16, H, device=device)
    want_probs, want_map = layer.router(x)
    want_losses = dict(layer.router.last_losses)
    with torch.autocast(device, dtype=BF16):
        probs, routing_map = layer.router(x)
        layer(x)  # the whole layer routes the same way
    assert probs.dtype == want_probs.dtype == layer.config.router_dtype
    assert torch.equal(routing_map, want_map) and torch.equal(probs, want_probs)
    losses = layer.router.last_losses
    assert sorted(losses) == sorted(want_losses) == ["load_balancing_loss", "z_loss"]
    for name, value in losses.items():
        assert value.dtype == (torch.float64 if router_dtype == "fp64" else torch.float32)
        assert torch.equal(value, want_losses[name]), name


def test_no_autocast_output_unchanged(device):
    """Outside autocast the fp32 layer is what it was: the output and gradients of an fp32 run
    equal a run of a copy (no cast sneaks in)."""
    layer = _layer(device, add_bias_linear=True)
    other = copy.deepcopy(layer)
    x = torch.randn(12, H, device=device)
    a, b = layer(x), other(x)
    assert a.dtype == torch.float32 and torch.equal(a, b)


@pytest.mark.parametrize("layer_dtype,input_dtype", [(BF16, torch.float32),
                                                     (torch.float32, BF16)])
def test_input_dtype_mismatch_raises_before_routing(device, layer_dtype, input_dtype):
    layer = MoELayer(config(moe_expert_capacity_factor=None), device=device, dtype=layer_dtype)
    calls = []
    layer.router.register_forward_pre_hook(lambda *a: calls.append(1))
    x = torch.randn(4, H, device=device, dtype=input_dtype)
    with pytest.raises(TypeError) as err:
        layer(x)
    msg = str(err.value)
    for part in ("hidden_states", str(layer_dtype), str(input_dtype), "params_dtype", "dtype=",
                 "torch.autocast"):
        assert part in msg, (part, msg)
    assert not calls  # the router never ran


@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
@pytest.mark.parametrize("case", ["fused", "bias"])
def test_expert_parallel_path_under_autocast(world_group, dispatcher, case):  # noqa: F811
    """The expert-parallel path (a group of one: dispatch, the experts' forward_rows, the
    dispatcher's combine) under autocast: the same bits as the plain layer under autocast, as
    outside it; the rows travel in bf16."""
    plain = _layer("cpu", moe_token_dispatcher_type=dispatcher, **CASES[case])
    ep = MoELayer(plain.config, ep_group=world_group)
    ep.load_state_dict(plain.state_dict())
    x = torch.randn(6, 2, H)
    outs, grads = [], []
    for layer in (plain, ep):
        with torch.autocast("cpu", dtype=BF16):
            out = layer(x)
        out.float().square().sum().backward()
        outs.append(out.detach())
        grads.append({n: p.grad for n, p in layer.named_parameters()})
    assert outs[0].dtype == outs[1].dtype == BF16 and torch.equal(outs[1], outs[0])
    assert sorted(grads[1]) == sorted(grads[0])
    for name, g in grads[1].items():
        assert g.dtype == torch.float32 and torch.equal(g, grads[0][name]), name


def test_compile_fullgraph_under_autocast():
    torch._dynamo.reset()
    layer = _layer("cpu", moe_shared_expert_intermediate_size=24, moe_shared_expert_gate=True)
    x = torch.randn(8, 2, H, requires_grad=True)
    with torch.autocast("cpu", dtype=BF16):
        eager = layer(x)
    eager.float().sum().backward()
    want = [p.grad.clone() for p in layer.parameters()] + [x.grad.clone()]
    layer.zero_grad(set_to_none=True)
    x.grad = None
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    with torch.autocast("cpu", dtype=BF16):
        out = compiled(x)
    out.float().sum().backward()
    assert out.dtype == BF16 and torch.equal(out, eager)
    for got, ref in zip([p.grad for p in layer.parameters()], want):
        assert got.dtype == ref.dtype == torch.float32
        assert torch.equal(got, ref)
    # the graph casts x to bf16 once for the shared expert, its gate and the experts (eager casts
    # it per use), so the three bf16 input gradients meet in bf16 before the cast back to fp32:
    # within a bf16 rounding of the largest gradient
    dx = want[-1]
    assert x.grad.dtype == torch.float32
    torch.testing.assert_close(x.grad, dx, rtol=0, atol=2.0**-8 * dx.abs().max().item())
