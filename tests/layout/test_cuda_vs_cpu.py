"""CUDA token layout ops against the CPU ops: the same inputs on both devices.

The CUDA kernels promise the CPU's results bit for bit (integer outputs, moved rows and probs,
the combine, permute's backward, unpermute's row gradients, token dropping), and a fixed-order
but different summation for unpermute_bwd's grad_probs (a length-H dot product: compared within
a tolerance derived from H and the dtype). Sizes go past one CUDA block / chunk, and hidden sizes
include ones whose rows are not 16-byte multiples (the narrow-access fallback). Every test skips
only when no GPU is present.
"""
import pytest
import torch

from helpers.tolerances import eps
from moe_core import ops

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

OPS = torch.ops.moe_core
FLOATS = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


def random_map(T, E, k):
    m = torch.zeros(T, E, dtype=torch.bool)
    if T:
        m.scatter_(1, torch.rand(T, E).argsort(dim=1)[:, :k], True)
    return m


def routed_probs(m, dtype):
    return (torch.rand(m.shape, dtype=torch.float64) * m).to(dtype)


def same(a, b, msg=""):
    """Bitwise equality (NaNs compared by bits too)."""
    a, b = a.detach().cpu(), b.detach().cpu()
    assert a.dtype == b.dtype and a.shape == b.shape, (msg, a.dtype, b.dtype, a.shape, b.shape)
    if a.is_floating_point():
        width = {8: torch.int64, 4: torch.int32, 2: torch.int16}[a.element_size()]
        a, b = a.view(width), b.view(width)
    assert torch.equal(a, b), msg


def both(fn, *args):
    """fn on the CPU inputs and on their CUDA copies (non-tensors passed through)."""
    cuda_args = [a.cuda() if isinstance(a, torch.Tensor) else a for a in args]
    return fn(*args), fn(*cuda_args)


# ---- permute ------------------------------------------------------------------------------------

