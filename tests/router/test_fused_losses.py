"""The aux-loss scores and the z-loss's logsumexp from the router's single pass.

router_topk_fused must give, next to router_topk_dense's routing, exactly what the separate ops
give: compute_routing_scores_for_aux_loss's scores and map, and an lse whose z-loss
(z_loss_from_lse) is z_loss_func's; its gradient must be the unfused composition's; and
TopKRouter, which makes one fused call in training, must report the same losses and gradients as a
forward making the three separate calls. On the CPU the fused extras run the separate ops' own loops
(bitwise); on CUDA the row sums are warp reductions (the last fp64 bit may differ before the fp32
rounding), so CUDA is checked to 1 ulp of the compute precision, plus exact maps wherever the scores
agree bitwise, against the CPU ops (and the CUDA separate ops where they exist). fp64 router math on
CUDA is not bitwise to the CPU (CUDA's exp vs glibc's, a warp-tree row sum vs the CPU's ascending
one, and no wider type to round from): it is held to cuda_cpu_fp64_ulps(E) (helpers/tolerances.py
derives it), with maps and indices still exact.
"""
import copy

import pytest
import torch

from helpers.reference_router import ROUTING_MODES
from helpers.tolerances import cuda_cpu_fp64_ulps
from moe_core import ops
from moe_core.config import MoEConfig
from moe_core.ops.aux_loss_autoscaler import AuxLossScale
from moe_core.ops.router_topk import router_topk_fused, z_loss_from_lse
from moe_core.router import TopKRouter

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
SCORES = ops.SCORE_FUNCTIONS


def compute_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def make_logits(T, E, dtype, device, special=True):
    """Random logits with a few hard rows: a -inf entry, exact ties, a large positive row."""
    x = torch.randn(T, E, dtype=torch.float64) * 3
    if special and T >= 4 and E >= 2:
        x[0, 1] = float("-inf")
        x[1, :] = 0.25  # all tied: the lower ids win
        x[2, :] += 40.0  # softplus above its threshold, exp overflow guarded by the max
    return x.to(dtype).to(device)


def make_mask(T, device, kind):
    if kind == "none":
        return None
    if kind == "all":
        return torch.ones(T, dtype=torch.bool, device=device)
    g = torch.Generator().manual_seed(T)
    return (torch.rand(T, generator=g) < 0.3).to(device)


def same(a, b, msg=""):
    """Bitwise equality, NaNs equal."""
    assert a.shape == b.shape and a.dtype == b.dtype, f"{msg}: {a.shape}/{a.dtype} vs {b.shape}/{b.dtype}"
    a, b = a.cpu(), b.cpu()
    if a.is_floating_point():
        ok = (a == b) | (a.isnan() & b.isnan())
    else:
        ok = a == b
    assert bool(ok.all()), f"{msg}: {int((~ok).sum())} of {ok.numel()} elements differ"


def close_ulps(a, b, dtype, n_ulps=1, msg="", scale=None):
    """Equal within n_ulps of `dtype` relative to max(|b|, scale) (scale: the magnitude the
    compared values are cancellations of, e.g. a gradient row's largest term), infinities and
    NaNs matching exactly."""
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    assert a.shape == b.shape, msg
    exact = (a == b) | (a.isnan() & b.isnan())
    mag = b.abs() if scale is None else torch.maximum(b.abs(), scale.double().cpu())
    tol = n_ulps * torch.finfo(dtype).eps * mag.clamp_min(torch.finfo(dtype).tiny)
    ok = exact | ((a - b).abs() <= tol)
    assert bool(ok.all()), f"{msg}: {int((~ok).sum())} elements differ by more than {n_ulps} ulps"


def separate_aux(logits, k, sf, mask):
    """compute_routing_scores_for_aux_loss on the CPU (the reference: it is bitwise on the CPU)."""
    m = mask.cpu() if mask is not None else None
    aux_map, scores = ops.compute_routing_scores_for_aux_loss(logits.detach().cpu(), k, sf,
                                                              padding_mask=m)
    return scores, aux_map


