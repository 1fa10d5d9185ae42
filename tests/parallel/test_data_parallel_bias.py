"""The routers' running counts under plain data parallelism (no expert parallelism), world 2 on
gloo: with ``tp_dp_cp_group`` left None, the expert-bias update and the global aux loss's counts
are summed over the data-parallel world, so every rank's expert bias and global-aux counts after
each training step equal one process's on the whole (concatenated) batch, under DDP (default
``broadcast_buffers``: its broadcast of rank 0's buffers copies values every rank already has)
and under FSDP2 (``fully_shard``, which leaves buffers alone). A group of one rank keeps each
rank's counts its own; without ``torch.distributed`` nothing is reduced.

The ranks return their states; the references run here, in the pytest process, where
``torch.distributed`` is not initialised.
"""
import contextlib
from typing import Dict, List

import pytest
import torch
import torch.distributed as dist

from helpers.dist import run_ranks

WORLD, STEPS, LR = 2, 3, 0.1
S, B, H = 6, 2, 16  # each rank's micro-batch: [S, B, H]


def _config():
    from moe_core import MoEConfig

    return MoEConfig(hidden_size=H, moe_ffn_hidden_size=24, num_moe_experts=8, moe_router_topk=2,
                     moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                     moe_router_bias_update_rate=1e-2,
                     moe_router_load_balancing_type="global_aux_loss", moe_aux_loss_coeff=1e-2,
                     add_bias_linear=False, params_dtype=torch.float32, moe_router_dtype="fp32")


def _layer(**kw):
    from moe_core import MoELayer

    torch.manual_seed(0)
    return MoELayer(_config(), **kw)


def _batch(step: int, micro: int = 0):
    """Micro-batch ``micro`` of step ``step``'s global batch: inputs and output-gradient weights
    ``[WORLD, S, B, H]``, rank r's share being ``[r]``."""
    g = torch.Generator().manual_seed(100 + 10 * step + micro)
    return torch.randn(WORLD, S, B, H, generator=g), torch.randn(WORLD, S, B, H, generator=g)


def _state(layer) -> Dict[str, torch.Tensor]:
    r = layer.router
    return dict(expert_bias=r.expert_bias.clone(),
                aux_counts=r.global_aux_buffer.tokens_per_expert.clone(),
                aux_steps=r.global_aux_buffer.steps.clone())


def _weights(model) -> Dict[str, torch.Tensor]:
    return {n.removeprefix("module."): (p.full_tensor() if hasattr(p, "full_tensor") else p)
            .detach().clone() for n, p in model.named_parameters()}


def train_worker(rank: int, world: int, wrap: str, micro: int = 1,
                 no_sync: bool = True) -> List[dict]:
    """``STEPS`` training steps of ``micro`` micro-batches each (rank ``rank``'s shares; all but
    the last under DDP's ``no_sync`` if ``no_sync``); after each step: the global-aux counts (before the reset),
    the expert bias (after the update) and the size of the group used."""
    from moe_core import finalize_step, moe_layers

    if wrap == "own_counts":
        layer = _layer(tp_dp_cp_group=dist.new_subgroups(1)[0])
    else:
        layer = _layer()
    model = layer
    if wrap == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(layer)  # broadcast_buffers=True
    elif wrap == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        model = fully_shard(layer, mesh=init_device_mesh("cpu", (world,)))
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    out = []
    for step in range(STEPS):
        for m in range(micro):
            X, G = _batch(step, m)
            last = m == micro - 1
            with contextlib.nullcontext() if last or not no_sync else model.no_sync():
                (model(X[rank]) * G[rank]).sum().backward()
        opt.step()
        opt.zero_grad()
        state = _state(layer)
        finalize_step(model)
        state["expert_bias"] = layer.router.expert_bias.clone()
        state["group_size"] = dist.get_world_size(moe_layers(model)[0].router.data_parallel_group())
        out.append(state)
    out[-1]["weights"] = _weights(model)
    # tensors leave a spawned rank as lists (a tensor's shared memory goes with its process)
    return [{k: _lists(v) for k, v in state.items()} for state in out]


def _lists(v):
    if isinstance(v, dict):
        return {k: _lists(x) for k, x in v.items()}
    return v.tolist() if isinstance(v, torch.Tensor) else v


def _tensors(per_rank: List[List[dict]]) -> List[List[dict]]:
    def back(v):
        if isinstance(v, dict):
            return {k: back(x) for k, x in v.items()}
        return torch.tensor(v, dtype=torch.float32) if isinstance(v, (list, float)) else v
    return [[{k: back(v) for k, v in state.items()} for state in steps] for steps in per_rank]


def reference(shards: List[int], average: bool, micro: int = 1) -> List[dict]:
    """One process: each of a step's ``micro`` micro-batches is the concatenation of ``shards``'
    shares (along B), with the loss that gives the ranks' averaged gradient (``average``: the
    mean of their losses)."""
    from moe_core import finalize_step
    from moe_core.ops import AuxLossScale

    # no process group, or a world of one (the in-process Megatron oracle of other test files
    # starts one): the router then sums over this process alone, as one process on the batch
    assert not dist.is_initialized() or dist.get_world_size() == 1
    layer = _layer()
    n = len(shards) if average else 1
    layer.router.aux_loss_scale = AuxLossScale(1.0 / n)
    opt = torch.optim.SGD(layer.parameters(), lr=LR)
    out = []
    for step in range(STEPS):
        for m in range(micro):
            X, G = _batch(step, m)
            x, g = torch.cat(list(X[shards]), dim=1), torch.cat(list(G[shards]), dim=1)
            (layer(x) * g / n).sum().backward()
        opt.step()
        opt.zero_grad()
        state = _state(layer)
        finalize_step(layer)
        state["expert_bias"] = layer.router.expert_bias.clone()
        out.append(state)
    out[-1]["weights"] = _weights(layer)
    return out


