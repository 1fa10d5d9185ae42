"""The swapped block's capacity options and ``torch.compile(fullgraph=True)``.

``replace_moe_blocks(..., capacity_factor=, pad_to_capacity=, drop_policy=)`` hands moe-core's
capacity rules to each swapped block's router (``MoEConfig.moe_expert_capacity_factor`` and
friends): dropped routes contribute nothing, and with padding every expert's rows are padded to
the capacity, so the expert GEMMs' shapes depend on the token count only. Every family's swapped
block compiles with ``fullgraph=True`` (no graph break: the ops' fake kernels, static permuted
sizes), dropless and padded, and its forward and every gradient equal the eager block's.
"""
import copy

import pytest
import torch

from helpers.hf_models import SWAP_FAMILIES, rel_err, tiny_model

from moe_core import ops
from moe_core.hf import MoECoreSparseMoeBlock, replace_moe_blocks

FP32_TOL = 1e-6


def _first_block(model) -> MoECoreSparseMoeBlock:
    return next(m for m in model.modules() if isinstance(m, MoECoreSparseMoeBlock))


def _no_drop_capacity(model) -> dict:
    """Pad-to-capacity with a factor whose capacity is every token (nothing dropped)."""
    dropless = copy.deepcopy(model)
    replace_moe_blocks(dropless)
    cfg = _first_block(dropless).config
    return dict(capacity_factor=cfg.num_moe_experts / cfg.moe_router_topk, pad_to_capacity=True)


def _fwd_bwd(block, x: torch.Tensor, run=None):
    """``(output, {name: grad})`` of ``block`` (called as ``run``, e.g. compiled) on ``x``
    (``x``'s gradient as ``"input"``)."""
    block.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_(True)
    out = (block if run is None else run)(x)
    y = out[0] if isinstance(out, tuple) else out
    g = torch.linspace(-1.0, 1.0, y.numel()).reshape(y.shape)
    (y * g).sum().backward()
    grads = {n: p.grad.clone() for n, p in block.named_parameters() if p.grad is not None}
    grads["input"] = x.grad.clone()
    return y.detach(), grads


@pytest.mark.parametrize("padded", [False, True], ids=["dropless", "pad-to-capacity"])
@pytest.mark.parametrize("family", SWAP_FAMILIES)
def test_swapped_block_compiles_fullgraph(family, padded):
    model = tiny_model(family)
    kwargs = _no_drop_capacity(model) if padded else {}
    replace_moe_blocks(model, **kwargs)
    block = _first_block(model)
    torch.manual_seed(3)
    x = torch.randn(2, 5, model.config.hidden_size)
    want, want_grads = _fwd_bwd(block, x)
    torch._dynamo.reset()  # each family's block is a new guard set on the same forward code
    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    got, got_grads = _fwd_bwd(block, x, compiled)
    assert rel_err(got, want) <= FP32_TOL
    assert sorted(got_grads) == sorted(want_grads) and len(got_grads) > 1
    bad = {n: rel_err(got_grads[n], w) for n, w in want_grads.items()
           if rel_err(got_grads[n], w) > FP32_TOL}
    assert not bad, bad


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss", "llama4"])
def test_pad_to_capacity_without_drops_equals_dropless(family):
    # capacity = every token: each expert's rows are padded with zero-prob filler tokens, which
    # change nothing; the permuted size is E * T whatever the routing
    model = tiny_model(family)
    padded = copy.deepcopy(model)
    replace_moe_blocks(model)
    replace_moe_blocks(padded, **_no_drop_capacity(padded))
    torch.manual_seed(4)
    x = torch.randn(2, 5, model.config.hidden_size)
    a, b = _first_block(model), _first_block(padded)
    cfg = b.config
    assert b.num_out_tokens(10) == cfg.num_moe_experts * 10
    with torch.no_grad():
        _, _, routing_map = b.router(x.reshape(10, -1))
    assert routing_map.all()  # the capacity mask: every token in every expert's rows
    want, want_grads = _fwd_bwd(a, x)
    got, got_grads = _fwd_bwd(b, x)
    assert rel_err(got, want) <= FP32_TOL
    assert all(rel_err(got_grads[n], w) <= FP32_TOL for n, w in want_grads.items())


