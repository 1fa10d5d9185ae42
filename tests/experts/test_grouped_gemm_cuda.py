"""Grouped expert GEMM on CUDA: the three products against an fp64 truth for every
operand dtype, both weight layouts, uneven counts (zeros, ones, one expert holding everything,
counts no multiple of any tile, rows past the last offset), K/N on and off the tensor-core path
(multiples of 8 or not, misaligned pointers), every out_dtype, bitwise equality with the CPU
where every sum is exact, determinism, CUDA-graph capture of forward and backward, and many
experts.

Accuracy rule (tests/helpers/tolerances.py): our error against the fp64 truth is at most 2x the
error of torch's own per-expert CUDA matmul in the same dtype, plus one ulp at the output scale.
Poisoning: deterministic algorithms make every torch.empty (the op's own output allocation in
the binding included) fill with NaN, so an element the kernel forgets to write shows as NaN;
torch's cuBLAS references run outside that mode (cuBLAS refuses it without a workspace config).
"""
import pytest
import torch

from helpers.grouped_gemm import capture_graph, offsets_of, poisoned
from helpers.tolerances import assert_error_at_most
from moe_core import ops

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float64]
# counts per expert; every case also gets TAIL rows past the last offset
COUNTS = {
    "uneven": [0, 1, 37, 0, 130, 9, 1, 250],
    "one_expert": [0, 0, 700, 0],
    "ones": [1] * 9,
    "random": None,  # drawn in the test: 12 experts, randint(0, 300), two forced zeros
}
TAIL = 19
# (K, N): multiples of 8 with tails past the 128 x 128 x 64 tiles (tensor cores for bf16/fp16),
# and sizes that are no multiple of 8 (the SIMT path for every dtype)
SIZES = {"aligned": (136, 264), "unaligned": (45, 70)}


def is_hopper():
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


def make_counts(case):
    if COUNTS[case] is not None:
        return COUNTS[case]
    c = torch.randint(0, 300, (12,))
    c[3] = c[7] = 0
    return c.tolist()


def make_inputs(counts, K, N, trans_w, dtype, tail=TAIL, device="cuda"):
    R, E = sum(counts) + tail, len(counts)
    x = torch.randn(R, K, dtype=torch.float64).to(dtype)
    w = (torch.randn((E, N, K) if trans_w else (E, K, N), dtype=torch.float64) / K**0.5).to(dtype)
    dy = torch.randn(R, N, dtype=torch.float64).to(dtype)
    return x.to(device), w.to(device), dy.to(device), offsets_of(counts, device)


def w_e(weight, e, trans_w):
    return weight[e].t() if trans_w else weight[e]


def reference(x, weight, dy, off, trans_w, dtype):
    """fwd, dgrad, wgrad by per-expert matmul in `dtype` on x's device; zeros past the last offset."""
    x, weight, dy = x.to(dtype), weight.to(dtype), dy.to(dtype)
    o = off.tolist()
    y = x.new_zeros(x.shape[0], weight.shape[1] if trans_w else weight.shape[2])
    dx = x.new_zeros(x.shape)
    dw = torch.zeros_like(weight)
    for e in range(len(o) - 1):
        xe, ge, we = x[o[e]:o[e + 1]], dy[o[e]:o[e + 1]], w_e(weight, e, trans_w)
        y[o[e]:o[e + 1]] = xe @ we
        dx[o[e]:o[e + 1]] = ge @ we.t()
        dw[e] = (ge.t() @ xe) if trans_w else (xe.t() @ ge)
    return y, dx, dw


def run_ours(x, w, dy, off, trans_w, out_dtype=None):
    with poisoned():
        return (ops.grouped_gemm(x, w, off, trans_w, out_dtype),
                ops.grouped_gemm_dgrad(dy, w, off, trans_w, out_dtype),
                ops.grouped_gemm_wgrad(x, dy, off, trans_w, out_dtype))


def check_structure(outs, counts, kept):
    y, dx, dw = outs
    for name, t in zip(("fwd", "dgrad", "wgrad"), outs):
        assert not t.isnan().any(), f"{name}: unwritten (NaN-poisoned) elements"
    assert torch.equal(y[kept:], torch.zeros_like(y[kept:])), "fwd: rows past the offsets"
    assert torch.equal(dx[kept:], torch.zeros_like(dx[kept:])), "dgrad: rows past the offsets"
    for e, c in enumerate(counts):
        if c == 0:
            assert torch.equal(dw[e], torch.zeros_like(dw[e])), f"wgrad: empty expert {e}"


