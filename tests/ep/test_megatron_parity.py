"""Expert parallelism against Megatron-Core's own MoELayer (megatron-core, local spec: SequentialMLP
experts, SwiGLU, no biases, fp32 router, aux loss on) at EP = 2 and EP = 4 over gloo on the CPU,
world = EP, ETP = 1: the same global weights (rank r holds experts [r·E/N, (r+1)·E/N) on both
sides), per-rank random inputs (no routing ties) and output gradients (``helpers.megatron_ep``).

Compared on every rank: the routing map exactly, the probs, the output, the input gradient, the
router weight gradient and the local experts' fc1 / fc2 weight gradients. Cases: the alltoall
dispatcher dropless (bf16 and fp32), capacity 0.5 without padding under the "probs" and the
"position" drop policies, capacity 1.0 padded to capacity (bf16); the allgather dispatcher
dropless and dropping, in fp32 only: Megatron's allgather combine rounds each rank's partial sum
to the activation dtype before the fp32 reduce-scatter (moe-core reduces the fp32 partials), so in
bf16 the two differ by roundings of the partial sums, which can exceed the output's scale where
the partials of a token's experts on different ranks cancel.

Tolerances (``tests/helpers/tolerances.py``'s units: ``eps`` per dtype, one rounding = eps / 2), at
the compared tensor's scale (its largest magnitude on Megatron's side), per rank:
* bf16 runs: two bf16 roundings, as ``tests/layer/test_megatron_parity.py``: both sides round the
  same bf16 GEMMs and the same top-k sum (K = 2), only their fp32 summation orders differ.
* fp32 runs, and the probs of every run (the router is fp32 on identical inputs): 64 fp32
  roundings, ~4e-6 relative. Every compared value ends a chain of dot products (H, F, the rank's
  tokens) that the two sides sum in different orders (BLAS blocks against moe-core's ordered fp32
  sums) through the softmax and SwiGLU backward; the router gradient adds one more reduction over
  the tokens, where cancellation leaves values well below the terms summed. Still three orders of
  magnitude below one bf16 rounding: a wrong token, expert, rank block or prob fails it.

Routing, where Megatron leaves something unspecified (the ``tests/layer/test_megatron_parity.py`` /
``tests/layout/test_ops.py`` rules): with padding to capacity the filler tokens (prob 0) are
Megatron's torch.topk choice among ties, so the real assignments and the column counts are compared;
with the "position" policy moe-core keeps the first ``capacity`` routed tokens of an over-full
expert (Megatron's CUDA behaviour) and Megatron's CPU code another subset, so both routers' maps
before dropping are compared exactly, moe-core's kept set against the first-routed closed form, and
Megatron's on what is defined (columns that fit, kept counts, kept within routed); the layers are
then compared with moe-core's router given Megatron's kept set, which leaves dispatch, experts,
combine and every gradient to the comparison.

Dispatcher metadata (the EP spec's test 1), in the same process groups, for nle ∈ {1, 2, 4}
local experts per rank (E = N·nle): moe-core's ``AlltoAllDispatcher.preprocess`` and Megatron's
``MoEAlltoAllTokenDispatcher.preprocess`` (built as its MoELayer builds it) on the same per-rank
routing maps, which include empty experts, a rank that receives nothing, a rank that sends nothing
and unequal token counts (``helpers.megatron_ep.metadata_maps``). The split sizes, the per-(source,
local expert) counts and the local experts' row counts decide where every row goes, so they are
integers compared exactly: with each other and with closed forms from all ranks' maps. The
chunk-sort permutations (permutation 2 and its inverse) are compared the same way. Drop-and-pad has
static sizes: Megatron's preprocess gives every local expert ``capacity·N`` rows, and the moe-core
EP layer's dispatch of a padded map must give the local offsets ``arange(nle + 1)·N·capacity``.

Both world sizes run all their cases in one process group each (``run_ranks``).
"""
from typing import Dict, List, Tuple

