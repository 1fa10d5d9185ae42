"""MoELayer features beyond the Megatron parity grid: compile, training, balancing state, latent
MoE, expert biases (where Megatron's own local path crashes), state-dict naming, bad input."""
import math

import pytest
import torch
import torch.nn.functional as F

from helpers import megatron_layer
from moe_core import MoEConfig, MoELayer, finalize_step, load_megatron_state_dict, ops
from moe_core.ops import AuxLossScale

H = 32


def config(**kw):
    base = dict(hidden_size=H, moe_ffn_hidden_size=48, num_moe_experts=8, moe_router_topk=2,
                add_bias_linear=False, gated_linear_unit=True, activation_func=F.silu,
                moe_router_dtype="fp32", moe_aux_loss_coeff=1e-2)
    base.update(kw)
    return MoEConfig(**base)


def reference_activation(cfg: MoEConfig, a: torch.Tensor) -> torch.Tensor:
    """Megatron's MLP activation from the spec: act(gate) * (linear + offset), gate half clamped
    to max=v and linear half to [-v, v]; or plain act(a)."""
    if not cfg.gated_linear_unit:
        return cfg.activation_func(a)
    half = a.shape[-1] // 2
    gate, linear = a[..., :half], a[..., half:]
    v = cfg.activation_func_clamp_value
    if v is not None:
        gate, linear = torch.clamp(gate, max=v), torch.clamp(linear, -v, v)
    return cfg.activation_func(gate) * (linear + cfg.glu_linear_offset)


def reference_layer(layer: MoELayer, x: torch.Tensor) -> torch.Tensor:
    """The layer written out per token and expert, in fp64 (no permute, no grouped GEMM)."""
    cfg = layer.config
    x2 = x.reshape(-1, cfg.hidden_size).double()
    probs, routing_map = layer.router(x.detach())
    out = torch.zeros_like(x2)
    e1, e2 = layer.experts.weight1.double(), layer.experts.weight2.double()
    for t in range(x2.shape[0]):
        for e in routing_map[t].nonzero().flatten().tolist():
            p = probs[t, e].double()
            a = e1[e] @ x2[t]
            if layer.experts.bias1 is not None:
                a = a + layer.experts.bias1[e].double()
            h = reference_activation(cfg, a) * p
            y = e2[e] @ h
            if layer.experts.bias2 is not None:
                y = y + layer.experts.bias2[e].double() * p
            out[t] += y
    return out.reshape(x.shape)


def test_expert_biases_against_reference():
    """Megatron's local experts cannot run with biases (an in-place add on a custom Function's
    view); ours against the per-token fp64 reference."""
    with pytest.raises(RuntimeError, match="is a view and is being modified inplace"):
        meg = megatron_layer.build(hidden_size=H, moe_ffn_hidden_size=48, num_moe_experts=8,
                                   add_bias_linear=True, gated_linear_unit=False,
                                   activation_func=F.gelu, moe_router_dtype="fp32")
        meg(torch.randn(4, 2, H, requires_grad=True))[0].sum().backward()
    layer = MoELayer(config(add_bias_linear=True, gated_linear_unit=False, activation_func=F.gelu))
    with torch.no_grad():
        for p in (layer.experts.bias1, layer.experts.bias2, layer.router.bias):
            p.copy_(torch.randn_like(p) * 0.1)
    x = torch.randn(6, 2, H)
    ours = layer(x)
    ref = reference_layer(layer, x)
    assert torch.allclose(ours.double(), ref, rtol=1e-5, atol=1e-6)


def squared_relu(x):
    return torch.pow(F.relu(x), 2)


@pytest.mark.parametrize("act,glu", [(F.silu, True), (F.gelu, True), (F.gelu, False),
                                     (F.silu, False), (F.relu, False), (squared_relu, False)],
                         ids=["swiglu", "geglu", "gelu", "silu", "relu", "squared_relu"])
def test_activations_against_reference(act, glu):
    layer = MoELayer(config(gated_linear_unit=glu, activation_func=act, glu_linear_offset=0.5 if glu else 0.0,
                            activation_func_clamp_value=2.0 if glu else None))
    x = torch.randn(5, 2, H)
    assert torch.allclose(layer(x).double(), reference_layer(layer, x), rtol=1e-5, atol=1e-6)


