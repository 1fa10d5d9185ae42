"""The interleaved GLU layout (Megatron's moe_mlp_glu_interleave_size) in the fused expert ops:
glu_probs, grouped_gemm_glu_probs and expert_mlp on interleaved columns / fc1 rows equal, bit for
bit, the same ops on the layout Megatron's own ``TEGroupedMLP._remove_glu_interleaving`` makes
of them (gate half, linear half), forward and backward; the gradients come back interleaved.
One exception: the rows' gradient through fc1 sums over fc1's 2F outputs, which the layout puts
in another order, so it is equal within that sum's rounding."""
import pytest
import torch

from megatron.core.transformer.moe.experts import TEGroupedMLP
from moe_core import ops

OPS = torch.ops.moe_core
DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float64]


def deinterleaved(x: torch.Tensor, size: int) -> torch.Tensor:
    """Megatron's layout change, along the last dim (a GLU's 2F columns)."""
    return TEGroupedMLP._remove_glu_interleaving(x.contiguous(), size)


def interleaved(x: torch.Tensor, size: int) -> torch.Tensor:
    """The inverse of :func:`deinterleaved`: gate block, linear block, gate block, ..."""
    shape = x.shape
    return x.reshape(-1, 2, shape[-1] // (2 * size), size).transpose(1, 2).reshape(shape)


def assert_bitwise(ours, ref, name):
    assert ours.dtype == ref.dtype and ours.shape == ref.shape, name
    same = (ours == ref) | (ours.isnan() & ref.isnan())
    assert bool(same.all()), f"{name}: {int((~same).sum())} of {ours.numel()} differ"


def test_interleaved_is_the_inverse_of_megatrons_layout_change():
    x = torch.arange(2 * 24).reshape(2, 24)
    for size in (1, 2, 3, 4, 12):
        assert torch.equal(deinterleaved(interleaved(x, size), size), x)
    # size 1 is GPT-OSS's: gate, up, gate, up, ...
    assert deinterleaved(torch.arange(8).reshape(1, 8), 1).tolist() == [[0, 2, 4, 6, 1, 3, 5, 7]]


@pytest.mark.megatron
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("act,offset,clamp", [("silu", 0.0, None), ("gelu_tanh", 1.0, 2.5),
                                              ("quick_gelu", 1.0, 7.0), ("relu", 0.0, None)])
@pytest.mark.parametrize("size", [1, 3, 8, 24])
def test_glu_probs_forward_and_backward(device, dtype, act, offset, clamp, size):
    F_ = 24
    a_std = (torch.randn(37, 2 * F_, dtype=torch.float64) * 3).to(dtype).to(device)
    probs = torch.rand(37, dtype=torch.float32, device=device)
    a_int = interleaved(a_std, size)
    assert torch.equal(deinterleaved(a_int, size), a_std)
    h = ops.glu_probs(a_int, probs, act, True, offset, clamp, glu_interleave_size=size)
    h_std = ops.glu_probs(a_std, probs, act, True, offset, clamp)
    assert_bitwise(h, h_std, "h")
    g = torch.randn_like(h)
    ga, gp = OPS.glu_probs_bwd(g, a_int, probs, act, True, offset, clamp, size)
    ga_std, gp_std = OPS.glu_probs_bwd(g, a_std, probs, act, True, offset, clamp)
    assert_bitwise(deinterleaved(ga, size), ga_std, "grad_a")
    assert_bitwise(gp, gp_std, "grad_probs")
    # in place: grad_h becomes h, grad_a is a
    a_copy, g_copy = a_int.clone(), g.clone()
    gp_inplace = OPS.glu_probs_bwd_(g_copy, a_copy, a_copy, probs, act, True, offset, clamp, size)
    assert_bitwise(a_copy, ga, "grad_a in place")
    assert_bitwise(g_copy, h, "h in place")
    assert_bitwise(gp_inplace, gp, "grad_probs in place")


@pytest.mark.megatron
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("size", [1, 4])
def test_fc1_and_whole_mlp_on_interleaved_rows(device, dtype, size):
    E, H, F_, R = 3, 16, 8, 20
    x = torch.randn(R, H, dtype=dtype, device=device)
    w1_std = (torch.randn(E, 2 * F_, H) / 4).to(dtype).to(device)
    w2 = (torch.randn(E, H, F_) / 3).to(dtype).to(device)
    # fc1's output columns are weight1's rows: interleave the rows
    w1_int = interleaved(w1_std.transpose(1, 2), size).transpose(1, 2).contiguous()
    offsets = torch.tensor([0, 7, 7, 18], device=device)
    probs = torch.rand(R, device=device)

    def run(w1, interleave, op):
        xs, w1s, w2s, ps = (t.clone().requires_grad_() for t in (x, w1, w2, probs))
        if op == "fc1":
            h, _a = ops.grouped_gemm_glu_probs(xs, w1s, offsets, ps, "silu", True,
                                               glu_interleave_size=interleave)
            y = h
        else:
            y = ops.expert_mlp(xs, w1s, w2s, offsets, ps, "silu", True,
                               glu_interleave_size=interleave)
        y.backward(torch.ones_like(y))
        return y, xs.grad, w1s.grad, w2s.grad if op != "fc1" else None, ps.grad

    for op in ("fc1", "mlp"):
        y, gx, gw1, gw2, gp = run(w1_int, size, op)
        y_s, gx_s, gw1_s, gw2_s, gp_s = run(w1_std, 0, op)
        assert_bitwise(y, y_s, f"{op} out")
        # fc1's dgrad sums over the 2F columns in the layout's order: fp32 sums differ in the
        # last bits, which a bf16 result may round either way
        tol = (2 * 2.0**-8) if dtype == torch.bfloat16 else 64 * 2.0**-24
        scale = gx_s.double().abs().max().item()
        assert (gx.double() - gx_s.double()).abs().max().item() <= tol * scale, f"{op} grad x"
        assert_bitwise(deinterleaved(gw1.transpose(1, 2), size).transpose(1, 2), gw1_s,
                       f"{op} grad w1")
        if gw2 is not None:
            assert_bitwise(gw2, gw2_s, f"{op} grad w2")
        assert_bitwise(gp, gp_s, f"{op} grad probs")


def test_compiled_fullgraph_passes_the_size():
    a = torch.randn(5, 12)
    probs = torch.rand(5)
    fn = torch.compile(lambda a, p: ops.glu_probs(a, p, "silu", True, glu_interleave_size=2),
                       fullgraph=True, backend="aot_eager")
    assert torch.equal(fn(a, probs), ops.glu_probs(a, probs, "silu", True,
                                                   glu_interleave_size=2))
    assert not torch.equal(fn(a, probs), ops.glu_probs(a, probs, "silu", True))


@pytest.mark.parametrize("call,message", [
    (lambda a: ops.glu_probs(a, None, "silu", True, glu_interleave_size=5),
     "interleave=5 must divide ffn=6"),
    (lambda a: ops.glu_probs(a, None, "silu", False, glu_interleave_size=2),
     "interleave=2 needs gated_linear_unit"),
    (lambda a: ops.glu_probs(a, None, "silu", True, glu_interleave_size=-1),
     "glu_interleave_size must be None or an int >= 0, got -1"),
    (lambda a: OPS.glu_probs(a, None, "silu", True, 0.0, None, -2),
     "interleave must be >= 0, got -2"),
])
def test_bad_interleave_is_named(call, message):
    with pytest.raises(ValueError, match=message):
        call(torch.randn(3, 12))


def test_opcheck():
    a = torch.randn(6, 16, requires_grad=True)
    probs = torch.rand(6, requires_grad=True)
    torch.library.opcheck(OPS.glu_probs, (a, probs, "silu", True, 0.5, 3.0, 4))
    x = torch.randn(6, 8, requires_grad=True)
    w = torch.randn(2, 16, 8, requires_grad=True)
    torch.library.opcheck(OPS.grouped_gemm_glu_probs,
                          (x, w, torch.tensor([0, 2, 6]), probs, "silu", True, 0.0, None, True,
                           None, 2))
