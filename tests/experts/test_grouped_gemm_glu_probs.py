"""grouped_gemm_glu_probs: fc1 with the gated activation and the router-probs
multiply, as one op. CPU tests (the CUDA ones are in test_grouped_gemm_cuda.py,
named *glu*).

Two references:
* the composition ``ops.grouped_gemm`` then ``ops.glu_probs``: the op's contract is those bits,
  forward (h and a) and backward (dx, dW, dprobs through the registered autograd), so every
  comparison with it is torch.equal-strict;
* an fp64 truth (per-expert matmul and the activation in fp64 from the same rounded inputs): our
  error is at most 2x that of torch's own unfused sequence in the same dtype
  (tests/helpers/tolerances.py).
Outputs are poisoned (deterministic algorithms fill every torch.empty with NaN), so an element the
op forgets to write shows; counts are uneven, with empty experts, one expert holding every row,
and rows past the last offset.
"""
import functools

import pytest
import torch
import torch.nn.functional as F

from helpers.grouped_gemm import offsets_of
from helpers.tolerances import assert_error_at_most
from moe_core import MoEConfig, ops
from moe_core.experts import GroupedMLP, activation_times_probs, apply_activation

OPS = torch.ops.moe_core
ACTS = list(ops.ACTIVATIONS)
DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float64]
CASES = [  # (gated, offset, clamp)
    (True, 0.0, None), (True, -0.5, None), (True, 0.3, 2.01), (False, 0.0, None)]
# counts per expert and the rows past the last offset
COUNTS = {
    "uneven": ([0, 1, 37, 0, 130, 9, 1, 50], 7),
    "one_expert": ([0, 0, 200, 0], 0),
    "tail_only": ([0, 0, 0], 5),
    "no_rows": ([0, 0], 0),
}
TORCH_ACT = {
    "silu": F.silu, "gelu": F.gelu, "gelu_tanh": functools.partial(F.gelu, approximate="tanh"),
    "relu": F.relu, "squared_relu": lambda x: torch.pow(F.relu(x), 2),
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
}


def make_inputs(counts, tail, H, F_, gated, dtype, trans_w=True, probs_dtype=torch.float32):
    R, E = sum(counts) + tail, len(counts)
    F1 = 2 * F_ if gated else F_
    x = torch.randn(R, H, dtype=torch.float64).to(dtype)
    shape = (E, F1, H) if trans_w else (E, H, F1)
    w = (torch.randn(shape, dtype=torch.float64) * (2.0 / H**0.5)).to(dtype)
    probs = None if probs_dtype is None else torch.rand(R, dtype=torch.float64).to(probs_dtype)
    return x, w, offsets_of(counts), probs


def composed(x, w, off, probs, act, gated, offset, clamp, trans_w=True):
    a = ops.grouped_gemm(x, w, off, trans_w)
    return ops.glu_probs(a, probs, act, gated, offset, clamp), a


def torch_sequence(x, w, off, probs, act, gated, offset, clamp, trans_w=True):
    """Megatron's unfused expert fc1 + activation + probs, in torch ops of x's dtype; rows past
    the last offset are a zero a (as the op's contract says)."""
    o = off.tolist()
    a = x.new_zeros(x.shape[0], w.shape[1] if trans_w else w.shape[2])
    parts = []
    for e in range(len(o) - 1):
        we = w[e].t() if trans_w else w[e]
        parts.append(x[o[e]:o[e + 1]] @ we)
    a = torch.cat(parts + [a[o[-1]:]]) if parts else a
    cfg = MoEConfig(hidden_size=8, num_moe_experts=2, moe_router_topk=2, gated_linear_unit=gated,
                    activation_func=TORCH_ACT[act], glu_linear_offset=offset,
                    activation_func_clamp_value=clamp)
    h = apply_activation(cfg, a)
    return (h if probs is None else (h * probs.unsqueeze(-1)).to(h.dtype)), a


def assert_same(ours, ref, msg):
    assert ours.dtype == ref.dtype and ours.shape == ref.shape, msg
    same = (ours == ref) | (ours.isnan() & ref.isnan())
    # bitwise, including the sign of zeros
    same &= torch.signbit(ours) == torch.signbit(ref)
    if not bool(same.all()):
        i = (~same).nonzero()[0].tolist()
        raise AssertionError(f"{msg}: {int((~same).sum())} of {ours.numel()} differ; first at "
                             f"{i}: ours {ours[tuple(i)].item()!r} ref {ref[tuple(i)].item()!r}")


