"""The guards every op shares (moe_core/ops/_guards.py).

One device per call: a meta tensor among CPU ones dispatches to the fake kernel, which would
return an uninitialised CPU tensor; every op must raise instead, naming the argument and its
device, while calls with every tensor on meta keep working (shape inference, FakeTensor tracing).

No silent double backward: the backward kernels have no derivatives, so a backward with
create_graph=True whose result would carry a graph must raise, per differentiable op and through
MoELayer; where nothing requires grad the gradients are constants and must equal the ordinary
backward's. A backward kernel called directly on inputs that require grad must raise when its
output is differentiated (torch's fallback only warns and drops the gradient).

No zero tensors for unused gradients: with one output of an op used, autograd makes no zero
tensor for the others, and the gradients equal those of a backward given explicit zeros; a node
that receives no gradient at all returns None. Ordinary backward, opcheck and torch.compile are
covered by their own test modules.
"""
from typing import Iterator, List, Sequence, Tuple

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from helpers.op_samples import samples
from moe_core import MoEConfig, MoELayer
from moe_core.ops import _guards

OPS = torch.ops.moe_core
Sample = Tuple[object, tuple]


def extra_samples() -> Iterator[Sample]:
    """Ops that helpers/op_samples.py's samples leaves to other modules (the SymInt variants, the
    fused fc1, the in-place GLU backward, expert_mlp, the chunked permute backward and the
    rounding of its accumulator)."""
    T, E, H, k = 12, 4, 16, 2
    idx = torch.stack([torch.randperm(E)[:k] for _ in range(T)])
    m = torch.zeros(T, E, dtype=torch.bool).scatter_(1, idx, True)
    probs = (torch.rand(T, E) * m).requires_grad_()
    x = torch.randn(T, H, requires_grad=True)
    yield OPS.permute_symint, (x, m, probs, T * k, False, 0)
    rows, _, sidx, off, _ = OPS.permute(x.detach(), m, None, T * k, False, 0)
    R = rows.shape[0]
    yield OPS.permute_bwd_symint, (torch.randn(R, H), torch.randn(R), sidx, off, T)
    yield OPS.permute_layout_symint, (m, probs, T * k, False, 0)
    yield OPS.permute_layout_bwd_symint, (torch.randn(R), sidx, off, T)
    yield OPS.token_dropping_symint, (probs, m, 5, "probs", False)
    y = torch.randn(R, H, requires_grad=True)
    yield OPS.unpermute_symint, (y, sidx, T, probs, off)
    rows = rows.requires_grad_()
    row_probs = torch.rand(R, requires_grad=True)
    w1 = torch.randn(E, 16, H, requires_grad=True)
    w2 = torch.randn(E, H, 8, requires_grad=True)
    yield OPS.grouped_gemm_glu_probs, (rows, w1, off, row_probs, "silu", True, 0.0, None, True)
    yield OPS.expert_mlp, (rows, w1, w2, off, row_probs, x.detach(), sidx, "silu", True, 0.0,
                           None)
    yield OPS.expert_mlp, (rows, w1, torch.randn(E, H, 16, requires_grad=True), off, None, None,
                           None, "gelu", False, 0.5, None)
    yield OPS.glu_probs_bwd_, (torch.randn(R, 8), torch.randn(R, 16), torch.empty(R, 16),
                               torch.rand(R), "silu", True, 0.0, None)
    yield OPS.permute_bwd_accumulate_, (torch.zeros(T, H), torch.randn(R - 3, H), sidx, 2)
    yield OPS.rounded, (torch.randn(T, H), torch.bfloat16)


def all_samples() -> List[Sample]:
    return list(samples("cpu")) + list(extra_samples())


def name_of(op) -> str:
    return op._qualified_op_name.split("::")[1]


def registered(key: str) -> List[str]:
    names = torch._C._dispatch_get_registrations_for_dispatch_key(key)
    return sorted(n.split("::")[1] for n in names if n.startswith("moe_core::"))


# every op with a fake kernel: the C++ ops and the Python-defined ones
META_OPS = registered("Meta")
# the ops that take two tensors or more (sinkhorn, sinkhorn_routing and rounded take one)
MIXABLE = [n for n in META_OPS
           if sum("Tensor" in str(a.type) for a in getattr(OPS, n).default._schema.arguments) > 1]