def check_aux(scores, aux_map, logits, k, sf, mask, device):
    ref_scores, ref_map = separate_aux(logits, k, sf, mask)
    if device == "cpu":
        same(scores, ref_scores, "aux scores")
        same(aux_map, ref_map, "aux map")
        return
    n = cuda_cpu_fp64_ulps(logits.shape[1]) if logits.dtype == torch.float64 else 1
    close_ulps(scores, ref_scores, compute_dtype(logits.dtype), n, "aux scores (CUDA vs CPU op)")
    rows = ((scores.cpu() == ref_scores) | (scores.cpu().isnan() & ref_scores.isnan())).all(1)
    same(aux_map.cpu()[rows], ref_map[rows], "aux map on rows with bitwise scores")
    # every row: the map is the top-k of the scores it came with (ties to the lower id)
    ours = scores.cpu().double().nan_to_num(nan=float("inf"))
    order = torch.sort(-ours, dim=1, stable=True).indices[:, :k]
    expect = torch.zeros_like(aux_map.cpu()).scatter_(1, order, True)
    if mask is not None:
        expect[mask.cpu()] = False
    same(aux_map.cpu(), expect, "aux map is the top-k of its own scores")
    try:  # the CUDA separate op, where it exists
        m2, s2 = ops.compute_routing_scores_for_aux_loss(logits.detach(), k, sf, padding_mask=mask)
    except RuntimeError as err:
        if "no CUDA kernel" not in str(err):
            raise
        return
    close_ulps(scores, s2, compute_dtype(logits.dtype), n, "aux scores (CUDA vs CUDA op)")


def check_lse(lse, logits, mask, device, coeff=0.37):
    T = logits.shape[0]
    assert lse.dtype == torch.float64 and lse.shape == (T,)
    ref = torch.logsumexp(logits.detach().double().cpu(), dim=1)
    if mask is not None:
        ref = ref.masked_fill(mask.cpu(), 0.0)
        assert bool((lse.cpu()[mask.cpu()] == 0).all()), "padded rows must have lse 0"
    close_ulps(lse, ref, torch.float64, 8 * max(1, logits.shape[1]), "lse vs torch.logsumexp")
    dt = compute_dtype(logits.dtype)
    z = z_loss_from_lse(lse, coeff, mask, dt)
    m = mask.cpu() if mask is not None else None
    z_ref = ops.z_loss_func(logits.detach().cpu(), coeff, padding_mask=m)
    assert z.dtype == z_ref.dtype == dt
    if T == 0 and mask is not None:
        # the documented contract: sum / max(n_unpadded, 1) = 0. (z_loss_func gives NaN here: an
        # empty mask reaches its C core as a NULL pointer, i.e. as "no mask".)
        assert z.item() == 0.0
        return
    if device == "cpu" and dt != torch.float64:
        same(z, z_ref, "z-loss from lse vs z_loss_func")
    else:  # fp64: torch's sum vs z_loss.c's ascending loop, in the last bits
        close_ulps(z, z_ref, dt, 4 * max(T, 1) if dt == torch.float64 else 1, "z-loss")


def run_fused(logits, k, sf, pre=False, mask=None, groups=None, bias=None, scaling=None):
    return router_topk_fused(
        logits, k, use_pre_softmax=pre, num_groups=groups[0] if groups else None,
        group_topk=groups[1] if groups else None, scaling_factor=scaling, score_function=sf,
        expert_bias=bias, padding_mask=mask, with_aux=True, with_lse=True)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("sf", SCORES)
