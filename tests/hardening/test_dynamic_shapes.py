"""Dynamic token counts under torch.compile: one compiled graph serves every batch size.

The single-device dropless layer is compiled with ``fullgraph=True`` and the token dimension
marked dynamic, then called with several token counts. For each count the outputs, the input and
parameter gradients and the balancing buffers the forward updates must equal an eager copy of the
layer (bitwise under aot_eager, which runs the same kernels; within a few fp32 ulps under inductor,
which generates its own code for the loss arithmetic), and dynamo must have compiled once.

The permute / unpermute C++ schemas take the token count as an ``int``, which the tracer would
pin to the first value; the ``*_symint`` ops carry it as a ``SymInt`` (moe_core/ops/permute.py):
their fake kernels must give symbolic sizes and opcheck must pass on them. Outside dynamo
(make_fx, non-strict torch.export) sizes reach Python as SymInts, which the loss helpers must
accept without pinning them.
"""
import copy
import threading
from typing import Callable, Dict, List

import pytest
import torch
import torch._dynamo.testing
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from moe_core import MoEConfig, MoELayer, ops
from moe_core.ops.router_topk import z_loss_from_lse

H = 16
# no 0 or 1 (dynamo specialises those sizes); the first count is the one traced
TOKEN_COUNTS = (5, 8, 13, 3, 21)

ROUTERS: Dict[str, dict] = {
    # Megatron's default router: softmax top-k, micro-batch aux loss, plus the z-loss
    "softmax_topk": dict(moe_z_loss_coeff=1e-3),
    # DeepSeek-V3 style: sigmoid scores, group-limited top-k, expert bias, scaling, global aux loss
    "sigmoid_groups_bias": dict(
        moe_router_score_function="sigmoid", moe_router_topk=3, moe_router_num_groups=4,
        moe_router_group_topk=2, moe_router_enable_expert_bias=True,
        moe_router_topk_scaling_factor=2.5, moe_router_load_balancing_type="global_aux_loss"),
}
# layers with a capacity: the capacity is computed from the token count, symbolic too (the token
# dropping op's SymInt schema), so they compile once as the dropless ones do
CAPACITY: Dict[str, dict] = {
    "softmax_dropping": dict(moe_expert_capacity_factor=0.5),
    "softmax_drop_and_pad": dict(moe_expert_capacity_factor=1.0,
                                 moe_pad_expert_input_to_capacity=True),
}


def build_layer(router: str) -> MoELayer:
    """A tiny fp32 layer (8 experts) with the router config ``router``; a non-zero expert bias
    where it has one, so the bias changes the routing."""
    kw = dict(hidden_size=H, moe_ffn_hidden_size=24, num_moe_experts=8, moe_router_topk=2,
              add_bias_linear=False, gated_linear_unit=True, activation_func=F.silu,
              moe_router_dtype="fp32", moe_aux_loss_coeff=1e-2)
    kw.update(ROUTERS[router] if router in ROUTERS else CAPACITY[router])
    torch.manual_seed(0)
    layer = MoELayer(MoEConfig(**kw))
    if layer.router.expert_bias is not None:
        with torch.no_grad():
            layer.router.expert_bias.copy_(torch.randn(8) * 0.05)
    return layer


def step(layer: Callable, x: torch.Tensor, g: torch.Tensor, dynamic: bool):
    """Forward + backward of ``sum(out * g)``; returns ``(out, dx)``."""
    x = x.clone().requires_grad_()
    if dynamic:
        torch._dynamo.mark_dynamic(x, 0)
    out = layer(x)
    out.backward(g)
    return out.detach(), x.grad


def run_counts(router: str, backend: str, check: Callable[[torch.Tensor, torch.Tensor, str], None]
               ) -> List[int]:
    """Eager and compiled copies of one layer over TOKEN_COUNTS; ``check(ours, eager, what)`` on
    the output, dx, every parameter gradient and every buffer. Returns the compile count seen
    after each call."""
    eager = build_layer(router)
    layer = copy.deepcopy(eager)
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend(backend)
    compiled = torch.compile(layer, fullgraph=True, dynamic=None, backend=counter)
    frames = []
    gen = torch.Generator().manual_seed(1)
    for T in TOKEN_COUNTS:
        x, g = torch.randn(T, H, generator=gen), torch.randn(T, H, generator=gen)
        out_c, dx_c = step(compiled, x, g, dynamic=True)
        frames.append(counter.frame_count)
        out_e, dx_e = step(eager, x, g, dynamic=False)
        assert out_c.shape == (T, H)
        check(out_c, out_e, f"T={T} output")
        check(dx_c, dx_e, f"T={T} input grad")
        for (name, p_c), p_e in zip(layer.named_parameters(), eager.parameters()):
            check(p_c.grad, p_e.grad, f"T={T} {name} grad")
        # the forward updates the expert-bias counts and the global aux loss's running counts
        for (name, b_c), b_e in zip(layer.named_buffers(), eager.buffers()):
            check(b_c, b_e, f"T={T} buffer {name}")
        layer.zero_grad(set_to_none=True)
        eager.zero_grad(set_to_none=True)
    return frames


