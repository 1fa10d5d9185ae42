"""Helpers of the expert tests: poisoned outputs, expert offsets, the per-expert matmul
reference of grouped_gemm (CPU), CUDA-graph capture."""
import contextlib

import torch


@contextlib.contextmanager
def poisoned():
    """torch's deterministic mode fills new (uninitialised) memory with NaN / the dtype's max, so an
    output row a kernel never writes shows."""
    prev = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    assert torch.utils.deterministic.fill_uninitialized_memory
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(prev)


def offsets_of(counts, device="cpu"):
    """[E + 1] int64 expert offsets: 0, then the running row counts."""
    return torch.tensor([0] + torch.tensor(counts, dtype=torch.long).cumsum(0).tolist(),
                        dtype=torch.long, device=device)


def per_expert(fn, offsets, *tensors):
    """Concatenates fn(e, slices...) over experts (row slices of each tensor)."""
    off = offsets.tolist()
    return [fn(e, *[t[off[e]:off[e + 1]] for t in tensors]) for e in range(len(off) - 1)]


def w_e(weight, e, trans_w):
    """Expert e's weight as a [K, N] matrix."""
    return weight[e].t() if trans_w else weight[e]


def reference(x, weight, dy, offsets, trans_w, dtype):
    """fwd, dgrad, wgrad by per-expert torch.matmul in `dtype` (fp64 gives the truth).

    x [R, K], weight [E, K, N] ([E, N, K] with trans_w), dy [R, N], offsets [E + 1] int64; the
    rows of x and dy from offsets[-1] on are left out. Returns y [offsets[-1], N],
    dx [offsets[-1], K] and dw of weight's shape, all in `dtype`."""
    x, weight, dy = x.to(dtype), weight.to(dtype), dy.to(dtype)
    y = torch.cat(per_expert(lambda e, xe: xe @ w_e(weight, e, trans_w), offsets, x))
    dx = torch.cat(per_expert(lambda e, ge: ge @ w_e(weight, e, trans_w).t(), offsets, dy))
    dw = torch.stack(per_expert(lambda e, xe, ge: (ge.t() @ xe) if trans_w else (xe.t() @ ge),
                                offsets, x, dy))
    return y, dx, dw


def capture_graph(step):
    """Warms `step` up on a side stream (as torch's CUDA-graph docs ask), then captures one call.
    Returns (graph, the captured call's outputs); replays overwrite those outputs."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = step()
    return graph, static_out