def check_bf16_vs_fp64(counts, K, N, trans_w, place=lambda name, t: t):
    """The three bf16 products over `counts`: every row written, within the fp64 rule.
    place(name, tensor) gives what the op is called with for "x", "weight" and "grad_y" (the
    same values elsewhere in memory, say); the references use the originals."""
    x, w, dy, off = make_inputs(counts, K, N, trans_w, torch.bfloat16)
    outs = run_ours(place("x", x), place("weight", w), place("grad_y", dy), off, trans_w)
    check_structure(outs, counts, sum(counts))
    truth = reference(x.cpu(), w.cpu(), dy.cpu(), off.cpu(), trans_w, torch.float64)
    same = reference(x, w, dy, off, trans_w, torch.bfloat16)
    for ours, t, s in zip(outs, truth, same):
        assert_error_at_most(ours, s, t)


@pytest.mark.parametrize("size", list(SIZES))
@pytest.mark.parametrize("case", list(COUNTS))
@pytest.mark.parametrize("trans_w", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_products_vs_fp64(dtype, trans_w, case, size):
    counts = make_counts(case)
    K, N = SIZES[size]
    x, w, dy, off = make_inputs(counts, K, N, trans_w, dtype)
    outs = run_ours(x, w, dy, off, trans_w)
    check_structure(outs, counts, sum(counts))
    xc, wc, gc, oc = x.cpu(), w.cpu(), dy.cpu(), off.cpu()
    truth = reference(xc, wc, gc, oc, trans_w, torch.float64)
    for name, ours, t in zip(("fwd", "dgrad", "wgrad"), outs, truth):
        assert ours.dtype == dtype and ours.shape == t.shape and ours.is_cuda, name
    if dtype == torch.float64:
        # torch's fp64 GEMM is as exact as the "truth" (often bitwise the same), so the rule
        # "2x torch's error" has nothing to scale; bound both fp64 sums instead:
        # |ours - truth| <= 2 · n · 2^-53 · Σ|a·b|, with a 2x margin
        mags = reference(xc.abs(), wc.abs(), gc.abs(), oc, trans_w, torch.float64)
        for name, ours, t, m, n in zip(("fwd", "dgrad", "wgrad"), outs, truth, mags,
                                       (K, N, max(counts))):
            err = (ours.cpu() - t).abs()
            assert (err <= 2 * n * 2.0**-52 * m).all(), f"{name}: fp64 error {err.max():.3e}"
        return
    same = reference(x, w, dy, off, trans_w, dtype)
    for name, ours, t, s in zip(("fwd", "dgrad", "wgrad"), outs, truth, same):
        assert_error_at_most(ours, s, t, factor=2.0,
                             msg=f"{name} {dtype} trans_w={trans_w} {case} {size}")


@pytest.mark.parametrize("size", list(SIZES))
@pytest.mark.parametrize("out_dtype", DTYPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_every_out_dtype(dtype, out_dtype, size):
    """fp32 (fp64) accumulation rounded once: |ours - t| <= out_eps·|s| + tiny + |s - t| with the
    sum s within K·eps_acc·Σ|a·b| of the truth t (a bound for any summation order), tiny the
    absolute rounding error among subnormals."""
    counts = [3, 0, 140, 17, 200]
    K, N = SIZES[size]
    x, w, dy, off = make_inputs(counts, K, N, True, dtype)
    outs = run_ours(x, w, dy, off, True, out_dtype)
    check_structure(outs, counts, sum(counts))
    xc, wc, gc, oc = x.cpu().double(), w.cpu().double(), dy.cpu().double(), off.cpu()
    truth = reference(xc, wc, gc, oc, True, torch.float64)
    mags = reference(xc.abs(), wc.abs(), gc.abs(), oc, True, torch.float64)
    # 2^-23 for fp32: tensor cores may truncate, not round, while accumulating (<= 2 units)
    acc_eps = 2.0**-52 if dtype == torch.float64 else 2.0**-23
    out_eps = {torch.float64: 2.0**-53, torch.float32: 2.0**-24, torch.float16: 2.0**-11,
               torch.bfloat16: 2.0**-8}[out_dtype]
    # half the smallest subnormal step: the absolute error of rounding near zero
    out_tiny = {torch.float64: 2.0**-1075, torch.float32: 2.0**-150, torch.float16: 2.0**-25,
                torch.bfloat16: 2.0**-134}[out_dtype]
    for name, ours, t, s, red in zip(("fwd", "dgrad", "wgrad"), outs, truth, mags,
                                     (K, N, max(counts))):
        assert ours.dtype == out_dtype, name
        sum_err = 1.01 * red * acc_eps * s
        bound = out_eps * (t.abs() + sum_err) + sum_err + out_tiny
        err = (ours.cpu().double() - t).abs()
        assert (err <= bound).all(), f"{name}: max excess {(err - bound).max().item():.3e}"


@pytest.mark.parametrize("trans_w", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("size", list(SIZES))
def test_bitwise_equal_to_cpu_on_exact_sums(size, dtype, trans_w):
    """Small integers: every product and partial sum is exact in fp32, so any summation order
    gives the same value and CPU and CUDA must agree bit for bit (indexing and layout, exactly)."""
    counts = [0, 5, 130, 1, 0, 77]
    K, N = SIZES[size]
    R, E = sum(counts) + TAIL, len(counts)
    x = torch.randint(-3, 4, (R, K)).to(dtype)
    w = torch.randint(-3, 4, (E, N, K) if trans_w else (E, K, N)).to(dtype)
    dy = torch.randint(-3, 4, (R, N)).to(dtype)
    off = offsets_of(counts, "cpu")
    cpu = (ops.grouped_gemm(x, w, off, trans_w), ops.grouped_gemm_dgrad(dy, w, off, trans_w),
           ops.grouped_gemm_wgrad(x, dy, off, trans_w))
    gpu = run_ours(x.cuda(), w.cuda(), dy.cuda(), off.cuda(), trans_w)
    for name, c, g in zip(("fwd", "dgrad", "wgrad"), cpu, gpu):
        assert torch.equal(c, g.cpu()), f"{name}: CPU and CUDA differ"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_deterministic(dtype):
    counts = [300, 0, 1211, 1, 513]
    x, w, dy, off = make_inputs(counts, 512, 384, True, dtype)
    first, second = run_ours(x, w, dy, off, True), run_ours(x, w, dy, off, True)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


@pytest.mark.parametrize("which", ["x", "weight", "grad_y"])
def test_misaligned_pointers_take_the_general_path(which):
    """A contiguous view one element into its storage is not 16-byte aligned: same results as
    the aligned copy within the accuracy rule, nothing unwritten."""

    def shifted(name, t):
        if name != which:
            return t
        buf = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
        v = buf[1:].view(t.shape)
        v.copy_(t)
        assert v.is_contiguous() and v.data_ptr() % 16 != 0
        return v

    check_bf16_vs_fp64([0, 40, 1, 90], 64, 48, False, place=shifted)


def test_many_experts():
    """More experts than the tile scan's threads (1024): most empty, a few with rows."""
    E = 1500
    counts = [0] * E
    for e, c in ((0, 3), (700, 129), (1023, 1), (1024, 2), (1499, 64)):
        counts[e] = c
    check_bf16_vs_fp64(counts, 16, 24, False)


@pytest.mark.parametrize("trans_w", [False, True])
def test_raster_remainder_groups(trans_w):
    """Experts of more than 16 M tiles of 128 rows, where Hopper's raster groups of 16 M tiles
    leave a remainder: 17 (one tile, folded into the last group), 22 (6, folded), 25 (9, a
    group of its own), 33 (1, folded after a whole group) and exactly 16; with trans_w, wgrad's
    18 output row tiles (N = 2184) leave 2. Every tile is written (NaN poisoning shows a missed
    one), within the fp64 rule."""
    check_bf16_vs_fp64([2049, 0, 2800, 3100, 4161, 2048], 72, 2184, trans_w)


@pytest.mark.parametrize("tile", ["128", "256"])
@pytest.mark.parametrize("trans_w", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_wgrad_both_stage_depths(tuning_env, dtype, trans_w, tile):
    """Hopper's wgrad loads the reduction (the expert's rows) in stages of 32 rows when experts
    average <= 256 rows, else 64 (MOE_GG_SM90_WGRAD_BK forces either). Counts with tails of
    every kind against both depths: within the fp64 rule, and the same values from both (the same
    k16 steps in the same order; the extra steps of zeroed tail rows add nothing)."""
    tuning_env("MOE_GG_SM90_TILE", tile)
    counts = [0, 1, 31, 33, 64, 95, 600, 257, 0, 129]
    x, w, dy, off = make_inputs(counts, 136, 264, trans_w, dtype)
    dws = {}
    for bk in ("32", "64"):
        tuning_env("MOE_GG_SM90_WGRAD_BK", bk)
        with poisoned():
            dws[bk] = ops.grouped_gemm_wgrad(x, dy, off, trans_w)
        assert not dws[bk].isnan().any(), f"bk={bk}: unwritten (NaN-poisoned) elements"
        for e, c in enumerate(counts):
            if c == 0:
                assert torch.equal(dws[bk][e], torch.zeros_like(dws[bk][e])), f"bk={bk} e={e}"
    truth = reference(x.cpu(), w.cpu(), dy.cpu(), off.cpu(), trans_w, torch.float64)[2]
    same = reference(x, w, dy, off, trans_w, dtype)[2]
    for bk, dw in dws.items():
        assert_error_at_most(dw, same, truth, factor=2.0, msg=f"wgrad bk={bk} {dtype} {tile}")
    assert torch.equal(dws["32"], dws["64"])


@pytest.mark.skipif(not is_hopper(), reason="the expert maps are the sm_90a kernel's")
@pytest.mark.parametrize("tile", ["128", "256"])
@pytest.mark.parametrize("bk", ["32", "64"])
@pytest.mark.parametrize("trans_w", [False, True])
def test_wgrad_expert_maps(tuning_env, trans_w, bk, tile):
    """Hopper's wgrad loads each expert's rows through tensor maps of its own, built on the device
    from expert_offsets, so the copy engine zero-fills the reduction's last block past the
    expert's end; MOE_GG_SM90_EXPERT_MAPS=0 loads through whole-buffer maps and zeroes those rows
    in shared memory. NaN sits right past experts' ends (the rows past the last offset, and the
    first row of expert 6, whose own dW is then NaN): every other expert's dW is finite and
    within the fp64 rule, and the two ways give the same bits."""
    tuning_env("MOE_GG_SM90_TILE", tile)
    tuning_env("MOE_GG_SM90_WGRAD_BK", bk)
    counts = [0, 1, 31, 33, 64, 95, 600, 257, 0, 129]
    x, w, dy, off = make_inputs(counts, 136, 264, trans_w, torch.bfloat16)
    kept, first6 = sum(counts), sum(counts[:6])
    x[kept:], dy[kept:], x[first6] = float("nan"), float("nan"), float("nan")
    dws = {}
    for maps in ("1", "0"):
        tuning_env("MOE_GG_SM90_EXPERT_MAPS", maps)
        with poisoned():
            dws[maps] = ops.grouped_gemm_wgrad(x, dy, off, trans_w)
    torch.testing.assert_close(dws["1"], dws["0"], rtol=0, atol=0, equal_nan=True)
    dw = dws["1"]
    assert dw[6].isnan().all(), "expert 6: its NaN row must reach its dW"
    rest = [e for e in range(len(counts)) if e != 6]
    assert not dw[rest].isnan().any(), "a neighbour's NaN leaked into another expert's dW"
    truth = reference(x.cpu(), w.cpu(), dy.cpu(), off.cpu(), trans_w, torch.float64)[2]
    same = reference(x, w, dy, off, trans_w, torch.bfloat16)[2]
    for e, c in enumerate(counts):
        if c == 0:
            assert torch.equal(dw[e], torch.zeros_like(dw[e])), f"empty expert {e}"
    assert_error_at_most(dw[rest], same[rest], truth[rest], msg=f"wgrad maps bk={bk} {tile}")


def check_graph_replays(draw, first, others, trans_w):
    """Capture forward and backward once on draw(first) (inputs, weight, dy, offsets); replay each
    of `others` copied into the static buffers: equal to eager, bit for bit, and rows past the
    last offset zero."""
    sx, sw, sdy, soff = draw(first)
    sx.requires_grad_(), sw.requires_grad_()

    def step():
        y = ops.grouped_gemm(sx, sw, soff, trans_w)
        return (y,) + torch.autograd.grad(y, (sx, sw), sdy)

    graph, static_out = capture_graph(step)
    for counts in others:
        x, w, dy, off = draw(counts)
        with torch.no_grad():
            sx.copy_(x), sw.copy_(w), sdy.copy_(dy), soff.copy_(off)
        graph.replay()
        xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = ops.grouped_gemm(xr, wr, off, trans_w)
        eager = (y,) + torch.autograd.grad(y, (xr, wr), dy)
        torch.cuda.synchronize()
        for name, g, e in zip(("y", "dx", "dw"), static_out, eager):
            assert torch.equal(g, e), f"{name}: replay differs from eager, counts {counts}"
        kept = sum(counts)
        assert torch.equal(static_out[0][kept:], torch.zeros_like(static_out[0][kept:]))


# ---- the split last wave (Hopper, fwd/dgrad) -------------------------------------------------
# When the tiles leave a partial last wave of r <= G / 2 tiles (G = the SMs), the sm_90a kernel
# cuts each of them along k into G / r segments (at most 16) run by otherwise idle CTAs; the last
# segment to finish sums the partials in k order. MOE_GG_SM90_SPLIT_TAIL=1 splits at every
# reduction length (segments down to one k block), 0 never; by default reductions of 64 k blocks
# or more, in segments of 16 or more.


def sms():
    return torch.cuda.get_device_properties(0).multi_processor_count


def tail_counts(m_tiles):
    """Rows per expert making m_tiles 128-row tiles in all: uneven tails, empty experts, ones."""
    per = [0, 1, 3, 0, 5, 2]
    per[2] += m_tiles - sum(per)
    tails = [0, 127, 1, 0, 64, 0]  # rows short of each expert's last full tile
    return [0 if t == 0 else max(1, 128 * t - r) for t, r in zip(per, tails)]


SK_WAVES = {  # name: M tiles of 128 rows, as a function of G (n tiles: 2 of 256 columns)
    "one_wave_and_2": lambda g: g // 2 + 1,        # total G + 2: 2 tiles in 8 segments
    "one_and_a_half": lambda g: g // 2 + g // 4,   # total 1.5 G: G / 2 tiles in 2 segments
    "two_waves_and_6": lambda g: g + 3,            # total 2 G + 6
    "half_a_wave": lambda g: g // 4,               # total G / 2: no full wave
}


@pytest.mark.skipif(not is_hopper(), reason="the split last wave is the sm_90a kernel's")
@pytest.mark.parametrize("waves", list(SK_WAVES))
@pytest.mark.parametrize("trans_w", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_split_tail(tuning_env, dtype, trans_w, waves):
    """fwd and dgrad with the last wave split: within the fp64 rule, rows past the last offset
    zero, bitwise equal over repeated calls (the order the segments finish in varies), and
    different bits from the unsplit kernel somewhere (the split did happen)."""
    tuning_env("MOE_GG_SM90_TILE", "256")
    counts = tail_counts(SK_WAVES[waves](sms()))
    x, w, dy, off = make_inputs(counts, 512, 512, trans_w, dtype)
    tuning_env("MOE_GG_SM90_SPLIT_TAIL", "0")
    plain = run_ours(x, w, dy, off, trans_w)[:2]  # fwd, dgrad (wgrad is never split)
    tuning_env("MOE_GG_SM90_SPLIT_TAIL", "1")
    split = run_ours(x, w, dy, off, trans_w)[:2]
    truth = reference(x.cpu(), w.cpu(), dy.cpu(), off.cpu(), trans_w, torch.float64)
    same = reference(x, w, dy, off, trans_w, dtype)
    kept = sum(counts)
    for name, o, p, t, sm in zip(("y", "dx"), split, plain, truth, same):
        assert not o.isnan().any(), f"{name}: unwritten (NaN-poisoned) elements"
        assert torch.equal(o[kept:], torch.zeros_like(o[kept:])), f"{name}: rows past the end"
        assert_error_at_most(o, sm, t, msg=f"{name} split {waves}")
        assert not torch.equal(o, p), f"{name}: the same bits as the unsplit kernel"
    for _ in range(3):
        for name, o, again in zip(("y", "dx"), split, run_ours(x, w, dy, off, trans_w)):
            assert torch.equal(o, again), f"{name}: a second call differs"


@pytest.mark.skipif(not is_hopper(), reason="the split last wave is the sm_90a kernel's")
def test_split_tail_default_threshold(tuning_env):
    """Unset, the last wave is split for reductions of 64 k blocks or more, in segments of 16 or
    more: fwd over K = 4096 (64 k blocks) splits its last wave of 2 tiles into 4 segments of 16
    (=1: 16 segments of 4); dgrad over N = 512 (8 k blocks) is not split."""
    tuning_env("MOE_GG_SM90_TILE", "256")
    counts = tail_counts(SK_WAVES["one_wave_and_2"](sms()))
    x, w, dy, off = make_inputs(counts, 4096, 512, True, torch.bfloat16)
    runs = {}
    for sk in ("0", "1", None):
        if sk is None:
            tuning_env("MOE_GG_SM90_SPLIT_TAIL", None)
        else:
            tuning_env("MOE_GG_SM90_SPLIT_TAIL", sk)
        runs[sk] = run_ours(x, w, dy, off, True)
    assert not torch.equal(runs[None][0], runs["0"][0]), "fwd, 64 k blocks: not split by default"
    assert not torch.equal(runs[None][0], runs["1"][0]), "fwd: 16 segments by default"
    assert torch.equal(runs[None][1], runs["0"][1]), "dgrad, 8 k blocks: split by default"


@pytest.mark.skipif(not is_hopper(), reason="the split last wave is the sm_90a kernel's")
@pytest.mark.parametrize("trans_w", [False, True])
def test_split_tail_cuda_graph(tuning_env, trans_w):
    """The split wave's counters are zeroed on the stream each call: a captured forward and
    backward replayed with other counts (other splits) equals eager, bit for bit."""
    tuning_env("MOE_GG_SM90_TILE", "256")
    tuning_env("MOE_GG_SM90_SPLIT_TAIL", "1")
    shapes = [tail_counts(f(sms())) for f in SK_WAVES.values()]
    R = max(sum(c) for c in shapes) + TAIL

    def draw(counts):
        return make_inputs(counts, 512, 512, trans_w, torch.bfloat16, tail=R - sum(counts))

    check_graph_replays(draw, shapes[0], shapes[1:] + shapes[:1], trans_w)


@pytest.mark.parametrize("trans_w", [False, True])
def test_zero_sizes(trans_w):
    off = offsets_of([0, 0, 0], "cuda")
    w = torch.randn((3, 8, 16) if trans_w else (3, 16, 8), device="cuda", dtype=torch.bfloat16)
    with poisoned():
        y = ops.grouped_gemm(torch.empty(0, 16, device="cuda", dtype=torch.bfloat16), w, off, trans_w)
        dw = ops.grouped_gemm_wgrad(torch.empty(0, 16, device="cuda", dtype=torch.bfloat16),
                                    torch.empty(0, 8, device="cuda", dtype=torch.bfloat16), off,
                                    trans_w)
    assert y.shape == (0, 8)
    assert torch.equal(dw, torch.zeros_like(dw))  # no rows: every expert's gradient is zero
    # K = 0: y is an empty sum
    off2 = offsets_of([2, 0, 3], "cuda")
    w0 = torch.randn((3, 8, 0) if trans_w else (3, 0, 8), device="cuda")
    with poisoned():
        y0 = ops.grouped_gemm(torch.randn(5, 0, device="cuda"), w0, off2, trans_w)
    assert torch.equal(y0, torch.zeros(5, 8, device="cuda"))


def test_offsets_on_another_device():
    x = torch.randn(6, 8, device="cuda")
    w = torch.randn(3, 8, 5, device="cuda")
    with pytest.raises(ValueError, match=r"expert_offsets is on cpu but x is on cuda"):
        ops.grouped_gemm(x, w, torch.tensor([0, 2, 2, 6]))


@pytest.mark.parametrize("trans_w", [False, True])
def test_autograd_matches_direct_products(trans_w):
    counts = [5, 0, 33, 1, 200]
    x, w, dy, off = make_inputs(counts, 64, 40, trans_w, torch.bfloat16)
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    ops.grouped_gemm(xr, wr, off, trans_w).backward(dy)
    assert torch.equal(xr.grad, ops.grouped_gemm_dgrad(dy, w, off, trans_w))
    assert torch.equal(wr.grad, ops.grouped_gemm_wgrad(x, dy, off, trans_w))


@pytest.mark.parametrize("trans_w", [False, True])
def test_cuda_graph_forward_backward(trans_w):
    """Capture forward and backward once; replay with new inputs and new offsets (other counts,
    rows past the last offset) copied into the static buffers: equal to eager, bit for bit."""
    K, N, R = 128, 96, 600

    def draw(counts):
        return make_inputs(counts, K, N, trans_w, torch.bfloat16, tail=R - sum(counts))

    check_graph_replays(draw, [100, 0, 250, 1, 99, 50],
                        ([0, 0, 600, 0, 0, 0], [1, 2, 3, 4, 5, 6], [129, 0, 0, 128, 300, 1]),
                        trans_w)


# ---- fc1 fused with glu_probs: grouped_gemm_glu_probs ------------------------------------
# The contract is the composition's bits (grouped_gemm, then glu_probs, on the same GPU), so the
# fused op is compared with torch.equal-strictness; the composition itself is held to the fp64
# truth by the tests above and by test_glu_probs.py. On every GPU the op runs the two kernels.

GLU_ACTS = list(ops.ACTIVATIONS)
GLU_CASES = [(True, 0.0, None), (True, -0.5, None), (True, 0.3, 2.01), (False, 0.0, None)]
# (H, F): F % 8 == 0 (glu_probs' 16-byte vectors), a narrow F, and an F that is no multiple of 8
# (glu_probs' element-wise path)
GLU_SIZES = {"tails": (136, 200), "narrow": (64, 24), "unaligned_f": (72, 44)}


def glu_inputs(counts, H, F_, gated, dtype, trans_w=True, tail=TAIL, probs_dtype=torch.float32):
    R, E = sum(counts) + tail, len(counts)
    F1 = 2 * F_ if gated else F_
    x = torch.randn(R, H, dtype=torch.float64).to(dtype)
    w = (torch.randn((E, F1, H) if trans_w else (E, H, F1), dtype=torch.float64) *
         (2.0 / H**0.5)).to(dtype)
    probs = None if probs_dtype is None else torch.rand(R, dtype=torch.float64).to(probs_dtype)
    return (x.cuda(), w.cuda(), offsets_of(counts, "cuda"),
            None if probs is None else probs.cuda())


def glu_composed(x, w, off, probs, act, gated, offset, clamp, trans_w=True):
    a = ops.grouped_gemm(x, w, off, trans_w)
    return ops.glu_probs(a, probs, act, gated, offset, clamp), a


def assert_bits(ours, ref, msg):
    assert ours.dtype == ref.dtype and ours.shape == ref.shape, msg
    same = ((ours == ref) | (ours.isnan() & ref.isnan())) & \
        (torch.signbit(ours) == torch.signbit(ref))
    if not bool(same.all()):
        i = (~same).nonzero()[0].tolist()
        raise AssertionError(f"{msg}: {int((~same).sum())} of {ours.numel()} differ; first at "
                             f"{i}: ours {ours[tuple(i)].item()!r} ref {ref[tuple(i)].item()!r}")


@pytest.mark.parametrize("size", list(GLU_SIZES))
@pytest.mark.parametrize("gated,offset,clamp", GLU_CASES)
@pytest.mark.parametrize("act", GLU_ACTS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_glu_fused_equals_composition(dtype, act, gated, offset, clamp, size):
    counts = make_counts("uneven")
    H, F_ = GLU_SIZES[size]
    for trans_w, pdt in ((True, torch.float32), (True, None), (True, torch.float64),
                         (False, torch.float32)):
        x, w, off, probs = glu_inputs(counts, H, F_, gated, dtype, trans_w, probs_dtype=pdt)
        with poisoned():
            h, a = ops.grouped_gemm_glu_probs(x, w, off, probs, act, gated, offset, clamp,
                                              trans_w)
            h_ref, a_ref = glu_composed(x, w, off, probs, act, gated, offset, clamp, trans_w)
        msg = f"{act} {size} trans_w={trans_w} probs={pdt}"
        assert_bits(a, a_ref, "a " + msg)
        assert_bits(h, h_ref, "h " + msg)
        assert not a.isnan().any(), "a: unwritten (NaN-poisoned) elements " + msg
        assert not h.isnan().any(), "h: unwritten (NaN-poisoned) elements " + msg
        kept = sum(counts)
        assert torch.equal(a[kept:], torch.zeros_like(a[kept:])), "a past the last offset"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_glu_wide_dtypes_compose(dtype):
    """fp32/fp64 operands: the SIMT GEMM then glu_probs, the same bits as calling them apart."""
    counts = make_counts("uneven")
    x, w, off, probs = glu_inputs(counts, 45, 24, True, dtype)
    with poisoned():
        h, a = ops.grouped_gemm_glu_probs(x, w, off, probs, "gelu", True, 0.5, 3.0)
        h_ref, a_ref = glu_composed(x, w, off, probs, "gelu", True, 0.5, 3.0)
    assert_bits(a, a_ref, "a")
    assert_bits(h, h_ref, "h")


@pytest.mark.parametrize("gated", [True, False])
def test_glu_default_dispatch_is_the_two_kernels(gated):
    """The op runs the grouped GEMM then the glu_probs kernel, with the bits of the two ops."""
    x, w, off, probs = glu_inputs([40, 0, 300, 7], 128, 256, gated, torch.bfloat16)
    ops.grouped_gemm_glu_probs(x, w, off, probs, "silu", gated)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        h, a = ops.grouped_gemm_glu_probs(x, w, off, probs, "silu", gated)
        torch.cuda.synchronize()
    names = [e.name for e in prof.events()]
    assert any("glu_probs_fwd_kernel" in n for n in names), names
    h_ref, a_ref = glu_composed(x, w, off, probs, "silu", gated, 0.0, None)
    assert_bits(a, a_ref, "a")
    assert_bits(h, h_ref, "h")


@pytest.mark.parametrize("gated,offset,clamp", GLU_CASES)
@pytest.mark.parametrize("act", ["silu", "gelu", "squared_relu"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_glu_fused_vs_fp64(dtype, act, gated, offset, clamp):
    """Against the fp64 truth: within 2x the error of torch's own unfused CUDA sequence."""
    counts = [0, 1, 37, 0, 130, 9, 1, 250]
    x, w, off, probs = glu_inputs(counts, 136, 200, gated, dtype)
    with poisoned():
        h, a = ops.grouped_gemm_glu_probs(x, w, off, probs, act, gated, offset, clamp)

    def sequence(x, w, probs, dtype):
        x, w, probs = x.to(dtype), w.to(dtype), probs.to(torch.float64 if dtype ==
                                                         torch.float64 else torch.float32)
        o = off.tolist()
        a = x.new_zeros(x.shape[0], w.shape[1])
        for e in range(len(o) - 1):
            a[o[e]:o[e + 1]] = x[o[e]:o[e + 1]] @ w[e].t()
        fn = {"silu": torch.nn.functional.silu, "gelu": torch.nn.functional.gelu,
              "squared_relu": lambda t: torch.relu(t) ** 2}[act]
        if gated:
            g, l = a.chunk(2, -1)
            if clamp is not None:
                g, l = g.clamp(max=clamp), l.clamp(-clamp, clamp)
            hh = fn(g) * (l + offset)
        else:
            hh = fn(a)
        return (hh * probs.unsqueeze(-1)).to(hh.dtype), a

    h64, a64 = sequence(x.cpu(), w.cpu(), probs.cpu(), torch.float64)
    h_t, a_t = sequence(x, w, probs, dtype)
    assert_error_at_most(a, a_t, a64, msg="a")
    assert_error_at_most(h, h_t, h64, msg="h")


@pytest.mark.parametrize("trans_w", [True, False])
@pytest.mark.parametrize("gated", [True, False])
def test_glu_backward_equals_composition(gated, trans_w):
    counts = [5, 0, 33, 1, 200]
    x, w, off, probs = glu_inputs(counts, 64, 40, gated, torch.bfloat16, trans_w)
    dy = torch.randn(x.shape[0], 40, device="cuda").to(torch.bfloat16)

    def grads(fn):
        xr, wr, pr = (t.clone().requires_grad_() for t in (x, w, probs))
        h, _ = fn(xr, wr, pr)
        h.backward(dy)
        return xr.grad, wr.grad, pr.grad

    ours = grads(lambda a, b, p: ops.grouped_gemm_glu_probs(a, b, off, p, "silu", gated, 0.5,
                                                            None, trans_w))
    ref = grads(lambda a, b, p: glu_composed(a, b, off, p, "silu", gated, 0.5, None, trans_w))
    for name, o, r in zip(("dx", "dW", "dprobs"), ours, ref):
        assert_bits(o, r, name)


def test_glu_deterministic():
    counts = [300, 0, 1211, 1, 513]
    x, w, off, probs = glu_inputs(counts, 512, 384, True, torch.bfloat16)
    first = ops.grouped_gemm_glu_probs(x, w, off, probs, "gelu", True, 0.5, 7.0)
    second = ops.grouped_gemm_glu_probs(x, w, off, probs, "gelu", True, 0.5, 7.0)
    for p, q in zip(first, second):
        assert torch.equal(p, q)


def test_glu_zero_rows():
    w = torch.randn(3, 16, 8, device="cuda", dtype=torch.bfloat16)
    with poisoned():
        h, a = ops.grouped_gemm_glu_probs(torch.empty(0, 8, device="cuda", dtype=torch.bfloat16),
                                          w, offsets_of([0, 0, 0], "cuda"),
                                          torch.empty(0, device="cuda"), "silu", True)
    assert h.shape == (0, 8) and a.shape == (0, 16)


@pytest.mark.parametrize("gated", [True, False])
def test_glu_cuda_graph_forward_backward(gated):
    """Capture the fused forward and its backward once; replay with new inputs and new offsets
    (other counts, rows past the last offset): equal to eager, bit for bit."""
    E, H, F_, R = 6, 128, 96, 600
    dtype = torch.bfloat16

    def draw(counts):
        return glu_inputs(counts, H, F_, gated, dtype, tail=R - sum(counts))

    sx, sw, soff, sp = draw([100, 0, 250, 1, 99, 50])
    sdy = torch.randn(R, F_, device="cuda").to(dtype)
    sx.requires_grad_(), sw.requires_grad_(), sp.requires_grad_()

    def step():
        h, a = ops.grouped_gemm_glu_probs(sx, sw, soff, sp, "silu", gated, 0.5 if gated else 0.0)
        dx, dw, dp = torch.autograd.grad(h, (sx, sw, sp), sdy)
        return h, a, dx, dw, dp

    graph, static_out = capture_graph(step)

    for counts in ([0, 0, 600, 0, 0, 0], [1, 2, 3, 4, 5, 6], [129, 0, 0, 128, 300, 1]):
        x, w, off, p = draw(counts)
        dy = torch.randn(R, F_, device="cuda").to(dtype)
        with torch.no_grad():
            sx.copy_(x), sw.copy_(w), soff.copy_(off), sp.copy_(p), sdy.copy_(dy)
        graph.replay()
        xr, wr, pr = x.clone().requires_grad_(), w.clone().requires_grad_(), p.clone().requires_grad_()
        h, a = ops.grouped_gemm_glu_probs(xr, wr, off, pr, "silu", gated, 0.5 if gated else 0.0)
        dx, dw, dp = torch.autograd.grad(h, (xr, wr, pr), dy)
        torch.cuda.synchronize()
        for name, g, e in zip(("h", "a", "dx", "dw", "dprobs"), static_out, (h, a, dx, dw, dp)):
            assert torch.equal(g, e), f"{name}: replay differs from eager, counts {counts}"
        kept = sum(counts)
        assert torch.equal(static_out[1][kept:], torch.zeros_like(static_out[1][kept:]))
