"""Expert parallelism against Megatron-Core's own MoELayer (megatron-core, local spec: SequentialMLP
experts, SwiGLU, no biases, fp32 router, aux loss on) at EP = 2 and EP = 4 over gloo on the CPU,
world = EP, ETP = 1: the same global weights (rank r holds experts [r·E/N, (r+1)·E/N) on both
sides), per-rank random inputs (no routing ties) and output gradients (``megatron_ep``).

Compared on every rank: the routing map exactly, the probs, the output, the input gradient, the
router weight gradient and the local experts' fc1 / fc2 weight gradients. Cases: the alltoall
dispatcher dropless (bf16 and fp32), capacity 0.5 without padding under the "probs" and the
"position" drop policies, capacity 1.0 padded to capacity (bf16); the allgather dispatcher
dropless and dropping, in fp32 only: Megatron's allgather combine rounds each rank's partial sum
to the activation dtype before the fp32 reduce-scatter (moe-core reduces the fp32 partials), so in
bf16 the two differ by roundings of the partial sums, which can exceed the output's scale where
the partials of a token's experts on different ranks cancel.

Tolerances (``tests/tolerances.py``'s units: ``eps`` per dtype, one rounding = eps / 2), at the
compared tensor's scale (its largest magnitude on Megatron's side), per rank:
* bf16 runs: two bf16 roundings, as ``test_layer.py``: both sides round the same bf16 GEMMs and
  the same top-k sum (K = 2), only their fp32 summation orders differ.
* fp32 runs, and the probs of every run (the router is fp32 on identical inputs): 64 fp32
  roundings, ~4e-6 relative. Every compared value ends a chain of dot products (H, F, the rank's
  tokens) that the two sides sum in different orders (BLAS blocks against moe-core's ordered fp32
  sums) through the softmax and SwiGLU backward; the router gradient adds one more reduction over
  the tokens, where cancellation leaves values well below the terms summed. Still three orders of
  magnitude below one bf16 rounding: a wrong token, expert, rank block or prob fails it.

Routing, where Megatron leaves something unspecified (the ``test_layer.py`` / ``test_layout.py``
rules): with padding to capacity the filler tokens (prob 0) are Megatron's torch.topk choice among
ties, so the real assignments and the column counts are compared; with the "position" policy
moe-core keeps the first ``capacity`` routed tokens of an over-full expert (Megatron's CUDA
behaviour) and Megatron's CPU code another subset, so both routers' maps before dropping are
compared exactly, moe-core's kept set against the first-routed closed form, and Megatron's on
what is defined (columns that fit, kept counts, kept within routed); the layers are then compared
with moe-core's router given Megatron's kept set, which leaves dispatch, experts, combine and
every gradient to the comparison.

Both world sizes run all their cases in one process group each (``run_ranks``).
"""
from typing import Dict, List, Tuple

import pytest
import torch
import torch.nn.functional as F

import megatron_ep
from dist_utils import run_ranks
from tolerances import eps

H, FFN, E, K, S, B = 32, 48, 8, 2, 12, 2
ROUNDINGS = {torch.bfloat16: 2, torch.float32: 64}

BASE = dict(hidden_size=H, moe_ffn_hidden_size=FFN, num_moe_experts=E, moe_router_topk=K,
            add_bias_linear=False, gated_linear_unit=True, activation_func=F.silu,
            moe_router_dtype="fp32", moe_aux_loss_coeff=1e-2, moe_grouped_gemm=False,
            seq_length=S, micro_batch_size=B)
BF16 = dict(bf16=True, params_dtype=torch.bfloat16)
A2A = dict(moe_token_dispatcher_type="alltoall")
AG = dict(moe_token_dispatcher_type="allgather")
DROP = dict(moe_expert_capacity_factor=0.5)

CASES: Dict[str, dict] = {
    "alltoall_dropless_bf16": dict(BASE, **BF16, **A2A),
    "alltoall_dropless_fp32": dict(BASE, **A2A),
    "alltoall_cap0.5_probs_bf16": dict(BASE, **BF16, **A2A, **DROP, moe_token_drop_policy="probs"),
    "alltoall_cap0.5_position_bf16": dict(BASE, **BF16, **A2A, **DROP,
                                          moe_token_drop_policy="position"),
    "alltoall_cap1.0_pad_bf16": dict(BASE, **BF16, **A2A, moe_expert_capacity_factor=1.0,
                                     moe_pad_expert_input_to_capacity=True),
    "allgather_dropless_fp32": dict(BASE, **AG),
    "allgather_cap0.5_probs_fp32": dict(BASE, **AG, **DROP, moe_token_drop_policy="probs"),
}

