"""The CUDA kernels of the load-balancing ops and of router_gating_linear against the CPU
kernels (the C reference path), bitwise determinism run to run, and capture into a CUDA graph
(no host sync). Integer outputs (maps, counts) must be equal; values within tolerances derived
from the roundings in which the two devices may differ (the order of a sum, the math library).

The parity against Megatron-Core on CUDA tensors lives in the op families' own modules
(tests/balancing/, tests/router/test_ops.py), parametrised over the `device` fixture."""
import pytest
import torch

import moe_core.ops as ops
from helpers.tolerances import assert_close_ulps, eps

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
SCORE_FUNCTIONS = ops.SCORE_FUNCTIONS


def _pad(T, frac=0.3):
    pad = torch.rand(T) < frac
    pad[0] = False
    pad[-1] = True
    return pad


def _both(*tensors):
    """(cpu tensors, cuda copies); None stays None."""
    return tensors, tuple(None if t is None else t.cuda() for t in tensors)


def _compute_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


# ---- aux-loss scores ----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("score_function", SCORE_FUNCTIONS)
@pytest.mark.parametrize("T,E,k,padded", [(1, 1, 1, False), (37, 12, 3, True), (257, 64, 8, False),
                                          (64, 200, 200, True), (5, 33, 1, False)])
def test_aux_scores_cpu_cuda(dtype, score_function, T, E, k, padded):
    logits = (torch.randn(T, E, dtype=torch.float64) * 3).to(dtype)
    pad = _pad(T) if padded and T > 1 else None
    (x_c, p_c), (x_g, p_g) = _both(logits, pad)
    x_c.requires_grad_()
    x_g.requires_grad_()
    m_c, s_c = ops.compute_routing_scores_for_aux_loss(x_c, k, score_function, padding_mask=p_c)
    m_g, s_g = ops.compute_routing_scores_for_aux_loss(x_g, k, score_function, padding_mask=p_g)
    assert torch.equal(m_c, m_g.cpu())
    assert torch.equal(m_g.sum(1).cpu(), torch.full((T,), k) * (1 if p_c is None else ~p_c))
    # Same rounding points; the row sums are added in another order (fp64, then rounded once)
    # and exp/log1p may differ in the last fp64 bit: at most an ulp of the fp32 result after
    # the normalisation; fp64 keeps the sum's reordering error (≤ E ulps) plus the library's.
    cd = _compute_dtype(dtype)
    n = 2 if cd == torch.float32 else E + 4
    assert_close_ulps(s_g, s_c, n_ulps=n, floor=1e-30, dtype=cd, msg="scores")
    w = torch.randn(T, E, dtype=cd)
    (s_c * w).sum().backward()
    (s_g * w.cuda()).sum().backward()
    # the gradient has one more row sum (Σ g·s), itself reordered
    assert_close_ulps(x_g.grad, x_c.grad, n_ulps=2 * n + 2, floor=x_c.grad.abs().max().item(),
                      dtype=max(cd, dtype, key=lambda d: eps(d)), msg="grad")


def test_aux_scores_cuda_ties_nan_and_inf_like_cpu():
    x = torch.zeros(8, 40)
    x[1, ::3] = 1.0  # ties: the lowest index wins
    x[2, 7] = float("nan")
    x[3, 5] = float("inf")
    x[4] = -float("inf")
    x[5, 2:9] = -0.0
    for sf in SCORE_FUNCTIONS:
        m_c, s_c = ops.compute_routing_scores_for_aux_loss(x, 6, sf)
        m_g, s_g = ops.compute_routing_scores_for_aux_loss(x.cuda(), 6, sf)
        assert torch.equal(m_c, m_g.cpu()), sf
        assert torch.equal(s_c.isnan(), s_g.cpu().isnan()), sf
        assert_close_ulps(s_g, s_c, n_ulps=2, floor=1e-30, msg=sf)


# ---- switch loss, z-loss, expert bias -------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("T,C,padded", [(0, 8, False), (1, 1, False), (50, 16, True),
                                        (3000, 96, True), (700, 300, False)])
