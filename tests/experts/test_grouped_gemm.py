"""Grouped expert GEMM: forward, dgrad and wgrad against an fp64 per-expert
reference (tests/helpers/grouped_gemm.py), autograd, opcheck, determinism, compile, and bad input
(one test per case). The tests taking the `device` fixture also run on CUDA when a GPU is present
(more in test_grouped_gemm_cuda.py).

Accuracy rule (tests/helpers/tolerances.py): our error against the fp64 truth is at most 2x the
error of torch's own per-expert matmul in the same dtype, plus one ulp at the output scale. Outputs
are poisoned: with deterministic algorithms on, every torch.empty (including the op's own output
allocation in the binding) is filled with NaN, so a row the kernel forgets to write shows as NaN.
"""
import pytest
import torch

from helpers.grouped_gemm import offsets_of, per_expert, reference, w_e
from helpers.tolerances import assert_error_at_most
from moe_core import ops

OPS = torch.ops.moe_core
DTYPES = [torch.float32, torch.bfloat16, torch.float16]

# counts per expert: zeros and ones, counts that are no multiple of any block (MR=8, NR=32,
# MC=NC=256, KC=128), one expert holding everything (past one MC tile), no rows at all
COUNTS = {
    "uneven": [0, 1, 37, 0, 130, 9, 1, 250],
    "one_expert": [0, 0, 300, 0],
    "random": None,  # drawn in the test: randint(0, 60) with two forced zeros
    "no_rows": [0, 0, 0],
}
SIZES = {"uneven": (45, 70), "one_expert": (129, 33), "random": (64, 300), "no_rows": (16, 24)}


def make_counts(case):
    if COUNTS[case] is not None:
        return COUNTS[case]
    c = torch.randint(0, 60, (12,))
    c[3] = c[7] = 0
    return c.tolist()


def make_inputs(counts, K, N, E_weight_layout_trans, dtype):
    R, E = sum(counts), len(counts)
    x = torch.randn(R, K, dtype=torch.float64).to(dtype)
    shape = (E, N, K) if E_weight_layout_trans else (E, K, N)
    weight = (torch.randn(shape, dtype=torch.float64) / K**0.5).to(dtype)
    dy = torch.randn(R, N, dtype=torch.float64).to(dtype)
    return x, weight, dy, offsets_of(counts)


def on(device, *tensors):
    return [t.to(device) for t in tensors]


