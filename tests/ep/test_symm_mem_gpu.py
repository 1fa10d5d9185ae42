"""The symmetric-memory dispatcher (``moe_alltoall_exchange="symm_mem"``) on one GPU, over an NCCL
world of one (the ``group`` fixture of tests/ep/conftest.py; layers, batches and comparisons from
tests/helpers/ep_cuda.py) with the exchange forced on at one rank (``dispatcher.exchange =
True``). NVSHMEM's rendezvous needs two ranks, so a group of one exchanges locally
(``LocalExchange``, a masked copy); everything around the exchange runs on CUDA as at any size
(counts, acceptance rule, packing, compaction, chunk sorts, the autograd of the exchange):

* the symm_mem layer equals the NCCL-exchange layer bitwise (output, input gradient, every
  parameter gradient, the router's losses) over two steps, with a budget of exactly the rows
  received (factor 1) and with an unused tail in the receive buffer (factor 2); nothing dropped;
* a budget below the load (factor 0.5) equals the NCCL-exchange layer whose routing map loses
  exactly the pairs the acceptance rule drops, and ``last_dropped_rows`` counts them;
* forward and backward make no stream-blocking call (``torch.cuda.set_sync_debug_mode("error")``)
  after a warm-up step (which allocates and rendezvouses the symmetric buffers);
* forward and backward captured in one CUDA graph and replayed on new inputs equal eager.

Skipped without a GPU, and without NVSHMEM (``is_nvshmem_available()`` False). The same checks
at 2 and 4 ranks with an emulated exchange over gloo are in tests/ep/test_symm_mem.py, and with the
NVSHMEM exchange at 2 ranks on 2 GPUs in tests/ep/test_symm_mem_multi_gpu.py.
"""
import math
import os
from typing import Tuple

import pytest
import torch

# hosts whose NVLink multicast is off need these before NVSHMEM starts; harmless elsewhere
for _name, _value in (("NVSHMEM_DISABLE_NVLS", "1"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                      ("NCCL_NVLS_ENABLE", "0")):
    os.environ.setdefault(_name, _value)

from helpers.ep_cuda import (B, S, assert_bitwise, batch, config_kwargs,  # noqa: E402
                             make_layer, no_blocking_sync, run_step)
from helpers.reference_symm_mem import expected_keep  # noqa: E402


def _nvshmem_available() -> bool:
    try:
        from torch.distributed import _symmetric_memory as symm_mem
        return bool(symm_mem.is_nvshmem_available())
    except (ImportError, AttributeError, RuntimeError):
        return False


pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU"),
    pytest.mark.skipif(torch.cuda.is_available() and not _nvshmem_available(),
                       reason="needs NVSHMEM (torch.distributed._symmetric_memory."
                              "is_nvshmem_available() is False)"),
]

CASES = ["softmax_top2", "sigmoid_groups_bias_top4_shared"]


def nccl_and_symm(case: str, group, factor: float) -> Tuple:
    kw = config_kwargs(case, "dropless", "alltoall")
    nccl = make_layer(kw, group)
    state = {k: v.clone() for k, v in nccl.state_dict().items()}
    symm = make_layer(dict(kw, moe_alltoall_exchange="symm_mem",
                           moe_alltoall_recv_factor=factor), group, state)
    assert type(symm.dispatcher).__name__ == "SymmMemAlltoAllDispatcher"
    assert symm.dispatcher.exchange and not symm.dispatcher.emulate
    return nccl, symm


@pytest.mark.parametrize("factor", [1.0, 2.0])
@pytest.mark.parametrize("case", CASES)
def test_symm_mem_equals_nccl_exchange_bitwise(group, tuning_env, case, factor):
    tuning_env("MOE_GG_SM90_SPLIT_TAIL", "0")
    nccl, symm = nccl_and_symm(case, group, factor)
    for seed in (1, 2):
        x, w = batch(seed=seed)
        want = run_step(nccl, nccl, x, w)
        got = run_step(symm, symm, x, w)
        assert_bitwise(got, want, f"symm_mem vs nccl exchange ({case}, factor {factor}, "
                                  f"step {seed})")
        assert int(symm.last_dropped_rows) == 0


def test_overflow_drops_the_rule_rows(group, tuning_env):
    tuning_env("MOE_GG_SM90_SPLIT_TAIL", "0")
    factor = 0.5
    nccl, symm = nccl_and_symm("softmax_top2", group, factor)
    budget = math.ceil(factor * S * B * nccl.config.moe_router_topk)
    original = nccl.router.forward
    dropped = {}

    def dropping_router(*args, **kwargs):
        probs, rmap = original(*args, **kwargs)
        keep = expected_keep([rmap.cpu()], 1, budget)[0].to(rmap.device)
        dropped["rows"] = int((rmap & ~keep).sum())
        return probs, rmap & keep

    nccl.router.forward = dropping_router
    x, w = batch()
    want = run_step(nccl, nccl, x, w)
    got = run_step(symm, symm, x, w)
    assert dropped["rows"] > 0
    assert_bitwise(got, want, "symm_mem with overflow vs the rule's reference")
    assert int(symm.last_dropped_rows) == dropped["rows"]


@pytest.mark.parametrize("case", CASES)
def test_symm_mem_never_syncs(group, case):
    _, symm = nccl_and_symm(case, group, 2.0)
    x, w = batch()
    run_step(symm, symm, x, w)  # warm-up: symmetric buffers, NVSHMEM, the token-count check
    xr = x.clone().requires_grad_()
    with no_blocking_sync():
        out = symm(xr)
        (out.float() * w).sum().backward()
    torch.cuda.synchronize()
    assert xr.grad is not None


def test_symm_mem_cuda_graph(group):
    _, layer = nccl_and_symm("softmax_top2", group, 2.0)
    params = list(layer.parameters())
    _, w = batch()

    def step(x: torch.Tensor):
        x = x.detach().requires_grad_()
        out = layer(x)
        grads = torch.autograd.grad((out.float() * w).sum(), [x] + params)
        return (out,) + tuple(grads)

    static_x, _ = batch(seed=3)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capture stream: buffers, NCCL, checks
        for _ in range(3):
            step(static_x)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        static_outs = step(static_x)
    names = ["out", "dx"] + [f"grad {n}" for n, _ in layer.named_parameters()]
    for seed in (4, 5):
        new_x, _ = batch(seed=seed)
        static_x.copy_(new_x)
        graph.replay()
        torch.cuda.synchronize()
        want = step(new_x)
        torch.cuda.synchronize()
        assert_bitwise(dict(zip(names, static_outs)), dict(zip(names, want)),
                       f"graph replay (seed {seed}) vs eager")
