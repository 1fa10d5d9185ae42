"""The symmetric-memory exchange (``moe_alltoall_exchange="symm_mem"``) on the CPU over gloo, at
2 and 4 ranks, with the emulated exchange primitive (``MOE_SYMM_MEM_EMULATE=1``; the NVSHMEM
primitive at 2 ranks on 2 GPUs is tested in tests/ep/test_symm_mem_multi_gpu.py, the layer on one
GPU, where a group of one exchanges locally, in tests/ep/test_symm_mem_gpu.py).

* (a) a receive budget that cannot overflow (factor = world size): the symm_mem layer equals
  the NCCL-exchange layer with the same weights bitwise (output, input gradient, every parameter
  gradient, the router's losses) over two steps, also with the shared expert overlapped with the
  exchanges, and drops nothing;
* (b) a small budget with skewed routing (an expert bias that sends every token to expert 0):
  equals the NCCL-exchange layer whose routing map loses exactly the (token, expert) pairs the
  acceptance rule drops, computed from every rank's routing map with plain loops
  (``helpers.reference_symm_mem.expected_keep``), and
  ``last_dropped_rows`` equals the number of this rank's pairs dropped;
* (c) nothing but the emulated primitive reads a tensor on the host (``tolist``, ``item``,
  ``nonzero`` and the dispatcher's host split reads raise elsewhere), forward and backward,
  after a warm-up step (the layer checks the token count is the same on every rank once per
  new count, as for the other static-buffer exchanges);
* (d) the configuration errors, one test per bad value, and the construction errors without
  NVSHMEM or on a gloo group without the emulation.
"""
import math
import os

import pytest
import torch

from helpers.dist import run_ranks
from helpers.ep_layer import CONFIGS, config_kwargs, global_batch, global_layer, run_layer, \
    shard_state
from helpers.reference_symm_mem import expected_keep

CASES = sorted(CONFIGS)


def _pair(rank: int, world: int, case: str, factor: float, **extra):
    """(NCCL-exchange layer, symm_mem layer) with the same rank-``rank`` shard of the global
    weights."""
    from moe_core import MoEConfig, MoELayer

    kw = dict(config_kwargs(case, "dropless", "alltoall"), **extra)
    ref = global_layer(kw)
    state = shard_state(ref, rank, world)
    layers = []
    for exchange in ("nccl", "symm_mem"):
        layer = MoELayer(MoEConfig(**kw, expert_model_parallel_size=world,
                                   moe_alltoall_exchange=exchange,
                                   moe_alltoall_recv_factor=factor))
        layer.load_state_dict(state)
        layers.append(layer)
    return layers


def _step(layer, x, g, m) -> dict:
    out, dx, losses = run_layer(layer, x, g, m)
    res = {"out": out, "dx": dx}
    res.update({f"grad {n}": p.grad.clone() for n, p in layer.named_parameters()})
    res.update({f"loss {k}": v for k, v in losses.items()})
    layer.zero_grad(set_to_none=True)
    return res


def _diff(got: dict, want: dict) -> list:
    if sorted(got) != sorted(want):
        return [f"keys {sorted(got)} vs {sorted(want)}"]
    return [k for k in want if not torch.equal(got[k], want[k])]


# ---- (a) generous budget: bitwise the NCCL exchange ----------------------------------------
def generous_worker(rank: int, world: int) -> dict:
    os.environ["MOE_SYMM_MEM_EMULATE"] = "1"
    res = {}
    for case in CASES:
        nccl, symm = _pair(rank, world, case, float(world))
        for seed in (1, 2):
            X, G, masks = global_batch(world, symm.config.params_dtype, seed=seed)
            want = _step(nccl, X[rank], G[rank], masks[rank])
            got = _step(symm, X[rank], G[rank], masks[rank])
            res[(case, seed)] = (_diff(got, want), int(symm.last_dropped_rows))
    # the shared expert overlapped with the exchanges, against the NCCL exchange overlapped
    case = "sigmoid_groups_bias_top8_shared"
    nccl, symm = _pair(rank, world, case, float(world), moe_shared_expert_overlap=True)
    X, G, masks = global_batch(world, symm.config.params_dtype)
    want = _step(nccl, X[rank], G[rank], masks[rank])
    got = _step(symm, X[rank], G[rank], masks[rank])
    res[(case + "_overlap", 1)] = (_diff(got, want), int(symm.last_dropped_rows))
    return res


