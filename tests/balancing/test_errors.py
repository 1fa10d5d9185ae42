"""Bad input to the load-balancing ops. One test per rejected case; each checks the
exception type and that the message names the argument and its bad value."""
import pytest
import torch

import moe_core.ops as ops

T, E = 6, 4


def logits():
    return torch.randn(T, E)


def routing_map():
    return torch.rand(T, E) < 0.5


# ---- compute_routing_scores_for_aux_loss ----------------------------------------------------


def test_aux_scores_rejects_1d_logits():
    with pytest.raises(ValueError, match=r"logits must be 2-D .*got \(6,\)"):
        ops.compute_routing_scores_for_aux_loss(torch.randn(T), 2, "softmax")


def test_aux_scores_rejects_integer_logits():
    with pytest.raises(TypeError, match=r"logits must be float32.*got Long"):
        ops.compute_routing_scores_for_aux_loss(torch.ones(T, E, dtype=torch.long), 2, "softmax")


def test_aux_scores_rejects_topk_zero():
    with pytest.raises(ValueError, match=r"topk must be in \[1, num_experts=4\], got 0"):
        ops.compute_routing_scores_for_aux_loss(logits(), 0, "softmax")


def test_aux_scores_rejects_topk_above_experts():
    with pytest.raises(ValueError, match=r"topk must be in \[1, num_experts=4\], got 5"):
        ops.compute_routing_scores_for_aux_loss(logits(), 5, "softmax")


def test_aux_scores_rejects_non_int_topk():
    with pytest.raises(TypeError, match=r"topk must be an int, got 2.0"):
        ops.compute_routing_scores_for_aux_loss(logits(), 2.0, "softmax")


def test_aux_scores_rejects_unknown_score_function():
    with pytest.raises(ValueError, match=r"score_function must be one of .*got 'relu'"):
        ops.compute_routing_scores_for_aux_loss(logits(), 2, "relu")


def test_padding_mask_rejects_non_bool():
    with pytest.raises(TypeError, match=r"padding_mask must be a bool tensor .*got torch.int64"):
        ops.compute_routing_scores_for_aux_loss(logits(), 2, "softmax",
                                                padding_mask=torch.zeros(T, dtype=torch.long))


def test_padding_mask_rejects_wrong_length():
    with pytest.raises(ValueError, match=r"padding_mask must have num_tokens=6 elements, got "
                                         r"shape \(5,\)"):
        ops.compute_routing_scores_for_aux_loss(logits(), 2, "softmax",
                                                padding_mask=torch.zeros(5, dtype=torch.bool))


def test_binding_rejects_2d_padding_mask():
    with pytest.raises(ValueError, match=r"padding_mask must be 1-D, got a 2-D tensor"):
        torch.ops.moe_core.aux_loss_scores(logits(), 2, "softmax",
                                           torch.zeros(T, 1, dtype=torch.bool))


# ---- switch loss ----------------------------------------------------------------------------


def test_switch_rejects_counts_of_wrong_length():
    with pytest.raises(ValueError, match=r"tokens_per_expert.shape\[0\] must equal probs.shape\[1\] "
                                         r"\(4\), got shape \[5\]"):
        ops.switch_load_balancing_loss_func(torch.rand(T, E), torch.ones(5), 10, 2, E, 0.1)


def test_switch_rejects_total_with_two_elements():
    with pytest.raises(ValueError, match=r"total_num_tokens must have one element, got shape "
                                         r"\[2\]"):
        ops.switch_load_balancing_loss_func(torch.rand(T, E), torch.ones(E), torch.ones(2), 2, E,
                                            0.1)


def test_switch_rejects_total_of_wrong_type():
    with pytest.raises(TypeError, match=r"total_num_tokens must be a number or a tensor, got "
                                        r"'10'"):
        ops.switch_load_balancing_loss_func(torch.rand(T, E), torch.ones(E), "10", 2, E, 0.1)


def test_switch_rejects_3d_probs():
    with pytest.raises(ValueError, match=r"probs must be 2-D .*got \(1, 6, 4\)"):
        ops.switch_load_balancing_loss_func(torch.rand(1, T, E), torch.ones(E), 10, 2, E, 0.1)


