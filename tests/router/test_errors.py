"""Bad input to the router ops: one test per rejected case; each message names the argument and
the bad value. Non-contiguous input is accepted (tested in test_ops.py)."""
import pytest
import torch

from moe_core import ops

X = torch.randn(6, 8)


def routing(**kw):
    args = dict(logits=X, topk=2)
    args.update(kw)
    return ops.topk_routing_with_score_function(**args)


def test_logits_rank_1d():
    with pytest.raises(ValueError, match=r"logits must be 2-D.*\(8,\)"):
        routing(logits=torch.randn(8))


def test_logits_rank_3d():
    with pytest.raises(ValueError, match=r"logits must be 2-D.*\(2, 3, 8\)"):
        routing(logits=torch.randn(2, 3, 8))


def test_logits_integer_dtype():
    with pytest.raises(TypeError, match="logits must be float32, float64, float16 or bfloat16, got Long"):
        routing(logits=torch.ones(6, 8, dtype=torch.long))


def test_topk_zero():
    with pytest.raises(ValueError, match=r"topk must be in \[1, num_experts=8\], got topk=0"):
        routing(topk=0)


def test_topk_negative():
    with pytest.raises(ValueError, match=r"got topk=-1"):
        routing(topk=-1)


def test_topk_above_num_experts():
    with pytest.raises(ValueError, match=r"topk must be in \[1, num_experts=8\], got topk=9"):
        routing(topk=9)


def test_topk_not_int():
    with pytest.raises(TypeError, match=r"topk must be an int, got 2.0"):
        routing(topk=2.0)


def test_num_experts_not_divisible_by_groups():
    with pytest.raises(ValueError, match="num_experts=8 must be divisible by num_groups=3"):
        routing(num_groups=3, group_topk=1)


def test_group_topk_above_num_groups():
    with pytest.raises(ValueError, match=r"group_topk must be in \[1, num_groups=4\], got group_topk=5"):
        routing(topk=6, num_groups=4, group_topk=5)


def test_group_topk_without_num_groups():
    with pytest.raises(ValueError, match="num_groups must be >= 1 when group_topk is set, got 0"):
        routing(group_topk=2)


def test_too_few_experts_in_kept_groups():
    with pytest.raises(ValueError, match=r"topk=6 exceeds the experts in the kept groups \(group_topk=2 x 2"):
        routing(topk=6, num_groups=4, group_topk=2)


def test_group_topk_above_topk():
    with pytest.raises(ValueError, match="group_topk=4 must be <= topk=2"):
        routing(topk=2, num_groups=4, group_topk=4)


def test_expert_bias_wrong_length():
    with pytest.raises(ValueError, match=r"expert_bias.shape\[0\] must equal logits.shape\[1\] \(num_experts\) \(8\), got shape \[7\]"):
        routing(score_function="sigmoid", expert_bias=torch.zeros(7))


def test_expert_bias_wrong_rank():
    with pytest.raises(ValueError, match="expert_bias must be 1-D, got a 2-D tensor"):
        routing(score_function="sigmoid", expert_bias=torch.zeros(1, 8))


def test_expert_bias_wrong_dtype():
    with pytest.raises(TypeError, match="expert_bias must be Float, got BFloat16"):
        routing(score_function="sigmoid", expert_bias=torch.zeros(8, dtype=torch.bfloat16))


def test_expert_bias_with_post_softmax():
    with pytest.raises(ValueError, match="expert_bias with score_function softmax needs use_pre_softmax"):
        routing(expert_bias=torch.zeros(8))


# ---- the rules beyond Megatron's: normalize, group_score_topk ----

def test_normalize_not_bool():
    with pytest.raises(ValueError, match="normalize must be None, True or False, got 1"):
        routing(score_function="sigmoid", normalize=1)


def test_normalize_with_post_softmax():
    with pytest.raises(ValueError, match=r"norm=2: softmax without use_pre_softmax is a softmax over "
                                         r"the k picked logits"):
        routing(normalize=True)


def test_normalize_false_with_post_softmax():
    with pytest.raises(ValueError, match=r"norm=1: softmax without use_pre_softmax"):
        routing(normalize=False)


def test_group_score_topk_negative():
    with pytest.raises(ValueError, match="group_score_topk must be None or an int >= 1, got -1"):
        routing(topk=4, num_groups=4, group_topk=2, group_score_topk=-1)


def test_group_score_topk_not_int():
    with pytest.raises(ValueError, match="group_score_topk must be None or an int >= 1, got 1.5"):
        routing(topk=4, num_groups=4, group_topk=2, group_score_topk=1.5)


def test_group_score_topk_above_group_size():
    with pytest.raises(ValueError, match="group_score_topk=3 exceeds the 2 experts of a group"):
        routing(topk=4, num_groups=4, group_topk=2, group_score_topk=3)


def test_group_score_topk_without_groups():
    with pytest.raises(ValueError, match="group_score_topk=2 needs group-limited routing"):
        routing(topk=4, group_score_topk=2)