def test_switch_loss_cpu_cuda(dtype, T, C, padded):
    probs = torch.rand(T, C, dtype=torch.float64).to(dtype)
    counts = torch.randint(0, 40, (C,)).float()
    total = torch.tensor(123.0, dtype=torch.float64)
    pad = _pad(T) if padded else None
    (p_c, n_c, t_c, m_c), (p_g, n_g, t_g, m_g) = _both(probs, counts, total, pad)
    l_c = torch.ops.moe_core.switch_aux_loss(p_c, n_c, t_c, 4, 16, 0.37, m_c)
    l_g = torch.ops.moe_core.switch_aux_loss(p_g, n_g, t_g, 4, 16, 0.37, m_g)
    cd = _compute_dtype(dtype)
    # fp64 partial sums of nonnegative terms in another order, rounded once: one ulp in fp32;
    # in fp64 the reordering error itself, at most (T + C) ulps (no cancellation)
    assert_close_ulps(l_g, l_c, n_ulps=1 if cd == torch.float32 else T + C, dtype=cd)
    g = torch.tensor(1.7, dtype=cd)
    gp_c = torch.ops.moe_core.switch_aux_loss_bwd(g, p_c, n_c, t_c, 4, 16, 0.37, m_c)
    gp_g = torch.ops.moe_core.switch_aux_loss_bwd(g.cuda(), p_g, n_g, t_g, 4, 16, 0.37, m_g)
    assert torch.equal(gp_c, gp_g.cpu())  # the same products in the same order


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("T,E,padded", [(0, 8, False), (0, 8, True), (1, 1, False), (33, 10, True),
                                        (5000, 64, True), (100, 300, False)])
def test_z_loss_cpu_cuda(dtype, T, E, padded):
    logits = (torch.randn(T, E, dtype=torch.float64) * 4).to(dtype)
    pad = _pad(T) if padded and T > 1 else (torch.zeros(T, dtype=torch.bool) if padded else None)
    (x_c, m_c), (x_g, m_g) = _both(logits, pad)
    l_c = ops.z_loss_func(x_c, 1e-3, padding_mask=m_c)
    l_g = ops.z_loss_func(x_g, 1e-3, padding_mask=m_g)
    cd = _compute_dtype(dtype)
    if T == 0 and not padded:
        assert l_c.isnan() and l_g.isnan().item()  # torch.mean of nothing
        return
    # fp64 lse² summed in another order (nonnegative terms), rounded once
    assert_close_ulps(l_g, l_c, n_ulps=1 if cd == torch.float32 else 4 * (T + E), dtype=cd)
    if T == 0:
        return
    g = torch.tensor(2.5, dtype=cd)
    gl_c = torch.ops.moe_core.z_loss_bwd(g, x_c, 1e-3, m_c)
    gl_g = torch.ops.moe_core.z_loss_bwd(g.cuda(), x_g, 1e-3, m_g)
    # lse's row sum is reordered (≤ E ulps of fp64) and exp differs in the last fp64 bit; the
    # gradient is lse · exp(x − lse), so the absolute error of lse (|lse| ≤ 30) becomes relative
    n = 2 if dtype != torch.float64 else 64 * E
    assert_close_ulps(gl_g, gl_c, n_ulps=n, floor=1e-30, dtype=dtype)


