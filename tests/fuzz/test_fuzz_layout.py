"""Property-based tests of the token layout ops against tests/helpers/reference_layout.py and plain
torch indexing: permute (dropless, cut-off / spare row bounds, drop-and-pad, aligned blocks),
unpermute (with and without probs), their round trip, sort_chunks_by_idxs, topk_to_dense and
tokens_per_expert. All of these are data movement or a fixed-order sum whose rounding the
contracts spell out, so every comparison is bitwise.
"""
import torch
from hypothesis import given, strategies as st

from helpers import reference_router as ref
from helpers import reference_layout as rl
from helpers.fuzz import FLOATS, assert_bitwise, gen, sprinkle
from moe_core import ops

SMALL_T = st.one_of(st.sampled_from([0, 1, 2]), st.integers(0, 24))
SMALL_E = st.one_of(st.just(1), st.integers(1, 9))


def routing_map(g, T, E, k=None, density=0.5):
    """k distinct experts per token (k given), else an arbitrary map (capacity dropping)."""
    if k is not None:
        idx = torch.argsort(torch.rand(T, E, generator=g), dim=1)[:, :k]
        return torch.zeros(T, E, dtype=torch.bool).scatter_(1, idx, True)
    return torch.rand(T, E, generator=g) < density


@st.composite
def permute_cases(draw):
    T, E, H = draw(SMALL_T), draw(SMALL_E), draw(st.integers(1, 8))
    dtype = draw(st.sampled_from(FLOATS))
    probs_dtype = draw(st.sampled_from([None, torch.float32, dtype, torch.float64]))
    g = gen(draw(st.integers(0, 2**31 - 1)))
    if draw(st.booleans()):
        k = draw(st.integers(1, E))
        rmap = routing_map(g, T, E, k)
    else:
        k = None
        rmap = routing_map(g, T, E, density=draw(st.sampled_from([0.0, 0.3, 1.0])))
    drop_and_pad = draw(st.booleans())
    if drop_and_pad:
        num_out = E * draw(st.integers(0, T + 2))  # capacity past T pads with -1 rows
    else:
        routed = int(rmap.sum())
        num_out = draw(st.sampled_from([routed, T * (k or E), max(routed - 1, 0), routed + 3]))
    align = draw(st.sampled_from([0, 1, 2, 4, 8]))
    tokens = sprinkle(torch.randn(T, H, generator=g, dtype=torch.float64), g,
                      draw(st.sampled_from([0.0, 0.1])), ["nan", "inf", "-inf"]).to(dtype)
    probs = None
    if probs_dtype is not None:
        probs = (torch.rand(T, E, generator=g, dtype=torch.float64) * rmap).to(probs_dtype)
    return tokens, rmap, probs, num_out, drop_and_pad, align


@given(permute_cases())
def test_permute_and_unpermute_vs_index_reference(case):
    tokens, rmap, probs, num_out, dnp, align = case
    T, H = tokens.shape
    out = ops.permute(tokens, rmap, probs, num_out_tokens=num_out, drop_and_pad=dnp,
                      align_size=align)
    want = rl.permute(tokens, rmap, probs, num_out, drop_and_pad=dnp, align=align)
    for name, o, w in zip(("rows", "row probs", "sorted_indices", "expert_offsets", "counts"),
                          out, want):
        if w is None:
            assert o is None, name
        else:
            assert_bitwise(o, w, name)
    rows, _, idx, offsets, _ = out
    # the combine of rows that an expert MLP changed (here: scaled by 3), with and without probs
    y = (rows.double() * 3).to(rows.dtype)
    assert_bitwise(ops.unpermute(y, idx, (T, H)), rl.unpermute(y, idx, T), "unpermute")
    if probs is not None:
        assert_bitwise(ops.unpermute(y, idx, (T, H), probs=probs, pad_offsets=offsets),
                       rl.unpermute(y, idx, T, probs, offsets), "unpermute with probs")


@given(permute_cases())
def test_permute_backward_is_the_unprobed_combine(case):
    """permute's backward sums each token's row gradients in ascending row order in fp32 (fp64)
    and rounds once: reference_layout.unpermute without probs, bit for bit; the probs' gradient
    is each row's gradient put back at (token, expert)."""
    tokens, rmap, probs, num_out, dnp, align = case
    T, H = tokens.shape
    x = tokens.clone().requires_grad_()
    p = probs.clone().requires_grad_() if probs is not None else None
    rows, rp, idx, offsets, _ = ops.permute(x, rmap, p, num_out_tokens=num_out, drop_and_pad=dnp,
                                            align_size=align)
    g = gen(1)
    grows = torch.randn(rows.shape, generator=g, dtype=torch.float64).to(rows.dtype)
    loss = (rows * grows).sum()
    if rp is not None:
        grp = torch.randn(rp.shape, generator=g, dtype=torch.float64).to(rp.dtype)
        loss = loss + (rp * grp).sum()
    loss.backward()
    assert_bitwise(x.grad, rl.unpermute(grows, idx, T), "grad tokens")
    if p is not None:
        want = torch.zeros_like(probs)
        experts = rl.row_experts(offsets, idx.numel())
        for r, t in enumerate(idx.tolist()):
            if t >= 0:
                want[t, experts[r]] = grp[r]
        assert_bitwise(p.grad, want, "grad probs")


