"""Router ops: topk routing and gating linear vs tests/helpers/reference_router.py and
megatron-core.

Inputs are tie-free wherever the comparison involves torch.topk (whose tie-breaking is
unspecified); our own tie rule is tested separately. Tolerances come from
tests/helpers/tolerances.py.
"""
import math

import pytest
import torch

from helpers import reference_router as ref
from helpers.megatron_moe import megatron_moe_utils
from helpers.tolerances import assert_close_ulps, eps, router_prob_ulps
from moe_core import ops

mcore = megatron_moe_utils()

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
SIZES = [(0, 8, 2), (1, 8, 2), (7, 1, 1), (7, 16, 16), (7, 16, 3), (64, 64, 4), (33, 128, 8),
         (4096, 256, 8)]
MODES = ref.ROUTING_MODES


def tie_free_logits(T, E, dtype, num_groups=None, device="cpu"):
    """[T, E] logits with distinct values per row and strictly ordered group sums.

    fp32/fp64: Gaussian (distinct with probability 1). Half dtypes: a random permutation of an
    exactly representable grid, arranged so that groups rank strictly (no tie in group scores).
    """
    if dtype in (torch.float32, torch.float64):
        return torch.randn(T, E, dtype=torch.float64).to(dtype).to(device)
    G = num_groups or 1
    P = E // G
    rank = torch.argsort(torch.rand(T, G), dim=1)
    within = torch.argsort(torch.rand(T, G, P), dim=2)
    vals = (rank.unsqueeze(-1) * P + within).reshape(T, E).to(torch.float64)
    return ((vals - E / 2) / max(E / 8, 1)).to(dtype).to(device)


def make_case(T, E, k, score, pre, variant, dtype, device):
    """Options for one case: 'plain', or 'full' = groups (when valid) + scaling + expert bias."""
    opts = dict(topk=k, use_pre_softmax=pre, score_function=score)
    if variant == "full":
        for G, gk in ((8, 4), (4, 2), (2, 1)):
            if E % G == 0 and E >= G and gk <= k and k // gk <= E // G and gk * (E // G) >= k:
                opts.update(num_groups=G, group_topk=gk)
                break
        opts["scaling_factor"] = 2.5
        if score != "softmax":
            opts["expert_bias"] = (0.1 * torch.randn(E)).to(device)
    logits = tie_free_logits(T, E, dtype, opts.get("num_groups"), device)
    return logits, opts


def check_routing(ours_fn, ref_fn, logits, dtype, prob_ulps, opts):
    """Runs both on copies of logits; compares dense probs and maps exactly/within ulps, and the
    logits gradients against an fp64 truth: our error at most 2x the reference's plus 4 ulps of
    the output scale (the backward cancels, g/D - sum(g v)/D^2, so elementwise ulps are no measure).
    """
    x1 = logits.clone().requires_grad_()
    x2 = logits.clone().requires_grad_()
    p1, m1 = ours_fn(x1)
    p2, m2 = ref_fn(x2)
    assert p1.dtype == p2.dtype == logits.dtype
    assert torch.equal(m1, m2), "routing maps differ"
    assert_close_ulps(p1, p2, n_ulps=prob_ulps, floor=1e-30, dtype=dtype, msg="probs")
    w = torch.randn(p1.shape, dtype=torch.float64, device=logits.device)
    (p1.double() * w).sum().backward()
    (p2.double() * w).sum().backward()
    x3 = logits.double().requires_grad_()
    t_opts = dict(opts)
    p3, _ = ref.to_dense(*ref.topk_routing(x3, **t_opts), logits.shape[1])
    (p3 * w).sum().backward()
    truth = x3.grad
    if truth.numel() == 0:
        return
    ours_err = (x1.grad.double() - truth).abs().max().item()
    ref_err = (x2.grad.double() - truth).abs().max().item()
    # the scale of the incoming gradient (before the backward's cancellations)
    g_scale = w.abs().max().item() * (opts.get("scaling_factor") or 1.0)
    slack = 4 * eps(dtype) * max(truth.abs().max().item(), g_scale)
    assert ours_err <= 2 * ref_err + slack, f"grad error {ours_err:.3e} vs reference {ref_err:.3e}"


