"""The dropless path waits on nothing from the host.

Router → permute → expert-side probs multiply → unpermute, forward and backward, captured into a
CUDA graph and replayed on new inputs: the replay equals eager mode bit for bit. A capture fails
outright on any host synchronisation (.item(), .tolist(), a device-to-host copy), so this is also
the test that the counts and offsets stay on the device.
"""
import pytest
import torch

import moe_core
from moe_core import ops

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


def _capture(step, static_inputs):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):  # warm-up outside the capture (allocator, lazy init)
            step(*static_inputs)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step(*static_inputs)
    return graph, outs


@needs_gpu
@pytest.mark.parametrize("score,groups", [("sigmoid", (4, 2)), ("softmax", None)])
def test_dropless_router_permute_unpermute_cuda_graph(score, groups):
    T, H, E, k = 512, 256, 16, 4
    w = torch.randn(E, H, device="cuda", requires_grad=True)
    bias = torch.randn(E, device="cuda") * 0.1 if score == "sigmoid" else None
    g = torch.randn(T, H, device="cuda")
    opts = dict(score_function=score, scaling_factor=2.5, expert_bias=bias)
    if groups:
        opts.update(num_groups=groups[0], group_topk=groups[1])

    def step(x):
        x = x.detach().requires_grad_()
        logits = x.float() @ w.t()
        probs, routing_map = ops.topk_routing_with_score_function(logits, k, **opts)
        rows, row_probs, idx, offsets, counts = ops.permute(x, routing_map, probs,
                                                            num_out_tokens=T * k)
        rows = (rows.float() * row_probs.unsqueeze(-1)).to(rows.dtype)
        out = ops.unpermute(rows, idx, (T, H))
        gx, gw = torch.autograd.grad((out.float() * g).sum(), (x, w))
        return out, gx, gw, routing_map, idx, offsets, counts

    static_x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    graph, outs = _capture(step, (static_x,))
    for _ in range(2):
        new_x = torch.randn_like(static_x)
        static_x.copy_(new_x)
        graph.replay()
        torch.cuda.synchronize()
        want = step(new_x)
        for name, a, b in zip(("out", "grad_x", "grad_w", "map", "idx", "offsets", "counts"),
                              outs, want):
            assert torch.equal(a, b), name
        assert int(outs[6].sum()) == T * k  # dropless: every (token, expert) pair has a row


@needs_gpu
@pytest.mark.parametrize("by_index", [False, True], ids=["rows-made", "rows-by-index"])
def test_layer_training_step_cuda_graph(by_index):
    """The whole MoELayer (router with aux loss, dispatch, grouped-GEMM experts, combine),
    forward and backward, in one CUDA graph, once every op it calls has a CUDA kernel; with the
    rows permute makes and with the rows read by index (top-4: the tokens' gradient in chunks)."""
    if not moe_core.layer_runs_on_cuda():
        missing = [op for op in moe_core.LAYER_OPS
                   if not torch._C._dispatch_has_kernel_for_dispatch_key(f"moe_core::{op}", "CUDA")]
        pytest.fail(f"layer ops without a CUDA kernel: {missing}")
    torch.manual_seed(0)
    cfg = moe_core.MoEConfig(hidden_size=256, num_moe_experts=8,
                             moe_router_topk=4 if by_index else 2,
                             moe_ffn_hidden_size=512, gated_linear_unit=True,
                             activation_func=torch.nn.functional.silu, add_bias_linear=False,
                             moe_aux_loss_coeff=1e-2, moe_z_loss_coeff=1e-3,
                             params_dtype=torch.bfloat16, moe_router_dtype="fp32",
                             moe_expert_rows_by_index=by_index)
    layer = moe_core.MoELayer(cfg).cuda()
    g = torch.randn(64, 4, 256, device="cuda", dtype=torch.bfloat16)

    def step(x):
        x = x.detach().requires_grad_()
        out = layer(x)
        grads = torch.autograd.grad((out.float() * g).sum(), [x] + list(layer.parameters()))
        return (out,) + tuple(grads)

    static_x = torch.randn(64, 4, 256, device="cuda", dtype=torch.bfloat16)
    graph, outs = _capture(step, (static_x,))
    new_x = torch.randn_like(static_x)
    static_x.copy_(new_x)
    graph.replay()
    torch.cuda.synchronize()
    for a, b in zip(outs, step(new_x)):
        assert torch.equal(a, b)
