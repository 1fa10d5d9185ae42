"""Expert parallelism when one rank's input, configuration or step goes wrong, 2 gloo ranks on
the CPU: every rank raises a clear error (the same on every rank where the cause is shared)
within seconds, and no rank is left in a collective (a lockstep probe follows every case, on a
process group whose collectives time out after a few seconds).

All cases run in one spawn of the ranks (a module fixture); each test reads its case."""
import re

import pytest
import torch

from helpers.dist import run_ranks
from helpers.ep_layer import config_kwargs, global_batch, global_layer, run_layer, shard_state
from helpers.rank_failures import run_cases

WORLD = 2
# seconds: the collectives' timeout; a case that needed it to end would take longer (the cases
# themselves take a fraction of a second on an idle machine)
FAST = 20.0


def _ep_layer(rank: int, world: int, case: str = "softmax_top2", mode: str = "dropless",
              dispatcher: str = "alltoall", dtype=torch.bfloat16, **extra):
    from moe_core import MoEConfig, MoELayer

    kw = dict(config_kwargs(case, mode, dispatcher, dtype), **extra)
    ref = global_layer(kw)
    ep = MoELayer(MoEConfig(**kw, expert_model_parallel_size=world))
    ep.load_state_dict(shard_state(ref, rank, world))
    return ep


# ---- the cases -------------------------------------------------------------------------------
def clip_without_gradients(rank: int, world: int):
    """Rank 1 dropped its gradients (``zero_grad(set_to_none=True)``, a skipped step):
    clip_grad_norm_ still joins the norm's all-reduce, and rank 0's norm counts its own
    gradients (rank 1 adds zeros)."""
    from moe_core.parallel import clip_grad_norm_

    ep = _ep_layer(rank, world, dtype=torch.float32)
    X, G, masks = global_batch(world, torch.float32)
    run_layer(ep, X[rank], G[rank], masks[rank])
    if rank == 1:
        ep.zero_grad(set_to_none=True)
    own = [p.grad.float() for p in ep.parameters() if p.grad is not None]
    want = (torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in own]))
            if own else torch.zeros(()))
    return clip_grad_norm_(ep, 1e9).item(), want.item()


def _step(ep, rank, world, tokens=None, dtype=torch.bfloat16):
    """One forward + backward on this rank's shard, its first ``tokens`` sequences' positions
    (all when None), in ``dtype``."""
    X, G, masks = global_batch(world, torch.float32)
    x, g, m = X[rank].to(dtype), G[rank], masks[rank]
    if tokens is not None:
        x, g, m = x[:tokens], g[:tokens], m[:, :tokens]
    run_layer(ep, x, g, m)


def _tokens_change_after_a_checked_step(rank, world, **kw):
    ep = _ep_layer(rank, world, **kw)
    _step(ep, rank, world)
    _step(ep, rank, world, tokens=6 - rank)  # rank 1 alone changes its count


def allgather_tokens_change(rank: int, world: int):
    _tokens_change_after_a_checked_step(rank, world, dispatcher="allgather")


def drop_and_pad_tokens_change(rank: int, world: int):
    _tokens_change_after_a_checked_step(rank, world, mode="drop_and_pad")


def compiled_allgather_tokens_change(rank: int, world: int):
    """Under torch.compile the ranks agree inside the graph (a device-side assert: no host
    read), so a token count that changes on one rank fails on every rank."""
    ep = _ep_layer(rank, world, dispatcher="allgather")
    torch._dynamo.reset()
    # dynamic: no rank recompiles at the second call (a recompile on one rank would keep the
    # other waiting in the graph's collective meanwhile)
    compiled = torch.compile(ep, backend="aot_eager", dynamic=True)
    X, G, masks = global_batch(world, torch.bfloat16)
    compiled(X[rank], padding_mask=masks[rank])
    n = 6 - rank
    compiled(X[rank][:n], padding_mask=masks[rank][:, :n])


def _input_dtype_on_rank_1(rank, world, **kw):
    ep = _ep_layer(rank, world, **kw)
    _step(ep, rank, world, dtype=torch.float32 if rank == 1 else torch.bfloat16)


def dtype_on_one_rank_alltoall(rank: int, world: int):
    _input_dtype_on_rank_1(rank, world)


def dtype_on_one_rank_allgather(rank: int, world: int):
    _input_dtype_on_rank_1(rank, world, dispatcher="allgather")


