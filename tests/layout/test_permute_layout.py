"""permute_layout: permute's layout without the rows (the C core's layout-only mode).

Its row probs, indices, offsets and counts must be bitwise permute's (and the loop-by-loop
reference's) on every layout: dropless, a row bound below the routed count (cut off) and above it
(unused tail rows), align_size > 1, drop-and-pad with the capacity below and above the token
count. The gradient reaches probs only and must be bitwise permute's gradient of probs, whether
permute's rows were used or not. Then opcheck, torch.compile(fullgraph=True) with a dynamic token
count, and one test per rejected argument.
"""
import pytest
import torch
import torch._dynamo.testing
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from helpers import reference_layout as ref
from moe_core import ops

OPS = torch.ops.moe_core

# (T, E, k, num_out_tokens as a function of (T, k, E), drop_and_pad, align_size)
LAYOUTS = {
    "dropless": (17, 8, 2, lambda T, k, E: T * k, False, 0),
    "aligned": (17, 8, 2, lambda T, k, E: T * k, False, 4),
    "cut_off": (17, 8, 2, lambda T, k, E: T * k - 7, False, 0),
    "cut_off_aligned": (17, 8, 2, lambda T, k, E: T * k - 7, False, 8),
    "bound_above_routed": (17, 8, 2, lambda T, k, E: T * k + 5, False, 0),
    "drop_and_pad": (24, 6, 2, lambda T, k, E: 5 * E, True, 0),
    "drop_and_pad_capacity_over_tokens": (9, 4, 2, lambda T, k, E: 13 * E, True, 4),
    "no_tokens": (0, 4, 2, lambda T, k, E: 0, False, 4),
}


def routing(T, E, k, dtype, device):
    """A map with exactly k experts per token and distinct positive probs where routed."""
    m = torch.zeros(T, E, dtype=torch.bool)
    if T:
        m.scatter_(1, torch.rand(T, E).argsort(dim=1)[:, :k], True)
    probs = torch.where(m, torch.rand(T, E, dtype=torch.float64) + 0.5, 0.0).to(dtype)
    return m.to(device), probs.to(device)


def layout_args(name, dtype=torch.float32, device="cpu"):
    T, E, k, n, dap, align = LAYOUTS[name]
    m, probs = routing(T, E, k, dtype, device)
    return m, probs, n(T, k, E), dap, align


