"""The symmetric-memory exchange's acceptance rule (moe_core/symm_exchange.py ``acceptance``)
written as plain loops over every rank's routing map: which (token, expert) pairs a receive
budget keeps. The tests build the reference layer from it, an NCCL-exchange layer whose routing
map loses exactly the pairs dropped (tests/ep/test_symm_mem.py, tests/ep/test_symm_mem_gpu.py,
tests/ep/test_symm_mem_multi_gpu.py)."""
from typing import List

import torch


def expected_keep(maps: List[torch.Tensor], world: int, budget: int) -> List[torch.Tensor]:
    """The acceptance rule, by loops: ``maps[s]`` is source s's routing map [T, E] (bool).
    Receiver r fills ``budget`` rows over (local expert e, source s) chunks, each chunk's rows
    in token order; returns keep masks [T, E] per source."""
    E = maps[0].shape[1]
    nle = E // world
    keep = [m.clone() for m in maps]
    for r in range(world):
        filled = 0
        for e in range(nle):
            g = r * nle + e
            for s in range(world):
                tokens = maps[s][:, g].nonzero().flatten().tolist()
                take = min(len(tokens), max(budget - filled, 0))
                filled += take
                for t in tokens[take:]:
                    keep[s][t, g] = False
    return keep
