"""Failure cases of expert parallelism over gloo ranks: each case runs on every rank, catches what
it raises, and is followed by a lockstep probe, so a case that left a rank in a collective (or
one rank a collective ahead of the others) shows as a probe that times out or disagrees.

``run_cases(rank, world, names)`` runs the named cases of ``CASES`` in order on this rank and
returns ``{name: Outcome}``: the worker of tests/ep/test_rank_failures.py and of the fuzz tier's
multi-rank cases. A case is ``fn(rank, world)``: it raises (the error under test) or returns
what the test checks."""
import dataclasses
import time
from typing import Callable, Dict, List, Optional

import torch


@dataclasses.dataclass
class Outcome:
    error: Optional[str]      # the exception's type name, None when the case returned
    message: str              # its message
    value: object             # what the case returned (None when it raised)
    seconds: float            # how long the case took on this rank
    lockstep: bool            # the probe after it saw every rank at the same case


def probe(tag: int) -> bool:
    """One all-reduce of ``tag`` over the world: True when every rank sent the same tag (every
    rank is at the same point), False otherwise; times out (raises) when a rank is missing."""
    import torch.distributed as dist

    t = torch.tensor([float(tag), 1.0], dtype=torch.float64)
    dist.all_reduce(t)
    world = dist.get_world_size()
    return t[0].item() == tag * world and t[1].item() == world


def run_case(fn: Callable[[int, int], None], rank: int, world: int, tag: int) -> Outcome:
    """``fn`` on this rank, then the probe; a probe that fails names the case before it."""
    start = time.monotonic()
    try:
        value = fn(rank, world)
        error, message = None, ""
    except Exception as e:  # noqa: BLE001 (the case's error is the result)
        error, message, value = type(e).__name__, str(e), None
    seconds = time.monotonic() - start
    try:
        lockstep = probe(tag)
    except Exception as e:  # noqa: BLE001
        raise RuntimeError(f"the probe after {fn.__name__} failed on rank {rank} (the case "
                           f"raised {error}: {message[:300]!r})") from e
    return Outcome(error, message, value, seconds, lockstep)


def run_cases(rank: int, world: int, cases: Dict[str, Callable[[int, int], None]],
              names: List[str]) -> Dict[str, Outcome]:
    return {name: run_case(cases[name], rank, world, i + 1) for i, name in enumerate(names)}
