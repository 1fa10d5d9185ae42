"""Token layout ops: capacity, token dropping, permute / unpermute, sort_chunks_by_idxs.

Compared with tests/helpers/reference_layout.py (our defined semantics, loop by loop) and with
megatron-core's real functions. Integer outputs, moved rows and probs must be exactly equal;
the combine is exactly equal for up to two rows per token and within derived ulps otherwise.
Where Megatron leaves a choice to torch.topk's unspecified tie-breaking, the inputs are tie-free
or only the defined part is compared.
"""
import itertools

import pytest
import torch

from helpers import reference_layout as ref
from helpers.megatron_moe import megatron_moe_utils
from helpers.tolerances import assert_close_ulps, eps
from moe_core import ops

mcore = megatron_moe_utils()  # a missing megatron-core fails here, it never skips

FLOATS = [torch.float32, torch.bfloat16, torch.float16]
ALL_FLOATS = FLOATS + [torch.float64]


# ---- inputs -------------------------------------------------------------------------------------

def on(device, *tensors):
    """Copies of the tensors on `device` (None stays None; a copy, so a leaf for autograd even
    on the CPU): the op runs there, the references on the CPU originals."""
    out = tuple(t.to(device, copy=True) if isinstance(t, torch.Tensor) else t for t in tensors)
    return out if len(out) > 1 else out[0]


def cpu(*tensors):
    out = tuple(t.cpu() if isinstance(t, torch.Tensor) else t for t in tensors)
    return out if len(out) > 1 else out[0]


def random_map(T, E, k):
    """[T, E] bool with exactly k experts per token, chosen uniformly."""
    m = torch.zeros(T, E, dtype=torch.bool)
    if T:
        m.scatter_(1, torch.rand(T, E).argsort(dim=1)[:, :k], True)
    return m


def distinct_probs(routing_map, dtype):
    """Probs that are distinct and positive within every column where routed, zero elsewhere.

    Values (a permutation of 1..T) / 256 are exact in bf16 and fp16 for T <= 255, so no rounding
    creates ties: Megatron's torch.topk then has one answer.
    """
    T, E = routing_map.shape
    vals = torch.stack([torch.randperm(T) + 1 for _ in range(E)], dim=1).double() / 256
    return torch.where(routing_map, vals, torch.zeros_like(vals)).to(dtype)


def router_output(T, E, k, dtype):
    """Real routing: softmax top-k through moe_core's router (probs [T, E] dtype, map bool)."""
    logits = torch.randn(T, E, dtype=torch.float64).to(dtype)
    return ops.topk_routing_with_score_function(logits, k)


# ---- get_capacity -------------------------------------------------------------------------------

@pytest.mark.parametrize("args", [(32, 8, 1.0), (32, 8, 1.1), (10, 4, 1.0), (3, 8, 1.0, 4),
                                  (0, 8, 1.0), (32, 8, 0.0), (7, 3, 1.3333), (4096 * 8, 256, 1.25),
                                  (5, 7, 2.0, 1), (100, 1, 0.5)])
def test_get_capacity_vs_megatron(args):
    assert ops.get_capacity(*args) == mcore.get_capacity(*args)


# ---- apply_router_token_dropping ----------------------------------------------------------------

DROP_SIZES = [(0, 4, 2), (1, 4, 2), (1, 1, 1), (16, 4, 1), (64, 8, 2), (97, 16, 4), (200, 8, 8)]
FACTORS = [0.0, 0.5, 1.0, 1.7, 10.0]


@pytest.mark.parametrize("policy", ["probs", "position"])
@pytest.mark.parametrize("pad", [False, True])
@pytest.mark.parametrize("dtype", ALL_FLOATS)
@pytest.mark.parametrize("T,E,k", DROP_SIZES)
def test_token_dropping_vs_reference(policy, pad, dtype, T, E, k, device):
    m = random_map(T, E, k)
    p = distinct_probs(m, dtype)
    for cf in FACTORS:
        fp, fm = cpu(*ops.apply_router_token_dropping(*on(device, p, m), k, cf, policy, pad))
        rp, rm = ref.token_dropping(p, m, k, cf, policy, pad)
        assert torch.equal(fm, rm), (cf, fm, rm)
        assert torch.equal(fp, rp)
        assert fp.dtype == dtype and fm.dtype == torch.bool


