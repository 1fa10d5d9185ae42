"""Megatron-Core's own MoELayer at expert parallel N on the CPU over gloo, beside moe-core's EP
layer, for the multi-process parity tests (run inside ``helpers.dist.run_ranks``).

Patches, applied in the rank process only (no Megatron file is edited; the approach of
``megatron_layer`` and of the EP spec's CPU probe): ``megatron_layer``'s ``Router.gating`` without
``.cuda()`` and the eager ``_apply_expert_bias`` (applied when it is imported);
``torch.cuda.current_device`` returns ``"cpu"`` for the whole run (``tensor_parallel/mappings.py``
allocates the collectives' outputs there); the alltoall dispatcher's class-wide
``cuda_dtoh_stream`` is a placeholder (no ``torch.cuda.Stream()``), and its
``_maybe_dtoh_and_synchronize`` turns the split sizes into host lists, which is what the device
-> host copy produces on a GPU. Routing, dropping, both dispatchers, the SequentialMLP experts and
the combine are Megatron's code.

``run_cases(rank, world, cases)`` runs every case on one process group: the same global weights
(one rank-independent generator per case; Megatron and moe-core each load rank r's experts
``[r·E/N, (r+1)·E/N)``), per-rank inputs and output gradients, forward and backward through both
layers; it returns, per case, what the tests compare (tensors, serialized with ``torch.save``).

``run_metadata(rank, world, nles)`` collects the alltoall dispatchers' bookkeeping alone (no
forward): for every ``nle`` (E = N·nle) both dispatchers' ``preprocess`` outputs on the same
per-rank routing maps, their chunk-sort permutations, and the drop-and-pad sizes. ``run_suite`` runs both
on one process group, so a test module spawns one group per world size.
"""
import contextlib
import io
import warnings
from typing import Callable, Dict, Iterator, Optional

import torch

# importing megatron_layer applies its Router.gating / _apply_expert_bias patches
from . import megatron_layer

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_submodules
    from megatron.core.transformer.moe import moe_utils
    from megatron.core.transformer.moe import router as mrouter
    from megatron.core.transformer.moe import token_dispatcher as mdispatcher
    from megatron.core.transformer.moe.moe_layer import MoELayer as MegatronMoELayer
    from megatron.core.transformer.spec_utils import get_submodules
    from megatron.core.transformer.transformer_config import TransformerConfig

import moe_core
from moe_core import MoEConfig, MoELayer, load_megatron_state_dict
from moe_core.dispatcher import AlltoAllDispatcher
from moe_core.ops import AuxLossScale
from moe_core.parallel import megatron_groups

AUX_LOSS_SCALE = 2.0
Tensors = Dict[str, torch.Tensor]


# ---- the CPU patches of the EP path ---------------------------------------------------------

def _splits_to_host(self, point: str, tokens_per_expert: Optional[torch.Tensor] = None):
    """Megatron's ``_maybe_dtoh_and_synchronize`` on the CPU: at the copy point the split sizes
    become host values (a list, as its numpy arrays are used); the wait is a no-op."""
    if not self.drop_and_pad and point == self.cuda_dtoh_point:
        for name in ("input_splits", "output_splits", "output_splits_tp"):
            value = getattr(self, name)
            if torch.is_tensor(value):
                setattr(self, name, value.tolist())
        if torch.is_tensor(self.num_out_tokens):
            self.num_out_tokens = int(self.num_out_tokens)
    return tokens_per_expert


def patch_megatron_for_cpu_ep() -> None:
    torch.cuda.current_device = lambda: "cpu"
    mdispatcher.MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = object()
    mdispatcher.MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize = _splits_to_host


# ---- one case ---------------------------------------------------------------------------------

def _global_tensors(kw: dict, world: int, S: int, B: int, seed: int) -> Tensors:
    """Weights of all E experts and every rank's input / output gradient, from one generator
    (rank independent); inputs are random normals, so routing has no ties."""
    g = torch.Generator().manual_seed(seed)
    E, H, F = kw["num_moe_experts"], kw["hidden_size"], kw["moe_ffn_hidden_size"]
    F1 = 2 * F if kw.get("gated_linear_unit") else F
    dt = kw.get("params_dtype", torch.float32)
    return dict(router=torch.randn(E, H, generator=g) * 0.5,
                fc1=torch.randn(E, F1, H, generator=g) * H**-0.5,
                fc2=torch.randn(E, H, F, generator=g) * F**-0.5,
                x=torch.randn(world, S, B, H, generator=g).to(dt),
                grad=torch.randn(world, S, B, H, generator=g).to(dt))