@given(st.integers(0, 40), st.integers(1, 8), st.integers(1, 6), st.sampled_from(FLOATS),
       st.integers(0, 2**31 - 1))
def test_dropless_round_trip_topk1_is_identity(T, E, H, dtype, seed):
    """topk = 1, dropless: every token has exactly one row, so unpermute(permute(x)) == x."""
    g = gen(seed)
    x = sprinkle(torch.randn(T, H, generator=g, dtype=torch.float64), g, 0.1,
                 ["nan", "inf", "-inf"]).to(dtype)
    rmap = routing_map(g, T, E, 1)
    rows, _, idx, _, _ = ops.permute(x, rmap, num_out_tokens=T)
    assert_bitwise(ops.unpermute(rows, idx, (T, H)), x, "round trip")


@given(st.integers(0, 12), st.integers(1, 5), st.sampled_from(FLOATS + [torch.int64]),
       st.integers(0, 2**31 - 1), st.booleans())
def test_sort_chunks_by_idxs_vs_split_cat(num_chunks, H, dtype, seed, with_probs):
    g = gen(seed)
    sizes = torch.randint(0, 5, (num_chunks,), generator=g)
    order = torch.randperm(num_chunks, generator=g)
    R = int(sizes.sum())
    x = torch.randn(R, H, generator=g, dtype=torch.float64)
    x = x.to(dtype) if dtype.is_floating_point else (x * 100).to(dtype)
    probs = torch.rand(R, generator=g) if with_probs else None
    want = [x.split(sizes.tolist())[i] for i in order.tolist()]
    want = torch.cat(want) if want else x
    if dtype.is_floating_point:
        xg = x.clone().requires_grad_()
        out, p = ops.sort_chunks_by_idxs(xg, sizes, order, probs)
        assert_bitwise(out, want, "sorted chunks")
        gout = torch.randn(out.shape, generator=g, dtype=torch.float64).to(dtype)
        out.backward(gout)
        # the backward moves the gradient chunks back: the inverse permutation
        back = torch.empty_like(gout)
        starts = torch.cat([sizes.new_zeros(1), sizes.cumsum(0)])
        pos = 0
        for c in order.tolist():
            n = int(sizes[c])
            back[int(starts[c]):int(starts[c]) + n] = gout[pos:pos + n]
            pos += n
        assert_bitwise(xg.grad, back, "grad")
    else:
        out, p = ops.sort_chunks_by_idxs(x, sizes, order, probs)
        assert_bitwise(out, want, "sorted chunks")
    if with_probs:
        pw = [probs.split(sizes.tolist())[i] for i in order.tolist()]
        assert_bitwise(p, torch.cat(pw) if pw else probs, "sorted probs")


@given(SMALL_T, SMALL_E, st.sampled_from(FLOATS), st.integers(0, 2**31 - 1), st.data())
def test_topk_to_dense_vs_scatter(T, E, dtype, seed, data):
    k = data.draw(st.integers(1, E))
    g = gen(seed)
    idx = torch.argsort(torch.rand(T, E, generator=g), dim=1)[:, :k]
    probs = sprinkle(torch.randn(T, k, generator=g, dtype=torch.float64), g, 0.2,
                     ["nan", "inf", "-inf"]).to(dtype).requires_grad_()
    dense, rmap = ops.topk_to_dense(probs, idx, E)
    want, want_map = ref.to_dense(probs.detach(), idx, E)
    assert_bitwise(dense, want, "dense probs")
    assert_bitwise(rmap, want_map, "routing map")
    gd = torch.randn(T, E, generator=g, dtype=torch.float64).to(dtype)
    dense.backward(gd)
    assert_bitwise(probs.grad, gd.gather(1, idx), "grad (a gather)")


@given(st.one_of(SMALL_T, st.sampled_from([1000, 4097])), st.one_of(SMALL_E, st.just(256)),
       st.sampled_from([0.0, 0.1, 0.5, 1.0]), st.sampled_from([None, "flat", "2d"]),
       st.integers(0, 2**31 - 1))
def test_tokens_per_expert_vs_sum(T, E, density, mask_kind, seed):
    g = gen(seed)
    rmap = routing_map(g, T, E, density=density)
    pad = torch.rand(T, generator=g) < 0.3
    mask = None if mask_kind is None else (pad if mask_kind == "flat" else pad.view(1, T))
    want = rmap[~pad].sum(0) if mask is not None else rmap.sum(0)
    assert_bitwise(ops.tokens_per_expert(rmap, mask), want.to(torch.long), "counts")