@pytest.mark.parametrize("mask_kind", ["none", "some", "all"])
def test_fused_extras_equal_separate_ops(device, dtype, sf, mask_kind, router_kernel):
    T, E, k = 53, 40, 5
    logits = make_logits(T, E, dtype, device)
    mask = make_mask(T, device, mask_kind)
    for pre in ([False, True] if sf == "softmax" else [False]):
        probs, rmap, idx, scores, aux_map, lse = run_fused(logits, k, sf, pre, mask)
        p2, m2, i2 = ops.router_topk_dense(logits, k, use_pre_softmax=pre, score_function=sf)
        same(probs, p2, "probs")
        same(rmap, m2, "routing map")
        same(idx, i2, "indices")
        assert scores.dtype == compute_dtype(dtype) and aux_map.dtype == torch.bool
        check_aux(scores, aux_map, logits, k, sf, mask, device)
        check_lse(lse, logits, mask, device)


@pytest.mark.parametrize("T,E,k,groups,sf,dtype", [
    (0, 8, 2, None, "softmax", torch.float32),           # no tokens
    (17, 1, 1, None, "sigmoid", torch.float32),          # one expert
    (19, 6, 6, None, "sqrtsoftplus", torch.bfloat16),    # topk = E
    (23, 1100, 7, None, "softmax", torch.float32),       # wider than the CUDA warp kernel
    (9, 1100, 3, None, "sigmoid", torch.float64),        # fp64 and wide
    (31, 256, 8, (8, 4), "sigmoid", torch.bfloat16),     # groups + bias (VPL = 8 kernel)
    (31, 256, 8, (64, 4), "softmax", torch.float32),     # > 32 groups: thread-per-token route
    (29, 1024, 16, None, "softmax", torch.float16),      # the widest warp kernel
    (33, 33, 4, None, "sqrtsoftplus", torch.float64),    # fp64 warp kernel
])
@pytest.mark.parametrize("masked", [False, True])
def test_fused_extras_odd_shapes_and_paths(device, T, E, k, groups, sf, dtype, masked,
                                          router_kernel):
    logits = make_logits(T, E, dtype, device)
    mask = make_mask(T, device, "some" if masked else "none")
    bias = torch.randn(E, device=device) if sf != "softmax" and groups else None
    for pre in ([False, True] if sf == "softmax" else [False]):
        out = run_fused(logits, k, sf, pre, mask, groups, bias, scaling=1.5)
        p2, m2, i2 = ops.router_topk_dense(
            logits, k, use_pre_softmax=pre, num_groups=groups[0] if groups else None,
            group_topk=groups[1] if groups else None, scaling_factor=1.5, score_function=sf,
            expert_bias=bias)
        same(out[0], p2, "probs")
        same(out[1], m2, "routing map")
        same(out[2], i2, "indices")
        check_aux(out[3], out[4], logits, k, sf, mask, device)
        check_lse(out[5], logits, mask, device)


def test_outputs_not_asked_for_are_none_and_routing_unchanged(device):
    logits = make_logits(12, 16, torch.float32, device)
    out = router_topk_fused(logits, 3, score_function="sigmoid")
    assert out[3] is None and out[4] is None and out[5] is None
    ref = ops.router_topk_dense(logits, 3, score_function="sigmoid")
    for a, b in zip(out[:3], ref):
        same(a, b)
    only_lse = router_topk_fused(logits, 3, score_function="sigmoid", with_lse=True)
    assert only_lse[3] is None and only_lse[5] is not None
    only_aux = router_topk_fused(logits, 3, score_function="sigmoid", with_aux=True)
    assert only_aux[3] is not None and only_aux[5] is None
    same(only_aux[3], router_topk_fused(logits, 3, score_function="sigmoid", with_aux=True,
                                        with_lse=True)[3])


