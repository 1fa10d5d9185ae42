"""Expert parallelism with random per-rank differences, 2 and 3 gloo ranks: token counts, input
dtypes and config fields drawn per rank, some after a step every rank agreed on. Every scenario must end the same way on every rank:
all ranks return (the scenario is one the exchanges can take) or all ranks raise an error of
one type (a bad input or a difference they cannot take), within a bounded time, and no rank may
be left in a collective (a lockstep probe follows every scenario, on a process group whose
collectives time out after a few seconds).

The scenarios come from a seeded generator, one list per world size run in one spawn of the
ranks: the "ci" profile draws a fixed list (the same on every run), "thorough" a larger random
one (MOE_CORE_FUZZ_PROFILE, as the rest of the tier)."""
import os
import random
from typing import Dict, List

import pytest
import torch

import helpers.fuzz  # noqa: F401  (the tier's profiles)
from helpers.dist import run_ranks
from helpers.rank_failures import run_cases

H, E = 16, 6  # 6 experts: split over 2 and 3 ranks
FAST = 20.0   # seconds: the collectives' timeout; a scenario that needed it takes longer
PROFILE = os.environ.get("MOE_CORE_FUZZ_PROFILE", "ci")
SCENARIOS = {"ci": 10, "thorough": 60}.get(PROFILE, 10)

MODES = {
    "dropless": dict(),
    "dropping": dict(moe_expert_capacity_factor=0.5),
    "drop_and_pad": dict(moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=True),
}
# one rank's config differs from the others' in one field (each changes what they exchange)
CONFIG_DIFFS = [
    dict(moe_router_dtype="fp64"),
    dict(moe_router_load_balancing_type="global_aux_loss"),
    dict(moe_router_topk=3),
    dict(moe_expert_capacity_factor=2.0),
]


def draw(rng: random.Random, world: int) -> dict:
    """One scenario: the shared config, and each rank's token count, dtype and config change."""
    mode = rng.choice(sorted(MODES))
    dispatcher = rng.choice(["alltoall", "allgather"])
    equal = rng.random() < 0.5
    base_tokens = rng.randint(2, 12)
    tokens = [base_tokens if equal else rng.randint(2, 12) for _ in range(world)]
    dtypes = ["bfloat16"] * world
    if rng.random() < 0.3:
        dtypes[rng.randrange(world)] = "float32"
    diffs = [{} for _ in range(world)]
    if rng.random() < 0.3:
        diffs[rng.randrange(world)] = rng.choice(CONFIG_DIFFS)
    # with the same config everywhere, half the scenarios first run a step every rank agrees on
    warm = not any(diffs) and rng.random() < 0.5
    return dict(mode=mode, dispatcher=dispatcher, tokens=tokens, dtypes=dtypes, diffs=diffs,
                warm=warm)


def scenarios(world: int) -> List[dict]:
    seed = 1000 + world if PROFILE == "ci" else random.randrange(2 ** 32)
    rng = random.Random(seed)
    return [draw(rng, world) for _ in range(SCENARIOS)]


def valid(s: dict) -> bool:
    """Whether the exchanges can take the scenario (every rank must then return)."""
    if any(s["diffs"]) or any(d != "bfloat16" for d in s["dtypes"]):
        return False
    needs_equal = s["dispatcher"] == "allgather" or s["mode"] == "drop_and_pad"
    return not (needs_equal and len(set(s["tokens"])) > 1)


def _run(s: dict):
    def case(rank: int, world: int):
        import torch.nn.functional as F

        from moe_core import MoEConfig, MoELayer

        kw = dict(hidden_size=H, moe_ffn_hidden_size=24, num_moe_experts=E, moe_router_topk=2,
                  add_bias_linear=False, gated_linear_unit=True, activation_func=F.silu,
                  moe_router_dtype="fp32", moe_aux_loss_coeff=1e-2, params_dtype=torch.bfloat16,
                  moe_token_dispatcher_type=s["dispatcher"], expert_model_parallel_size=world)
        kw.update(MODES[s["mode"]])
        kw.update(s["diffs"][rank])
        if kw.get("moe_expert_capacity_factor") is None:
            kw.pop("moe_pad_expert_input_to_capacity", None)
        torch.manual_seed(0)
        layer = MoELayer(MoEConfig(**kw))
        g = torch.Generator().manual_seed(rank)
        if s["warm"]:  # a step every rank agrees on first: the checks must not go stale
            layer(torch.randn(s["tokens"][0], H, generator=g, dtype=torch.bfloat16))
        x = torch.randn(s["tokens"][rank], H, generator=g).to(getattr(torch, s["dtypes"][rank]))
        x.requires_grad_(True)
        out = layer(x)
        out.float().sum().backward()
        return bool(torch.isfinite(out.float()).all())
    return case


def worker(rank: int, world: int, drawn: List[dict]) -> Dict[str, object]:
    cases = {f"scenario {i}": _run(s) for i, s in enumerate(drawn)}
    return run_cases(rank, world, cases, list(cases))


@pytest.mark.parametrize("world", [2, 3])
def test_random_per_rank_differences(world):
    drawn = scenarios(world)
    per_rank = run_ranks(worker, world, drawn, timeout=600, collective_timeout=FAST)
    for i, s in enumerate(drawn):
        outs = [res[f"scenario {i}"] for res in per_rank]
        where = f"world {world} scenario {i} {s}"
        for rank, o in enumerate(outs):
            assert o.lockstep, f"{where}: rank {rank} out of step"
            assert o.seconds < FAST, f"{where}: rank {rank} took {o.seconds:.1f} s"
        errors = [o.error for o in outs]
        if valid(s):
            assert errors == [None] * world, f"{where}: {[o.message for o in outs]}"
            assert all(o.value for o in outs), f"{where}: a non-finite output"
        else:
            assert None not in errors and len(set(errors)) == 1, \
                f"{where}: {[(o.error, o.message[:200]) for o in outs]}"
