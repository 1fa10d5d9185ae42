"""Overflow and contract checks: sizes that do not fit in int64 and inputs that break an op's
contract are rejected with a message naming the argument and its value, before anything is
written; every backward validates its inputs as its forward does.

Checks that need only the sizes run on the host for both devices (parametrized on ``device``);
checks of values in device memory (expert offsets, sorted indices, top-k ids) would need a host
sync on CUDA, so they are CPU-only there (documented in the csrc/moe_*.h headers and the .cu files).
"""
import pytest
import torch

import moe_core  # noqa: F401  (registers the ops)

ops = torch.ops.moe_core


def _routing(device, T=4, E=4, H=8):
    tokens = torch.randn(T, H, device=device)
    routing_map = torch.zeros(T, E, dtype=torch.bool, device=device)
    routing_map[:, 0] = True
    routing_map[:, 2] = True
    return tokens, routing_map


def _permute_still_works(device):
    tokens, routing_map = _routing(device)
    out, _, idx, offsets, _ = ops.permute(tokens, routing_map, None, 8, False, 0)
    assert offsets.cpu().tolist() == [0, 4, 4, 8, 8]
    back = ops.unpermute(out, idx, 4, None, None)
    torch.testing.assert_close(back, 2 * tokens)


# ---- 1. overflow ------------------------------------------------------------------------------

def test_sort_chunks_split_sizes_sum_wraps():
    # INT64_MAX + INT64_MAX + 4 wraps to 2 in int64; 2 rows: the old check passed and bf16 moved
    # chunks far past the buffer
    x = torch.randn(2, 3).to(torch.bfloat16)
    split = torch.tensor([2**63 - 1, 2**63 - 1, 4])
    with pytest.raises(ValueError, match=r"split_sizes.*9223372036854775807"):
        ops.sort_chunks_by_idxs(x, split, torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError, match=r"split_sizes.*9223372036854775807"):
        ops.sort_chunks_by_idxs_bwd(x, split, torch.tensor([0, 1, 2]))
    ok = ops.sort_chunks_by_idxs(x, torch.tensor([1, 1]), torch.tensor([1, 0]))
    assert torch.equal(ok, x.flip(0))


def test_permute_align_size_overflows_row_bound(device):
    tokens, routing_map = _routing(device)
    # num_out_tokens + E * (align_size - 1) wrapped to 4: every token past expert 0 was dropped
    with pytest.raises(ValueError, match=r"align_size=4611686018427387904"):
        ops.permute(tokens, routing_map, None, 8, False, 2**62)
    _permute_still_works(device)


def test_permute_drop_and_pad_bound_overflows(device):
    tokens, routing_map = _routing(device)
    with pytest.raises(ValueError, match=r"drop_and_pad.*align_size=4611686018427387904"):
        ops.permute(tokens, routing_map, None, 2**63 - 1, True, 2**62)
    _permute_still_works(device)


def test_permute_rows_times_hidden_overflows(device):
    tokens, routing_map = _routing(device)
    # the row bound fits in int64, its [rows, hidden] buffer does not
    with pytest.raises(ValueError, match=r"hidden=8.*overflows int64"):
        ops.permute(tokens, routing_map, None, 2**62, False, 0)
    _permute_still_works(device)


# ---- 2. contract violations -------------------------------------------------------------------

def _permuted(T=4, E=4, H=8):
    tokens, routing_map = _routing("cpu", T, E, H)
    probs = torch.rand(T, E)
    return tokens, probs, ops.permute(tokens, routing_map, probs, 8, False, 0)


def test_unpermute_expert_offsets_past_rows():
    tokens, probs, (out, _, idx, offsets, _) = _permuted()
    bad = offsets.clone()
    bad[-1] = 100  # the buffer has 8 rows
    with pytest.raises(ValueError, match=r"expert_offsets\[num_experts=4\] = 100.*num_rows=8"):
        ops.unpermute(out, idx, 4, probs, bad)
    with pytest.raises(ValueError, match=r"expert_offsets\[num_experts=4\] = 100.*num_rows=8"):
        ops.unpermute_bwd(tokens, idx, probs, bad, out)
    with pytest.raises(ValueError, match=r"expert_offsets\[num_experts=4\] = 100.*num_rows=8"):
        ops.permute_bwd(out, torch.rand(8), idx, bad, 4)
    ops.unpermute(out, idx, 4, probs, offsets)


def test_unpermute_sorted_indices_past_tokens():
    tokens, probs, (out, _, idx, offsets, _) = _permuted()
    bad = idx.clone()
    bad[5] = 4  # only tokens 0..3 exist
    with pytest.raises(ValueError, match=r"sorted_indices\[5\] = 4 is outside \[-1, num_tokens=4\)"):
        ops.unpermute(out, bad, 4, probs, offsets)
    with pytest.raises(ValueError, match=r"sorted_indices\[5\] = 4 is outside"):
        ops.unpermute_bwd(tokens, bad, probs, offsets, out)
    with pytest.raises(ValueError, match=r"sorted_indices\[5\] = 4 is outside"):
        ops.permute_bwd(out, None, bad, offsets, 4)
    ops.unpermute(out, idx, 4, probs, offsets)


def test_topk_to_dense_duplicate_indices():
    probs = torch.rand(2, 2)
    idx = torch.tensor([[0, 3], [1, 1]])  # row 1 names expert 1 twice: last write used to win
    with pytest.raises(ValueError, match=r"topk_indices\[1\] repeats expert 1"):
        ops.topk_to_dense(probs, idx, 4)
    with pytest.raises(ValueError, match=r"topk_indices\[1\] repeats expert 1"):
        ops.topk_to_dense_bwd(torch.rand(2, 4), idx)
    dense, routing_map = ops.topk_to_dense(probs, torch.tensor([[0, 3], [1, 2]]), 4)
    assert routing_map.sum().item() == 4