def _build_megatron(kw: dict, glob: Tensors, rank: int, world: int) -> MegatronMoELayer:
    base = dict(num_layers=1, num_attention_heads=4, use_cpu_initialization=True,
                expert_model_parallel_size=world)
    base.update(kw)
    cfg = TransformerConfig(**base)
    sub = get_gpt_layer_local_submodules(num_experts=cfg.num_moe_experts, moe_grouped_gemm=False)
    meg = MegatronMoELayer(cfg, get_submodules(sub.mlp))
    meg.router.set_layer_number(1)
    nle = cfg.num_moe_experts // world
    assert list(meg.local_expert_indices) == list(range(rank * nle, (rank + 1) * nle))
    with torch.no_grad():
        meg.router.weight.copy_(glob["router"])
        for i, expert in enumerate(meg.experts.local_experts):
            expert.linear_fc1.weight.copy_(glob["fc1"][rank * nle + i])
            expert.linear_fc2.weight.copy_(glob["fc2"][rank * nle + i])
    return meg


@contextlib.contextmanager
def spying(owner: object, name: str, calls: list,
           replace: Optional[Callable] = None) -> Iterator[None]:
    """Within: ``owner.name`` records each call's map in and out into ``calls``; ``replace``, if
    given, computes the result instead of the original."""
    original = getattr(owner, name)

    def wrapper(probs, routing_map, *args, **kwargs):
        out = (replace or original)(probs, routing_map, *args, **kwargs)
        calls.append(dict(map_in=routing_map.detach().clone(), map_out=out[1].detach().clone()))
        return out

    setattr(owner, name, wrapper)
    try:
        yield
    finally:
        setattr(owner, name, original)


def _routing_of(router: torch.nn.Module) -> dict:
    seen = {}
    router.register_forward_hook(lambda m, i, o: seen.update(probs=o[0].detach(), map=o[1]))
    return seen


def _step(layer: torch.nn.Module, x: torch.Tensor, grad: torch.Tensor, megatron: bool) -> Tensors:
    """Forward and backward of one layer on this rank's tokens; what the tests compare."""
    seen = _routing_of(layer.router)
    x = x.clone().requires_grad_()
    if megatron:
        megatron_layer.set_loss_scale(AUX_LOSS_SCALE)
        out, bias = layer(x)
        assert bias is None
    else:
        with AuxLossScale(AUX_LOSS_SCALE):
            out = layer(x)
    out.backward(grad)
    if megatron:
        experts = layer.experts.local_experts
        w1 = torch.stack([e.linear_fc1.weight.grad for e in experts])
        w2 = torch.stack([e.linear_fc2.weight.grad for e in experts])
    else:
        w1, w2 = layer.experts.weight1.grad, layer.experts.weight2.grad
    return dict(map=seen["map"].clone(), probs=seen["probs"].clone(), out=out.detach(),
                dx=x.grad, router=layer.router.weight.grad, w1=w1, w2=w2)


def run_case(rank: int, world: int, kw: dict, seed: int) -> dict:
    """Both layers on one case. With the "position" drop policy and dropping, moe-core keeps the
    first routed tokens of an over-full expert and Megatron's CPU code another subset (the
    documented difference, ``moe_core/ops/token_dropping.py``): the routing is recorded from a
    first forward of moe-core's own router, then the layers are compared with moe-core's router
    handed Megatron's kept set (``final_probs = probs * kept``, Megatron's formula), so that
    dispatch, experts, combine and every gradient are still compared with Megatron's."""
    kw = dict(kw)
    S, B = kw.pop("seq_length"), kw.pop("micro_batch_size")  # not TransformerConfig fields here
    glob = _global_tensors(kw, world, S, B, seed)
    torch.manual_seed(seed)
    meg = _build_megatron(kw, glob, rank, world)
    ours = MoELayer(MoEConfig.from_megatron(meg.config), **megatron_groups())
    load_megatron_state_dict(ours, meg.state_dict())
    meg.train(), ours.train()
    x, grad = glob["x"][rank], glob["grad"][rank]
    position = (kw.get("moe_expert_capacity_factor") is not None
                and kw.get("moe_token_drop_policy") == "position")

    meg_calls, our_calls = [], []
    with spying(mrouter, "apply_router_token_dropping", meg_calls):
        result = dict(megatron=_step(meg, x, grad, megatron=True))
    extra, handover = {}, contextlib.nullcontext()
    if position:
        with spying(moe_core.ops, "apply_router_token_dropping", our_calls), torch.no_grad():
            ours.router(x)  # moe-core's own choice
        kept = meg_calls[0]["map_out"]
        capacity = moe_utils.get_capacity(x.shape[0] * x.shape[1] * kw["moe_router_topk"],
                                          kw["num_moe_experts"], kw["moe_expert_capacity_factor"])
        extra = dict(megatron_routed=meg_calls[0]["map_in"], ours_routed=our_calls[0]["map_in"],
                     ours_kept=our_calls[0]["map_out"], capacity=torch.tensor(capacity))
        handover = spying(moe_core.ops, "apply_router_token_dropping", [],
                          replace=lambda probs, routing_map, *a, **k: (probs * kept, kept))
    with handover:
        result["ours"] = _step(ours, x, grad, megatron=False)
    result["extra"] = extra
    return result


