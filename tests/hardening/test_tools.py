"""tools.layer_rows_ab's op-by-op timing (``--ops``) on the CPU: it wraps expert_mlp's op
handles, ``permute`` and the router for a run, so the run must leave the same gradients as an
unwrapped step, see each path's own ops, and put every handle back, on an error too."""
import dataclasses
import sys

import pytest
import torch

import moe_core.ops


@pytest.fixture(scope="module")
def ab():
    # imported when a test needs it, not at collection: through benchmarks.bench_ep it sets NCCL's
    # multicast switches for the whole process
    from tools import layer_rows_ab

    return layer_rows_ab


def _handles(ab):
    mlp = sys.modules["moe_core.ops.expert_mlp"]
    return {n: getattr(mlp, n) for n in ab._EXPERT_OPS} | {"permute": moe_core.ops.permute}


def _tiny(ab, by_index):
    from benchmarks.bench_ep import build_ours, moe_kwargs
    from benchmarks.shapes import SHAPES
    s = SHAPES["tiny"]
    layer = build_ours(moe_kwargs(s, "dropless", 1), torch.device("cpu"), 0, None, None)
    layer.config = dataclasses.replace(layer.config, moe_expert_rows_by_index=by_index)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(s.tokens, s.hidden, dtype=torch.bfloat16, generator=gen, requires_grad=True)
    g = torch.randn(s.tokens, s.hidden, dtype=torch.bfloat16, generator=gen)
    return layer, x, g


@pytest.mark.parametrize("by_index", [False, True])
def test_ops_timing_same_gradients_own_ops_handles_restored(ab, by_index):
    before = _handles(ab)
    layer, x, g = _tiny(ab, by_index)
    layer(x).backward(g)
    expected = x.grad.clone()
    params = list(layer.parameters()) + [x]
    for p in params:
        p.grad = None
    grads = []

    def clear():
        grads.append(x.grad.clone())
        for p in params:
            p.grad = None

    per = ab.op_times(layer, x, g, clear, torch.device("cpu"), 2)
    assert len(grads) == 3 and all(torch.equal(t, expected) for t in grads)
    for op in ("router", "layout", "_FC1", "_FC2", "_DGRAD", "_WGRAD", "_GLU_BWD_"):
        assert per[op] > 0, op
    # by index the tokens' gradient is made inside expert_mlp; with the rows made, the rows'
    # gradient is gathered there and permute's backward makes the tokens'
    assert ("gathered_rows_grad" in per) == by_index
    assert ("_UNPERMUTE_BWD" in per) == (not by_index)
    assert _handles(ab) == before
    assert not layer.router._forward_hooks and not layer.router._forward_pre_hooks


def test_ops_timing_restores_handles_after_an_error(ab):
    before = _handles(ab)
    layer, x, g = _tiny(ab, True)

    def clear():
        raise RuntimeError("stop")

    with pytest.raises(RuntimeError, match="stop"):
        ab.op_times(layer, x, g, clear, torch.device("cpu"), 1)
    assert _handles(ab) == before
    assert not layer.router._forward_hooks and not layer.router._forward_pre_hooks