@pytest.mark.parametrize("case", list(COUNTS))
@pytest.mark.parametrize("trans_w", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_products_vs_fp64(poison, device, dtype, trans_w, case):
    counts = make_counts(case)
    K, N = SIZES[case]
    x, weight, dy, off = make_inputs(counts, K, N, trans_w, dtype)
    xd, wd, gd, od = on(device, x, weight, dy, off)
    y = ops.grouped_gemm(xd, wd, od, trans_w).cpu()
    dx = ops.grouped_gemm_dgrad(gd, wd, od, trans_w).cpu()
    dw = ops.grouped_gemm_wgrad(xd, gd, od, trans_w).cpu()
    truth = reference(x, weight, dy, off, trans_w, torch.float64)
    same = reference(x, weight, dy, off, trans_w, dtype)
    for name, ours, t, s in zip(("fwd", "dgrad", "wgrad"), (y, dx, dw), truth, same):
        assert ours.dtype == dtype and ours.shape == t.shape, (name, ours.dtype, ours.shape)
        assert not ours.isnan().any(), f"{name}: unwritten (NaN-poisoned) elements"
        if t.numel():
            assert_error_at_most(ours, s, t, factor=2.0, msg=f"{name} {dtype} trans_w={trans_w}")
    # an expert with no rows has a zero weight gradient
    for e, c in enumerate(counts):
        if c == 0:
            assert torch.equal(dw[e], torch.zeros_like(dw[e]))


@pytest.mark.parametrize("dtype,out_dtype", [(torch.bfloat16, torch.float32),
                                             (torch.float16, torch.float32),
                                             (torch.float32, torch.bfloat16)])
def test_out_dtype(poison, device, dtype, out_dtype):
    counts = [3, 0, 140, 17]
    x, weight, dy, off = make_inputs(counts, 40, 36, True, dtype)
    truth = reference(x, weight, dy, off, True, torch.float64)
    xd, wd, gd, od = on(device, x, weight, dy, off)
    outs = (ops.grouped_gemm(xd, wd, od, True, out_dtype).cpu(),
            ops.grouped_gemm_dgrad(gd, wd, od, True, out_dtype).cpu(),
            ops.grouped_gemm_wgrad(xd, gd, od, True, out_dtype).cpu())
    # fp32 accumulation rounded once to out_dtype: a few fp32 ulps of Σ|a·b| plus one out ulp
    for ours, t in zip(outs, truth):
        assert ours.dtype == out_dtype and not ours.isnan().any()
        out_eps = torch.finfo(out_dtype).eps
        bound = out_eps * t.abs() + 300 * 2.0**-23 * t.abs().max() + 1e-30
        assert ((ours.double() - t).abs() <= bound).all()


def test_generic_kernel_matches_contract(poison, tuning_env):
    """The portable kernel (used where the CPU has no AVX-512) under the same accuracy rule."""
    tuning_env("MOE_CORE_GEMM_KERNEL", "generic")
    x, weight, dy, off = make_inputs([0, 70, 1, 150], 130, 40, False, torch.bfloat16)
    truth = reference(x, weight, dy, off, False, torch.float64)
    same = reference(x, weight, dy, off, False, torch.bfloat16)
    outs = (ops.grouped_gemm(x, weight, off), ops.grouped_gemm_dgrad(dy, weight, off),
            ops.grouped_gemm_wgrad(x, dy, off))
    for ours, t, s in zip(outs, truth, same):
        assert_error_at_most(ours, s, t)


@pytest.mark.parametrize("trans_w", [False, True])
def test_gradcheck_fp64(trans_w):
    counts = [0, 3, 1, 4, 0]
    x = torch.randn(sum(counts), 4, dtype=torch.float64, requires_grad=True)
    shape = (5, 6, 4) if trans_w else (5, 4, 6)
    w = torch.randn(shape, dtype=torch.float64, requires_grad=True)
    off = offsets_of(counts)
    assert torch.autograd.gradcheck(lambda a, b: ops.grouped_gemm(a, b, off, trans_w), (x, w))


@pytest.mark.parametrize("trans_w", [False, True])
def test_backward_matches_autograd_of_reference(device, trans_w):
    """bf16: our autograd vs torch autograd through the per-expert fp32 matmul of the same values."""
    counts = [5, 0, 33, 1]
    x, weight, dy, off = make_inputs(counts, 24, 40, trans_w, torch.bfloat16)
    xd, wd, gd, od = on(device, x, weight, dy, off)
    x1, w1 = xd.clone().requires_grad_(), wd.clone().requires_grad_()
    ops.grouped_gemm(x1, w1, od, trans_w).backward(gd)
    gx1, gw1 = x1.grad.cpu(), w1.grad.cpu()
    x2, w2 = x.float().requires_grad_(), weight.float().requires_grad_()
    y2 = torch.cat(per_expert(lambda e, xe: xe @ w_e(w2, e, trans_w), off, x2))
    y2.backward(dy.float())
    assert gx1.dtype == torch.bfloat16 and gw1.dtype == torch.bfloat16
    # ours: fp32 sums rounded once to bf16; the reference: the same fp32 sums, unrounded
    for ours, ref in ((gx1, x2.grad), (gw1, w2.grad)):
        tol = 2.0**-8 * ref.abs() + 1e-5 * ref.abs().max()
        assert ((ours.float() - ref).abs() <= tol).all()
    assert torch.equal(gw1[1], torch.zeros_like(gw1[1]))  # expert 1 has no rows


def test_backward_only_what_is_needed():
    x, weight, dy, off = make_inputs([2, 3], 8, 6, False, torch.float32)
    xr = x.clone().requires_grad_()
    ops.grouped_gemm(xr, weight, off).backward(dy)
    assert xr.grad is not None and weight.grad is None
    wr = weight.clone().requires_grad_()
    ops.grouped_gemm(x, wr, off).backward(dy)
    assert wr.grad is not None and x.grad is None
    ref = reference(x, weight, dy, off, False, torch.float64)
    torch.testing.assert_close(xr.grad.double(), ref[1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(wr.grad.double(), ref[2], rtol=1e-5, atol=1e-5)


def test_grad_y_in_wider_dtype_is_cast(device):
    """out_dtype=float32 from bf16 inputs: the fp32 grad_y is cast to bf16 for the backward."""
    x, weight, dy, off = on(device, *make_inputs([4, 0, 9], 16, 12, True, torch.bfloat16))
    xr, wr = x.clone().requires_grad_(), weight.clone().requires_grad_()
    ops.grouped_gemm(xr, wr, off, True, torch.float32).backward(dy.float())
    assert xr.grad.dtype == torch.bfloat16 and wr.grad.dtype == torch.bfloat16
    assert torch.equal(xr.grad, ops.grouped_gemm_dgrad(dy, weight, off, True))
    assert torch.equal(wr.grad, ops.grouped_gemm_wgrad(x, dy, off, True))


def opcheck_samples(device="cpu"):
    x, weight, dy, off = on(device, *make_inputs([0, 5, 1, 9], 12, 10, False, torch.bfloat16))
    wt = weight.transpose(1, 2).contiguous()
    yield OPS.grouped_gemm, (x.clone().requires_grad_(), weight.clone().requires_grad_(), off)
    yield OPS.grouped_gemm, (x, wt.clone().requires_grad_(), off, True, torch.float32)
    yield OPS.grouped_gemm_dgrad, (dy, weight, off)
    yield OPS.grouped_gemm_dgrad, (dy, wt, off, True, torch.float32)
    yield OPS.grouped_gemm_wgrad, (x, dy, off)
    yield OPS.grouped_gemm_wgrad, (x, dy, off, True, torch.float32)


@pytest.mark.parametrize("i", range(6))
def test_opcheck(device, i):
    op, args = list(opcheck_samples(device))[i]
    torch.library.opcheck(op, args)


def test_deterministic_and_thread_count_invariant():
    x, weight, dy, off = make_inputs([300, 0, 211, 1], 200, 150, True, torch.bfloat16)

    def run():
        return (ops.grouped_gemm(x, weight, off, True),
                ops.grouped_gemm_dgrad(dy, weight, off, True),
                ops.grouped_gemm_wgrad(x, dy, off, True, torch.float32))

    first, second = run(), run()
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = run()
    finally:
        torch.set_num_threads(threads)
    for a, b, c in zip(first, second, single):
        assert torch.equal(a, b) and torch.equal(a, c)


@pytest.mark.parametrize("trans_w", [False, True])
def test_zero_width(device, trans_w):
    """K = 0: y is zeros (an empty sum); N = 0: dx is zeros; both: wgrad is an empty tensor."""
    off = offsets_of([2, 0, 3]).to(device)
    w = torch.randn((3, 4, 0) if trans_w else (3, 0, 4), device=device)
    y = ops.grouped_gemm(torch.randn(5, 0, device=device), w, off, trans_w)
    assert torch.equal(y, torch.zeros(5, 4, device=device))
    dx = ops.grouped_gemm_dgrad(torch.randn(5, 4, device=device), w, off, trans_w)
    assert dx.shape == (5, 0)
    w2 = torch.randn((3, 0, 6) if trans_w else (3, 6, 0), device=device)
    dx2 = ops.grouped_gemm_dgrad(torch.randn(5, 0, device=device), w2, off, trans_w)
    assert torch.equal(dx2, torch.zeros(5, 6, device=device))
    dw = ops.grouped_gemm_wgrad(torch.randn(5, 0, device=device), torch.randn(5, 4, device=device),
                                off, trans_w)
    assert dw.shape == ((3, 4, 0) if trans_w else (3, 0, 4))


def test_noncontiguous_inputs():
    x, weight, dy, off = make_inputs([3, 0, 8], 10, 6, False, torch.float32)
    xt = x.t().contiguous().t()  # same values, column-major
    wt = weight.transpose(1, 2).contiguous().transpose(1, 2)
    assert not xt.is_contiguous() and not wt.is_contiguous()
    assert torch.equal(ops.grouped_gemm(xt, wt, off), ops.grouped_gemm(x, weight, off))


def test_compile_fullgraph_forward_backward():
    torch._dynamo.reset()
    x, weight, dy, off = make_inputs([4, 0, 7, 2], 16, 8, True, torch.float32)

    def f(a, b):
        return ops.grouped_gemm(a, b, off, True).square().sum()

    x1, w1 = x.clone().requires_grad_(), weight.clone().requires_grad_()
    torch.compile(f, fullgraph=True, backend="aot_eager")(x1, w1).backward()
    x2, w2 = x.clone().requires_grad_(), weight.clone().requires_grad_()
    f(x2, w2).backward()
    assert torch.equal(x1.grad, x2.grad) and torch.equal(w1.grad, w2.grad)


# ---- bad input: one test per case; each message names the argument and the bad value ----------

X = torch.randn(6, 8)
W = torch.randn(3, 8, 5)
OFF = torch.tensor([0, 2, 2, 6])


def test_x_rank():
    with pytest.raises(ValueError, match=r"x must be 2-D, got a 3-D tensor of shape \[1, 6, 8\]"):
        ops.grouped_gemm(X[None], W, OFF)


def test_weight_rank():
    with pytest.raises(ValueError, match=r"weight must be 3-D, got a 2-D tensor of shape \[8, 5\]"):
        ops.grouped_gemm(X, W[0], OFF)


def test_x_integer_dtype():
    with pytest.raises(TypeError, match="x must be float32, float64, float16 or bfloat16, got Long"):
        ops.grouped_gemm(X.long(), W.long(), OFF)


def test_dtype_mismatch_x_weight():
    with pytest.raises(TypeError, match=r"weight must have the same dtype as x \(BFloat16\), got Float"):
        ops.grouped_gemm(X.bfloat16(), W, OFF)


def test_dtype_mismatch_wgrad():
    with pytest.raises(TypeError, match=r"grad_y must have the same dtype as x \(Float\), got Half"):
        ops.grouped_gemm_wgrad(X, torch.randn(6, 5).half(), OFF)


def test_k_mismatch():
    with pytest.raises(ValueError, match=r"weight.shape\[1\] must equal x.shape\[1\] \(in_features\) "
                                         r"\(8\), got shape \[3, 7, 5\]"):
        ops.grouped_gemm(X, torch.randn(3, 7, 5), OFF)


def test_k_mismatch_trans_w():
    with pytest.raises(ValueError, match=r"weight.shape\[2\] must equal x.shape\[1\] \(in_features\) "
                                         r"\(8\), got shape \[3, 5, 7\]"):
        ops.grouped_gemm(X, torch.randn(3, 5, 7), OFF, True)


def test_n_mismatch_dgrad():
    with pytest.raises(ValueError, match=r"weight.shape\[2\] must equal grad_y.shape\[1\] "
                                         r"\(out_features\) \(4\), got shape \[3, 8, 5\]"):
        ops.grouped_gemm_dgrad(torch.randn(6, 4), W, OFF)


def test_rows_mismatch_wgrad():
    with pytest.raises(ValueError, match=r"grad_y.shape\[0\] must equal x.shape\[0\] \(num_rows\) "
                                         r"\(6\), got shape \[5, 5\]"):
        ops.grouped_gemm_wgrad(X, torch.randn(5, 5), OFF)


def test_offsets_wrong_length():
    with pytest.raises(ValueError, match=r"expert_offsets.shape\[0\] must equal num_experts \+ 1 "
                                         r"\(4\), got shape \[3\]"):
        ops.grouped_gemm(X, W, torch.tensor([0, 2, 6]))


def test_offsets_wrong_dtype():
    with pytest.raises(TypeError, match="expert_offsets must be Long, got Int"):
        ops.grouped_gemm(X, W, OFF.int())


def test_offsets_wrong_rank():
    with pytest.raises(ValueError, match=r"expert_offsets must be 1-D, got a 2-D tensor of shape \[1, 4\]"):
        ops.grouped_gemm(X, W, OFF[None])


def test_offsets_decreasing():
    with pytest.raises(ValueError, match=r"expert_offsets must be non-decreasing, got "
                                         r"expert_offsets\[2\]=1 < expert_offsets\[1\]=3"):
        ops.grouped_gemm(X, W, torch.tensor([0, 3, 1, 6]))


def test_offsets_first_not_zero():
    with pytest.raises(ValueError, match=r"expert_offsets\[0\] must be 0, got 1"):
        ops.grouped_gemm_dgrad(torch.randn(6, 5), W, torch.tensor([1, 2, 2, 6]))


def test_offsets_last_above_rows():
    with pytest.raises(ValueError, match=r"expert_offsets\[num_experts=3\] must be <= num_rows=6, got 7"):
        ops.grouped_gemm_wgrad(X, torch.randn(6, 5), torch.tensor([0, 2, 2, 7]))


@pytest.mark.parametrize("trans_w", [False, True])
def test_rows_past_the_last_expert(device, trans_w):
    """A buffer sized by a static bound (permute with token dropping): rows past
    expert_offsets[-1] belong to no expert; fwd/dgrad give zeros there, wgrad ignores them."""
    E, K, N, rows, kept = 3, 8, 5, 12, 7
    off = torch.tensor([0, 3, 3, kept], device=device)
    x = torch.randn(rows, K, device=device)
    w = torch.randn((E, N, K) if trans_w else (E, K, N), device=device)
    dy = torch.randn(rows, N, device=device)
    y = ops.grouped_gemm(x, w, off, trans_w=trans_w)
    dx = ops.grouped_gemm_dgrad(dy, w, off, trans_w=trans_w)
    dw = ops.grouped_gemm_wgrad(x, dy, off, trans_w=trans_w)
    assert torch.equal(y[kept:], torch.zeros(rows - kept, N, device=device))
    assert torch.equal(dx[kept:], torch.zeros(rows - kept, K, device=device))
    y_ref = ops.grouped_gemm(x[:kept], w, off, trans_w=trans_w)
    assert torch.equal(y[:kept], y_ref)
    assert torch.equal(dx[:kept], ops.grouped_gemm_dgrad(dy[:kept], w, off, trans_w=trans_w))
    assert torch.equal(dw, ops.grouped_gemm_wgrad(x[:kept], dy[:kept], off, trans_w=trans_w))


def test_no_experts():
    with pytest.raises(ValueError, match=r"num_experts \(expert_offsets.shape\[0\] - 1\) must be >= 1, got 0"):
        ops.grouped_gemm_wgrad(X[:0], torch.randn(0, 5), torch.tensor([0]))


def test_out_dtype_integer():
    with pytest.raises(TypeError, match="out_dtype must be float32, float64, float16 or bfloat16, got Int"):
        ops.grouped_gemm(X, W, OFF, False, torch.int32)
