"""moe_core.megatron against Megatron-Core's own MoE layer, inside Megatron's GPTModel.

A tiny GPTModel (two layers, every MLP a MoE) is built twice from the same weights: with Megatron's
local layer spec (its MoELayer, SequentialMLP experts) and with ``gpt_layer_spec`` (moe-core's
layer, loaded from Megatron's state dict), then trained a few SGD steps on the same batches, on
the CPU over gloo, at world 1 and at EP 2 (each rank its own batches, no data-parallel reduction
on either side, so each rank's model follows the same recursion in both). Compared: every step's
loss, and what Megatron's MoE metrics tracker recorded (the aux / z losses per layer).

Tolerance of the losses: 64 fp32 roundings (32 eps) of the loss, per step. Both sides run the
same attention, embedding and output layer; the MoE layers agree to a few fp32 roundings
(tests/ep/test_megatron_parity.py's bound for each value they produce), and a few SGD steps
carry those differences into the weights at the learning rate's scale; a wrong expert, prob,
aux-loss gradient or scale moves the loss by orders of magnitude more. The tracker's values are
losses over the same routing: the same bound.

Checkpoints: ``sharded_state_dict`` gives Megatron's sharded keys, shapes, offsets and replica
ids, compared entry by entry with Megatron's (world 1 and EP 2, GLU and plain experts, biases,
shared expert with gate, expert bias); a distributed checkpoint of Megatron's GPTModel loads into
ours and ours into Megatron's, every weight equal after the round trip.
"""
import copy
import dataclasses
import warnings

import pytest
import torch
import torch.nn.functional as F

from helpers import megatron_gpt, megatron_layer
from helpers.dist import run_ranks
from helpers.tolerances import eps

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from megatron.core import dist_checkpointing
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.dist_checkpointing.mapping import (ShardedObject, ShardedTensor,
                                                          ShardedTensorFactory)
    from megatron.core.transformer.moe import moe_utils
    from megatron.core.transformer.transformer_config import TransformerConfig

from moe_core.megatron import MoECoreMegatronLayer, gpt_layer_spec, moe_module_spec
from moe_core.ops import AuxLossScale

pytestmark = pytest.mark.megatron

CASES = {
    "swiglu_softmax_aux": dict(),
    "sigmoid_bias_shared_z_seq": dict(
        moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
        moe_shared_expert_intermediate_size=8, moe_shared_expert_gate=True,
        moe_z_loss_coeff=1e-3, moe_router_load_balancing_type="seq_aux_loss"),
    "gelu_global_aux": dict(
        gated_linear_unit=False, activation_func=F.gelu,
        moe_router_load_balancing_type="global_aux_loss"),
}
# Megatron's expert MLP adds its bias in place on a custom Function's output view, which autograd
# refuses on the CPU: expert biases are compared in the checkpoint layout and round trip only
CHECKPOINT_CASES = dict(CASES, gelu_bias=dict(gated_linear_unit=False, activation_func=F.gelu,
                                              add_bias_linear=True),
                        swiglu_bias=dict(add_bias_linear=True))
STEPS = 4


@pytest.fixture(scope="module", autouse=True)
def world():
    megatron_layer.init_world_of_one()
    megatron_gpt.patch_megatron_for_cpu()