@pytest.mark.parametrize("pad", [False, True])
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("T,E,k", DROP_SIZES)
def test_token_dropping_probs_vs_megatron(pad, dtype, T, E, k, device):
    """Tie-free probs: without padding everything is defined; with padding the filler tokens
    (prob 0) are Megatron's arbitrary choice, so the map is compared on routed entries and by
    column counts, the probs exactly."""
    m = random_map(T, E, k)
    p = distinct_probs(m, dtype)
    for cf in FACTORS:
        p1 = on(device, p).requires_grad_()
        p2 = p.clone().requires_grad_()
        fp, fm = ops.apply_router_token_dropping(p1, on(device, m), k, cf, "probs", pad)
        mp, mm = mcore.apply_router_token_dropping(p2, m, k, cf, "probs", pad)
        fp_dev = fp
        fp, fm = cpu(fp, fm)
        assert torch.equal(fp, mp)
        if pad:
            assert torch.equal(fm & m, mm & m)
            assert torch.equal(fm.sum(0), mm.sum(0))
        else:
            assert torch.equal(fm, mm)
        g = torch.randn(T, E, dtype=torch.float64).to(dtype)
        (fp_dev * on(device, g)).sum().backward()
        (mp * g).sum().backward()
        if not pad:
            assert torch.equal(p1.grad.cpu(), p2.grad)
        else:  # the gradient is grad * final_map: equal on the routed part
            assert torch.equal(p1.grad.cpu() * m, p2.grad * m)


@pytest.mark.parametrize("pad", [False, True])
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("T,E,k", DROP_SIZES)
def test_token_dropping_position_vs_megatron(pad, dtype, T, E, k, device):
    """Megatron's CPU "position" keeps an unspecified subset of an over-full column (its CUDA
    path keeps the first ones, as we do). Defined and compared: columns that fit, the kept
    count of every column, kept ⊆ routed, and everything when capacity > T."""
    m = random_map(T, E, k)
    p = distinct_probs(m, dtype)
    for cf in FACTORS:
        cap = ops.get_capacity(T * k, E, cf)
        fp, fm = cpu(*ops.apply_router_token_dropping(*on(device, p, m), k, cf, "position", pad))
        mp, mm = mcore.apply_router_token_dropping(p, m, k, cf, "position", pad)
        counts = m.sum(0)
        fits = counts <= cap if not pad else counts == cap
        if cap > T:
            fits = torch.ones_like(fits)
        assert torch.equal(fm[:, fits], mm[:, fits])
        assert torch.equal(fp[:, fits], mp[:, fits])
        assert torch.equal(fm.sum(0), mm.sum(0))
        assert torch.equal((fm & m).sum(0), (mm & m).sum(0))


def test_position_keeps_first_routed_tokens_in_order(device):
    T, E = 40, 3
    m = torch.zeros(T, E, dtype=torch.bool, device=device)
    m[5::2, 0] = True            # 18 routed tokens into expert 0
    m[[1, 3, 30], 1] = True      # 3 into expert 1, expert 2 gets nothing
    p = m.float() * 0.5
    cap = ops.get_capacity(T * 1, E, 0.3)  # = 4
    assert cap == 4
    _, fm = ops.apply_router_token_dropping(p, m, 1, 0.3, "position", False)
    assert fm[:, 0].nonzero().flatten().tolist() == [5, 7, 9, 11]
    assert fm[:, 1].nonzero().flatten().tolist() == [1, 3, 30]
    assert not fm[:, 2].any()
    _, fm = ops.apply_router_token_dropping(p, m, 1, 0.3, "position", True)
    assert fm[:, 1].nonzero().flatten().tolist() == [0, 1, 3, 30]  # filler: first unrouted, 0
    assert fm[:, 2].nonzero().flatten().tolist() == [0, 1, 2, 3]


def test_probs_policy_ties_go_to_lower_token_and_nan_first(device):
    p = torch.tensor([[0.5], [0.7], [0.5], [float("nan")], [0.5]], device=device)
    m = torch.ones(5, 1, dtype=torch.bool, device=device)
    # capacity = ceil(5 / 1 * 0.6) = 3: NaN, 0.7, then the first 0.5 (token 0)
    fp, fm = ops.apply_router_token_dropping(p, m, 1, 0.6, "probs", False)
    assert fm.flatten().tolist() == [True, True, False, True, False]
    assert fp[3, 0].isnan()


def test_everything_to_one_expert_and_empty_experts(device):
    T, E = 33, 6
    m = torch.zeros(T, E, dtype=torch.bool)
    m[:, 2] = True
    p = distinct_probs(m, torch.float32)
    for policy, pad in itertools.product(["probs", "position"], [False, True]):
        fp, fm = cpu(*ops.apply_router_token_dropping(*on(device, p, m), 1, 1.0, policy, pad))
        rp, rm = ref.token_dropping(p, m, 1, 1.0, policy, pad)
        assert torch.equal(fm, rm) and torch.equal(fp, rp)
        assert fm[:, 2].sum() == ops.get_capacity(T, E, 1.0)


# ---- permute ------------------------------------------------------------------------------------