LAYOUT_SIZES = [(0, 4, 2, 8), (1, 1, 1, 3), (300, 8, 2, 64), (1000, 64, 8, 72), (517, 128, 6, 13),
                (2048, 16, 4, 1024)]


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("T,E,k,H", LAYOUT_SIZES)
@pytest.mark.parametrize("mode", ["dropless", "cut", "align", "dap", "dap_align", "dap_over"])
def test_permute_cuda_equals_cpu(dtype, T, E, k, H, mode):
    m = random_map(T, E, k)
    p = routed_probs(m, dtype)
    x = torch.randn(T, H, dtype=torch.float64).to(dtype)
    n, dap, align = T * k, False, 0
    if mode == "cut":
        n = max(T * k - 5 * E, 0)
    elif mode == "align":
        align = 16
    elif mode in ("dap", "dap_align"):
        n, dap, align = max(T * k // E, 1) * E, True, (8 if mode == "dap_align" else 0)
    elif mode == "dap_over":  # capacity above the token count: -1 rows inside every block
        n, dap = (T + 3) * E, True
    for probs in (p, None):
        cpu, gpu = both(lambda *a: OPS.permute(*a, n, dap, align), x, m, probs)
        for name, a, b in zip(["rows", "probs", "sorted_indices", "offsets", "counts"], cpu, gpu):
            same(a, b, name)


def test_permute_cuda_unaligned_pointer_fallback():
    """A token buffer that starts 2 bytes past a 16-byte boundary takes the narrow path."""
    T, E, k, H = 333, 32, 4, 64
    m = random_map(T, E, k)
    base = torch.randn(T * H + 1).to(torch.bfloat16)
    x = base[1:].view(T, H)
    cpu = OPS.permute(x, m, None, T * k, False, 0)
    gpu = OPS.permute(base.cuda()[1:].view(T, H), m.cuda(), None, T * k, False, 0)
    for a, b in zip(cpu, gpu):
        same(a, b)


# ---- unpermute / permute backward ---------------------------------------------------------------


@pytest.fixture(params=["slots", "csr"])
def gather_map(request, tuning_env):
    """The map of the forward gathers (and of unpermute_bwd without probs): the slots table, or
    the CSR of the backwards with probs when MOE_CORE_UNPERMUTE_SLOTS=0."""
    if request.param == "csr":
        tuning_env("MOE_CORE_UNPERMUTE_SLOTS", "0")
    return request.param


DTYPE_PAIRS = [(d, d) for d in FLOATS] + [(torch.bfloat16, torch.float32),
                                          (torch.float16, torch.float32),
                                          (torch.float32, torch.float64),
                                          (torch.bfloat16, torch.float16),
                                          (torch.bfloat16, torch.float64)]


def layout(T, E, k, H, dtype, align=0):
    m = random_map(T, E, k)
    x = torch.randn(T, H, dtype=torch.float64).to(dtype)
    rows, _, idx, off, _ = OPS.permute(x, m, None, T * k, False, align)
    return m, rows, idx, off


@pytest.mark.parametrize("dtype,probs_dtype", DTYPE_PAIRS)
@pytest.mark.parametrize("T,E,k,H", LAYOUT_SIZES)
def test_unpermute_cuda_equals_cpu(dtype, probs_dtype, T, E, k, H, gather_map):
    m, rows, idx, off = layout(T, E, k, H, dtype, align=4)
    y = torch.randn(rows.shape, dtype=torch.float64).to(dtype)
    p = routed_probs(m, probs_dtype)
    for probs, offsets in ((p, off), (None, None)):
        cpu, gpu = both(lambda *a: OPS.unpermute(*a), y, idx, T, probs, offsets)
        same(cpu, gpu, "unpermute")
    # backward: row gradients bitwise; grad_probs a fixed-order dot product (tolerance)
    g = torch.randn(T, H, dtype=torch.float64).to(dtype)
    (gx_c, gp_c), (gx_g, gp_g) = both(lambda *a: OPS.unpermute_bwd(*a), g, idx, p, off, y)
    same(gx_c, gx_g, "grad_permuted_tokens")
    P = torch.promote_types(dtype, probs_dtype)
    scale = torch.zeros(T, E, dtype=torch.float64)
    for r, t in enumerate(idx.tolist()):
        if t >= 0:
            e = int(torch.searchsorted(off, r, right=True)) - 1
            scale[t, e] = (g[t].double() * y[r].double()).abs().sum()
    tol = 2 * (H + 2) * max(eps(P), eps(probs_dtype)) * scale
    assert ((gp_g.cpu().double() - gp_c.double()).abs() <= tol).all()  # tol 0 where no row
    (gx_c, _), (gx_g, _) = both(lambda *a: OPS.unpermute_bwd(*a), g, idx, None, None, None)
    same(gx_c, gx_g, "grad_permuted_tokens without probs")


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("T,E,k,H", LAYOUT_SIZES)
def test_permute_bwd_cuda_equals_cpu(dtype, T, E, k, H, gather_map):
    m, rows, idx, off = layout(T, E, k, H, dtype, align=8)
    R = rows.shape[0]
    gr = torch.randn(R, H, dtype=torch.float64).to(dtype)
    gp = torch.randn(R, dtype=torch.float64).to(dtype)
    for probs in (gp, None):
        cpu, gpu = both(lambda *a: OPS.permute_bwd(*a, T), gr, probs, idx, off)
        same(cpu[0], gpu[0], "grad_tokens")
        same(cpu[1], gpu[1], "grad_probs")


@pytest.mark.parametrize("T,E,k,n,dap,align", [
    (40000, 4, 2, 80000, False, 0),     # > 1024 chunks per expert: the chunk scan's tile loop
    (40000, 3, 1, 40000, False, 4096),  # align padding past one pass of an expert's warps
    (33000, 2, 1, 2 * 40000, True, 0),  # capacity > tokens: long -1 runs inside every block
    (100, 1, 1, 500, False, 128),       # one expert; the tail [offsets[E], R) is mostly padding
    (0, 5, 2, 40, True, 0),             # no token: every row is padding, written by the scatter
    (3000, 32, 4, 11000, False, 8),     # E = 32: the scatter's one-warp plan, one expert a lane
    (3000, 33, 4, 11000, False, 8),     # E = 33: two experts a lane, lanes 17.. own none
    (3000, 256, 8, 23000, False, 8),    # E = 256: the largest the scatter plans, 8 a lane
    (3000, 257, 8, 23000, False, 8),    # E = 257: the chunk scan's last block plans instead
    (3000, 256, 4, 3000, True, 16),     # drop_and_pad: capacity blocks cut at the rows
    (3000, 300, 4, 3000, True, 16),     # the same on the chunk scan's plan
])
def test_permute_cuda_planning_edges(T, E, k, n, dap, align):
    """The planning kernels' loops and padding writes on shapes the reference sizes miss."""
    m = random_map(T, E, k)
    x = torch.randn(T, 8, dtype=torch.float64).to(torch.bfloat16)
    p = routed_probs(m, torch.float32)
    for probs in (p, None):
        cpu, gpu = both(lambda *a: OPS.permute(*a, n, dap, align), x, m, probs)
        for name, a, b in zip(["rows", "probs", "sorted_indices", "offsets", "counts"], cpu, gpu):
            same(a, b, name)


def test_permute_cuda_row_lists_at_the_shared_memory_limit():
    """E = 12288 experts fill the scatter's 48 KB of row lists exactly (one token a block); with
    the kernel's own static shared memory that needs the opt-in past 48 KB."""
    m = random_map(40, 12288, 2)
    x = torch.randn(40, 8, dtype=torch.float64).to(torch.bfloat16)
    cpu, gpu = both(lambda *a: OPS.permute(*a, 80, False, 0), x, m, routed_probs(m, torch.float32))
    for name, a, b in zip(["rows", "probs", "sorted_indices", "offsets", "counts"], cpu, gpu):
        same(a, b, name)


@pytest.mark.parametrize("T,align", [(8192, 0), (16384, 0), (16384, 16), (16385, 16), (40000, 16)])
def test_unpermute_cuda_token_rows_scan_tiles(T, align):
    """The token → rows scan below one tile (mixtral's shape, no padding), at one tile exactly
    (with and without padding rows), one past it, and several tiles. The CSR serves the
    backwards with probs (the forward gathers take the slots table)."""
    E, k, H = 8, 2, 8
    m, rows, idx, off = layout(T, E, k, H, torch.float32, align=align)
    y = torch.randn(rows.shape, dtype=torch.float64).to(torch.float32)
    p = routed_probs(m, torch.float32)
    cpu, gpu = both(lambda *a: OPS.unpermute(*a), y, idx, T, p, off)
    same(cpu, gpu, "unpermute")
    cpu, gpu = both(lambda *a: OPS.permute_bwd(*a, T), y, None, idx, off)
    same(cpu[0], gpu[0], "grad_tokens")
    gp = torch.randn(rows.shape[0], dtype=torch.float64).to(torch.float32)
    cpu, gpu = both(lambda *a: OPS.permute_bwd(*a, T), y, gp, idx, off)  # CSR
    same(cpu[0], gpu[0], "grad_tokens (CSR)")
    same(cpu[1], gpu[1], "grad_probs (CSR)")
    g = torch.randn(T, H, dtype=torch.float64).to(torch.float32)
    (gx_c, _), (gx_g, _) = both(lambda *a: OPS.unpermute_bwd(*a), g, idx, p, off, None)  # CSR
    same(gx_c, gx_g, "grad_permuted_tokens (CSR)")


@pytest.mark.parametrize("align", [0, 4])
def test_unpermute_cuda_tokens_with_more_rows_than_staged(align, gather_map):
    """Tokens with more rows (40) than the slots (16) and than the CSR gather stages in shared
    memory (32): the rest come from the overflow list, or from the CSR in global memory, still in
    the CPU's ascending order, with probs too."""
    T, E, k, H = 50, 64, 40, 24
    m, rows, idx, off = layout(T, E, k, H, torch.float32, align=align)
    y = torch.randn(rows.shape, dtype=torch.float64).to(torch.bfloat16)
    p = routed_probs(m, torch.float32)
    for probs, offsets in ((p, off), (None, None)):
        cpu, gpu = both(lambda *a: OPS.unpermute(*a), y, idx, T, probs, offsets)
        same(cpu, gpu, "unpermute")
    cpu, gpu = both(lambda *a: OPS.permute_bwd(*a, T), y, None, idx, off)
    same(cpu[0], gpu[0], "grad_tokens")


@pytest.mark.parametrize("H,dtype", [(24, torch.float32), (1000, torch.bfloat16)])
@pytest.mark.parametrize("with_probs", [True, False])
def test_unpermute_cuda_row_counts_around_the_slots(H, dtype, with_probs, gather_map):
    """The forward gathers keep 16 rows per token in a table, take the rest from an overflow list
    (up to 256 rows, sorted in shared memory) and scan sorted_indices beyond that. Tokens with 0,
    1, 15, 16, 17, 31, 40, 255, 256, 257 and 300 rows, rows in random order, several overflowing
    tokens in one block (8 or 4 tokens per block): every token equals the CPU bit for bit."""
    counts = [0, 1, 2, 15, 16, 17, 31, 40, 255, 256, 257, 300, 3]
    T, E = len(counts), 4
    owner = torch.cat([torch.full((c,), t, dtype=torch.long) for t, c in enumerate(counts)])
    R = owner.numel()
    idx = owner[torch.randperm(R)]
    idx[::97] = -1  # a few padding rows among them
    y = torch.randn(R, H, dtype=torch.float64).to(dtype)
    probs = offsets = None
    if with_probs:
        probs = torch.rand(T, E, dtype=torch.float32)
        offsets = torch.tensor([0, R // 4, R // 2, R // 2, R], dtype=torch.long)
    cpu, gpu = both(lambda *a: OPS.unpermute(*a), y, idx, T, probs, offsets)
    same(cpu, gpu, "unpermute")
    off = torch.tensor([0, R // 4, R // 2, R // 2, R], dtype=torch.long)
    cpu, gpu = both(lambda *a: OPS.permute_bwd(*a, T), y, None, idx, off)
    same(cpu[0], gpu[0], "grad_tokens")
    # unpermute's backward without probs copies each token's gradient to its rows, overflow too
    g = torch.randn(T, H, dtype=torch.float64).to(dtype)
    (gx_c, _), (gx_g, _) = both(lambda *a: OPS.unpermute_bwd(*a), g, idx, None, None, None)
    same(gx_c, gx_g, "grad_permuted_tokens")


@pytest.mark.parametrize("E,k", [(64, 2), (16, 4)])
def test_unpermute_cuda_drop_and_pad_fillers(E, k):
    """drop_and_pad fills short experts with the lowest unrouted tokens, so those tokens own a row
    in many experts (past the 16 slots when E = 64) while the rest own k or fewer."""
    T, H = 600, 40
    m = random_map(T, E, k)
    m[:, 0] = False  # expert 0 short: every block's fillers come first from tokens 0, 1, ...
    x = torch.randn(T, H, dtype=torch.float64).to(torch.bfloat16)
    n = (T * k // E + 7) * E
    rows, _, idx, off, _ = OPS.permute(x, m, None, n, True, 0)
    p = routed_probs(m, torch.float32)
    for probs, offsets in ((p, off), (None, None)):
        cpu, gpu = both(lambda *a: OPS.unpermute(*a), rows, idx, T, probs, offsets)
        same(cpu, gpu, "unpermute")
    g = torch.randn(T, H, dtype=torch.float64).to(torch.bfloat16)
    (gx_c, _), (gx_g, _) = both(lambda *a: OPS.unpermute_bwd(*a), g, idx, None, None, None)
    same(gx_c, gx_g, "grad_permuted_tokens")


def test_layout_cuda_round_trip_through_autograd():
    """permute → unpermute on CUDA with gradients, equal to the same graph on the CPU."""
    T, E, k, H = 700, 32, 8, 96
    m = random_map(T, E, k)
    probs = routed_probs(m, torch.float32)
    x = torch.randn(T, H).to(torch.bfloat16)
    gout = torch.randn(T, H).to(torch.bfloat16)
    res = []
    for dev in ("cpu", "cuda"):
        xx = x.to(dev).detach().requires_grad_()  # leaves on both devices
        pp = probs.to(dev).detach().requires_grad_()
        rows, _, idx, off, _ = ops.permute(xx, m.to(dev), None, num_out_tokens=T * k)
        out = ops.unpermute(rows * 2, idx, xx.shape, probs=pp, routing_map=m.to(dev))
        out.backward(gout.to(dev))
        res.append((out.detach().cpu(), xx.grad.cpu(), pp.grad.cpu()))
    same(res[0][0], res[1][0], "out")
    same(res[0][1], res[1][1], "grad x")
    # grad_probs: length-H fp32 dot products of O(1) terms, summed in another fixed order
    torch.testing.assert_close(res[0][2], res[1][2], rtol=0, atol=(H + 2) * 2**-23 * 4 * H)


def test_layout_cuda_deterministic_bitwise():
    T, E, k, H = 4096, 128, 8, 512
    m = random_map(T, E, k).cuda()
    x = torch.randn(T, H, device="cuda").to(torch.bfloat16)
    probs = routed_probs(m.cpu(), torch.float32).cuda()
    a = OPS.permute(x, m, probs, T * k, False, 16)
    b = OPS.permute(x, m, probs, T * k, False, 16)
    for u, v in zip(a, b):
        same(u, v)
    y = torch.randn(a[0].shape, device="cuda").to(torch.bfloat16)
    g = torch.randn(T, H, device="cuda").to(torch.bfloat16)
    same(OPS.unpermute(y, a[2], T, probs, a[3]), OPS.unpermute(y, a[2], T, probs, a[3]))
    for u, v in zip(OPS.unpermute_bwd(g, a[2], probs, a[3], y),
                    OPS.unpermute_bwd(g, a[2], probs, a[3], y)):
        same(u, v)
    for u, v in zip(OPS.permute_bwd(y, a[1], a[2], a[3], T), OPS.permute_bwd(y, a[1], a[2], a[3], T)):
        same(u, v)


# ---- token dropping and counts ------------------------------------------------------------------

@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("T,E", [(1, 1), (300, 8), (2500, 64), (5000, 16)])
@pytest.mark.parametrize("policy", ["probs", "position"])
@pytest.mark.parametrize("pad", [False, True])
def test_token_dropping_cuda_equals_cpu(dtype, T, E, policy, pad):
    k = min(4, E)
    m = random_map(T, E, k)
    # many ties (few distinct values), NaNs, -0 and +0, infinities and negatives
    p = (torch.randint(-3, 12, (T, E)).double() / 4) * m
    p[torch.rand(T, E) < 0.01] = float("nan")
    p[torch.rand(T, E) < 0.01] = -0.0
    p[torch.rand(T, E) < 0.005] = float("inf")
    p[torch.rand(T, E) < 0.005] = float("-inf")
    p = p.to(dtype)
    for cap in [0, 1, 7, max(T * k // E, 1), T - 1, T, T + 5]:
        cpu, gpu = both(lambda *a: OPS.token_dropping(*a, cap, policy, pad), p, m)
        same(cpu[1], gpu[1], f"map cap={cap}")
        same(cpu[0], gpu[0], f"probs cap={cap}")
    g = torch.randn(T, E, dtype=torch.float64).to(dtype)
    g[0, 0] = float("nan")
    cpu, gpu = both(lambda *a: OPS.token_dropping_bwd(*a), g, cpu[1])
    same(cpu, gpu, "grad")


def test_token_dropping_cuda_large_column_sort():
    """T = 16384 continuous probs: the radix select must find exactly the CPU's top capacity."""
    T, E, k = 16384, 32, 4
    m = random_map(T, E, k)
    p = torch.rand(T, E) * m
    cap = ops.get_capacity(T * k, E, 0.8)
    cpu, gpu = both(lambda *a: OPS.token_dropping(*a, cap, "probs", False), p, m)
    same(cpu[0], gpu[0])
    same(cpu[1], gpu[1])


@pytest.mark.parametrize("T,E", [(0, 4), (1, 1), (1000, 64), (70000, 8)])
def test_tokens_per_expert_cuda_equals_cpu(T, E):
    m = torch.rand(T, E) < 0.3
    pad = torch.rand(T) < 0.2
    for mask in (None, pad):
        cpu, gpu = both(lambda *a: OPS.tokens_per_expert(*a), m, mask)
        same(cpu, gpu)


# ---- sort_chunks_by_idxs ------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64, torch.int64])
@pytest.mark.parametrize("C,shape", [(1, (5,)), (7, (3, 2)), (64, (129,)), (2000, (16,))])
def test_sort_chunks_cuda_equals_cpu(dtype, C, shape):
    split = torch.randint(0, 6, (C,))
    split[0] = 0
    order = torch.randperm(C)
    n = int(split.sum())
    x = (torch.randn(n, *shape) * 100).to(dtype)
    for op in (OPS.sort_chunks_by_idxs, OPS.sort_chunks_by_idxs_bwd):
        cpu, gpu = both(lambda *a: op(*a), x, split, order)
        same(cpu, gpu)
