"""Sinkhorn normalisation and Sinkhorn routing (top-1 and top-k, training and eval)
against megatron-core's sinkhorn and its TopKRouter.sinkhorn_load_balancing."""
import warnings

import pytest
import torch

import moe_core.ops as ops
from helpers.tolerances import assert_close_ulps

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from megatron.core.transformer.moe import moe_utils as mcore


def megatron_sinkhorn_routing(logits, topk, training):
    """The body of Megatron's TopKRouter.sinkhorn_load_balancing (it needs a full router)."""
    def act(x):
        return torch.sigmoid(x) if topk == 1 else torch.softmax(x, -1, dtype=torch.float32).type_as(x)

    if training:
        with torch.no_grad():
            _, indices = torch.topk(mcore.sinkhorn(logits.to(torch.float32)), k=topk, dim=1)
        logits = act(logits)
    else:
        logits = act(logits)
        _, indices = torch.topk(logits, k=topk, dim=1)
    routing_map = torch.zeros_like(logits).int().scatter(1, indices, 1).bool()  # on logits' device
    return logits * routing_map, routing_map


@pytest.mark.parametrize("shape", [(32, 8), (7, 5), (64, 16), (300, 40)])
def test_sinkhorn_matches_megatron(shape, device):
    cost = torch.randn(*shape, device=device)
    ours = ops.sinkhorn(cost)
    ref = mcore.sinkhorn(cost)
    assert ours.dtype == torch.float32 and ours.device == cost.device
    assert_close_ulps(ours, ref, n_ulps=64, floor=ref.abs().max().item())
    # the balancing itself: every column sums to 1/E (within tol), rows to about 1/T
    torch.testing.assert_close(ours.sum(0), torch.full((shape[1],), 1.0 / shape[1], device=device),
                               rtol=1e-3, atol=1e-4)


def test_sinkhorn_max_iters_caps_the_loop(device):
    cost = (torch.randn(16, 4) * 5).to(device)
    one = ops.sinkhorn(cost, tol=0.0, max_iters=1)
    c = cost.exp()
    d0 = (1 / 16) / (c.sum(1) + 1e-8)
    d1 = (1 / 4) / ((d0.unsqueeze(1) * c).sum(0) + 1e-8)
    torch.testing.assert_close(one, d1 * c * d0.unsqueeze(1), rtol=1e-5, atol=1e-9)


@pytest.mark.parametrize("topk", [1, 2, 3])
@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sinkhorn_routing_matches_megatron(topk, training, dtype, device):
    T, E = 48, 8
    base = (torch.randn(T, E) + torch.linspace(0, 2, E)).to(dtype).to(device)
    x1, x2 = base.clone().requires_grad_(), base.clone().requires_grad_()
    probs, routing_map = ops.sinkhorn_load_balancing(x1, topk, training=training)
    ref_probs, ref_map = megatron_sinkhorn_routing(x2, topk, training)
    assert probs.dtype == dtype and routing_map.dtype == torch.bool
    if dtype == torch.float32:
        assert torch.equal(routing_map, ref_map)
    else:  # bf16 activations tie often; compare rows without a tie at the k-th place
        src = ref_probs.detach().float() if not training else mcore.sinkhorn(base.float())
        act = (torch.sigmoid(base) if topk == 1 else
               torch.softmax(base, -1, dtype=torch.float32).type_as(base)).float()
        vals = (src if training else act).topk(min(topk + 1, E), dim=1).values
        ok = vals[:, topk - 1] != vals[:, topk]
        assert torch.equal(routing_map[ok], ref_map[ok])
        return
    assert_close_ulps(probs, ref_probs, n_ulps=4, dtype=dtype)
    w = torch.randn(T, E, device=device)
    (probs * w).sum().backward()
    (ref_probs * w).sum().backward()
    assert_close_ulps(x1.grad, x2.grad, n_ulps=16, floor=x2.grad.abs().max().item(), dtype=dtype)


def test_sinkhorn_routing_balances_skewed_logits(device):
    T, E = 256, 8
    logits = (torch.randn(T, E) + torch.linspace(0, 3, E)).to(device)  # top-1 piles onto expert 7
    _, greedy = ops.sinkhorn_load_balancing(logits, 1, training=False)
    _, balanced = ops.sinkhorn_load_balancing(logits, 1, training=True)
    assert greedy.sum(0).max() > 2 * balanced.sum(0).max()


@pytest.mark.parametrize("topk", [1, 3])
def test_gradcheck_sinkhorn_routing_fp64(topk, device):
    logits = torch.randn(6, 5, dtype=torch.float64, device=device, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda x: ops.sinkhorn_load_balancing(x, topk, training=True)[0], (logits,))


@pytest.mark.parametrize("topk", [1, 2])
def test_opcheck_sinkhorn_ops(topk, device):
    logits = torch.randn(9, 5, device=device, requires_grad=True)
    torch.library.opcheck(torch.ops.moe_core.sinkhorn.default, (logits.detach(), 1e-4, 0))
    torch.library.opcheck(torch.ops.moe_core.sinkhorn_routing.default, (logits, topk, True, 1e-4))
    torch.library.opcheck(torch.ops.moe_core.sinkhorn_routing.default, (logits, topk, False, 1e-4))
    _, routing_map = ops.sinkhorn_load_balancing(logits.detach(), topk)
    torch.library.opcheck(torch.ops.moe_core.sinkhorn_routing_bwd.default,
                          (torch.randn(9, 5, device=device), logits.detach(), routing_map, topk))
