"""Expert parallelism on the CPU over gloo: the EP layer at N = 2 and 4 ranks against the
single-process MoELayer holding the same global weights.

What is compared, per rank r (rank r's tokens are shard r of a global batch):

* output, input gradient, router, shared-expert and latent-projection gradients, aux / z losses:
  equal (bitwise) to the single-process layer run on shard r. With the all-to-all dispatcher each
  row meets the same GEMMs and each token's rows are summed on its own rank in the same order at
  every N. The allgather dispatcher sums a token's rows per rank first (fp32) and reduces the
  input gradient across ranks, so its output, input gradient and the latent projections'
  gradients (which see both) agree within four roundings of the dtype at the tensor's scale.
* the local expert weight gradients: equal (bitwise) to a single process that runs every shard's
  permuted rows through the experts in (source rank, token) order, which is the order the EP
  ranks receive them in (the CPU grouped GEMM's reduction order does not depend on the rows'
  position), and within fp32-accumulation tolerance of the sum of the shards' own gradients.
* the expert-bias update after the step (counts all-reduced over the world): equal to the
  single-process update from all shards' counts.

Plus: EP x DP (world 4 as EP 2 x DP 2) after ``all_reduce_gradients`` against one process on
the whole batch, FSDP2 on the replicated parameters, the drop-and-pad path under
``torch.compile(fullgraph=True)``, and the errors raised on every rank before any exchange.
All cases of one world size run in one spawn of the ranks (a module fixture).
"""
import copy
from typing import Dict, List, Tuple

import pytest
import torch

from helpers.dist import run_ranks
from helpers.ep_layer import (B, CONFIGS, H, MODES, S, config_kwargs, global_batch, global_layer,
                              run_layer, shard_state)
from helpers.tolerances import eps

DISPATCHERS = ("alltoall", "allgather")
CASES = [(c, m, d) for c in CONFIGS for m in MODES for d in DISPATCHERS]


def concatenated_expert_grads(layer, X, G, masks) -> Dict[str, torch.Tensor]:
    """Expert gradients of one process that routes every shard itself and runs all shards'
    permuted rows through the experts at once, each expert's rows in (shard, token) order."""
    from moe_core import ops

    layer = copy.deepcopy(layer)
    layer.zero_grad(set_to_none=True)
    world, E = X.shape[0], layer.config.num_moe_experts
    pad = layer.config.moe_pad_expert_input_to_capacity
    per_shard = []
    for r in range(world):
        x = X[r].reshape(-1, H)
        if layer.fc1_latent_proj is not None:
            x = layer.fc1_latent_proj(x)
        probs, rmap = layer.router(X[r], padding_mask=masks[r].t())
        bound = layer.num_out_tokens(x.shape[0])
        rows, rp, idx, off, _ = ops.permute(x, rmap, probs, num_out_tokens=bound, drop_and_pad=pad)
        per_shard.append((rows, rp, idx, off.tolist(), bound))
    pieces, piece_probs, sizes = [], [], []
    for e in range(E):
        for rows, rp, _, off, _ in per_shard:
            pieces.append(rows[off[e]:off[e + 1]])
            piece_probs.append(rp[off[e]:off[e + 1]])
            sizes.append(off[e + 1] - off[e])
    counts = torch.tensor(sizes).view(E, world).sum(1)
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)])
    y = layer.experts.forward_rows(torch.cat(pieces), offsets, torch.cat(piece_probs))
    parts = list(torch.split(y, sizes))
    loss = 0.0
    for r, (rows, _, idx, off, bound) in enumerate(per_shard):
        mine = [parts[e * world + r] for e in range(E)]
        used = off[E]
        yr = torch.cat(mine + [y.new_zeros(bound - used, y.shape[1])])
        out = ops.unpermute(yr, idx, restore_shape=(S * B, y.shape[1]))
        if layer.fc2_latent_proj is not None:
            out = layer.fc2_latent_proj(out)
        loss = loss + (out.float() * G[r].reshape(-1, H)).sum()
    loss.backward()
    return {n: p.grad for n, p in layer.experts.named_parameters()}