@pytest.mark.parametrize("world", [2, 4])
def test_generous_budget_equals_nccl_exchange_bitwise(world):
    for rank, res in enumerate(run_ranks(generous_worker, world, timeout=600)):
        for (case, seed), (bad, dropped) in res.items():
            assert not bad, f"EP={world} rank {rank} {case} step {seed}: differ in {bad}"
            assert dropped == 0, f"EP={world} rank {rank} {case}: {dropped} rows dropped"


# ---- (b) small budget, skewed routing: the reference drops the rule's rows -----------------
SKEW = dict(num_moe_experts=8, moe_router_topk=2, moe_router_score_function="sigmoid",
            moe_router_enable_expert_bias=True)


def skewed_worker(rank: int, world: int, factor: float) -> dict:
    import torch.distributed as dist

    os.environ["MOE_SYMM_MEM_EMULATE"] = "1"
    nccl, symm = _pair(rank, world, "softmax_top2", factor, **SKEW)
    for layer in (nccl, symm):  # every token's first choice: expert 0 (receiver 0 overflows)
        with torch.no_grad():
            layer.router.expert_bias.zero_()
            layer.router.expert_bias[0] = 10.0
    X, G, masks = global_batch(world, symm.config.params_dtype)
    budget = math.ceil(factor * X[rank].shape[0] * X[rank].shape[1] * SKEW["moe_router_topk"])
    original = nccl.router.forward
    dropped = {}

    def dropping_router(*args, **kwargs):
        probs, rmap = original(*args, **kwargs)
        maps = [torch.empty_like(rmap) for _ in range(world)]
        dist.all_gather(maps, rmap.contiguous())
        keep = expected_keep(maps, world, budget)[rank]
        dropped["rows"] = int((rmap & ~keep).sum())
        return probs, rmap & keep

    nccl.router.forward = dropping_router
    want = _step(nccl, X[rank], G[rank], masks[rank])
    got = _step(symm, X[rank], G[rank], masks[rank])
    return dict(bad=_diff(got, want), dropped=int(symm.last_dropped_rows),
                expected=dropped["rows"])


@pytest.mark.parametrize("world,factor", [(2, 0.75), (4, 0.6)])
def test_overflow_drops_the_rule_rows(world, factor):
    per_rank = run_ranks(skewed_worker, world, factor, timeout=600)
    assert sum(r["expected"] for r in per_rank) > 0, "the skew did not overflow the budget"
    for rank, r in enumerate(per_rank):
        assert not r["bad"], f"EP={world} rank {rank}: differ from the reference in {r['bad']}"
        assert r["dropped"] == r["expected"], f"EP={world} rank {rank}: {r}"