import pytest
import torch
import torch.nn.functional as F

from helpers import megatron_ep
from helpers.dist import run_ranks
from helpers.tolerances import eps
from moe_core.ops import get_capacity

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

NLES = (1, 2, 4)  # local experts per rank of the metadata checks

Results = Tuple[int, List[Dict[str, dict]]]
Metadata = Tuple[int, List[Dict[int, dict]]]


@pytest.fixture(scope="module", params=[2, 4], ids=lambda n: f"ep{n}")
def ep_run(request) -> Tuple[int, List[dict]]:
    """(N, per rank the packed results) of every layer case and every metadata check at EP = N:
    one run_ranks call per world size."""
    world = request.param
    return world, run_ranks(megatron_ep.run_suite, world, CASES, NLES)


@pytest.fixture(scope="module")
def ep_results(ep_run) -> Results:
    """(N, per rank {case: result}) of the layer cases."""
    world, per_rank = ep_run
    return world, [{name: megatron_ep.unpack(packed) for name, packed in ranks["cases"].items()}
                   for ranks in per_rank]


@pytest.fixture(scope="module")
def ep_metadata(ep_run) -> Metadata:
    """(N, per rank {nle: result}) of the metadata checks."""
    world, per_rank = ep_run
    return world, [{nle: megatron_ep.unpack(packed) for nle, packed in ranks["metadata"].items()}
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


# ---- dispatcher metadata ----------------------------------------------------------------------

def closed_forms(maps: List[torch.Tensor], rank: int, nle: int) -> Dict[str, torch.Tensor]:
    """Rank ``rank``'s metadata from all ranks' maps: ``counts[s, e]`` rows of source s for
    expert e; rank r holds experts ``[r·nle, (r+1)·nle)``."""
    N = len(maps)
    counts = torch.stack([m.sum(0, dtype=torch.long) for m in maps])               # [N, E]
    per_local = counts[:, rank * nle:(rank + 1) * nle]                              # [N, nle]
    return dict(per_local=per_local, input_splits=counts[rank].view(N, nle).sum(1),
                output_splits=per_local.sum(1), tokens_per_expert=per_local.sum(0))


def assert_same(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Integer tensors: same dtype (int64), shape and values."""
    assert got.dtype == want.dtype == torch.long, f"{what}: dtypes {got.dtype}, {want.dtype}"
    assert torch.equal(got, want), f"{what}: {got.tolist()} != {want.tolist()}"


@pytest.mark.megatron
@pytest.mark.parametrize("nle", NLES, ids=lambda n: f"nle{n}")
def test_ep_metadata_matches_megatron(ep_metadata: Metadata, nle: int):
    """preprocess: moe-core's per_local / host splits, Megatron's input_splits, output_splits,
    num_global_tokens_per_local_expert and tokens_per_expert, and the closed forms, exactly."""
    world, ranks = ep_metadata
    for kind in ("topk", "sparse"):
        maps = [ranks[r][nle][kind]["map"] for r in range(world)]
        for rank in range(world):
            res, want = ranks[rank][nle][kind], closed_forms(maps, rank, nle)
            where = f"EP {world} nle {nle} {kind} rank {rank}"
            assert_same(res["ours_per_local"], want["per_local"], f"{where}: ours per_local")
            if nle > 1:  # Megatron sets it for permutation 2 only
                assert_same(res["meg_global_per_local"], want["per_local"],
                            f"{where}: Megatron num_global_tokens_per_local_expert")
            for name in ("input_splits", "output_splits"):
                assert_same(res[f"ours_{name}"], want[name], f"{where}: ours {name}")
                assert_same(res[f"meg_{name}"], want[name], f"{where}: Megatron {name}")
            assert_same(res["meg_tokens_per_expert"], want["tokens_per_expert"],
                        f"{where}: Megatron tokens_per_expert")
            assert_same(res["ours_per_local"].sum(0), want["tokens_per_expert"],
                        f"{where}: ours rows per local expert")
        # the edge cases the maps are built to contain
        received = [closed_forms(maps, r, nle)["output_splits"] for r in range(world)]
        assert not received[1].any(), f"EP {world} nle {nle} {kind}: rank 1 receives rows"
        if kind == "sparse":
            assert not maps[-1].any(), f"EP {world} nle {nle}: the last rank sends rows"
            rank0 = closed_forms(maps, 0, nle)["tokens_per_expert"]
            assert rank0.any(), f"EP {world} nle {nle}: rank 0 receives nothing"
            if nle > 1:
                assert rank0[-1] == 0, f"EP {world} nle {nle}: rank 0's last expert not empty"


@pytest.mark.megatron
@pytest.mark.parametrize("nle", NLES, ids=lambda n: f"nle{n}")
def test_ep_chunk_order_matches_megatron(ep_metadata: Metadata, nle: int):
    """chunk_order("sort" / "restore") equal Megatron's sort_input_by_local_experts /
    restore_output_by_local_experts and the closed forms: received chunk ``s·nle + l`` (source
    s, local expert l) goes to place ``l·N + s``, and back; sorting the chunk sizes gives them
    expert-major."""
    world, ranks = ep_metadata
    sort = torch.tensor([s * nle + l for l in range(nle) for s in range(world)])
    restore = torch.tensor([l * world + s for s in range(world) for l in range(nle)])
    assert torch.equal(sort[restore], torch.arange(world * nle))
    for rank in range(world):
        res, where = ranks[rank][nle]["chunk_order"], f"EP {world} nle {nle} rank {rank}"
        assert_same(res["ours_sort"], sort, f"{where}: ours sort")
        assert_same(res["meg_sort"], sort, f"{where}: Megatron sort")
        assert_same(res["ours_restore"], restore, f"{where}: ours restore")
        assert_same(res["meg_restore"], restore, f"{where}: Megatron restore")
        per_local = ranks[rank][nle]["topk"]["ours_per_local"]
        assert torch.equal(per_local.reshape(-1)[res["ours_sort"]], per_local.t().reshape(-1))


@pytest.mark.megatron
@pytest.mark.parametrize("nle", NLES, ids=lambda n: f"nle{n}")
def test_ep_drop_and_pad_sizes_match_megatron(ep_metadata: Metadata, nle: int):
    """Drop-and-pad (capacity <= T): Megatron's preprocess gives tokens_per_expert =
    capacity·N per local expert and capacity per (rank, expert) chunk; the moe-core EP layer's
    dispatch of the padded map gives the local offsets arange(nle + 1)·N·capacity over
    nle·N·capacity rows, whatever the routing (rank 1's experts hold padding only)."""
    world, ranks = ep_metadata
    E = world * nle
    cap = get_capacity(megatron_ep.PAD_TOKENS * megatron_ep.META_K, E, megatron_ep.PAD_CF)
    assert cap <= megatron_ep.PAD_TOKENS
    for rank in range(world):
        res, where = ranks[rank][nle]["drop_and_pad"], f"EP {world} nle {nle} rank {rank}"
        assert int(res["meg_capacity"]) == cap, where
        assert_same(res["column_counts"], torch.full((E,), cap), f"{where}: padded map")
        assert_same(res["meg_tokens_per_expert"], torch.full((nle,), cap * world),
                    f"{where}: Megatron tokens_per_expert")
        assert_same(res["meg_global_per_local"], torch.full((E,), cap),
                    f"{where}: Megatron num_global_tokens_per_local_expert")
        offsets = torch.arange(nle + 1) * world * cap
        assert_same(res["ours_offsets"], offsets, f"{where}: ours expert_offsets")
        assert_same(torch.cat([torch.zeros(1, dtype=torch.long),
                               res["meg_tokens_per_expert"].cumsum(0)]), offsets,
                    f"{where}: Megatron offsets")
        assert int(res["ours_rows"]) == nle * world * cap, f"{where}: rows"