# ---- forward ----------------------------------------------------------------------------------

# the activation matters in one dtype; the dtype and the counts with one activation (the op is
# the composition on the CPU by construction: this guards the wiring, not the math)
MATRIX = ([(torch.bfloat16, act, case, "uneven") for act in ACTS for case in range(len(CASES))] +
          [(dt, "gelu", case, counts) for dt in DTYPES for case in range(len(CASES))
           for counts in COUNTS])


@pytest.mark.parametrize("dtype,act,case,counts", MATRIX, ids=str)
def test_forward_equals_composition(poison, dtype, act, case, counts):
    gated, offset, clamp = CASES[case]
    case = counts
    counts, tail = COUNTS[case]
    for trans_w, pdt in ((True, torch.float32), (False, None), (True, torch.float64)):
        x, w, off, probs = make_inputs(counts, tail, 24, 20, gated, dtype, trans_w, pdt)
        h, a = ops.grouped_gemm_glu_probs(x, w, off, probs, act, gated, offset, clamp, trans_w)
        h_ref, a_ref = composed(x, w, off, probs, act, gated, offset, clamp, trans_w)
        msg = f"{act} trans_w={trans_w} probs={pdt}"
        assert_same(a, a_ref, "a " + msg)
        assert_same(h, h_ref, "h " + msg)
        assert h.shape == (x.shape[0], 20) and a.shape == (x.shape[0], 40 if gated else 20)
        kept = sum(counts)
        assert torch.equal(a[kept:], torch.zeros_like(a[kept:])), "a past the last offset"


@pytest.mark.parametrize("gated,offset,clamp", CASES)
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_forward_vs_fp64(poison, dtype, act, gated, offset, clamp):
    counts, tail = COUNTS["uneven"]
    x, w, off, probs = make_inputs(counts, tail, 64, 24, gated, dtype)
    h, a = ops.grouped_gemm_glu_probs(x, w, off, probs, act, gated, offset, clamp)
    assert not h.isnan().any() and not a.isnan().any()
    h64, a64 = torch_sequence(x.double(), w.double(), off, probs.double(), act, gated, offset,
                              clamp)
    h_t, a_t = torch_sequence(x, w, off, probs, act, gated, offset, clamp)
    assert_error_at_most(a, a_t, a64, msg=f"a {act}")
    assert_error_at_most(h, h_t, h64, msg=f"h {act}")


def test_rows_past_the_last_offset_get_glu_of_zero():
    """a = 0 there, and h = glu_probs(0) · p: -0 with a negative offset, NaN for an inf prob."""
    x, w, off, probs = make_inputs([3, 0, 2], 4, 16, 8, True, torch.bfloat16)
    probs[-1] = float("inf")
    h, a = ops.grouped_gemm_glu_probs(x, w, off, probs, "silu", True, -1.0)
    assert torch.equal(a[5:], torch.zeros_like(a[5:]))
    assert torch.signbit(h[5:8]).all() and (h[5:8] == 0).all()
    assert h[8].isnan().all()


def test_zero_rows_and_zero_hidden():
    w = torch.randn(3, 16, 8, dtype=torch.bfloat16)
    h, a = ops.grouped_gemm_glu_probs(torch.empty(0, 8, dtype=torch.bfloat16), w,
                                      offsets_of([0, 0, 0]), torch.empty(0), "silu", True)
    assert h.shape == (0, 8) and a.shape == (0, 16)
    # H = 0: a is an empty sum (zeros), h = glu_probs of zeros
    x0 = torch.empty(5, 0, dtype=torch.bfloat16)
    w0 = torch.empty(3, 16, 0, dtype=torch.bfloat16)
    h, a = ops.grouped_gemm_glu_probs(x0, w0, offsets_of([2, 0, 3]), torch.rand(5), "gelu", True,
                                      0.5)
    assert torch.equal(a, torch.zeros(5, 16, dtype=torch.bfloat16))
    assert torch.equal(h, torch.zeros(5, 8, dtype=torch.bfloat16))