def _compare(ours: torch.Tensor, ref: torch.Tensor, bitwise: bool, n_ulps: float = 4) -> dict:
    """``equal`` and the max difference relative to the reference's max magnitude in ulps of
    the dtype (for the assertion message and the tolerance rule)."""
    assert ours is not None and ref is not None, f"no gradient: ours {ours is None}, ref {ref is None}"
    diff = (ours.double() - ref.double()).abs().max().item()
    scale = ref.double().abs().max().item() or 1.0
    ulps = diff / (scale * eps(ref.dtype))
    return dict(equal=torch.equal(ours, ref), ulps=ulps, bitwise=bitwise, n_ulps=n_ulps)


def ep_case(rank: int, world: int, case: str, mode: str, dispatcher: str) -> dict:
    from moe_core import MoEConfig, MoELayer

    kw = config_kwargs(case, mode, dispatcher)
    ref = global_layer(kw)
    ep = MoELayer(MoEConfig(**kw, expert_model_parallel_size=world))
    ep.load_state_dict(shard_state(ref, rank, world))
    X, G, masks = global_batch(world, kw["params_dtype"])
    out, dx, losses = run_layer(ep, X[rank], G[rank], masks[rank])

    bitwise = dispatcher == "alltoall"
    res = {}
    refs = []
    for r in range(world):  # the single-process layer on every shard (counts for the bias)
        refs.append(run_layer(ref, X[r], G[r], masks[r]) if r == rank else None)
        if r != rank:  # routing alone counts the tokens for the expert bias
            ref.router(X[r], padding_mask=masks[r].t())
        if r == rank:
            rparams = {n: p.grad.clone() for n, p in ref.named_parameters()
                       if not n.startswith("experts.")}
    r_out, r_dx, r_losses = refs[rank]
    res["out"] = _compare(out, r_out, bitwise)
    res["dx"] = _compare(dx, r_dx, bitwise)
    for n, p in ep.named_parameters():
        if not n.startswith("experts."):
            # the latent projections see the combine and the input gradient of the experts
            res[f"grad {n}"] = _compare(p.grad, rparams[n], bitwise or "latent_proj" not in n)
    res["losses"] = dict(equal=sorted(losses) == sorted(r_losses) and all(
        torch.equal(losses[k], r_losses[k]) for k in losses), ulps=0.0, bitwise=True, n_ulps=0)

    nle = kw["num_moe_experts"] // world
    cat = concatenated_expert_grads(ref, X, G, masks)
    for n, p in ep.experts.named_parameters():
        res[f"grad experts.{n}"] = _compare(p.grad, cat[n][rank * nle:(rank + 1) * nle], True)
    if ep.router.expert_bias is not None:
        ep.router.update_expert_bias()   # counts all-reduced over the world (the default)
        ref.router.update_expert_bias()  # every shard's counts, in one process
        res["expert_bias"] = _compare(ep.router.expert_bias, ref.router.expert_bias, True)
    return res


def ep_worker(rank: int, world: int, cases: List[Tuple[str, str, str]]) -> dict:
    return {c: ep_case(rank, world, *c) for c in cases}


@pytest.fixture(scope="module", params=[2, 4], ids=["ep2", "ep4"])
def ep_results(request):
    world = request.param
    return world, run_ranks(ep_worker, world, CASES, timeout=600)


@pytest.mark.parametrize("case", CASES, ids=["-".join(c) for c in CASES])
def test_ep_equals_single_process(ep_results, case):
    world, per_rank = ep_results
    for rank, results in enumerate(per_rank):
        for what, r in results[case].items():
            where = f"EP={world} rank {rank} {what}"
            if r["bitwise"]:
                assert r["equal"], f"{where}: not bitwise equal (max diff {r['ulps']:.2f} ulps)"
            else:
                assert r["ulps"] <= r["n_ulps"], f"{where}: {r['ulps']:.2f} ulps > {r['n_ulps']}"