PERMUTE_SIZES = [(0, 4, 2, 8), (1, 4, 2, 8), (1, 1, 1, 1), (17, 8, 2, 16), (64, 16, 4, 32),
                 (50, 64, 8, 24), (40, 4, 4, 8)]


@pytest.mark.parametrize("dtype", ALL_FLOATS)
@pytest.mark.parametrize("T,E,k,H", PERMUTE_SIZES)
def test_permute_dropless_vs_megatron(dtype, T, E, k, H, device):
    probs, m = router_output(T, E, k, dtype)
    x = torch.randn(T, H, dtype=torch.float64).to(dtype)
    n = T * k
    ours = cpu(*ops.permute(*on(device, x, m, probs), num_out_tokens=n))
    theirs = mcore.permute(x, m, probs, num_out_tokens=n)
    assert torch.equal(ours[0], theirs[0])
    assert torch.equal(ours[1], theirs[1])
    assert torch.equal(ours[2], theirs[2])
    assert torch.equal(ours[4], m.sum(0))
    assert torch.equal(ours[3], torch.cat([torch.zeros(1, dtype=torch.long), m.sum(0).cumsum(0)]))
    assert ours[3].dtype == ours[4].dtype == torch.long
    got = ref.permute(x, m, probs, n)
    for a, b in zip(ours, got):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("T,E,k,H", [(0, 4, 2, 8), (1, 4, 2, 8), (17, 8, 2, 16), (64, 16, 4, 32),
                                     (40, 4, 2, 8)])
@pytest.mark.parametrize("cf", [0.5, 1.0, 1.5])
def test_permute_drop_and_pad_vs_megatron(dtype, T, E, k, H, cf, device):
    probs, m = router_output(T, E, k, dtype)
    probs, m = mcore.apply_router_token_dropping(probs, m, k, cf, "probs", True)
    cap = ops.get_capacity(T * k, E, cf)
    assert cap <= T  # Megatron crashes beyond: see test_drop_and_pad_capacity_over_tokens
    x = torch.randn(T, H, dtype=torch.float64).to(dtype)
    ours = cpu(*ops.permute(*on(device, x, m, probs), num_out_tokens=cap * E, drop_and_pad=True))
    theirs = mcore.permute(x, m, probs, num_out_tokens=cap * E, drop_and_pad=True)
    for i in range(3):
        assert torch.equal(ours[i], theirs[i])
    assert torch.equal(ours[4], torch.full((E,), cap))
    # an arbitrary map (columns shorter or longer than the capacity): Megatron's stable order
    m2 = random_map(T, E, k)
    ours = cpu(*ops.permute(*on(device, x, m2, probs), num_out_tokens=cap * E, drop_and_pad=True))
    theirs = mcore.permute(x, m2, probs, num_out_tokens=cap * E, drop_and_pad=True)
    for i in range(3):
        assert torch.equal(ours[i], theirs[i])


def test_drop_and_pad_capacity_over_tokens(device):
    """Megatron crashes here (view of E*T indices as [E, cap]); ours: all T tokens per block in
    Megatron's order, then capacity - T zero rows with index -1 that unpermute skips."""
    T, E, H, cap = 3, 4, 5, 7
    m = random_map(T, E, 2)
    p = distinct_probs(m, torch.float32)
    x = torch.randn(T, H)
    with pytest.raises(RuntimeError):
        mcore.permute(x, m, p, num_out_tokens=cap * E, drop_and_pad=True)
    rows, pp, idx, off, cnt = cpu(*ops.permute(*on(device, x, m, p), num_out_tokens=cap * E,
                                               drop_and_pad=True))
    got = ref.permute(x, m, p, cap * E, drop_and_pad=True)
    for a, b in zip((rows, pp, idx, off, cnt), got):
        assert torch.equal(a, b)
    assert rows.shape == (E * cap, H)
    assert (idx.view(E, cap)[:, T:] == -1).all() and (rows.view(E, cap, H)[:, T:] == 0).all()
    assert (pp.view(E, cap)[:, T:] == 0).all()
    out = ops.unpermute(*on(device, rows, idx), x.shape, probs=on(device, p),
                        routing_map=on(device, m), drop_and_pad=True)
    assert torch.equal(out.cpu(), ref.unpermute(rows, idx, T, p, off))


