"""moe_core.torchtitan: torchtitan's MoE modules swapped for moe-core's layer.

Parity: for each routing option of torchtitan's ``TokenChoiceTopKRouter`` (sigmoid and softmax
scores, top-k renormalisation or not, a route scale, node-limited groups, the expert bias of its
auxiliary-loss-free balancing, top-1, shared experts), torchtitan's own module and the swapped
copy run the same input and output gradient; the output and every gradient (input, router gate,
w1 / w2 / w3 of the experts, the shared experts' w1 / w2 / w3) are compared with an fp64
reference of torchtitan's math (``helpers.torchtitan_moe.reference``).

Tolerances, at each tensor's scale (its largest magnitude in the reference): moe-core runs in
fp32, its error at most 64 fp32 roundings (32 eps: the chains of dot products over D, F and the
tokens that fp32 sums in other orders, as tests/ep/test_megatron_parity.py derives); torchtitan
runs its experts' GEMMs in bf16 (inputs, weights and each GEMM's output rounded to bf16, the
SwiGLU product too: six roundings on the way to the output, more through the backward), held
to 16 bf16 roundings. The second bound shows the reference is torchtitan's math; the first is
four orders of magnitude tighter than a wrong expert, score or weight half would need.
"""
import copy
import types

import pytest
import torch
from torch import nn

pytest.importorskip("torchtitan", reason="torchtitan is not importable here: `make test` installs "
                    "torchtitan==0.3.0 (Makefile TORCHTITAN_VERSION, its imports pinned in "
                    "requirements-dev.txt)")

from helpers import torchtitan_moe as ttm  # noqa: E402
from helpers.dist import run_ranks  # noqa: E402
from helpers.tolerances import eps  # noqa: E402
from moe_core.torchtitan import (MoECoreTorchtitanMoE,  # noqa: E402
                                 UnsupportedTorchtitanMoEError, replace_moe,
                                 torchtitan_state_dict)

CASES = {
    "sigmoid_norm_bias": dict(),
    "sigmoid_plain": dict(route_norm=False, load_balance_coeff=None),
    "softmax_scale_bias": dict(score_func="softmax", route_norm=False, route_scale=2.5),
    "softmax_top1": dict(score_func="softmax", top_k=1, route_norm=False,
                         load_balance_coeff=None),
    "groups_shared": dict(num_expert_groups=4, num_limited_groups=2, shared=True),
}


def swapped(module: nn.Module) -> nn.Module:
    """A model holding a copy of ``module`` as ``moe``, swapped."""
    holder = nn.Module()
    holder.moe = copy.deepcopy(module)
    assert replace_moe(holder) == 1
    assert isinstance(holder.moe, MoECoreTorchtitanMoE)
    return holder


def within(ours: torch.Tensor, ref: torch.Tensor, roundings: int, dtype, what: str) -> None:
    tol = roundings * eps(dtype) / 2 * ref.abs().max().item()
    err = (ours.detach().double() - ref.detach().double()).abs().max().item()
    assert err <= tol, f"{what}: max error {err:.3e} > {tol:.3e}"


def _grads_tt(module: nn.Module) -> dict:
    return {k: p.grad for k, p in module.named_parameters()}


def _grads_ours(holder: nn.Module) -> dict:
    """The swapped module's gradients in torchtitan's names and layout."""
    m = holder.moe
    F_ = m.config.moe_ffn_hidden_size
    w1 = m.experts.weight1.grad
    pre = "routed_experts.inner_experts."
    out = {"router.gate.weight": m.router.weight.grad, pre + "w1_EFD": w1[:, :F_],
           pre + "w3_EFD": w1[:, F_:], pre + "w2_EDF": m.experts.weight2.grad}
    if m.shared_experts is not None:
        fc1 = m.shared_experts.linear_fc1.weight.grad
        S = fc1.shape[0] // 2
        out.update({"shared_experts.w1.weight": fc1[:S], "shared_experts.w3.weight": fc1[S:],
                    "shared_experts.w2.weight": m.shared_experts.linear_fc2.weight.grad})
    return out


