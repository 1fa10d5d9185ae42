"""Property-based tests of router_topk (dense and compact forms) against
tests/helpers/reference_router.py.

Selection must equal the reference's exactly: descending score, NaN first, ties to the lowest
expert index (and the lowest group index). To keep that an exact property, logits come from a
grid of multiples of 1/8 in [-8, 8] (plenty of exact ties, no near-ties: two distinct scores
differ by far more than the one-ulp differences between torch's fp32 exp/sigmoid and the core's).
Expert biases come from multiples of 1/8 in [-1/2, 1/2]; over the whole grid the closest two
distinct sigmoid / sqrt-softplus scores plus bias are 1e-5 apart, against an fp32 ulp of 1.2e-7.
Group-limited routing on scores (sigmoid, sqrtsoftplus, softmax before the top-k) draws each
group's logits from its own band of the grid, so group scores are either far apart or exactly
tied (a copied group). Probs are compared within tests/router/test_ops.py's ulp bound
(tests/helpers/tolerances.py's router_prob_ulps), with a floor at the dtype's smallest normal (fp16
probs below 6.1e-5 are subnormal: one rounding is a step of 2**-24 there, more than an ulp relative
to the value); with only finite logits the logits' gradients are checked against an fp64 truth as
tests/router/test_ops.py does.
"""
import pytest
import torch
from hypothesis import given, strategies as st

from helpers import reference_router as ref
from helpers.fuzz import FLOATS, assert_bitwise, assert_close_or_same_special, gen, grid, sprinkle
from helpers.tolerances import eps, router_prob_ulps
from moe_core import ops

TOKENS = st.one_of(st.sampled_from([0, 1, 2, 3, 5, 16]), st.integers(0, 40),
                   st.sampled_from([257, 1024]))
EXPERTS = st.sampled_from([1, 2, 3, 4, 6, 8, 12, 16, 32, 64, 128, 256])
MODES = st.sampled_from(ref.ROUTING_MODES)


@st.composite
def routing_cases(draw, grouped: bool):
    dtype = draw(st.sampled_from(FLOATS))
    T = draw(TOKENS)
    score, pre = draw(MODES)
    if grouped:
        E = draw(st.sampled_from([2, 4, 6, 8, 12, 16, 32, 64, 256]))
        G = draw(st.sampled_from([g for g in (2, 3, 4, 8) if E % g == 0 and g <= E]))
        gk = draw(st.integers(1, G))
        P = E // G
        k = draw(st.integers(gk, gk * P))
    else:
        E = draw(EXPERTS)
        G = gk = None
        k = draw(st.one_of(st.just(E), st.just(1), st.integers(1, E)))
    opts = dict(topk=k, use_pre_softmax=pre, score_function=score)
    if grouped:
        opts.update(num_groups=G, group_topk=gk)
    if draw(st.booleans()):
        opts["scaling_factor"] = draw(st.sampled_from([0.5, 1.0, 2.5]))
    use_bias = score != "softmax" and draw(st.booleans())
    spread = draw(st.sampled_from([1, 2, 8, 64]))  # narrow grids give many exact ties
    rate = draw(st.sampled_from([0.0, 0.0, 0.02, 0.3]))
    if grouped and score == "softmax" and not pre:
        # the reference masks dropped groups with -inf, which ties with a -inf logit inside a
        # kept group (the op never picks outside the kept groups): keep -inf out of the selection
        kinds = draw(st.sampled_from([["nan"], ["inf"], ["nan", "inf"]]))
    elif grouped:
        kinds = ["nan"]  # +-inf would move a group's score out of its band
    else:
        kinds = draw(st.sampled_from([["nan"], ["inf"], ["-inf"], ["nan", "inf", "-inf"]]))
    seed = draw(st.integers(0, 2**31 - 1))
    g = gen(seed)
    banded = grouped and not (score == "softmax" and not pre)
    if not banded:
        logits = grid((T, E), g, -spread, spread, dtype=torch.float64)
    else:
        # group r-th in the ranking of its row gets values in band r of 128 / G grid steps
        width = 128 // G
        rank = torch.argsort(torch.rand(T, G, generator=g), dim=1).to(torch.float64)
        inner = torch.randint(0, max(width - 1, 1), (T, G, P), generator=g).to(torch.float64)
        inner = torch.minimum(inner, torch.tensor(float(spread)))
        logits = ((rank.unsqueeze(-1) * width + inner) / 8 - 8).reshape(T, E)
        if G > 1 and T > 0 and draw(st.booleans()):
            # an exact tie between two groups: group b gets group a's values and rank
            a, b = draw(st.permutations(range(G)))[:2]
            logits = logits.view(T, G, P).clone()
            logits[:, b] = logits[:, a]
            logits = logits.reshape(T, E)
    logits = sprinkle(logits, g, rate, kinds).to(dtype)
    if use_bias:
        if banded:
            # one bias per group, growing with the band: bands stay apart after the bias
            opts["expert_bias"] = torch.full((E,), 0.125 * draw(st.integers(-4, 4)))
        else:
            opts["expert_bias"] = grid((E,), g, -4, 4)
    return logits, opts


