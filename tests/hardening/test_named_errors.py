"""Errors that named the wrong thing (a GEMM's operand, a reshape, torch's allocator or pybind's
cast) or nothing: each now names the argument and its bad value."""
import pytest
import torch

from moe_core import MoEConfig, MoELayer, ops
from moe_core.layer import load_megatron_state_dict


def _rmap():
    rmap = torch.zeros(4, 8, dtype=torch.bool)
    rmap[:, :2] = True
    return rmap


def test_capacity_factor_inf():
    msg = r"capacity_factor must be a finite number >= 0, got inf"
    with pytest.raises(ValueError, match=msg):
        ops.get_capacity(8, 8, float("inf"))
    rmap = _rmap()
    with pytest.raises(ValueError, match=msg):
        ops.apply_router_token_dropping(torch.rand(4, 8) * rmap, rmap, router_topk=2,
                                        capacity_factor=float("inf"))


def test_router_gating_linear_hidden_size_zero():
    with pytest.raises(ValueError, match=r"inp has hidden size 0 \(shape \(4, 0\)\): the router "
                                         r"needs hidden >= 1"):
        ops.router_gating_linear(torch.zeros(4, 0), torch.zeros(8, 0), None, torch.float32)


@pytest.mark.parametrize("call,message", [
    (lambda: ops.router_topk(torch.randn(4, 8), 2 ** 64),
     r"router_topk: topk=18446744073709551616 "),
    (lambda: ops.permute(torch.randn(4, 3), _rmap(), None, num_out_tokens=2 ** 63),
     r"permute: num_out_tokens=9223372036854775808 "),
    (lambda: ops.router_topk(torch.randn(4, 8), -2 ** 63 - 1),
     r"router_topk: topk=-9223372036854775809 "),
], ids=["topk_2_64", "num_out_tokens_2_63", "topk_below_int64"])
def test_ints_outside_int64_are_named(call, message):
    with pytest.raises(ValueError, match=message + r"is outside int64 \[-2\*\*63, 2\*\*63 - 1\]"):
        call()


@pytest.mark.parametrize("num_experts", [-1, 0, 1, 2 ** 62, 2 ** 64])
def test_topk_to_dense_expert_count(num_experts):
    probs, idx = torch.rand(4, 2), torch.zeros(4, 2, dtype=torch.long)
    with pytest.raises(ValueError, match=rf"topk_to_dense: num_experts={num_experts}: must be >= "
                                         rf"1 and >= topk \(2\), with \[num_tokens, num_experts\] "
                                         rf"= \[4, {num_experts}\] addressable"):
        ops.topk_to_dense(probs, idx, num_experts)
    with pytest.raises(TypeError, match=r"num_experts must be an int, got float"):
        ops.topk_to_dense(probs, idx, 8.0)
    # an index tensor of the wrong length: the binding's message names both
    with pytest.raises(ValueError, match=r"topk_probs shape \[4, 2\] must equal topk_indices "
                                         r"shape \[4, 3\]"):
        ops.topk_to_dense(probs, torch.zeros(4, 3, dtype=torch.long), 8)


@pytest.mark.parametrize("meta", ["split_sizes", "sorted_idxs"])
def test_sort_chunks_by_idxs_meta_index(meta):
    split, order = torch.tensor([3, 3]), torch.tensor([1, 0])
    args = dict(split_sizes=split, sorted_idxs=order)
    args[meta] = args[meta].to("meta")
    with pytest.raises(ValueError, match=rf"{meta} is on meta but input is on cpu"):
        ops.sort_chunks_by_idxs(torch.randn(6, 3), args["split_sizes"], args["sorted_idxs"])


def _config(**kw):
    return MoEConfig(**dict(dict(hidden_size=8, num_moe_experts=4, moe_ffn_hidden_size=8), **kw))


def test_params_dtype_float8_refused_by_the_config():
    with pytest.raises(ValueError, match=r"params_dtype=torch.float8_e4m3fn: must be a floating-"
                                         r"point torch.dtype the layer computes in"):
        _config(params_dtype=torch.float8_e4m3fn)


@pytest.mark.parametrize("params", [torch.float32, torch.bfloat16])
def test_fp64_input_under_autocast_names_hidden_states(params):
    """autocast leaves fp64 alone: the input must then have the parameters' dtype."""
    layer = MoELayer(_config(params_dtype=params))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with pytest.raises(TypeError, match=rf"hidden_states is torch.float64 but the layer's "
                                            rf"parameters are {params}"):
            layer(torch.randn(5, 8, dtype=torch.float64))


def test_load_megatron_state_dict_names_the_key():
    layer = MoELayer(_config())
    sd = {k: v for k, v in layer.state_dict().items() if not k.startswith("experts.")}
    te = {f"experts.linear_fc{j}.weight{i}": torch.zeros(8, 8) for i in range(4) for j in (1, 2)}
    te.update({f"experts.linear_fc{j}.bias{i}": torch.zeros(8) for i in range(4) for j in (1, 2)})
    load_megatron_state_dict(layer, dict(sd, **te))  # the right shapes load

    bad = dict(sd, **te)
    bad["experts.linear_fc1.weight2"] = torch.zeros(3, 3)
    with pytest.raises(ValueError, match=r"^experts.linear_fc1.weight2: shape \(3, 3\), but the "
                                         r"layer's experts.weight1 holds one expert as \(8, 8\)$"):
        load_megatron_state_dict(layer, bad)
    bad = dict(sd, **te)
    bad["experts.local_experts.x.linear_fc1.weight"] = torch.zeros(8, 8)
    with pytest.raises(ValueError, match=r"^experts.local_experts.x.linear_fc1.weight: the local "
                                         r"expert number 'x' is not an integer$"):
        load_megatron_state_dict(layer, bad)
    bad = dict(sd, **te)
    bad["experts.linear_fc2.weight0"] = "weights"
    with pytest.raises(TypeError, match=r"^experts.linear_fc2.weight0: expected a tensor, got "
                                        r"str$"):
        load_megatron_state_dict(layer, bad)
