"""Expert parallelism on one GPU: the EP code path over an NCCL world of one.

One process, one GPU, an NCCL process group of one rank (the module-scoped ``group`` fixture of
tests/ep/conftest.py: a free port on 127.0.0.1, destroyed at the end). An ``ep_group`` passed
explicitly runs the expert-parallel path even at one rank; its dispatcher skips the collectives
there (identities) unless ``dispatcher.exchange`` is set, which these tests do (except where (a)
checks the default too), so the NCCL exchanges, the counts all-gather and the host read of the
split sizes all run. On a single GPU we can then check, bit for bit:

* (a) the EP path equals the plain layer (no group): output, input gradient, every parameter
  gradient and the router's losses, for the all-to-all dispatcher dropless, dropping (capacity
  0.5, no padding) and drop-and-pad (capacity 1.0), and the all-gather dispatcher dropless; with
  the collectives run (NCCL, ``dispatcher.exchange = True``) and skipped (the dispatcher's
  default at one rank). At one rank every exchange is the identity and each expert sees the
  same rows with the same offsets, so the grouped GEMMs run the same schedule (the Hopper split
  of a partial last wave is switched off all the same, MOE_GG_SM90_SPLIT_TAIL=0, as the
  bitwise EP tests do: docs/design.md, "Expert parallelism");
* (b) drop-and-pad all-to-all under ``torch.compile(fullgraph=True)``, forward and backward,
  equals eager (aot_eager and inductor);
* (c) drop-and-pad all-to-all, forward and backward, captured in one CUDA graph (NCCL
  collectives inside) and replayed on new inputs, equals eager;
* (d) dropless all-to-all waits on the host once per forward (the split sizes' event, in
  ``_HostSplits.get``) and never in the backward; drop-and-pad never waits. Counted two ways:
  ``_HostSplits.get`` and ``torch.cuda.Event.synchronize`` wrapped, and every stream-blocking
  operation (``.item()``, ``.tolist()``, blocking host<->device copies, stream syncs) reported by
  ``torch.cuda.set_sync_debug_mode`` ("warn" with its locations, "error" where none may occur).
  The layer is built both ways users build it: on the CPU then ``.cuda()``, and under
  ``with torch.device("cuda")``;
* (e) the shared expert overlapped with the exchanges (``moe_shared_expert_overlap``, on a side
  stream) equals the layer that runs it first: output and parameter gradients bitwise, the input
  gradient within two bf16 roundings (autograd sums its three parts in another order).

Small shapes (T = 256, H = 256, E = 8, F = 512, bf16 parameters, fp32 router; the layers,
batches and comparisons are tests/helpers/ep_cuda.py's). Skipped without a GPU; the CPU versions
of these checks over gloo at 2 and 4 ranks are in tests/ep/test_layer.py.
"""
import contextlib
import os
import warnings
from typing import Dict, List, Tuple

import pytest
import torch

from helpers.ep_cuda import (CONFIGS, assert_bitwise, batch, config_kwargs, make_layer,
                             no_blocking_sync, run_step)
from helpers.tolerances import eps
from moe_core import MoELayer

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")

# the sync-debug mode's warning for a blocking operation (its first use also warns that the mode
# is a prototype, which is not a sync)
SYNC_WARNING = "called a synchronizing CUDA operation"


# ---- layers and steps -----------------------------------------------------------------------
def plain_and_ep(kw: dict, group, exchange: bool) -> Tuple[MoELayer, MoELayer]:
    plain = make_layer(kw)
    ep = make_layer(kw, group, {k: v.clone() for k, v in plain.state_dict().items()},
                    exchange=exchange)
    return plain, ep


# ---- (a) the EP path at one rank equals the plain layer ------------------------------------
CASES_A = [("softmax_top2", "dropless", "alltoall"), ("softmax_top2", "dropping", "alltoall"),
           ("softmax_top2", "drop_and_pad", "alltoall"), ("softmax_top2", "dropless", "allgather"),
           ("sigmoid_groups_bias_top4_shared", "dropless", "alltoall"),
           ("sigmoid_groups_bias_top4_shared", "drop_and_pad", "alltoall")]


