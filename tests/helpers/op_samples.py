"""Sample calls of the ops for torch.library.opcheck: tests/hardening/test_opcheck.py runs
opcheck on each, tests/hardening/test_guards.py reuses them for the one-device and
double-backward guards."""
from typing import Iterator, Tuple

import torch

import moe_core  # noqa: F401  (registers torch.ops.moe_core)

OPS = torch.ops.moe_core


def samples(device: str) -> Iterator[Tuple[object, tuple]]:
    """(op, args) pairs on `device` covering the router, layout, balancing, glu_probs and grouped
    GEMM ops (small shapes, the main option combinations), each fit for torch.library.opcheck."""
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
    # the named rules beyond Megatron's: normalize, group_score_topk
    yield OPS.router_topk, (logits, k, False, 4, 2, 0.0, "sigmoid", None, False, 1)
    yield OPS.router_topk_bwd, (torch.randn(T, k, device=device), logits.detach(), idx, k, False,
                                0, 0, 1.5, "sigmoid")
    yield OPS.router_topk_bwd, (torch.randn(T, k, device=device), logits.detach(), idx, k, True,
                                0, 0, 0.0, "softmax", True)
    yield OPS.router_topk_dense, (logits, k, False, 0, 0, 0.0, "softmax", None)
    yield OPS.router_topk_dense, (logits, k, True, 4, 2, 2.5, "softmax", None)
    yield OPS.router_topk_dense, (logits, k, False, 4, 2, 2.5, "sigmoid",
                                  torch.randn(E, device=device))
    yield OPS.router_topk_dense, (logits.detach().double().requires_grad_(), k, False, 0, 0, 0.0,
                                  "sqrtsoftplus", None)
    yield OPS.router_topk_dense, (logits, k, True, 0, 0, 0.0, "softmax", None, True)
    yield OPS.router_topk_dense_bwd, (torch.randn(T, E, device=device), logits.detach(), idx, k,
                                      False, 0, 0, 1.5, "sigmoid")
    yield OPS.router_topk_dense_bwd, (torch.randn(T, E, device=device), logits.detach(), idx, k,
                                      False, 4, 2, 0.0, "sigmoid", False, 2)
    # the fused router's extras: aux scores + map and lse, with and without a mask
    pad = torch.rand(T, device=device) < 0.3
    yield OPS.router_topk_fused, (logits, k, False, 0, 0, 0.0, "softmax", None, pad, True, True)
    yield OPS.router_topk_fused, (logits, k, True, 4, 2, 2.5, "softmax", None, None, True, False)
    yield OPS.router_topk_fused, (logits, k, False, 4, 2, 2.5, "sigmoid",
                                  torch.randn(E, device=device), pad, False, True)
    yield OPS.router_topk_fused, (logits.detach().double().requires_grad_(), k, False, 0, 0, 0.0,
                                  "sqrtsoftplus", None, pad, True, True)
    yield OPS.router_topk_fused, (logits, k, False, 0, 0, 0.0, "sigmoid", None, None, False,
                                  False)
    yield OPS.router_topk_fused, (logits, k, False, 4, 2, 2.5, "sqrtsoftplus", None, pad, True,
                                  True, None, 2)
    yield OPS.router_lse_bwd, (torch.randn(T, device=device, dtype=torch.float64),
                               logits.detach(), torch.logsumexp(logits.detach().double(), 1), pad)
    yield OPS.topk_to_dense, (torch.randn(T, k, device=device, requires_grad=True), idx, E)
    yield OPS.topk_to_dense_bwd, (torch.randn(T, E, device=device), idx)
    # token layout: every layout, with and without probs
    m = torch.zeros(T, E, dtype=torch.bool, device=device).scatter_(1, idx, True)
    probs = (torch.rand(T, E, device=device) * m).requires_grad_()
    x = torch.randn(T, H, device=device, dtype=torch.bfloat16, requires_grad=True)
    yield OPS.token_dropping, (probs, m, 3, "probs", False)
    yield OPS.token_dropping, (probs, m, 3, "position", True)
    yield OPS.token_dropping_bwd, (torch.randn(T, E, device=device), m)
    yield OPS.tokens_per_expert, (m, torch.rand(T, device=device) < 0.3)
    for n, dap, align in [(T * k, False, 0), (T * k - 5, False, 8), (2 * E, True, 0),
                          (5 * E, True, 4)]:
        yield OPS.permute, (x, m, probs, n, dap, align)
        yield OPS.permute, (x, m, None, n, dap, align)
        yield OPS.permute_layout, (m, probs, n, dap, align)
        yield OPS.permute_layout, (m, None, n, dap, align)
    rows, _, sidx, off, _ = OPS.permute(x.detach(), m, None, T * k, False, 4)
    R = rows.shape[0]
    yield OPS.permute_bwd, (torch.randn(R, H, device=device), torch.randn(R, device=device), sidx,
                            off, T)
    yield OPS.permute_bwd, (torch.randn(R, H, device=device), None, sidx, off, T)
    yield OPS.permute_layout_bwd, (torch.randn(R, device=device), sidx, off, T)
    y = torch.randn(R, H, device=device, requires_grad=True)
    yield OPS.unpermute, (y, sidx, T, probs, off)
    yield OPS.unpermute, (y, sidx, T, None, None)
    yield OPS.unpermute_bwd, (torch.randn(T, H, device=device), sidx, probs.detach(), off,
                              y.detach())
    yield OPS.unpermute_bwd, (torch.randn(T, H, device=device), sidx, None, None, None)
    split = torch.tensor([2, 0, 4, 3, 3], device=device)
    order = torch.tensor([2, 0, 4, 3, 1], device=device)
    yield OPS.sort_chunks_by_idxs, (x, split, order)
    yield OPS.sort_chunks_by_idxs_bwd, (torch.randn(T, H, device=device), split, order)
    yield OPS.router_gating_linear, (inp, w, None, torch.float32)
    yield OPS.router_gating_linear, (inp, w, bias, torch.float64)
    yield OPS.router_gating_linear, (inp, w.detach().float().requires_grad_(), None, torch.float32)
    yield OPS.router_gating_linear_bwd, (torch.randn(T, E, device=device), inp.detach(), w.detach())
    yield OPS.router_gating_linear_bwd, (torch.randn(T, E, device=device, dtype=torch.float64),
                                         inp.detach(), w.detach())
    # load balancing: padded and unpadded
    pad = torch.rand(T, device=device) < 0.3
    probs = torch.rand(T, E, device=device, requires_grad=True)
    counts = torch.randint(0, 9, (E,), device=device).float()
    total = torch.tensor(17.0, dtype=torch.float64, device=device)
    routing_map = torch.rand(T, E, device=device) < 0.3
    yield OPS.aux_loss_scores, (logits, k, "sigmoid", pad)
    yield OPS.aux_loss_scores_bwd, (torch.randn(T, E, device=device), logits.detach(), "softmax",
                                    None)
    yield OPS.switch_aux_loss, (probs, counts, total, k, E, 0.1, pad)
    yield OPS.switch_aux_loss_bwd, (torch.tensor(1.5, device=device), probs.detach(), counts, total,
                                    k, E, 0.1, None)
    yield OPS.z_loss, (logits, 0.01, pad)
    yield OPS.z_loss_bwd, (torch.tensor(2.0, device=device), logits.detach(), 0.01, pad)
    yield OPS.expert_bias_update, (counts, torch.randn(E, device=device), 1e-3)
    yield OPS.sinkhorn, (logits.detach(), 1e-4, 0)
    yield OPS.sinkhorn_routing, (logits, 2, True, 1e-4)
    yield OPS.sinkhorn_routing_bwd, (torch.randn(T, E, device=device), logits.detach(), routing_map,
                                     2)
    yield OPS.routing_metrics, (routing_map, probs.detach(), pad)
    yield OPS.topk_overlap, (idx, idx.flip(1), E, pad)
    # glu_probs: GLU with probs, offset and clamp; plain activation, no probs
    ga = torch.randn(T, 16, device=device, dtype=torch.bfloat16, requires_grad=True)
    gp = torch.rand(T, device=device, requires_grad=True)
    yield OPS.glu_probs, (ga, gp, "silu", True, 0.5, 2.0)
    yield OPS.glu_probs, (ga, None, "gelu", False, 0.0, None)
    yield OPS.glu_probs_bwd, (torch.randn(T, 8, device=device, dtype=torch.bfloat16), ga.detach(),
                              gp.detach(), "gelu_tanh", True, 0.0, None)
    # grouped GEMM: uneven counts with an empty expert, both weight layouts, the
    # tensor-core path (H = 32, 8 columns) and on CUDA the SIMT path (fp32, 5 columns)
    off = torch.tensor([0, 5, 5, 12], device=device)
    gw = torch.randn(3, H, 8, device=device, dtype=torch.bfloat16, requires_grad=True)
    gy = torch.randn(T, 8, device=device, dtype=torch.bfloat16)
    yield OPS.grouped_gemm, (inp, gw, off)
    yield OPS.grouped_gemm, (inp, gw.detach().transpose(1, 2).contiguous(), off, True,
                             torch.float32)
    yield OPS.grouped_gemm_dgrad, (gy, gw.detach(), off)
    yield OPS.grouped_gemm_wgrad, (inp.detach(), gy, off, True)
    yield OPS.grouped_gemm, (inp.detach().float().requires_grad_(),
                             torch.randn(3, 5, H, device=device, requires_grad=True), off, True)
