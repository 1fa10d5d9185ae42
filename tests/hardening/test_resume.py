"""Exact resume: everything a layer needs to continue training bit for bit is in its state dict.

A tiny CPU layer with every piece of router state (expert bias and its running token counts,
the global aux loss's running counts, a bound aux-loss scale) trains 3 steps with Adam, saves
model and optimizer state with ``torch.save``, and a fresh process builds a new layer from another
seed, loads both and trains 2 more steps. Parameters, buffers, optimizer state and losses must
equal those of 5 steps in one process, bitwise. The run itself is in tests/helpers/resume.py; the
fresh process is ``python -m helpers.resume`` (no test module is imported by another).

The global batch here spans two optimizer steps (expert-bias update and global aux-loss reset
every second step), so the checkpoint falls inside one and the running counts are non-zero when
saved; ``test_each_piece_of_state_changes_the_result`` checks that resuming without any one of
them (or without the scale) gives different bits, so the bitwise test can tell.
"""
import copy
import os
import subprocess
import sys
from typing import Dict

import pytest
import torch

from helpers.resume import AUX_SCALE, E, SAVE_AFTER, T, TOTAL_STEPS, build, snapshot, train
from moe_core import load_megatron_state_dict
from moe_core.ops import AuxLossScale


def assert_same_state(got: Dict, want: Dict, what: str) -> None:
    assert sorted(got) == sorted(want), what
    for key, value in want.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(got[key], value), f"{what}: {key}"
        elif isinstance(value, dict):
            assert_same_state(got[key], value, f"{what}.{key}")
        elif isinstance(value, (list, tuple)):
            assert len(got[key]) == len(value), f"{what}: {key}"
            for i, (a, b) in enumerate(zip(got[key], value)):
                assert_same_state({"v": a}, {"v": b}, f"{what}: {key}[{i}]")
        else:
            assert got[key] == value, f"{what}: {key}"