# ---- (c) no host read outside the emulated primitive ---------------------------------------
def no_host_read_worker(rank: int, world: int) -> dict:
    from moe_core import dispatcher, symm_exchange

    os.environ["MOE_SYMM_MEM_EMULATE"] = "1"
    _, symm = _pair(rank, world, "sigmoid_groups_bias_top8_shared", 1.0)
    X, G, masks = global_batch(world, symm.config.params_dtype)
    # warm-up: the equal-token-count check reads the counts once per new token count
    _step(symm, X[rank], G[rank], masks[rank])
    x = X[rank].clone().requires_grad_(True)
    reads = []
    state = {"inside": False}
    names = ("tolist", "item", "nonzero")
    originals = {n: getattr(torch.Tensor, n) for n in names}

    def guarded(name):
        def read(self, *a, **k):
            if not state["inside"]:
                import traceback
                reads.append(name + "\n" + "".join(traceback.format_stack(limit=8)))
                raise RuntimeError(f"host read: Tensor.{name}")
            return originals[name](self, *a, **k)
        return read

    exchange = symm_exchange.EmulatedExchange.exchange

    def emulated(self, *a, **k):
        state["inside"] = True
        try:
            return exchange(self, *a, **k)
        finally:
            state["inside"] = False

    def host_splits(*a, **k):
        reads.append("_HostSplits")
        raise RuntimeError("host read: _HostSplits")

    host_class = dispatcher._HostSplits
    try:
        for n in names:
            setattr(torch.Tensor, n, guarded(n))
        symm_exchange.EmulatedExchange.exchange = emulated
        dispatcher._HostSplits = host_splits
        out = symm(x, padding_mask=masks[rank])
        (out.float() * G[rank]).sum().backward()
        error = None
    except RuntimeError as e:
        error = str(e)
    finally:
        for n in names:
            setattr(torch.Tensor, n, originals[n])
        symm_exchange.EmulatedExchange.exchange = exchange
        dispatcher._HostSplits = host_class
    return dict(reads=reads, error=error, grad=x.grad is not None)


def test_no_host_read_outside_the_emulated_exchange():
    for rank, r in enumerate(run_ranks(no_host_read_worker, 2, timeout=300)):
        assert r["reads"] == [] and r["error"] is None and r["grad"], f"rank {rank}: {r}"


# ---- (d) configuration and construction errors --------------------------------------------
def _config(**kw):
    from moe_core import MoEConfig

    base = dict(config_kwargs("softmax_top2", "dropless", "alltoall"))
    base.update(kw)
    return MoEConfig(**base)


@pytest.mark.parametrize("kw,message", [
    (dict(moe_alltoall_exchange="nvshmem"), r"moe_alltoall_exchange='nvshmem': must be 'nccl' "
                                            r"or 'symm_mem'"),
    (dict(moe_alltoall_exchange="symm_mem", moe_token_dispatcher_type="allgather"),
     r"moe_alltoall_exchange='symm_mem': .*needs moe_token_dispatcher_type='alltoall', got "
     r"'allgather'"),
    (dict(moe_alltoall_exchange="symm_mem", moe_expert_capacity_factor=1.0),
     r"moe_alltoall_exchange='symm_mem': .*needs moe_expert_capacity_factor=None, got 1.0"),
    (dict(moe_alltoall_exchange="symm_mem", moe_expert_capacity_factor=1.0,
          moe_pad_expert_input_to_capacity=True),
     r"moe_alltoall_exchange='symm_mem': .*needs moe_expert_capacity_factor=None"),
    (dict(moe_alltoall_recv_factor=0.0), r"moe_alltoall_recv_factor=0.0: must be a finite "
                                         r"number > 0"),
    (dict(moe_alltoall_recv_factor=-1.5), r"moe_alltoall_recv_factor=-1.5: must be"),
    (dict(moe_alltoall_recv_factor=float("inf")), r"moe_alltoall_recv_factor=inf: must be"),
    (dict(moe_alltoall_recv_factor=float("nan")), r"moe_alltoall_recv_factor=nan: must be"),
    (dict(moe_alltoall_recv_factor="2"), r"moe_alltoall_recv_factor='2': must be"),
    (dict(moe_alltoall_recv_factor=True), r"moe_alltoall_recv_factor=True: must be"),
], ids=["unknown_exchange", "allgather", "capacity_factor", "pad_to_capacity", "factor_zero",
        "factor_negative", "factor_inf", "factor_nan", "factor_str", "factor_bool"])
def test_config_errors(kw, message):
    with pytest.raises(ValueError, match=message):
        _config(**kw)