# ---- EP x DP: gradients after the reduction equal one process on the whole batch -------------
def dp_worker(rank: int, world: int, use_fsdp: bool) -> dict:
    """World 4 as EP 2 x DP 2 (fp32): each rank runs shard ``rank`` of a 4-shard batch; after
    the reduction every gradient must equal the mean over the shards' losses in one process."""
    import torch.distributed as dist
    from moe_core import MoEConfig, MoELayer
    from moe_core.parallel import all_reduce_gradients, expert_parallel_groups

    kw = config_kwargs("sigmoid_groups_bias_top8_shared", "dropless", "alltoall", torch.float32)
    ep_size = 2
    groups = expert_parallel_groups(ep_size)
    ref = global_layer(kw)
    ep = MoELayer(MoEConfig(**kw, expert_model_parallel_size=ep_size), **groups.layer_kwargs())
    ep_rank = dist.get_rank(groups.ep_group)
    ep.load_state_dict(shard_state(ref, ep_rank, ep_size))
    if use_fsdp:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        fully_shard(ep.router, mesh=mesh)
        fully_shard(ep.shared_experts, mesh=mesh)
    X, G, masks = global_batch(world, torch.float32)
    run_layer(ep, X[rank], G[rank], masks[rank])  # each rank's own loss; the reduction averages
    try:  # without the expert-DP group each expert's two holders would not be summed
        all_reduce_gradients(ep)
        missing_group_error = "no error"
    except ValueError as e:
        missing_group_error = str(e)
    all_reduce_gradients(ep, expert_dp_group=groups.expert_dp_group)
    from moe_core.ops import AuxLossScale

    ref.router.aux_loss_scale = AuxLossScale(1.0 / world)  # the mean of the ranks' losses
    for r in range(world):
        run_layer(ref, X[r], G[r] / world, masks[r])
    nle = kw["num_moe_experts"] // ep_size
    res = {}
    for n, p in ep.named_parameters():
        g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        want = dict(ref.named_parameters())[n].grad
        if n.startswith("experts."):
            want = want[ep_rank * nle:(ep_rank + 1) * nle]
        res[n] = _compare(g, want, False, n_ulps=16)
    res["missing_group_error"] = missing_group_error
    return res


@pytest.mark.parametrize("use_fsdp", [False, True], ids=["all_reduce", "fsdp2"])
def test_ep_times_dp_gradients(use_fsdp):
    """Sums of four shards in another order: within 16 fp32 ulps of the largest gradient."""
    for rank, res in enumerate(run_ranks(dp_worker, 4, use_fsdp, timeout=300)):
        error = res.pop("missing_group_error")
        assert "expert_dp_group has 1 ranks, but with 4 data-parallel ranks and expert " \
               "parallelism 2 each expert is held by 2" in error, f"rank {rank}: {error!r}"
        for n, r in res.items():
            assert r["ulps"] <= r["n_ulps"], f"rank {rank} {n}: {r['ulps']:.2f} ulps"


# ---- at EP 2: compile, overlap, DeviceMesh, and the errors raised on every rank -------------
def _layer_and_batch(rank: int, world: int, case: str, mode: str, dispatcher: str, **extra):
    from moe_core import MoEConfig, MoELayer

    kw = config_kwargs(case, mode, dispatcher)
    ref = global_layer(kw)
    ep = MoELayer(MoEConfig(**kw, **extra, expert_model_parallel_size=world))
    ep.load_state_dict(shard_state(ref, rank, world))
    X, G, masks = global_batch(world, torch.bfloat16)
    return ep, X[rank], G[rank], masks[rank]


def _grads(layer) -> Dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in layer.named_parameters()}


def _all_gather_list(t: torch.Tensor) -> List[torch.Tensor]:
    import torch.distributed as dist

    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t.contiguous())
    return parts


def _error_of(fn) -> str:
    try:
        fn()
    except ValueError as e:
        return str(e)
    return "no error"