@pytest.mark.parametrize("L,E", [(1, 1), (1, 64), (3, 8), (5, 1000)])
def test_expert_bias_update_cpu_cuda_bitwise(L, E):
    counts = torch.randint(0, 50, (L, E)).float()
    counts[0, : E // 2] = counts[0].mean()  # sign(0) where the mean is exact
    counts[-1, -1] = 12.3456  # a non-integer count
    bias = torch.randn(L, E) * 1e-2
    out_c = ops.get_updated_expert_bias(counts.clone(), bias, 1e-3)
    out_g = ops.get_updated_expert_bias(counts.cuda(), bias.cuda(), 1e-3)
    assert torch.equal(out_c, out_g.cpu())
    in_place = bias.cuda()
    torch.ops.moe_core.expert_bias_update(counts.cuda(), in_place, 1e-3)  # a fresh output
    assert torch.equal(in_place.cpu(), bias)


# ---- Sinkhorn ---------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("T,E", [(1, 1), (7, 5), (64, 16), (1000, 64), (33, 300)])
def test_sinkhorn_cpu_cuda(dtype, T, E):
    cost = torch.randn(T, E, dtype=torch.float64).to(dtype)
    out_c = ops.sinkhorn(cost)
    out_g = ops.sinkhorn(cost.cuda())
    cd = _compute_dtype(dtype)
    assert out_g.dtype == cd
    # the iteration contracts; each step's sums are reordered (fp32: below its ulp but for rare
    # boundary cases, as in the Megatron comparison; fp64: up to T + E ulps per step)
    n = 64 if cd == torch.float32 else 4 * (T + E)
    assert_close_ulps(out_g, out_c, n_ulps=n, floor=out_c.abs().max().item(), dtype=cd)
    capped_c = ops.sinkhorn(cost, tol=0.0, max_iters=3)
    capped_g = ops.sinkhorn(cost.cuda(), tol=0.0, max_iters=3)
    assert_close_ulps(capped_g, capped_c, n_ulps=16, floor=capped_c.abs().max().item(), dtype=cd)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("topk", [1, 2, 5])
@pytest.mark.parametrize("training", [True, False])
def test_sinkhorn_routing_cpu_cuda(dtype, topk, training):
    T, E = 300, 16
    logits = (torch.randn(T, E, dtype=torch.float64) + torch.linspace(0, 2, E)).to(dtype)
    x_c = logits.clone().requires_grad_()
    x_g = logits.cuda().requires_grad_()
    p_c, m_c = ops.sinkhorn_load_balancing(x_c, topk, training=training)
    p_g, m_g = ops.sinkhorn_load_balancing(x_g, topk, training=training)
    assert torch.equal(m_c, m_g.cpu())
    # eval: the same elementwise activation (softmax: a reordered row sum, one ulp after rounding)
    assert_close_ulps(p_g, p_c, n_ulps=2 if dtype != torch.float64 else E + 4, floor=1e-30,
                      dtype=dtype)
    w = torch.randn(T, E, dtype=dtype)
    (p_c * w).sum().backward()
    (p_g * w.cuda()).sum().backward()
    assert_close_ulps(x_g.grad, x_c.grad, n_ulps=4 if dtype != torch.float64 else 2 * E + 8,
                      floor=x_c.grad.abs().max().item(), dtype=dtype)


# ---- routing metrics ----------------------------------------------------------------------------


@pytest.mark.parametrize("T,E,padded,with_scores", [(0, 4, False, True), (1, 1, False, True),
                                                    (100, 12, True, True), (3000, 64, True, False),
                                                    (513, 300, False, True)])
def test_routing_metrics_cpu_cuda(T, E, padded, with_scores):
    logits = torch.randn(T, E) + torch.linspace(0, 1.5, E)
    routing_map, scores = ops.compute_routing_scores_for_aux_loss(logits, min(3, E), "softmax")
    pad = _pad(T) if padded and T > 1 else None
    s = scores if with_scores else None
    (r_c, s_c, p_c), (r_g, s_g, p_g) = _both(routing_map, s, pad)
    a = ops.routing_metrics(r_c, s_c, p_c)
    b = ops.routing_metrics(r_g, s_g, p_g)
    assert torch.equal(a.tokens_per_expert, b.tokens_per_expert.cpu())
    # from the same integers in the same order (only log may differ in its last fp64 bit)
    for name in ("max_over_mean", "load_cv", "load_entropy"):
        assert_close_ulps(getattr(b, name), getattr(a, name), n_ulps=1, msg=name)
    if with_scores:
        # per-token sums in another order, then a reordered mean of nonnegative terms
        assert_close_ulps(b.score_entropy, a.score_entropy, n_ulps=2, msg="score_entropy")


@pytest.mark.parametrize("T,k,padded", [(0, 2, False), (1, 1, False), (80, 4, True),
                                        (5000, 8, True)])
def test_topk_overlap_cpu_cuda(T, k, padded):
    E = 32
    a = torch.rand(T, E).topk(k, dim=1).indices
    b = a.clone()
    b[: T // 2] = torch.rand(T // 2, E).topk(k, dim=1).indices
    pad = _pad(T) if padded else None
    (a_c, b_c, p_c), (a_g, b_g, p_g) = _both(a, b, pad)
    assert torch.equal(ops.topk_overlap(a_c, b_c, E, p_c), ops.topk_overlap(a_g, b_g, E, p_g).cpu())


# ---- router_gating_linear -------------------------------------------------------------------------


def _gemm_bound(a, b, length, acc_eps):
    """|error| bound of the dot products of `length` terms accumulated with unit roundoff
    acc_eps / 2: γ_n · Σ|a||b| (Higham), elementwise."""
    absprod = a.abs().double() @ b.abs().double()
    u = acc_eps / 2
    gamma = length * u / (1 - length * u)
    return gamma * absprod


@pytest.mark.parametrize("inp_dtype,w_dtype,router_dtype", [
    (torch.bfloat16, torch.bfloat16, torch.float32),   # cuBLAS takes bf16 directly
    (torch.float16, torch.float16, torch.float32),
    (torch.float32, torch.float32, torch.float32),
    (torch.bfloat16, torch.float32, torch.float32),    # mixed: inp converted first
    (torch.bfloat16, torch.bfloat16, torch.float64),   # fp64 router: both converted
    (torch.float32, torch.bfloat16, torch.bfloat16),   # half router dtype
], ids=str)
@pytest.mark.parametrize("T,H,E", [(1, 1, 1), (37, 96, 24), (1024, 512, 64), (5, 7000, 8)])
@pytest.mark.parametrize("bias", [False, True])
def test_gating_linear_cpu_cuda(inp_dtype, w_dtype, router_dtype, T, H, E, bias):
    inp = torch.randn(T, H).to(inp_dtype)
    w = (torch.randn(E, H) * 0.05).to(w_dtype)
    b = torch.randn(E).to(w_dtype) if bias else None
    (i_c, w_c, b_c), (i_g, w_g, b_g) = _both(inp, w, b)
    out_c = torch.ops.moe_core.router_gating_linear(i_c, w_c, b_c, router_dtype)
    out_g = torch.ops.moe_core.router_gating_linear(i_g, w_g, b_g, router_dtype)
    assert out_g.dtype == router_dtype
    acc_eps = 2.0**-52 if router_dtype == torch.float64 else 2.0**-23
    # operands as the router dtype sees them
    ir, wr = inp.to(router_dtype).double(), w.to(router_dtype).double()
    bound = _gemm_bound(ir, wr.t(), H, acc_eps)
    # each side rounds the product to rd, then (with a bias) the sum once more: two ulps of rd
    # at the scale of the product and the result
    scale = out_c.double().abs() + (0 if b is None else b.to(router_dtype).double().abs())
    diff = (out_g.cpu().double() - out_c.double()).abs()
    tol = 2 * bound + 2 * eps(router_dtype) * scale
    assert (diff <= tol).all(), f"logits: max excess {(diff - tol).max().item():.3e}"

    g = torch.randn(T, E, dtype=router_dtype)
    gi_c, gw_c, gb_c = torch.ops.moe_core.router_gating_linear_bwd(g, i_c, w_c)
    gi_g, gw_g, gb_g = torch.ops.moe_core.router_gating_linear_bwd(g.cuda(), i_g, w_g)
    gd = g.double()
    for ours, ref, a, bb, length, dt, name in (
            (gi_g, gi_c, gd, wr, E, inp_dtype, "grad_inp"),
            (gw_g, gw_c, gd.t(), ir, T, w_dtype, "grad_weight")):
        assert ours.dtype == ref.dtype == dt, name
        bound = _gemm_bound(a, bb, length, acc_eps)
        # rounded to the router dtype, then to the leaf dtype: one ulp of the coarser, twice
        coarse = max(eps(router_dtype), eps(dt))
        tol = 2 * bound + 2 * coarse * ref.double().abs()
        diff = (ours.cpu().double() - ref.double()).abs()
        assert (diff <= tol).all(), f"{name}: max excess {(diff - tol).max().item():.3e}"
    # the bias gradient is an fp64 sum on both devices (reordered), rounded to rd then w_dtype
    assert_close_ulps(gb_g, gb_c, n_ulps=2, floor=gb_c.abs().max().item() * 2.0**-40,
                      dtype=max(router_dtype, w_dtype, key=lambda d: eps(d)), msg="grad_bias")


@pytest.mark.parametrize("T,H,E", [(4096, 2048, 128), (333, 7168, 256), (64, 96, 3)])
def test_gating_linear_bwd_bf16_on_tensor_cores(T, H, E):
    """bf16 operands with an fp32 router: the backward splits the fp32 gradient into three bf16
    terms for the tensor cores. Against the fp64 truth its error is that of an fp32 GEMM over
    three times the terms (plus the bf16 rounding of the output), and it stays within one bf16
    ulp of the fp32 path (Megatron's fp32 torch.mm, rounded to bf16); run to run bitwise."""
    gen = torch.Generator().manual_seed(T + E)
    inp = torch.randn(T, H, generator=gen).bfloat16()
    w = (torch.randn(E, H, generator=gen) * 0.05).bfloat16()
    g = torch.randn(T, E, generator=gen) * torch.logspace(-6, 0, E)  # gradients of many scales
    gi, gw, _ = torch.ops.moe_core.router_gating_linear_bwd(g.cuda(), inp.cuda(), w.cuda())
    gi2, gw2, _ = torch.ops.moe_core.router_gating_linear_bwd(g.cuda(), inp.cuda(), w.cuda())
    assert torch.equal(gi, gi2) and torch.equal(gw, gw2)
    gd, ind, wd = g.double(), inp.double(), w.double()
    for ours, truth, a, b, length, name in (
            (gi, gd @ wd, gd, wd, 3 * E, "grad_inp"), (gw, gd.t() @ ind, gd.t(), ind, 3 * T,
                                                      "grad_weight")):
        assert ours.dtype == torch.bfloat16, name
        bound = _gemm_bound(a, b, length, 2.0**-23)
        tol = bound + eps(torch.bfloat16) / 2 * truth.abs() * (1 + 2.0**-7)
        diff = (ours.cpu().double() - truth).abs()
        assert (diff <= tol).all(), f"{name}: max excess {(diff - tol).max().item():.3e}"
        fp32_path = (a.float() @ b.float()).bfloat16().double()
        ulp = eps(torch.bfloat16) * fp32_path.abs().clamp_min(2.0**-126)
        # (plus both GEMMs' accumulation error, where cancellation leaves a small result)
        assert ((ours.cpu().double() - fp32_path).abs() <= ulp + 2 * bound).all(), name


def test_gating_linear_zero_tokens_cuda():
    inp = torch.randn(0, 64, device="cuda", requires_grad=True)
    w = torch.randn(8, 64, device="cuda", requires_grad=True)
    b = torch.randn(8, device="cuda", requires_grad=True)
    out = ops.router_gating_linear(inp, w, b, torch.float32)
    assert out.shape == (0, 8)
    out.backward(torch.zeros_like(out))
    assert inp.grad.shape == (0, 64) and not w.grad.any() and not b.grad.any()


# ---- determinism and graph capture ----------------------------------------------------------------


def _all_cuda_outputs(logits, inp, w, b, pad):
    """Every balancing op and the gating linear, forward and backward, on one set of CUDA inputs."""
    outs = []
    x = logits.detach().requires_grad_()
    m, s = ops.compute_routing_scores_for_aux_loss(x, 8, "sigmoid", padding_mask=pad)
    counts = m.sum(0)
    aux = ops.switch_load_balancing_loss_func(s, counts, counts.sum() / 8, 8, x.shape[1], 0.01,
                                              padding_mask=pad)
    z = ops.z_loss_func(x, 1e-3, padding_mask=pad)
    (gx,) = torch.autograd.grad(aux + z, x)
    outs += [m, s, aux, z, gx]
    outs += list(ops.routing_metrics(m, s, pad))
    outs.append(ops.get_updated_expert_bias(counts.float(), torch.zeros(x.shape[1], device="cuda"),
                                            1e-3))
    p, rm = ops.sinkhorn_load_balancing(x, 2, training=True)
    (gs,) = torch.autograd.grad((p * torch.arange(float(x.shape[1]), device="cuda")).sum(), x)
    outs += [p, rm, gs]
    i_ = inp.detach().requires_grad_()
    w_ = w.detach().requires_grad_()
    b_ = b.detach().requires_grad_()
    out = ops.router_gating_linear(i_, w_, b_, torch.float32)
    outs += [out] + list(torch.autograd.grad(out.square().sum(), (i_, w_, b_)))
    return outs


def test_cuda_ops_are_bitwise_deterministic():
    T, E, H = 4096, 64, 1024
    logits = torch.randn(T, E, device="cuda")
    inp = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(E, H, device="cuda", dtype=torch.bfloat16) * 0.05
    b = torch.randn(E, device="cuda", dtype=torch.bfloat16)
    pad = _pad(T).cuda()
    first = _all_cuda_outputs(logits, inp, w, b, pad)
    side = torch.cuda.Stream()  # another stream, another cuBLAS stream binding: same bits
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        second = _all_cuda_outputs(logits, inp, w, b, pad)
    torch.cuda.synchronize()
    for i, (a, c) in enumerate(zip(first, second)):
        assert torch.equal(a, c), f"output {i} differs between runs"


def test_cuda_ops_capture_in_a_graph():
    """No host sync anywhere (Sinkhorn's loop included): the ops capture into a CUDA graph, and a
    replay on new inputs gives what eager mode gives."""
    T, E, H = 512, 32, 256
    static = [torch.randn(T, E, device="cuda"),
              torch.randn(T, H, device="cuda", dtype=torch.bfloat16),
              torch.randn(E, H, device="cuda", dtype=torch.bfloat16) * 0.05,
              torch.randn(E, device="cuda", dtype=torch.bfloat16)]
    pad = _pad(T).cuda()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):  # warm-up (creates the cuBLAS handle outside the capture)
            _all_cuda_outputs(*static, pad)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = _all_cuda_outputs(*static, pad)
    fresh = [torch.randn_like(static[0]), torch.randn_like(static[1]),
             torch.randn_like(static[2]) * 0.05, torch.randn_like(static[3])]
    for dst, src in zip(static, fresh):
        dst.copy_(src)
    graph.replay()
    torch.cuda.synchronize()
    for i, (a, c) in enumerate(zip(outs, _all_cuda_outputs(*fresh, pad))):
        assert torch.equal(a, c), f"output {i} differs between replay and eager"
