"""The routing rules beyond Megatron's (``normalize``, ``group_score_topk``, a selection bias with
softmax-pre) against plain-torch references of the Hugging Face families' router math
(transformers' modeling code for DeepSeek-V2 / V3, Ernie-4.5-MoE, Qwen-MoE / Mixtral, GPT-OSS;
in helpers/hf_router_rules.py), forward and backward, on the CPU; the CUDA kernels against the
CPU (skipped without a GPU).

Inputs are tie-free (Gaussian fp32 / fp64 logits, and a permuted exact grid for bf16), so the
references' ``torch.topk`` and our ranking pick the same experts in the same order (best first).
Prob tolerance: the softmax over E experts is summed in another order than torch's vectorised sum
(sqrt(E) ulps, as tests/router/test_ops.py), the renormalisation sum over k terms likewise (k ulps),
plus one ulp for each of the divisions and products; bf16 probs are one rounding of nearly equal
fp32 values (1 ulp).
"""
import pytest
import torch

from helpers.hf_router_rules import (hf_deepseek_v2, hf_deepseek_v3, hf_ernie45, hf_gpt_oss,
                                     hf_qwen)
from helpers.tolerances import assert_close_ulps, cuda_cpu_fp64_ulps, eps
from moe_core import ops
from moe_core.ops.router_topk import router_topk_fused


# ---- the cases: (reference, our router_topk options) -----------------------------------------
def _case(name: str, E: int, k: int, device: str = "cpu"):
    """(reference fn of logits, our options) for one family rule."""
    g = torch.Generator().manual_seed(E * 31 + k)
    bias = (0.05 * torch.randn(E, generator=g)).float().to(device)
    if name == "v2_greedy":
        return (lambda x: hf_deepseek_v2(x, k, "greedy", 1, 1, 16.0),
                dict(use_pre_softmax=True, scaling_factor=16.0))
    if name.startswith("v2_group"):  # groups of E/8, 3 kept, scored by their max
        return (lambda x: hf_deepseek_v2(x, k, "group_limited_greedy", 8, 3, 16.0),
                dict(use_pre_softmax=True, num_groups=8, group_topk=3, group_score_topk=1,
                     scaling_factor=16.0))
    if name.startswith("v3"):  # 8 groups, 4 kept, top-2 sums
        norm = name.endswith("_norm")
        return (lambda x: hf_deepseek_v3(x, k, bias, 8, 4, norm, 2.5),
                dict(score_function="sigmoid", expert_bias=bias, num_groups=8, group_topk=4,
                     group_score_topk=2, normalize=norm, scaling_factor=2.5))
    if name == "ernie45":
        return (lambda x: hf_ernie45(x, k, bias, 1e-12),
                dict(use_pre_softmax=True, expert_bias=bias, normalize=True))
    if name.startswith("qwen"):
        norm = name.endswith("_norm")
        return (lambda x: hf_qwen(x, k, norm),
                dict(use_pre_softmax=True, normalize=True if norm else None))
    if name == "gpt_oss":
        return lambda x: hf_gpt_oss(x, k), dict()
    raise KeyError(name)


RULES = ["v2_greedy", "v2_group", "v3_norm", "v3_raw", "ernie45", "qwen_norm", "qwen_raw",
         "gpt_oss"]
# (E, k): k below, at and above the Megatron rule's topk // group_topk == 2 (V3) or == 1 (V2),
# and a k the kept groups only just hold
SHAPES = [(64, 1), (64, 2), (64, 6), (64, 8), (64, 12), (256, 8), (32, 12)]


