"""The routing layout value (moe_core.ops.routing_layout): made by permute's layout-only mode or
with the rows in permute's full mode, bitwise permute's outputs either way; the combine equal to
unpermute; traced by torch.compile as a plain value."""
import pytest
import torch

from moe_core import ops


def _routing(T=37, E=6, k=2, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(T, E, generator=g)
    top = scores.topk(k, dim=1).indices
    routing_map = torch.zeros(T, E, dtype=torch.bool).scatter(1, top, True)
    probs = torch.softmax(scores, dim=1) * routing_map
    return routing_map.to(device), probs.to(device)


LAYOUTS = [dict(), dict(align_size=8), dict(drop_and_pad=True), dict(cut=True)]
IDS = ["dropless", "aligned", "drop_and_pad", "bound_below_routed"]


def _bound(routing_map, kind):
    T, E = routing_map.shape
    if kind.get("drop_and_pad"):
        return E * 5  # capacity 5 of 37 tokens
    if kind.get("cut"):
        return int(routing_map.sum()) - 9  # the rows past the bound are cut off
    return int(routing_map.sum())


@pytest.mark.parametrize("kind", LAYOUTS, ids=IDS)
def test_layout_equals_permute(device, kind):
    routing_map, probs = _routing(device=device)
    x = torch.randn(routing_map.shape[0], 16, device=device)
    opts = dict(drop_and_pad=kind.get("drop_and_pad", False), align_size=kind.get("align_size", 0))
    bound = _bound(routing_map, kind)
    want = ops.permute(x, routing_map, probs, num_out_tokens=bound, **opts)
    layout = ops.routing_layout(routing_map, probs, bound, **opts)
    rows, full = ops.permute_tokens(x, routing_map, probs, bound, **opts)
    for lay in (layout, full):
        assert torch.equal(lay.row_probs, want[1])
        assert torch.equal(lay.sorted_indices, want[2])
        assert torch.equal(lay.expert_offsets, want[3])
        assert torch.equal(lay.tokens_per_expert, want[4])
        assert lay.routing_map is routing_map and lay.probs is probs
        assert (lay.drop_and_pad, lay.align_size) == (opts["drop_and_pad"], opts["align_size"])
        assert (lay.num_rows, lay.num_tokens, lay.num_experts) == (want[0].shape[0], 37, 6)
    assert torch.equal(rows, want[0])


def test_layout_without_probs(device):
    routing_map, _ = _routing(device=device)
    layout = ops.routing_layout(routing_map, None, int(routing_map.sum()))
    assert layout.row_probs is None and layout.probs is None
    want = ops.permute(torch.zeros(37, 1, device=device), routing_map, None,
                       num_out_tokens=int(routing_map.sum()))
    assert torch.equal(layout.sorted_indices, want[2])


def test_layout_probs_gradient_equals_permute(device):
    """The row probs carry the gradient back to the probs, bitwise as permute's backward."""
    routing_map, probs = _routing(device=device)
    g = torch.randn(int(routing_map.sum()), device=device)
    p1 = probs.clone().requires_grad_()
    ops.routing_layout(routing_map, p1, g.shape[0]).row_probs.backward(g)
    p2 = probs.clone().requires_grad_()
    x = torch.randn(37, 4, device=device)
    ops.permute(x, routing_map, p2, num_out_tokens=g.shape[0])[1].backward(g)
    assert torch.equal(p1.grad, p2.grad)


@pytest.mark.parametrize("weighted", [False, True], ids=["plain", "probs"])
def test_combine_equals_unpermute(device, weighted):
    routing_map, probs = _routing(device=device)
    R = int(routing_map.sum())
    x = torch.randn(37, 16, device=device)
    rows, layout = ops.permute_tokens(x, routing_map, probs, R)
    y = torch.randn_like(rows)
    if weighted:
        want = ops.unpermute(y, layout.sorted_indices, (37, 16), probs=probs,
                             pad_offsets=layout.expert_offsets)
        got = ops.combine(y, layout, probs)
    else:
        want = ops.unpermute(y, layout.sorted_indices, (37, 16))
        got = ops.combine(y, layout)
    assert torch.equal(got, want)


def test_layout_traces_as_a_value():
    """A compiled function that makes, reads and returns a layout: one graph (fullgraph), one
    compile for every token count (dynamic), the same values as eager."""
    def f(x, routing_map, probs):
        rows, layout = ops.permute_tokens(x, routing_map, probs, x.shape[0] * 2)
        y = rows * layout.row_probs.unsqueeze(-1)
        return ops.combine(y, layout), layout

    compiled = torch.compile(f, fullgraph=True, dynamic=True)
    for T in (37, 53):
        routing_map, probs = _routing(T=T, seed=T)
        x = torch.randn(T, 16)
        got, layout = compiled(x, routing_map, probs)
        want, want_layout = f(x, routing_map, probs)
        assert torch.equal(got, want)
        assert isinstance(layout, ops.RoutingLayout)
        assert torch.equal(layout.sorted_indices, want_layout.sorted_indices)
