"""glu_probs: the gated activation and the router-probs multiply in one op, against the unfused
torch sequence it replaces (moe_core.experts.apply_activation, then (h * p).to(h.dtype)).

Two torch references (tests/helpers/glu_probs.py's reference, scalar=True / False):
* "scalar": the sequence with the activation fed a strided (non-contiguous) view, which sends torch's
  CPU kernels down their scalar path (libm's exp/erf/tanh, like our C). The op must equal it bit for
  bit, forward and grad_a, in every dtype.
* "ordinary": the sequence as the layer would run it (vectorised kernels, SLEEF's exp/erf/tanh, and
  oneDNN for contiguous fp32 gelu). Equal bit for bit where no transcendental is involved or the
  dtype's rounding absorbs the difference (measured exhaustively over every bf16/fp16 input below),
  else within a few ulps.
"""
import functools

import pytest
import torch
import torch.nn.functional as F

from helpers.glu_probs import (ACTS, autograd_grads, grad_probs_truth, off_rounded_clamp,
                               reference)
from helpers.tolerances import assert_close_ulps, assert_error_at_most, eps
from moe_core import MoEConfig, ops
from moe_core.experts import activation_times_probs, apply_activation

OPS = torch.ops.moe_core
DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float64]
NO_TRANSCENDENTAL = {"relu", "squared_relu"}


def inputs(rows, ffn, dtype, gated, probs_dtype, device="cpu", scale=3.0):
    a = (torch.randn(rows, 2 * ffn if gated else ffn, dtype=torch.float64) * scale).to(dtype)
    probs = None if probs_dtype is None else torch.rand(rows, dtype=torch.float64).to(probs_dtype)
    return a.to(device), None if probs is None else probs.to(device)


def assert_equal(ours, ref, msg=""):
    assert ours.dtype == ref.dtype and ours.shape == ref.shape, msg
    same = (ours == ref) | (ours.isnan() & ref.isnan())
    if not bool(same.all()):
        i = (~same).nonzero()[0].tolist()
        raise AssertionError(f"{msg}: {int((~same).sum())} of {ours.numel()} differ; first at {i}: "
                             f"ours {ours[tuple(i)].item()!r} ref {ref[tuple(i)].item()!r}")


CASES = [  # (gated, offset, clamp)
    (True, 0.0, None), (True, 1.0, None), (True, 0.3, 2.01), (False, 0.0, None)]


def _torch_passes_grad_at_rounded_clamp() -> bool:
    """Whether this torch's clamp backward passes the gradient at x == dtype(v), the bound rounded
    to the tensor's dtype (torch 2.11: yes, its mask is min <= x <= max; 2.14: no, it is strict
    there). The op follows 2.14: an input equal to the rounded bound gets no gradient."""
    x = torch.tensor([2.015625], dtype=torch.bfloat16, requires_grad=True)
    x.clamp(max=2.01).sum().backward()
    return bool(x.grad[0] != 0)


TORCH_BOUNDARY_GRAD = _torch_passes_grad_at_rounded_clamp()


def probs_dtypes(dtype):
    return [None, torch.float32, dtype, torch.float64]