@pytest.mark.parametrize("wrap, micro, no_sync",
                         [("ddp", 1, True), ("fsdp2", 1, True), ("ddp", 2, True),
                          ("ddp", 2, False)],
                         ids=["ddp", "fsdp2", "ddp_no_sync_accumulation", "ddp_accumulation"])
def test_data_parallel_equals_one_process(wrap, micro, no_sync):
    """Bias and global-aux counts: integer counts summed in fp32, so equal bit for bit on every
    rank and to the reference; the weights, whose gradients are summed in another order, within
    fp32 rounding. With two micro-batches a step, with or without DDP's ``no_sync`` on the
    first: DDP broadcasts rank 0's buffers before the second forward, so the router's own
    counts of the first (which are not a buffer) must not be replaced by rank 0's."""
    whole_batch = reference(list(range(WORLD)), average=True, micro=micro)
    per_rank = _tensors(run_ranks(train_worker, WORLD, wrap, micro, no_sync, timeout=300))
    for rank, steps in enumerate(per_rank):
        for step, (got, want) in enumerate(zip(steps, whole_batch)):
            where = f"{wrap} rank {rank} step {step}"
            assert got["group_size"] == WORLD, where
            for key in ("expert_bias", "aux_counts", "aux_steps"):
                assert torch.equal(got[key], want[key]), \
                    f"{where} {key}: {got[key].tolist()} != {want[key].tolist()}"
        assert not torch.equal(steps[-1]["expert_bias"], torch.zeros_like(want["expert_bias"]))
        for name, w in whole_batch[-1]["weights"].items():
            torch.testing.assert_close(steps[-1]["weights"][name], w, rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"{wrap} rank {rank} {name}: {m}")
    assert all(torch.equal(per_rank[0][s][k], per_rank[r][s][k]) for r in range(WORLD)
               for s in range(STEPS) for k in ("expert_bias", "aux_counts"))


def test_group_of_one_keeps_each_ranks_counts():
    """``tp_dp_cp_group`` = a group of one rank (no wrapper: each rank trains alone): every
    rank's bias and counts are one process's on that rank's micro-batches only."""
    per_rank = _tensors(run_ranks(train_worker, WORLD, "own_counts", timeout=300))
    for rank, steps in enumerate(per_rank):
        want = reference([rank], average=False)
        for step, (got, ref) in enumerate(zip(steps, want)):
            assert got["group_size"] == 1
            for key in ("expert_bias", "aux_counts", "aux_steps"):
                assert torch.equal(got[key], ref[key]), f"rank {rank} step {step} {key}"
    assert not torch.equal(per_rank[0][-1]["expert_bias"], per_rank[1][-1]["expert_bias"])


def test_without_torch_distributed_nothing_is_reduced():
    """One process, no process group: the router resolves no group, the global-aux counts are
    this forward's routing counts and the bias moves by ``rate * sign(mean - count)``. In a fresh
    process (other test files start an in-process group that outlives them)."""
    import multiprocessing

    proc = multiprocessing.get_context("spawn").Process(target=_nothing_is_reduced)
    proc.start()
    proc.join(timeout=120)
    if proc.is_alive():
        proc.kill()
        pytest.fail("the fresh process did not finish in 120 s")
    assert proc.exitcode == 0


def _nothing_is_reduced() -> None:
    assert not dist.is_initialized()
    layer = _layer()
    X, G = _batch(0)
    probs, routing_map = layer.router(X[0])
    assert layer.router.data_parallel_group() is None
    counts = routing_map.sum(0, dtype=torch.float32)
    assert torch.equal(layer.router.global_aux_buffer.tokens_per_expert, counts)
    assert torch.equal(layer.router.local_tokens_per_expert, counts)
    from moe_core import update_expert_bias

    update_expert_bias(layer)
    want = torch.sign(counts.mean() - counts) * 1e-2
    assert torch.equal(layer.router.expert_bias, want)
    assert torch.equal(layer.router.local_tokens_per_expert, torch.zeros_like(counts))


def sub_mesh_worker(rank: int, world: int) -> str:
    """FSDP2 over a mesh of this rank alone, global aux loss and expert bias, no group given:
    the forward sums the global-aux counts over the default group (the weight is unsharded and
    plain then), the bias update would sum over the mesh."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from moe_core import finalize_step

    mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("dp", "shard"))["shard"]
    layer = fully_shard(_layer(), mesh=mesh)
    X, G = _batch(0)
    (layer(X[rank]) * G[rank]).sum().backward()
    try:
        finalize_step(layer)
    except ValueError as e:
        return str(e)
    return "no error"


def test_fsdp2_over_part_of_the_world_asks_for_the_group():
    for rank, error in enumerate(run_ranks(sub_mesh_worker, WORLD, timeout=300)):
        assert ("default data-parallel group had 2 ranks and now has 1" in error
                and "pass tp_dp_cp_group" in error), f"rank {rank}: {error!r}"
