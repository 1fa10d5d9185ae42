"""Property-based tests of the expert ops (glu_probs, grouped_gemm) and the load-balancing losses
(switch aux loss, z-loss) against PyTorch references.

* glu_probs: bit for bit torch's scalar-path sequence (tests/helpers/glu_probs.py's reference, as
  tests/experts/test_glu_probs.py), forward and grad_a, NaN and inf included; grad_probs within
  test_glu_probs' rounding bound.
* grouped_gemm (fwd, dgrad, wgrad) on small shapes, empty experts and K or N of 1: every element
  within the worst-case error of a running fp32 (fp64) sum against the fp64 per-expert truth
  (tests/helpers/grouped_gemm.py's reference); on larger outputs also at most 2x torch's own
  matmul error (tests/helpers/tolerances.py).
* switch aux loss and z-loss: their formulas in fp64, rounded once, as the contracts say; a few
  ulps of slack for the fp64 sums' order (more for fp64 results, which nothing rounds away).
"""
import math

import pytest
import torch
from hypothesis import given, strategies as st

from helpers.fuzz import FLOATS, assert_bitwise, assert_close_or_same_special, gen, sprinkle
from helpers.glu_probs import (ACTS, autograd_grads, grad_probs_truth, off_rounded_clamp,
                               reference)
from helpers.grouped_gemm import offsets_of, reference as gg_reference
from helpers.tolerances import assert_error_at_most, eps
from moe_core import ops

OPS = torch.ops.moe_core


@st.composite
def glu_cases(draw):
    dtype = draw(st.sampled_from(FLOATS))
    gated = draw(st.booleans())
    rows, ffn = draw(st.integers(0, 9)), draw(st.integers(1, 40))
    act = draw(st.sampled_from(ACTS))
    offset = draw(st.sampled_from([0.0, 1.0, 0.3])) if gated else 0.0
    clamp = draw(st.sampled_from([None, 2.01, 7.0])) if gated else None
    pdt = draw(st.sampled_from([None, torch.float32, dtype, torch.float64]))
    g = gen(draw(st.integers(0, 2**31 - 1)))
    scale = draw(st.sampled_from([0.5, 3.0, 30.0]))
    a = torch.randn(rows, 2 * ffn if gated else ffn, generator=g, dtype=torch.float64) * scale
    rate = draw(st.sampled_from([0.0, 0.0, 0.05]))
    a = sprinkle(a, g, rate, ["nan", "inf", "-inf"]).to(dtype)
    a = off_rounded_clamp(a, clamp)
    probs = None if pdt is None else torch.rand(rows, generator=g, dtype=torch.float64).to(pdt)
    dy = torch.randn(rows, ffn, generator=g, dtype=torch.float64).to(dtype)
    return a, probs, dy, act, gated, offset, clamp


@given(glu_cases())
def test_glu_probs_vs_torch_scalar_sequence(case):
    a, probs, dy, act, gated, offset, clamp = case
    assert_bitwise(ops.glu_probs(a, probs, act, gated, offset, clamp),
                   reference(a, probs, act, gated, offset, clamp), f"forward {act}")
    ref_ga, _ = autograd_grads(a, probs, dy, act, gated, offset, clamp)
    ga, gp = OPS.glu_probs_bwd(dy, a, probs, act, gated, offset, clamp)
    if act in ("relu", "squared_relu"):
        # known: a NaN gate input gets no gradient here (test_relu_backward_at_nan_follows_autograd)
        gate = a[:, : a.shape[1] // 2] if gated else a
        known = torch.zeros_like(a, dtype=torch.bool)
        known[:, : gate.shape[1]] = gate.isnan()
        ga, ref_ga = ga.masked_fill(known, 0), ref_ga.masked_fill(known, 0)
    assert_bitwise(ga, ref_ga, f"grad_a {act}")
    if probs is None:
        return
    # test_glu_probs' bound (grad_probs_truth: the exact sum of the product-dtype terms), on the
    # rows whose terms are finite and whose sum stays finite in probs' dtype; elsewhere (a term
    # overflowed, or inf / NaN inputs) the special value itself, which no summation order changes
    pt = torch.promote_types(a.dtype, probs.dtype)
    terms = (dy.to(pt) * reference(a, None, act, gated, offset, clamp)).double()
    finite = torch.isfinite(terms).all(-1)
    truth = terms.sum(-1)
    if bool(finite.any()):
        truth[finite] = grad_probs_truth(a[finite], probs[finite], dy[finite], act, gated, offset,
                                         clamp)[0]
    special = ~torch.isfinite(truth.to(pt).to(probs.dtype))
    assert_bitwise(gp[special].double(), truth.to(pt).to(probs.dtype)[special].double(),
                   f"grad_probs {act} (special values)")
    t, tm, o = truth[~special], terms[~special], gp.double()[~special]
    tol = eps(pt) * t.abs() + eps(probs.dtype) * t.abs() + tm.shape[-1] * 2.0**-52 * tm.abs().sum(-1)
    assert ((o - t).abs() <= tol).all(), f"grad_probs {act}"


@st.composite
def gemm_cases(draw):
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float16, torch.float64]))
    E = draw(st.integers(1, 5))
    counts = draw(st.lists(st.sampled_from([0, 1, 2, 3, 7, 16, 33]), min_size=E, max_size=E))
    K = draw(st.sampled_from([1, 2, 3, 8, 17, 64, 130]))
    N = draw(st.sampled_from([1, 2, 5, 16, 33, 70]))
    trans_w = draw(st.booleans())
    g = gen(draw(st.integers(0, 2**31 - 1)))
    R = sum(counts)
    x = torch.randn(R, K, generator=g, dtype=torch.float64).to(dtype)
    shape = (E, N, K) if trans_w else (E, K, N)
    w = (torch.randn(shape, generator=g, dtype=torch.float64) / K**0.5).to(dtype)
    dy = torch.randn(R, N, generator=g, dtype=torch.float64).to(dtype)
    return x, w, dy, offsets_of(counts), trans_w, counts