def test_config_accepts_symm_mem_dropless():
    cfg = _config(moe_alltoall_exchange="symm_mem", moe_alltoall_recv_factor=1)
    assert cfg.moe_alltoall_exchange == "symm_mem" and cfg.moe_alltoall_recv_factor == 1


def gloo_without_emulation_worker(rank: int, world: int) -> str:
    import torch.distributed as dist
    from moe_core import MoELayer

    os.environ.pop("MOE_SYMM_MEM_EMULATE", None)
    try:
        MoELayer(_config(moe_alltoall_exchange="symm_mem"), ep_group=dist.group.WORLD)
    except ValueError as e:
        return str(e)
    return "no error"


def test_symm_mem_on_gloo_without_emulation_raises():
    (msg,) = run_ranks(gloo_without_emulation_worker, 1, timeout=120)
    assert "moe_alltoall_exchange='symm_mem' needs NVSHMEM symmetric memory on CUDA over an " \
           "NCCL expert-parallel group; this group's backend is 'gloo'" in msg, msg
    assert "MOE_SYMM_MEM_EMULATE=1" in msg and "'nccl'" in msg, msg


def test_symm_mem_without_nvshmem_raises(monkeypatch):
    from torch.distributed import _symmetric_memory as symm_mem
    from moe_core import symm_exchange

    monkeypatch.setattr(symm_exchange.dist, "get_backend", lambda group: "nccl")
    monkeypatch.setattr(symm_mem, "is_nvshmem_available", lambda: False)
    with pytest.raises(ValueError, match=r"moe_alltoall_exchange='symm_mem' needs NVSHMEM .*"
                                         r"use moe_alltoall_exchange='nccl'"):
        symm_exchange.make_exchange(object(), emulate=False)


@pytest.mark.parametrize("dtype,hidden,cols", [(torch.bfloat16, 16, 32), (torch.bfloat16, 30, 32),
                                               (torch.bfloat16, 31, 64), (torch.float32, 16, 32),
                                               (torch.float32, 15, 16), (torch.float16, 64, 96)])
def test_packed_rows_are_64_byte_multiples(dtype, hidden, cols):
    """H values plus a fp32 prob's 4 bytes, rounded up to 64 bytes a row."""
    from moe_core.symm_exchange import packed_columns

    assert packed_columns(hidden, dtype, torch.float32) == cols


def test_acceptance_rule():
    """Receiver r fills its budget over (local expert, source) chunks in that order."""
    from moe_core.symm_exchange import acceptance

    # W = 2, nle = 2: counts[s, g]
    gathered = torch.tensor([[5, 1, 2, 0], [4, 3, 0, 7]])
    acc = acceptance(gathered, 2, 2, budget=8)
    # receiver 0, chunks (e0,s0)=5 (e0,s1)=4 (e1,s0)=1 (e1,s1)=3 -> 5, 3, 0, 0
    assert acc[0].tolist() == [[5, 3], [0, 0]]
    # receiver 1, chunks (e0,s0)=2 (e0,s1)=0 (e1,s0)=0 (e1,s1)=7 -> 2, 0, 0, 6
    assert acc[1].tolist() == [[2, 0], [0, 6]]


def tokens_differ_worker(rank: int, world: int) -> str:
    os.environ["MOE_SYMM_MEM_EMULATE"] = "1"
    _, symm = _pair(rank, world, "softmax_top2", 2.0)
    X, _, _ = global_batch(world, symm.config.params_dtype)
    try:
        symm(X[rank][: X.shape[1] - rank])  # a different token count on every rank
    except ValueError as e:
        return str(e)
    return "no error"


def test_symm_mem_needs_equal_token_counts():
    """The budget and the symmetric buffers are sized from T: raised on every rank."""
    for rank, msg in enumerate(run_ranks(tokens_differ_worker, 2, timeout=300)):
        assert "hidden_states has" in msg and "moe_alltoall_exchange='symm_mem' (symmetric " \
               "buffers) needs the same number on every expert-parallel rank, got [12, 10]" in msg, \
            f"rank {rank}: {msg}"
