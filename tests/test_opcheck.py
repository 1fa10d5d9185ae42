"""Tier 3: torch.library.opcheck on every op (schema, fake tensor, autograd registration, AOT
dispatch), and torch.compile(fullgraph=True) through the router with no graph break."""
import pytest
import torch

import moe_core  # noqa: F401
from conftest import DEVICES
from moe_core import ops

OPS = torch.ops.moe_core


def samples(device):
    T, E, H, k = 12, 16, 32, 4
    logits = torch.randn(T, E, device=device, requires_grad=True)
    idx = torch.stack([torch.randperm(E, device=device)[:k] for _ in range(T)])
    inp = torch.randn(T, H, device=device, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(E, H, device=device, dtype=torch.bfloat16, requires_grad=True)
    bias = torch.randn(E, device=device, dtype=torch.bfloat16, requires_grad=True)
    yield OPS.router_topk, (logits, k, False, 0, 0, 0.0, "softmax", None)
    yield OPS.router_topk, (logits, k, True, 4, 2, 2.5, "softmax", None)
    yield OPS.router_topk, (logits, k, False, 4, 2, 2.5, "sigmoid", torch.randn(E, device=device))
    yield OPS.router_topk, (logits, k, False, 0, 0, 0.0, "sqrtsoftplus", None)
    yield OPS.router_topk_bwd, (torch.randn(T, k, device=device), logits.detach(), idx, k, False,
                                0, 0, 1.5, "sigmoid")
    yield OPS.router_topk_dense, (logits, k, False, 0, 0, 0.0, "softmax", None)
    yield OPS.router_topk_dense, (logits, k, True, 4, 2, 2.5, "softmax", None)
    yield OPS.router_topk_dense, (logits, k, False, 4, 2, 2.5, "sigmoid",
                                  torch.randn(E, device=device))
    yield OPS.router_topk_dense, (logits.detach().double().requires_grad_(), k, False, 0, 0, 0.0,
                                  "sqrtsoftplus", None)
    yield OPS.router_topk_dense_bwd, (torch.randn(T, E, device=device), logits.detach(), idx, k,
                                      False, 0, 0, 1.5, "sigmoid")
    # the fused router's extras (issue 6): aux scores + map and lse, with and without a mask
    # (the aux-score backward is aux_loss_scores_bwd: on CUDA only once that op has a kernel)
    pad = torch.rand(T, device=device) < 0.3
    aux = device == "cpu" or torch._C._dispatch_has_kernel_for_dispatch_key(
        "moe_core::aux_loss_scores_bwd", "CUDA")
    yield OPS.router_topk_fused, (logits, k, False, 0, 0, 0.0, "softmax", None, pad, aux, True)
    yield OPS.router_topk_fused, (logits, k, True, 4, 2, 2.5, "softmax", None, None, aux, False)
    yield OPS.router_topk_fused, (logits, k, False, 4, 2, 2.5, "sigmoid",
                                  torch.randn(E, device=device), pad, False, True)
    yield OPS.router_topk_fused, (logits.detach().double().requires_grad_(), k, False, 0, 0, 0.0,
                                  "sqrtsoftplus", None, pad, aux, True)
    yield OPS.router_topk_fused, (logits, k, False, 0, 0, 0.0, "sigmoid", None, None, False,
                                  False)
    yield OPS.router_lse_bwd, (torch.randn(T, device=device, dtype=torch.float64),
                               logits.detach(), torch.logsumexp(logits.detach().double(), 1), pad)
    yield OPS.topk_to_dense, (torch.randn(T, k, device=device, requires_grad=True), idx, E)
    yield OPS.topk_to_dense_bwd, (torch.randn(T, E, device=device), idx)
    if device == "cpu":
        yield OPS.router_gating_linear, (inp, w, None, torch.float32)
        yield OPS.router_gating_linear, (inp, w, bias, torch.float64)
        yield OPS.router_gating_linear_bwd, (torch.randn(T, E, device=device), inp.detach(), w.detach())
        # grouped GEMM (issue 5): uneven counts with an empty expert, both weight layouts
        off = torch.tensor([0, 5, 5, 12], device=device)
        gw = torch.randn(3, H, 8, device=device, dtype=torch.bfloat16, requires_grad=True)
        gy = torch.randn(T, 8, device=device, dtype=torch.bfloat16)
        yield OPS.grouped_gemm, (inp, gw, off)
        yield OPS.grouped_gemm, (inp, gw.detach().transpose(1, 2).contiguous(), off, True,
                                 torch.float32)
        yield OPS.grouped_gemm_dgrad, (gy, gw.detach(), off)
        yield OPS.grouped_gemm_wgrad, (inp.detach(), gy, off, True)


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_all_ops(device):
    for op, args in samples(device):
        torch.library.opcheck(op, args)


def test_every_registered_op_has_an_opcheck():
    """Each op registered with the dispatcher is opcheck-ed by some test module (this one for the
    router, the op family's own module for the others)."""
    import pathlib
    import re

    text = "\n".join(p.read_text() for p in pathlib.Path(__file__).parent.glob("test_*.py"))
    registered = sorted(n.split("::")[1] for n in
                        torch._C._dispatch_get_registrations_for_dispatch_key("CPU")
                        if n.startswith("moe_core::"))
    assert registered
    missing = [n for n in registered
               if not re.search(rf"(opcheck\(\s*(torch\.ops\.moe_core|OPS)\.{n}\b|OPS\.{n}, \()", text)]
    assert not missing, f"ops without an opcheck: {missing}"


def router(x, w, bias):
    logits = ops.router_gating_linear(x, w, None, torch.float32)
    probs, routing_map = ops.topk_routing_with_score_function(
        logits, 4, num_groups=4, group_topk=2, scaling_factor=2.5, score_function="sigmoid",
        expert_bias=bias)
    return probs, routing_map


def test_compile_fullgraph_router_forward_backward():
    torch._dynamo.reset()
    x = torch.randn(64, 32, requires_grad=True)
    w = torch.randn(16, 32, requires_grad=True)
    bias = torch.randn(16) * 0.1
    compiled = torch.compile(router, fullgraph=True, backend="aot_eager")
    p1, m1 = compiled(x, w, bias)
    (p1 * torch.arange(16.0)).sum().backward()
    g1 = (x.grad.clone(), w.grad.clone())
    x.grad = w.grad = None
    p2, m2 = router(x, w, bias)
    (p2 * torch.arange(16.0)).sum().backward()
    assert torch.equal(p1, p2) and torch.equal(m1, m2)
    assert torch.equal(g1[0], x.grad) and torch.equal(g1[1], w.grad)