def bitwise(ours: torch.Tensor, eager: torch.Tensor, what: str) -> None:
    assert torch.equal(ours, eager), f"{what}: max diff {(ours - eager).abs().max().item():.3e}"


def within_fp32_ulps(ours: torch.Tensor, eager: torch.Tensor, what: str) -> None:
    # a few fp32 ulps of the tensor's scale: inductor may reorder the scalar loss arithmetic
    scale = eager.abs().max().item()
    diff = (ours - eager).abs().max().item()
    assert diff <= 8 * 2.0**-23 * max(scale, 1e-30), f"{what}: max diff {diff:.3e} at {scale:.3e}"


@pytest.mark.parametrize("router", sorted(ROUTERS))
def test_dynamic_token_count_one_graph_aot_eager(router):
    frames = run_counts(router, "aot_eager", bitwise)
    assert frames == [1] * len(TOKEN_COUNTS), f"compiles after each call: {frames}"


@pytest.mark.parametrize("layer", sorted(CAPACITY))
def test_capacity_layer_one_graph_aot_eager(layer):
    frames = run_counts(layer, "aot_eager", bitwise)
    assert frames == [1] * len(TOKEN_COUNTS), f"compiles after each call: {frames}"


def test_token_dropping_symint_op():
    """The SymInt twin of token_dropping: opcheck passes, and it is the C++ op's kernel."""
    gen = torch.Generator().manual_seed(6)
    T, E, k = 12, 6, 3
    _, routing_map, probs = _routing(T, E, k, gen)
    probs.requires_grad_()
    for cap, policy, pad in [(4, "probs", False), (6, "position", True), (T, "probs", True)]:
        args = (probs, routing_map, cap, policy, pad)
        torch.library.opcheck(torch.ops.moe_core.token_dropping_symint, args)
        ours = torch.ops.moe_core.token_dropping_symint(*args)
        cpp = torch.ops.moe_core.token_dropping(*args)
        assert all(torch.equal(a, b) for a, b in zip(ours, cpp))


def test_dynamic_token_count_one_graph_inductor():
    frames = run_counts("softmax_topk", "inductor", within_fp32_ulps)
    assert frames == [1] * len(TOKEN_COUNTS), f"compiles after each call: {frames}"


def _unique_graphs(router: str) -> int:
    """Dynamo's own count of the graphs it compiled for ``router``'s layer over TOKEN_COUNTS
    (the token dimension dynamic)."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    layer = build_layer(router)
    compiled = torch.compile(layer, fullgraph=True, dynamic=None, backend="aot_eager")
    for T in TOKEN_COUNTS:
        step(compiled, torch.randn(T, H), torch.randn(T, H), dynamic=True)
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def test_unique_graphs_counter_sees_one_graph():
    """The same property through dynamo's own statistics (no counting backend)."""
    assert _unique_graphs("sigmoid_groups_bias") == 1


def test_one_graph_with_torch_distributed_initialised():
    """With a process group up, the global aux loss reduces its counts over the default
    data-parallel group: resolving it must not change the module between the first and the second
    compiled call (no recompile), whatever ran in the process before."""
    from helpers.world_group import one_rank_world

    with one_rank_world():
        assert build_layer("sigmoid_groups_bias").router.data_parallel_group() is not None
        assert _unique_graphs("sigmoid_groups_bias") == 1