@pytest.mark.parametrize("case", sorted(CASES))
def test_forward_and_every_gradient_match_torchtitan(case):
    tt = ttm.build(**CASES[case])
    ours = swapped(tt)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 6, ttm.D, generator=g)
    dy = torch.randn(2, 6, ttm.D, generator=g)
    w64 = ttm.weights64(tt)
    x64 = x.double().requires_grad_()
    ref = ttm.reference(tt, w64, x64)
    ref.backward(dy.double())
    results = {}
    for name, module, grads in (("torchtitan", tt, _grads_tt), ("moe-core", ours, _grads_ours)):
        xi = x.clone().requires_grad_()
        y = module(xi) if name == "torchtitan" else module.moe(xi)
        y.backward(dy)
        results[name] = (y, xi.grad, grads(module))
    for name, (dtype, roundings) in {"torchtitan": (torch.bfloat16, 16),
                                     "moe-core": (torch.float32, 64)}.items():
        y, dx, grads = results[name]
        within(y, ref, roundings, dtype, f"{case} {name} output")
        within(dx, x64.grad, roundings, dtype, f"{case} {name} input gradient")
        expected = {k for k, v in w64.items() if v.requires_grad}
        assert set(grads) == expected, f"{name}: {sorted(grads)} vs {sorted(expected)}"
        for k in expected:
            within(grads[k], w64[k].grad, roundings, dtype, f"{case} {name} {k} gradient")


@pytest.mark.parametrize("case", sorted(CASES))
def test_weights_map_both_ways(case):
    tt = ttm.build(**CASES[case])
    holder = swapped(tt)
    theirs = {f"moe.{k}": v for k, v in tt.state_dict().items()}
    back = torchtitan_state_dict(holder)
    assert sorted(back) == sorted(theirs)
    assert all(torch.equal(back[k], theirs[k]) for k in theirs)
    other = swapped(ttm.build(**CASES[case], seed=5))
    assert not torch.equal(other.moe.router.weight, holder.moe.router.weight)
    other.load_state_dict(theirs, strict=True)  # a torchtitan checkpoint of the original model
    again = torchtitan_state_dict(other)
    assert all(torch.equal(again[k], theirs[k]) for k in theirs)


def test_torchtitans_load_balancing_hook_updates_the_swapped_bias():
    """torchtitan's optimizer pre-step hook (its auxiliary-loss-free balancing) reads the token
    counts of the swapped modules and updates their expert bias as it updates its own."""
    from torchtitan.components.optimizer import register_moe_load_balancing_hook

    parallel_dims = types.SimpleNamespace(get_optional_mesh=lambda name: None,
                                          ep_enabled=False, tp=1)
    biases = []
    for swap in (False, True):
        tt = ttm.build()
        block = nn.Module()
        block.moe_enabled, block.moe = True, tt
        model = nn.Module()
        model.layers = nn.ModuleDict({"0": block})
        if swap:
            assert replace_moe(model) == 1
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        register_moe_load_balancing_hook(opt, [model], parallel_dims)
        model.train()
        x = torch.randn(2, 6, ttm.D, generator=torch.Generator().manual_seed(3))
        block.moe(x).sum().backward()
        assert block.moe.tokens_per_expert_E.sum() == 2 * 6 * ttm.K
        opt.step()
        assert block.moe.tokens_per_expert_E.sum() == 0
        biases.append(block.moe.expert_bias_E.clone())
    assert not torch.equal(biases[0], ttm.build().expert_bias_E)
    assert torch.equal(biases[1], biases[0])


def test_refusals_name_what_is_unsupported():
    from torchtitan.models.common.moe import MoE

    with pytest.raises(ValueError, match="no torchtitan MoE"):
        replace_moe(nn.Sequential(nn.Linear(2, 2)))

    class OtherMoE(MoE):
        pass

    def model_with(module):
        m = nn.Module()
        m.first, m.second = ttm.build(), module
        return m

    odd = ttm.build()
    odd.__class__ = OtherMoE
    m = model_with(odd)
    with pytest.raises(UnsupportedTorchtitanMoEError, match="second: MoE class OtherMoE"):
        replace_moe(m)
    assert type(m.first) is MoE  # nothing swapped when one module is refused
    forced = ttm.build()
    forced.router._debug_force_load_balance = True
    with pytest.raises(UnsupportedTorchtitanMoEError, match="_debug_force_load_balance"):
        replace_moe(model_with(forced))
    with pytest.raises(UnsupportedTorchtitanMoEError, match="route_norm=True with top_k=1"):
        replace_moe(model_with(ttm.build(top_k=1)))
    biased = ttm.build()
    biased.router.gate.bias = nn.Parameter(torch.zeros(ttm.E))
    with pytest.raises(UnsupportedTorchtitanMoEError, match="gate with a bias"):
        replace_moe(model_with(biased))


# ---- torchtitan's parallelism: FSDP2 and the EP mesh dimension, on gloo --------------------------