def assert_losses_match(ours: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    tol = 32 * eps(torch.float32) * ref.abs().clamp_min(1.0)
    diff = (ours - ref).abs()
    assert (diff <= tol).all(), f"{what}: ours {ours.tolist()} vs Megatron {ref.tolist()}"


def compare_runs(meg_run, our_run, what: str) -> None:
    (meg_losses, meg_tracked, meg_bias), (our_losses, our_tracked, our_bias) = meg_run, our_run
    assert_losses_match(our_losses, meg_losses, f"{what} losses")
    # Megatron's finalize_model_grads updated both models' expert bias (steps of +-rate)
    assert len(our_bias) == len(meg_bias)
    for ours, ref in zip(our_bias, meg_bias):
        assert ref.abs().max() > 0 and torch.equal(ours, ref), f"{what}: {ours} vs {ref}"
    for step, (m, o) in enumerate(zip(meg_tracked, our_tracked)):
        assert sorted(o) == sorted(m), f"{what} step {step}: tracked {sorted(o)} vs {sorted(m)}"
        assert m, f"{what}: Megatron tracked no aux loss"
        for name in m:
            assert_losses_match(o[name], m[name], f"{what} step {step} {name}")


@pytest.mark.parametrize("case", sorted(CASES))
def test_gpt_training_matches_megatron(case):
    cfg = megatron_gpt.config(**CASES[case])
    meg, ours = megatron_gpt.models(cfg)
    assert all(isinstance(layer.mlp, MoECoreMegatronLayer) for layer in ours.decoder.layers)
    data = megatron_gpt.batches(STEPS, seed=1)
    compare_runs(megatron_gpt.train(meg, data), megatron_gpt.train(ours, data), case)


def _ep_rank(rank: int, world: int, dispatcher: str, ckpt_dir: str):
    from helpers import megatron_ep

    megatron_gpt.patch_megatron_for_cpu()
    with megatron_ep.megatron_parallel(world):
        cfg = megatron_gpt.config(expert_model_parallel_size=world,
                                  moe_token_dispatcher_type=dispatcher)
        meg, ours = megatron_gpt.models(cfg)
        layout = (_describe(meg.sharded_state_dict()), _describe(ours.sharded_state_dict()))
        data = megatron_gpt.batches(STEPS, seed=10 + rank)
        runs = (megatron_gpt.train(meg, data), megatron_gpt.train(ours, data))
        round_trip = _round_trip(meg, ours, cfg, ckpt_dir)
    return dict(runs=runs, layout=layout, round_trip=round_trip)


@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
def test_gpt_training_matches_megatron_ep2(dispatcher, tmp_path):
    results = run_ranks(_ep_rank, 2, dispatcher, str(tmp_path))
    for rank, res in enumerate(results):
        compare_runs(*res["runs"], f"EP 2 {dispatcher} rank {rank}")
        meg_layout, our_layout = res["layout"]
        assert our_layout == meg_layout, f"rank {rank}: sharded layouts differ"
        for what, mismatches in res["round_trip"].items():
            assert not mismatches, f"rank {rank} {what}: {mismatches}"


# ---- checkpoints --------------------------------------------------------------------------------

def _describe(sharded: dict) -> dict:
    """What a distributed checkpoint stores of each entry (factories built)."""
    out = {}
    for name, v in sharded.items():
        if isinstance(v, ShardedTensorFactory):
            out[name] = ("factory", v.key, v.replica_id, [
                (b.key, b.global_shape, b.global_offset, b.local_shape, b.replica_id,
                 b.axis_fragmentations, b.dtype) for b in v.build()])
        elif isinstance(v, ShardedObject):
            out[name] = ("object", v.key, v.global_shape, v.global_offset, v.replica_id)
        else:
            assert isinstance(v, ShardedTensor), f"{name}: {type(v).__name__}"
            out[name] = ("tensor", v.key, v.global_shape, v.global_offset, v.local_shape,
                         v.replica_id, v.prepend_axis_num, v.axis_fragmentations, v.dtype)
    return out


def _moe_weights(model) -> dict:
    """Every MoE weight of a GPTModel in Megatron's per-expert names (ours unstacked)."""
    out = {}
    for key, value in model.state_dict().items():
        if ".mlp." not in key or "_extra_state" in key or value is None:
            continue
        head, name = key.split(".mlp.")
        if name.startswith("experts.weight") or name.startswith("experts.bias"):
            kind, fc = ("weight", name[-1]) if "weight" in name else ("bias", name[-1])
            for i, part in enumerate(value):
                out[f"{head}.mlp.experts.local_experts.{i}.linear_fc{fc}.{kind}"] = part
        elif name in ("router.local_tokens_per_expert",) or name.startswith(
                "router.global_aux_buffer"):
            continue  # moe-core's running counts (Megatron keeps them out of checkpoints)
        else:
            out[key] = value
    return out


def _mismatches(a: dict, b: dict) -> list:
    if sorted(a) != sorted(b):
        return [f"keys {sorted(set(a) ^ set(b))}"]
    return [k for k in a if not torch.equal(a[k], b[k])]


def _round_trip(meg, ours, cfg, ckpt_dir: str) -> dict:
    """Megatron's checkpoint into a fresh model of ours, ours back into a fresh Megatron model:
    the MoE weights that arrive, against those saved (non-MoE weights are Megatron's own code)."""
    import os

    import torch.distributed as dist

    # weights unlike both fresh models' init, and the same on every rank where replicated (a
    # checkpoint keeps one replica: the ranks' models must agree on it, as data parallelism keeps
    # them; the experts of each rank are their own shards)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in meg.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
        for layer in meg.decoder.layers:
            if getattr(layer.mlp.router, "expert_bias", None) is not None:
                layer.mlp.router.expert_bias.copy_(torch.randn(cfg.num_moe_experts, generator=g))
    fresh_meg, fresh_ours = megatron_gpt.models(cfg, seed=99)
    first, second = os.path.join(ckpt_dir, "megatron"), os.path.join(ckpt_dir, "ours")
    if dist.get_rank() == 0:
        os.makedirs(first, exist_ok=True)
        os.makedirs(second, exist_ok=True)
    dist.barrier()
    dist_checkpointing.save(meg.sharded_state_dict(), first)
    fresh_ours.load_state_dict(dist_checkpointing.load(fresh_ours.sharded_state_dict(), first))
    dist_checkpointing.save(fresh_ours.sharded_state_dict(), second)
    fresh_meg.load_state_dict(dist_checkpointing.load(fresh_meg.sharded_state_dict(), second))
    return {"megatron -> ours": _mismatches(_moe_weights(fresh_ours), _moe_weights(meg)),
            "ours -> megatron": _mismatches(_moe_weights(fresh_meg), _moe_weights(meg))}


@pytest.mark.parametrize("case", sorted(CHECKPOINT_CASES))
def test_sharded_state_dict_has_megatrons_layout(case):
    meg, ours = megatron_gpt.models(megatron_gpt.config(**CHECKPOINT_CASES[case]))
    assert _describe(ours.sharded_state_dict()) == _describe(meg.sharded_state_dict())
    singleton = dict(singleton_local_shards=True)
    assert _describe(ours.sharded_state_dict(metadata=dict(singleton))) == \
        _describe(meg.sharded_state_dict(metadata=dict(singleton)))


@pytest.mark.parametrize("case", sorted(CHECKPOINT_CASES))
def test_dist_checkpoint_round_trip(case, tmp_path):
    cfg = megatron_gpt.config(**CHECKPOINT_CASES[case])
    meg, ours = megatron_gpt.models(cfg)
    for what, mismatches in _round_trip(meg, ours, cfg, str(tmp_path)).items():
        assert not mismatches, f"{what}: {mismatches}"


# ---- the aux-loss scale and the layer interface ------------------------------------------------

def test_aux_loss_scale_is_megatrons():
    """Megatron's ``set_loss_scale`` scales our aux-loss gradients as it scales its own: the
    router's weight gradient of both layers at scale 3 (and no output gradient, so the aux loss
    is all the router's gradient)."""
    kw = dict(hidden_size=16, num_moe_experts=4, moe_ffn_hidden_size=8, moe_router_topk=2,
              add_bias_linear=False, moe_aux_loss_coeff=0.1, moe_router_dtype="fp32")
    meg = megatron_layer.build(**kw)
    ours = MoECoreMegatronLayer(meg.config, layer_number=1)
    ours.load_state_dict(meg.state_dict())
    x = torch.randn(6, 2, 16)
    grads = []
    with AuxLossScale(7.0):  # an enclosing moe-core scale does not override Megatron's
        for layer in (meg, ours):
            moe_utils.MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(3.0))
            out, bias = layer(x)
            assert bias is None and out.shape == x.shape
            out.backward(torch.zeros_like(out))
            grads.append(layer.router.weight.grad)
    moe_utils.MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0))
    assert grads[0].abs().max() > 0
    tol = 32 * eps(torch.float32) * grads[0].abs().max()
    assert (grads[1] - grads[0]).abs().max() <= tol


