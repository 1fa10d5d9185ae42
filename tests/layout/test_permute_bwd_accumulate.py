"""permute_bwd_accumulate_: permute's backward summed chunk by chunk into an fp32 accumulator.

The contract: starting from permute_bwd_accumulator (fp32 zeros) and adding the rows' gradient in
ascending chunks, however split, acc.to(dtype) is bitwise permute_bwd's grad_tokens, on the CPU
and on CUDA. The layouts have -1 rows (alignment padding and the unused tail of the row bound),
tokens routed nowhere, and tokens whose rows fall into several chunks; the values include -0.0,
subnormals and magnitudes whose sums round or overflow in the target dtype.
"""
import pytest
import torch

from moe_core import ops

OPS = torch.ops.moe_core
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
INT_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def layout(T=24, E=6, k=3, H=40, align=4, unrouted=(0, 5, 17)):
    """permute's sorted_indices and expert_offsets for a map with k experts per token (none for
    the `unrouted` tokens), expert blocks padded to `align` and a row bound past the routed
    count, so both kinds of -1 row occur."""
    m = torch.zeros(T, E, dtype=torch.bool)
    m.scatter_(1, torch.rand(T, E).argsort(dim=1)[:, :k], True)
    m[list(unrouted)] = False
    x = torch.randn(T, H)
    _, _, sidx, off, _ = ops.permute(x, m, num_out_tokens=T * k + 5, align_size=align)
    return sidx, off


def grad_rows(R, H, dtype, sidx):
    """Rows' gradient with signed zeros, subnormals, large and small magnitudes; padding rows
    hold garbage (they must be skipped, as permute_bwd skips them)."""
    g = torch.randn(R, H, dtype=torch.float64)
    scale = torch.tensor([1.0, 1e-3, 1e3, 3e4])[torch.randint(0, 4, (R, H))].double()
    g = g * scale
    if dtype == torch.float32:
        g[:, 1] = g[:, 1] * 1e33  # sums near fp32's max
        g[:, 2] = torch.randn(R).double() * 1e-40  # fp32 subnormals
    elif dtype == torch.float16:
        g[:, 1] = 6e4 * torch.sign(torch.randn(R)).double()  # sums overflow fp16 to inf
        g[:, 2] = torch.randn(R).double() * 1e-7  # fp16 subnormals
    else:
        g[:, 1] = torch.randn(R).double() * 1e38
        g[:, 2] = torch.randn(R).double() * 1e-39
    g[:, 0] = -0.0  # every row -0.0: permute_bwd's sum is +0.0
    g[::3, 3] = -0.0
    g = g.to(dtype)
    g[sidx < 0] = 7.0  # padding rows: must not count
    return g