def test_parameter_init_follows_megatron():
    """Router and fc1 ~ N(0, std); fc2 (an output projection) ~ N(0, std / sqrt(2 num_layers))."""
    torch.manual_seed(0)
    cfg = config(hidden_size=256, moe_ffn_hidden_size=512, num_layers=8, init_method_std=0.02,
                 moe_shared_expert_intermediate_size=256)
    layer = MoELayer(cfg)
    for p, std in ((layer.router.weight, 0.02), (layer.experts.weight1, 0.02),
                   (layer.experts.weight2, 0.02 / 4.0), (layer.shared_experts.linear_fc1.weight, 0.02),
                   (layer.shared_experts.linear_fc2.weight, 0.02 / 4.0)):
        assert abs(p.float().std().item() - std) < 0.05 * std and abs(p.float().mean().item()) < 0.1 * std


def test_latent_with_identity_projections_equals_plain_layer():
    plain = MoELayer(config())
    latent = MoELayer(config(moe_latent_size=H))
    latent.load_state_dict({**plain.state_dict(),
                            "fc1_latent_proj.weight": torch.eye(H),
                            "fc2_latent_proj.weight": torch.eye(H)})
    x = torch.randn(5, 3, H)
    assert torch.equal(latent(x), plain(x))


def test_latent_projects_into_the_experts_size():
    layer = MoELayer(config(moe_latent_size=12))
    assert tuple(layer.experts.weight1.shape) == (8, 96, 12)
    assert tuple(layer.experts.weight2.shape) == (8, 12, 48)
    x = torch.randn(4, 2, H, requires_grad=True)
    out = layer(x)
    out.sum().backward()
    assert out.shape == x.shape and layer.fc1_latent_proj.weight.grad.abs().sum() > 0


def test_compile_fullgraph_forward_backward():
    torch._dynamo.reset()
    layer = MoELayer(config(moe_z_loss_coeff=1e-3, moe_shared_expert_intermediate_size=32,
                            moe_shared_expert_gate=True))
    x = torch.randn(8, 2, H, requires_grad=True)
    eager_out = layer(x)
    eager_out.sum().backward()
    eager_grads = [p.grad.clone() for p in layer.parameters()] + [x.grad.clone()]
    layer.zero_grad(set_to_none=True)
    x.grad = None
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    out = compiled(x)
    out.sum().backward()
    assert torch.equal(out, eager_out)
    for a, b in zip([p.grad for p in layer.parameters()] + [x.grad], eager_grads):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-7)


def test_routing_load_is_each_experts_share_of_the_last_forward():
    """router.last_routing_load: the share of the routed (token, expert) pairs each expert got in
    the last forward, against the routing map counted here; None before any forward; a second
    forward on other tokens replaces it, a rewrite of the map (a CUDA-graph replay) shows in the
    next read; the compiled layer's equals the eager one's."""
    torch._dynamo.reset()
    layer = MoELayer(config())
    assert layer.router.last_routing_load is None
    loads, xs = [], []
    for seed in (0, 1):
        x = torch.randn(8, 2, H, generator=torch.Generator().manual_seed(seed))
        xs.append(x)
        _, routing_map = layer.router(x)
        counts = routing_map.sum(0).double()
        layer(x)
        got = layer.router.last_routing_load
        assert got.dtype == torch.float32 and got.shape == (8,)
        torch.testing.assert_close(got.double(), counts / counts.sum(), rtol=0, atol=1e-7)
        assert torch.equal(got, layer.router.last_routing_load)  # every read: the same map
        loads.append(got)
    assert not torch.equal(loads[0], loads[1])
    # a CUDA-graph replay rewrites the captured map in place without running the forward's
    # Python: a read after it must see the new routing
    layer.router._last_routing_map.copy_(routing_map.roll(1, dims=1))
    torch.testing.assert_close(layer.router.last_routing_load.double(),
                               counts.roll(1) / counts.sum(), rtol=0, atol=1e-7)
    layer(xs[0])
    assert torch.equal(layer.router.last_routing_load, loads[0])
    # the compiled forward on the other tokens must replace the map the eager one left
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    compiled(xs[1])
    assert torch.equal(layer.router.last_routing_load, loads[1])


def test_short_training_run_loss_falls():
    """Fit a fixed random target with the layer: the loss must fall well below its start."""
    torch.manual_seed(0)
    layer = MoELayer(config(moe_z_loss_coeff=1e-3))
    x = torch.randn(64, H)
    target = torch.tanh(x @ torch.randn(H, H) / math.sqrt(H))
    opt = torch.optim.Adam(layer.parameters(), lr=1e-2)
    losses = []
    for _ in range(40):
        loss = F.mse_loss(layer(x), target)
        opt.zero_grad()
        loss.backward()
        opt.step()
        finalize_step(layer)
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0], losses[::8]