@pytest.mark.parametrize("name", sorted(LAYOUTS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_layout_equals_permute(name, dtype, device):
    m, probs, n, dap, align = layout_args(name, dtype, device)
    H = 5
    x = torch.randn(m.shape[0], H, device=device)
    full = ops.permute(x, m, probs, num_out_tokens=n, drop_and_pad=dap, align_size=align)
    got = ops.permute_layout(m, probs, num_out_tokens=n, drop_and_pad=dap, align_size=align)
    assert len(got) == 4
    for a, b in zip(got, (full[1], full[2], full[3], full[4])):
        assert a.device == b.device and a.dtype == b.dtype and torch.equal(a, b)
    # and the loop-by-loop reference (on the CPU)
    want = ref.permute(x.cpu(), m.cpu(), probs.cpu(), n, dap, align)
    for a, b in zip(got, (want[1], want[2], want[3], want[4])):
        assert torch.equal(a.cpu(), b)
    # without probs: the same layout, no row probs
    pp, idx, off, cnt = ops.permute_layout(m, None, num_out_tokens=n, drop_and_pad=dap,
                                           align_size=align)
    assert pp is None
    assert torch.equal(idx, full[2]) and torch.equal(off, full[3]) and torch.equal(cnt, full[4])


def test_cut_off_and_tail_cases_are_what_they_say():
    """The layouts above really cut rows off / leave unused rows / pad to the capacity."""
    m, probs, n, dap, align = layout_args("cut_off")
    _, idx, off, _ = ops.permute_layout(m, probs, num_out_tokens=n)
    assert int(m.sum()) > n and int(off[-1]) == n == idx.shape[0] and bool((idx >= 0).all())
    m, probs, n, dap, align = layout_args("bound_above_routed")
    _, idx, off, _ = ops.permute_layout(m, probs, num_out_tokens=n)
    assert int(off[-1]) == int(m.sum()) < n and bool((idx[int(off[-1]):] == -1).all())
    m, probs, n, dap, align = layout_args("drop_and_pad_capacity_over_tokens")
    pp, idx, off, cnt = ops.permute_layout(m, probs, num_out_tokens=n, drop_and_pad=dap,
                                           align_size=align)
    assert cnt.tolist() == [16] * 4 and int((idx == -1).sum()) == 4 * (16 - 9)
    assert bool((pp[idx == -1] == 0).all())


@pytest.mark.parametrize("name", sorted(LAYOUTS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows_used", [False, True], ids=["probs_only", "rows_used"])
def test_probs_gradient_equals_permute(name, dtype, rows_used, device):
    """Bitwise permute's gradient of probs: through permute's probs-only backward (rows unused)
    and through its full backward (rows used, whose gradient does not touch probs)."""
    m, probs, n, dap, align = layout_args(name, dtype, device)
    x = torch.randn(m.shape[0], 3, device=device, requires_grad=True)
    p1 = probs.clone().requires_grad_()
    p2 = probs.clone().requires_grad_()
    rows, pp1, *_ = ops.permute(x, m, p1, num_out_tokens=n, drop_and_pad=dap, align_size=align)
    pp2, *_ = ops.permute_layout(m, p2, num_out_tokens=n, drop_and_pad=dap, align_size=align)
    w = torch.randn(pp1.shape[0], dtype=torch.float64, device=device)
    loss1 = (pp1.double() * w).sum() + (rows.double().sum() if rows_used else 0.0)
    loss1.backward()
    (pp2.double() * w).sum().backward()
    assert p2.grad.dtype == dtype and torch.equal(p1.grad, p2.grad)
    # each routed (token, expert) gets its row's weight, the rest zero
    pp_ref, idx, off, _ = ops.permute_layout(m.cpu(), probs.cpu(), num_out_tokens=n,
                                             drop_and_pad=dap, align_size=align)
    want = torch.zeros(probs.shape, dtype=torch.float64)
    experts = ref.row_experts(off, idx.shape[0])
    for r, t in enumerate(idx.tolist()):
        if t >= 0:
            want[t, experts[r]] += w[r].item()
    assert torch.equal(p2.grad.cpu(), want.to(dtype))


def test_no_probs_and_unused_probs_give_no_gradient():
    m, probs, n, dap, align = layout_args("dropless")
    p = probs.clone().requires_grad_()
    pp, idx, off, cnt = ops.permute_layout(m, p, num_out_tokens=n)
    # only an integer output used: no gradient flows, none is computed
    assert not idx.requires_grad and not cnt.requires_grad and pp.requires_grad
    (pp * 0).sum().backward()
    assert torch.equal(p.grad, torch.zeros_like(p))


def test_backward_kernel_equals_permute_bwd(device):
    """permute_layout_bwd == permute_bwd's grad_probs for the same rows' probs gradient."""
    for name in sorted(LAYOUTS):
        m, probs, n, dap, align = layout_args(name, torch.float32, device)
        _, idx, off, _ = ops.permute_layout(m, probs, num_out_tokens=n, drop_and_pad=dap,
                                            align_size=align)
        R, T = idx.shape[0], m.shape[0]
        g = torch.randn(R, device=device)
        got = OPS.permute_layout_bwd(g, idx, off, T)
        _, want = OPS.permute_bwd(torch.randn(R, 4, device=device), g, idx, off, T)
        assert torch.equal(got, want), name


def test_opcheck(device):
    for name in ("dropless", "cut_off_aligned", "drop_and_pad", "no_tokens"):
        m, probs, n, dap, align = layout_args(name, torch.float32, device)
        probs.requires_grad_()
        for op in (OPS.permute_layout, OPS.permute_layout_symint):
            torch.library.opcheck(op, (m, probs, n, dap, align))
            torch.library.opcheck(op, (m, None, n, dap, align))
        _, idx, off, _ = OPS.permute_layout(m, None, n, dap, align)
        g = torch.randn(idx.shape[0], device=device)
        torch.library.opcheck(OPS.permute_layout_bwd, (g, idx, off, m.shape[0]))
        torch.library.opcheck(OPS.permute_layout_bwd_symint, (g, idx, off, m.shape[0]))


def test_symint_ops_equal_the_cpp_ops():
    m, probs, n, dap, align = layout_args("aligned")
    for a, b in zip(OPS.permute_layout_symint(m, probs, n, dap, align),
                    OPS.permute_layout(m, probs, n, dap, align)):
        assert torch.equal(a, b)
    _, idx, off, _ = OPS.permute_layout(m, probs, n, dap, align)
    g = torch.randn(idx.shape[0])
    assert torch.equal(OPS.permute_layout_bwd_symint(g, idx, off, m.shape[0]),
                       OPS.permute_layout_bwd(g, idx, off, m.shape[0]))


def _layout_step(m, probs):
    """The row probs weighted by their row number: a function of the layout to differentiate."""
    pp, idx, off, cnt = ops.permute_layout(m, probs, num_out_tokens=m.shape[0] * 2,
                                           align_size=4)
    return (pp * torch.arange(pp.shape[0], dtype=pp.dtype)).sum(), idx, off, cnt


def test_compile_fullgraph_dynamic_token_count():
    """One graph (aot_eager, fullgraph) serves every token count; outputs and the probs' gradient
    equal eager bitwise."""
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(_layout_step, fullgraph=True, backend=counter)
    for T in (5, 8, 13, 3, 21):
        m, probs = routing(T, 8, 2, torch.float32, "cpu")
        p1, p2 = probs.clone().requires_grad_(), probs.clone().requires_grad_()
        torch._dynamo.mark_dynamic(m, 0)
        torch._dynamo.mark_dynamic(p1, 0)
        got = compiled(m, p1)
        want = _layout_step(m, p2)
        for a, b in zip(got, want):
            assert torch.equal(a, b), T
        got[0].backward()
        want[0].backward()
        assert torch.equal(p1.grad, p2.grad), T
    assert counter.frame_count == 1


def test_traced_graph_keeps_the_token_count_symbolic():
    """make_fx with symbolic shapes records the SymInt ops, forward and backward, and the graph
    serves other token counts."""

    def fwd_bwd(m, probs):
        pp, idx, _, _ = ops.permute_layout(m, probs, num_out_tokens=m.shape[0] * 2)
        (grad,) = torch.autograd.grad((pp * torch.arange(pp.shape[0])).sum(), (probs,))
        return pp, idx, grad

    m, probs = routing(9, 6, 2, torch.float32, "cpu")
    gm = make_fx(fwd_bwd, tracing_mode="symbolic")(m, probs.requires_grad_())
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert OPS.permute_layout_symint.default in targets
    assert OPS.permute_layout_bwd_symint.default in targets
    T = next(n for n in gm.graph.nodes if n.op == "placeholder").meta["val"].shape[0]
    pp, idx, grad = (o.meta["val"] for o in
                     next(n for n in gm.graph.nodes if n.op == "output").args[0])
    assert statically_known_true(pp.shape[0] == 2 * T) and statically_known_true(grad.shape[0] == T)
    for n in (4, 11):
        m2, p2 = routing(n, 6, 2, torch.float32, "cpu")
        for a, b in zip(gm(m2, p2.requires_grad_()), fwd_bwd(m2, p2)):
            assert torch.equal(a, b), n


# ---- bad input: one test per rejected case ------------------------------------------------------

def _setup():
    m, probs, n, dap, align = layout_args("dropless")
    _, idx, off, _ = ops.permute_layout(m, probs, num_out_tokens=n)
    return dict(m=m, p=probs, n=n, idx=idx, off=off, g=torch.randn(idx.shape[0]),
                T=m.shape[0])


BAD_CASES = {
    "num_out_none": (lambda s: ops.permute_layout(s["m"], s["p"]), ValueError, "num_out_tokens"),
    "num_out_negative": (lambda s: ops.permute_layout(s["m"], s["p"], num_out_tokens=-1),
                         ValueError, "num_out_tokens"),
    "align_negative": (lambda s: ops.permute_layout(s["m"], s["p"], num_out_tokens=4,
                                                    align_size=-2), ValueError, "align_size"),
    "align_bool": (lambda s: ops.permute_layout(s["m"], s["p"], num_out_tokens=4, align_size=True),
                   ValueError, "align_size"),
    "align_overflow": (lambda s: ops.permute_layout(s["m"], s["p"], num_out_tokens=4,
                                                    align_size=2**62), ValueError, "align_size"),
    "map_dtype": (lambda s: ops.permute_layout(s["m"].float(), s["p"], num_out_tokens=4),
                  TypeError, "routing_map"),
    "map_1d": (lambda s: ops.permute_layout(s["m"][0], None, num_out_tokens=4), ValueError,
               "routing_map"),
    "map_no_experts": (lambda s: ops.permute_layout(s["m"][:, :0], None, num_out_tokens=4),
                       ValueError, "routing_map"),
    "probs_shape": (lambda s: ops.permute_layout(s["m"], s["p"][:, :-1], num_out_tokens=4),
                    ValueError, "probs"),
    "probs_int": (lambda s: ops.permute_layout(s["m"], s["m"].long(), num_out_tokens=4),
                  TypeError, "probs"),
    "probs_meta": (lambda s: ops.permute_layout(s["m"], s["p"].to("meta"), num_out_tokens=4),
                   ValueError, "probs is on meta"),
    "bwd_grad_2d": (lambda s: OPS.permute_layout_bwd(s["g"][:, None], s["idx"], s["off"], s["T"]),
                    ValueError, "grad_permuted_probs"),
    "bwd_grad_int": (lambda s: OPS.permute_layout_bwd(s["idx"], s["idx"], s["off"], s["T"]),
                     TypeError, "grad_permuted_probs"),
    "bwd_indices_length": (lambda s: OPS.permute_layout_bwd(s["g"], s["idx"][:-1], s["off"],
                                                            s["T"]), ValueError, "sorted_indices"),
    "bwd_indices_range": (lambda s: OPS.permute_layout_bwd(s["g"], s["idx"] + s["T"], s["off"],
                                                           s["T"]), ValueError, "sorted_indices"),
    "bwd_offsets_short": (lambda s: OPS.permute_layout_bwd(s["g"], s["idx"], s["off"][:1],
                                                           s["T"]), ValueError, "expert_offsets"),
    "bwd_offsets_order": (lambda s: OPS.permute_layout_bwd(s["g"], s["idx"], s["off"].flip(0),
                                                           s["T"]), ValueError, "expert_offsets"),
    "bwd_num_tokens_negative": (lambda s: OPS.permute_layout_bwd(s["g"], s["idx"], s["off"], -1),
                                ValueError, "num_tokens"),
}


@pytest.mark.parametrize("case", sorted(BAD_CASES))
def test_bad_input(case):
    fn, exc, name = BAD_CASES[case]
    with pytest.raises(exc, match=name):
        fn(_setup())