@pytest.mark.parametrize("variant", ["plain", "full"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("score,pre", MODES)
@pytest.mark.parametrize("T,E,k", SIZES)
def test_routing_vs_reference(T, E, k, score, pre, dtype, variant, device):
    logits, opts = make_case(T, E, k, score, pre, variant, dtype, device)
    ours = lambda x: ops.topk_routing_with_score_function(x, **opts)  # noqa: E731
    refd = lambda x: ref.to_dense(*ref.topk_routing(x, **opts), E)  # noqa: E731
    check_routing(ours, refd, logits, dtype, router_prob_ulps(dtype, E), opts)
    # the compact form: same indices, best first
    p1, i1 = ops.topk_routing_with_score_function(logits, **opts, dense_output=True)
    p2, i2 = ref.topk_routing(logits, **opts)
    assert torch.equal(i1, i2)
    assert_close_ulps(p1, p2, n_ulps=router_prob_ulps(dtype, E), floor=1e-30, dtype=dtype)


@pytest.mark.megatron
@pytest.mark.parametrize("variant", ["plain", "full"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("score,pre", MODES)
@pytest.mark.parametrize("T,E,k", SIZES)
def test_routing_vs_megatron(T, E, k, score, pre, dtype, variant):
    logits, opts = make_case(T, E, k, score, pre, variant, dtype, "cpu")
    ours = lambda x: ops.topk_routing_with_score_function(x, **opts)  # noqa: E731
    meg = lambda x: mcore.topk_routing_with_score_function(x, **opts)  # noqa: E731
    if T == 0 and opts.get("group_topk"):
        # Documented difference: Megatron's group-limited top-k cannot reshape 0 tokens; ours
        # returns empty results.
        with pytest.raises(RuntimeError, match="0 elements"):
            meg(logits)
        p, m = ours(logits)
        assert p.shape == m.shape == (0, E)
        return
    # Megatron's score math is fp32 even for fp64 logits (ours stays fp64): compare at fp32 level.
    tol_dtype = torch.float32 if dtype == torch.float64 else dtype
    check_routing(ours, meg, logits, tol_dtype, router_prob_ulps(tol_dtype, E), opts)
    p1, i1 = ops.topk_routing_with_score_function(logits, **opts, dense_output=True)
    p2, i2 = mcore.topk_routing_with_score_function(logits, **opts, dense_output=True)
    assert torch.equal(i1, i2), "compact indices (best first) differ"
    assert_close_ulps(p1, p2, n_ulps=router_prob_ulps(tol_dtype, E), floor=1e-30, dtype=tol_dtype)


@pytest.mark.megatron
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("T,E,k,G,gk", [(64, 64, 8, 8, 4), (7, 16, 4, 4, 2), (1, 256, 8, 8, 4),
                                        (33, 32, 6, 4, 3), (16, 8, 8, 2, 2)])
def test_group_limited_topk_vs_megatron(T, E, k, G, gk, dtype):
    scores = tie_free_logits(T, E, dtype, G)
    v1, i1 = ops.group_limited_topk(scores, k, T, E, G, gk)
    v2, i2 = mcore.group_limited_topk(scores, k, T, E, G, gk)
    assert torch.equal(i1, i2)
    assert torch.equal(v1, v2)


@pytest.mark.megatron
@pytest.mark.parametrize("inp_dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("router_dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(0, 64), (1, 64), (37, 96), (4, 8, 256)])
def test_gating_linear_vs_megatron(shape, inp_dtype, router_dtype, bias, device):
    E = 24
    inp = torch.randn(shape).to(inp_dtype).to(device)
    weight = (torch.randn(E, shape[-1]) * 0.05).to(inp_dtype).to(device)
    b = torch.randn(E).to(inp_dtype).to(device) if bias else None
    leaves = [t.clone().requires_grad_() if t is not None else None for t in (inp, weight, b)]
    leaves_m = [t.clone().requires_grad_() if t is not None else None for t in (inp, weight, b)]
    out = ops.router_gating_linear(*leaves, router_dtype)
    if shape[0] == 0:
        # Documented difference: Megatron's forward cannot reshape 0 tokens (view(0, -1)); ours
        # gives empty logits, empty input grads and zero weight/bias grads.
        with pytest.raises(RuntimeError, match="0 elements"):
            mcore.router_gating_linear(*leaves_m, router_dtype)
        assert out.shape == (0, E) and out.dtype == router_dtype
        out.backward(torch.zeros_like(out))
        assert leaves[0].grad.shape == shape and torch.equal(leaves[1].grad, torch.zeros_like(weight))
        return
    out_m = mcore.router_gating_linear(*leaves_m, router_dtype)
    assert out.dtype == out_m.dtype == router_dtype and out.shape == out_m.shape
    # Both are checked against the exact (fp64) product: our error must be at most 2x torch's own
    # error in the same dtype, plus one ulp of the result scale. Grads likewise.
    exact_leaves = [t.double().requires_grad_() if t is not None else None for t in (inp, weight, b)]
    exact = ref.gating_linear(*exact_leaves, torch.float64)
    g = torch.randn(out.shape, dtype=router_dtype, device=device)
    out.backward(g)
    out_m.backward(g)
    exact.backward(g.double())

    # The accumulator of our sums: fp64 on the CPU; on CUDA cuBLAS accumulates in fp32 (fp64 for
    # an fp64 router dtype), as Megatron's own torch.mm does.
    acc_eps = 2.0**-52 if device == "cpu" or router_dtype == torch.float64 else 2.0**-23

    def check(ours_t, meg_t, truth, name, dtype, length):
        # The fp64 "truth" is itself a torch GEMM (in fp64), so the slack is the rounding of a
        # length-`length` dot product in our accumulator at the scale of its terms, next to one
        # ulp of dtype.
        err = lambda t: (t.double() - truth).abs().max().item()  # noqa: E731
        terms = truth.abs().max().item()
        slack = torch.finfo(dtype).eps * terms + acc_eps * length**0.5 * terms
        assert err(ours_t) <= 2 * err(meg_t) + slack, f"{name}: {err(ours_t):.3e} vs {err(meg_t):.3e}"

    T = inp.numel() // shape[-1]
    check(out, out_m, exact, "logits", router_dtype, shape[-1])
    lengths = {"inp": E, "weight": T, "bias": T}
    for ours_t, meg_t, truth, name in zip(leaves, leaves_m, exact_leaves, ("inp", "weight", "bias")):
        if ours_t is not None:
            assert ours_t.grad.dtype == meg_t.grad.dtype == ours_t.dtype, name
            check(ours_t.grad, meg_t.grad, truth.grad, name, ours_t.dtype, lengths[name])


@pytest.mark.parametrize("score,pre", MODES)
@pytest.mark.parametrize("variant", ["plain", "full"])
def test_gradcheck_fp64(score, pre, variant):
    logits, opts = make_case(4, 16, 4, score, pre, variant, torch.float64, "cpu")
    if "expert_bias" in opts:
        opts["expert_bias"] = opts["expert_bias"].float()
    fn = lambda x: ops.topk_routing_with_score_function(x, **opts)[0]  # noqa: E731
    assert torch.autograd.gradcheck(fn, (logits.requires_grad_(),), eps=1e-6, atol=1e-8)
    fn_c = lambda x: ops.topk_routing_with_score_function(x, **opts, dense_output=True)[0]  # noqa: E731
    assert torch.autograd.gradcheck(fn_c, (logits,), eps=1e-6, atol=1e-8)


@pytest.mark.parametrize("bias", [False, True])
def test_gating_linear_gradcheck_fp64(bias, device):
    inp = torch.randn(5, 12, dtype=torch.float64, device=device, requires_grad=True)
    w = torch.randn(6, 12, dtype=torch.float64, device=device, requires_grad=True)
    b = torch.randn(6, dtype=torch.float64, device=device, requires_grad=True) if bias else None
    args = (inp, w, b) if bias else (inp, w)
    fn = (lambda i, w_, b_: ops.router_gating_linear(i, w_, b_, torch.float64)) if bias else (
        lambda i, w_: ops.router_gating_linear(i, w_, None, torch.float64))
    assert torch.autograd.gradcheck(fn, args)


def test_ties_lowest_index_wins(device):
    logits = torch.tensor([[0.0, 1.0, 1.0, 0.5, 1.0, 0.0],
                           [2.0, 2.0, 2.0, 2.0, 2.0, 2.0]], device=device)
    _, idx = ops.router_topk(logits, 3)
    assert idx.tolist() == [[1, 2, 4], [0, 1, 2]]
    # equal group scores: the lower group index is kept
    g = torch.tensor([[1.0, 0.0, 0.0, 1.0, 0.5, 0.5]], device=device)
    _, idx = ops.router_topk(g, 2, num_groups=3, group_topk=1)
    assert idx.tolist() == [[0, 1]]


def test_nan_and_inf_logits(device):
    x = torch.randn(4, 8, device=device)
    x[1, 3] = float("nan")
    x[2, 5] = float("-inf")
    x[3, 6] = float("inf")
    for score in ops.SCORE_FUNCTIONS:
        p, idx = ops.router_topk(x, 2, score_function=score)
        rp, ridx = ref.topk_routing(x, 2, score_function=score)
        assert torch.equal(idx, ridx)
        assert idx[1, 0] == 3 and p[1].isnan().all(), "NaN expert ranks first, its row's probs NaN"
        assert 5 not in idx[2].tolist() and p[2].isfinite().all(), "-inf is never picked"
        assert idx[3, 0] == 6
        assert torch.equal(p[3].isnan(), rp[3].isnan())
        assert torch.allclose(p[[0, 2]], rp[[0, 2]]), "other rows unaffected"
    # softmax over a picked +inf: inf - inf = NaN, as in torch
    p, _ = ops.router_topk(x, 2, score_function="softmax")
    assert p[3].isnan().all()


@pytest.mark.parametrize("k", [2, 64, 256])
@pytest.mark.parametrize("score", [s for s in ops.SCORE_FUNCTIONS if s != "softmax"])
def test_renormalisation_sum_is_rounded_once(score, k, device):
    """sigmoid / sqrtsoftplus divide the k picked fp32 scores by their sum plus 1e-20; the sum is
    the correctly rounded fp32 value of the exact sum (fp64 accumulation, one rounding), so the
    probs equal, bit for bit, the fp32 quotient built from math.fsum: independent of k (a
    left-to-right fp32 sum drifts by tens of ulps at k = 256). Every path (compact, dense and the
    fused router) divides by the same denominator."""
    g = torch.Generator().manual_seed(11)
    logits = torch.randn(24, 256, generator=g)
    x64 = logits.double()
    # the fp32 scores, each correctly rounded: the fp64 sqrt of an fp32 value rounds to the
    # correctly rounded fp32 sqrt (torch's own fp32 sqrt on CPU is not always correctly rounded)
    s = torch.sigmoid(x64).float() if score == "sigmoid" else \
        torch.nn.functional.softplus(x64).float().double().sqrt().float()
    probs, idx = ops.router_topk(logits.to(device), k, score_function=score)
    _, want_idx = ref.topk_routing(logits, k, score_function=score)
    assert torch.equal(idx.cpu(), want_idx)
    picked = s.gather(1, want_idx)
    total = torch.tensor([math.fsum(r) for r in picked.double().tolist()]).float()
    denom = total + torch.tensor(1e-20, dtype=torch.float32)
    want = picked / denom.unsqueeze(1)
    assert torch.equal(probs.cpu(), want)
    exact = picked.double() / picked.double().sum(1, keepdim=True)
    assert_close_ulps(probs, exact, n_ulps=2, dtype=torch.float32, msg="the contract's 2 ulps")
    dense, _, _ = ops.router_topk_dense(logits.to(device), k, score_function=score)
    assert torch.equal(dense.cpu().gather(1, want_idx), want)
    fused, _ = ops.topk_routing_with_score_function(logits.to(device), k, score_function=score)
    assert torch.equal(fused.cpu().gather(1, want_idx), want)


def test_non_contiguous_input_is_accepted():
    base = torch.randn(32, 16)
    x = base.t().contiguous().t()  # same values, column-major strides
    assert not x.is_contiguous()
    for opts in (dict(topk=3), dict(topk=4, score_function="sigmoid", num_groups=4, group_topk=2)):
        a = ops.topk_routing_with_score_function(x, **opts)
        b = ops.topk_routing_with_score_function(base, **opts)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    w = torch.randn(16, 8).t()  # [8, 16] non-contiguous weight
    assert torch.equal(ops.router_gating_linear(x, w, None, torch.float32),
                       ops.router_gating_linear(x.contiguous(), w.contiguous(), None, torch.float32))


def test_deterministic_bitwise(device):
    x = torch.randn(4096, 256, device=device, requires_grad=True)
    opts = dict(topk=8, score_function="sigmoid", num_groups=8, group_topk=4,
                expert_bias=torch.randn(256, device=device) * 0.1, scaling_factor=2.5)
    outs = []
    for _ in range(2):
        x.grad = None
        p, m = ops.topk_routing_with_score_function(x, **opts)
        (p * torch.arange(256.0, device=device)).sum().backward()
        outs.append((p, m, x.grad.clone()))
    for a, b in zip(*outs):
        assert torch.equal(a, b)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("score,pre", MODES)
def test_cpu_cuda_same_routing(score, pre, dtype, router_kernel):
    logits, opts = make_case(2048, 64, 6, score, pre, "full", dtype, "cpu")
    p_cpu, i_cpu = ops.router_topk(logits, **opts)
    cuda_opts = {k: (v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in opts.items()}
    p_gpu, i_gpu = ops.router_topk(logits.cuda(), **cuda_opts)
    assert torch.equal(i_cpu, i_gpu.cpu())
    # Same code and rounding points; only the math library differs (CUDA's exp/log1p in fp64 are
    # within 2 ulps, glibc's within 1), which survives rounding to fp32 at most as one ulp.
    assert_close_ulps(p_gpu, p_cpu, n_ulps=8 if dtype == torch.float64 else 1, floor=1e-30,
                      dtype=dtype)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("T,E,k,G,gk,score", [
    (64, 2048, 8, None, None, "softmax"),      # wider than the warp kernel: thread-per-token path
    (64, 256, 8, 64, 4, "sigmoid"),            # more than 32 groups: thread-per-token path
    (300, 1024, 16, 32, 8, "sqrtsoftplus"),    # the widest warp kernel
    (77, 3, 3, None, None, "softmax"),         # fewer experts than lanes
])
def test_cpu_cuda_same_routing_all_kernel_paths(T, E, k, G, gk, score, router_kernel):
    logits = torch.randn(T, E, dtype=torch.float64).float()
    opts = dict(num_groups=G, group_topk=gk, score_function=score, use_pre_softmax=score == "softmax")
    x_cpu = logits.clone().requires_grad_()
    x_gpu = logits.cuda().requires_grad_()
    p_cpu, i_cpu = ops.router_topk(x_cpu, k, **opts)
    p_gpu, i_gpu = ops.router_topk(x_gpu, k, **opts)
    assert torch.equal(i_cpu, i_gpu.cpu())
    assert_close_ulps(p_gpu, p_cpu, n_ulps=1, floor=1e-30, dtype=torch.float32)
    w = torch.randn(T, k)
    (p_cpu * w).sum().backward()
    (p_gpu * w.cuda()).sum().backward()
    assert_close_ulps(x_gpu.grad, x_cpu.grad, n_ulps=2, floor=x_cpu.grad.abs().max().item(),
                      dtype=torch.float32)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_router_cuda_graph_capture_and_replay():
    """Router forward and backward have no host sync: they capture into a CUDA graph, and a
    replay on new inputs gives what eager mode gives."""
    T, E, H = 1024, 64, 128
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(E, H, device="cuda", dtype=torch.bfloat16)
    bias = torch.randn(E, device="cuda") * 0.1
    g = torch.randn(T, E, device="cuda")

    def step(inp):
        logits = (inp.float() @ w.float().t()).detach().requires_grad_()
        probs, routing_map = ops.topk_routing_with_score_function(
            logits, 8, num_groups=8, group_topk=4, scaling_factor=2.5, score_function="sigmoid",
            expert_bias=bias)
        (grad,) = torch.autograd.grad((probs * g).sum(), logits)
        return probs, routing_map, grad

    static_x = x.detach().clone()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            step(static_x)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step(static_x)
    new_x = torch.randn_like(static_x)
    static_x.copy_(new_x)
    graph.replay()
    torch.cuda.synchronize()
    for a, b in zip(outs, step(new_x)):
        assert torch.equal(a, b)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_cuda_ties_signed_zeros_and_nan_like_cpu(dtype, router_kernel):
    """The fp32 CUDA kernel ranks by packed keys: ties (including -0 vs +0) go to the lower id and
    NaN ranks first, exactly as on the CPU."""
    x = torch.zeros(64, 40, dtype=dtype)
    x[::2, ::3] = -0.0
    x[1::4, 7] = float("nan")
    x[2::4, 5:9] = 1.0
    x[3::4] = torch.randint(-3, 3, (16, 40)).to(dtype)
    for opts in (dict(), dict(use_pre_softmax=True), dict(score_function="sigmoid"),
                 dict(num_groups=8, group_topk=3), dict(score_function="sqrtsoftplus", num_groups=4, group_topk=2)):
        p_cpu, i_cpu = ops.router_topk(x, 6, **opts)
        p_gpu, i_gpu = ops.router_topk(x.cuda(), 6, **opts)
        assert torch.equal(i_cpu, i_gpu.cpu()), opts
        assert torch.equal(p_cpu.isnan(), p_gpu.cpu().isnan())
        assert_close_ulps(p_gpu, p_cpu, n_ulps=1, floor=1e-30, dtype=dtype)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("score", ops.SCORE_FUNCTIONS)
@pytest.mark.parametrize("E,G,gk,k", [
    (32, 32, 8, 8),    # one expert per group (P = 1): segments of one lane
    (64, 32, 8, 8),    # P = 2
    (64, 16, 4, 8),    # P = 4
    (128, 16, 4, 8),   # P = 8
    (256, 16, 4, 8),   # P = 16
    (256, 8, 4, 8),    # P = 32: a group is one register slot (DeepSeek-V3's shape)
    (128, 4, 2, 6),    # P = 32 with fewer slots
    (512, 16, 4, 8),   # P = 32 on a 16-slot row: the serial group rounds
    (256, 4, 2, 8),    # P = 64: the serial group rounds
    (96, 8, 4, 8),     # P = 12 (does not divide the warp): the serial group rounds
])
def test_cuda_group_phase_paths_like_cpu(dtype, score, E, G, gk, k, router_kernel):
    """Every group-phase path of the fused CUDA kernels (lanes kernel: a group is P / VPL lanes
    when that is a power of two, else the strided kernel; strided kernel: segments of P lanes
    reduced side by side when P divides 32, the serial rounds otherwise) picks the CPU's experts, on random rows and
    on rows full of ties (equal group sums, equal scores, where the lower id must win)."""
    torch.manual_seed(E + G + k)
    T = 257
    x = torch.randn(T, E, dtype=torch.float64).to(dtype)
    x[::3] = torch.randint(-2, 3, (len(range(0, T, 3)), E)).to(dtype)  # ties everywhere
    x[1::7, ::5] = 0.5
    bias = None if score == "softmax" else (0.1 * torch.randn(E)).round(decimals=1)
    opts = dict(num_groups=G, group_topk=gk, score_function=score, scaling_factor=2.5)
    for pre in ((False, True) if score == "softmax" else (False,)):
        o = dict(opts, use_pre_softmax=pre)
        p_cpu, i_cpu = ops.router_topk(x, k, expert_bias=bias, **o)
        p_gpu, i_gpu = ops.router_topk(x.cuda(), k, expert_bias=None if bias is None else bias.cuda(), **o)
        assert torch.equal(i_cpu, i_gpu.cpu()), o
        assert_close_ulps(p_gpu, p_cpu, n_ulps=1, floor=1e-30, dtype=dtype)
        pd_cpu, m_cpu = ops.topk_routing_with_score_function(x, k, expert_bias=bias, **o)
        pd_gpu, m_gpu = ops.topk_routing_with_score_function(
            x.cuda(), k, expert_bias=None if bias is None else bias.cuda(), **o)
        assert torch.equal(m_cpu, m_gpu.cpu()), o
        assert_close_ulps(pd_gpu, pd_cpu, n_ulps=1, floor=1e-30, dtype=dtype)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_sigmoid_and_exp_equal_cpu_bitwise():
    """The lanes kernel computes the fp64 sigmoid and exp with its own polynomial, not CUDA's
    library; rounded to fp32 they are the CPU's values bit for bit. Rows of 64 experts, all -inf
    but the first one or two: with k = 1 the prob is sigmoid(x) itself; softmax-pre over
    (0, -|x|) gives 1 / (1 + exp(-|x|)) and exp(-|x|) / (1 + exp(-|x|))."""
    n = 1 << 20
    gen = torch.Generator().manual_seed(7)
    x = torch.cat([torch.linspace(-110, 110, n, dtype=torch.float64).float(),
                   20 * torch.randn(n, generator=gen),
                   torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 88.72,
                                 -88.72, 103.27, -103.27, 103.28, -103.28, 708.5, -708.5, 1e30,
                                 -1e30])])
    rows = torch.full((len(x), 64), -float("inf"))
    rows[:, 0] = x
    p_cpu, i_cpu = ops.router_topk(rows, 1, score_function="sigmoid")
    p_gpu, i_gpu = ops.router_topk(rows.cuda(), 1, score_function="sigmoid")
    assert torch.equal(i_cpu, i_gpu.cpu()) and (i_cpu == 0).all()
    assert torch.equal(p_cpu.isnan(), p_gpu.cpu().isnan())
    assert torch.equal(p_cpu.nan_to_num(), p_gpu.cpu().nan_to_num())
    assert (p_cpu > 0).any() and (p_cpu < 1).any() and (p_cpu == 0).any()
    rows[:, 0] = 0.0
    rows[:, 1] = -x.abs()
    p_cpu, i_cpu = ops.router_topk(rows, 2, use_pre_softmax=True)
    p_gpu, i_gpu = ops.router_topk(rows.cuda(), 2, use_pre_softmax=True)
    assert torch.equal(i_cpu, i_gpu.cpu())
    assert torch.equal(p_cpu.nan_to_num(), p_gpu.cpu().nan_to_num())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("E,k", [(132, 8), (100, 6), (33, 4), (255, 8), (256, 8), (64, 1),
                                 (256, 40), (256, 127), (256, 128)])
@pytest.mark.parametrize("offset", [0, 1])
@pytest.mark.parametrize("score", ["sigmoid", "softmax"])
def test_cuda_row_widths_and_alignment_like_cpu(E, k, offset, score, router_kernel):
    """Rows that are no whole number of a lane's run of experts (the lanes kernel then uses no
    16-byte access) and logits that start 4 bytes past a 16-byte boundary route as on the CPU,
    dense and compact, bit for bit; so do k > 32 (more winners than candidate slots: the lanes
    kernel's rounds) and k = 128 (past its int8 ranks: the strided kernel). The expert bias
    starts at the same offset (the lanes kernel's 16-byte bias loads, or scalar ones)."""
    torch.manual_seed(E + k + offset)
    T = 301
    flat = torch.randn(T * E + offset, dtype=torch.float64).float()
    x = flat[offset:].view(T, E)
    bflat = 0.1 * torch.randn(E + offset)
    bias = bflat[offset:] if score == "sigmoid" else None
    opts = dict(score_function=score, scaling_factor=2.5)
    xg = flat.cuda()[offset:].view(T, E)
    assert xg.data_ptr() % 16 == 4 * offset
    bg = None if bias is None else bflat.cuda()[offset:]
    assert bg is None or bg.data_ptr() % 16 == 4 * offset
    p_cpu, m_cpu = ops.topk_routing_with_score_function(x, k, expert_bias=bias, **opts)
    p_gpu, m_gpu = ops.topk_routing_with_score_function(xg, k, expert_bias=bg, **opts)
    assert torch.equal(m_cpu, m_gpu.cpu())
    assert torch.equal(p_cpu, p_gpu.cpu())
    c_cpu, i_cpu = ops.router_topk(x, k, expert_bias=bias, **opts)
    c_gpu, i_gpu = ops.router_topk(xg, k, expert_bias=bg, **opts)
    assert torch.equal(i_cpu, i_gpu.cpu()) and torch.equal(c_cpu, c_gpu.cpu())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("score,pre", MODES)
@pytest.mark.parametrize("T,E,k", [(0, 8, 2), (5, 3, 3), (300, 64, 6), (129, 256, 8), (33, 2048, 4)])
def test_dense_router_equals_compact_then_dense(device, dtype, score, pre, T, E, k):
    """router_topk_dense (one fused kernel on CUDA) gives bitwise what router_topk followed by
    topk_to_dense gives, on every kernel path (fp64, > 1024 experts), with gradients."""
    logits, opts = make_case(T, E, k, score, pre, "full" if E <= 256 else "plain", dtype, device)
    x1 = logits.clone().requires_grad_()
    x2 = logits.clone().requires_grad_()
    p1, m1, i1 = ops.router_topk_dense(x1, **opts)
    tp, i2 = ops.router_topk(x2, **opts)
    p2, m2 = ops.topk_to_dense(tp, i2, E)
    assert torch.equal(i1, i2) and torch.equal(m1, m2)
    assert torch.equal(p1, p2) and not p1.isnan().any()
    g = torch.randn(T, E, dtype=dtype, device=device)
    (p1 * g).sum().backward()
    (p2 * g).sum().backward()
    if T:
        assert torch.equal(x1.grad, x2.grad)