def test_topk_to_dense_index_out_of_range():
    with pytest.raises(ValueError, match=r"topk_indices\[0, 1\] = 7 is outside \[0, num_experts=4\)"):
        ops.topk_to_dense(torch.rand(1, 2), torch.tensor([[0, 7]]), 4)


# ---- 3. every backward validates its inputs as its forward does -------------------------------

def _int_like(t):
    return t.to(torch.int64)


def test_router_topk_bwd_grad_probs_dtype(device):
    logits = torch.randn(4, 8, device=device)
    probs, idx = ops.router_topk(logits, 2, False, 0, 0, 0.0, "softmax", None)
    for op in (ops.router_topk_bwd, ops.router_topk_dense_bwd):
        g = torch.ones(4, 2 if op is ops.router_topk_bwd else 8, device=device, dtype=torch.long)
        with pytest.raises(TypeError, match=r"grad_probs must be float32.*got Long"):
            op(g, logits, idx, 2, False, 0, 0, 0.0, "softmax")
    ops.router_topk_bwd(torch.ones_like(probs), logits, idx, 2, False, 0, 0, 0.0, "softmax")


def test_router_topk_bwd_no_experts(device):
    logits = torch.randn(4, 0, device=device)
    with pytest.raises(ValueError, match=r"at least one expert column, got shape \[4, 0\]"):
        ops.router_topk_bwd(torch.ones(4, 1, device=device), logits,
                            torch.zeros(4, 1, dtype=torch.long, device=device), 1, False, 0, 0,
                            0.0, "softmax")
    ok = torch.randn(4, 8, device=device)
    _, idx = ops.router_topk(ok, 2, False, 0, 0, 0.0, "softmax", None)
    ops.router_topk_bwd(torch.ones(4, 2, device=device), ok, idx, 2, False, 0, 0, 0.0, "softmax")


def test_router_lse_bwd_grad_lse_dtype(device):
    logits = torch.randn(4, 8, device=device)
    lse = torch.logsumexp(logits.double(), -1)
    with pytest.raises(TypeError, match=r"grad_lse must be float32.*got Long"):
        ops.router_lse_bwd(torch.ones(4, dtype=torch.long, device=device), logits, lse, None)
    ops.router_lse_bwd(torch.ones(4, dtype=torch.double, device=device), logits, lse, None)


def test_aux_loss_scores_bwd_grad_scores_dtype(device):
    logits = torch.randn(4, 8, device=device)
    with pytest.raises(TypeError, match=r"grad_scores must be float32.*got Long"):
        ops.aux_loss_scores_bwd(torch.ones(4, 8, dtype=torch.long, device=device), logits,
                                "softmax", None)
    ops.aux_loss_scores_bwd(torch.ones(4, 8, device=device), logits, "softmax", None)


def test_switch_aux_loss_bwd_grad_loss_dtype(device):
    probs = torch.rand(4, 8, device=device)
    tpe = torch.ones(8, device=device)
    total = torch.tensor(4.0, device=device)
    with pytest.raises(TypeError, match=r"grad_loss must be float32.*got Long"):
        ops.switch_aux_loss_bwd(torch.tensor(1, device=device), probs, tpe, total, 2, 8, 0.1, None)
    ops.switch_aux_loss_bwd(torch.tensor(1.0, device=device), probs, tpe, total, 2, 8, 0.1, None)


def test_z_loss_bwd_grad_loss_dtype(device):
    logits = torch.randn(4, 8, device=device)
    with pytest.raises(TypeError, match=r"grad_loss must be float32.*got Bool"):
        ops.z_loss_bwd(torch.tensor(True, device=device), logits, 0.1, None)
    ops.z_loss_bwd(torch.tensor(1.0, device=device), logits, 0.1, None)


def test_sinkhorn_routing_bwd_grad_probs_dtype(device):
    logits = torch.randn(4, 8, device=device)
    probs, routing_map = ops.sinkhorn_routing(logits, 2, False, 1e-4)
    with pytest.raises(TypeError, match=r"grad_probs must be float32.*got Int"):
        ops.sinkhorn_routing_bwd(torch.ones(4, 8, dtype=torch.int32, device=device), logits,
                                 routing_map, 2)
    ops.sinkhorn_routing_bwd(torch.ones_like(probs), logits, routing_map, 2)


def test_token_dropping_bwd_no_experts(device):
    g = torch.ones(4, 0, device=device)
    with pytest.raises(ValueError, match=r"grad_final_probs must have at least one expert column"):
        ops.token_dropping_bwd(g, torch.zeros(4, 0, dtype=torch.bool, device=device))
    m = torch.ones(4, 2, dtype=torch.bool, device=device)
    assert torch.equal(ops.token_dropping_bwd(torch.ones(4, 2, device=device), m),
                       torch.ones(4, 2, device=device))


def test_permute_bwd_hidden(device):
    g = torch.ones(8, 0, device=device)
    idx = torch.zeros(8, dtype=torch.long, device=device)
    offsets = torch.tensor([0, 8], device=device)
    with pytest.raises(ValueError, match=r"grad_permuted_tokens must have hidden >= 1, got shape "
                                         r"\[8, 0\]"):
        ops.permute_bwd(g, None, idx, offsets, 4)
    _permute_still_works(device)