@pytest.mark.parametrize("exchange", ["collectives", "skipped"])
@pytest.mark.parametrize("case,mode,dispatcher", CASES_A, ids=["-".join(c) for c in CASES_A])
def test_ep_path_of_one_equals_plain_layer_bitwise(group, tuning_env, case, mode, dispatcher,
                                                   exchange):
    tuning_env("MOE_GG_SM90_SPLIT_TAIL", "0")
    plain, ep = plain_and_ep(config_kwargs(case, mode, dispatcher), group,
                             exchange=exchange == "collectives")
    assert ep.dispatcher is not None and plain.dispatcher is None
    x, w = batch()
    want = run_step(plain, plain, x, w)
    got = run_step(ep, ep, x, w)
    assert_bitwise(got, want, f"EP path ({dispatcher}, {mode}) vs plain layer")
    x2, w2 = batch(seed=2)  # a second step (the splits change; nothing cached is stale)
    assert_bitwise(run_step(ep, ep, x2, w2), run_step(plain, plain, x2, w2),
                   f"second step, EP path ({dispatcher}, {mode}) vs plain layer")


# ---- (b) drop-and-pad all-to-all compiles with fullgraph -----------------------------------
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_drop_and_pad_alltoall_compiles_fullgraph(group, backend):
    layer = make_layer(config_kwargs("softmax_top2", "drop_and_pad", "alltoall"), group)
    x, w = batch()
    eager = run_step(layer, layer, x, w)
    torch._dynamo.reset()
    try:
        compiled = torch.compile(layer, fullgraph=True, backend=backend)
        got = run_step(compiled, layer, x, w)
        x2, w2 = batch(seed=2)
        got2 = run_step(compiled, layer, x2, w2)
    finally:
        torch._dynamo.reset()
    assert_bitwise(got, eager, f"compiled ({backend}) vs eager")
    assert_bitwise(got2, run_step(layer, layer, x2, w2), f"compiled ({backend}) vs eager, step 2")