@pytest.mark.parametrize("dtype", FLOATS)
def test_permute_static_bound_with_dropping(dtype, device):
    """Dropping without padding, buffers sized T*topk: the used rows are Megatron's (called with
    the exact count), the rest are zero with index -1, and the kept count is on the device."""
    T, E, k, H = 64, 8, 2, 16
    probs, m = router_output(T, E, k, dtype)
    probs, m = ops.apply_router_token_dropping(probs, m, k, 0.6, "probs", False)
    x = torch.randn(T, H, dtype=torch.float64).to(dtype)
    rows, pp, idx, off, cnt = cpu(*ops.permute(*on(device, x, m, probs), num_out_tokens=T * k))
    kept = int(m.sum())
    assert kept < T * k and off[-1] == kept and torch.equal(cnt, m.sum(0))
    theirs = mcore.permute(x, m, probs, num_out_tokens=kept)
    assert torch.equal(rows[:kept], theirs[0]) and torch.equal(pp[:kept], theirs[1])
    assert torch.equal(idx[:kept], theirs[2])
    assert (idx[kept:] == -1).all() and (rows[kept:] == 0).all() and (pp[kept:] == 0).all()
    out = ops.unpermute(*on(device, rows, idx), x.shape, probs=on(device, probs),
                        routing_map=on(device, m))
    assert torch.equal(out.cpu(), mcore.unpermute(theirs[0], theirs[2], x.shape, probs=probs,
                                                  routing_map=m))


def test_permute_truncates_past_num_out_tokens_like_megatron(device):
    T, E, k, H = 20, 4, 2, 3
    probs, m = router_output(T, E, k, torch.float32)
    x = torch.randn(T, H)
    n = T * k - 7
    ours = cpu(*ops.permute(*on(device, x, m, probs), num_out_tokens=n))
    theirs = mcore.permute(x, m, probs, num_out_tokens=n)
    for i in range(3):
        assert torch.equal(ours[i], theirs[i])
    assert ours[3][-1] == n and ours[4].sum() == n


@pytest.mark.parametrize("align", [1, 4, 16])
@pytest.mark.parametrize("drop_and_pad", [False, True])
def test_permute_align(align, drop_and_pad, device):
    T, E, k, H = 37, 8, 2, 8
    probs, m = router_output(T, E, k, torch.bfloat16)
    cap = ops.get_capacity(T * k, E, 1.0)
    if drop_and_pad:
        probs, m = ops.apply_router_token_dropping(probs, m, k, 1.0, "probs", True)
    n = cap * E if drop_and_pad else T * k
    x = torch.randn(T, H).to(torch.bfloat16)
    rows, pp, idx, off, cnt = cpu(*ops.permute(*on(device, x, m, probs), num_out_tokens=n,
                                               drop_and_pad=drop_and_pad, align_size=align))
    got = ref.permute(x, m, probs, n, drop_and_pad, align)
    for a, b in zip((rows, pp, idx, off, cnt), got):
        assert torch.equal(a, b)
    assert rows.shape[0] == ref.num_rows(E, n, drop_and_pad, align)
    assert (cnt % align == 0).all()
    pad = idx < 0
    assert (rows[pad] == 0).all() and (pp[pad] == 0).all()
    # the unaligned permutation's rows, in the same order, are the non-padding rows
    plain = cpu(*ops.permute(*on(device, x, m, probs), num_out_tokens=n,
                             drop_and_pad=drop_and_pad))
    assert torch.equal(rows[~pad], plain[0][plain[2] >= 0])
    # unpermute skips the padding rows: same combine as without alignment
    y = torch.randn(rows.shape).to(torch.bfloat16)
    y_plain = y[~pad]
    out = ops.unpermute(*on(device, y, idx), x.shape, probs=on(device, probs),
                        routing_map=on(device, m), pad_offsets=on(device, off)).cpu()
    plain_y = torch.zeros(plain[0].shape, dtype=y.dtype)
    plain_y[plain[2] >= 0] = y_plain
    out_plain = ops.unpermute(*on(device, plain_y, plain[2]), x.shape, probs=on(device, probs),
                              routing_map=on(device, m), drop_and_pad=drop_and_pad).cpu()
    assert torch.equal(out, out_plain)


def test_all_tokens_to_one_expert_and_empty_experts(device):
    T, E, H = 25, 5, 4
    m = torch.zeros(T, E, dtype=torch.bool)
    m[:, 3] = True
    p = distinct_probs(m, torch.float32)
    x = torch.randn(T, H)
    ours = cpu(*ops.permute(*on(device, x, m, p), num_out_tokens=T))
    theirs = mcore.permute(x, m, p, num_out_tokens=T)
    for i in range(3):
        assert torch.equal(ours[i], theirs[i])
    assert ours[4].tolist() == [0, 0, 0, T, 0] and ours[3].tolist() == [0, 0, 0, 0, T, T]
    out = ops.unpermute(*on(device, ours[0], ours[2]), x.shape, probs=on(device, p),
                        routing_map=on(device, m))
    assert torch.equal(out.cpu(), mcore.unpermute(theirs[0], theirs[2], x.shape, probs=p,
                                                  routing_map=m))


