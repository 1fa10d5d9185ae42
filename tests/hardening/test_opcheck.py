"""torch.library.opcheck (schema, fake tensor, autograd registration, AOT dispatch) on every op
(the sample calls in helpers/op_samples.py), a check that each op registered with the dispatcher
is opcheck-ed by some test module, and torch.compile(fullgraph=True) through the router with no
graph break."""
import pytest
import torch

from helpers.op_samples import samples
from moe_core import ops


def test_opcheck_all_ops(device):
    for op, args in samples(device):
        torch.library.opcheck(op, args)


def test_every_registered_op_has_an_opcheck():
    """Each op registered with the dispatcher is opcheck-ed by some test module (this one, through
    helpers/op_samples.py, for the ops listed there; the op family's own module for the others)."""
    import pathlib
    import re

    tests = pathlib.Path(__file__).parents[1]
    text = "\n".join(p.read_text() for p in
                     [*tests.rglob("test_*.py"), tests / "helpers" / "op_samples.py"])
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