# ---- (c) drop-and-pad all-to-all in a CUDA graph -------------------------------------------
def test_drop_and_pad_alltoall_cuda_graph(group):
    layer = make_layer(config_kwargs("softmax_top2", "drop_and_pad", "alltoall"), group)
    params = list(layer.parameters())
    _, w = batch()

    def step(x: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        x = x.detach().requires_grad_()
        out = layer(x)
        grads = torch.autograd.grad((out.float() * w).sum(), [x] + params)
        return (out,) + tuple(grads)

    static_x, _ = batch(seed=3)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capture stream: NCCL, allocator, checks
        for _ in range(3):
            step(static_x)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    # thread-local capture: the NCCL watchdog thread keeps polling the warm-up's work while we
    # capture, which the global mode would forbid; a host sync in the step still fails the
    # capture (synchronising with or querying a capturing stream is invalid in every mode)
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


# ---- (d) host synchronisation ----------------------------------------------------------------
@contextlib.contextmanager
def host_syncs(found: Dict[str, List[str]]):
    """Records into ``found``: 'event' (one entry per ``torch.cuda.Event.synchronize``) and
    'blocking' (where each stream-blocking operation happened, as the sync-debug mode reports
    it)."""
    original = torch.cuda.Event.synchronize

    def counted(event):
        found.setdefault("event", []).append("torch.cuda.Event.synchronize")
        return original(event)

    torch.cuda.Event.synchronize = counted
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                yield found
            finally:
                torch.cuda.set_sync_debug_mode("default")
    finally:
        torch.cuda.Event.synchronize = original
    found.setdefault("blocking", []).extend(
        f"{os.path.relpath(w.filename)}:{w.lineno}" for w in seen
        if SYNC_WARNING in str(w.message))


@pytest.fixture
def split_reads(monkeypatch) -> List[int]:
    """Counts the dispatcher's host reads of its split sizes (``_HostSplits.get``)."""
    from moe_core import dispatcher

    calls: List[int] = []
    original = dispatcher._HostSplits.get

    def get(self):
        calls.append(1)
        return original(self)

    monkeypatch.setattr(dispatcher._HostSplits, "get", get)
    return calls


@pytest.mark.parametrize("build", ["moved", "device_context"])
def test_dropless_alltoall_waits_once_per_forward_never_in_backward(group, split_reads, build):
    layer = make_layer(config_kwargs("softmax_top2", "dropless", "alltoall"), group, build=build)
    x, w = batch()
    run_step(layer, layer, x, w)  # warm-up: NCCL, the pinned buffer, lazy initialisation
    split_reads.clear()

    xr = x.clone().requires_grad_()
    fwd: Dict[str, List[str]] = {}
    with host_syncs(fwd):
        out = layer(xr)
    assert len(split_reads) == 1, f"split sizes read {len(split_reads)} times in one forward"
    assert len(fwd.get("event", [])) == 1, f"event waits in the forward: {fwd.get('event')}"
    assert fwd.get("blocking", []) == [], (
        f"stream-blocking syncs in the dropless forward (built {build}), besides the one wait "
        f"for the split sizes: {fwd['blocking']}")

    split_reads.clear()
    bwd: Dict[str, List[str]] = {}
    with host_syncs(bwd), no_blocking_sync():
        (out.float() * w).sum().backward()
    torch.cuda.synchronize()
    assert split_reads == [] and bwd.get("event", []) == [], f"host waits in the backward: {bwd}"


@pytest.mark.parametrize("case", sorted(CONFIGS))
def test_drop_and_pad_alltoall_never_waits(group, split_reads, case):
    layer = make_layer(config_kwargs(case, "drop_and_pad", "alltoall"), group)
    x, w = batch()
    run_step(layer, layer, x, w)  # warm-up (the token-count check runs once, here)
    split_reads.clear()
    xr = x.clone().requires_grad_()
    found: Dict[str, List[str]] = {}
    with host_syncs(found), no_blocking_sync():
        out = layer(xr)
        (out.float() * w).sum().backward()
    torch.cuda.synchronize()
    assert split_reads == [] and found.get("event", []) == [], f"host waits: {found}"


# ---- (e) shared-expert overlap ---------------------------------------------------------------
@pytest.mark.parametrize("mode", ["dropless", "drop_and_pad"])
def test_shared_expert_overlap_equals_no_overlap(group, mode):
    """Output and every parameter gradient bitwise. The input gradient sums three bf16
    contributions (shared expert, router, dispatch) in the order autograd reaches them, and
    overlapping moves the shared expert's nodes from first to between the exchanges, so that sum
    runs in another order (Megatron documents the same of its overlap): within two roundings,
    2 eps(bf16) of max |dx| (tests/ep/test_layer.py's rule; on the CPU, this config, six seeds, the
    largest difference was 0.5-1.0 eps of max |dx|)."""
    kw = config_kwargs("sigmoid_groups_bias_top4_shared", mode, "alltoall")
    first = make_layer(kw, group)
    state = {k: v.clone() for k, v in first.state_dict().items()}
    over = make_layer(dict(kw, moe_shared_expert_overlap=True), group, state)
    for seed in (1, 2):
        x, w = batch(seed=seed)
        got, want = run_step(over, over, x, w), run_step(first, first, x, w)
        dx_got, dx_want = got.pop("dx"), want.pop("dx")
        assert_bitwise(got, want, f"shared expert overlapped vs first ({mode}, step {seed})")
        diff = (dx_got.double() - dx_want.double()).abs().max().item()
        scale = dx_want.double().abs().max().item()
        assert diff <= 2 * eps(torch.bfloat16) * scale, (
            f"dx ({mode}, step {seed}): max |diff| {diff:.3e} at scale {scale:.3e}")