# ---- unpermute ----------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype,probs_dtype", [(d, d) for d in ALL_FLOATS] +
                         [(torch.bfloat16, torch.float32), (torch.float16, torch.float32),
                          (torch.float32, torch.float64), (torch.bfloat16, torch.float16)])
@pytest.mark.parametrize("with_probs", [False, True])
@pytest.mark.parametrize("T,E,k,H", PERMUTE_SIZES)
def test_unpermute_vs_megatron(dtype, probs_dtype, with_probs, T, E, k, H, device):
    probs, m = router_output(T, E, k, probs_dtype)
    x = torch.randn(T, H, dtype=torch.float64).to(dtype)
    rows, _, idx, off, _ = ops.permute(x, m, None, num_out_tokens=T * k)
    y = torch.randn(rows.shape, dtype=torch.float64).to(dtype)  # the "expert outputs"
    p = probs if with_probs else None
    y1 = on(device, y).requires_grad_()
    y2 = y.clone().requires_grad_()
    p1 = on(device, p).requires_grad_() if with_probs else None
    p2 = p.clone().requires_grad_() if with_probs else None
    ours_dev = ops.unpermute(y1, on(device, idx), x.shape, probs=p1, routing_map=on(device, m))
    ours = ours_dev.detach().cpu()
    theirs = mcore.unpermute(y2, idx, x.shape, probs=p2, routing_map=m)
    assert ours.dtype == theirs.dtype == dtype
    assert torch.equal(ours, ref.unpermute(y, idx, T, p, off))
    P = torch.promote_types(dtype, probs_dtype) if with_probs else dtype
    if k <= 2:
        assert torch.equal(ours, theirs)
    else:  # Megatron rounds every add to P; ours sums in fp32 (fp64) and rounds to P once
        assert_close_ulps(ours, theirs, n_ulps=k, floor=1.0, dtype=P)
    g = torch.randn(T, H, dtype=torch.float64).to(dtype)
    ours_dev.backward(on(device, g))
    theirs.backward(g)
    assert torch.equal(y1.grad.cpu(), y2.grad)  # g[t] * prob, rounded as Megatron: no sum involved
    if with_probs:
        # a length-H dot product: compare against the exact value, error within H·eps(P)·Σ|terms|
        exact = torch.zeros(T, E, dtype=torch.float64)
        scale = torch.zeros(T, E, dtype=torch.float64)
        for r, t in enumerate(idx.tolist()):
            e = int(torch.searchsorted(off, r, right=True)) - 1
            terms = g[t].double() * y[r].double()
            exact[t, e], scale[t, e] = terms.sum(), terms.abs().sum()
        tol = (H + 2) * max(eps(P), eps(probs_dtype)) * scale + 1e-300
        for grad in (p1.grad.cpu(), p2.grad):
            assert ((grad.double() - exact).abs() <= tol).all()


@pytest.mark.parametrize("dtype", FLOATS)
def test_unpermute_drop_and_pad_vs_megatron(dtype, device):
    T, E, k, H = 48, 8, 2, 16
    probs, m = router_output(T, E, k, dtype)
    probs, m = mcore.apply_router_token_dropping(probs, m, k, 1.0, "probs", True)
    cap = ops.get_capacity(T * k, E, 1.0)
    x = torch.randn(T, H, dtype=torch.float64).to(dtype)
    rows, _, idx, off, _ = ops.permute(x, m, None, num_out_tokens=cap * E, drop_and_pad=True)
    y = torch.randn(rows.shape, dtype=torch.float64).to(dtype)
    for p in (None, probs):
        ours = ops.unpermute(*on(device, y, idx), x.shape, probs=on(device, p),
                             routing_map=on(device, m), drop_and_pad=True)
        theirs = mcore.unpermute(y, idx, x.shape, probs=p, routing_map=m, drop_and_pad=True)
        assert torch.equal(ours.cpu(), theirs)


@pytest.mark.parametrize("dtype", FLOATS)
def test_permute_backward_vs_megatron(dtype, device):
    for T, E, k, H in [(31, 8, 2, 16), (1, 4, 1, 8), (40, 16, 6, 8)]:
        probs, m = router_output(T, E, k, dtype)
        x = torch.randn(T, H, dtype=torch.float64).to(dtype)
        x1, x2 = on(device, x).requires_grad_(), x.clone().requires_grad_()
        p1, p2 = on(device, probs).requires_grad_(), probs.clone().requires_grad_()
        a = ops.permute(x1, on(device, m), p1, num_out_tokens=T * k)
        b = mcore.permute(x2, m, p2, num_out_tokens=T * k)
        gr = torch.randn(a[0].shape, dtype=torch.float64).to(dtype)
        gp = torch.randn(a[1].shape, dtype=torch.float64).to(dtype)
        ((a[0] * on(device, gr)).sum() + (a[1] * on(device, gp)).sum()).backward()
        ((b[0] * gr).sum() + (b[1] * gp).sum()).backward()
        assert torch.equal(p1.grad.cpu(), p2.grad)
        if k <= 2:
            assert torch.equal(x1.grad.cpu(), x2.grad)
        else:
            assert_close_ulps(x1.grad, x2.grad, n_ulps=k, floor=1.0)