def test_op_group_score_topk_negative():
    with pytest.raises(ValueError, match=r"group_score_topk must be >= 0 \(0: topk / group_topk\), "
                                         r"got -4"):
        torch.ops.moe_core.router_topk(X, 2, False, 0, 0, 0.0, "sigmoid", None,
                                       group_score_topk=-4)


@pytest.mark.parametrize("normalize,norm", [(False, 1), (True, 2)])
def test_op_normalize_is_the_norm(normalize, norm):
    """The op's named normalize reaches the core as its moe_topk_norm_t (False: none, True: sum),
    which softmax-post refuses by number."""
    with pytest.raises(ValueError, match=rf"norm={norm}: softmax without use_pre_softmax"):
        torch.ops.moe_core.router_topk(X, 2, False, 0, 0, 0.0, "softmax", None,
                                       normalize=normalize)


def test_unknown_score_function():
    with pytest.raises(ValueError, match=r"score_function must be one of .* got 'relu'"):
        routing(score_function="relu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU to place tensors on two devices")
def test_mismatched_devices():
    with pytest.raises(ValueError, match="expert_bias is on cpu but logits is on cuda"):
        routing(logits=X.cuda(), score_function="sigmoid", expert_bias=torch.zeros(8))


def test_group_limited_topk_wrong_shape():
    with pytest.raises(ValueError, match=r"scores must have shape \(num_tokens=6, num_experts=9\), got \(6, 8\)"):
        ops.group_limited_topk(X, 2, 6, 9, 4, 2)


# ---- router_gating_linear ----

W = torch.randn(4, 8)


def test_gating_weight_hidden_mismatch():
    with pytest.raises(ValueError, match=r"weight.shape\[1\] must equal inp.shape\[1\] \(hidden\) \(8\), got shape \[4, 7\]"):
        ops.router_gating_linear(X, torch.randn(4, 7), None, torch.float32)


def test_gating_weight_rank():
    with pytest.raises(ValueError, match="weight must be 2-D, got a 1-D tensor"):
        ops.router_gating_linear(X, torch.randn(8), None, torch.float32)


def test_gating_inp_integer_dtype():
    with pytest.raises(TypeError, match="inp must be float32, float64, float16 or bfloat16, got Int"):
        ops.router_gating_linear(torch.ones(6, 8, dtype=torch.int32), W, None, torch.float32)


def test_gating_inp_scalar():
    with pytest.raises(ValueError, match=r"inp must be a tensor of shape \[..., hidden\], got Tensor of shape \(\)"):
        ops.router_gating_linear(torch.tensor(1.0), W, None, torch.float32)


def test_gating_bias_wrong_length():
    with pytest.raises(ValueError, match=r"bias.shape\[0\] must equal weight.shape\[0\] \(num_experts\) \(4\), got shape \[5\]"):
        ops.router_gating_linear(X, W, torch.zeros(5), torch.float32)


def test_gating_bias_wrong_dtype():
    with pytest.raises(TypeError, match="bias must be Float, got Double"):
        ops.router_gating_linear(X, W, torch.zeros(4, dtype=torch.float64), torch.float32)


def test_gating_router_dtype_not_float():
    with pytest.raises(TypeError, match="router_dtype must be a float dtype, got Long"):
        ops.router_gating_linear(X, W, None, torch.int64)


# ---- topk_to_dense ----

def test_topk_to_dense_index_out_of_range():
    with pytest.raises(ValueError, match=r"topk_indices\[0, 1\] = 8 is outside \[0, num_experts=8\)"):
        ops.topk_to_dense(torch.ones(2, 2), torch.tensor([[0, 8], [1, 2]]), 8)


def test_topk_to_dense_shape_mismatch():
    with pytest.raises(ValueError, match=r"topk_probs shape \[2, 2\] must equal topk_indices shape \[2, 3\]"):
        ops.topk_to_dense(torch.ones(2, 2), torch.zeros(2, 3, dtype=torch.long), 8)


def test_topk_to_dense_index_dtype():
    with pytest.raises(TypeError, match="topk_indices must be Long, got Int"):
        ops.topk_to_dense(torch.ones(2, 2), torch.zeros(2, 2, dtype=torch.int32), 8)


def test_gating_linear_bwd_weight_hidden_mismatch():
    """The backward op checks the weight against the input (a weight swapped between forward and
    backward), instead of reading past the weight's end."""
    with pytest.raises(ValueError, match=r"weight.*inp.shape\[1\] \(hidden\)"):
        torch.ops.moe_core.router_gating_linear_bwd(torch.randn(8, 4), torch.randn(8, 64),
                                                    torch.randn(4, 8))


def test_gating_linear_bwd_swapped_weight_through_autograd():
    """The same through ordinary autograd: ``w.data`` replaced by a narrower tensor after the
    forward."""
    x = torch.randn(8, 64, requires_grad=True)
    w = torch.randn(4, 64, requires_grad=True)
    logits = ops.router_gating_linear(x, w, None, torch.float32)
    w.data = torch.randn(4, 8)
    with pytest.raises(ValueError, match=r"weight.*inp.shape\[1\] \(hidden\)"):
        logits.sum().backward()