# every op with an autograd formula (a Python-defined op without one gets torch's default kernel,
# which refuses inputs that require grad: nothing to guard)
GUARDED = sorted(n.split("::")[1] for n in _guards.DOUBLE_BACKWARD_GUARDED)
# the backward kernels: differentiating their outputs raises
NO_DERIVATIVE = sorted(n.split("::")[1] for n in _guards.NO_DERIVATIVE)


def samples_of(name: str) -> List[Sample]:
    found = [(op, args) for op, args in all_samples() if name_of(op) == name]
    assert found, f"no sample for moe_core::{name}"
    return found


def tensor_positions(args: Sequence) -> List[int]:
    return [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]


def argument_names(op) -> List[str]:
    return [a.name for a in op.default._schema.arguments]


def test_every_op_registers_through_the_guards():
    """No op's fake kernel or autograd formula was registered around the shared guards."""
    assert META_OPS and set(registered("CPU")) <= set(META_OPS)
    assert sorted(n.split("::")[1] for n in _guards.DEVICE_CHECKED) == META_OPS
    autograd = set(registered("Autograd"))
    assert set(META_OPS) - set(MIXABLE) == {"sinkhorn", "sinkhorn_routing", "rounded"}
    assert set(GUARDED) <= autograd
    assert set(NO_DERIVATIVE) <= autograd
    # the rest are Python-defined ops with torch's default autograd kernel
    assert autograd - set(GUARDED) - set(NO_DERIVATIVE) == {"permute_bwd_symint",
                                                            "permute_layout_bwd_symint", "rounded"}


@pytest.mark.parametrize("name", MIXABLE)
def test_meta_argument_among_cpu_ones_raises(name):
    """Each tensor argument in turn on meta, the others on the CPU: a ValueError naming it."""
    checked = 0
    for op, args in samples_of(name):
        names = argument_names(op)
        positions = tensor_positions(args)
        if len(positions) < 2:
            continue
        for i in positions:
            mixed = list(args)
            mixed[i] = args[i].detach().to("meta")
            with pytest.raises(ValueError, match=rf"^{name.removesuffix('_symint')}: ") as info:
                op(*mixed)
            msg = str(info.value)
            assert names[i] in msg and "is on meta" in msg and "is on cpu" in msg, msg
            checked += 1
    assert checked, f"moe_core::{name}: no sample with two tensor arguments"


@pytest.mark.parametrize("name", META_OPS)
def test_all_meta_call_gives_meta_outputs(name):
    for op, args in samples_of(name):
        meta = [a.detach().to("meta") if isinstance(a, torch.Tensor) else a for a in args]
        out = op(*meta)
        outs = out if isinstance(out, (tuple, list)) else [out]
        assert all(o.device.type == "meta" for o in outs if isinstance(o, torch.Tensor))


def test_fake_tensors_on_two_devices_raise():
    """Under FakeTensorMode (torch.compile's tracing) the check sees the fake devices: a CUDA
    weight with CPU rows is refused while tracing, even on a machine without a GPU."""
    with FakeTensorMode():
        x, off = torch.randn(6, 8), torch.tensor([0, 2, 6])
        with pytest.raises(ValueError, match=r"^grouped_gemm: weight is on cuda:0 but x is on cpu"):
            OPS.grouped_gemm(x, torch.empty(2, 8, 4, device="cuda"), off)
        assert OPS.grouped_gemm(x, torch.empty(2, 8, 4), off).shape == (6, 4)


def _float_outputs(out) -> List[torch.Tensor]:
    outs = out if isinstance(out, (tuple, list)) else [out]
    return [o for o in outs if isinstance(o, torch.Tensor) and o.requires_grad]


def _inputs_requiring_grad(args) -> List[torch.Tensor]:
    return [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]


def differentiable_samples(name: str) -> List[Sample]:
    found = [(op, args) for op, args in samples_of(name) if _inputs_requiring_grad(args)]
    assert found, f"no differentiable sample for moe_core::{name}"
    return found


