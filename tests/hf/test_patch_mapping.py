"""The register_patch_mapping route: ``moe_core.hf.register_patch_mapping()`` (or
``patch_mapping()`` with transformers' ``apply_patches``) has ``from_pretrained`` /
``from_config`` build moe-core blocks directly, equal to ``replace_moe_blocks`` on HF's model.
"""
import copy

import pytest
import torch

from helpers.hf_models import SWAP_FAMILIES, inputs, rel_err, run_step, tiny_model

import moe_core
import moe_core.hf as mh
from moe_core.hf import MoECoreSparseMoeBlock, UnsupportedMoEBlockError

FP32_TOL = 1e-6


def _blocks(model) -> list:
    return [m for m in model.modules() if isinstance(m, MoECoreSparseMoeBlock)]


@pytest.fixture
def registered():
    """Registers the mapping of one model type; unregisters it afterwards."""
    from transformers.monkey_patching import unregister_patch_mapping

    names = []

    def register(model_type: str, **options):
        names.extend(mh.register_patch_mapping([model_type], **options))
        return names

    yield register
    if names:
        unregister_patch_mapping(names)


@pytest.mark.parametrize("family", SWAP_FAMILIES)
def test_from_pretrained_builds_moe_core_blocks(family, registered, tmp_path):
    model = tiny_model(family)
    model.save_pretrained(tmp_path)
    registered(model.config.model_type)
    loaded = type(model).from_pretrained(tmp_path).eval()
    swapped = copy.deepcopy(model)
    n = mh.replace_moe_blocks(swapped)
    assert len(_blocks(loaded)) == n > 0
    hf_names = set(mh.patch_mapping([model.config.model_type]))
    assert any(type(m).__name__ in hf_names for m in model.modules())
    assert not any(type(m).__name__ in hf_names for m in loaded.modules())
    # HF's keys, shapes, and the checkpoint's values
    sd, want_sd = loaded.state_dict(), model.state_dict()
    assert list(sd) == list(want_sd)
    assert all(torch.equal(sd[k], want_sd[k]) for k in want_sd)
    # the same model as replace_moe_blocks makes: logits, every gradient, router logits
    ids = inputs()
    want_logits, want_grads, want_out = run_step(swapped, ids, output_router_logits=True)
    got_logits, got_grads, got_out = run_step(loaded, ids, output_router_logits=True)
    assert torch.equal(got_logits, want_logits)
    assert sorted(got_grads) == sorted(want_grads)
    assert all(torch.equal(got_grads[k], want_grads[k]) for k in want_grads)
    assert len(got_out.router_logits) == len(want_out.router_logits)
    assert all(torch.equal(a, b) for a, b in zip(got_out.router_logits, want_out.router_logits))
    # and HF eager's logits
    with torch.no_grad():
        assert rel_err(loaded(ids).logits, model(ids).logits) <= FP32_TOL


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss", "llama4", "deepseek_v3"])
def test_from_config_initialises_the_experts_as_hf_does(family):
    # HF's _init_weights reaches the swapped experts (instances of the family's experts class
    # too): normal(0, initializer_range), not the uninitialised memory of torch.empty
    from transformers.monkey_patching import apply_patches

    config = tiny_model(family).config
    torch.manual_seed(0)
    with apply_patches(mh.patch_mapping([config.model_type])):
        model = type(tiny_model(family))._from_config(config)
    assert _blocks(model)
    std = config.initializer_range
    for name, p in model.named_parameters():
        if ".experts." in name and name.endswith("_proj"):
            assert abs(p.std().item() - std) < 0.1 * std, name
            assert abs(p.mean().item()) < 0.1 * std, name
    ids = inputs()
    logits, grads, _ = run_step(model, ids)
    assert torch.isfinite(logits).all() and all(torch.isfinite(g).all() for g in grads.values())


def test_options_reach_the_blocks_and_losses_are_read(registered, tmp_path):
    model = tiny_model("mixtral")
    model.save_pretrained(tmp_path)
    registered("mixtral", aux_loss_coeff=0.01, z_loss_coeff=1e-3, capacity_factor=4.0)
    loaded = type(model).from_pretrained(tmp_path).train()
    cfgs = [b.config for b in _blocks(loaded)]
    assert cfgs and all(c.moe_aux_loss_coeff == 0.01 and c.moe_z_loss_coeff == 1e-3 and
                        c.moe_expert_capacity_factor == 4.0 for c in cfgs)
    run_step(loaded, inputs())
    losses = mh.moe_core_losses(loaded)
    assert set(losses) == {"load_balancing_loss", "z_loss"}
    assert all(torch.isfinite(v) and v > 0 for v in losses.values())


def test_patched_model_generates_trains_with_peft_and_pickles(registered, tmp_path):
    import peft

    model = tiny_model("qwen3_moe")
    model.save_pretrained(tmp_path / "ckpt")
    registered("qwen3_moe")
    loaded = type(model).from_pretrained(tmp_path / "ckpt").eval()
    ids = inputs(batch=1, seq=5, seed=3)
    with torch.no_grad():
        assert torch.equal(loaded.generate(ids, max_new_tokens=4, do_sample=False),
                           model.generate(ids, max_new_tokens=4, do_sample=False))
    torch.save(loaded, tmp_path / "m.pt")
    again = torch.load(tmp_path / "m.pt", weights_only=False)
    with torch.no_grad():
        assert torch.equal(again(ids).logits, loaded(ids).logits)
    pm = peft.get_peft_model(loaded, peft.LoraConfig(
        r=4, target_modules=[], target_parameters=["experts.gate_up_proj", "experts.down_proj"]))
    _, grads, _ = run_step(pm, inputs())
    assert grads and all("lora_" in n for n in grads)
    moe_core.finalize_step(pm)


def test_refusals_and_bad_names():
    from transformers.monkey_patching import apply_patches

    with pytest.raises(ValueError, match=r"families \['mixtrall'\]"):
        mh.patch_mapping(["mixtrall"])
    config = tiny_model("llama4", num_experts_per_tok=2).config
    with apply_patches(mh.patch_mapping(["llama4"])):
        with pytest.raises(UnsupportedMoEBlockError, match="num_experts_per_tok=2"):
            type(tiny_model("llama4"))._from_config(config)
    assert set(mh.patch_mapping()) == {
        "MixtralSparseMoeBlock", "Qwen2MoeSparseMoeBlock", "Qwen3MoeSparseMoeBlock",
        "OlmoeSparseMoeBlock", "DeepseekV2Moe", "DeepseekV3MoE", "Glm4MoeMoE", "GptOssMLP",
        "Ernie4_5_MoeSparseMoeBlock", "Llama4TextMoe"}