def misc_worker(rank: int, world: int) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from moe_core import MoEConfig, MoELayer

    res = {}
    # drop-and-pad has static splits: the whole layer compiles with fullgraph, fwd + bwd
    ep, x, g, m = _layer_and_batch(rank, world, "softmax_top2", "drop_and_pad", "alltoall")
    eager = run_layer(ep, x, g, m) + (_grads(ep),)
    ep.zero_grad(set_to_none=True)
    torch._dynamo.reset()
    compiled = torch.compile(ep, fullgraph=True, backend="aot_eager")
    got = run_layer(compiled, x, g, m) + (_grads(ep),)
    res["compile_fullgraph"] = (torch.equal(got[0], eager[0]) and torch.equal(got[1], eager[1])
                                and all(torch.equal(got[3][k], eager[3][k]) for k in eager[3]))

    # the shared expert overlapped with the exchanges gives the same values
    plain, x, g, m = _layer_and_batch(rank, world, "sigmoid_groups_bias_top8_shared", "dropless",
                                      "alltoall")
    over, _, _, _ = _layer_and_batch(rank, world, "sigmoid_groups_bias_top8_shared", "dropless",
                                     "alltoall", moe_shared_expert_overlap=True)
    a, b = run_layer(plain, x, g, m), run_layer(over, x, g, m)
    ga, gb = _grads(plain), _grads(over)
    res["overlap"] = dict(out=_compare(b[0], a[0], True), dx=_compare(b[1], a[1], False, 2),
                          **{k: _compare(gb[k], ga[k], True) for k in ga})

    # a DeviceMesh is accepted where a group is
    kw = config_kwargs("softmax_top2", "dropless", "alltoall")
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    ref = global_layer(kw)
    with_mesh = MoELayer(MoEConfig(**kw, expert_model_parallel_size=world), ep_group=mesh)
    with_pair = MoELayer(MoEConfig(**kw, expert_model_parallel_size=world), ep_group=(mesh, "ep"))
    with_group = MoELayer(MoEConfig(**kw, expert_model_parallel_size=world))
    X, G, masks = global_batch(world, torch.bfloat16)
    outs = []
    for layer in (with_mesh, with_pair, with_group):
        layer.load_state_dict(shard_state(ref, rank, world))
        outs.append(run_layer(layer, X[rank], G[rank], masks[rank])[0])
    res["device_mesh"] = torch.equal(outs[0], outs[2]) and torch.equal(outs[1], outs[2])

    # the global gradient norm and the single-process state dict of an expert-parallel model
    from moe_core.parallel import clip_grad_norm_, full_state_dict

    ep, x, g, m = _layer_and_batch(rank, world, "sigmoid_groups_bias_top8_shared", "dropless",
                                   "alltoall")
    ref = global_layer(config_kwargs("sigmoid_groups_bias_top8_shared", "dropless", "alltoall"))
    run_layer(ep, x, g, m)
    before = {n: p.grad.clone() for n, p in ep.named_parameters()}
    # the norm one process computes from this rank's replicated gradients and every rank's
    # expert gradients (gathered); clipped to half of it, every gradient must halve
    gathered = {n: torch.cat(_all_gather_list(t)) if n.startswith("experts.") else t
                for n, t in before.items()}
    want = torch.linalg.vector_norm(
        torch.stack([torch.linalg.vector_norm(t.float()) for t in gathered.values()]))
    norm = clip_grad_norm_(ep, want.item() / 2)
    res["clip_norm"] = _compare(norm, want, False, n_ulps=4)
    coef = (want.item() / 2) / (norm.item() + 1e-6)
    res["clipped"] = {n: _compare(p.grad, before[n] * coef, False, n_ulps=2)
                      for n, p in ep.named_parameters()}
    full = full_state_dict(ep)
    # the running token counts differ by design: the EP layer has routed a batch, ref has not
    running = {"router.local_tokens_per_expert"}
    res["full_state_dict"] = sorted(full) == sorted(ref.state_dict()) and all(
        torch.equal(full[k], v) for k, v in ref.state_dict().items() if k not in running)
    # errors: raised on every rank before any exchange, so the next collective still works
    errs = {}
    errs["ep_size_vs_world"] = _error_of(
        lambda: MoELayer(MoEConfig(**kw, expert_model_parallel_size=world * 2)))
    solo = [dist.new_group([r]) for r in range(world)][rank]
    errs["group_size"] = _error_of(
        lambda: MoELayer(MoEConfig(**kw, expert_model_parallel_size=world), ep_group=solo))
    mine = dict(kw, moe_expert_capacity_factor=1.0 if rank == 0 else None)
    errs["config_differs"] = _error_of(
        lambda: MoELayer(MoEConfig(**mine, expert_model_parallel_size=world)))
    for disp, mode in (("alltoall", "drop_and_pad"), ("allgather", "dropless")):
        layer, x, g, m = _layer_and_batch(rank, world, "softmax_top2", mode, disp)
        tokens = x[: S - rank]  # a different token count on every rank
        errs[f"tokens_differ_{disp}"] = _error_of(lambda: layer(tokens))
    dist.barrier()
    res["errors"] = errs
    return res


@pytest.fixture(scope="module")
def misc_results():
    return run_ranks(misc_worker, 2, timeout=300)


