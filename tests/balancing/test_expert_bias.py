"""Aux-loss-free balancing: token counting and the expert bias update, bit for bit
against megatron-core's get_updated_expert_bias over several steps."""
import warnings

import pytest
import torch

import moe_core.ops as ops
from helpers.world_group import world_group  # noqa: F401  (fixture)

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from megatron.core.transformer.moe import moe_utils as mcore


def _route_with_bias(logits, bias, k):
    probs, routing_map = ops.topk_routing_with_score_function(
        logits, k, score_function="sigmoid", expert_bias=bias)
    return probs, routing_map


@pytest.mark.parametrize("rate", [1e-3, 0.05])
def test_expert_bias_training_loop_matches_megatron_bit_for_bit(world_group, rate):  # noqa: F811
    T, E, k = 64, 16, 4
    bias_ours = torch.zeros(E)
    bias_ref = torch.zeros(E)
    skew = torch.linspace(-1, 1, E)
    for step in range(8):
        counts_ours = torch.zeros(E)
        counts_ref = torch.zeros(E)
        for _micro_batch in range(2):
            logits = torch.randn(T, E) + skew
            pad = torch.rand(T) < 0.2
            _, map_ours = _route_with_bias(logits, bias_ours, k)
            ops.accumulate_tokens_per_expert(counts_ours, map_ours, pad)
            _, map_ref = mcore.topk_routing_with_score_function(
                logits, k, score_function="sigmoid", expert_bias=bias_ref)
            counts_ref += (map_ref & ~pad.unsqueeze(-1)).sum(0)  # Megatron's _apply_expert_bias
        assert torch.equal(counts_ours, counts_ref), f"step {step}"
        bias_ours = ops.get_updated_expert_bias(counts_ours, bias_ours, rate, world_group)
        bias_ref = mcore.get_updated_expert_bias(counts_ref, bias_ref, rate,
                                                 tp_dp_cp_group=world_group)
        assert bias_ours.dtype == torch.float32
        assert torch.equal(bias_ours, bias_ref), f"step {step}: {bias_ours} vs {bias_ref}"
    assert bias_ours.abs().max() > 0


def test_expert_bias_update_random_biases_and_ties_bit_for_bit(world_group, device):  # noqa: F811
    E = 12
    bias = (torch.randn(E) * 1e-2).to(device)
    for step in range(5):
        counts = torch.randint(0, 40, (E,)).float().to(device)
        counts[3] = counts.mean()  # may or may not be exact; exercises sign(0) when it is
        counts[:4] = 10.0
        ours = ops.get_updated_expert_bias(counts.clone(), bias, 1e-3, world_group)
        ref = mcore.get_updated_expert_bias(counts.clone(), bias, 1e-3, tp_dp_cp_group=world_group)
        assert torch.equal(ours, ref), f"step {step}"
        bias = ours


def test_expert_bias_sign_zero_is_no_step(world_group, device):  # noqa: F811
    # the spec's example: counts (1, 5, 3, 3) -> (+rate, -rate, 0, 0)
    counts = torch.tensor([1.0, 5.0, 3.0, 3.0], device=device)
    zeros = torch.zeros(4, device=device)
    out = ops.get_updated_expert_bias(counts, zeros, 1e-3, world_group)
    ref = mcore.get_updated_expert_bias(counts.clone(), zeros, 1e-3,
                                        tp_dp_cp_group=world_group)
    assert torch.equal(out, ref)
    assert out.tolist() == [pytest.approx(1e-3), pytest.approx(-1e-3), 0.0, 0.0]


def test_expert_bias_stacked_layers_bit_for_bit(world_group, device):  # noqa: F811
    L, E = 3, 8
    counts = torch.randint(0, 50, (L, E)).float().to(device)
    bias = (torch.randn(L, E) * 1e-3).to(device)
    ours = ops.get_updated_expert_bias(counts.clone(), bias, 2e-3, world_group)
    ref = mcore.get_updated_expert_bias(counts.clone(), bias, 2e-3, tp_dp_cp_group=world_group)
    assert ours.shape == (L, E) and torch.equal(ours, ref)


def test_expert_bias_integer_counts(world_group, device):  # noqa: F811
    counts = torch.randint(0, 50, (8,)).to(device)
    bias = torch.randn(8).to(device)
    ours = ops.get_updated_expert_bias(counts.clone(), bias, 1e-3, world_group)
    ref = mcore.get_updated_expert_bias(counts.clone(), bias, 1e-3, tp_dp_cp_group=world_group)
    assert torch.equal(ours, ref)


def test_expert_bias_without_group_needs_no_process_group(device):
    counts = torch.tensor([4.0, 0.0, 2.0], device=device)
    out = ops.get_updated_expert_bias(counts, torch.zeros(3, device=device), 0.5)
    assert out.tolist() == [-0.5, 0.5, 0.0]


def test_expert_bias_nan_propagates(device):
    counts = torch.tensor([1.0, float("nan"), 2.0], device=device)
    out = ops.get_updated_expert_bias(counts, torch.zeros(3, device=device), 0.1)
    assert out.isnan().all()  # the mean is NaN, as in torch


def test_counts_not_accumulated_under_no_grad():
    counts = torch.zeros(4)
    routing_map = torch.ones(3, 4, dtype=torch.bool)
    with torch.no_grad():
        ops.accumulate_tokens_per_expert(counts, routing_map)
    assert not counts.any()
    ops.accumulate_tokens_per_expert(counts, routing_map)
    assert counts.tolist() == [3.0] * 4


def test_counts_exclude_padding():
    counts = torch.zeros(3)
    routing_map = torch.tensor([[1, 0, 1], [0, 1, 1], [1, 1, 0]], dtype=torch.bool)
    pad = torch.tensor([False, True, False])
    ops.accumulate_tokens_per_expert(counts, routing_map, pad)
    assert counts.tolist() == [2.0, 1.0, 1.0]


def test_tokens_per_expert_matches_torch(device):
    routing_map = (torch.rand(40, 9) < 0.3).to(device)
    pad = (torch.rand(40) < 0.25).to(device)
    assert torch.equal(ops.tokens_per_expert(routing_map), routing_map.sum(0))
    assert torch.equal(ops.tokens_per_expert(routing_map, pad), routing_map[~pad].sum(0))


def test_expert_bias_affects_selection_only():
    T, E, k = 20, 8, 2
    logits = torch.randn(T, E)
    bias = torch.zeros(E)
    bias[0] = 10.0  # expert 0 is always selected
    probs, routing_map = _route_with_bias(logits, bias, k)
    assert routing_map[:, 0].all()
    scores = torch.sigmoid(logits)
    picked = scores * routing_map
    expected = picked / (picked.sum(-1, keepdim=True) + 1e-20)
    torch.testing.assert_close(probs, expected, rtol=1e-6, atol=1e-7)


def test_opcheck_expert_bias_update(device):
    torch.library.opcheck(torch.ops.moe_core.expert_bias_update.default,
                          (torch.randint(0, 9, (6,)).float().to(device), torch.randn(6).to(device),
                           1e-3))
    torch.library.opcheck(torch.ops.moe_core.expert_bias_update.default,
                          (torch.randint(0, 9, (2, 6)).float().to(device),
                           torch.randn(2, 6).to(device), 1e-3))
