"""The symmetric-memory exchange (``moe_alltoall_exchange="symm_mem"``) through NVSHMEM
(``NvshmemExchange``, ``torch.ops.symm_mem.all_to_all_vdev``) at 2 ranks on 2 GPUs: one process
per GPU, spawned by ``helpers.dist.run_ranks`` over NCCL (free port, a timeout on every
collective, a rank still running when another fails is stopped and reported). Layers, batches and
comparisons are tests/helpers/ep_cuda.py's (T = 256 tokens a rank, H = 256, E = 8, bf16
parameters, fp32 router); each rank holds its shard of one seeded global layer.

* both configurations build the NVSHMEM exchange (not the emulated or the local one);
* the symm_mem layer equals the NCCL-exchange layer with the same weights bitwise (output, input
  gradient, every parameter gradient, the router's losses) over two steps, and drops nothing:
  with a receive budget of twice the rows a rank sends (factor 2.0 = the world size: no receiver
  can get more, so the buffer keeps an unused tail), each rank its own batch; and with a budget
  of exactly the rows a rank sends (factor 1.0). At factor 1.0 a receiver overflows whenever
  routing favours its experts, so there both ranks take the same batch and rank 1's router
  weight and expert bias are rank 0's with the two halves of the experts swapped: rank 1 routes
  every token to the mirror image of rank 0's experts, every receiver gets exactly its budget
  (checked from the gathered routing maps), and the buffer is full to the last row;
* a budget below the load (factor 0.5, each rank its own batch) equals the NCCL-exchange layer
  whose routing map loses exactly the (token, expert) pairs the acceptance rule drops, computed
  from both ranks' routing maps by ``helpers.reference_symm_mem.expected_keep`` (as
  tests/ep/test_symm_mem.py does with the emulated exchange), over two steps; and
  ``last_dropped_rows`` equals the number of this rank's pairs dropped;
* forward and backward make no stream-blocking call (``torch.cuda.set_sync_debug_mode("error")``)
  after a warm-up step (which starts NVSHMEM, allocates and rendezvouses the symmetric buffers
  and checks the token counts), with nothing dropped (factor 2.0) and with rows dropped (0.5);
* when one rank fails between two exchanges, the other, left waiting in the exchange (a device
  wait without a timeout of its own), is stopped and named, and no rank process outlives the
  call.

NVSHMEM frees a symmetric buffer collectively (every rank, in the same order) from the tensor's
deleter, so each worker keeps its layers until its checks end, with the cyclic garbage collector
off, and every rank then frees them in the same order between two barriers.

Set in every rank before NCCL and NVSHMEM start (hosts whose NVLink multicast is off need them;
harmless elsewhere): NVSHMEM_DISABLE_NVLS=1, TORCH_SYMM_MEM_DISABLE_MULTICAST=1,
NCCL_NVLS_ENABLE=0 (a value already in the environment is kept). The bitwise checks switch off the
Hopper grouped GEMM's split of a partial last wave (MOE_GG_SM90_SPLIT_TAIL=0), as the other
bitwise EP tests do.

Skipped with fewer than 2 GPUs, and without NVSHMEM (``is_nvshmem_available()`` False or no
``all_to_all_vdev`` in this torch). The one-GPU version (a group of one exchanges locally) is
tests/ep/test_symm_mem_gpu.py; 2 and 4 ranks with the emulated exchange over gloo,
tests/ep/test_symm_mem.py.
"""
import contextlib
import gc
import math
import multiprocessing
import os
from typing import Dict, List, Tuple

import pytest
import torch

from helpers.dist import run_ranks
from helpers.ep_cuda import (B, E, S, batch, bitwise_differences, config_kwargs, make_layer,
                             no_blocking_sync, run_step)
from helpers.ep_layer import shard_state
from helpers.reference_symm_mem import expected_keep

WORLD = 2

