"""PyTorch module conventions of MoELayer and its submodules: ``device=`` / ``dtype=`` factory
kwargs, ``reset_parameters`` re-drawing exactly what construction drew, building on the meta
device then ``to_empty`` + ``reset_parameters``, fp32 router buffers under a dtype cast, and
``extra_repr`` naming the sizes, an output that is no view (FSDP2's warning)."""
import warnings

import pytest
import torch

from moe_core import MoEConfig, MoELayer
from moe_core.experts import GroupedMLP, SharedExpertMLP
from moe_core.router import TopKRouter

from helpers.world_group import world_group  # noqa: F401  (a fixture)

PLAIN = dict(hidden_size=32, num_moe_experts=8, moe_ffn_hidden_size=16, moe_router_topk=2,
             add_bias_linear=False)
# between them every kind of parameter and buffer: expert bias (sigmoid), global aux loss,
# latent projections, a gated shared expert; router, latent and expert biases
FULL = dict(PLAIN, moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
            moe_router_load_balancing_type="global_aux_loss", moe_aux_loss_coeff=1e-2,
            moe_latent_size=24, moe_shared_expert_intermediate_size=16,
            moe_shared_expert_gate=True, num_layers=4)
BIASED = dict(PLAIN, add_bias_linear=True, moe_latent_size=24, num_layers=2)
KINDS = pytest.mark.parametrize("kw", [PLAIN, FULL, BIASED], ids=["plain", "full", "biased"])


def _state(module):
    return {k: v.clone() for k, v in module.state_dict().items()}


def _assert_same_state(a, b):
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype, k
        assert torch.equal(a[k], b[k]), k


def _config(kw):
    try:
        return MoEConfig(**kw)
    except TypeError as e:  # a field this config does not have: the test must be updated
        raise AssertionError(f"MoEConfig rejected {kw}: {e}")


@KINDS
def test_reset_parameters_redraws_what_construction_drew(kw):
    cfg = _config(kw)
    torch.manual_seed(3)
    built = _state(MoELayer(cfg))
    layer = MoELayer(cfg)
    with torch.no_grad():
        for p in layer.parameters():
            p.add_(1.0)
        for b in layer.buffers():
            b.add_(5.0)
    torch.manual_seed(3)
    layer.reset_parameters()
    _assert_same_state(_state(layer), built)


@KINDS
def test_meta_then_to_empty_then_reset_equals_built(kw):
    cfg = _config(kw)
    torch.manual_seed(11)
    built = _state(MoELayer(cfg))
    meta = MoELayer(cfg, device="meta")
    assert all(t.is_meta for t in meta.state_dict().values())
    meta.to_empty(device="cpu")
    torch.manual_seed(11)
    meta.reset_parameters()
    _assert_same_state(_state(meta), built)
    x = torch.randn(6, cfg.hidden_size)
    torch.manual_seed(0)
    ref = MoELayer(cfg)
    ref.load_state_dict(meta.state_dict())
    assert torch.equal(meta(x), ref(x))


def test_dtype_kwarg_sets_parameters_and_keeps_buffers_fp32():
    cfg = _config(FULL)
    layer = MoELayer(cfg, dtype=torch.bfloat16)
    for name, p in layer.named_parameters():
        assert p.dtype == torch.bfloat16, name
    for name, b in layer.named_buffers():
        assert b.dtype == torch.float32, name
    x = torch.randn(5, cfg.hidden_size, dtype=torch.bfloat16)
    assert layer(x).dtype == torch.bfloat16


def test_dtype_kwarg_equals_casting_after_build():
    """The same draws (fp32 for the router, params_dtype for the experts) as building in
    params_dtype: building in bf16 equals building in bf16 through the config."""
    torch.manual_seed(5)
    a = _state(MoELayer(_config(dict(PLAIN, params_dtype=torch.bfloat16))))
    torch.manual_seed(5)
    b = _state(MoELayer(_config(PLAIN), dtype=torch.bfloat16))
    _assert_same_state(a, b)


def test_submodules_take_device_and_dtype():
    cfg = _config(FULL)
    r = TopKRouter(cfg, device="meta", dtype=torch.float16)
    assert r.weight.is_meta and r.weight.dtype == torch.float16
    assert r.expert_bias.is_meta and r.expert_bias.dtype == torch.float32
    assert r.global_aux_buffer.tokens_per_expert.is_meta
    g = GroupedMLP(_config(BIASED), device="meta", dtype=torch.bfloat16)
    assert g.weight1.is_meta and g.weight1.dtype == torch.bfloat16 and g.bias2.is_meta
    s = SharedExpertMLP(cfg, device="meta", dtype=torch.bfloat16)
    assert s.linear_fc1.weight.is_meta and s.gate_weight.dtype == torch.bfloat16


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_device_cuda_builds_on_the_gpu():
    cfg = _config(FULL)
    layer = MoELayer(cfg, device="cuda", dtype=torch.bfloat16)
    assert all(t.is_cuda for t in layer.state_dict().values())
    torch.manual_seed(2)
    layer.reset_parameters()
    first = _state(layer)
    torch.manual_seed(2)
    layer.reset_parameters()
    _assert_same_state(_state(layer), first)


def test_extra_repr_names_the_sizes():
    layer = MoELayer(_config(FULL))
    assert layer.extra_repr() == "hidden_size=32, num_moe_experts=8, topk=2"
    assert layer.router.extra_repr() == ("num_experts=8, hidden_size=32, topk=2, "
                                         "score_function=sigmoid, expert_bias")
    assert layer.experts.extra_repr() == (
        "num_local_experts=8, input_size=24, ffn_hidden_size=16, gated_linear_unit=False, "
        "bias=False, dtype=torch.float32")
    assert layer.shared_experts.extra_repr() == "gate=True"
    assert "GroupedMLP(num_local_experts=8" in repr(layer)
    assert "bias=True" in repr(MoELayer(_config(BIASED)).experts)


# ---- the output is no view: FSDP2 warns about a module returning one ------------------------

@pytest.mark.parametrize("shape", [(10, 32), (5, 2, 32)], ids=["T,H", "S,B,H"])
@pytest.mark.parametrize("kw", [PLAIN, dict(PLAIN, moe_latent_size=24)], ids=["plain", "latent"])
def test_output_is_no_view_and_equals_the_flat_layer(kw, shape):
    """[T, H] and [S, B, H] inputs: the output owns its storage as far as autograd knows
    (``_base is None``), and the [S, B, H] output and its input gradient equal the flat [T, H]
    layer's, unflattened (the unflattening is no copy: it is the same numbers)."""
    torch.manual_seed(0)
    layer = MoELayer(_config(kw))
    x = torch.randn(*shape, requires_grad=True)
    out = layer(x)
    assert out.shape == x.shape and out._base is None
    g = torch.randn(shape)
    (gx,) = torch.autograd.grad(out, x, g)
    flat_x = x.detach().reshape(-1, 32).requires_grad_()
    flat = layer(flat_x)
    (flat_gx,) = torch.autograd.grad(flat, flat_x, g.reshape(-1, 32))
    assert torch.equal(out, flat.reshape(shape))
    assert torch.equal(gx, flat_gx.reshape(shape))


def test_fsdp2_wrapped_layer_gives_no_view_warning(world_group):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    layer = MoELayer(_config(PLAIN))
    fully_shard(layer, mesh=init_device_mesh("cpu", (1,)))
    x = torch.randn(5, 2, 32, requires_grad=True)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*returned a view tensor")
        out = layer(x)
    out.sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