# ---- backward ---------------------------------------------------------------------------------

def grads(fn, x, w, probs, dy, da=None):
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    pr = None if probs is None else probs.clone().requires_grad_()
    h, a = fn(xr, wr, pr)
    outs, gs = [h], [dy]
    if da is not None:
        outs.append(a), gs.append(da)
    torch.autograd.backward(outs, gs)
    return xr.grad, wr.grad, None if pr is None else pr.grad


@pytest.mark.parametrize("dtype,act,case,counts",
                         [m for m in MATRIX if m[0] != torch.float64 and m[3] != "no_rows"],
                         ids=str)
def test_backward_equals_composition(poison, dtype, act, case, counts):
    gated, offset, clamp = CASES[case]
    case = counts
    counts, tail = COUNTS[case]
    for trans_w in (True, False):
        x, w, off, probs = make_inputs(counts, tail, 24, 16, gated, dtype, trans_w)
        dy = torch.randn(x.shape[0], 16, dtype=torch.float64).to(dtype)
        ours = grads(lambda a, b, p: ops.grouped_gemm_glu_probs(a, b, off, p, act, gated, offset,
                                                                clamp, trans_w), x, w, probs, dy)
        ref = grads(lambda a, b, p: composed(a, b, off, p, act, gated, offset, clamp, trans_w),
                    x, w, probs, dy)
        for name, o, r in zip(("dx", "dW", "dprobs"), ours, ref):
            assert_same(o, r, f"{name} {act} trans_w={trans_w}")
        for e, c in enumerate(counts):
            if c == 0:
                assert torch.equal(ours[1][e], torch.zeros_like(ours[1][e])), "empty expert's dW"


@pytest.mark.parametrize("gated", [True, False])
def test_backward_through_a_too(gated):
    """A gradient reaching a directly adds to glu_probs' grad_a, as autograd adds them."""
    x, w, off, probs = make_inputs([4, 0, 9], 3, 16, 8, gated, torch.bfloat16)
    dy = torch.randn(x.shape[0], 8).to(torch.bfloat16)
    da = torch.randn(x.shape[0], 16 if gated else 8).to(torch.bfloat16)
    ours = grads(lambda a, b, p: ops.grouped_gemm_glu_probs(a, b, off, p, "silu", gated), x, w,
                 probs, dy, da)
    ref = grads(lambda a, b, p: composed(a, b, off, p, "silu", gated, 0.0, None), x, w, probs,
                dy, da)
    for name, o, r in zip(("dx", "dW", "dprobs"), ours, ref):
        assert_same(o, r, name)
    # only a used: h's gradient is absent (None, not zeros), probs get none
    xr = x.clone().requires_grad_()
    _, a = ops.grouped_gemm_glu_probs(xr, w, off, probs, "silu", gated)
    a.backward(da)
    assert_same(xr.grad, ops.grouped_gemm_dgrad(da, w, off, True), "dx from a alone")