def test_eval_and_no_grad_update_no_statistics():
    layer = MoELayer(config(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                            moe_router_load_balancing_type="global_aux_loss"))
    x = torch.randn(8, 2, H)
    with torch.no_grad():
        layer(x)
    layer.eval()
    layer(x)
    assert layer.router.local_tokens_per_expert.sum() == 0
    assert layer.router.global_aux_buffer.steps == 0
    assert layer.router.last_losses == {}
    layer.train()
    layer(x)
    assert layer.router.local_tokens_per_expert.sum() == 16 * 2
    assert layer.router.global_aux_buffer.steps == 1


def test_expert_bias_update_matches_megatron_over_steps():
    """Three steps of routing + bias update, ours vs Megatron's counts and get_updated_expert_bias."""
    kw = dict(hidden_size=H, moe_ffn_hidden_size=48, num_moe_experts=8, moe_router_topk=2,
              add_bias_linear=False, gated_linear_unit=True, activation_func=F.silu,
              moe_router_dtype="fp32", moe_router_score_function="sigmoid",
              moe_router_enable_expert_bias=True, moe_router_bias_update_rate=1e-2,
              moe_router_load_balancing_type="none")
    meg = megatron_layer.build(**kw)
    ours = MoELayer(MoEConfig.from_megatron(meg.config))
    load_megatron_state_dict(ours, meg.state_dict())
    for step in range(3):
        x = torch.randn(8, 2, H)
        meg(x)
        ours(x)
        assert torch.equal(ours.router.local_tokens_per_expert, meg.router.local_tokens_per_expert)
        counts = meg.router.local_tokens_per_expert.clone()
        new = megatron_layer.moe_utils.get_updated_expert_bias(
            counts, meg.router.expert_bias, 1e-2, megatron_layer.dist.group.WORLD)
        meg.router.expert_bias.copy_(new)
        meg.router.local_tokens_per_expert.zero_()
        finalize_step(ours)
        assert torch.equal(ours.router.expert_bias, meg.router.expert_bias), step
        assert ours.router.local_tokens_per_expert.sum() == 0
    assert ours.router.expert_bias.abs().sum() > 0


def test_input_jitter_matches_megatron():
    kw = dict(hidden_size=H, moe_ffn_hidden_size=48, num_moe_experts=8, moe_router_topk=2,
              add_bias_linear=False, gated_linear_unit=True, activation_func=F.silu,
              moe_router_dtype="fp32", moe_input_jitter_eps=0.1, moe_aux_loss_coeff=0.0)
    meg = megatron_layer.build(**kw)
    ours = MoELayer(MoEConfig.from_megatron(meg.config))
    load_megatron_state_dict(ours, meg.state_dict())
    x = torch.randn(8, 2, H)
    torch.manual_seed(7)
    out_meg, _ = meg(x)
    torch.manual_seed(7)
    out_ours = ours(x)
    assert (out_ours - out_meg).abs().max() <= 2 * 2.0**-23 * out_meg.abs().max() * 8


def test_te_grouped_state_dict_naming():
    layer = MoELayer(config())
    sd = {"router.weight": torch.randn(8, H)}
    for i in range(8):
        sd[f"experts.linear_fc1.weight{i}"] = torch.randn(96, H)
        sd[f"experts.linear_fc2.weight{i}"] = torch.randn(H, 48)
        sd[f"experts.linear_fc1._extra_state{i}"] = None
    load_megatron_state_dict(layer, sd)
    assert torch.equal(layer.experts.weight1[3], sd["experts.linear_fc1.weight3"])
    assert torch.equal(layer.experts.weight2[7], sd["experts.linear_fc2.weight7"])


def test_aux_loss_scale_is_per_layer():
    """Two layers with different scales: each router's gradient gets its own aux scale."""
    torch.manual_seed(0)
    a, b = MoELayer(config()), MoELayer(config())
    b.load_state_dict(a.state_dict())
    a.router.aux_loss_scale = AuxLossScale(0.0)
    b.router.aux_loss_scale = AuxLossScale(100.0)
    x = torch.randn(8, 2, H)
    a(x).sum().backward()
    b(x).sum().backward()
    assert not torch.allclose(a.router.weight.grad, b.router.weight.grad)
    c = MoELayer(config(moe_aux_loss_coeff=0.0))
    c.load_state_dict(a.state_dict())
    c(x).sum().backward()
    assert torch.allclose(a.router.weight.grad, c.router.weight.grad, atol=1e-7)