Results = Tuple[int, List[Dict[str, dict]]]


@pytest.fixture(scope="module", params=[2, 4], ids=lambda n: f"ep{n}")
def ep_results(request) -> Results:
    """(N, per rank {case: result}) of every case at EP = N: one run_ranks call per world size."""
    world = request.param
    per_rank = run_ranks(megatron_ep.run_cases, world, CASES)
    return world, [{name: megatron_ep.unpack(packed) for name, packed in ranks.items()}
                   for ranks in per_rank]


def case_dtype(case: str) -> torch.dtype:
    return CASES[case].get("params_dtype", torch.float32)


def check_close(ours: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, name: str) -> None:
    """|ours - ref| <= ROUNDINGS[dtype] roundings of ``dtype`` at ref's largest magnitude."""
    assert ours.shape == ref.shape, f"{name}: shape {tuple(ours.shape)} vs {tuple(ref.shape)}"
    ours, ref = ours.detach().double(), ref.detach().double()
    scale = ref.abs().max().item()
    diff = (ours - ref).abs().max().item()
    tol = ROUNDINGS[dtype] * eps(dtype) / 2 * max(scale, 1e-30)
    assert diff <= tol, f"{name}: max diff {diff:.3e} > {tol:.3e} (scale {scale:.3e})"


def first_routed(routed: torch.Tensor, capacity: int) -> torch.Tensor:
    """moe-core's "position" policy: the first ``capacity`` routed tokens of every expert."""
    return routed & (routed.long().cumsum(0) <= capacity)


@pytest.mark.megatron
@pytest.mark.parametrize("case", list(CASES))
def test_ep_routing_matches_megatron(ep_results: Results, case: str):
    world, ranks = ep_results
    kw = CASES[case]
    T = S * B
    for rank, results in enumerate(ranks):
        res = results[case]
        meg, ours, extra = res["megatron"], res["ours"], res["extra"]
        where = f"EP {world} rank {rank} {case}"
        if kw.get("moe_pad_expert_input_to_capacity"):
            real_meg = meg["map"] & (meg["probs"] != 0)
            real_ours = ours["map"] & (ours["probs"] != 0)
            assert torch.equal(real_meg, real_ours), f"{where}: routed assignments differ"
            assert torch.equal(meg["map"].sum(0), ours["map"].sum(0)), f"{where}: column counts"
        else:
            assert torch.equal(meg["map"], ours["map"]), f"{where}: routing maps differ"
        if kw.get("moe_token_drop_policy") == "position":
            routed, cap = extra["megatron_routed"], int(extra["capacity"])
            kept_meg, kept_ours = meg["map"], extra["ours_kept"]
            assert torch.equal(extra["ours_routed"], routed), f"{where}: maps before dropping"
            assert torch.equal(kept_ours, first_routed(routed, cap)), f"{where}: ours not first"
            fits = routed.sum(0) <= cap
            assert torch.equal(kept_ours[:, fits], kept_meg[:, fits]), f"{where}: columns that fit"
            assert torch.equal(kept_ours.sum(0), kept_meg.sum(0)), f"{where}: kept counts"
            assert not (kept_meg & ~routed).any(), f"{where}: Megatron kept an unrouted token"
        if "moe_expert_capacity_factor" in kw and not kw.get("moe_pad_expert_input_to_capacity"):
            assert ours["map"].sum() < T * K, f"{where}: capacity dropped nothing"
        check_close(ours["probs"], meg["probs"], torch.float32, f"{where}: probs")


@pytest.mark.megatron
@pytest.mark.parametrize("case", list(CASES))
def test_ep_layer_matches_megatron(ep_results: Results, case: str):
    world, ranks = ep_results
    dtype = case_dtype(case)
    for rank, results in enumerate(ranks):
        meg, ours = results[case]["megatron"], results[case]["ours"]
        where = f"EP {world} rank {rank} {case}"
        assert ours["out"].dtype == meg["out"].dtype == dtype, where
        assert ours["w1"].shape == (E // world, 2 * FFN, H), where
        assert ours["w2"].shape == (E // world, H, FFN), where
        for key, name in (("out", "output"), ("dx", "input grad"), ("router", "router weight grad"),
                          ("w1", "experts fc1 weight grad"), ("w2", "experts fc2 weight grad")):
            check_close(ours[key], meg[key], dtype, f"{where}: {name}")