def splits(R):
    """Chunk boundaries [(lo, hi)]: one chunk, two, three, and uneven ones with empty chunks."""
    return {
        "one": [(0, R)],
        "two": [(0, R // 2), (R // 2, R)],
        "three": [(0, R // 3), (R // 3, 2 * R // 3), (2 * R // 3, R)],
        "uneven": [(0, 0), (0, 1), (1, 8), (8, 8), (8, R - 2), (R - 2, R), (R, R)],
        "rows": [(r, r + 1) for r in range(R)],
    }


def bits(t):
    return t.view(INT_VIEW[t.dtype])


def accumulate(device, g, sidx, T, bounds):
    acc = ops.permute_bwd_accumulator(T, g.shape[1], device)
    for lo, hi in bounds:
        ops.permute_bwd_accumulate_(acc, g[lo:hi], sidx, lo)
    return acc


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("split", ["one", "two", "three", "uneven", "rows"])
def test_chunked_sum_is_permute_bwd_bitwise(dtype, split, device):
    T, H = 24, 40
    sidx, off = layout(T=T, H=H)
    R = sidx.shape[0]
    g = grad_rows(R, H, dtype, sidx)
    sidx_d, off_d, g_d = sidx.to(device), off.to(device), g.to(device)
    expected = OPS.permute_bwd(g_d, None, sidx_d, off_d, T)[0]
    bounds = splits(R)[split]
    if split in ("two", "three"):  # some token's rows really are spread over the chunks
        chunk_of = {r: i for i, (lo, hi) in enumerate(bounds) for r in range(lo, hi)}
        assert any(len({chunk_of[r] for r in (sidx == t).nonzero().flatten().tolist()}) > 1
                   for t in range(T))
    acc = accumulate(device, g_d, sidx_d, T, bounds)
    got = acc.to(dtype)
    assert torch.equal(bits(got), bits(expected))
    # the cases the values were chosen for actually occur
    assert (bits(got[:, 0]) == 0).all()  # rows of -0.0 sum to +0.0, no row at all gives +0.0
    for t in (0, 5, 17):  # routed nowhere: +0.0 everywhere
        assert (bits(got[t]) == 0).all()
    if dtype == torch.float16:
        assert torch.isinf(got[:, 1]).any()
    if device == "cuda":  # and the CPU's bits
        cpu_acc = accumulate("cpu", g, sidx, T, bounds)
        assert torch.equal(bits(acc.cpu()), bits(cpu_acc))


def test_accumulates_onto_what_acc_holds(device):
    """acc is added to, not overwritten: two passes over the rows give fp32(2 * sum) exactly
    where the sum is exact (small integers)."""
    T, H = 10, 8
    sidx, _ = layout(T=T, E=4, k=2, H=H, unrouted=(3,))
    g = torch.randint(-4, 5, (sidx.shape[0], H)).float().to(device)
    sidx = sidx.to(device)
    acc = ops.permute_bwd_accumulator(T, H, device)
    once = accumulate(device, g, sidx, T, [(0, sidx.shape[0])])
    for _ in range(2):
        ops.permute_bwd_accumulate_(acc, g, sidx, 0)
    assert torch.equal(acc, 2 * once)
    # a direct reference: each token's rows, ascending
    ref = torch.zeros(T, H)
    for r, t in enumerate(sidx.cpu().tolist()):
        if t >= 0:
            ref[t] += g[r].cpu()
    assert torch.equal(once.cpu(), ref)


def test_accumulator_is_fp32_positive_zeros():
    acc = ops.permute_bwd_accumulator(5, 3)
    assert acc.dtype == torch.float32 and acc.shape == (5, 3) and acc.is_contiguous()
    assert (acc.view(torch.int32) == 0).all()  # +0.0, not -0.0


def test_opcheck(device):
    sidx, _ = layout(T=12, E=4, k=2, H=16, unrouted=(2,))
    sidx = sidx.to(device)
    for dtype in DTYPES:
        g = torch.randn(7, 16, device=device).to(dtype)
        torch.library.opcheck(OPS.permute_bwd_accumulate_,
                              (torch.zeros(12, 16, device=device), g, sidx, 3))


def test_compile_fullgraph_loop_equals_eager(device):
    T, H = 24, 40
    sidx, _ = layout(T=T, H=H)
    R = sidx.shape[0]
    g = grad_rows(R, H, torch.bfloat16, sidx).to(device)
    sidx = sidx.to(device)
    bounds = splits(R)["uneven"]

    def run(g, sidx):
        acc = ops.permute_bwd_accumulator(T, H, g.device)
        for lo, hi in bounds:
            ops.permute_bwd_accumulate_(acc, g[lo:hi] * 1, sidx, lo)
        return acc.to(torch.bfloat16)

    torch._dynamo.reset()
    got = torch.compile(run, fullgraph=True)(g, sidx)
    assert torch.equal(bits(got), bits(run(g, sidx)))


# ---- bad inputs: one test each, the message names the argument and the value ------------------

def _args():
    sidx, _ = layout(T=12, E=4, k=2, H=16, unrouted=(2,))
    return torch.zeros(12, 16), torch.randn(5, 16), sidx


def test_bad_acc_dtype():
    acc, g, sidx = _args()
    with pytest.raises(TypeError, match=r"acc must be Float, got BFloat16"):
        ops.permute_bwd_accumulate_(acc.bfloat16(), g, sidx, 0)


def test_bad_acc_shape():
    acc, g, sidx = _args()
    with pytest.raises(ValueError, match=r"grad_rows_chunk\.shape\[1\] must equal acc\.shape\[1\]"):
        ops.permute_bwd_accumulate_(torch.zeros(12, 8), g, sidx, 0)
    with pytest.raises(ValueError, match=r"acc must be 2-D, got a 1-D"):
        ops.permute_bwd_accumulate_(torch.zeros(12), g, sidx, 0)


def test_bad_acc_not_contiguous():
    acc, g, sidx = _args()
    with pytest.raises(ValueError, match=r"acc must be contiguous"):
        ops.permute_bwd_accumulate_(torch.zeros(16, 12).t(), g, sidx, 0)


def test_chunk_too_long_for_row_lo():
    acc, g, sidx = _args()
    R = sidx.shape[0]
    with pytest.raises(ValueError, match=rf"row_lo={R - 4}, row_lo \+ 5\) run past the {R} rows"):
        ops.permute_bwd_accumulate_(acc, g, sidx, R - 4)


def test_negative_row_lo():
    acc, g, sidx = _args()
    with pytest.raises(ValueError, match=r"row_lo must be >= 0, got -1"):
        ops.permute_bwd_accumulate_(acc, g, sidx, -1)


def test_bad_index_dtype():
    acc, g, sidx = _args()
    with pytest.raises(TypeError, match=r"sorted_indices must be Long, got Int"):
        ops.permute_bwd_accumulate_(acc, g, sidx.int(), 0)


def test_bad_chunk_dtype():
    acc, g, sidx = _args()
    with pytest.raises(ValueError, match=r"grad_rows_chunk must be bf16, fp16 or fp32, got float64"):
        ops.permute_bwd_accumulate_(acc, g.double(), sidx, 0)


def test_index_out_of_range_cpu():
    """As permute_bwd on the CPU: an index outside [-1, T) in the chunk is refused, naming it."""
    acc, g, sidx = _args()
    sidx = sidx.clone()
    sidx[3] = 12
    with pytest.raises(ValueError, match=r"sorted_indices\[3\] = 12 is outside \[-1, "
                                         r"num_tokens=12\)"):
        ops.permute_bwd_accumulate_(acc, g, sidx, 0)
    ops.permute_bwd_accumulate_(acc, g, sidx, 4)  # the bad row is not in this chunk


def test_device_mismatch_meta():
    acc, g, sidx = _args()
    with pytest.raises(ValueError, match=r"^permute_bwd_accumulate_: grad_rows_chunk is on meta "
                                         r"but acc is on cpu"):
        ops.permute_bwd_accumulate_(acc, g.to("meta"), sidx, 0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_device_mismatch_cuda():
    acc, g, sidx = _args()
    with pytest.raises(ValueError, match=r"sorted_indices is on cpu but acc is on cuda"):
        ops.permute_bwd_accumulate_(acc.cuda(), g.cuda(), sidx, 0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_index_out_of_range_cuda_is_skipped():
    """CUDA cannot check without a host sync: like permute_bwd there, the row is skipped."""
    acc, g, sidx = _args()
    sidx = sidx.clone()
    sidx[3] = 12
    acc = acc.cuda()
    ops.permute_bwd_accumulate_(acc, g.cuda(), sidx.cuda(), 0)
    ref = torch.zeros(12, 16)
    for r in range(5):
        if 0 <= sidx[r] < 12:
            ref[sidx[r]] += g[r]
    assert torch.equal(acc.cpu(), ref)