@pytest.mark.parametrize("gated,offset,clamp", CASES)
@pytest.mark.parametrize("act", ["silu", "gelu", "squared_relu"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_backward_vs_fp64(dtype, act, gated, offset, clamp):
    counts, tail = COUNTS["uneven"]
    x, w, off, probs = make_inputs(counts, tail, 32, 16, gated, dtype)
    dy = torch.randn(x.shape[0], 16, dtype=torch.float64).to(dtype)
    ours = grads(lambda a, b, p: ops.grouped_gemm_glu_probs(a, b, off, p, act, gated, offset,
                                                            clamp), x, w, probs, dy)
    truth = grads(lambda a, b, p: torch_sequence(a, b, off, p, act, gated, offset, clamp),
                  x.double(), w.double(), probs.double(), dy.double())
    same = grads(lambda a, b, p: torch_sequence(a, b, off, p, act, gated, offset, clamp), x, w,
                 probs, dy)
    for name, o, t, s in zip(("dx", "dW", "dprobs"), ours, truth, same):
        assert not o.isnan().any(), name
        assert_error_at_most(o, s, t, msg=f"{name} {act}")


@pytest.mark.parametrize("gated,offset,clamp", CASES)
@pytest.mark.parametrize("act", ["silu", "gelu", "gelu_tanh", "quick_gelu"])
def test_gradcheck_fp64(act, gated, offset, clamp):
    x, w, off, probs = make_inputs([2, 0, 3], 1, 4, 3, gated, torch.float64,
                                   probs_dtype=torch.float64)
    x.requires_grad_(), w.requires_grad_(), probs.requires_grad_()
    # clamp kinks: the linear half's values stay in (-v, v) for these small inputs
    assert torch.autograd.gradcheck(
        lambda a, b, p: ops.grouped_gemm_glu_probs(a, b, off, p, act, gated, offset, clamp)[0],
        (x, w, probs))


def test_backward_only_what_is_needed():
    x, w, off, probs = make_inputs([3, 5], 0, 8, 4, True, torch.float32)
    dy = torch.randn(8, 4)
    wr = w.clone().requires_grad_()
    h, _ = ops.grouped_gemm_glu_probs(x, wr, off, probs, "silu", True)
    h.backward(dy)
    assert wr.grad is not None and x.grad is None and probs.grad is None
    pr = probs.clone().requires_grad_()
    h, _ = ops.grouped_gemm_glu_probs(x, w, off, pr, "silu", True)
    h.backward(dy)
    ref = grads(lambda a, b, p: composed(a, b, off, p, "silu", True, 0.0, None), x, w, probs, dy)
    assert_same(pr.grad, ref[2], "dprobs alone")


def test_deterministic_and_thread_count_invariant():
    x, w, off, probs = make_inputs([300, 0, 211, 1], 9, 96, 80, True, torch.bfloat16)

    def run():
        return ops.grouped_gemm_glu_probs(x, w, off, probs, "silu", True, 0.5, 7.0)

    first, second = run(), run()
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = run()
    finally:
        torch.set_num_threads(threads)
    for a, b, c in zip(first, second, single):
        assert torch.equal(a, b) and torch.equal(a, c)


# ---- registration: opcheck, compile, the layer ------------------------------------------------

def opcheck_samples():
    x, w, off, probs = make_inputs([0, 5, 1, 9], 2, 12, 8, True, torch.bfloat16)
    yield (x.clone().requires_grad_(), w.clone().requires_grad_(), off,
           probs.clone().requires_grad_(), "silu", True, 0.5, 3.0, True)
    x2, w2, off2, _ = make_inputs([4, 0, 3], 0, 8, 6, False, torch.float32, trans_w=False)
    yield (x2.requires_grad_(), w2.requires_grad_(), off2, None, "gelu", False, 0.0, None, False)


@pytest.mark.parametrize("i", range(2))
def test_opcheck(i):
    torch.library.opcheck(OPS.grouped_gemm_glu_probs, list(opcheck_samples())[i])


def test_compile_fullgraph_forward_backward():
    torch._dynamo.reset()
    x, w, off, probs = make_inputs([4, 0, 7, 2], 3, 16, 8, True, torch.float32)

    def f(a, b, p):
        h, _ = ops.grouped_gemm_glu_probs(a, b, off, p, "silu", True, 0.25)
        return h.square().sum()

    def run(fn):
        xr, wr, pr = (t.clone().requires_grad_() for t in (x, w, probs))
        fn(xr, wr, pr).backward()
        return xr.grad, wr.grad, pr.grad

    for g1, g2 in zip(run(torch.compile(f, fullgraph=True, backend="aot_eager")), run(f)):
        assert torch.equal(g1, g2)


@pytest.mark.parametrize("act,fused", [(F.silu, True), (F.gelu, True),
                                       (lambda x: x * torch.tanh(x), False)])
@pytest.mark.parametrize("gated,bias", [(True, False), (False, False), (True, True)])
def test_grouped_mlp_uses_the_fused_op(monkeypatch, act, fused, gated, bias):
    """GroupedMLP calls the fused op (fc1 + glu_probs inside ops.expert_mlp) exactly when the
    activation is one glu_probs knows and there is no fc1 bias, and its output and gradients
    equal the unfused path's bit for bit."""
    cfg = MoEConfig(hidden_size=16, num_moe_experts=4, moe_router_topk=2,
                    moe_ffn_hidden_size=8, gated_linear_unit=gated, activation_func=act,
                    glu_linear_offset=0.5 if gated else 0.0, add_bias_linear=bias,
                    params_dtype=torch.bfloat16)
    mlp = GroupedMLP(cfg)
    x = torch.randn(23, 16).to(torch.bfloat16)
    off = offsets_of([5, 0, 11, 4])
    probs = torch.rand(23)
    calls = []
    real = ops.expert_mlp
    monkeypatch.setattr(ops, "expert_mlp", lambda *a, **k: calls.append(1) or real(*a, **k))
    xr = x.clone().requires_grad_()
    y = mlp.forward_rows(xr, off, probs)
    y.float().square().sum().backward()
    assert bool(calls) == (fused and not bias)
    # the unfused path, by hand
    mlp2 = GroupedMLP(cfg)
    mlp2.load_state_dict(mlp.state_dict())
    x2 = x.clone().requires_grad_()
    a = ops.grouped_gemm(x2, mlp2.weight1, off, trans_w=True)
    if bias:
        a = a + mlp2.bias1[GroupedMLP._row_expert(off, 23)]
    h = activation_times_probs(cfg, a, probs)
    y2 = ops.grouped_gemm(h, mlp2.weight2, off, trans_w=True)
    if bias:
        y2 = y2 + (mlp2.bias2[GroupedMLP._row_expert(off, 23)] * probs.unsqueeze(-1)).to(y2.dtype)
    y2.float().square().sum().backward()
    assert_same(y, y2, "y")
    assert_same(xr.grad, x2.grad, "dx")
    assert_same(mlp.weight1.grad, mlp2.weight1.grad, "dW1")


# ---- bad input: one test per rejected case; the message names the argument --------------------

def good(**kw):
    x, w, off, probs = make_inputs([2, 0, 4], 0, 8, 4, True, torch.float32)
    args = dict(x=x, weight=w, expert_offsets=off, probs=probs, activation="silu",
                gated_linear_unit=True, linear_offset=0.0, clamp_value=None, trans_w=True)
    args.update(kw)
    return OPS.grouped_gemm_glu_probs(*args.values())


@pytest.mark.parametrize("kw,pattern", [
    (dict(x=torch.randn(6)), r"x must be 2-D"),
    (dict(x=torch.ones(6, 8, dtype=torch.int32)), r"x must be float32"),
    (dict(weight=torch.randn(8, 8)), r"weight must be 3-D"),
    (dict(weight=torch.randn(3, 8, 9)), r"weight.shape\[2\] must equal x.shape\[1\]"),
    (dict(weight=torch.randn(3, 8, 8, dtype=torch.float64)), r"weight must have the same dtype"),
    (dict(weight=torch.randn(3, 7, 8)), r"weight.shape\[1\] must be 2F"),
    (dict(weight=torch.randn(3, 0, 8), gated_linear_unit=False), r"weight.shape\[1\] must be F"),
    (dict(expert_offsets=torch.tensor([0, 2, 6])), r"expert_offsets.shape\[0\] must equal"),
    (dict(expert_offsets=torch.tensor([0, 2, 2, 6], dtype=torch.int32)),
     r"expert_offsets must be Long"),
    (dict(expert_offsets=torch.tensor([0, 4, 2, 6])), r"expert_offsets must be non-decreasing"),
    (dict(expert_offsets=torch.tensor([0, 2, 2, 7])), r"expert_offsets\[num_experts=3\]"),
    (dict(probs=torch.rand(5)), r"probs.shape\[0\] must equal x.shape\[0\]"),
    (dict(probs=torch.rand(6, 1)), r"probs must be 1-D"),
    (dict(probs=torch.ones(6, dtype=torch.int64)), r"probs must be float32"),
    (dict(activation="tanh"), r"activation must be"),
    (dict(clamp_value=-1.0), r"clamp_value must be >= 0"),
], ids=["x_1d", "x_int", "weight_2d", "k_mismatch", "weight_dtype", "odd_glu_width",
        "zero_width", "offsets_len", "offsets_dtype", "offsets_decreasing", "offsets_past_rows",
        "probs_len", "probs_2d", "probs_int", "activation", "clamp_negative"])
def test_bad_input(kw, pattern):
    with pytest.raises((ValueError, TypeError), match=pattern):
        good(**kw)