def unfused_grad(logits, k, sf, pre, mask, coeff, w_probs, w_scores, g_z):
    """The three separate ops' gradients, summed as autograd sums them in an unfused router:
    (router + aux scores) + z-loss, each in the logits' dtype."""
    x = logits.detach().cpu().requires_grad_()
    m = mask.cpu() if mask is not None else None
    probs, _, _ = ops.router_topk_dense(x, k, use_pre_softmax=pre, score_function=sf)
    (g1,) = torch.autograd.grad((probs.float() * w_probs.cpu()).sum(), x)
    _, scores = ops.compute_routing_scores_for_aux_loss(x, k, sf, padding_mask=m)
    (g2,) = torch.autograd.grad((scores * w_scores.cpu()).sum(), x)
    z = ops.z_loss_func(x, coeff, padding_mask=m)
    (g3,) = torch.autograd.grad(z, x, grad_outputs=g_z.cpu())
    return (g1 + g2) + g3


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("sf,pre", ROUTING_MODES)
@pytest.mark.parametrize("masked", [False, True])
def test_fused_grad_equals_unfused_composition(device, dtype, sf, pre, masked):
    T, E, k, coeff = 37, 24, 4, 0.3
    logits = make_logits(T, E, dtype, device, special=False)
    mask = make_mask(T, device, "some" if masked else "none")
    w_probs = torch.randn(T, E, device=device)
    w_scores = torch.randn(T, E, device=device, dtype=compute_dtype(dtype))
    g_z = torch.tensor(1.7, device=device, dtype=compute_dtype(dtype))
    x = logits.clone().requires_grad_()
    probs, _, _, scores, _, lse = run_fused(x, k, sf, pre, mask)
    z = z_loss_from_lse(lse, coeff, mask, compute_dtype(dtype))
    loss = (probs.float() * w_probs).sum() + (scores * w_scores).sum() + z * g_z
    (grad,) = torch.autograd.grad(loss, x)
    ref = unfused_grad(logits, k, sf, pre, mask, coeff, w_probs, w_scores, g_z)
    assert grad.dtype == dtype
    if device == "cpu":
        same(grad, ref, "grad_logits vs the unfused ops")
    elif dtype == torch.float64:  # each gradient is a cancellation of terms of its row's size
        row = ref.abs().amax(dim=1, keepdim=True).expand_as(ref)
        close_ulps(grad, ref, dtype, 2 * cuda_cpu_fp64_ulps(E), "grad_logits", scale=row)
    else:  # CUDA exp / warp sums vs glibc: an ulp of the logits dtype
        close_ulps(grad, ref, dtype, 1, "grad_logits")


@pytest.mark.parametrize("masked", [False, True])
def test_lse_grad_is_z_loss_grad(device, masked):
    T, E = 29, 13
    logits = make_logits(T, E, torch.float32, device)
    mask = make_mask(T, device, "some" if masked else "none")
    x = logits.clone().requires_grad_()
    *_, lse = router_topk_fused(x, 2, with_lse=True, padding_mask=mask)
    (g,) = torch.autograd.grad(z_loss_from_lse(lse, 0.01, mask), x)
    xr = logits.detach().cpu().requires_grad_()
    (gr,) = torch.autograd.grad(ops.z_loss_func(xr, 0.01, mask.cpu() if masked else None), xr)
    if device == "cpu":
        same(g, gr)
    else:
        close_ulps(g, gr, torch.float32, 1)
    if masked:
        assert bool((g.cpu()[mask.cpu()] == 0).all())