class TinyBlock(nn.Module):
    """A MoE block as torchtitan's decoders mark them (``moe_enabled``, ``moe``)."""

    def __init__(self, moe: nn.Module):
        super().__init__()
        self.moe_enabled, self.moe = True, moe

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.moe(h)


class TinyDecoder(nn.Module):
    """The attributes torchtitan's ``apply_fsdp_to_decoder`` reads (tok_embeddings, layers of
    MoE blocks, norm, lm_head): blocks ``h + moe(h)`` (torchtitan's attention kernels have no CPU
    backward)."""

    def __init__(self, moe_factory, vocab: int = 32):
        super().__init__()
        self.enable_weight_tying = False
        self.tok_embeddings = nn.Embedding(vocab, ttm.D)
        self.layers = nn.ModuleDict()
        for i in range(2):
            self.layers[str(i)] = TinyBlock(moe_factory(i))
        self.norm = nn.RMSNorm(ttm.D)
        self.lm_head = nn.Linear(ttm.D, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for block in self.layers.values():
            h = block(h)
        return self.lm_head(self.norm(h))


def _tiny_model(swap_ep_mesh=None, ep_size: int = 1) -> nn.Module:
    torch.manual_seed(0)
    model = TinyDecoder(lambda i: ttm.build(seed=10 + i, shared=i == 1))
    replace_moe(model, ep_mesh=swap_ep_mesh)
    return model


def _train(model: nn.Module, batches, global_tokens: int, steps: int = 3) -> list:
    """SGD on the summed token loss over ``global_tokens`` (torchtitan's scaling: FSDP's own
    gradient division is off), the loss summed over ranks."""
    import torch.distributed as dist

    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for tokens in batches[:steps]:
        opt.zero_grad()
        logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(),
                                                 tokens[:, 1:].flatten(), reduction="sum")
        (loss / global_tokens).backward()
        opt.step()
        total = loss.detach().clone()
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(total)
        losses.append(total / global_tokens)
    return [float(v) for v in losses]


def _batches(world: int, seed: int = 4):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 32, (2 * world, 9), generator=g) for _ in range(3)]


def _fsdp_rank(rank: int, world: int, ep: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torchtitan.distributed.fsdp import apply_fsdp_to_decoder

    if ep == 1:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
        model = _tiny_model()
        apply_fsdp_to_decoder(model, mesh, param_dtype=torch.float32,
                              reduce_dtype=torch.float32, pp_enabled=False)
    else:  # EP over the world, experts not sharded further (efsdp of one)
        mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("efsdp", "ep"))
        dp = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
        model = _tiny_model(swap_ep_mesh=mesh["ep"])
        apply_fsdp_to_decoder(model, dp, param_dtype=torch.float32,
                              reduce_dtype=torch.float32, pp_enabled=False, ep_degree=ep,
                              edp_mesh=mesh["efsdp"])
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():  # gloo has no PREMUL_SUM; the divide factor is 1: a sum
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)
    batches = [b[2 * rank:2 * rank + 2] for b in _batches(world)]
    return _train(model, batches, global_tokens=2 * world * 8)


@pytest.mark.parametrize("ep", [1, 2], ids=["fsdp2", "fsdp2_ep2"])
def test_torchtitans_fsdp_and_ep_mesh_train_as_one_process(ep):
    """torchtitan's ``apply_fsdp_to_decoder`` over two gloo ranks (and with EP 2: the swap on
    its EP mesh dimension, the experts on its expert-FSDP mesh) trains the swapped model to the
    losses of one process on the whole batch, within 64 fp32 roundings per step."""
    world = 2
    one = _train(_tiny_model(), _batches(world), global_tokens=2 * world * 8)
    for rank_losses in run_ranks(_fsdp_rank, world, ep):
        for step, (a, b) in enumerate(zip(rank_losses, one)):
            assert abs(a - b) <= 32 * eps(torch.float32) * abs(b), (step, rank_losses, one)


def test_replaces_every_moe_of_a_torchtitan_qwen3_model():
    """A tiny torchtitan Qwen3 MoE model: both MoE layers replaced, the logits those of
    torchtitan's model (its experts in bf16: 16 bf16 roundings at the logits' scale; the forward
    only, as torchtitan's CPU attention has no backward)."""
    from helpers.torchtitan_moe import qwen3

    model = qwen3()
    ours = copy.deepcopy(model)
    assert replace_moe(ours) == 2
    assert all(isinstance(b.moe, MoECoreTorchtitanMoE) for b in ours.layers.values())
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(2))
    pos = torch.arange(16).expand(2, 16)
    with torch.no_grad():
        ref = model(tokens, pos, model.get_attention_masks(pos))
        out = ours(tokens, pos, ours.get_attention_masks(pos))
    within(out, ref, 16, torch.bfloat16, "logits")
    with pytest.raises(ValueError, match="no torchtitan MoE"):
        replace_moe(ours)  # swapped already: nothing left