def test_switch_rejects_topk_zero():
    with pytest.raises(ValueError, match=r"topk must be >= 1, got 0"):
        ops.switch_load_balancing_loss_func(torch.rand(T, E), torch.ones(E), 10, 0, E, 0.1)


def test_switch_rejects_num_experts_zero():
    with pytest.raises(ValueError, match=r"num_experts must be >= 1, got 0"):
        ops.switch_load_balancing_loss_func(torch.rand(T, E), torch.ones(E), 10, 2, 0, 0.1)


def test_switch_rejects_nan_coeff():
    with pytest.raises(ValueError, match=r"coeff must be finite, got nan"):
        ops.switch_load_balancing_loss_func(torch.rand(T, E), torch.ones(E), 10, 2, E,
                                            float("nan"))


def test_switch_rejects_bool_counts():
    with pytest.raises(TypeError, match=r"tokens_per_expert must be a real number dtype, got Bool"):
        ops.switch_load_balancing_loss_func(torch.rand(T, E), torch.ones(E, dtype=torch.bool), 10,
                                            2, E, 0.1)


def test_seq_loss_rejects_wrong_layout():
    m, s = ops.compute_routing_scores_for_aux_loss(logits(), 2, "softmax")
    with pytest.raises(ValueError, match=r"scores must be \[seq_length \* bsz, num_experts\] = "
                                         r"\[4 \* 2, E\], got \(6, 4\)"):
        ops.seq_load_balancing_loss(s, m, 4, 2, 2, E, 0.1)


def test_tokens_count_with_mask_needs_topk():
    with pytest.raises(ValueError, match=r"topk is required when with_padding_mask is True, got "
                                         r"None"):
        ops.get_tokens_per_expert_and_token_count(routing_map(), None, None, True)


def test_global_buffer_rejects_zero_experts():
    with pytest.raises(ValueError, match=r"num_experts must be an int >= 1, got 0"):
        ops.GlobalAuxLossBuffer(0)


def test_global_loss_rejects_non_buffer():
    m, s = ops.compute_routing_scores_for_aux_loss(logits(), 2, "softmax")
    with pytest.raises(TypeError, match=r"buffer must be a GlobalAuxLossBuffer, got Tensor"):
        ops.global_load_balancing_loss(s, m, 2, E, 0.1, torch.zeros(E))


# ---- z-loss ---------------------------------------------------------------------------------


def test_z_loss_rejects_3d_logits():
    with pytest.raises(ValueError, match=r"logits must be 2-D .*got \(2, 6, 4\)"):
        ops.z_loss_func(torch.randn(2, T, E), 0.1)


def test_z_loss_rejects_infinite_coeff():
    with pytest.raises(ValueError, match=r"z_loss_coeff must be finite, got inf"):
        ops.z_loss_func(logits(), float("inf"))


def test_z_loss_rejects_zero_experts():
    with pytest.raises(ValueError, match=r"num_experts must be >= 1, got 0"):
        ops.z_loss_func(torch.randn(T, 0), 0.1)


# ---- autoscaler -----------------------------------------------------------------------------


def test_scale_rejects_two_element_tensor():
    with pytest.raises(ValueError, match=r"scale must have one element, got shape \(2,\)"):
        ops.AuxLossScale().set(torch.ones(2))


def test_scale_rejects_string():
    with pytest.raises(TypeError, match=r"scale must be a number or a tensor, got 'x'"):
        ops.AuxLossScale("x")


def test_scale_blocks_must_nest():
    a, b = ops.AuxLossScale(), ops.AuxLossScale()
    a.__enter__()
    b.__enter__()
    with pytest.raises(RuntimeError, match=r"exited in the order they were entered"):
        a.__exit__(None, None, None)
    b.__exit__(None, None, None)
    a.__exit__(None, None, None)


# ---- expert bias ----------------------------------------------------------------------------


def test_bias_rejects_fp64_bias():
    with pytest.raises(TypeError, match=r"expert_bias must be Float, got Double"):
        ops.get_updated_expert_bias(torch.ones(E), torch.zeros(E, dtype=torch.float64), 1e-3)


def test_bias_rejects_shape_mismatch():
    with pytest.raises(ValueError, match=r"tokens_per_expert shape \[5\] must equal expert_bias "
                                         r"shape \[4\]"):
        ops.get_updated_expert_bias(torch.ones(5), torch.zeros(E), 1e-3)