def dtype_on_one_rank_global_aux(rank: int, world: int):
    """The router reduces the global aux loss's counts before the dispatcher's first
    collective: the agreement is a collective of its own, before the router."""
    _input_dtype_on_rank_1(rank, world, moe_router_load_balancing_type="global_aux_loss")


def shape_on_one_rank(rank: int, world: int):
    ep = _ep_layer(rank, world)
    x = torch.randn(12, 16 + rank, dtype=torch.bfloat16)
    ep(x)


def _config_on_rank_1(rank, world, same=None, **differs):
    _ep_layer(rank, world, **(same or {}), **(differs if rank == 1 else {}))


def router_dtype_differs(rank: int, world: int):
    _config_on_rank_1(rank, world, moe_router_dtype="fp64")


def global_aux_loss_on_one_rank(rank: int, world: int):
    _config_on_rank_1(rank, world, moe_router_load_balancing_type="global_aux_loss")


def expert_bias_on_one_rank(rank: int, world: int):
    _config_on_rank_1(rank, world, dict(moe_router_score_function="sigmoid"),
                      moe_router_enable_expert_bias=True)


def config_changed_after_construction(rank: int, world: int):
    ep = _ep_layer(rank, world)
    if rank == 1:
        ep.config.moe_router_dtype = "fp64"
    _step(ep, rank, world)


def eval_on_one_rank(rank: int, world: int):
    ep = _ep_layer(rank, world, moe_router_load_balancing_type="global_aux_loss")
    ep.train(rank == 0)
    _step(ep, rank, world)


def rank_raises_mid_step(rank: int, world: int):
    """Rank 1's experts raise (an error moe-core cannot see coming) and its training loop
    catches it: rank 0, in the combine's all-to-all, raises within the EP group's timeout an
    error naming that exchange (expert_parallel_groups(timeout=...))."""
    import datetime

    from moe_core import MoEConfig, MoELayer
    from moe_core.parallel import expert_parallel_groups

    groups = expert_parallel_groups(world, timeout=datetime.timedelta(seconds=3))
    kw = config_kwargs("softmax_top2", "dropless", "alltoall")
    ref = global_layer(kw)
    ep = MoELayer(MoEConfig(**kw, expert_model_parallel_size=world), **groups.layer_kwargs())
    ep.load_state_dict(shard_state(ref, rank, world))
    if rank == 1:
        def broken(*args, **kwargs):
            raise RuntimeError("out of memory (simulated)")
        ep.experts.forward_rows = broken
    X, _, masks = global_batch(world, torch.bfloat16)
    ep(X[rank], padding_mask=masks[rank])


CASES = {f.__name__: f for f in (
    clip_without_gradients, allgather_tokens_change, drop_and_pad_tokens_change,
    compiled_allgather_tokens_change, dtype_on_one_rank_alltoall, dtype_on_one_rank_allgather,
    dtype_on_one_rank_global_aux, shape_on_one_rank, router_dtype_differs,
    global_aux_loss_on_one_rank, expert_bias_on_one_rank, config_changed_after_construction,
    eval_on_one_rank, rank_raises_mid_step)}


def worker(rank: int, world: int) -> dict:
    _ep_layer(rank, world)  # imports and first allocations, outside the cases' timing
    return run_cases(rank, world, CASES, list(CASES))


@pytest.fixture(scope="module")
def outcomes():
    return run_ranks(worker, WORLD, timeout=300, collective_timeout=FAST)


# cases that compile: their time is the compiler's, on a busy machine more than FAST
SLOW = {"compiled_allgather_tokens_change": 300.0}


def _no_rank_left_behind(outcomes, case):
    for rank, res in enumerate(outcomes):
        o = res[case]
        assert o.lockstep, f"rank {rank}: not in step with the others after {case}"
        limit = SLOW.get(case, FAST)
        assert o.seconds < limit, f"rank {rank}: {case} took {o.seconds:.1f} s"
    return [res[case] for res in outcomes]


def _same_error_everywhere(outcomes, case, error, pattern):
    for rank, o in enumerate(_no_rank_left_behind(outcomes, case)):
        assert o.error == error and re.search(pattern, o.message), \
            f"rank {rank}: {o.error}: {o.message!r}"


def test_clip_grad_norm_on_a_rank_without_gradients(outcomes):
    got = _no_rank_left_behind(outcomes, "clip_without_gradients")
    for rank, o in enumerate(got):
        assert o.error is None, f"rank {rank}: {o.error}: {o.message}"
    norm, want = got[0].value
    assert abs(norm - want) <= 4 * 2 ** -24 * want, (norm, want)
    # rank 1 has no gradient of its own: its norm is rank 0's expert gradients'
    assert got[1].value[0] > 0


