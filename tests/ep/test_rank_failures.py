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


CASES = {f.__name__: f for f in (clip_without_gradients,)}


def worker(rank: int, world: int) -> dict:
    _ep_layer(rank, world)  # imports and first allocations, outside the cases' timing
    return run_cases(rank, world, CASES, list(CASES))


@pytest.fixture(scope="module")
def outcomes():
    return run_ranks(worker, WORLD, timeout=300, collective_timeout=FAST)


def _no_rank_left_behind(outcomes, case):
    for rank, res in enumerate(outcomes):
        o = res[case]
        assert o.lockstep, f"rank {rank}: not in step with the others after {case}"
        assert o.seconds < FAST, f"rank {rank}: {case} took {o.seconds:.1f} s"
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