@pytest.mark.parametrize("name", GUARDED)
def test_create_graph_raises(name):
    """A second derivative would flow through the backward kernels: the backward raises."""
    for op, args in differentiable_samples(name):
        outs = _float_outputs(op(*args))
        # weights that require grad make every incoming gradient require grad
        loss = sum((o.double() * torch.rand(o.shape, dtype=torch.float64, requires_grad=True))
                   .sum() for o in outs)
        with pytest.raises(RuntimeError, match=rf"^moe_core\.{name.removesuffix('_symint')}: "
                                               r"double backward \(create_graph=True\) is not "
                                               r"supported"):
            torch.autograd.grad(loss, _inputs_requiring_grad(args), create_graph=True)


@pytest.mark.parametrize("name", GUARDED)
def test_create_graph_without_a_graph_is_exact_or_raises(name):
    """With constant incoming gradients the result needs a graph only through saved tensors that
    require grad: then it raises; otherwise the gradients are constants equal to backward's."""
    for op, args in differentiable_samples(name):
        inputs = _inputs_requiring_grad(args)
        loss = sum(o.double().sum() for o in _float_outputs(op(*args)))
        try:
            grads = torch.autograd.grad(loss, inputs, create_graph=True, allow_unused=True)
        except RuntimeError as e:
            assert str(e).startswith(f"moe_core.{name.removesuffix('_symint')}: double backward")
            continue
        loss = sum(o.double().sum() for o in _float_outputs(op(*args)))
        expected = torch.autograd.grad(loss, inputs, allow_unused=True)
        for g, e in zip(grads, expected):
            assert g is None or not g.requires_grad
            assert (g is None) == (e is None) and (g is None or torch.equal(g, e))


def test_nonlinear_ops_raise_with_constant_incoming_gradients():
    """The check after the backward: grouped_gemm's input gradient depends on the weight, which
    requires grad, even when the incoming gradient is a constant."""
    x = torch.randn(6, 8, requires_grad=True)
    w = torch.randn(2, 8, 4, requires_grad=True)
    y = OPS.grouped_gemm(x, w, torch.tensor([0, 2, 6]))
    with pytest.raises(RuntimeError, match=r"^moe_core\.grouped_gemm: double backward"):
        torch.autograd.grad(y.sum(), x, create_graph=True)
    # only the frozen weight is saved: the gradient is a constant, and correct
    y = OPS.grouped_gemm(x, w.detach(), torch.tensor([0, 2, 6]))
    (g,) = torch.autograd.grad(y.sum(), x, create_graph=True)
    assert not g.requires_grad
    assert torch.allclose(g, torch.cat([w[0].sum(1).expand(2, 8), w[1].sum(1).expand(4, 8)]))


# the ops with an autograd formula and several outputs (the others: index and mask tensors, or a
# second float output that a caller may leave unused)
MULTI_OUTPUT = [n for n in GUARDED if len(getattr(OPS, n).default._schema.returns) > 1]


def _materialized_zeros(backward) -> List[str]:
    """The autograd nodes that made a zero tensor themselves during ``backward()``: autograd's
    stand-in for an unused output's gradient (an allocation and a fill kernel on the GPU, every
    step), made before the formula runs, so the node is the zero fill's direct parent."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        backward()
    return [e.cpu_parent.name for e in prof.events()
            if e.name in ("aten::zeros", "aten::zeros_like", "aten::fill_", "aten::zero_")
            and e.cpu_parent is not None and e.cpu_parent.name.startswith("GeneratedBackwardFor")]


@pytest.mark.parametrize("name", MULTI_OUTPUT)
def test_unused_outputs_get_no_zero_gradient(name):
    """With one float output used, the others (and the index / mask outputs) reach the formula as
    None: no zero tensor is made for them, and the gradients equal those of a backward that
    passes the unused float outputs explicit zero gradients (what autograd used to make)."""
    for op, args in differentiable_samples(name):
        inputs = _inputs_requiring_grad(args)
        for used in range(len(_float_outputs(op(*args)))):
            outs = _float_outputs(op(*args))
            weight = torch.rand(outs[used].shape, dtype=torch.float64)
            loss = (outs[used].double() * weight).sum()
            got = []
            made = _materialized_zeros(lambda: got.extend(
                torch.autograd.grad(loss, inputs, allow_unused=True)))
            assert made == [], f"{name}: output {used} used, zeros made by {made}"
            outs = _float_outputs(op(*args))
            grads = [weight.to(o.dtype) if i == used else torch.zeros_like(o)
                     for i, o in enumerate(outs)]
            expected = torch.autograd.grad(outs, inputs, grads, allow_unused=True)
            for i, (g, e) in enumerate(zip(got, expected)):
                e = None if e is not None and g is None and not e.any() else e
                assert (g is None) == (e is None), f"{name}: input {i}, output {used} used"
                assert g is None or torch.equal(g, e), f"{name}: input {i}, output {used} used"


def test_formula_with_no_incoming_gradient_returns_none():
    """A node whose every incoming gradient is None (permute's rows unused, so nothing flows back
    to the grouped_gemm that made its tokens) returns None for every input without running its
    formula, which would read the missing gradient; the probs' gradient is still exact."""
    T, E, H, k = 12, 4, 16, 2
    idx = torch.stack([torch.randperm(E)[:k] for _ in range(T)])
    m = torch.zeros(T, E, dtype=torch.bool).scatter_(1, idx, True)
    probs = (torch.rand(T, E) * m).requires_grad_()
    x = torch.randn(T, H, requires_grad=True)
    w = torch.randn(1, H, H, requires_grad=True)
    tokens = OPS.grouped_gemm(x, w, torch.tensor([0, T]))
    _, row_probs, _, _, _ = OPS.permute(tokens, m, probs, T * k, False, 0)
    weight = torch.rand(T * k, dtype=torch.float64)
    (row_probs.double() * weight).sum().backward()
    assert x.grad is None and w.grad is None
    # the rows' probs are expert-major, tokens ascending: probs.t() masked by the map's transpose
    ref = probs.detach().clone().requires_grad_()
    (ref.t()[m.t()].double() * weight).sum().backward()
    assert torch.equal(probs.grad, ref.grad)