@given(gemm_cases())
def test_grouped_gemm_vs_per_expert_matmul(case):
    x, w, dy, off, trans_w, counts = case
    dtype = x.dtype
    outs = (ops.grouped_gemm(x, w, off, trans_w), ops.grouped_gemm_dgrad(dy, w, off, trans_w),
            ops.grouped_gemm_wgrad(x, dy, off, trans_w))
    truth = gg_reference(x, w, dy, off, trans_w, torch.float64)
    same = gg_reference(x, w, dy, off, trans_w, dtype)
    # Every element: the worst case of a running sum of n products in the fp32 (fp64)
    # accumulator, (n + 1) eps x sum of |products|, plus the final rounding to the dtype (relative
    # for normal results, half a subnormal step below the dtype's smallest normal).
    # tests/helpers/tolerances.py's statistical rule (max error at most 2x torch's) only on outputs
    # of 1024+ elements: on a handful, torch's blocked sums can be luckier than any one running sum
    # (e.g. 4.5 vs 0.5 ulps on a [2, 130] x [130, 1] fwd), and in fp64 torch *is* the truth.
    acc_eps = 2.0**-52 if dtype == torch.float64 else 2.0**-23
    mags = gg_reference(x.abs(), w.abs(), dy.abs(), off, trans_w, torch.float64)
    lengths = (x.shape[1], dy.shape[1], max(counts + [1]))
    for name, o, t, s, m, n in zip(("fwd", "dgrad", "wgrad"), outs, truth, same, mags, lengths):
        assert o.dtype == dtype and o.shape == t.shape, (name, o.dtype, tuple(o.shape))
        fi = torch.finfo(dtype)
        tol = (n + 1) * acc_eps * m + eps(dtype) * t.abs() + 0.5 * fi.smallest_normal * fi.eps
        err = (o.double() - t).abs()
        assert (err <= tol).all(), f"{name} {dtype} trans_w={trans_w}: {(err - tol).max():.3e}"
        if dtype != torch.float64 and t.numel() >= 1024:
            assert_error_at_most(o, s, t, factor=2.0, msg=f"{name} {dtype} trans_w={trans_w}")
    for e, c in enumerate(counts):
        if c == 0:
            assert not outs[2][e].any(), "an expert without rows has a zero weight gradient"


@st.composite
def loss_cases(draw):
    dtype = draw(st.sampled_from(FLOATS))
    T = draw(st.one_of(st.sampled_from([0, 1, 2]), st.integers(0, 40), st.just(2048)))
    E = draw(st.one_of(st.just(1), st.integers(1, 16), st.just(256)))
    g = gen(draw(st.integers(0, 2**31 - 1)))
    mask = (torch.rand(T, generator=g) < draw(st.sampled_from([0.0, 0.3, 1.0]))) \
        if draw(st.booleans()) else None
    rate = draw(st.sampled_from([0.0, 0.0, 0.01]))
    kinds = draw(st.sampled_from([["nan"], ["inf"], ["-inf"], ["nan", "inf", "-inf"]]))
    return dtype, T, E, g, mask, rate, kinds


def loss_ulps(dtype, n):
    """fp32 (or narrower) results: the fp64 sums' order shows at most as one rounding step.
    fp64 results: a sum of n non-negative terms in two orders, 2n ulps."""
    return 4 + 2 * n if dtype == torch.float64 else 1