def _pack(value: dict) -> bytes:
    buf = io.BytesIO()
    torch.save(value, buf)
    return buf.getvalue()


def unpack(data: bytes) -> dict:
    return torch.load(io.BytesIO(data), weights_only=True)


@contextlib.contextmanager
def megatron_parallel(world: int) -> Iterator[None]:
    """Megatron's parallel state at EP = ``world`` (TP = ETP = PP = 1) with the CPU patches."""
    patch_megatron_for_cpu_ep()
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(1, 1, expert_model_parallel_size=world)
    try:
        yield
    finally:
        ps.destroy_model_parallel()


def _run_cases(rank: int, world: int, cases: Dict[str, dict], seed: int) -> Dict[str, bytes]:
    return {name: _pack(run_case(rank, world, kw, seed + i))
            for i, (name, kw) in enumerate(cases.items())}


def run_cases(rank: int, world: int, cases: Dict[str, dict], seed: int = 0) -> Dict[str, bytes]:
    """Every case at EP = ``world`` (ETP = 1) on this rank; per case the packed result of
    ``run_case`` (unpack with ``unpack``)."""
    with megatron_parallel(world):
        return _run_cases(rank, world, cases, seed)


# ---- dispatcher metadata ----------------------------------------------------------------------

META_K = 2                 # experts per token where the maps are top-k (fewer if fewer are allowed)
META_TOKENS = 6            # rank r has META_TOKENS + r tokens (unequal counts, dropless)
PAD_TOKENS, PAD_CF = 8, 1.0  # drop-and-pad: equal counts, capacity ceil(T·K/E·cf) <= T


def metadata_maps(world: int, nle: int, seed: int) -> Dict[str, list]:
    """Per kind, every rank's routing map ``[T_r, E]`` (bool), from one rank-independent
    generator, so each rank builds all of them and keeps its own. Rank 1's experts get no token
    from any rank (rank 1 receives nothing) in both kinds:

    * ``topk``: each token's top ``k`` experts among the allowed ones, by random scores, with
      ``k = min(K, E - nle - 1)`` (at least 1), so that not every token takes every allowed one.
    * ``sparse``: independent Bernoulli(0.3) entries; besides rank 1's experts, rank 0's last
      local expert is empty (when rank 0 has another one), and the last rank sends nothing.
    """
    g = torch.Generator().manual_seed(seed)
    E = world * nle
    tokens = [META_TOKENS + r for r in range(world)]
    banned = torch.zeros(E, dtype=torch.bool)
    banned[nle:2 * nle] = True
    k = max(1, min(META_K, E - nle - 1))
    topk, sparse = [], []
    for T in tokens:
        scores = torch.randn(T, E, generator=g).masked_fill(banned, float("-inf"))
        topk.append(torch.zeros(T, E, dtype=torch.bool).scatter(1, scores.topk(k, 1).indices, True))
    sparse_banned = banned.clone()
    if nle > 1:
        sparse_banned[nle - 1] = True
    for r, T in enumerate(tokens):
        m = (torch.rand(T, E, generator=g) < 0.3) & ~sparse_banned
        sparse.append(m if r < world - 1 else torch.zeros_like(m))
    return dict(topk=topk, sparse=sparse)


