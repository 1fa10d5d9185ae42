"""Helpers of the expert tests: poisoned outputs, expert offsets, CUDA-graph capture."""
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