def test_combine_is_deterministic_bitwise(device):
    T, E, k, H = 257, 32, 8, 64
    probs, m = on(device, *router_output(T, E, k, torch.bfloat16))
    x = torch.randn(T, H).to(torch.bfloat16).to(device)
    rows, _, idx, _, _ = ops.permute(x, m, None, num_out_tokens=T * k)
    y = torch.randn(rows.shape).to(torch.bfloat16).to(device)
    outs = [ops.unpermute(y, idx, x.shape, probs=probs, routing_map=m) for _ in range(3)]
    assert all(torch.equal(outs[0], o) for o in outs[1:])


def test_unpermute_int64_offsets(device):
    """rows × hidden = 2^31 + 3·2^19 elements: a row offset computed in int32 would wrap. The rows
    buffer is torch.empty (untouched pages are never allocated); only the last rows are written
    and referenced, the rest are -1 (skipped), so the test is cheap."""
    H = 1 << 19
    R = (1 << 12) + 3                      # R·H > 2^31
    T = 3
    big = torch.empty(R, H, dtype=torch.bfloat16, device=device)
    last = torch.arange(3 * H, dtype=torch.float32).remainder(251).view(3, H).to(torch.bfloat16)
    last = last.to(device)
    big[R - 3:] = last
    idx = torch.full((R,), -1, dtype=torch.long, device=device)
    idx[R - 3:] = torch.tensor([2, 0, 1], device=device)
    out = ops.unpermute(big, idx, (T, H))
    assert torch.equal(out, last[[1, 2, 0]])
    # the backward of permute gathers from the same kind of buffer (the gradient of the rows)
    off = torch.tensor([R - 3, R], device=device)
    grad_tokens, _ = torch.ops.moe_core.permute_bwd(big, None, idx, off, T)
    assert torch.equal(grad_tokens, last[[1, 2, 0]])
    del big


# ---- sort_chunks_by_idxs ------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ALL_FLOATS)
@pytest.mark.parametrize("sizes", [[3, 0, 5, 2], [0], [7], [1, 1, 1, 1, 1, 1], [0, 0, 4, 0]])
def test_sort_chunks_vs_megatron(dtype, sizes, device):
    split = torch.tensor(sizes)
    order = torch.randperm(len(sizes))
    n = sum(sizes)
    x = torch.randn(n, 3, 2, dtype=torch.float64).to(dtype)
    p = torch.randn(n, dtype=torch.float64).to(dtype)
    x1, x2 = on(device, x).requires_grad_(), x.clone().requires_grad_()
    p1, p2 = on(device, p).requires_grad_(), p.clone().requires_grad_()
    o1, q1 = ops.sort_chunks_by_idxs(x1, on(device, split), on(device, order), probs=p1)
    o2, q2 = mcore.sort_chunks_by_idxs(x2, split, order, probs=p2)
    assert torch.equal(o1.cpu(), o2) and torch.equal(q1.cpu(), q2)
    gx = torch.randn_like(o2)
    gq = torch.randn_like(q2)
    ((o1 * on(device, gx)).sum() + (q1 * on(device, gq)).sum()).backward()
    ((o2 * gx).sum() + (q2 * gq).sum()).backward()
    assert torch.equal(x1.grad.cpu(), x2.grad) and torch.equal(p1.grad.cpu(), p2.grad)
    o3, q3 = ops.sort_chunks_by_idxs(on(device, x), split, order)
    assert q3 is None and torch.equal(o3.cpu(), o2)


# ---- opcheck and gradcheck ----------------------------------------------------------------------

