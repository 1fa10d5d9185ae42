"""The grouped GEMMs' gathered operand (``x_index`` / ``grad_y_index``): every op reading its rows
through an index equals, bit for bit, the op on the materialised rows (``src[index]``, a -1 index
a zero row), on the CPU and on CUDA (the ``device`` fixture adds CUDA when a GPU is present).
Indices have -1 entries, repeats, source rows that no row reads, rows past expert_offsets[-1] and
an empty expert. Autograd through a gathered call equals autograd through the materialised rows,
whose rows' gradient is then summed into the source by ``permute``'s backward (the documented
semantics), bit for bit; torch.compile(fullgraph=True) equals eager; opcheck; one test per bad
input.
"""
import threading

import pytest
import torch

from helpers.grouped_gemm import offsets_of
from moe_core import ops

OPS = torch.ops.moe_core
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# an empty expert (index 1), sizes past one CPU tile (MC = NC = 256) and the 128-row CUDA tiles
COUNTS = [5, 0, 290, 33]
TAIL = 9  # rows past expert_offsets[-1]
S = 120  # source rows (fewer than the rows: repeats are certain)
SIZES = [(136, 264), (45, 70)]  # tensor-core shapes on CUDA, then no multiple of 8


def make_index(rows, num_src, device="cpu", seed=0):
    """[rows] int64: random source rows (repeats), every 7th row -1, the last source row never
    read."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, num_src - 1, (rows,), generator=g)
    idx[::7] = -1
    return idx.to(device)


def materialise(src, idx):
    """src[idx] with zero rows where idx == -1 (the rows a gathered op must read)."""
    rows = src[idx.clamp(min=0)]
    return torch.where((idx >= 0)[:, None], rows, torch.zeros((), dtype=src.dtype,
                                                              device=src.device))


def inputs(device, dtype, K, N, trans_w, seed=0):
    torch.manual_seed(seed)
    R, E = sum(COUNTS) + TAIL, len(COUNTS)
    shape = (E, N, K) if trans_w else (E, K, N)
    w = (torch.randn(shape, dtype=torch.float64) / K**0.5).to(dtype).to(device)
    xs = torch.randn(S, K, dtype=torch.float64).to(dtype).to(device)
    dys = torch.randn(S, N, dtype=torch.float64).to(dtype).to(device)
    x = torch.randn(R, K, dtype=torch.float64).to(dtype).to(device)
    dy = torch.randn(R, N, dtype=torch.float64).to(dtype).to(device)
    return xs, dys, x, dy, w, offsets_of(COUNTS, device), make_index(R, S, device, seed)


def assert_bitwise(got, want):
    assert got.dtype == want.dtype and got.shape == want.shape
    assert torch.equal(got, want), (got.double() - want.double()).abs().max()


# ---- gathered == gather then op, bit for bit ---------------------------------------------------

@pytest.mark.parametrize("K,N", SIZES)
@pytest.mark.parametrize("trans_w", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_fwd_gathers_x(poison, device, dtype, trans_w, K, N):
    xs, _, _, _, w, off, idx = inputs(device, dtype, K, N, trans_w)
    got = ops.grouped_gemm(xs, w, off, trans_w, None, idx)
    assert_bitwise(got, ops.grouped_gemm(materialise(xs, idx), w, off, trans_w))


@pytest.mark.parametrize("K,N", SIZES)
@pytest.mark.parametrize("trans_w", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_dgrad_gathers_grad_y(poison, device, dtype, trans_w, K, N):
    _, dys, _, _, w, off, idx = inputs(device, dtype, K, N, trans_w)
    got = ops.grouped_gemm_dgrad(dys, w, off, trans_w, None, idx)
    assert_bitwise(got, ops.grouped_gemm_dgrad(materialise(dys, idx), w, off, trans_w))


@pytest.mark.parametrize("K,N", SIZES)
@pytest.mark.parametrize("trans_w", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_wgrad_gathers_x(poison, device, dtype, trans_w, K, N):
    xs, _, _, dy, w, off, idx = inputs(device, dtype, K, N, trans_w)
    got = ops.grouped_gemm_wgrad(xs, dy, off, trans_w, None, x_index=idx)
    assert_bitwise(got, ops.grouped_gemm_wgrad(materialise(xs, idx), dy, off, trans_w))


@pytest.mark.parametrize("K,N", SIZES)
@pytest.mark.parametrize("trans_w", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_wgrad_gathers_grad_y(poison, device, dtype, trans_w, K, N):
    _, dys, x, _, w, off, idx = inputs(device, dtype, K, N, trans_w)
    got = ops.grouped_gemm_wgrad(x, dys, off, trans_w, None, grad_y_index=idx)
    assert_bitwise(got, ops.grouped_gemm_wgrad(x, materialise(dys, idx), off, trans_w))


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.float64])
def test_out_dtype_gathered(poison, device, out_dtype):
    xs, dys, x, dy, w, off, idx = inputs(device, torch.bfloat16, 45, 70, True)
    assert_bitwise(ops.grouped_gemm(xs, w, off, True, out_dtype, idx),
                   ops.grouped_gemm(materialise(xs, idx), w, off, True, out_dtype))
    assert_bitwise(ops.grouped_gemm_wgrad(xs, dy, off, True, out_dtype, idx),
                   ops.grouped_gemm_wgrad(materialise(xs, idx), dy, off, True, out_dtype))


def test_fp64_gathered(device):
    xs, dys, x, dy, w, off, idx = inputs(device, torch.float64, 12, 10, False)
    assert_bitwise(ops.grouped_gemm(xs, w, off, False, None, idx),
                   ops.grouped_gemm(materialise(xs, idx), w, off))
    assert_bitwise(ops.grouped_gemm_dgrad(dys, w, off, False, None, idx),
                   ops.grouped_gemm_dgrad(materialise(dys, idx), w, off))
    assert_bitwise(ops.grouped_gemm_wgrad(x, dys, off, False, None, None, idx),
                   ops.grouped_gemm_wgrad(x, materialise(dys, idx), off))


def test_every_row_minus_one_and_empty_source(poison, device):
    """An empty source: every index -1, every row zero (fwd/dgrad output zeros, wgrad zeros)."""
    w = torch.randn(4, 6, 5, device=device)
    off = offsets_of(COUNTS, device)
    idx = torch.full((sum(COUNTS),), -1, dtype=torch.long, device=device)
    src = torch.empty(0, 5, device=device)
    y = ops.grouped_gemm(src, w, off, True, None, idx)
    assert y.shape == (sum(COUNTS), 6) and torch.equal(y, torch.zeros_like(y))
    dw = ops.grouped_gemm_wgrad(src, torch.randn(sum(COUNTS), 6, device=device), off, True,
                                None, idx)
    assert torch.equal(dw, torch.zeros_like(dw))


@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
def test_glu_probs_gathers_x(poison, device, dtype, gated):
    torch.manual_seed(1)
    H, F, E = 40, 24, len(COUNTS)
    R = sum(COUNTS) + TAIL
    xs = torch.randn(S, H, device=device).to(dtype)
    w = (torch.randn(E, 2 * F if gated else F, H, device=device) / H**0.5).to(dtype)
    off, idx = offsets_of(COUNTS, device), make_index(R, S, device)
    probs = torch.rand(R, device=device)
    got = ops.grouped_gemm_glu_probs(xs, w, off, probs, "silu", gated, x_index=idx)
    want = ops.grouped_gemm_glu_probs(materialise(xs, idx), w, off, probs, "silu", gated)
    assert_bitwise(got[0], want[0])
    assert_bitwise(got[1], want[1])


# ---- autograd ----------------------------------------------------------------------------------

def reference_grads(xs, w, off, idx, trans_w, grad_y):
    """Autograd through the materialised rows; the rows' gradient summed into the source by
    permute's backward (ascending rows in fp32, one rounding)."""
    rows = materialise(xs, idx).requires_grad_()
    wr = w.clone().requires_grad_()
    ops.grouped_gemm(rows, wr, off, trans_w).backward(grad_y)
    dxs = OPS.permute_bwd(rows.grad, None, idx, off, xs.shape[0])[0]
    return dxs, wr.grad