@pytest.mark.parametrize("case,why", [
    ("allgather_tokens_change", "the allgather dispatcher"),
    ("drop_and_pad_tokens_change", "moe_pad_expert_input_to_capacity"),
])
def test_token_count_changes_on_one_rank_after_a_checked_step(outcomes, case, why):
    """Checked at every forward (no per-rank cache that goes stale)."""
    _same_error_everywhere(outcomes, case, "ValueError",
                           rf"{why} needs the same number on every expert-parallel rank, "
                           rf"got \[12, 10\]")


def test_token_count_changes_under_compile(outcomes):
    _same_error_everywhere(outcomes, "compiled_allgather_tokens_change", "RuntimeError",
                           "the expert-parallel ranks disagree on this forward")


@pytest.mark.parametrize("case", ["dtype_on_one_rank_alltoall", "dtype_on_one_rank_allgather",
                                  "dtype_on_one_rank_global_aux"])
def test_input_dtype_on_one_rank(outcomes, case):
    """The single-process layer's TypeError, raised on every rank (the alltoall dispatcher
    carries the agreement in its token-count all-gather; the others have one of their own)."""
    _same_error_everywhere(outcomes, case, "TypeError",
                           r"^expert-parallel forward stopped on every rank: rank 1: "
                           r"hidden_states is torch.float32 but the layer's parameters are "
                           r"torch.bfloat16")


def test_input_shape_on_one_rank(outcomes):
    _same_error_everywhere(outcomes, "shape_on_one_rank", "ValueError",
                           r"^expert-parallel forward stopped on every rank: rank 1: "
                           r"hidden_states has 2 dimensions and last size 17, the layer takes "
                           r"\[S, B, 16\] or \[T, 16\]$")


@pytest.mark.parametrize("case,field,values", [
    ("router_dtype_differs", "moe_router_dtype", "rank 0: 'fp32', rank 1: 'fp64'"),
    ("global_aux_loss_on_one_rank", "moe_router_load_balancing_type",
     "rank 0: 'aux_loss', rank 1: 'global_aux_loss'"),
    ("expert_bias_on_one_rank", "moe_router_enable_expert_bias", "rank 0: False, rank 1: True"),
])
def test_config_differs_at_construction(outcomes, case, field, values):
    _same_error_everywhere(outcomes, case, "ValueError",
                           f"^{field} differs across the expert-parallel ranks: {values}$")


def test_config_changed_after_construction(outcomes):
    _same_error_everywhere(outcomes, "config_changed_after_construction", "ValueError",
                           r"^the configuration differs across the expert-parallel ranks")


def test_training_mode_differs(outcomes):
    _same_error_everywhere(outcomes, "eval_on_one_rank", "ValueError",
                           r"training mode or grad mode differs across the expert-parallel ranks "
                           r"\(rank 0: training, grad enabled, rank 1: eval, grad enabled\)")


def test_every_config_field_is_classified():
    """A new MoEConfig field must be put in one of the two lists: checked across the
    expert-parallel ranks, or free to differ."""
    import dataclasses

    from moe_core import MoEConfig
    from moe_core.layer import _MAY_DIFFER, _SAME_ON_EVERY_RANK

    fields = {f.name for f in dataclasses.fields(MoEConfig)}
    assert not set(_SAME_ON_EVERY_RANK) & set(_MAY_DIFFER)
    assert fields == set(_SAME_ON_EVERY_RANK) | set(_MAY_DIFFER), \
        fields ^ (set(_SAME_ON_EVERY_RANK) | set(_MAY_DIFFER))


def test_a_rank_that_raises_mid_step_leaves_no_rank_waiting(outcomes):
    """The rank that raised has its own error; the other raises within the group's timeout (3 s
    here, not the default 30 minutes) naming the exchange it was left in."""
    got = _no_rank_left_behind(outcomes, "rank_raises_mid_step")
    assert got[1].error == "RuntimeError" and "out of memory (simulated)" in got[1].message
    assert got[0].error == "RuntimeError" and re.search(
        r"^moe_core expert parallelism: the combine all-to-all did not complete \(", got[0].message
    ), got[0].message
    assert "must not go on after a step raised on one rank" in got[0].message