def test_one_forward_and_one_backward_graph_for_every_count():
    """AOTAutograd's own compilers see one forward and one backward graph over TOKEN_COUNTS (the
    frame count above says dynamo traced once; this says the backward was not recompiled per
    size either)."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    compiles = {"forward": 0, "backward": 0}

    def counting(kind):
        def compiler(gm, example_inputs):
            compiles[kind] += 1
            return make_boxed_func(gm.forward)
        return compiler

    torch._dynamo.reset()
    backend = aot_autograd(fw_compiler=counting("forward"), bw_compiler=counting("backward"))
    layer = build_layer("sigmoid_groups_bias")
    eager = copy.deepcopy(layer)
    compiled = torch.compile(layer, fullgraph=True, dynamic=None, backend=backend)
    seen = []
    for T in TOKEN_COUNTS:
        x, g = torch.randn(T, H), torch.randn(T, H)
        out_c, dx_c = step(compiled, x, g, dynamic=True)
        out_e, dx_e = step(eager, x, g, dynamic=False)
        bitwise(out_c, out_e, f"T={T} output")
        bitwise(dx_c, dx_e, f"T={T} input grad")
        seen.append(dict(compiles))
    assert seen == [{"forward": 1, "backward": 1}] * len(TOKEN_COUNTS), seen


def test_first_call_in_a_fresh_thread_does_not_recompile():
    """The aux-loss scale stack is per thread; a thread's first compiled call must not create
    state that the second call's guards then see changed."""
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(build_layer("softmax_topk"), fullgraph=True, backend=counter)
    frames, errors = [], []

    def body():
        try:
            for T in (6, 9):
                step(compiled, torch.randn(T, H), torch.randn(T, H), dynamic=True)
                frames.append(counter.frame_count)
        except Exception as e:  # surfaced below, in the test's own thread
            errors.append(e)

    t = threading.Thread(target=body)
    t.start()
    t.join()
    assert not errors, errors
    assert frames == [1, 1]


# ---- the SymInt ops: symbolic fake sizes, one traced graph for every size, opcheck ---------------

def _routing(T: int, E: int, k: int, gen: torch.Generator):
    idx = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)])
    routing_map = torch.zeros(T, E, dtype=torch.bool).scatter_(1, idx, True)
    probs = torch.rand(T, E, generator=gen) * routing_map
    return torch.randn(T, H, generator=gen), routing_map, probs


def _permute_unpermute(x, routing_map, probs):
    k = 3
    rows, row_probs, idx, offsets, counts = ops.permute(x, routing_map, probs,
                                                        num_out_tokens=x.shape[0] * k)
    out = ops.unpermute(rows * 2.0, idx, restore_shape=x.shape, probs=probs, pad_offsets=offsets)
    return rows, row_probs, idx, offsets, counts, out


def test_fake_kernels_give_symbolic_sizes_and_the_graph_serves_other_sizes():
    gen = torch.Generator().manual_seed(2)
    E, k = 6, 3
    gm = make_fx(_permute_unpermute, tracing_mode="symbolic")(*_routing(7, E, k, gen))
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert torch.ops.moe_core.permute_symint.default in targets
    assert torch.ops.moe_core.unpermute_symint.default in targets
    x_val = next(n for n in gm.graph.nodes if n.op == "placeholder").meta["val"]
    T = x_val.shape[0]
    assert isinstance(T, torch.SymInt)
    outs = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    rows, row_probs, idx, offsets, counts, out = (o.meta["val"] for o in outs)
    for size in (rows.shape[0], row_probs.shape[0], idx.shape[0]):
        assert isinstance(size, torch.SymInt) and statically_known_true(size == k * T), size
    assert statically_known_true(out.shape[0] == T)
    assert tuple(offsets.shape) == (E + 1,) and tuple(counts.shape) == (E,)
    # the traced graph, run at other sizes, equals the eager ops
    for n in (4, 11):
        args = _routing(n, E, k, gen)
        for got, want in zip(gm(*args), _permute_unpermute(*args)):
            assert got.shape == want.shape and torch.equal(got, want)