def test_drop_and_pad_compiles_fullgraph(misc_results):
    assert all(r["compile_fullgraph"] for r in misc_results)


def test_shared_expert_overlap_equals_plain(misc_results):
    """Output and every gradient bitwise; the input gradient within two bf16 roundings of its
    largest value: its three terms (router, shared expert, routed experts) are accumulated in
    another order when the shared expert runs under the exchange (as in Megatron)."""
    for rank, res in enumerate(misc_results):
        for what, r in res["overlap"].items():
            if r["bitwise"]:
                assert r["equal"], f"rank {rank} {what}: {r['ulps']:.2f} ulps"
            else:
                assert r["ulps"] <= r["n_ulps"], f"rank {rank} {what}: {r['ulps']:.2f} ulps"


def test_full_state_dict_and_global_norm_clipping(misc_results):
    """full_state_dict gathers the experts into the single-process state dict (bitwise);
    clip_grad_norm_ uses the norm over every rank's experts (four fp32 roundings) and scales
    every gradient by the same factor."""
    for rank, r in enumerate(misc_results):
        assert r["full_state_dict"], f"rank {rank}"
        assert r["clip_norm"]["ulps"] <= r["clip_norm"]["n_ulps"], f"rank {rank}: {r['clip_norm']}"
        for n, c in r["clipped"].items():
            assert c["ulps"] <= c["n_ulps"], f"rank {rank} {n}: {c['ulps']:.2f} ulps"


def test_device_mesh_as_group(misc_results):
    assert all(r["device_mesh"] for r in misc_results)


@pytest.mark.parametrize("case,message", [
    ("ep_size_vs_world", r"expert_model_parallel_size=4 but the default group has 2 ranks"),
    ("group_size", r"expert_model_parallel_size=2 but ep_group has 1 ranks"),
    ("config_differs", r"moe_expert_capacity_factor differs across the expert-parallel ranks: "
                       r"rank 0: 1.0, rank 1: None"),
    ("tokens_differ_alltoall", r"moe_pad_expert_input_to_capacity needs the same number on every "
                               r"expert-parallel rank, got \[12, 10\]"),
    ("tokens_differ_allgather", r"the allgather dispatcher needs the same number on every "
                                r"expert-parallel rank, got \[12, 10\]"),
])
def test_error_on_every_rank(misc_results, case, message):
    import re

    for rank, r in enumerate(misc_results):
        assert re.search(message, r["errors"][case]), f"rank {rank}: {r['errors'][case]!r}"


def test_expert_parallel_without_a_group_of_that_size():
    """Single process: EP = 2 with no process group of two ranks is refused at construction."""
    from moe_core import MoEConfig, MoELayer

    with pytest.raises(ValueError, match="expert_model_parallel_size=2"):
        MoELayer(MoEConfig(**config_kwargs("softmax_top2", "dropless", "alltoall"),
                           expert_model_parallel_size=2))


# ---- a group of one: the expert-parallel path equals the plain layer ------------------------
def world_of_one_worker(rank: int, world: int) -> dict:
    """The EP path on an explicit group of one, with its exchanges skipped (the default: they
    are identities) and forced through the collectives, against the plain layer."""
    import torch.distributed as dist
    from moe_core import MoEConfig, MoELayer

    res = {}
    for case in ("softmax_top2", "sigmoid_groups_bias_top8_shared"):
        for mode in MODES:
            for disp in DISPATCHERS:
                kw = config_kwargs(case, mode, disp)
                plain = global_layer(kw)
                X, G, masks = global_batch(1, torch.bfloat16)
                want = run_layer(plain, X[0], G[0], masks[0])[:2] + (_grads(plain),)
                for forced in (False, True):
                    ep = MoELayer(MoEConfig(**kw), ep_group=dist.group.WORLD)
                    ep.load_state_dict(plain.state_dict())
                    ep.dispatcher.exchange = forced
                    got = run_layer(ep, X[0], G[0], masks[0])[:2] + (_grads(ep),)
                    res[(case, mode, disp, forced)] = (
                        torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
                        and all(torch.equal(got[2][k], want[2][k]) for k in want[2]))
    return res


def test_world_of_one_equals_plain_layer():
    (res,) = run_ranks(world_of_one_worker, 1, timeout=300)
    bad = [k for k, ok in res.items() if not ok]
    assert not bad, f"differs from the plain layer: {bad}"