def _megatron_a2a_dispatcher(rank: int, world: int, nle: int, **kw
                             ) -> "mdispatcher.MoEAlltoAllTokenDispatcher":
    """Megatron's alltoall dispatcher as its MoELayer builds it (local experts
    ``[rank·nle, (rank+1)·nle)``, the default process-group collection)."""
    cfg = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=4,
                            use_cpu_initialization=True, add_bias_linear=False,
                            num_moe_experts=world * nle, moe_ffn_hidden_size=8,
                            moe_router_topk=META_K, moe_token_dispatcher_type="alltoall",
                            expert_model_parallel_size=world, **kw)
    return mdispatcher.MoEAlltoAllTokenDispatcher(
        nle, [rank * nle + i for i in range(nle)], cfg,
        pg_collection=moe_utils.get_default_pg_collection())


def _metadata_for(rank: int, world: int, nle: int, seed: int) -> dict:
    """One ``nle``: both dispatchers' metadata per map kind, their chunk orders, and the
    drop-and-pad sizes (moe-core's EP layer's dispatch against Megatron's preprocess)."""
    E = world * nle
    group = ps.get_expert_model_parallel_group()
    ours, meg = AlltoAllDispatcher(group, E), _megatron_a2a_dispatcher(rank, world, nle)
    out = {}
    for kind, maps in metadata_maps(world, nle, seed).items():
        routing_map = maps[rank]
        per_local, host = ours.preprocess(routing_map)
        splits = host.get()
        tokens_per_expert = meg.preprocess(routing_map)
        res = dict(map=routing_map, ours_per_local=per_local,
                   ours_input_splits=torch.tensor(splits[:world]),
                   ours_output_splits=torch.tensor(splits[world:]),
                   meg_input_splits=meg.input_splits, meg_output_splits=meg.output_splits,
                   meg_tokens_per_expert=tokens_per_expert)
        if nle > 1:  # Megatron keeps it for permutation 2 only
            res["meg_global_per_local"] = meg.num_global_tokens_per_local_expert.clone()
        out[kind] = res
    cpu = torch.device("cpu")
    out["chunk_order"] = dict(ours_sort=ours.chunk_order("sort", cpu),
                              ours_restore=ours.chunk_order("restore", cpu),
                              meg_sort=meg.sort_input_by_local_experts,
                              meg_restore=meg.restore_output_by_local_experts)

    # drop-and-pad: the EP layer's dispatch of a padded map against Megatron's static sizes
    meg_pad = _megatron_a2a_dispatcher(rank, world, nle, moe_expert_capacity_factor=PAD_CF,
                                       moe_pad_expert_input_to_capacity=True)
    layer = MoELayer(MoEConfig.from_megatron(meg_pad.config), **megatron_groups())
    g = torch.Generator().manual_seed(seed + 1)
    scores = torch.randn(world, PAD_TOKENS, E, generator=g)[rank]
    scores[:, nle:2 * nle] = float("-inf")  # rank 1's experts are only ever padding
    top = scores.topk(META_K, 1).indices
    routed = torch.zeros(PAD_TOKENS, E, dtype=torch.bool).scatter(1, top, True)
    probs = torch.softmax(scores, 1) * routed
    probs, padded = moe_core.ops.apply_router_token_dropping(
        probs, routed, META_K, PAD_CF, drop_policy="probs", pad_to_capacity=True)
    x = torch.randn(world, PAD_TOKENS, 8, generator=g)[rank]
    with torch.no_grad():
        rows, _, offsets, _ = layer.dispatch(x, probs, padded)
    out["drop_and_pad"] = dict(
        ours_offsets=offsets, ours_rows=torch.tensor(rows.shape[0]),
        meg_tokens_per_expert=meg_pad.preprocess(padded),
        meg_capacity=torch.tensor(meg_pad.capacity),
        meg_global_per_local=meg_pad.num_global_tokens_per_local_expert.clone(),
        column_counts=padded.sum(0))
    return out


def run_metadata(rank: int, world: int, nles, seed: int = 1000) -> Dict[int, bytes]:
    """Per ``nle``, the packed result of the metadata comparison (within ``megatron_parallel``)."""
    return {nle: _pack(_metadata_for(rank, world, nle, seed + nle)) for nle in nles}


def run_suite(rank: int, world: int, cases: Dict[str, dict], nles, seed: int = 0) -> dict:
    """``run_cases`` and ``run_metadata`` on one process group: ``dict(cases=..., metadata=...)``."""
    with megatron_parallel(world):
        return dict(cases=_run_cases(rank, world, cases, seed),
                    metadata=run_metadata(rank, world, nles))