def test_opcheck_all_layout_ops():
    T, E, k, H = 9, 4, 2, 5
    probs, m = router_output(T, E, k, torch.float32)
    probs = probs.requires_grad_()
    x = torch.randn(T, H, requires_grad=True)
    torch.library.opcheck(torch.ops.moe_core.token_dropping.default, (probs, m, 3, "probs", False))
    torch.library.opcheck(torch.ops.moe_core.token_dropping.default, (probs, m, 3, "position", True))
    torch.library.opcheck(torch.ops.moe_core.token_dropping_bwd.default, (torch.randn(T, E), m))
    for n, dap, align in [(T * k, False, 0), (T * k, False, 4), (3 * E, True, 0), (12 * E, True, 2)]:
        torch.library.opcheck(torch.ops.moe_core.permute.default, (x, m, probs, n, dap, align))
        torch.library.opcheck(torch.ops.moe_core.permute.default, (x, m, None, n, dap, align))
    rows, pp, idx, off, _ = torch.ops.moe_core.permute(x.detach(), m, probs.detach(), T * k, False, 0)
    R = rows.shape[0]
    torch.library.opcheck(torch.ops.moe_core.permute_bwd.default, (torch.randn(R, H), torch.randn(R), idx, off, T))
    torch.library.opcheck(torch.ops.moe_core.permute_bwd.default, (torch.randn(R, H), None, idx, off, T))
    y = torch.randn(R, H, requires_grad=True)
    torch.library.opcheck(torch.ops.moe_core.unpermute.default, (y, idx, T, probs, off))
    torch.library.opcheck(torch.ops.moe_core.unpermute.default, (y, idx, T, None, None))
    torch.library.opcheck(torch.ops.moe_core.unpermute_bwd.default, (torch.randn(T, H), idx, probs.detach(), off, y.detach()))
    torch.library.opcheck(torch.ops.moe_core.unpermute_bwd.default, (torch.randn(T, H), idx, None, None, None))
    split, order = torch.tensor([2, 0, 4, 3]), torch.tensor([2, 0, 3, 1])
    torch.library.opcheck(torch.ops.moe_core.sort_chunks_by_idxs.default, (x, split, order))
    torch.library.opcheck(torch.ops.moe_core.sort_chunks_by_idxs_bwd.default, (torch.randn(T, H), split, order))


def test_gradcheck_fp64():
    T, E, k, H = 7, 4, 2, 3
    probs, m = router_output(T, E, k, torch.float64)
    x = torch.randn(T, H, dtype=torch.float64, requires_grad=True)
    p = probs.detach().requires_grad_()

    def perm(x, p):
        rows, pp, *_ = ops.permute(x, m, p, num_out_tokens=T * k, align_size=4)
        return rows, pp

    assert torch.autograd.gradcheck(perm, (x, p))
    rows, _, idx, off, _ = ops.permute(x.detach(), m, None, num_out_tokens=T * k, align_size=4)
    y = torch.randn(rows.shape, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda y, p: ops.unpermute(y, idx, (T, H), probs=p, routing_map=m, pad_offsets=off), (y, p))
    assert torch.autograd.gradcheck(
        lambda p: ops.apply_router_token_dropping(p, m, k, 0.7, "probs", False)[0], (p,))
    split, order = torch.tensor([2, 0, 4, 1]), torch.tensor([3, 0, 2, 1])
    assert torch.autograd.gradcheck(lambda x: ops.sort_chunks_by_idxs(x, split, order)[0], (x,))


def test_compile_fullgraph_dropless_layout():
    T, E, k, H = 16, 4, 2, 8
    probs, m = router_output(T, E, k, torch.float32)
    x = torch.randn(T, H)

    def layer(x, probs, m):
        rows, _, idx, off, cnt = ops.permute(x, m, None, num_out_tokens=T * k)
        return ops.unpermute(rows * 2, idx, x.shape, probs=probs, routing_map=m), cnt

    eager = layer(x, probs, m)
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")(x, probs, m)
    assert torch.equal(eager[0], compiled[0]) and torch.equal(eager[1], compiled[1])


# ---- bad input: one test per rejected case ------------------------------------------------------

def _setup():
    T, E, H = 6, 4, 3
    m = random_map(T, E, 2)
    p = distinct_probs(m, torch.float32)
    x = torch.randn(T, H)
    rows, _, idx, off, _ = ops.permute(x, m, None, num_out_tokens=T * 2)
    return T, E, H, m, p, x, rows, idx, off