@pytest.mark.parametrize("trans_w", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_autograd_gathered_fwd(device, dtype, trans_w):
    xs, _, _, _, w, off, idx = inputs(device, dtype, 45, 70, trans_w)
    gy = torch.randn(idx.shape[0], 70, device=device).to(dtype)
    xr, wr = xs.clone().requires_grad_(), w.clone().requires_grad_()
    ops.grouped_gemm(xr, wr, off, trans_w, None, idx).backward(gy)
    dxs, dw = reference_grads(xs, w, off, idx, trans_w, gy)
    assert_bitwise(xr.grad, dxs)
    assert_bitwise(wr.grad, dw)
    # the source row that no row reads gets zeros; a -1 row contributes to no source row
    assert torch.equal(xr.grad[S - 1], torch.zeros_like(xr.grad[S - 1]))


def test_autograd_source_grad_is_the_row_sum_in_fp32():
    """With at most two rows per source row, the fp32 sum rounded once equals torch's index
    backward in fp32 (two-term sums do not depend on the order): an independent check of the
    permute_bwd semantics."""
    torch.manual_seed(3)
    K, N = 16, 12
    xs = torch.randn(10, K, requires_grad=True)
    w = torch.randn(2, K, N, requires_grad=True)
    idx = torch.tensor([3, 0, -1, 7, 3, 9, 0, 1, -1, 2, 5, 8])
    off = torch.tensor([0, 5, 10])
    gy = torch.randn(12, N)
    ops.grouped_gemm(xs, w, off, False, None, idx).backward(gy)
    x2 = xs.detach().clone().requires_grad_()
    ops.grouped_gemm(materialise(x2, idx), w.detach(), off).backward(gy)
    assert torch.equal(xs.grad, x2.grad)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_autograd_gathered_glu_probs(device, dtype):
    torch.manual_seed(2)
    H, F, E = 40, 24, len(COUNTS)
    R = sum(COUNTS) + TAIL
    xs = torch.randn(S, H, device=device).to(dtype)
    w = (torch.randn(E, 2 * F, H, device=device) / H**0.5).to(dtype)
    off, idx = offsets_of(COUNTS, device), make_index(R, S, device)
    probs = torch.rand(R, device=device)
    gh = torch.randn(R, F, device=device).to(dtype)
    xr, wr, pr = (t.clone().requires_grad_() for t in (xs, w, probs))
    ops.grouped_gemm_glu_probs(xr, wr, off, pr, "silu", True, x_index=idx)[0].backward(gh)
    rows = materialise(xs, idx).requires_grad_()
    w2, p2 = w.clone().requires_grad_(), probs.clone().requires_grad_()
    ops.grouped_gemm_glu_probs(rows, w2, off, p2, "silu", True)[0].backward(gh)
    assert_bitwise(xr.grad, OPS.permute_bwd(rows.grad, None, idx, off, S)[0])
    assert_bitwise(wr.grad, w2.grad)
    assert_bitwise(pr.grad, p2.grad)


def test_gradcheck_gathered_fp64():
    torch.manual_seed(4)
    xs = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    w = torch.randn(2, 3, 4, dtype=torch.float64, requires_grad=True)
    idx, off = torch.tensor([4, -1, 0, 4, 2, 1, 0]), torch.tensor([0, 3, 6])
    assert torch.autograd.gradcheck(lambda a, b: ops.grouped_gemm(a, b, off, True, None, idx),
                                    (xs, w))


def test_compile_fullgraph_gathered():
    torch._dynamo.reset()
    xs, _, _, _, w, off, idx = inputs("cpu", torch.float32, 16, 8, True)

    def f(a, b):
        return ops.grouped_gemm(a, b, off, True, None, idx).square().sum()

    x1, w1 = xs.clone().requires_grad_(), w.clone().requires_grad_()
    out1 = torch.compile(f, fullgraph=True, backend="aot_eager")(x1, w1)
    out1.backward()
    x2, w2 = xs.clone().requires_grad_(), w.clone().requires_grad_()
    out2 = f(x2, w2)
    out2.backward()
    assert torch.equal(out1, out2)
    assert torch.equal(x1.grad, x2.grad) and torch.equal(w1.grad, w2.grad)


def test_compile_fullgraph_gathered_backward_kernels():
    """dgrad / wgrad with an index and glu_probs with x_index under fullgraph compile: the fake
    kernels give the right shapes."""
    torch._dynamo.reset()
    xs, dys, x, dy, w, off, idx = inputs("cpu", torch.float32, 16, 8, True)

    def f(xs, dys, x):
        a = ops.grouped_gemm_dgrad(dys, w, off, True, None, idx)
        b = ops.grouped_gemm_wgrad(xs, dy, off, True, None, idx)
        c = ops.grouped_gemm_wgrad(x, dys, off, True, None, None, idx)
        h, _ = ops.grouped_gemm_glu_probs(xs, w.transpose(1, 2).contiguous(), off, None, "relu",
                                          False, trans_w=False, x_index=idx)
        return a, b, c, h

    got = torch.compile(f, fullgraph=True, backend="aot_eager")(xs, dys, x)
    for g, e in zip(got, f(xs, dys, x)):
        assert torch.equal(g, e)


def opcheck_samples(device="cpu"):
    xs, dys, x, dy, w, off, idx = inputs(device, torch.bfloat16, 12, 10, False)
    yield OPS.grouped_gemm, (xs.clone().requires_grad_(), w.clone().requires_grad_(), off, False,
                             None, idx)
    yield OPS.grouped_gemm_dgrad, (dys, w, off, False, None, idx)
    yield OPS.grouped_gemm_wgrad, (xs, dy, off, False, None, idx, None)
    yield OPS.grouped_gemm_wgrad, (x, dys, off, True, torch.float32, None, idx)
    wg = w.transpose(1, 2).contiguous()
    yield OPS.grouped_gemm_glu_probs, (xs.clone().requires_grad_(), wg.clone().requires_grad_(),
                                       off, None, "silu", True, 0.0, None, True, idx)


@pytest.mark.parametrize("i", range(5))
def test_opcheck_gathered(device, i):
    op, args = list(opcheck_samples(device))[i]
    torch.library.opcheck(op, args)


# ---- bad input: one test per case --------------------------------------------------------------

XS = torch.randn(6, 8)
W = torch.randn(3, 8, 5)
OFF = torch.tensor([0, 2, 2, 4])
IDX = torch.tensor([0, 5, -1, 3])


def test_dgrad_has_no_x_index():
    """dgrad gathers grad_y only: the op takes no x_index."""
    with pytest.raises(TypeError, match="x_index"):
        ops.grouped_gemm_dgrad(torch.randn(6, 5), W, OFF, x_index=IDX)


def test_fwd_has_no_grad_y_index():
    with pytest.raises(TypeError, match="grad_y_index"):
        ops.grouped_gemm(XS, W, OFF, grad_y_index=IDX)


def test_index_wrong_dtype():
    with pytest.raises(TypeError, match="x_index must be Long, got Int"):
        ops.grouped_gemm(XS, W, OFF, x_index=IDX.int())


def test_index_wrong_rank():
    with pytest.raises(ValueError,
                       match=r"x_index must be 1-D, got a 2-D tensor of shape \[1, 4\]"):
        ops.grouped_gemm(XS, W, OFF, x_index=IDX[None])


def test_index_not_contiguous():
    with pytest.raises(ValueError, match=r"x_index must be contiguous, got strides \[2\]"):
        ops.grouped_gemm(XS, W, OFF, x_index=torch.tensor([0, 9, 5, 9, -1, 9, 3, 9])[::2])


def test_index_on_meta_device():
    with pytest.raises(ValueError, match="x_index is on meta but x is on cpu"):
        ops.grouped_gemm(XS, W, OFF, x_index=IDX.to("meta"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_index_on_other_device():
    with pytest.raises(ValueError, match="x_index is on cuda:0 but x is on cpu"):
        ops.grouped_gemm(XS, W, OFF, x_index=IDX.cuda())


def test_index_value_too_large():
    with pytest.raises(ValueError, match=r"gather_index\[1\] = 6 is outside \[-1, gather_rows=6\)"):
        ops.grouped_gemm(XS, W, OFF, x_index=torch.tensor([0, 6, -1, 3]))


def test_index_value_below_minus_one():
    with pytest.raises(ValueError,
                       match=r"gather_index\[3\] = -2 is outside \[-1, gather_rows=6\)"):
        ops.grouped_gemm_dgrad(torch.randn(6, 5), W, OFF, grad_y_index=torch.tensor([0, 1, 2, -2]))


def test_index_shorter_than_expert_offsets():
    with pytest.raises(ValueError,
                       match=r"expert_offsets\[num_experts=3\] must be <= num_rows=3, got 4"):
        ops.grouped_gemm(XS, W, OFF, x_index=IDX[:3])


def test_source_columns_mismatch():
    with pytest.raises(ValueError,
                       match=r"weight.shape\[1\] must equal x.shape\[1\] \(in_features\)"):
        ops.grouped_gemm(torch.randn(6, 7), W, OFF, x_index=IDX)


def test_wgrad_both_indices():
    with pytest.raises(ValueError, match="pass x_index or grad_y_index, not both"):
        ops.grouped_gemm_wgrad(XS, torch.randn(6, 5), OFF, False, None, IDX, IDX)


def test_wgrad_rows_mismatch_gathered():
    with pytest.raises(ValueError,
                       match=r"grad_y.shape\[0\] must equal x_index.shape\[0\] \(num_rows\) \(4\)"):
        ops.grouped_gemm_wgrad(XS, torch.randn(6, 5), OFF, False, None, IDX)


def test_glu_probs_probs_rows_follow_the_index():
    w = torch.randn(3, 10, 8)
    with pytest.raises(ValueError, match=r"probs.shape\[0\] must equal x_index.shape\[0\]"):
        ops.grouped_gemm_glu_probs(XS, w, OFF, torch.rand(6), "silu", True, x_index=IDX)


# ---- the Hopper kernels' own gathered loads, under every tuning switch --------------------------
HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


@pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU (the sm90 kernels read the index)")
@pytest.mark.parametrize("tile", ["128", "256"])
@pytest.mark.parametrize("switch", [None, ("MOE_GG_SM90_SPLIT_TAIL", "1"),
                                    ("MOE_GG_SM90_EXPERT_MAPS", "0"),
                                    ("MOE_GG_SM90_WGRAD_BK", "64"), ("MOE_GG_SM90_WGRAD_BK", "32")],
                         ids=["default", "split", "no-maps", "bk64", "bk32"])
@pytest.mark.parametrize("trans_w", [False, True])
def test_sm90_gathered_loads(tuning_env, tile, switch, trans_w):
    """The sm90 kernels copy a gathered operand's rows themselves (cp.async into the swizzled
    stages): bitwise the same kernel on the materialised rows, for fwd, dgrad and both wgrad
    operands, with -1 rows, repeated rows, rows past expert_offsets[E], experts of 0 to several
    hundred rows (several M tiles, reductions with tails), a split last wave, the whole-buffer
    wgrad maps and both wgrad stage depths."""
    tuning_env("MOE_GG_SM90_TILE", tile)
    if switch is not None:
        tuning_env(*switch)
    counts = [5, 0, 700, 129, 256, 1]
    g = torch.Generator().manual_seed(0)
    R, S, K, N, E = sum(counts) + 13, 900, 264, 136, len(counts)
    dev, dt = "cuda", torch.bfloat16
    idx = torch.randint(0, S, (R,), generator=g)
    idx[::5] = -1
    idx = idx.to(dev)
    off = offsets_of(counts, dev)
    w = (torch.randn((E, N, K) if trans_w else (E, K, N), generator=g) / K**0.5).to(dt).to(dev)
    xs = torch.randn(S, K, generator=g).to(dt).to(dev)
    dys = torch.randn(S, N, generator=g).to(dt).to(dev)
    x = torch.randn(R, K, generator=g).to(dt).to(dev)
    dy = torch.randn(R, N, generator=g).to(dt).to(dev)
    assert_bitwise(ops.grouped_gemm(xs, w, off, trans_w, None, idx),
                   ops.grouped_gemm(materialise(xs, idx), w, off, trans_w))
    assert_bitwise(ops.grouped_gemm_dgrad(dys, w, off, trans_w, None, idx),
                   ops.grouped_gemm_dgrad(materialise(dys, idx), w, off, trans_w))
    assert_bitwise(ops.grouped_gemm_wgrad(xs, dy, off, trans_w, None, x_index=idx),
                   ops.grouped_gemm_wgrad(materialise(xs, idx), dy, off, trans_w))
    assert_bitwise(ops.grouped_gemm_wgrad(x, dys, off, trans_w, None, grad_y_index=idx),
                   ops.grouped_gemm_wgrad(x, materialise(dys, idx), off, trans_w))


@pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU (the sm90 kernels read the index)")
def test_sm90_gathered_needs_no_row_copy():
    """On Hopper a gathered call's workspace has no room for a copy of the rows (the kernel
    reads them by index): the call allocates what the plain call on materialised rows does
    besides its output (the workspace), not a [rows, K] copy more."""
    R, S, K, N, E = 4096, 512, 1024, 512, 8
    dev, dt = "cuda", torch.bfloat16
    idx = torch.randint(0, S, (R,), device=dev)
    off = offsets_of([R // E] * E, dev)
    w = torch.randn(E, N, K, device=dev).to(dt)
    xs = torch.randn(S, K, device=dev).to(dt)
    rows = xs[idx]

    def extra(call) -> int:
        call()  # warm-up
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        y = call()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base - y.numel() * y.element_size()

    gathered = extra(lambda: ops.grouped_gemm(xs, w, off, True, None, idx))
    plain = extra(lambda: ops.grouped_gemm(rows, w, off, True))
    assert gathered < plain + R * K * 2 // 4, (gathered, plain)


PRODUCTS = ["fwd", "fwd_plain", "dgrad", "wgrad_x", "wgrad_grad_y"]


def products(device, R, S, K, N, E):
    """Inputs of every product, bf16: the four gathered ones and the plain forward. Returns
    call(op, t): the product `op` (one of PRODUCTS) with every tensor operand passed through t."""
    dt = torch.bfloat16
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, S, (R,), generator=g).to(device)
    off = offsets_of([R // E] * E, device)
    w = (torch.randn(E, N, K, generator=g) / K**0.5).to(dt).to(device)
    src_k = torch.randn(S, K, generator=g).to(dt).to(device)
    src_n = torch.randn(S, N, generator=g).to(dt).to(device)
    rows_k = torch.randn(R, K, generator=g).to(dt).to(device)
    rows_n = torch.randn(R, N, generator=g).to(dt).to(device)

    def call(op, t=lambda x: x):
        return {
            "fwd": lambda: ops.grouped_gemm(t(src_k), t(w), off, True, None, idx),
            "fwd_plain": lambda: ops.grouped_gemm(t(rows_k), t(w), off, True),
            "dgrad": lambda: ops.grouped_gemm_dgrad(t(src_n), t(w), off, True, None, idx),
            "wgrad_x": lambda: ops.grouped_gemm_wgrad(t(src_k), t(rows_n), off, True, None,
                                                      x_index=idx),
            "wgrad_grad_y": lambda: ops.grouped_gemm_wgrad(t(rows_k), t(src_n), off, True, None,
                                                           grad_y_index=idx),
        }[op]()

    return call


@pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU (the sm90 kernels read the index)")
@pytest.mark.parametrize("op", PRODUCTS)
def test_sm90_as_a_threads_first_cuda_work(op):
    """A thread whose first CUDA work is a grouped GEMM (autograd's device thread when a backward
    starts at the experts) has no current context until the runtime makes one current, and the
    Hopper kernels' tensor maps are made by a driver call that needs one. Such a call must run
    the Hopper kernel as on a thread that launched before (a gathered call's workspace has no
    room for the fallback's row copy; a plain one would run the portable kernel): the same bits
    as on this thread."""
    call = products("cuda", 2048, 512, 256, 128, 4)
    want = call(op)
    torch.cuda.synchronize()
    box = {}

    def first_cuda_work():
        try:
            box["got"] = call(op)
            torch.cuda.synchronize()
        except Exception as e:  # reported below, on this thread
            box["error"] = e

    t = threading.Thread(target=first_cuda_work)
    t.start()
    t.join(timeout=60)
    assert not t.is_alive(), "the call on the fresh thread did not return"
    assert "error" not in box, box.get("error")
    assert_bitwise(box["got"], want)


def _at_odd_offset(t: torch.Tensor) -> torch.Tensor:
    """The same values in a view that starts one element into its storage (2 bytes for bf16:
    never 16-byte aligned)."""
    flat = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
    view = flat[1:].view(t.shape)
    view.copy_(t)
    assert view.data_ptr() % 16
    return view


@pytest.mark.parametrize("op", PRODUCTS)
def test_misaligned_operands(device, op):
    """Operands that start at an odd element (views into a larger buffer) give the same bits as
    the same values at aligned addresses, gathered or not: the Hopper kernels need aligned
    bases, and a gathered call has no workspace for the fallback's row copy, so the binding
    copies such an operand first."""
    call = products(device, 512, 200, 64, 32, 4)
    assert_bitwise(call(op, _at_odd_offset), call(op))