# ---- forward ----------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("gated,offset,clamp", CASES)
def test_forward_equals_torch_scalar_path_bitwise(dtype, act, gated, offset, clamp):
    for pdt in probs_dtypes(dtype):
        a, probs = inputs(37, 40, dtype, gated, pdt)
        ours = ops.glu_probs(a, probs, act, gated, offset, clamp)
        assert_equal(ours, reference(a, probs, act, gated, offset, clamp), f"{act} probs {pdt}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("act", ACTS)
def test_forward_vs_ordinary_torch(dtype, act):
    """The sequence as the layer runs it: exact without a transcendental and for every bf16 silu,
    else within 2 ulps of the activation (SLEEF vs libm, 1 ulp in fp32, at most a rounding
    step in the half types)."""
    a, probs = inputs(64, 48, dtype, True, torch.float32)
    ours = ops.glu_probs(a, probs, act, True, 0.5, 3.0)
    ref = reference(a, probs, act, True, 0.5, 3.0, scalar=False)
    if act in NO_TRANSCENDENTAL or (act == "silu" and dtype == torch.bfloat16):
        assert_equal(ours, ref, act)
    elif dtype == torch.float32 and act == "gelu":
        # contiguous fp32 gelu runs oneDNN's own erf polynomial: checked against fp64 instead
        truth = reference(a.double(), probs.double(), act, True, 0.5, 3.0).to(dtype)
        assert_close_ulps(ours, truth, n_ulps=2, floor=1.0, msg=act)
        assert_close_ulps(ref, truth, n_ulps=64, floor=1.0, msg="torch's own")
    else:
        assert_close_ulps(ours, ref, n_ulps=4, floor=1.0, msg=act)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("act", ACTS)
def test_every_half_input_forward_and_backward(dtype, act):
    """Every finite bf16/fp16 value through the activation: equal to torch's scalar path always;
    equal to torch's ordinary (vectorised) path except for the few inputs where SLEEF's and
    libm's fp32 results round to different half values; counted and bounded here."""
    x = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(dtype)
    x = x[torch.isfinite(x)].reshape(1, -1)
    if act in ("squared_relu", "quick_gelu"):  # keep x*x and the grads finite
        x = x[:, x[0].abs() < (200 if dtype == torch.float16 else 1e15)]
    dy = torch.randn(x.shape, dtype=torch.float64).to(dtype)
    ours = ops.glu_probs(x, None, act, False)
    grad, _ = OPS.glu_probs_bwd(dy, x, None, act, False)
    for scalar in (True, False):
        xa = x.clone().requires_grad_()
        ref = reference(xa, None, act, False, scalar=scalar)
        ref.backward(dy)
        if scalar:
            assert_equal(ours, ref.detach(), f"{act} forward")
            assert_equal(grad, xa.grad, f"{act} backward")
        else:
            differ = int(((ours != ref) & ~(ours.isnan() & ref.isnan())).sum())
            # SLEEF's erf/tanh vs libm: which inputs round apart depends on the CPU's vector ISA
            # and the torch build (300 on one machine, 660 on another); bounded at 2 %, and
            # every difference within 2 ulps below
            limit = 0 if act in NO_TRANSCENDENTAL or act == "silu" or act == "quick_gelu" \
                else x.numel() // 50
            assert differ <= limit, f"{act}: {differ} inputs differ from torch's vectorised kernel"
            assert_close_ulps(ours, ref, n_ulps=2, floor=1e-3)


def test_zero_rows_and_odd_widths():
    for rows, ffn in [(0, 8), (3, 1), (5, 7), (2, 9)]:
        for gated in (True, False):
            a, probs = inputs(rows, ffn, torch.bfloat16, gated, torch.float32)
            ours = ops.glu_probs(a, probs, "silu", gated)
            assert ours.shape == (rows, ffn)
            assert_equal(ours, reference(a, probs, "silu", gated), f"{rows}x{ffn}")
            ga, gp = OPS.glu_probs_bwd(torch.ones(rows, ffn, dtype=torch.bfloat16), a, probs,
                                       "silu", gated)
            assert ga.shape == a.shape and gp.shape == (rows,)


def test_clamp_boundaries():
    """Values exactly at v, at bf16(v) > v, and beyond, on both halves (forward and the masks).
    An input equal to the bound rounded to its dtype (here bf16(v)) gets no gradient, as in torch
    2.14; torch 2.11 passed the gradient there, so against such a torch those elements are
    checked against the rule instead."""
    v = 2.01  # bf16(2.01) = 2.015625 > v
    vals = torch.tensor([-3.0, -2.015625, -2.0, 0.5, 2.0, 2.015625, 3.0], dtype=torch.bfloat16)
    g, l = torch.meshgrid(vals, vals, indexing="ij")
    a = torch.cat([g.reshape(-1, 1), l.reshape(-1, 1)], dim=1)
    probs = torch.rand(a.shape[0])
    dy = torch.randn(a.shape[0], 1).to(torch.bfloat16)
    aa = a.clone().requires_grad_()
    pp = probs.clone().requires_grad_()
    ref = reference(aa, pp, "silu", True, 0.25, v)
    ref.backward(dy)
    assert_equal(ops.glu_probs(a, probs, "silu", True, 0.25, v), ref.detach(), "forward")
    ga, gp = OPS.glu_probs_bwd(dy, a, probs, "silu", True, 0.25, v)
    at_bound = torch.stack([a[:, 0] == 2.015625, a[:, 1].abs() == 2.015625], dim=1)
    if TORCH_BOUNDARY_GRAD:
        assert_equal(ga[~at_bound], aa.grad[~at_bound], "grad_a off the rounded bound")
    else:
        assert_equal(ga, aa.grad, "grad_a")
    assert (ga[at_bound] == 0).all(), "the rounded bound is clamped: no gradient"
    assert (ga[:, 0][a[:, 0].float() > 2.01] == 0).all()


# ---- backward ---------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("gated,offset,clamp", CASES)
def test_backward_vs_autograd(dtype, act, gated, offset, clamp):
    for pdt in probs_dtypes(dtype):
        a, probs = inputs(29, 72, dtype, gated, pdt)
        a = off_rounded_clamp(a, clamp)
        dy = torch.randn(29, 72, dtype=torch.float64).to(dtype)
        ref_ga, ref_gp = autograd_grads(a, probs, dy, act, gated, offset, clamp)
        ga, gp = OPS.glu_probs_bwd(dy, a, probs, act, gated, offset, clamp)
        assert_equal(ga, ref_ga, f"grad_a {act} probs {pdt}")
        if probs is None:
            assert gp.numel() == 0
            continue
        assert gp.dtype == probs.dtype
        # our fixed-order fp64 sum, rounded: within one ulp of the exactly rounded sum ...
        truth, terms = grad_probs_truth(a, probs, dy, act, gated, offset, clamp)
        pt = torch.promote_types(dtype, pdt)
        tol_round = eps(pt) * truth.abs() + eps(pdt) * truth.abs() + \
            72 * 2.0**-52 * terms.abs().sum(-1)  # our fp64 running sums
        assert ((gp.double() - truth).abs() <= tol_round).all(), f"grad_probs {act} {pdt}"
        # ... and autograd's (torch's cascade sum in the product dtype) within its own error
        tol_torch = tol_round + 4 * eps(pt) * terms.abs().sum(-1)
        assert ((gp.double() - ref_gp.double()).abs() <= tol_torch).all(), f"vs autograd {act}"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("act", ["relu", "squared_relu"])
@pytest.mark.parametrize("gated", [True, False])
def test_relu_backward_at_special_inputs_equals_autograd(gated, act, dtype, device):
    """NaN, ±inf, ±0 and fp16's largest values through relu / squared_relu, against autograd of
    the composite. ReluBackward is threshold_backward: (relu(x) <= 0 ? 0 : grad), so a NaN input
    passes the gradient (relu: grad; squared_relu: PowBackward's grad * 2r = NaN); PowBackward's
    2r is a dtype tensor, so in fp16 it is inf from r = 32768 on."""
    vals = [float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1.5, -1.5, 32768.0, 40000.0]
    dys = [2.0, 0.0, -0.75, float("nan")]
    x, dy = (t.reshape(-1, 1) for t in torch.meshgrid(
        torch.tensor(vals, dtype=torch.float64), torch.tensor(dys, dtype=torch.float64),
        indexing="ij"))
    a = (torch.cat([x, torch.full_like(x, 0.5)], 1) if gated else x).to(dtype)
    dy = dy.to(dtype)
    for pdt in (None, torch.float32, torch.float64):
        probs = None if pdt is None else torch.full((a.shape[0],), 0.75, dtype=pdt)
        ref_ga, ref_gp = autograd_grads(a, probs, dy, act, gated, 0.0, None)
        ga, gp = OPS.glu_probs_bwd(dy.to(device), a.to(device),
                                   None if probs is None else probs.to(device), act, gated, 0.0,
                                   None)
        assert_equal(ga.cpu(), ref_ga, f"grad_a {act} probs {pdt}")
        if probs is not None:  # one term per row: the sum is the rounded product itself
            assert_equal(gp.cpu(), ref_gp, f"grad_probs {act} probs {pdt}")
        rows = x.reshape(-1).to(dtype).isnan() & dy.reshape(-1).isfinite() & (dy.reshape(-1) != 0)
        if act == "relu":
            assert ga[:, 0].cpu()[rows].ne(0).all(), "a NaN relu input passes the gradient"
        else:
            assert ga[:, 0].cpu()[rows].isnan().all(), "a NaN squared_relu input gets NaN"


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("gated", [True, False])
def test_autograd_registration(act, gated):
    """Through the registered autograd: grads for a and probs, probs optional."""
    a, probs = inputs(9, 16, torch.bfloat16, gated, torch.float32)
    dy = torch.randn(9, 16).to(torch.bfloat16)
    aa, pp = a.clone().requires_grad_(), probs.clone().requires_grad_()
    ops.glu_probs(aa, pp, act, gated, 0.5 if gated else 0.0, 1.5 if gated else None).backward(dy)
    ga, gp = OPS.glu_probs_bwd(dy, a, probs, act, gated, 0.5 if gated else 0.0,
                               1.5 if gated else None)
    assert_equal(aa.grad, ga)
    assert_equal(pp.grad, gp)
    aa.grad = None
    ops.glu_probs(aa, None, act, gated).backward(dy)
    assert aa.grad.shape == a.shape


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("gated,offset,clamp", CASES)
def test_gradcheck_fp64(act, gated, offset, clamp):
    a, probs = inputs(4, 6, torch.float64, gated, torch.float64)
    a = a + 0.05 * torch.sign(a)  # keep away from relu's kink at 0
    if clamp is not None:
        a = torch.where((a.abs() - clamp).abs() < 0.05, a + 0.1, a)
    a.requires_grad_()
    probs.requires_grad_()
    torch.autograd.gradcheck(lambda x, p: ops.glu_probs(x, p, act, gated, offset, clamp),
                             (a, probs))


# ---- bad input: one test per rejected case ----------------------------------------------------

def good():
    return torch.randn(4, 8), torch.rand(4)


@pytest.mark.parametrize("make,arg", [
    (lambda: OPS.glu_probs(torch.randn(8), None, "silu", True), "a"),
    (lambda: OPS.glu_probs(torch.ones(4, 8, dtype=torch.int32), None, "silu", True), "a"),
    (lambda: OPS.glu_probs(torch.randn(4, 7), None, "silu", True), "a.shape[1]"),
    (lambda: OPS.glu_probs(torch.randn(4, 0), None, "silu", False), "a.shape[1]"),
    (lambda: OPS.glu_probs(good()[0], torch.rand(5), "silu", True), "probs"),
    (lambda: OPS.glu_probs(good()[0], torch.rand(4, 1), "silu", True), "probs"),
    (lambda: OPS.glu_probs(good()[0], torch.ones(4, dtype=torch.int64), "silu", True), "probs"),
    (lambda: OPS.glu_probs(good()[0], None, "tanh", True), "activation"),
    (lambda: OPS.glu_probs(good()[0], None, "silu", True, 0.0, -1.0), "clamp_value"),
    (lambda: OPS.glu_probs_bwd(torch.randn(4, 5), good()[0], None, "silu", True), "grad_h"),
    (lambda: OPS.glu_probs_bwd(torch.randn(3, 4), good()[0], None, "silu", True), "grad_h"),
    (lambda: OPS.glu_probs_bwd(torch.randn(4, 4, dtype=torch.float64), good()[0], None, "silu",
                               True), "grad_h"),
    (lambda: OPS.glu_probs_bwd(torch.randn(4), good()[0], None, "silu", True), "grad_h"),
], ids=["a_1d", "a_int", "a_odd_glu", "a_empty", "probs_len", "probs_2d", "probs_int",
        "activation", "clamp_negative", "grad_h_cols", "grad_h_rows", "grad_h_dtype", "grad_h_1d"])
def test_bad_input(make, arg):
    with pytest.raises((ValueError, TypeError)) as e:
        make()
    assert arg in str(e.value)


# ---- the layer's dispatch ---------------------------------------------------------------------

def test_activation_names():
    assert ops.activation_name(F.silu) == "silu"
    assert ops.activation_name(F.gelu) == "gelu"
    assert ops.activation_name(functools.partial(F.gelu, approximate="tanh")) == "gelu_tanh"
    assert ops.activation_name(functools.partial(F.gelu, approximate="none")) == "gelu"
    assert ops.activation_name(F.relu) == "relu"
    assert ops.activation_name(torch.relu) == "relu"
    assert ops.activation_name(lambda x: torch.pow(F.relu(x), 2)) is None  # user callable
    assert ops.activation_name(functools.partial(F.gelu, approximate="bogus")) is None
    assert ops.activation_name(torch.tanh) is None
    from megatron.core import activations
    assert ops.activation_name(activations.squared_relu) == "squared_relu"
    assert ops.activation_name(activations.quick_gelu) is None  # compiled: rounds once


@pytest.mark.parametrize("act,fused", [(F.silu, True), (F.gelu, True), (F.relu, True),
                                       (lambda x: x * torch.tanh(x), False),
                                       (lambda x: torch.pow(F.relu(x), 2), False)])
@pytest.mark.parametrize("gated", [True, False])
def test_layer_dispatch(monkeypatch, act, fused, gated):
    """The layer calls glu_probs exactly when the activation is one it knows, and either way gives
    the unfused sequence (bitwise here: bf16 silu/relu, and gelu's scalar path... compared to the
    unfused torch run with the same activation within the op's contract)."""
    calls = []
    real = ops.glu_probs
    monkeypatch.setattr(ops, "glu_probs", lambda *a, **k: calls.append(1) or real(*a, **k))
    cfg = MoEConfig(hidden_size=8, num_moe_experts=2, moe_router_topk=2, gated_linear_unit=gated,
                    activation_func=act, glu_linear_offset=0.5 if gated else 0.0,
                    activation_func_clamp_value=2.0 if gated else None)
    a, probs = inputs(16, 24, torch.bfloat16, gated, torch.float32)
    h = activation_times_probs(cfg, a, probs)
    assert bool(calls) == fused
    ref = (apply_activation(cfg, a) * probs.unsqueeze(-1)).to(a.dtype)
    if act is F.gelu:
        assert_close_ulps(h, ref, n_ulps=2, floor=1e-3)
    else:
        assert_equal(h, ref)


# ---- CUDA ---------------------------------------------------------------------------------------

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


@cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("gated,offset,clamp", CASES)
# 1320: more 16-byte vectors per row than a warp has in flight at once, and not a multiple of them
@pytest.mark.parametrize("ffn", [64, 13, 1320])
def test_cuda_vs_cpu_and_torch_cuda(dtype, act, gated, offset, clamp, ffn):
    """CUDA vs the CPU op: bitwise without a transcendental (forward, grad_a, grad_probs: same
    element functions, same sum order). With one, CUDA's exp/erf/tanh (2 ulps) and libm's (1)
    enter act(g) = g · φ(g) through φ, bounded by 1: an error of ulps of |g|, not of the result
    (gelu's 1 + erf cancels for g < 0); so the bound is 8 ulps (those 3, the formula's own
    roundings, the gate and probs products) of max(|result|, the inputs' product magnitude).
    Against torch's own CUDA ops run unfused (which round every intermediate to the dtype): our
    error against the fp64 truth is at most 2x theirs."""
    a, probs = inputs(300, ffn, dtype, gated, torch.float32)
    a = off_rounded_clamp(a, clamp)
    dy = torch.randn(300, ffn, dtype=torch.float64).to(dtype)
    h_cpu = ops.glu_probs(a, probs, act, gated, offset, clamp)
    ga_cpu, gp_cpu = OPS.glu_probs_bwd(dy, a, probs, act, gated, offset, clamp)
    ac, pc, dyc = a.cuda(), probs.cuda(), dy.cuda()
    h = ops.glu_probs(ac, pc, act, gated, offset, clamp)
    ga, gp = OPS.glu_probs_bwd(dyc, ac, pc, act, gated, offset, clamp)
    if act in NO_TRANSCENDENTAL:
        assert_equal(h.cpu(), h_cpu, "forward")
        assert_equal(ga.cpu(), ga_cpu, "grad_a")
        assert_equal(gp.cpu(), gp_cpu, "grad_probs")
    else:
        a64, p64, dy64 = a.double(), probs.double().unsqueeze(-1), dy.double().abs()
        g = a64[:, :ffn].abs()
        lin = (a64[:, ffn:] + offset).abs() if gated else torch.ones_like(g)
        h_scale = g * lin * p64                               # |g| · |linear| · p >= |h|
        ga_scale = dy64 * p64 * (1 + g) * (1 + lin)            # |φ|, |act'| <= 1.2 (+ g · φ')
        ga_scale = torch.cat([ga_scale, ga_scale], dim=1) if gated else ga_scale
        gp_scale = (dy64 * g * lin).sum(-1)                    # Σ_f |dy · h0|: the dot's terms
        assert_close_ulps(h, h_cpu, n_ulps=8, floor=h_scale, msg="forward")
        assert_close_ulps(ga, ga_cpu, n_ulps=8, floor=ga_scale, msg="grad_a")
        assert_close_ulps(gp, gp_cpu, n_ulps=8, floor=gp_scale, dtype=dtype, msg="grad_probs")
    truth = reference(a.double(), probs.double(), act, gated, offset, clamp)
    t_ga, t_gp = autograd_grads(a.double(), probs.double(), dy.double(), act, gated, offset, clamp)
    ref = reference(ac, pc, act, gated, offset, clamp, scalar=False)
    ref_ga, ref_gp = autograd_grads(ac, pc, dyc, act, gated, offset, clamp, scalar=False)
    assert_error_at_most(h, ref, truth, msg="forward vs torch CUDA")
    assert_error_at_most(ga, ref_ga, t_ga, msg="grad_a vs torch CUDA")
    assert_error_at_most(gp, ref_gp, t_gp, msg="grad_probs vs torch CUDA")


@cuda
def test_cuda_deterministic_and_zero_rows():
    a, probs = inputs(4096, 256, torch.bfloat16, True, torch.float32, device="cuda")
    dy = torch.randn(4096, 256, device="cuda").to(torch.bfloat16)
    r1 = OPS.glu_probs_bwd(dy, a, probs, "silu", True)
    r2 = OPS.glu_probs_bwd(dy, a, probs, "silu", True)
    assert torch.equal(r1[0], r2[0]) and torch.equal(r1[1], r2[1])
    z, zp = inputs(0, 8, torch.bfloat16, True, torch.float32, device="cuda")
    assert ops.glu_probs(z, zp, "silu", True).shape == (0, 8)