def test_module_spec_builds_our_layer():
    spec = moe_module_spec()
    assert spec.module is MoECoreMegatronLayer and spec.submodules is None
    args = dict(num_experts=4, normalization="RMSNorm", qk_layernorm=True)
    layer_spec, theirs = gpt_layer_spec(**args), get_gpt_layer_local_spec(**args)
    assert layer_spec.submodules.mlp.module is MoECoreMegatronLayer
    assert layer_spec.module is theirs.module
    for field in dataclasses.fields(theirs.submodules):  # all but the MLP: Megatron's spec
        if field.name != "mlp":
            assert getattr(layer_spec.submodules, field.name) == \
                getattr(theirs.submodules, field.name), field.name


def _tiny(**kw) -> TransformerConfig:
    base = dict(num_layers=1, hidden_size=16, num_attention_heads=2, use_cpu_initialization=True,
                num_moe_experts=4, moe_ffn_hidden_size=8, add_bias_linear=False)
    base.update(kw)
    return TransformerConfig(**base)


def test_refusals_name_what_is_unsupported():
    with pytest.raises(ValueError, match="num_experts=None"):
        gpt_layer_spec()
    with pytest.raises(ValueError, match="submodules"):
        MoECoreMegatronLayer(_tiny(), submodules=object())
    with pytest.raises(ValueError, match="is_mtp_layer"):
        MoECoreMegatronLayer(_tiny(), is_mtp_layer=True)
    with pytest.raises(ValueError, match="moe_latent_size"):
        MoECoreMegatronLayer(_tiny(moe_latent_size=8))
    with pytest.raises(ValueError, match="moe_mlp_glu_interleave_size=32"):
        MoECoreMegatronLayer(_tiny(gated_linear_unit=True, moe_mlp_glu_interleave_size=32))
    with pytest.raises(ValueError, match="moe_router_force_biased"):
        MoECoreMegatronLayer(_tiny(moe_router_force_biased=1.0))
    layer = MoECoreMegatronLayer(_tiny(moe_enable_routing_replay=True))
    assert layer.config.moe_enable_routing_replay
    layer = MoECoreMegatronLayer(_tiny())
    with pytest.raises(ValueError, match="intermediate_tensors"):
        layer(torch.randn(4, 1, 16), intermediate_tensors=(None, None))