@given(loss_cases(), st.integers(1, 8), st.sampled_from([1e-2, 1.0, 3.5]),
       st.sampled_from(["count", "float", "zero"]))
def test_switch_aux_loss_vs_formula(case, topk, coeff, total_kind):
    dtype, T, E, g, mask, rate, kinds = case
    probs = sprinkle(torch.rand(T, E, generator=g, dtype=torch.float64), g, rate, kinds).to(dtype)
    counts = torch.randint(0, T * topk + 1, (E,), generator=g)
    total = {"count": max(T, 1), "float": T * 1.5 + 0.25, "zero": 0}[total_kind]
    p = probs.clone().requires_grad_()
    loss = ops.switch_load_balancing_loss_func(p, counts, total, topk, E, coeff, padding_mask=mask)
    keep = torch.ones(T, dtype=torch.bool) if mask is None else ~mask
    out_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    scale = torch.tensor(E * coeff, dtype=torch.float64) / (topk * float(total) ** 2) \
        if total else torch.tensor(math.inf)
    per_col = probs.double()[keep].sum(0) * counts.float().double()
    want = (per_col.sum() * scale).to(out_dtype)
    assert loss.dtype == out_dtype and loss.shape == ()
    assert_close_or_same_special(loss.reshape(1), want.reshape(1), loss_ulps(dtype, T * E),
                                 msg="switch aux loss")
    if not total or not bool(torch.isfinite(probs).all()):
        return
    gl = torch.randn((), generator=g, dtype=torch.float64).to(out_dtype)
    loss.backward(gl)
    want_g = (gl.double() * counts.float().double() * scale).expand(T, E) * keep.view(T, 1)
    assert_close_or_same_special(p.grad, want_g.to(dtype), 2, floor=torch.finfo(dtype).tiny,
                                 msg="grad probs")


@given(loss_cases(), st.sampled_from([1e-3, 1.0, 2.5]))
def test_z_loss_vs_formula(case, coeff):
    dtype, T, E, g, mask, rate, kinds = case
    logits = sprinkle(torch.randn(T, E, generator=g, dtype=torch.float64) * 4, g, rate, kinds)
    logits = logits.to(dtype)
    x = logits.clone().requires_grad_()
    loss = ops.z_loss_func(x, coeff, padding_mask=mask)
    out_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    lse = torch.logsumexp(logits.double(), dim=-1)
    keep = torch.ones(T, dtype=torch.bool) if mask is None else ~mask
    n = T if mask is None else max(int(keep.sum()), 1)
    sq = (lse * lse)[keep]
    want = (sq.sum() / n * coeff) if n else torch.tensor(math.nan, dtype=torch.float64)
    assert loss.dtype == out_dtype and loss.shape == ()
    assert_close_or_same_special(loss.reshape(1), want.to(out_dtype).reshape(1),
                                 loss_ulps(dtype, T) + (8 if dtype == torch.float64 else 0),
                                 msg="z-loss")
    if not bool(torch.isfinite(logits).all()):
        return
    gl = torch.randn((), generator=g, dtype=torch.float64).to(out_dtype)
    loss.backward(gl)
    want_g = gl.double() * coeff * 2 * lse.view(T, 1) * torch.softmax(logits.double(), -1) / n
    want_g = want_g * keep.view(T, 1)
    ulps = 4 if dtype != torch.float64 else 16 + 2 * E
    assert_close_or_same_special(x.grad, want_g.to(dtype), ulps, floor=torch.finfo(dtype).tiny,
                                 msg="grad logits")


@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("act", ["relu", "squared_relu"])
def test_relu_backward_at_nan_follows_autograd(act, gated):
    """Found by test_glu_probs_vs_torch_scalar_sequence: a NaN gate input, fp32."""
    a = torch.tensor([[float("nan"), 0.5]] if gated else [[float("nan")]])
    dy = torch.tensor([[2.0]])
    ref_ga, _ = autograd_grads(a, None, dy, act, gated, 0.0, None)
    ga, _ = OPS.glu_probs_bwd(dy, a, None, act, gated, 0.0, None)
    assert_bitwise(ga, ref_ga, f"grad_a {act}")


@pytest.mark.parametrize("with_mask", [False, True])
def test_z_loss_backward_of_zero_tokens(with_mask):
    """Found by test_z_loss_vs_formula: logits [0, E] (with an empty padding mask the loss is 0,
    without one NaN, the mean of nothing); the gradient must be an empty [0, E] tensor."""
    x = torch.zeros(0, 4, requires_grad=True)
    mask = torch.zeros(0, dtype=torch.bool) if with_mask else None
    ops.z_loss_func(x, 1.0, padding_mask=mask).backward()
    assert x.grad.shape == (0, 4)