def test_gradcheck_fp64_through_all_outputs():
    logits = torch.randn(6, 7, dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([0, 1, 0, 0, 0, 1], dtype=torch.bool)
    for sf, pre in ROUTING_MODES:
        def f(x):
            p, _, _, s, _, lse = run_fused(x, 3, sf, pre, mask)
            return p, s, lse
        assert torch.autograd.gradcheck(f, (logits,))


def test_zero_tokens_z_loss_contract(device):
    logits = torch.empty(0, 8, device=device)
    *_, lse = router_topk_fused(logits, 2, with_lse=True, with_aux=True)
    assert lse.shape == (0,)
    assert torch.isnan(z_loss_from_lse(lse, 0.1)).item()  # mean of nothing, as torch.mean
    mask = torch.empty(0, dtype=torch.bool, device=device)
    assert z_loss_from_lse(lse, 0.1, mask).item() == 0.0  # sum / max(0, 1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("E,k", [(64, 6), (256, 8), (2048, 8)])
def test_cpu_cuda_same_extras(dtype, E, k, router_kernel):
    T = 999
    logits = make_logits(T, E, dtype, "cpu")
    mask = make_mask(T, "cpu", "some")
    for sf in SCORES:
        cpu = run_fused(logits, k, sf, sf == "softmax", mask)
        gpu = run_fused(logits.cuda(), k, sf, sf == "softmax", mask.cuda())
        fp64 = dtype == torch.float64
        if fp64:
            close_ulps(gpu[0], cpu[0], dtype, cuda_cpu_fp64_ulps(E), "probs")
        else:
            same(gpu[0].cpu(), cpu[0], "probs")
        same(gpu[1].cpu(), cpu[1], "routing map")
        same(gpu[2].cpu(), cpu[2], "indices")
        close_ulps(gpu[3], cpu[3], compute_dtype(dtype), cuda_cpu_fp64_ulps(E) if fp64 else 1, "aux scores")
        rows = (gpu[3].cpu() == cpu[3]).all(1)
        if not fp64:
            assert rows.float().mean() > 0.99
        same(gpu[4].cpu()[rows], cpu[4][rows], "aux map")
        close_ulps(gpu[5], cpu[5], torch.float64, 8, "lse")


# ---- the router: one fused call vs three separate calls ----------------------------------------

def old_forward(router: TopKRouter, hidden, padding_mask=None):
    """TopKRouter.forward with the losses computed apart (separate z_loss_func and aux-score passes)."""
    cfg = router.config
    E, k = cfg.num_moe_experts, router.topk
    seq_length = hidden.shape[0]
    bsz = hidden.shape[1] if hidden.dim() == 3 else 1
    router.last_losses = {}
    logits = router.gating(router.apply_input_jitter(hidden)).reshape(-1, E)
    mask = padding_mask.reshape(-1) if padding_mask is not None else None
    num_valid = (~mask).sum() if mask is not None else None
    train = router.training and torch.is_grad_enabled()
    if cfg.moe_z_loss_coeff is not None and train:
        z = ops.z_loss_func(logits, cfg.moe_z_loss_coeff, padding_mask=mask)
        logits = router._attach(logits, z, "z_loss", cfg.moe_z_loss_coeff, num_valid)
    probs, routing_map = ops.topk_routing_with_score_function(
        logits, k, use_pre_softmax=cfg.moe_router_pre_softmax,
        num_groups=cfg.moe_router_num_groups, group_topk=cfg.moe_router_group_topk,
        scaling_factor=cfg.moe_router_topk_scaling_factor,
        score_function=cfg.moe_router_score_function, expert_bias=router.expert_bias)
    if cfg.moe_expert_capacity_factor is not None:
        probs, routing_map = ops.apply_router_token_dropping(
            probs, routing_map, router_topk=k, capacity_factor=cfg.moe_expert_capacity_factor,
            drop_policy=cfg.moe_token_drop_policy,
            pad_to_capacity=cfg.moe_pad_expert_input_to_capacity)
    coeffs = dict(zip(cfg.load_balancing_types, cfg.aux_loss_coeffs))
    aux_types = [t for t in ("aux_loss", "seq_aux_loss", "global_aux_loss") if coeffs.get(t, 0)]
    if train and aux_types:
        aux_map, scores = ops.compute_routing_scores_for_aux_loss(
            logits, k, cfg.moe_router_score_function, padding_mask=mask)
        if "aux_loss" in aux_types:
            c = coeffs["aux_loss"]
            loss = ops.load_balancing_loss(scores, aux_map, k, E, c, padding_mask=mask)
            probs = router._attach(probs, loss, "load_balancing_loss", c, num_valid)
        if "seq_aux_loss" in aux_types:
            c = coeffs["seq_aux_loss"]
            loss = ops.seq_load_balancing_loss(scores, aux_map, seq_length, bsz, k, E, c,
                                               padding_mask=mask)
            probs = router._attach(probs, loss, "seq_load_balancing_loss", c, num_valid)
        if "global_aux_loss" in aux_types:
            c = coeffs["global_aux_loss"]
            loss = ops.global_load_balancing_loss(scores, aux_map, k, E, c,
                                                  router.global_aux_buffer, padding_mask=mask)
            probs = router._attach(probs, loss, "global_load_balancing_loss", c, num_valid)
    return probs, routing_map


ROUTER_CASES = {
    "aux+z": dict(moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=0.01,
                  moe_z_loss_coeff=1e-3),
    "seq+global+z_sigmoid": dict(
        moe_router_load_balancing_type=["seq_aux_loss", "global_aux_loss"],
        moe_aux_loss_coeff=[0.02, 0.03], moe_z_loss_coeff=2e-3,
        moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
        moe_router_num_groups=4, moe_router_group_topk=2),
    "aux_pre_softmax_per_token": dict(moe_router_load_balancing_type="aux_loss",
                                      moe_aux_loss_coeff=0.01, moe_router_pre_softmax=True,
                                      calculate_per_token_loss=True),
    "z_only_sqrtsoftplus_dropping": dict(moe_router_load_balancing_type="none",
                                         moe_z_loss_coeff=1e-2,
                                         moe_router_score_function="sqrtsoftplus",
                                         moe_expert_capacity_factor=1.0),
    "aux_z_dropping": dict(moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=0.01,
                           moe_z_loss_coeff=1e-3, moe_expert_capacity_factor=1.25),
}


@pytest.mark.parametrize("case", list(ROUTER_CASES))
@pytest.mark.parametrize("masked", [False, True])
def test_router_fused_equals_unfused(device, case, masked):
    S, B, H, E = 7, 3, 32, 16
    cfg = MoEConfig(hidden_size=H, num_moe_experts=E, moe_router_topk=4, add_bias_linear=False,
                    **ROUTER_CASES[case])
    torch.manual_seed(0)
    r_new = TopKRouter(cfg).to(device)
    if r_new.expert_bias is not None:
        r_new.expert_bias.copy_(torch.randn(E) * 0.01)
    r_old = copy.deepcopy(r_new)
    hidden = torch.randn(S, B, H, device=device)
    mask = (torch.rand(S, B) < 0.25).to(device) if masked else None
    w = torch.randn(S * B, E, device=device)
    results = []
    for r, fwd in ((r_new, lambda h: r_new(h, mask)), (r_old, lambda h: old_forward(r_old, h, mask))):
        r.train()
        h = hidden.clone().requires_grad_()
        with AuxLossScale(0.5):
            probs, rmap = fwd(h)
            (probs * w).sum().backward()
        results.append((probs.detach(), rmap, dict(r.last_losses), h.grad, r.weight.grad))
    (p1, m1, l1, gh1, gw1), (p2, m2, l2, gh2, gw2) = results
    same(p1, p2, "probs")
    same(m1, m2, "routing map")
    assert list(l1) == list(l2), (list(l1), list(l2))
    for name in l1:
        if device == "cpu":
            same(l1[name], l2[name], f"loss {name}")
        else:
            close_ulps(l1[name], l2[name], torch.float32, 4, f"loss {name}")
    # the logits gradient is the same sum of the same pieces, so on the CPU the gating GEMM's
    # backward sees the same input; on CUDA the z-loss piece is CUDA's (lse from a warp sum)
    if device == "cpu":
        same(gh1, gh2, "grad hidden")
        same(gw1, gw2, "grad weight")
    else:
        close_ulps(gh1, gh2, torch.float32, 4, "grad hidden")
        close_ulps(gw1, gw2, torch.float32, 4, "grad weight")