def test_permute_backward_graph_keeps_the_token_count_symbolic():
    """AOT autograd traces the backward with a symbolic token count: permute's backward records
    permute_bwd_symint and its gradient has the input's symbolic row count."""
    gen = torch.Generator().manual_seed(3)
    E, k = 6, 3

    def fwd_bwd(x, routing_map, probs):
        rows, row_probs, _, _, _ = ops.permute(x, routing_map, probs,
                                               num_out_tokens=x.shape[0] * k)
        return torch.autograd.grad((rows.sum(1) * row_probs).sum(), (x, probs))

    x, routing_map, probs = _routing(9, E, k, gen)
    x.requires_grad_()
    probs.requires_grad_()
    gm = make_fx(fwd_bwd, tracing_mode="symbolic")(x, routing_map, probs)
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert torch.ops.moe_core.permute_bwd_symint.default in targets
    T = next(n for n in gm.graph.nodes if n.op == "placeholder").meta["val"].shape[0]
    grads = [o.meta["val"] for o in next(n for n in gm.graph.nodes if n.op == "output").args[0]]
    assert all(statically_known_true(g.shape[0] == T) for g in grads)
    x2, m2, p2 = _routing(5, E, k, gen)
    want = fwd_bwd(x2.requires_grad_(), m2, p2.requires_grad_())
    got = gm(x2, m2, p2)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_loss_helpers_keep_a_symbolic_token_count():
    """Outside dynamo (make_fx, non-strict export) a symbolic size reaches Python as a SymInt:
    the aux loss's token total and the z-loss's mean must take it without pinning it."""
    gen = torch.Generator().manual_seed(6)

    def losses(scores, routing_map, lse):
        return (ops.load_balancing_loss(scores, routing_map, 2, 8, 1e-2),
                z_loss_from_lse(lse, 1e-3, None))

    def inputs(T):
        return (torch.rand(T, 8, generator=gen), torch.rand(T, 8, generator=gen) < 0.3,
                torch.randn(T, generator=gen, dtype=torch.float64))

    gm = make_fx(losses, tracing_mode="symbolic")(*inputs(7))
    for T in (4, 11):
        args = inputs(T)
        for got, want in zip(gm(*args), losses(*args)):
            assert torch.equal(got, want), T


# the router's logging attributes (last_losses, last_routing_load) are plain tensors by design
@pytest.mark.filterwarnings("ignore:The tensor attributes? .* assigned during export")
@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
def test_non_strict_export_with_a_dynamic_token_count(train):
    """torch.export (non-strict: the Python code runs on SymInts) of the layer's forward with a
    dynamic token dimension; the exported program at other token counts equals the layer."""
    layer = build_layer("softmax_topk").train(train)
    T = torch.export.Dim("T", min=2)
    program = torch.export.export(layer, (torch.randn(7, H),), dynamic_shapes=({0: T},),
                                  strict=False)
    for n in (4, 19):
        x = torch.randn(n, H)
        assert torch.equal(program.module()(x), layer(x)), n


def test_opcheck_symint_ops():
    gen = torch.Generator().manual_seed(4)
    T, E, k = 12, 6, 3
    x, routing_map, probs = _routing(T, E, k, gen)
    x.requires_grad_()
    probs.requires_grad_()
    for n, dap, align in [(T * k, False, 0), (T * k - 5, False, 4), (2 * E, True, 0)]:
        torch.library.opcheck(torch.ops.moe_core.permute_symint, (x, routing_map, probs, n, dap,
                                                                  align))
        torch.library.opcheck(torch.ops.moe_core.permute_symint, (x, routing_map, None, n, dap,
                                                                  align))
    rows, _, idx, off, _ = torch.ops.moe_core.permute(x.detach(), routing_map, None, T * k,
                                                      False, 4)
    R = rows.shape[0]
    torch.library.opcheck(torch.ops.moe_core.permute_bwd_symint,
                          (torch.randn(R, H), torch.randn(R), idx, off, T))
    torch.library.opcheck(torch.ops.moe_core.permute_bwd_symint,
                          (torch.randn(R, H), None, idx, off, T))
    y = torch.randn(R, H, requires_grad=True)
    torch.library.opcheck(torch.ops.moe_core.unpermute_symint, (y, idx, T, probs, off))
    torch.library.opcheck(torch.ops.moe_core.unpermute_symint, (y, idx, T, None, None))


def test_symint_ops_equal_the_cpp_ops():
    """The SymInt ops are the same kernels: identical outputs for concrete sizes."""
    gen = torch.Generator().manual_seed(5)
    T, E, k = 10, 6, 3
    x, routing_map, probs = _routing(T, E, k, gen)
    for args in [(x, routing_map, probs, T * k, False, 0), (x, routing_map, probs, 2 * E, True, 4)]:
        ours, cpp = torch.ops.moe_core.permute_symint(*args), torch.ops.moe_core.permute(*args)
        assert all(torch.equal(a, b) for a, b in zip(ours, cpp))
    rows, _, idx, off, _ = torch.ops.moe_core.permute(x, routing_map, None, T * k, False, 0)
    assert torch.equal(torch.ops.moe_core.unpermute_symint(rows, idx, T, probs, off),
                       torch.ops.moe_core.unpermute(rows, idx, T, probs, off))
    g = torch.randn_like(rows)
    for a, b in zip(torch.ops.moe_core.permute_bwd_symint(g, None, idx, off, T),
                    torch.ops.moe_core.permute_bwd(g, None, idx, off, T)):
        assert torch.equal(a, b)