@pytest.mark.parametrize("policy", ["probs", "position"])
@pytest.mark.parametrize("padded", [False, True], ids=["dropping", "pad-to-capacity"])
def test_capacity_drops_routes_and_the_rest_is_hf_math(policy, padded):
    # 10 tokens, top-2 of 8 experts, factor 0.5: capacity ceil(20 / 8 * 0.5) = 2 per expert, so
    # routes are dropped. The block's output is HF's experts module run on the kept routes (the
    # dropped slots' weights zeroed), and HF's own block (dropless) differs
    model = tiny_model("qwen3_moe")
    hf = copy.deepcopy(model).model.layers[0].mlp
    replace_moe_blocks(model, capacity_factor=0.5, pad_to_capacity=padded, drop_policy=policy)
    block = _first_block(model)
    assert block.config.moe_token_drop_policy == policy
    torch.manual_seed(5)
    x = torch.randn(1, 10, model.config.hidden_size)
    cap = ops.get_capacity(10 * 2, 8, 0.5)
    assert cap == 2
    with torch.no_grad():
        _, probs, routing_map = block.gate(x[0])
        got = block(x)[0]
        want_dropless = hf(x)[0]
        k = block.config.moe_router_topk
        idx = probs.topk(k, dim=-1).indices
        want = hf.experts(x[0], idx, probs.gather(1, idx))
    kept = probs > 0
    assert (kept.sum(0) <= cap).all() and kept.sum() < 10 * k  # routes were dropped
    assert routing_map.sum(0).eq(cap).all() if padded else torch.equal(routing_map, kept)
    assert rel_err(got, want) <= FP32_TOL
    assert rel_err(got, want_dropless) > 1e-3


def test_capacity_options_are_checked():
    with pytest.raises(ValueError, match="moe_pad_expert_input_to_capacity"):
        replace_moe_blocks(tiny_model("qwen3_moe"), pad_to_capacity=True)
    with pytest.raises(ValueError, match="moe_token_drop_policy"):
        replace_moe_blocks(tiny_model("qwen3_moe"), capacity_factor=1.0, drop_policy="random")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("padded", [False, True], ids=["dropless", "pad-to-capacity"])
@pytest.mark.parametrize("family", SWAP_FAMILIES)
def test_swapped_block_cuda_graph(family, padded):
    """The swapped block, forward and backward, captured in CUDA graphs
    (``make_graphed_callables``) and replayed on new values: the output and every gradient equal
    the eager block's on the same values (the same kernels; no host sync to break the capture)."""
    model = tiny_model(family)
    kwargs = _no_drop_capacity(model) if padded else {}
    replace_moe_blocks(model, **kwargs)
    block = _first_block(model).cuda()
    H = model.config.hidden_size
    torch.manual_seed(6)
    sample = torch.randn(2, 5, H, device="cuda", requires_grad=True)
    graphed = torch.cuda.make_graphed_callables(block, (sample,))
    x = torch.randn(2, 5, H, device="cuda")

    def fwd_bwd(fn):
        block.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_(True)
        out = fn(xi)
        y = out[0] if isinstance(out, tuple) else out
        g = torch.linspace(-1.0, 1.0, y.numel(), device="cuda").reshape(y.shape)
        (y * g).sum().backward()
        grads = {n: p.grad.clone() for n, p in block.named_parameters() if p.grad is not None}
        grads["input"] = xi.grad.clone()
        return y.detach(), grads

    got, got_grads = fwd_bwd(graphed)
    want, want_grads = fwd_bwd(block)
    assert rel_err(got, want) <= FP32_TOL
    assert sorted(got_grads) == sorted(want_grads) and len(got_grads) > 1
    bad = {n: rel_err(got_grads[n], w) for n, w in want_grads.items()
           if rel_err(got_grads[n], w) > FP32_TOL}
    assert not bad, bad