def test_every_backward_kernel_has_no_derivative():
    """Every functional backward kernel is registered; glu_probs_bwd_ writes its inputs in place
    (the in-place path of glu_probs' own backward) and is left to torch's checks."""
    kernels = [n for n in registered("CPU") if n.endswith(("_bwd", "_dgrad", "_wgrad"))]
    assert kernels and NO_DERIVATIVE == kernels
    assert "glu_probs_bwd_" not in NO_DERIVATIVE


@pytest.mark.parametrize("name", NO_DERIVATIVE)
def test_backward_kernel_output_differentiated_raises(name):
    """Each float tensor argument requires grad: the outputs equal the call without grad, and
    differentiating them (plain backward or create_graph=True) raises naming the op."""
    for op, args in samples_of(name):
        leaves = [a.detach().requires_grad_() if isinstance(a, torch.Tensor)
                  and a.is_floating_point() else a for a in args]
        outs = op(*leaves)
        with torch.no_grad():
            want = op(*args)
        outs_list = outs if isinstance(outs, (tuple, list)) else [outs]
        want_list = want if isinstance(want, (tuple, list)) else [want]
        for o, w in zip(outs_list, want_list):
            assert (o is None) == (w is None) and (o is None or torch.equal(o, w))
        diff = [o for o in outs_list if isinstance(o, torch.Tensor) and o.requires_grad]
        assert diff, f"moe_core::{name}: no output requires grad"
        inputs = _inputs_requiring_grad(leaves)
        for create_graph in (False, True):
            loss = sum(o.double().sum() for o in diff)
            with pytest.raises(RuntimeError, match=rf"^moe_core\.{name}: has no derivative"):
                torch.autograd.grad(loss, inputs, create_graph=create_graph, allow_unused=True)


def test_layer_create_graph_raises():
    layer = MoELayer(MoEConfig(hidden_size=32, moe_ffn_hidden_size=48, num_moe_experts=8,
                               moe_router_topk=2, add_bias_linear=False, gated_linear_unit=True,
                               activation_func=F.silu, moe_router_dtype="fp32",
                               moe_aux_loss_coeff=1e-2, moe_z_loss_coeff=1e-3))
    x = torch.randn(8, 2, 32, requires_grad=True)
    loss = layer(x).square().sum()
    with pytest.raises(RuntimeError, match=r"^moe_core\.[a-z_]+: double backward "
                                           r"\(create_graph=True\) is not supported"):
        torch.autograd.grad(loss, [x, *layer.parameters()], create_graph=True)
    # the same layer still trains: an ordinary backward after the refused one
    layer(x).square().sum().backward()
    assert x.grad is not None and all(p.grad is not None for p in layer.parameters())