def test_example_trains_and_matches_torchtitans_own_moe(tmp_path):
    """examples/torchtitan_moe.py: the swapped run's loss falls and tracks the run on
    torchtitan's own MoE (which computes its experts in bf16: within a bf16 rounding's share of
    the loss after ten steps), and the saved state dict has torchtitan's keys and shapes."""
    import os
    import re
    import subprocess
    import sys

    from helpers.scripts import ROOT

    path = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=path)
    runs = {}
    for route in ("swap", "no-swap"):
        save = str(tmp_path / f"{route}.pt")
        args = ["--steps", "21", "--save", save] + (["--no-swap"] if route == "no-swap" else [])
        res = subprocess.run([sys.executable, "examples/torchtitan_moe.py", *args], cwd=ROOT,
                             env=env, capture_output=True, text=True, timeout=300)
        assert res.returncode == 0, res.stderr[-3000:]
        losses = [float(v) for v in re.findall(r"loss ([\d.]+)", res.stdout)]
        runs[route] = (losses, torch.load(save, weights_only=True))
    (ours, ours_sd), (theirs, theirs_sd) = runs["swap"], runs["no-swap"]
    assert ours[-1] < 0.25 * ours[0], ours
    assert abs(ours[0] - theirs[0]) <= 1e-3  # the same initial weights, printed to 4 places
    assert all(abs(a - b) <= 4 * eps(torch.bfloat16) * b for a, b in zip(ours, theirs)), \
        (ours, theirs)
    assert sorted(ours_sd) == sorted(theirs_sd)
    assert all(ours_sd[k].shape == theirs_sd[k].shape for k in theirs_sd)


def _parallelize_rank(rank: int, world: int):
    """torchtitan's own ``parallelize_qwen3`` on a tiny swapped Qwen3 model, FSDP over the two
    ranks (``ep=1``) and FSDP + EP 2 (the swap on its EP mesh): the logits of this rank's tokens
    against the same swapped model unparallelised. ``ParallelDims`` builds its mesh on
    ``torchtitan.tools.utils.device_type``, CUDA even without a GPU: set to the CPU here."""
    import torchtitan.distributed.parallel_dims as titan_parallel_dims
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.models.qwen3.parallelize import parallelize_qwen3

    from helpers.torchtitan_moe import qwen3

    titan_parallel_dims.device_type = "cpu"
    out = {}
    for ep in (1, 2):
        dims = ParallelDims(dp_replicate=1, dp_shard=world, cp=1, tp=1, pp=1, ep=ep,
                            world_size=world, spmd_backend="partial_dtensor")
        dims.build_mesh()
        model = qwen3()
        single = copy.deepcopy(model)
        replace_moe(single)
        replace_moe(model, ep_mesh=dims.get_mesh("ep") if ep > 1 else None)
        parallelize_qwen3(model, parallel_dims=dims,
                          training=TrainingConfig(mixed_precision_param="float32"),
                          parallelism=ParallelismConfig(spmd_backend="partial_dtensor",
                                                        data_parallel_shard_degree=world,
                                                        expert_parallel_degree=ep),
                          compile_config=CompileConfig(), ac_config=None, dump_folder="")
        tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(rank))
        pos = torch.arange(16).expand(2, 16)
        with torch.no_grad():
            got = model(tokens, pos, model.get_attention_masks(pos))
            ref = single(tokens, pos, single.get_attention_masks(pos))
        sharded = type(model.layers["0"].moe.experts.weight1).__name__
        out[ep] = (torch.equal(got, ref), sharded, model.layers["0"].moe.experts.num_local_experts)
    return out


def test_torchtitans_parallelize_function_runs_the_swapped_model():
    """parallelize_qwen3 (torchtitan's, partial-DTensor backend) over two gloo ranks: FSDP2
    shards the swapped experts (DTensors), EP 2 leaves each rank its 4 of 8 experts, and the
    logits equal the unparallelised swapped model's bit for bit (forward only: torchtitan's CPU
    attention has no backward)."""
    for rank, res in enumerate(run_ranks(_parallelize_rank, 2)):
        assert res[1] == (True, "DTensor", 8), (rank, res)
        assert res[2] == (True, "DTensor", 4), (rank, res)