def tie_free_logits(T: int, E: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Distinct values per row: Gaussian for fp32 / fp64, a permuted exact grid for bf16."""
    g = torch.Generator().manual_seed(seed)
    if dtype in (torch.float32, torch.float64):
        return torch.randn(T, E, generator=g, dtype=torch.float64).to(dtype)
    vals = torch.argsort(torch.rand(T, E, generator=g), dim=1).to(torch.float64)
    return ((vals - E / 2) / (E / 8)).to(dtype)


def prob_ulps(dtype: torch.dtype, E: int, k: int) -> float:
    return 4 + E**0.5 + k if dtype in (torch.float32, torch.float64) else 1


def _valid(rule: str, E: int, k: int) -> bool:
    if rule.startswith(("v2_group", "v3")):
        kept = (3 if rule.startswith("v2") else 4) * (E // 8)
        return k <= kept
    return not (rule == "gpt_oss" and k == 1)  # a softmax over one logit: no router gradient


# ---- forward: indices exactly, probs within the derived ulps ------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
@pytest.mark.parametrize("E,k", SHAPES)
@pytest.mark.parametrize("rule", RULES)
def test_rule_forward_vs_hf_math(rule, E, k, dtype):
    if not _valid(rule, E, k):
        pytest.skip("the kept groups hold fewer than k experts")
    ref_fn, opts = _case(rule, E, k)
    x = tie_free_logits(97, E, dtype, seed=E + k)
    p_ref, i_ref = ref_fn(x)
    p, i = ops.router_topk(x, k, **opts)
    assert torch.equal(i, i_ref), f"{rule}: indices differ"
    assert p.dtype == x.dtype
    assert_close_ulps(p, p_ref, n_ulps=prob_ulps(dtype, E, k), floor=1e-30, dtype=dtype,
                      msg=f"{rule} probs")
    # the dense router and the fused one (what TopKRouter runs) route the same
    dp, dmap, di = ops.router_topk_dense(x, k, **opts)
    assert torch.equal(di, i) and torch.equal(dp.gather(1, i), p)
    assert int(dmap.sum()) == x.shape[0] * k and bool(dmap.gather(1, i).all())


# ---- backward: our gradient vs autograd through the fp64 reference --------------------------------
@pytest.mark.parametrize("E,k", [(64, 1), (64, 6), (32, 12)])
@pytest.mark.parametrize("rule", RULES)
def test_rule_backward_vs_autograd_of_hf_math(rule, E, k):
    if not _valid(rule, E, k):
        pytest.skip("the kept groups hold fewer than k experts")
    ref_fn, opts = _case(rule, E, k)
    x = tie_free_logits(33, E, torch.float64, seed=7 * E + k)
    w = torch.randn(33, k, dtype=torch.float64)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    p1, i1 = ops.router_topk(x1, k, **opts)
    p2, i2 = ref_fn(x2)
    assert torch.equal(i1, i2)
    (p1 * w).sum().backward()
    (p2 * w).sum().backward()
    # fp64 both sides, the same formula up to its summation order: a few ulps of the scale of
    # the incoming gradient (the backward cancels: g/D - sum(g v)/D^2, s (g - sum g s))
    scale = w.abs().max().item() * (opts.get("scaling_factor") or 1.0)
    assert_close_ulps(x1.grad, x2.grad, n_ulps=64, floor=scale, dtype=torch.float64,
                      msg=f"{rule} grad")
    # the dense router's backward is the same gradient
    x3 = x.clone().requires_grad_()
    dp, _, di = ops.router_topk_dense(x3, k, **opts)
    (dp.gather(1, di) * w).sum().backward()
    assert torch.equal(x3.grad, x1.grad)


@pytest.mark.parametrize("rule", ["v2_group", "v3_norm", "v3_raw", "ernie45", "qwen_norm"])
def test_rule_gradcheck_fp64(rule):
    _, opts = _case(rule, 32, 4)
    x = tie_free_logits(3, 32, torch.float64, seed=3).requires_grad_()
    fn = lambda t: ops.router_topk(t, 4, **opts)[0]  # noqa: E731
    assert torch.autograd.gradcheck(fn, (x,), eps=1e-6, atol=1e-8)
    fn_d = lambda t: ops.router_topk_dense(t, 4, **opts)[0]  # noqa: E731
    assert torch.autograd.gradcheck(fn_d, (x,), eps=1e-6, atol=1e-8)


# ---- what each flag changes, alone -------------------------------------------------------------
def test_normalize_false_is_the_raw_scores():
    x = tie_free_logits(50, 16, torch.float32)
    for sf, f in (("sigmoid", torch.sigmoid),
                  ("sqrtsoftplus", lambda t: torch.nn.functional.softplus(t).sqrt())):
        p, i = ops.router_topk(x, 4, score_function=sf, normalize=False)
        # torch's vectorised sigmoid / softplus are within an ulp of the correctly rounded value
        assert_close_ulps(p, f(x).gather(1, i), n_ulps=2, dtype=torch.float32)
        assert torch.equal(i, f(x).topk(4).indices)
        p_def, i_def = ops.router_topk(x, 4, score_function=sf)
        assert torch.equal(i_def, i) and not torch.equal(p_def, p)


def test_normalize_true_renormalises_top1():
    # Megatron's rule keeps a single sigmoid score; normalize=True divides it by itself + 1e-20
    x = tie_free_logits(20, 8, torch.float32)
    p, i = ops.router_topk(x, 1, score_function="sigmoid", normalize=True)
    s, i0 = ops.router_topk(x, 1, score_function="sigmoid")
    assert torch.equal(i, i0)
    assert_close_ulps(s, torch.sigmoid(x).gather(1, i), n_ulps=2, dtype=torch.float32)
    assert torch.equal(p, s / (s + 1e-20)) and bool((p == 1.0).all())


def test_normalize_false_with_pre_softmax_is_megatron_rule():
    x = tie_free_logits(20, 16, torch.float32)
    a = ops.router_topk(x, 3, use_pre_softmax=True, normalize=False)
    b = ops.router_topk(x, 3, use_pre_softmax=True)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_group_score_topk_equal_to_megatron_rule_is_megatron_rule():
    # topk 8, group_topk 4: Megatron scores a group by its top 8 // 4 = 2 experts
    x = tie_free_logits(64, 64, torch.float32)
    b = 0.1 * torch.randn(64)
    opts = dict(score_function="sigmoid", num_groups=8, group_topk=4, expert_bias=b)
    a = ops.router_topk(x, 8, group_score_topk=2, **opts)
    c = ops.router_topk(x, 8, **opts)
    assert torch.equal(a[0], c[0]) and torch.equal(a[1], c[1])


def test_group_score_max_can_differ_from_megatron_sum():
    # one token, 4 groups of 2; topk 4, group_topk 2 (Megatron sums a group's top 2)
    # group maxima: .9 .8 .95 .6 -> groups 0, 2; top-2 sums: 1.0 1.5 .95 1.1 -> groups 1, 3
    x = torch.tensor([[0.9, 0.1, 0.8, 0.7, 0.95, 0.0, 0.6, 0.5]])
    _, i_max = ops.router_topk(x, 4, num_groups=4, group_topk=2, group_score_topk=1)
    _, i_sum = ops.router_topk(x, 4, num_groups=4, group_topk=2)
    assert i_max.tolist() == [[4, 0, 1, 5]]
    assert i_sum.tolist() == [[2, 3, 6, 7]]


def test_softmax_selection_bias_changes_the_choice_not_the_probs():
    x = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    b = torch.tensor([0.0, 0.0, 0.0, 0.9])
    p, i = ops.router_topk(x, 2, use_pre_softmax=True, expert_bias=b)
    s = x.softmax(-1)
    assert i.tolist() == [[3, 0]]  # 0.032 + 0.9 ranks first
    assert_close_ulps(p, s[:, [3, 0]], n_ulps=4, dtype=torch.float32)


def test_selection_bias_with_softmax_fused_aux_outputs_stay_megatrons():
    # the aux-loss scores and map ignore the bias (Megatron's compute_routing_scores_for_aux_loss)
    x = tie_free_logits(40, 16, torch.float32)
    b = torch.zeros(16)
    b[5] = 1.0
    out = router_topk_fused(x, 3, use_pre_softmax=True, expert_bias=b, with_aux=True)
    plain = router_topk_fused(x, 3, use_pre_softmax=True, with_aux=True)
    assert bool(out[1][:, 5].all()) and not bool(plain[1][:, 5].all())
    assert torch.equal(out[3], plain[3]) and torch.equal(out[4], plain[4])


# ---- CUDA: every kernel path against the CPU --------------------------------------------------
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize("E,k", [(64, 6), (64, 1), (256, 8), (512, 8), (2048, 8)])
@pytest.mark.parametrize("rule", RULES)
def test_rule_cuda_like_cpu(rule, E, k, dtype, router_kernel):
    if not _valid(rule, E, k):
        pytest.skip("the kept groups hold fewer than k experts")
    _, opts = _case(rule, E, k)
    gopts = {n: (v.cuda() if isinstance(v, torch.Tensor) else v) for n, v in opts.items()}
    x = tie_free_logits(300, E, dtype, seed=E + k)
    xc, xg = x.clone().requires_grad_(), x.cuda().requires_grad_()
    pc, ic = ops.router_topk(xc, k, **opts)
    pg, ig = ops.router_topk(xg, k, **gopts)
    assert torch.equal(ic, ig.cpu())
    n = cuda_cpu_fp64_ulps(E) if dtype == torch.float64 else 1
    assert_close_ulps(pg, pc, n_ulps=n, floor=1e-30, dtype=dtype)
    w = torch.randn(300, k, dtype=torch.float64)
    (pc.double() * w).sum().backward()
    (pg.double() * w.cuda()).sum().backward()
    # each logit's gradient is a cancellation of terms of the incoming gradient's scale (at
    # k = 1 renormalised, p / (p + 1e-20) is flat: its gradient is all rounding, ~1e-19)
    scale = max(xc.grad.abs().max().item(), w.abs().max().item() * (opts.get("scaling_factor") or 1.0))
    assert_close_ulps(xg.grad, xc.grad, n_ulps=2 * n, floor=scale, dtype=dtype)
    # the fused dense router with its extras (the fp32 lanes / strided kernels)
    fc = router_topk_fused(x, k, with_aux=True, with_lse=True, **opts)
    fg = router_topk_fused(x.cuda(), k, with_aux=True, with_lse=True, **gopts)
    assert torch.equal(fc[1], fg[1].cpu()) and torch.equal(fc[2], fg[2].cpu())
    assert_close_ulps(fg[0], fc[0], n_ulps=n, floor=1e-30, dtype=dtype)
    assert torch.equal(fc[4], fg[4].cpu())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("G,gn", [(64, 1), (64, 2), (16, 3)])
def test_group_score_cuda_many_groups_like_cpu(G, gn):
    # more than 32 groups: the thread-per-token fallback; 16 groups of 16 with top-3 sums
    E, k = 256, 8
    x = tie_free_logits(200, E, torch.float32, seed=G + gn)
    opts = dict(score_function="sigmoid", num_groups=G, group_topk=4, group_score_topk=gn,
                normalize=False)
    pc, ic = ops.router_topk(x, k, **opts)
    pg, ig = ops.router_topk(x.cuda(), k, **opts)
    assert torch.equal(ic, ig.cpu())
    assert_close_ulps(pg, pc, n_ulps=1, floor=1e-30, dtype=torch.float32)


def test_prob_tolerance_is_not_vacuous():
    # the derived bound is tight enough to see a wrong rule: renormalised vs raw sigmoid probs
    x = tie_free_logits(20, 64, torch.float32)
    p_raw, _ = ops.router_topk(x, 6, score_function="sigmoid", normalize=False)
    p_norm, _ = ops.router_topk(x, 6, score_function="sigmoid", normalize=True)
    with pytest.raises(AssertionError):
        assert_close_ulps(p_raw, p_norm, n_ulps=prob_ulps(torch.float32, 64, 6), floor=1e-30,
                          dtype=torch.float32)
    assert eps(torch.float32) * prob_ulps(torch.float32, 64, 6) < 1e-5