def check_grads(logits, opts):
    """tests/router/test_ops.py's gradient rule: against the fp64 truth, our error is at most 2x the
    reference's (in the same dtype) plus 4 ulps of the output scale."""
    E = logits.shape[1]
    x1, x2 = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    x3 = logits.double().requires_grad_()
    w = torch.randn(logits.shape[0], E, dtype=torch.float64, generator=gen(7))
    (ops.topk_routing_with_score_function(x1, **opts)[0].double() * w).sum().backward()
    (ref.to_dense(*ref.topk_routing(x2, **opts), E)[0].double() * w).sum().backward()
    (ref.to_dense(*ref.topk_routing(x3, **opts), E)[0] * w).sum().backward()
    truth = x3.grad
    if truth.numel() == 0:
        return
    ours_err = (x1.grad.double() - truth).abs().max().item()
    ref_err = (x2.grad.double() - truth).abs().max().item()
    g_scale = w.abs().max().item() * (opts.get("scaling_factor") or 1.0)
    slack = 4 * eps(logits.dtype) * max(truth.abs().max().item(), g_scale)
    assert ours_err <= 2 * ref_err + slack, f"grad error {ours_err:.3e} vs reference {ref_err:.3e}"


def check(logits, opts):
    T, E = logits.shape
    dtype = logits.dtype
    # fp64: the core sums a row's E softmax terms left to right in fp64, torch pairwise; with
    # many tied (equal) terms their rounding errors add up instead of averaging out, so the
    # sqrt(E) estimate of tests/router/test_ops.py becomes the worst case of two summation orders
    # of E positive terms, 2E ulps
    ulps = 4 + 2 * E if dtype == torch.float64 else router_prob_ulps(dtype, E)
    floor = torch.finfo(dtype).tiny
    p_ref, i_ref = ref.topk_routing(logits, **opts)
    p, i = ops.router_topk(logits, **opts)
    assert_bitwise(i, i_ref, "compact indices")
    assert_close_or_same_special(p, p_ref, ulps, dtype, floor, "compact probs")
    dense_ref, map_ref = ref.to_dense(p_ref, i_ref, E)
    dp, dmap, di = ops.router_topk_dense(logits, **opts)
    assert_bitwise(di, i_ref, "dense form's indices")
    assert_bitwise(dmap, map_ref, "routing map")
    assert_close_or_same_special(dp, dense_ref, ulps, dtype, floor, "dense probs")
    if bool(torch.isfinite(logits).all()):
        check_grads(logits, opts)


@given(routing_cases(grouped=False))
def test_router_topk_vs_reference(case):
    check(*case)


@given(routing_cases(grouped=True))
def test_group_limited_router_topk_vs_reference(case):
    check(*case)


@pytest.mark.parametrize("score", [s for s in ops.SCORE_FUNCTIONS if s != "softmax"])
def test_sigmoid_renormalisation_sum_is_as_accurate_as_torch(score):
    """Found by test_router_topk_vs_reference: T=1, E=topk=256, fp32 logits from {-1/8, 0, 1/8}.
    tests/helpers/tolerances.py's rule: our error against the fp64 truth at most 2x torch's + 1
    ulp."""
    from helpers.tolerances import assert_error_at_most

    vals = torch.tensor([0.125, -0.125, 0.0])
    logits = vals[torch.randint(0, 3, (1, 256), generator=gen(0))]
    ours, idx = ops.router_topk(logits, 256, score_function=score)
    torch32, idx32 = ref.topk_routing(logits, 256, score_function=score)
    truth, idx64 = ref.topk_routing(logits.double(), 256, score_function=score)
    assert torch.equal(idx, idx32) and torch.equal(idx, idx64)
    assert_error_at_most(ours, torch32, truth, factor=2.0, msg=score)


@pytest.mark.parametrize("score", ops.SCORE_FUNCTIONS)
def test_all_tied_row_picks_the_lowest_indices(score):
    """A row of equal logits: the top-k are experts 0..k-1, in order (the documented rule)."""
    logits = torch.zeros(3, 8)
    _, idx = ops.router_topk(logits, 3, score_function=score)
    assert idx.tolist() == [[0, 1, 2]] * 3
    _, idx = ops.router_topk(logits, 3, score_function=score, num_groups=4, group_topk=2)
    assert idx.tolist() == [[0, 1, 2]] * 3