def test_bias_rejects_3d_bias():
    with pytest.raises(ValueError, match=r"expert_bias must be 1-D .* got a 3-D tensor of shape "
                                         r"\[1, 1, 4\]"):
        ops.get_updated_expert_bias(torch.ones(1, 1, E), torch.zeros(1, 1, E), 1e-3)


def test_bias_rejects_nan_rate():
    with pytest.raises(ValueError, match=r"expert_bias_update_rate must be finite, got nan"):
        ops.get_updated_expert_bias(torch.ones(E), torch.zeros(E), float("nan"))


def test_tokens_per_expert_rejects_float_map():
    with pytest.raises(TypeError, match=r"routing_map must be Bool, got Float"):
        ops.tokens_per_expert(torch.ones(T, E))


def test_tokens_per_expert_rejects_1d_map():
    with pytest.raises(ValueError, match=r"routing_map must be 2-D .*got \(6,\)"):
        ops.tokens_per_expert(torch.ones(T, dtype=torch.bool))


# ---- sinkhorn -------------------------------------------------------------------------------


def test_sinkhorn_rejects_negative_tol():
    with pytest.raises(ValueError, match=r"tol must be >= 0, got -1"):
        ops.sinkhorn(logits(), tol=-1.0)


def test_sinkhorn_rejects_nan_tol():
    with pytest.raises(ValueError, match=r"tol must be >= 0, got nan"):
        ops.sinkhorn(logits(), tol=float("nan"))


def test_sinkhorn_rejects_negative_max_iters():
    with pytest.raises(ValueError, match=r"max_iters must be >= 0, got -2"):
        ops.sinkhorn(logits(), max_iters=-2)


def test_sinkhorn_rejects_1d_cost():
    with pytest.raises(ValueError, match=r"cost must be 2-D, got a 1-D tensor of shape \[6\]"):
        ops.sinkhorn(torch.randn(T))


def test_sinkhorn_routing_rejects_topk_above_experts():
    with pytest.raises(ValueError, match=r"topk must be in \[1, num_experts=4\], got 7"):
        ops.sinkhorn_load_balancing(logits(), 7)


def test_sinkhorn_routing_rejects_non_int_topk():
    with pytest.raises(TypeError, match=r"topk must be an int, got True"):
        ops.sinkhorn_load_balancing(logits(), True)


# ---- metrics --------------------------------------------------------------------------------


def test_metrics_reject_scores_shape_mismatch():
    with pytest.raises(ValueError, match=r"scores shape \[6, 3\] must equal routing_map shape "
                                         r"\[6, 4\]"):
        ops.routing_metrics(routing_map(), torch.rand(T, 3))


def test_metrics_reject_integer_scores():
    with pytest.raises(TypeError, match=r"scores must be float32.*got Long"):
        ops.routing_metrics(routing_map(), torch.ones(T, E, dtype=torch.long))


def test_overlap_rejects_out_of_range_index():
    a = torch.tensor([[0, 1], [2, 3]])
    b = torch.tensor([[0, 1], [2, 9]])
    with pytest.raises(ValueError, match=r"indices_b has 9 at flat position 3, outside "
                                         r"\[0, num_experts=4\)"):
        ops.topk_overlap(a, b, 4)


def test_overlap_rejects_shape_mismatch():
    with pytest.raises(ValueError, match=r"indices_b shape \[2, 3\] must equal indices_a shape "
                                         r"\[2, 2\]"):
        ops.topk_overlap(torch.zeros(2, 2, dtype=torch.long), torch.zeros(2, 3, dtype=torch.long), 4)


def test_overlap_rejects_too_few_experts():
    with pytest.raises(ValueError, match=r"num_experts must be >= topk=2, got 1"):
        ops.topk_overlap(torch.zeros(2, 2, dtype=torch.long), torch.zeros(2, 2, dtype=torch.long), 1)


def test_overlap_rejects_int32_indices():
    with pytest.raises(TypeError, match=r"indices_a must be Long, got Int"):
        ops.topk_overlap(torch.zeros(2, 2, dtype=torch.int32), torch.zeros(2, 2, dtype=torch.long), 4)