BAD_CASES = {
    "capacity_num_experts": (lambda s: ops.get_capacity(8, 0, 1.0), ValueError, "num_experts"),
    "capacity_factor_negative": (lambda s: ops.get_capacity(8, 2, -1.0), ValueError, "capacity_factor"),
    "drop_policy": (lambda s: ops.apply_router_token_dropping(s["p"], s["m"], 2, 1.0, "random"),
                    ValueError, "drop_policy"),
    "drop_topk": (lambda s: ops.apply_router_token_dropping(s["p"], s["m"], 0, 1.0), ValueError,
                  "router_topk"),
    "drop_probs_1d": (lambda s: ops.apply_router_token_dropping(s["p"][0], s["m"], 2, 1.0),
                      ValueError, "routing_probs"),
    "drop_probs_int": (lambda s: ops.apply_router_token_dropping(s["m"].long(), s["m"], 2, 1.0),
                       TypeError, "routing_probs"),
    "drop_map_dtype": (lambda s: ops.apply_router_token_dropping(s["p"], s["m"].int(), 2, 1.0),
                       TypeError, "routing_map"),
    "drop_map_shape": (lambda s: ops.apply_router_token_dropping(s["p"], s["m"][:-1], 2, 1.0),
                       ValueError, "routing_map"),
    "permute_num_out_none": (lambda s: ops.permute(s["x"], s["m"]), ValueError, "num_out_tokens"),
    "permute_num_out_negative": (lambda s: ops.permute(s["x"], s["m"], num_out_tokens=-1),
                                 ValueError, "num_out_tokens"),
    "permute_align_negative": (lambda s: ops.permute(s["x"], s["m"], num_out_tokens=4, align_size=-2),
                               ValueError, "align_size"),
    "permute_tokens_1d": (lambda s: ops.permute(s["x"][0], s["m"], num_out_tokens=4), ValueError,
                          "tokens"),
    "permute_tokens_int": (lambda s: ops.permute(s["x"].long(), s["m"], num_out_tokens=4),
                           TypeError, "tokens"),
    "permute_map_dtype": (lambda s: ops.permute(s["x"], s["m"].float(), num_out_tokens=4),
                          TypeError, "routing_map"),
    "permute_map_rows": (lambda s: ops.permute(s["x"], s["m"][:-1], num_out_tokens=4),
                         ValueError, "routing_map"),
    "permute_probs_shape": (lambda s: ops.permute(s["x"], s["m"], s["p"][:, :-1], num_out_tokens=4),
                            ValueError, "probs"),
    "unpermute_restore_shape": (lambda s: ops.unpermute(s["rows"], s["idx"], (6, 4)), ValueError,
                                "restore_shape"),
    "unpermute_indices_length": (lambda s: ops.unpermute(s["rows"], s["idx"][:-1], (6, 3)),
                                 ValueError, "sorted_indices"),
    "unpermute_indices_dtype": (lambda s: ops.unpermute(s["rows"], s["idx"].int(), (6, 3)),
                                TypeError, "sorted_indices"),
    "unpermute_indices_range": (lambda s: ops.unpermute(s["rows"], s["idx"] + 1, (6, 3)),
                                ValueError, "sorted_indices"),
    "unpermute_probs_no_map": (lambda s: ops.unpermute(s["rows"], s["idx"], (6, 3), probs=s["p"]),
                               ValueError, "routing_map"),
    "unpermute_probs_rows": (lambda s: ops.unpermute(s["rows"], s["idx"], (6, 3), probs=s["p"][:-1],
                                                     pad_offsets=s["off"]), ValueError, "probs"),
    "unpermute_offsets_size": (lambda s: ops.unpermute(s["rows"], s["idx"], (6, 3), probs=s["p"],
                                                       pad_offsets=s["off"][:-1]),
                               ValueError, "expert_offsets"),
    "unpermute_offsets_order": (lambda s: ops.unpermute(s["rows"], s["idx"], (6, 3), probs=s["p"],
                                                        pad_offsets=s["off"].flip(0)),
                                ValueError, "expert_offsets"),
    "unpermute_rows_int": (lambda s: ops.unpermute(s["rows"].long(), s["idx"], (6, 3)), TypeError,
                           "permuted_tokens"),
    "chunks_sum": (lambda s: ops.sort_chunks_by_idxs(s["x"], torch.tensor([2, 3]), torch.tensor([1, 0])),
                   ValueError, "split_sizes"),
    "chunks_negative": (lambda s: ops.sort_chunks_by_idxs(s["x"], torch.tensor([7, -1]),
                                                          torch.tensor([1, 0])),
                        ValueError, "split_sizes"),
    "chunks_float_sizes": (lambda s: ops.sort_chunks_by_idxs(s["x"], torch.tensor([2.0, 4.0]),
                                                             torch.tensor([1, 0])),
                           TypeError, "split_sizes"),
    "chunks_not_permutation": (lambda s: ops.sort_chunks_by_idxs(s["x"], torch.tensor([2, 4]),
                                                                 torch.tensor([1, 1])),
                               ValueError, "sorted_idxs"),
    "chunks_out_of_range": (lambda s: ops.sort_chunks_by_idxs(s["x"], torch.tensor([2, 4]),
                                                              torch.tensor([0, 2])),
                            ValueError, "sorted_idxs"),
    "chunks_length": (lambda s: ops.sort_chunks_by_idxs(s["x"], torch.tensor([2, 4]),
                                                        torch.tensor([0, 1, 2])),
                      ValueError, "sorted_idxs"),
}


@pytest.mark.parametrize("case", sorted(BAD_CASES))
def test_bad_input(case):
    T, E, H, m, p, x, rows, idx, off = _setup()
    fn, exc, name = BAD_CASES[case]
    with pytest.raises(exc, match=name):
        fn(dict(m=m, p=p, x=x, rows=rows, idx=idx, off=off))