def test_resume_in_a_fresh_process_is_bitwise_exact(tmp_path):
    layer, opt = build(seed=0)
    losses = train(layer, opt, range(SAVE_AFTER))
    ckpt = str(tmp_path / "ckpt.pt")
    torch.save(snapshot(layer, opt, losses), ckpt)
    saved = torch.load(ckpt)["model"]
    # the checkpoint is inside a global batch: the running counts are live state
    assert saved["router.local_tokens_per_expert"].sum() == T * 2
    assert saved["router.global_aux_buffer.steps"] == 1
    assert saved["router.global_aux_buffer.tokens_per_expert"].sum() == T * 2
    assert saved["router.expert_bias"].abs().sum() > 0
    assert saved["router.aux_loss_scale"] == AUX_SCALE

    losses += train(layer, opt, range(SAVE_AFTER, TOTAL_STEPS))
    reference = snapshot(layer, opt, losses[SAVE_AFTER:])

    out = str(tmp_path / "resumed.pt")
    tests_dir = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (tests_dir, env.get("PYTHONPATH")) if p)
    # the repository root is the working directory, so -m finds this checkout's moe_core
    proc = subprocess.run([sys.executable, "-m", "helpers.resume", ckpt, out], capture_output=True,
                          text=True, timeout=120, cwd=os.path.dirname(tests_dir), env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    resumed = torch.load(out)
    assert_same_state(resumed["model"], reference["model"], "model")
    assert_same_state(resumed["optim"], reference["optim"], "optimizer")
    assert len(resumed["losses"]) == TOTAL_STEPS - SAVE_AFTER
    for step, (a, b) in enumerate(zip(resumed["losses"], reference["losses"]), SAVE_AFTER):
        assert torch.equal(a, b), f"step {step}: losses {a.tolist()} != {b.tolist()}"


def test_each_piece_of_state_changes_the_result():
    """In one process: resuming from the full state dict is exact, and resuming from one without
    a running count or the scale is not (so the fresh-process test can fail)."""
    layer, opt = build(seed=0)
    train(layer, opt, range(SAVE_AFTER))
    model, optim = copy.deepcopy(layer.state_dict()), copy.deepcopy(opt.state_dict())
    want_losses = train(layer, opt, range(SAVE_AFTER, TOTAL_STEPS))
    want = layer.state_dict()

    def resumed_equal(drop) -> bool:
        other, other_opt = build(seed=99, bind_scale=False)
        other.load_state_dict({k: v for k, v in model.items() if k not in drop})
        other_opt.load_state_dict(optim)
        losses = train(other, other_opt, range(SAVE_AFTER, TOTAL_STEPS))
        got = other.state_dict()
        return (all(torch.equal(a, b) for a, b in zip(losses, want_losses))
                and all(torch.equal(got[k], v) for k, v in want.items() if k in got))

    assert resumed_equal(drop=())
    for drop in (["router.local_tokens_per_expert"],
                 ["router.global_aux_buffer.tokens_per_expert", "router.global_aux_buffer.steps"],
                 ["router.aux_loss_scale"]):
        assert not resumed_equal(drop), f"resuming without {drop} changed nothing"


def test_state_dict_holds_the_running_counts_and_the_scale():
    layer, _ = build(seed=0)
    train(layer, torch.optim.Adam(layer.parameters()), range(1))
    sd = layer.state_dict()
    router = layer.router
    assert torch.equal(sd["router.local_tokens_per_expert"], router.local_tokens_per_expert)
    assert torch.equal(sd["router.global_aux_buffer.tokens_per_expert"],
                       router.global_aux_buffer.tokens_per_expert)
    assert torch.equal(sd["router.global_aux_buffer.steps"], router.global_aux_buffer.steps)
    assert sd["router.aux_loss_scale"].dtype == torch.float32
    assert sd["router.aux_loss_scale"] == AUX_SCALE
    # no holder bound: no key (the ambient scale belongs to the training loop)
    unbound, _ = build(seed=0, bind_scale=False)
    assert "router.aux_loss_scale" not in unbound.state_dict()


def test_loaded_scale_updates_a_shared_holder_in_place():
    """A holder bound to several routers stays one holder: loading sets its value."""
    src, _ = build(seed=0)
    shared = AuxLossScale(3.0)
    a, _ = build(seed=1, bind_scale=False)
    b, _ = build(seed=2, bind_scale=False)
    a.router.aux_loss_scale = b.router.aux_loss_scale = shared
    a.load_state_dict(src.state_dict())
    assert a.router.aux_loss_scale is shared and b.router.aux_loss_scale is shared
    assert shared.value == AUX_SCALE


def test_state_dict_without_running_counts_loads_strictly_and_keeps_them():
    """Megatron saves neither running count (non-persistent buffers): such a state dict loads
    strictly, the layer's own counts stay, and nothing is reported missing."""
    src, _ = build(seed=0)
    layer, opt = build(seed=1)
    train(layer, opt, range(1))
    kept = {k: v.clone() for k, v in layer.state_dict().items()
            if "tokens_per_expert" in k or k.endswith("steps")}
    assert len(kept) == 3 and all(v.sum() > 0 for v in kept.values())
    sd = {k: v for k, v in src.state_dict().items() if k not in kept}
    result = layer.load_state_dict(sd)
    assert not result.missing_keys and not result.unexpected_keys
    assert torch.equal(layer.router.weight, src.router.weight)
    for key, value in kept.items():
        assert torch.equal(layer.state_dict()[key], value), key
    # the same through load_megatron_state_dict, with Megatron's per-expert naming
    megatron = {k: v for k, v in sd.items() if not k.startswith("experts.")}
    for i in range(E):
        megatron[f"experts.linear_fc1.weight{i}"] = src.experts.weight1[i].clone()
        megatron[f"experts.linear_fc2.weight{i}"] = src.experts.weight2[i].clone()
    other, _ = build(seed=2)
    result = load_megatron_state_dict(other, megatron)
    assert not result.missing_keys and not result.unexpected_keys
    assert torch.equal(other.experts.weight2, src.experts.weight2)


def test_casting_the_model_keeps_the_balancing_state_fp32():
    """bf16 has 8 significant bits: a count of 257 or a bias of 1e-2 + 2**-20 would round."""
    layer, _ = build(seed=0)
    router = layer.router
    with torch.no_grad():
        router.local_tokens_per_expert.fill_(257.0)
        router.global_aux_buffer.tokens_per_expert.fill_(257.0)
        router.global_aux_buffer.steps.fill_(3.0)
        router.expert_bias.fill_(1e-2 + 2.0**-20)
    before = {k: v.clone() for k, v in layer.state_dict().items()}
    layer.to(torch.bfloat16)
    assert router.weight.dtype == torch.bfloat16
    for key in ("router.local_tokens_per_expert", "router.global_aux_buffer.tokens_per_expert",
                "router.global_aux_buffer.steps", "router.expert_bias"):
        value = layer.state_dict()[key]
        assert value.dtype == torch.float32 and torch.equal(value, before[key]), key


def test_scale_of_more_than_one_element_is_refused():
    layer, _ = build(seed=0)
    sd = dict(layer.state_dict(), **{"router.aux_loss_scale": torch.ones(2)})
    with pytest.raises(RuntimeError, match=r"router\.aux_loss_scale: expected a one-element "
                                           r"tensor, got \(2,\)"):
        layer.load_state_dict(sd)


def test_counts_of_another_shape_are_refused():
    layer, _ = build(seed=0)
    sd = dict(layer.state_dict(), **{"router.local_tokens_per_expert": torch.ones(E + 1)})
    with pytest.raises(RuntimeError, match=rf"router\.local_tokens_per_expert: expected a tensor "
                                           rf"of shape \({E},\), got \({E + 1},\)"):
        layer.load_state_dict(sd)


def test_counts_are_saved_but_are_no_buffer():
    """Each rank's own counts: out of named_buffers (what DDP broadcasts from rank 0), in the
    state dict, and they follow the model's device moves."""
    layer, _ = build(seed=0)
    assert "router.local_tokens_per_expert" not in dict(layer.named_buffers())
    assert "router.local_tokens_per_expert" in layer.state_dict()
    layer.to("meta")
    assert layer.router.local_tokens_per_expert.device.type == "meta"
    assert layer.router.local_tokens_per_expert.dtype == torch.float32