def test_selective_moe_recompute_recomputes_the_layer():
    """Megatron's "moe" in the selective recompute_modules recomputes its MoE layer inside the
    layer (MoELayer.moe_layer_recompute): this one does the same, with the same gradients."""
    torch.manual_seed(0)
    plain = MoECoreMegatronLayer(_tiny())
    torch.manual_seed(0)
    recomputed = MoECoreMegatronLayer(_tiny(recompute_granularity="selective",
                                            recompute_modules=["moe"]))
    assert recomputed.config.moe_layer_recompute and not plain.config.moe_layer_recompute
    x = torch.randn(4, 1, 16)
    grads = []
    for layer in (plain, recomputed):
        xx = x.clone().requires_grad_()
        out, bias = layer(xx)
        assert bias is None
        out.square().sum().backward()
        grads.append([xx.grad] + [p.grad for p in layer.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_tensor_parallel_is_refused():
    cfg = copy.copy(_tiny())
    cfg.tensor_model_parallel_size = 2
    with pytest.raises(ValueError, match="tensor_model_parallel_size=2"):
        MoECoreMegatronLayer(cfg)
    cfg = copy.copy(_tiny())
    cfg.expert_tensor_parallel_size = 2
    with pytest.raises(ValueError, match="expert_tensor_parallel_size=2"):
        MoECoreMegatronLayer(cfg)


def test_megatron_keys_and_ours_both_load():
    cfg = megatron_gpt.config()
    meg, ours = megatron_gpt.models(cfg)
    _, again = megatron_gpt.models(cfg, seed=5)
    assert _mismatches(_moe_weights(again), _moe_weights(meg)) != []
    again.load_state_dict(ours.state_dict(), strict=True)  # moe-core's own keys
    assert _mismatches(_moe_weights(again), _moe_weights(meg)) == []


def test_example_trains_under_torchrun_at_ep2():
    """examples/megatron_gpt_moe.py as documented (torchrun, two CPU ranks, EP 2): the loss
    falls, and Megatron's tracker reports a load-balancing loss near its balanced value 1."""
    import os
    import re
    import subprocess
    import sys

    from helpers.dist import free_port
    from helpers.scripts import ROOT

    path = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=path)
    res = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--master-port", str(free_port()), "examples/megatron_gpt_moe.py", "--ep", "2",
         "--steps", "30"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    steps = re.findall(r"loss ([\d.]+)  load-balancing loss \(rank 0\) ([\d.]+)", res.stdout)
    assert len(steps) == 4, res.stdout
    losses = [float(s[0]) for s in steps]
    assert losses[-1] < 0.5 * losses[0], losses
    assert all(0.9 < float(s[1]) < 1.5 for s in steps), steps
    assert "MoECoreMegatronLayer" in res.stdout and "expert_parallel=2" in res.stdout