# hosts whose NVLink multicast is off need these before NCCL and NVSHMEM start; harmless elsewhere
NVSHMEM_ENV = {name: os.environ.get(name, value) for name, value in (
    ("NVSHMEM_DISABLE_NVLS", "1"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
    ("NCCL_NVLS_ENABLE", "0"))}


def _nvshmem_available() -> bool:
    try:
        from torch.distributed import _symmetric_memory as symm_mem
        return bool(symm_mem.is_nvshmem_available()) and hasattr(torch.ops.symm_mem,
                                                                 "all_to_all_vdev")
    except (ImportError, AttributeError, RuntimeError):
        return False


pytestmark = [
    pytest.mark.skipif(torch.cuda.device_count() < WORLD, reason=f"needs {WORLD} GPUs"),
    pytest.mark.skipif(torch.cuda.device_count() >= WORLD and not _nvshmem_available(),
                       reason="needs NVSHMEM (torch.distributed._symmetric_memory."
                              "is_nvshmem_available() is False or torch.ops.symm_mem has no "
                              "all_to_all_vdev)"),
]

CASES = ["softmax_top2", "sigmoid_groups_bias_top4_shared"]
EQUAL = [(case, factor) for case in CASES for factor in (1.0, 2.0)]
OVERFLOW_FACTOR = 0.5
NO_SYNC = [(case, factor) for case in CASES for factor in (2.0, OVERFLOW_FACTOR)]


# ---- in the ranks ----------------------------------------------------------------------------
@contextlib.contextmanager
def _lockstep_frees(layers: list):
    """The block appends every layer it builds to ``layers``, so none (and none of its symmetric
    buffers) is freed inside it; the cyclic garbage collector is off meanwhile (it runs at a
    moment of its own in each process, and a symmetric buffer it freed would enter NVSHMEM's
    collective free alone). After the block every rank frees the layers in the same order, and
    collects, between two barriers."""
    import torch.distributed as dist

    gc.disable()
    try:
        yield
        torch.cuda.synchronize()
        dist.barrier()
        layers.clear()
        gc.collect()
        torch.cuda.synchronize()
        dist.barrier()
    finally:
        gc.enable()


def _pair(rank: int, case: str, factor: float, layers: list, mirror: bool = False):
    """(NCCL-exchange layer, symm_mem layer), both with rank ``rank``'s shard of the seeded
    global layer, also appended to ``layers``; ``mirror``: rank 1's router weight and expert
    bias are the global ones with the two halves of the experts swapped (expert e scores as
    expert (e + E/2) mod E)."""
    import torch.distributed as dist

    os.environ.pop("MOE_SYMM_MEM_EMULATE", None)  # the NVSHMEM exchange, never the emulation
    kw = config_kwargs(case, "dropless", "alltoall")
    state = shard_state(make_layer(kw), rank, WORLD)
    if mirror and rank == 1:
        for name in ("router.weight", "router.expert_bias"):
            if name in state:
                state[name] = state[name].roll(-(E // 2), dims=0).contiguous()
    ep_kw = dict(kw, expert_model_parallel_size=WORLD)
    nccl = make_layer(ep_kw, dist.group.WORLD, state)
    symm = make_layer(dict(ep_kw, moe_alltoall_exchange="symm_mem",
                           moe_alltoall_recv_factor=factor), dist.group.WORLD, state)
    layers.extend([nccl, symm])
    return nccl, symm


def _kinds(symm) -> Dict[str, object]:
    d = symm.dispatcher
    return dict(dispatcher=type(d).__name__, exchanger=type(d.exchanger).__name__,
                emulate=d.emulate)


def _rule_reference(layer, rank: int, budget: int, drop: bool, seen: dict) -> None:
    """Wraps ``layer``'s router: every forward gathers both ranks' routing maps and records each
    receiver's load (``seen["loads"]``) and how many of this rank's pairs the acceptance rule
    drops at ``budget`` (``seen["expected"]``); with ``drop`` the layer routes without them."""
    import torch.distributed as dist

    original = layer.router.forward

    def forward(*args, **kwargs):
        probs, rmap = original(*args, **kwargs)
        parts = [torch.empty_like(rmap, dtype=torch.uint8) for _ in range(WORLD)]
        dist.all_gather(parts, rmap.to(torch.uint8).contiguous())
        maps = [p.bool().cpu() for p in parts]
        nle = maps[0].shape[1] // WORLD
        seen["loads"] = [sum(int(m[:, r * nle:(r + 1) * nle].sum()) for m in maps)
                         for r in range(WORLD)]
        keep = expected_keep(maps, WORLD, budget)[rank].to(rmap.device)
        seen["expected"] = int((rmap & ~keep).sum())
        return probs, (rmap & keep) if drop else rmap

    layer.router.forward = forward


def _compare(rank: int, case: str, factor: float, mirror: bool, drop: bool,
             layers: list) -> dict:
    """Two steps of the symm_mem layer against the NCCL-exchange layer (the rule's drops
    applied with ``drop``): per step, what differs, this rank's rows dropped and the
    reference's count, the receivers' loads; the budget and the exchange built."""
    nccl, symm = _pair(rank, case, factor, layers, mirror)
    budget = math.ceil(factor * S * B * nccl.config.moe_router_topk)
    seen: dict = {}
    _rule_reference(nccl, rank, budget, drop, seen)
    steps = []
    for step in (1, 2):
        x, w = batch(seed=100 * step + (0 if mirror else rank))
        want = run_step(nccl, nccl, x, w)
        got = run_step(symm, symm, x, w)
        steps.append(dict(bad=bitwise_differences(got, want), dropped=int(symm.last_dropped_rows),
                          expected=seen["expected"], loads=seen["loads"]))
    return dict(kinds=_kinds(symm), budget=budget, steps=steps)


def exchange_worker(rank: int, world: int) -> dict:
    import moe_core

    res, layers = {}, []
    with _lockstep_frees(layers), moe_core.tuning.environment(MOE_GG_SM90_SPLIT_TAIL="0"):
        for case, factor in EQUAL:
            res[(case, factor)] = _compare(rank, case, factor, mirror=factor == 1.0, drop=False,
                                           layers=layers)
        for case in CASES:
            res[(case, OVERFLOW_FACTOR)] = _compare(rank, case, OVERFLOW_FACTOR, mirror=False,
                                                    drop=True, layers=layers)
    return res


def no_sync_worker(rank: int, world: int) -> Dict[Tuple[str, float], bool]:
    res, layers = {}, []
    with _lockstep_frees(layers):
        for case, factor in NO_SYNC:
            res[(case, factor)] = _no_sync_check(rank, case, factor, layers)
    return res


def _no_sync_check(rank: int, case: str, factor: float, layers: list) -> bool:
    """A step after a warm-up step (NVSHMEM, the symmetric buffers, the token-count check) with
    every stream-blocking call raising; whether the input got its gradient."""
    _, symm = _pair(rank, case, factor, layers)
    x, w = batch(seed=1 + rank)
    run_step(symm, symm, x, w)
    xr = x.clone().requires_grad_()
    with no_blocking_sync():
        out = symm(xr)
        (out.float() * w).sum().backward()
    torch.cuda.synchronize()
    return xr.grad is not None


STOP_MESSAGE = "rank 1 stops before the second step"


def stop_worker(rank: int, world: int) -> str:
    """Both ranks run a step; then rank 1 raises and rank 0 enters the next exchange alone."""
    _, symm = _pair(rank, "softmax_top2", 2.0, [])
    x, w = batch(seed=1 + rank)
    run_step(symm, symm, x, w)
    if rank == 1:
        raise RuntimeError(STOP_MESSAGE)
    run_step(symm, symm, x, w)  # waits for rank 1 (the counts' all-gather, the exchange)
    return "rank 0 finished without rank 1"


# ---- the checks ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def exchange_results() -> List[dict]:
    return run_ranks(exchange_worker, WORLD, backend="nccl", env=NVSHMEM_ENV, timeout=600)


def test_symm_mem_uses_the_nvshmem_exchange(exchange_results):
    for rank, res in enumerate(exchange_results):
        for key, r in res.items():
            assert r["kinds"] == dict(dispatcher="SymmMemAlltoAllDispatcher",
                                      exchanger="NvshmemExchange", emulate=False), \
                f"rank {rank} {key}: {r['kinds']}"


@pytest.mark.parametrize("case,factor", EQUAL, ids=[f"{c}-factor{f}" for c, f in EQUAL])
def test_symm_mem_equals_nccl_exchange_bitwise(exchange_results, case, factor):
    for rank, res in enumerate(exchange_results):
        r = res[(case, factor)]
        for step, s in enumerate(r["steps"], 1):
            where = f"rank {rank} {case} factor {factor} step {step}"
            assert not s["bad"], f"{where}: symm_mem vs nccl exchange differ:\n  " + \
                "\n  ".join(s["bad"])
            assert s["dropped"] == 0 and s["expected"] == 0, f"{where}: rows dropped: {s}"
            if factor == 1.0:  # the mirrored routing fills every receiver's budget exactly
                assert s["loads"] == [r["budget"]] * WORLD, f"{where}: loads {s['loads']}, " \
                                                            f"budget {r['budget']}"
            else:
                assert max(s["loads"]) <= r["budget"], f"{where}: {s['loads']} > {r['budget']}"


@pytest.mark.parametrize("case", CASES)
def test_overflow_drops_the_rule_rows(exchange_results, case):
    per_rank = [res[(case, OVERFLOW_FACTOR)] for res in exchange_results]
    for step in range(2):
        assert sum(r["steps"][step]["expected"] for r in per_rank) > 0, \
            f"{case} step {step + 1}: nothing overflowed the budget {per_rank[0]['budget']}"
    for rank, r in enumerate(per_rank):
        for step, s in enumerate(r["steps"], 1):
            where = f"rank {rank} {case} factor {OVERFLOW_FACTOR} step {step}"
            assert not s["bad"], f"{where}: symm_mem vs the rule's reference differ:\n  " + \
                "\n  ".join(s["bad"])
            assert s["dropped"] == s["expected"], f"{where}: {s}"


def test_symm_mem_never_syncs():
    per_rank = run_ranks(no_sync_worker, WORLD, backend="nccl", env=NVSHMEM_ENV, timeout=600)
    for rank, res in enumerate(per_rank):
        assert res == {key: True for key in NO_SYNC}, f"rank {rank}: {res}"


def test_no_rank_left_waiting_when_another_fails():
    before = set(multiprocessing.active_children())
    with pytest.raises(AssertionError) as failed:
        run_ranks(stop_worker, WORLD, backend="nccl", env=NVSHMEM_ENV, timeout=600)
    message = str(failed.value)
    assert "rank 1 failed (ranks [0] were still running and are stopped)" in message, message
    assert STOP_MESSAGE in message, message
    left = set(multiprocessing.active_children()) - before
    assert not left, f"rank processes still alive: {left}"