def test_layer_ops_list_names_registered_ops():
    """layer_runs_on_cuda() checks CUDA kernels by name: every name must be a real op (a typo would
    make the check vacuous), and on this build the layer's CPU kernels all exist."""
    import moe_core

    for op in moe_core.LAYER_OPS:
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"moe_core::{op}", "CPU"), op
    if not torch.cuda.is_available():
        assert moe_core.layer_runs_on_cuda() is False


def _cxx_ops_of_step(layer, x):
    """The C++ ops (kernels registered per device) a forward + backward of ``layer`` calls,
    nested ones included (the profiler sees ops called inside Python-defined ops too)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        layer(x).sum().backward()
    names = {e.name[len("moe_core::"):] for e in prof.events() if e.name.startswith("moe_core::")}
    return {n for n in names
            if torch._C._dispatch_has_kernel_for_dispatch_key(f"moe_core::{n}", "CPU")}


def test_layer_ops_list_is_what_a_step_calls():
    """LAYER_OPS (what layer_runs_on_cuda() checks) is exactly the C++ ops a training step calls
    over the layer's paths: the fused experts with the rows read by index (the tokens' gradient
    whole and in row chunks) and with the rows made, the unfused experts (biases), softmax with
    aux and z losses, sigmoid with groups and an expert bias, capacity dropping, padding to
    capacity. A stale entry or a missing op fails."""
    import moe_core

    x = torch.randn(24, H, requires_grad=True)
    paths = [config(moe_z_loss_coeff=1e-3, moe_expert_rows_by_index=True),
             config(moe_expert_rows_by_index=False),
             config(add_bias_linear=True),
             config(moe_router_score_function="sigmoid", moe_router_num_groups=4,
                    moe_router_group_topk=2, moe_router_enable_expert_bias=True,
                    moe_aux_loss_coeff=0.0),
             config(moe_expert_capacity_factor=1.0),
             config(moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=True)]
    called = set()
    for cfg in paths:
        called |= _cxx_ops_of_step(MoELayer(cfg), x)
    # by index at top-4 in bf16, with more rows than the weights hold: the tokens' gradient made
    # in row chunks (permute_bwd_accumulate_)
    chunked = config(moe_router_topk=4, params_dtype=torch.bfloat16, moe_expert_rows_by_index=True)
    xb = torch.randn(512, H, dtype=torch.bfloat16, requires_grad=True)
    called |= _cxx_ops_of_step(MoELayer(chunked), xb)
    assert called == set(moe_core.LAYER_OPS), (sorted(called - set(moe_core.LAYER_OPS)),
                                                sorted(set(moe_core.LAYER_OPS) - called))


# ---- bad input: one test per case -------------------------------------------------------------

def test_hidden_states_wrong_width():
    with pytest.raises(ValueError, match=r"hidden_states must be \[S, B, 32\] or \[T, 32\], got \(4, 2, 31\)"):
        MoELayer(config())(torch.randn(4, 2, 31))


def test_hidden_states_wrong_rank():
    with pytest.raises(ValueError, match=r"hidden_states must be .* got \(32,\)"):
        MoELayer(config())(torch.randn(32))


def test_padding_mask_wrong_shape():
    with pytest.raises(ValueError, match=r"padding_mask must be \[B, S\] = \[2, 4\] .* got \(4, 2\)"):
        MoELayer(config())(torch.randn(4, 2, H), padding_mask=torch.zeros(4, 2, dtype=torch.bool))


def test_padding_mask_not_bool():
    with pytest.raises(TypeError, match="padding_mask must be bool .* got torch.int64"):
        MoELayer(config())(torch.randn(6, H), padding_mask=torch.zeros(6, dtype=torch.long))


BAD_CONFIGS = {
    "no_experts": (dict(num_moe_experts=None), "num_moe_experts=None"),
    "zero_hidden": (dict(hidden_size=0), "hidden_size=0"),
    "topk_above_experts": (dict(moe_router_topk=9), r"moe_router_topk=9: must be in \[1, num_moe_experts=8\]"),
    "score_function": (dict(moe_router_score_function="relu"), "moe_router_score_function='relu'"),
    "router_dtype": (dict(moe_router_dtype="bf16"), "moe_router_dtype='bf16'"),
    "balancing_type": (dict(moe_router_load_balancing_type="magic"), "moe_router_load_balancing_type='magic'"),
    "quantile_balancing": (dict(moe_router_load_balancing_type="quantile_balancing"), "quantile balancing"),
    "coeff_list_mismatch": (dict(moe_router_load_balancing_type=["aux_loss", "seq_aux_loss"], moe_aux_loss_coeff=0.1),
                            "moe_aux_loss_coeff=0.1: must be a list"),
    "sinkhorn_with_coeff": (dict(moe_router_load_balancing_type="sinkhorn", moe_aux_loss_coeff=0.1),
                            "sinkhorn balancing requires"),
    "top1_softmax_post": (dict(moe_router_topk=1), "moe_router_topk=1: top-1 softmax routing needs"),
    "expert_bias_softmax": (dict(moe_router_enable_expert_bias=True), "moe_router_enable_expert_bias=True"),
    "groups_not_dividing": (dict(moe_router_num_groups=3, moe_router_group_topk=1), "moe_router_num_groups=3: must divide"),
    "group_topk_without_groups": (dict(moe_router_group_topk=2), "moe_router_num_groups=None: must be set"),
    "group_topk_too_large": (dict(moe_router_num_groups=4, moe_router_group_topk=5), "moe_router_group_topk=5"),
    "capacity_with_sinkhorn": (dict(moe_expert_capacity_factor=1.0, moe_router_load_balancing_type="sinkhorn",
                                    moe_aux_loss_coeff=0.0), "moe_expert_capacity_factor=1.0: token dropping"),
    "pad_without_capacity": (dict(moe_pad_expert_input_to_capacity=True), "moe_pad_expert_input_to_capacity=True"),
    "drop_policy": (dict(moe_expert_capacity_factor=1.0, moe_token_drop_policy="random"), "moe_token_drop_policy='random'"),
    "token_dropping_flag": (dict(moe_token_dropping=True), "moe_token_dropping=True"),
    "probs_on_input_topk2": (dict(moe_apply_probs_on_input=True), "moe_apply_probs_on_input=True: needs moe_router_topk=1"),
    "shared_expert_with_bias": (dict(moe_shared_expert_intermediate_size=16, add_bias_linear=True), "add_bias_linear=True"),
    "shared_expert_size": (dict(moe_shared_expert_intermediate_size=0), "moe_shared_expert_intermediate_size=0"),
    "shared_expert_overlap": (dict(moe_shared_expert_overlap=True), "moe_shared_expert_overlap=True"),
    "latent_size": (dict(moe_latent_size=-4), "moe_latent_size=-4"),
    "experts_float": (dict(num_moe_experts=4.0), "num_moe_experts=4.0: must be an int"),
    "experts_string": (dict(num_moe_experts="4"), "num_moe_experts='4': must be an int"),
    "experts_bool": (dict(num_moe_experts=True), "num_moe_experts=True: must be an int"),
    "hidden_float": (dict(hidden_size=16.0), "hidden_size=16.0: must be an int"),
    "topk_fraction": (dict(moe_router_topk=2.5), "moe_router_topk=2.5: must be an int"),
    "params_dtype_int": (dict(params_dtype=torch.int32), "params_dtype=torch.int32: must be a floating"),
    "activation_none": (dict(activation_func=None), "activation_func=None: must be a callable"),
    "init_std_negative": (dict(init_method_std=-0.1), "init_method_std=-0.1: must be >= 0"),
    "z_loss_nan": (dict(moe_z_loss_coeff=float("nan")), "moe_z_loss_coeff=nan: must be a finite"),
    "z_loss_inf": (dict(moe_z_loss_coeff=float("inf")), "moe_z_loss_coeff=inf: must be a finite"),
    "capacity_nan": (dict(moe_expert_capacity_factor=float("nan")),
                     "moe_expert_capacity_factor=nan: must be a finite"),
    "capacity_inf": (dict(moe_expert_capacity_factor=float("inf")),
                     "moe_expert_capacity_factor=inf: must be a finite"),
    "aux_coeff_nan": (dict(moe_aux_loss_coeff=float("nan")), "moe_aux_loss_coeff=nan: must be a finite"),
    "flag_not_bool": (dict(gated_linear_unit=1), "gated_linear_unit=1: must be a bool"),
    "expert_parallel_not_dividing": (dict(expert_model_parallel_size=3), "expert_model_parallel_size=3"),
    "expert_parallel_flex": (dict(expert_model_parallel_size=2, moe_token_dispatcher_type="flex"),
                             "moe_token_dispatcher_type='flex'"),
    "expert_tensor_parallel": (dict(expert_tensor_parallel_size=2), "expert_tensor_parallel_size=2"),
    "shared_expert_overlap_without_shared_expert": (
        dict(moe_shared_expert_overlap=True, moe_token_dispatcher_type="alltoall"),
        "moe_shared_expert_overlap=True: needs a shared expert"),
    "shared_expert_overlap_allgather": (dict(moe_shared_expert_overlap=True, moe_shared_expert_intermediate_size=16,
                                             add_bias_linear=False), "moe_shared_expert_overlap=True"),
    "tensor_parallel": (dict(tensor_model_parallel_size=2), "tensor_model_parallel_size=2"),
    "jitter_eps": (dict(moe_input_jitter_eps=1.5), "moe_input_jitter_eps=1.5"),
    "dispatcher": (dict(moe_token_dispatcher_type="mpi"), "moe_token_dispatcher_type='mpi'"),
    "fp8_padding": (dict(moe_router_padding_for_quantization=True), "moe_router_padding_for_quantization=True"),
    "num_layers": (dict(num_layers=0), "num_layers=0"),
    # the routing rules beyond Megatron's
    "norm_topk_prob_not_bool": (dict(moe_router_norm_topk_prob=1),
                                "moe_router_norm_topk_prob=1: must be None, True or False"),
    "norm_topk_prob_post_softmax": (dict(moe_router_norm_topk_prob=True),
                                    "moe_router_norm_topk_prob=True: post-softmax routing"),
    "norm_topk_prob_sinkhorn": (dict(moe_router_load_balancing_type="sinkhorn", moe_aux_loss_coeff=0.0,
                                     moe_router_score_function="sigmoid", moe_router_norm_topk_prob=False),
                                "moe_router_norm_topk_prob=False: sinkhorn routing"),
    "norm_topk_prob_top1": (dict(moe_router_topk=1, moe_router_score_function="sigmoid",
                                 moe_router_norm_topk_prob=True),
                            "moe_router_norm_topk_prob=True: top-1 renormalised probs"),
    "group_score_without_groups": (dict(moe_router_group_score_topk=2),
                                   "moe_router_group_score_topk=2: needs group-limited routing"),
    "group_score_zero": (dict(moe_router_num_groups=4, moe_router_group_topk=2, moe_router_group_score_topk=0),
                         r"moe_router_group_score_topk=0: must be in \[1, 2\]"),
    "group_score_above_group": (dict(moe_router_num_groups=4, moe_router_group_topk=2,
                                     moe_router_group_score_topk=3),
                                r"moe_router_group_score_topk=3: must be in \[1, 2\]"),
    "group_score_float": (dict(moe_router_num_groups=4, moe_router_group_topk=2, moe_router_group_score_topk=1.0),
                          "moe_router_group_score_topk=1.0: must be an int or None"),
    "group_topk_above_topk": (dict(moe_router_num_groups=4, moe_router_group_topk=3),
                              "moe_router_group_topk=3: must be <= moe_router_topk=2"),
    "kept_groups_too_small": (dict(moe_router_topk=4, moe_router_num_groups=4, moe_router_group_topk=1,
                                   moe_router_group_score_topk=1),
                              "moe_router_group_topk=1: must keep enough experts"),
    "jitter_mode": (dict(moe_input_jitter_mode="experts"), "moe_input_jitter_mode='experts'"),
    # ranges of the remaining numeric fields
    "aux_coeff_negative": (dict(moe_aux_loss_coeff=-0.1), r"moe_aux_loss_coeff=-0.1: must be >= 0"),
    "aux_coeff_list_negative": (dict(moe_router_load_balancing_type=["aux_loss", "seq_aux_loss"],
                                     moe_aux_loss_coeff=[0.1, -0.1]),
                                r"moe_aux_loss_coeff=\[0.1, -0.1\]: must be >= 0"),
    "bias_update_rate_negative": (dict(moe_router_bias_update_rate=-1e-3),
                                  "moe_router_bias_update_rate=-0.001: must be >= 0"),
    "scaling_factor_zero": (dict(moe_router_topk_scaling_factor=0.0),
                            "moe_router_topk_scaling_factor=0.0: must be > 0"),
    "scaling_factor_negative": (dict(moe_router_topk_scaling_factor=-2.5),
                                "moe_router_topk_scaling_factor=-2.5: must be > 0"),
    "clamp_value_negative": (dict(activation_func_clamp_value=-7.0),
                             "activation_func_clamp_value=-7.0: must be > 0"),
    "ffn_hidden_zero": (dict(ffn_hidden_size=0), "ffn_hidden_size=0: must be >= 1"),
    "num_groups_zero": (dict(moe_router_num_groups=0), "moe_router_num_groups=0: must be >= 1"),
    "group_topk_negative": (dict(moe_router_num_groups=4, moe_router_group_topk=-1),
                            "moe_router_group_topk=-1: must be >= 1"),
    "limited_devices_negative": (dict(moe_router_topk_limited_devices=-1),
                                 "moe_router_topk_limited_devices=-1: must be >= 1"),
    "layer_freq_zero": (dict(moe_layer_freq=0), "moe_layer_freq=0: must be an int >= 1"),
    "layer_freq_float": (dict(moe_layer_freq=1.5), "moe_layer_freq=1.5: must be an int >= 1"),
    "layer_freq_pattern": (dict(moe_layer_freq=[1, 2]), r"moe_layer_freq=\[1, 2\]: a list must be"),
    "fp8_padding_not_bool": (dict(moe_router_padding_for_quantization="yes"),
                             "moe_router_padding_for_quantization='yes': must be a bool or None"),
    "rows_by_index_not_bool": (dict(moe_expert_rows_by_index=1),
                               "moe_expert_rows_by_index=1: must be a bool or None"),
    "bias_update_rate_inf": (dict(moe_router_bias_update_rate=float("inf")),
                             "moe_router_bias_update_rate=inf: must be a finite"),
}


@pytest.mark.parametrize("case", sorted(BAD_CONFIGS))
def test_bad_config(case):
    kw, message = BAD_CONFIGS[case]
    with pytest.raises(ValueError, match=message):
        config(**kw)


def test_negative_capacity_factor_means_dropless():
    assert config(moe_expert_capacity_factor=-1.0).moe_expert_capacity_factor is None


@pytest.mark.parametrize("pad", [False, True])
def test_capacity_factor_past_int64_keeps_every_token(pad):
    """A capacity of ceil(T·topk/E · 1e30) does not fit the op's int64 argument; any capacity of
    at least T keeps every routed token (and with padding puts every token in every expert), so
    the layer must equal one with a capacity factor of exactly E (capacity = T·topk >= T)."""
    x = torch.randn(6, H)
    outs = []
    for cf in (1e30, 8.0):
        torch.manual_seed(0)
        layer = MoELayer(config(moe_expert_capacity_factor=cf,
                                moe_pad_expert_input_to_capacity=pad))
        _, routing_map = layer.router(x)
        assert routing_map.sum() == (6 * 8 if pad else 6 * 2)
        outs.append(layer(x))
    assert torch.equal(outs[0], outs[1])


# ---- the routing rules beyond Megatron's, through the router and the layer -------------------
def _dense(p: torch.Tensor, i: torch.Tensor, E: int):
    return torch.zeros(p.shape[0], E, dtype=p.dtype).scatter(1, i, p)


def test_router_passes_norm_topk_prob_and_group_score_topk_down():
    cfg = config(num_moe_experts=16, moe_router_topk=3, moe_router_score_function="sigmoid",
                 moe_router_norm_topk_prob=False, moe_router_num_groups=4, moe_router_group_topk=2,
                 moe_router_group_score_topk=1, moe_aux_loss_coeff=0.0)
    layer = MoELayer(cfg)
    x = torch.randn(10, H)
    probs, routing_map = layer.router(x)
    logits = ops.router_gating_linear(x, layer.router.weight, None, torch.float32)
    p, i = ops.router_topk(logits, 3, score_function="sigmoid", num_groups=4, group_topk=2,
                           group_score_topk=1, normalize=False)
    assert torch.equal(probs, _dense(p, i, 16))
    assert torch.equal(routing_map, _dense(p, i, 16) != 0)
    # raw sigmoid scores: a token's probs do not sum to one
    assert not torch.allclose(probs.sum(-1), torch.ones(10))
    assert "group_score_topk=1" in repr(layer.router) and "norm_topk_prob=False" in repr(layer.router)


def test_softmax_pre_expert_bias_steers_the_choice_and_is_updated():
    cfg = config(moe_router_pre_softmax=True, moe_router_enable_expert_bias=True,
                 moe_router_bias_update_rate=0.5, moe_aux_loss_coeff=0.0,
                 moe_router_load_balancing_type="none")
    layer = MoELayer(cfg).train()
    x = torch.randn(12, H)
    with torch.no_grad():
        layer.router.expert_bias.copy_(torch.tensor([0, 0, 0, 0, 0, 0, 0, 2.0]))
    probs, routing_map = layer.router(x)
    assert bool(routing_map[:, 7].all())  # a softmax prob + 2 beats every unbiased one
    logits = ops.router_gating_linear(x, layer.router.weight, None, torch.float32)
    s = torch.softmax(logits, dim=-1)
    # the probs are the unbiased softmax values
    torch.testing.assert_close(probs[routing_map], s[routing_map], rtol=4 * 2.0**-23, atol=0)
    counts = routing_map.sum(0).float()
    before = layer.router.expert_bias.clone()
    finalize_step(layer)  # bias += rate * sign(mean count - count): expert 7 took every token
    assert torch.equal(layer.router.expert_bias, before + 0.5 * torch.sign(counts.mean() - counts))
    assert layer.router.expert_bias[7] == 1.5


def test_layer_jitter_mode_jitters_router_and_experts_in_training_only():
    layer = MoELayer(config(moe_input_jitter_eps=0.1, moe_input_jitter_mode="layer")).train()
    plain = MoELayer(config()).train()
    plain.load_state_dict(layer.state_dict())
    x = torch.randn(8, 2, H)
    torch.manual_seed(5)
    noise = torch.empty_like(x).uniform_(0.9, 1.1)
    torch.manual_seed(5)
    out = layer(x)
    assert torch.equal(out, plain(x * noise))  # the same jittered input for router and experts
    layer.eval()
    plain.eval()
    assert torch.equal(layer(x), plain(x))  # no jitter in evaluation (Megatron's mode has one)


def test_fp32_router_with_bf16_experts_and_the_new_rules():
    # moe_router_dtype="fp32": the logits and probs are fp32 from bf16 activations and weights
    # (Megatron's field), the experts stay bf16
    cfg = config(num_moe_experts=16, moe_router_topk=3, moe_router_score_function="sigmoid",
                 moe_router_norm_topk_prob=False, moe_router_num_groups=4, moe_router_group_topk=2,
                 moe_router_group_score_topk=2, params_dtype=torch.bfloat16, moe_aux_loss_coeff=0.0)
    layer = MoELayer(cfg)
    x = torch.randn(10, H).to(torch.bfloat16)
    probs, routing_map = layer.router(x)
    assert probs.dtype == torch.float32 and layer.experts.weight1.dtype == torch.bfloat16
    logits = x.float() @ layer.router.weight.float().t()
    p, i = ops.router_topk(logits, 3, score_function="sigmoid", num_groups=4, group_topk=2,
                           group_score_topk=2, normalize=False)
    assert torch.equal(routing_map, _dense(p, i, 16) != 0)
    torch.testing.assert_close(probs, _dense(p, i, 16), rtol=2 * 2.0**-23, atol=0)
    out = layer(x)
    assert out.dtype == torch.bfloat16 and out.shape == x.shape


_FIRST_BACKWARD = """
import torch
from moe_core import MoEConfig, MoELayer


def step(device):
    torch.manual_seed(0)
    cfg = MoEConfig(hidden_size=256, moe_ffn_hidden_size=128, num_moe_experts=8,
                    moe_router_topk=2, moe_expert_rows_by_index=True, add_bias_linear=False,
                    gated_linear_unit=True, activation_func=torch.nn.functional.silu,
                    params_dtype=torch.bfloat16)
    layer = MoELayer(cfg, device=device)
    assert layer.experts.reads_rows_by_index  # the fused expert path
    g = torch.Generator().manual_seed(1)
    x = torch.randn(512, 256, generator=g).to(torch.bfloat16).to(device).requires_grad_()
    dy = torch.randn(512, 256, generator=g).to(torch.bfloat16).to(device)
    out = layer(x)
    out.backward(dy)
    return {"out": out.detach().cpu(), "dx": x.grad.cpu(),
            **{n: p.grad.cpu() for n, p in layer.named_parameters()}}
"""


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_rows_by_index_first_backward_of_a_process(tmp_path):
    """The by-index layer's backward as a fresh process's first backward: autograd's device
    thread then does its first CUDA work in the experts' gathered GEMMs, with no context made
    current on it yet. It runs, and equals bit for bit the same step in this process, where
    earlier work has run on that thread."""
    import os
    import subprocess
    import sys

    path = str(tmp_path / "step.pt")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    child = _FIRST_BACKWARD + "\nimport sys\ntorch.save(step('cuda'), sys.argv[1])\n"
    proc = subprocess.run([sys.executable, "-c", child, path], capture_output=True, text=True,
                          timeout=300, cwd=root)
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = torch.load(path)
    scope = {}
    exec(_FIRST_BACKWARD, scope)
    want = scope["step"]("cuda")
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name
