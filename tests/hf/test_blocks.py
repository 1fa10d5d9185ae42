"""replace_moe_blocks: moe-core's MoELayer in place of HF's sparse-MoE blocks, against HF eager.

Tolerances as in test_backend.py (LoRA factor gradients within 1e-5 too), but fp64 within 4 fp32
ulps (HF's routers compute their softmax in fp32 even in an fp64 model: its probs carry up to an
ulp of fp32 each, and the router gradient p * (g - sum g p) cancels; measured 2e-8 to 2.4e-7
relative, depending on the CPU's vectorised exp); fp32
within 1e-6 relative (or twice HF fp32's own distance from fp64 for a gradient with cancellation);
bf16 logits within 1e-2 of HF bf16's and every gradient no further from the fp32 model's than twice
HF bf16's distance plus 1e-2. On top of the backend's differences, the swapped router sums the
softmax and its renormalisation in its own order, and the experts apply the probs before fc2
(Megatron's order) rather than after. Each family's routing rule is its HF rule op for op; the rule
variants (DeepSeek-V2 group_limited_greedy and V3 at any top_k, V3 without norm_topk_prob, Mixtral's
jitter, Ernie-4.5 at other top_k and without shared experts) are tested on their own, and so are
the two documented differences, each on a token crafted to hit it: Ernie-4.5's renormalisation
when the chosen probs sum below moe_norm_min, and Llama-4's choice between two logits with the
same fp32 sigmoid.
"""
import copy
import warnings

import pytest
import torch
import torch.nn.functional as F

from helpers.hf_models import (SWAP_FAMILIES, assert_close_grads, assert_fp32_grads_close,
                               assert_mixed_grads_close, assert_tie_free, inputs, rel_err,
                               run_step, tiny_model)
from helpers.hf_router_rules import hf_deepseek_v2, hf_deepseek_v3, hf_ernie45

import moe_core
from moe_core.hf import MoECoreSparseMoeBlock, UnsupportedMoEBlockError, replace_moe_blocks
from moe_core.hf.blocks import _FAMILIES, _GATE_NAMES

FP32_TOL = 1e-6
LORA_TOL = 1e-5
FP64_TOL = 4 * 2.0**-23


def _hf_blocks(model) -> list:
    """The model's HF sparse-MoE blocks (of the families replace_moe_blocks knows)."""
    return [m for m in model.modules() if type(m).__name__ in _FAMILIES]


def _swapped(model):
    new = copy.deepcopy(model)
    n = replace_moe_blocks(new)
    assert n == len(_hf_blocks(model)) > 0
    assert not _hf_blocks(new)
    assert sum(isinstance(m, MoECoreSparseMoeBlock) for m in new.modules()) == n
    return new


@pytest.mark.parametrize("family", SWAP_FAMILIES)
def test_fp32_logits_grads_and_aux_loss_equal_eager(family):
    model = tiny_model(family)
    ids = inputs()
    want_logits, want_grads, out = run_step(model, ids, output_router_logits=True)
    assert_tie_free(out.router_logits, model.config.num_experts_per_tok)
    swapped = _swapped(model)
    got_logits, got_grads, out2 = run_step(swapped, ids, output_router_logits=True)
    _, want64, _ = run_step(tiny_model(family, torch.float64), ids)
    assert rel_err(got_logits, want_logits) <= FP32_TOL
    assert_fp32_grads_close(got_grads, want_grads, want64, FP32_TOL)
    # HF's output recording sees the swapped routers' logits
    assert len(out2.router_logits) == len(out.router_logits)
    for a, b in zip(out2.router_logits, out.router_logits):
        assert rel_err(a.detach(), b.detach()) <= FP32_TOL
    if getattr(out, "aux_loss", None) is not None:  # HF's pooled load-balancing loss
        assert torch.allclose(out2.aux_loss, out.aux_loss, rtol=1e-6, atol=0)


@pytest.mark.parametrize("family", SWAP_FAMILIES)
def test_fp64_logits_and_grads_equal_eager(family):
    model = tiny_model(family, torch.float64)
    ids = inputs()
    got_logits, got_grads, _ = run_step(_swapped(model), ids)
    if family == "llama4":
        # HF's Llama-4 router rounds its sigmoid to fp32 (moe-core's stays fp64), and with the
        # probs on the input and no renormalisation that rounding reaches the router gradient
        # whole (3.7e-7): the reference is HF's math in fp64
        model = _exact_fp64_routers(model)
    want_logits, want_grads, _ = run_step(model, ids)
    # HF's routers take the softmax in fp32 even in an fp64 model (moe-core's stays fp64), so
    # the two differ by fp32 rounding of the probs, not more
    assert rel_err(got_logits, want_logits) <= FP64_TOL
    assert_close_grads(got_grads, want_grads, FP64_TOL)


@pytest.mark.parametrize("family", SWAP_FAMILIES)
def test_bf16_within_documented_tolerance(family):
    ids = inputs()
    _, ref_grads, _ = run_step(tiny_model(family), ids)
    model = tiny_model(family, torch.bfloat16)
    hf_logits, hf_grads, out = run_step(model, ids, output_router_logits=True)
    assert_tie_free(out.router_logits, model.config.num_experts_per_tok)
    logits, grads, _ = run_step(_swapped(model), ids)
    assert rel_err(logits, hf_logits) <= 1e-2
    for name, want in ref_grads.items():
        hf_err = rel_err(hf_grads[name].float(), want)
        assert rel_err(grads[name].float(), want) <= 2 * hf_err + 1e-2, name


@pytest.mark.parametrize("family", SWAP_FAMILIES)
def test_autocast_bf16_within_documented_tolerance(family):
    """An fp32 model under CPU autocast, swapped, against HF eager under the same autocast:
    bf16's tolerances; the swapped experts run their GEMMs in bf16 (as nn.Linear under
    autocast, and HF eager's linears), so their output is bf16."""
    ids = inputs()
    model = tiny_model(family)
    _, ref_grads, _ = run_step(model, ids)
    hf_logits, hf_grads, out = run_step(model, ids, autocast=torch.bfloat16,
                                        output_router_logits=True)
    assert_tie_free(out.router_logits, model.config.num_experts_per_tok)
    swapped = _swapped(model)
    seen = []
    for block in swapped.modules():
        if isinstance(block, MoECoreSparseMoeBlock):
            block.experts.register_forward_hook(lambda m, args, y: seen.append(y.dtype))
    logits, grads, _ = run_step(swapped, ids, autocast=torch.bfloat16)
    assert seen and set(seen) == {torch.bfloat16}
    assert rel_err(logits, hf_logits) <= 1e-2
    assert_mixed_grads_close(grads, hf_grads, ref_grads)


@pytest.mark.parametrize("family", SWAP_FAMILIES)
def test_generate_equals_eager_greedy(family):
    model = tiny_model(family)
    ids = inputs(batch=1, seq=5, seed=3)
    with torch.no_grad():
        want = model.generate(ids, max_new_tokens=4, do_sample=False)
        got = _swapped(model).generate(ids, max_new_tokens=4, do_sample=False)
    assert torch.equal(got, want)


@pytest.mark.parametrize("family", SWAP_FAMILIES)
def test_peft_lora_on_experts_gradients_equal_eager(family):
    import peft
    base = tiny_model(family)
    swapped = _swapped(base)
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=[],
                          target_parameters=["experts.gate_up_proj", "experts.down_proj"])
    grads = []
    for m in (base, swapped):
        torch.manual_seed(7)
        pm = peft.get_peft_model(m, copy.deepcopy(cfg))
        with torch.no_grad():
            for name, p in pm.named_parameters():
                if "lora_" in name:
                    p.normal_(0.0, 0.2)
        _, g, _ = run_step(pm, inputs())
        assert g and all("lora_" in n for n in g) and all(v.abs().sum() > 0 for v in g.values())
        grads.append(g)
        opt = torch.optim.SGD([p for p in pm.parameters() if p.requires_grad], lr=0.1)
        opt.step()
    # LoRA factor gradients contract a whole expert stack's gradient to rank r, with
    # cancellation: HF's own fp32 implementations disagree there by up to 4.6e-6 (batched_mm vs
    # eager, OLMoE's first layer), hence LORA_TOL
    assert_close_grads(grads[1], grads[0], LORA_TOL)


@pytest.mark.parametrize("family", SWAP_FAMILIES)
def test_state_dict_round_trip_both_ways(family):
    ids = inputs()
    hf_a = tiny_model(family, seed=0)
    hf_b = tiny_model(family, seed=1)
    swapped = _swapped(hf_b)
    sd_hf, sd_swapped = hf_a.state_dict(), swapped.state_dict()
    assert list(sd_hf) == list(sd_swapped)
    assert all(sd_hf[k].shape == sd_swapped[k].shape and sd_hf[k].dtype == sd_swapped[k].dtype
               for k in sd_hf)
    # HF -> swapped
    swapped.load_state_dict(sd_hf, strict=True)
    with torch.no_grad():
        assert rel_err(swapped(ids).logits, hf_a(ids).logits) <= FP32_TOL
    # swapped -> HF (a fresh model with other weights)
    hf_c = tiny_model(family, seed=2)
    hf_c.load_state_dict(swapped.state_dict(), strict=True)
    with torch.no_grad():
        assert torch.equal(hf_c(ids).logits, hf_a(ids).logits)
    # the swapped block holds HF's Parameter objects: nothing was copied
    block = next(m for m in swapped.modules() if isinstance(m, MoECoreSparseMoeBlock))
    assert block.experts.weight1 is block.experts.gate_up_proj
    hf_name = _GATE_NAMES.get(family, "gate")
    assert isinstance(block, moe_core.MoELayer) and block.router is block._modules[hf_name]


def test_deepseek_v2_greedy_routing_equals_eager():
    model = tiny_model("deepseek_v2")
    model.config.topk_method = "greedy"
    for m in model.modules():
        if hasattr(m, "topk_method"):
            m.topk_method = "greedy"
    ids = inputs()
    want_logits, want_grads, _ = run_step(model, ids)
    swapped = _swapped(model)
    assert all(m.gate.config.moe_router_group_topk is None for m in swapped.modules()
               if isinstance(m, MoECoreSparseMoeBlock))
    got_logits, got_grads, _ = run_step(swapped, ids)
    assert rel_err(got_logits, want_logits) <= FP32_TOL
    assert_close_grads(got_grads, want_grads, FP32_TOL)


@pytest.mark.parametrize("family", ["mixtral", "llama4"])
def test_swapped_model_pickles(tmp_path, family):
    # the router classes are made at run time (Llama-4's also derives from nn.Linear)
    model = tiny_model(family)
    swapped = _swapped(model)
    torch.save(swapped, tmp_path / "m.pt")
    loaded = torch.load(tmp_path / "m.pt", weights_only=False)
    ids = inputs()
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, swapped(ids).logits)


def test_pickle_naming_the_classes_under_blocks_loads():
    # a pickle may name the run-time router and experts classes under moe_core.hf.blocks (where
    # they were once made): that name resolves to the same class
    import pickle

    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    from moe_core.hf import blocks
    from moe_core.hf.experts import HFGroupedMLP, _experts_class

    swapped = _swapped(tiny_model("mixtral"))
    data = pickle.dumps(swapped)
    assert b"moe_core.hf.router" in data
    # the same length, so the pickle's string lengths stay right
    loaded = pickle.loads(data.replace(b"moe_core.hf.router", b"moe_core.hf.blocks"))
    ids = inputs()
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, swapped(ids).logits)
    experts_cls = _experts_class(HFGroupedMLP, MixtralExperts)
    assert getattr(blocks, experts_cls.__name__) is experts_cls
    with pytest.raises(AttributeError, match="MoECoreNothing"):
        getattr(blocks, "MoECoreNothing")


@pytest.mark.parametrize("hooked_before", [True, False], ids=["hooked-before", "hooked-after"])
@pytest.mark.parametrize("family", ["qwen3_moe", "llama4"])
def test_router_logits_recorded_whenever_hf_installed_its_hooks(family, hooked_before):
    # HF installs its recording hooks at the first forward, by router class and output index
    # (Llama-4's recorder reads the router's second output): before the swap, the swap adds
    # them to the new routers; after it, HF finds the new routers by their class
    model = tiny_model(family)
    ids = inputs()
    with torch.no_grad():
        # the first forward installs HF's hooks (on a copy when they must come after the swap)
        want = (model if hooked_before else copy.deepcopy(model))(
            ids, output_router_logits=True).router_logits
        assert hooked_before == any(getattr(m, "_output_capturing_hooks_installed", False)
                                    for m in model.modules())
        replace_moe_blocks(model)
        got = model(ids, output_router_logits=True).router_logits
    assert len(got) == len(want) == model.config.num_hidden_layers
    assert all(rel_err(a, b) <= FP32_TOL for a, b in zip(got, want))


def test_moe_core_losses_are_reported_and_reach_the_router():
    model = tiny_model("mixtral").train()
    ids = inputs()
    _, want_grads, out = run_step(model, ids, output_router_logits=True)
    swapped = copy.deepcopy(model)
    assert replace_moe_blocks(swapped, aux_loss_coeff=0.01, z_loss_coeff=1e-3) == 2
    _, grads, out2 = run_step(swapped, ids, output_router_logits=True)
    losses = out2["moe_core_losses"]
    assert set(losses) == {"load_balancing_loss", "z_loss"}
    assert all(v.dim() == 0 and torch.isfinite(v) and v > 0 for v in losses.values())
    assert losses == moe_core.hf.moe_core_losses(swapped)
    # HF's own aux loss is unchanged; moe-core's losses add router gradients only
    assert torch.allclose(out2.aux_loss, out.aux_loss, rtol=1e-6, atol=0)
    router = [n for n in want_grads if n.endswith("gate.weight")]
    assert all(rel_err(grads[n], want_grads[n]) > 1e-4 for n in router)
    assert all(rel_err(grads[n], want_grads[n]) <= FP32_TOL for n in want_grads
               if n not in router and ".layers.1." in n and "mlp" in n)


@pytest.mark.parametrize("family", ["deepseek_v3", "ernie4_5_moe"])
def test_finalize_step_and_cast_after_the_swap(family):
    # DeepSeek-V3's expert bias is a buffer of the router, Ernie-4.5's a frozen Parameter of the
    # router's moe_statics
    model = tiny_model(family)
    swapped = _swapped(model).train()
    run_step(swapped, inputs())
    biases = {n: b.clone() for n, b in swapped.state_dict().items()
              if n.endswith("e_score_correction_bias")}
    assert biases
    # finds the blocks as MoELayers; HF's expert bias is a checkpoint constant, left as it is
    moe_core.finalize_step(swapped)
    assert all(torch.equal(swapped.state_dict()[n], b) for n, b in biases.items())
    swapped.eval()
    swapped.to(torch.bfloat16)
    block = next(m for m in swapped.modules() if isinstance(m, MoECoreSparseMoeBlock))
    assert block.experts.gate_up_proj.dtype == torch.bfloat16
    assert block.experts.weight1.dtype == torch.bfloat16
    with torch.no_grad():
        assert torch.isfinite(swapped(inputs()).logits).all()


def test_gradient_checkpointing_on_both_routes():
    moe_core.hf.register_experts_backend()
    model = tiny_model("qwen2_moe").train()
    ids = inputs()
    want_logits, want_grads, _ = run_step(model, ids)
    _, want64, _ = run_step(tiny_model("qwen2_moe", torch.float64).train(), ids)
    backend = copy.deepcopy(model)
    backend.set_experts_implementation("moe_core")
    for m in (backend, _swapped(model)):
        m.gradient_checkpointing_enable()
        got_logits, got_grads, _ = run_step(m, ids)
        assert rel_err(got_logits, want_logits) <= FP32_TOL
        assert_fp32_grads_close(got_grads, want_grads, want64, FP32_TOL)


def test_swap_after_peft_wrapping_raises():
    import peft
    model = peft.get_peft_model(tiny_model("qwen3_moe"), peft.LoraConfig(
        target_modules=[], target_parameters=["experts.gate_up_proj"]))
    with pytest.raises(UnsupportedMoEBlockError, match="swap the blocks first"):
        replace_moe_blocks(model)


# ---- the routing-rule variants, each against HF eager ----------------------------------------
def _rule_of(swapped, field):
    return {getattr(m.router.config, field) for m in swapped.modules()
            if isinstance(m, MoECoreSparseMoeBlock)}


def _exact_fp64_routers(model):
    """HF's DeepSeek and Llama-4 routers cast to fp32 even in an fp64 model, so that model's
    router gradients carry fp32 rounding (1e-6 relative without renormalisation, where nothing
    cancels it): for an fp64 truth, its routers run the same math in fp64 (references in
    helpers/hf_router_rules.py; Llama-4's inline). Returns ``model``, patched in place."""
    for m in model.modules():
        kind = type(m).__name__
        if kind == "DeepseekV2TopkRouter":
            def forward(h, m=m):
                logits = F.linear(h.reshape(-1, m.hidden_dim), m.weight)
                return (logits, *hf_deepseek_v2(logits, m.top_k, m.topk_method, m.num_group,
                                                 m.topk_group, m.routed_scaling_factor))
            m.forward = forward
        elif kind in ("DeepseekV3TopkRouter", "Glm4MoeTopkRouter"):
            def forward(h, m=m):
                logits = F.linear(h.reshape(-1, m.hidden_dim), m.weight)
                return (logits, *hf_deepseek_v3(logits, m.top_k, m.e_score_correction_bias,
                                                 m.num_group, m.topk_group, m.norm_topk_prob,
                                                 m.routed_scaling_factor))
            m.forward = forward
        elif kind == "Llama4Router":
            def forward(h, m=m):
                logits = F.linear(h, m.weight)
                top, idx = logits.topk(m.top_k, dim=1)
                scores = torch.full_like(logits, float("-inf")).scatter_(1, idx, top)
                return scores.sigmoid(), logits
            m.forward = forward
    return model


def _assert_swap_equals_eager(family, train=False, seed=0, **overrides):
    """The tiny ``family`` model with ``overrides``: fp32 logits and every gradient of the swapped
    model within FP32_TOL of HF eager's (twice HF fp32's own distance from an fp64 truth where a
    gradient cancels); generator seeded with ``seed`` before each run (the jitter draws).
    Returns the swapped model."""
    ids = inputs()
    model = tiny_model(family, **overrides).train(train)
    with torch.no_grad():
        assert_tie_free(model(ids, output_router_logits=True).router_logits,
                        model.config.num_experts_per_tok)
    swapped = _swapped(model)
    truth = _exact_fp64_routers(tiny_model(family, torch.float64, **overrides).train(train))
    runs = []
    for m in (model, swapped, truth):
        torch.manual_seed(seed)
        runs.append(run_step(m, ids))
    (want_logits, want_grads, _), (got_logits, got_grads, _), (_, want64, _) = runs
    assert rel_err(got_logits, want_logits) <= FP32_TOL
    assert_fp32_grads_close(got_grads, want_grads, want64, FP32_TOL)
    return swapped


@pytest.mark.parametrize("k,topk_group", [(2, 2), (3, 2), (4, 2), (1, 3)])
def test_deepseek_v2_group_limited_greedy_any_top_k_equals_eager(k, topk_group):
    # groups of 2, scored by their best expert: Megatron's sum of the top k // topk_group is a
    # different rule as soon as that is not 1
    swapped = _assert_swap_equals_eager("deepseek_v2", num_experts_per_tok=k, topk_group=topk_group)
    assert _rule_of(swapped, "moe_router_group_score_topk") == {1}
    assert _rule_of(swapped, "moe_router_group_topk") == {topk_group}


@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe"])
@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("k", [1, 3, 4, 6])
def test_deepseek_v3_any_top_k_with_and_without_norm_topk_prob_equals_eager(k, norm, family):
    # 16 experts in 4 groups of 4, 2 kept (8 experts); groups scored by their top-2 sum
    # (GLM-4.5's router is DeepSeek-V3's)
    if k == 1 and norm:
        pytest.skip("top-1 renormalised: every prob is 1.0 (tested to raise)")
    swapped = _assert_swap_equals_eager(family, num_experts_per_tok=k, n_routed_experts=16,
                                        norm_topk_prob=norm)
    assert _rule_of(swapped, "moe_router_group_score_topk") == {2}
    assert _rule_of(swapped, "moe_router_norm_topk_prob") == {norm}


def test_deepseek_v3_top1_with_norm_topk_prob_raises():
    model = tiny_model("deepseek_v3", num_experts_per_tok=1)
    with pytest.raises(UnsupportedMoEBlockError, match=r"deepseek_v3.*top-1.*norm_topk_prob"):
        replace_moe_blocks(model)


def test_deepseek_kept_groups_smaller_than_top_k_raises():
    model = tiny_model("deepseek_v3", num_experts_per_tok=6)  # 2 groups of 2 kept: 4 experts
    with pytest.raises(UnsupportedMoEBlockError, match=r"deepseek_v3.*kept groups hold 4 of 8"):
        replace_moe_blocks(model)


def test_mixtral_router_jitter_equals_eager_in_training():
    swapped = _assert_swap_equals_eager("mixtral", train=True, seed=11, router_jitter_noise=0.2)
    assert _rule_of(swapped, "moe_input_jitter_mode") == {"layer"}
    assert _rule_of(swapped, "moe_input_jitter_eps") == {0.2}
    # the jitter is drawn (another seed gives other logits), and only in training
    ids = inputs()
    torch.manual_seed(12)
    other, _, _ = run_step(swapped, ids)
    torch.manual_seed(11)
    same, _, _ = run_step(swapped, ids)
    assert rel_err(other, same) > 1e-4
    with torch.no_grad():
        plain = tiny_model("mixtral")(ids).logits
        assert torch.equal(swapped.eval()(ids).logits, _swapped(tiny_model("mixtral"))(ids).logits)
        assert rel_err(swapped(ids).logits, plain) <= FP32_TOL


def test_gpt_oss_returns_hf_router_scores():
    model = tiny_model("gpt_oss")
    hf_block = next(m for m in model.modules() if type(m).__name__ == "GptOssMLP")
    x = torch.randn(2, 5, model.config.hidden_size)
    with torch.no_grad():
        want_out, want_scores = hf_block(x)
    replace_moe_blocks(model)
    block = model.model.layers[0].mlp
    assert isinstance(block, MoECoreSparseMoeBlock) and "router" in block._modules
    assert "gate" not in block._modules
    with torch.no_grad():
        got_out, got_scores = block(x)
    assert got_scores.shape == want_scores.shape == (10, model.config.num_experts_per_tok)
    assert rel_err(got_scores, want_scores) <= FP32_TOL
    assert rel_err(got_out, want_out) <= FP32_TOL
    assert block.router.bias is hf_block.router.bias
    assert block.experts.down_proj_bias is hf_block.experts.down_proj_bias


def test_gpt_oss_top1_raises():
    model = tiny_model("gpt_oss", num_experts_per_tok=1)
    with pytest.raises(UnsupportedMoEBlockError, match=r"gpt_oss.*top-1"):
        replace_moe_blocks(model)


@pytest.mark.parametrize("k,shared", [(2, 0), (3, 2)])
def test_ernie45_top_k_and_shared_experts_equal_eager(k, shared):
    # without shared experts HF's block holds shared_experts = None, and so does the swapped one
    swapped = _assert_swap_equals_eager("ernie4_5_moe", num_experts_per_tok=k,
                                        moe_num_shared_experts=shared)
    block = next(m for m in swapped.modules() if isinstance(m, MoECoreSparseMoeBlock))
    assert ("shared_experts" in block._modules) == (shared > 0)
    assert _rule_of(swapped, "moe_router_pre_softmax") == {True}
    assert _rule_of(swapped, "moe_router_norm_topk_prob") == {True}


def _logits_token(weight: torch.Tensor, logits: list) -> torch.Tensor:
    """``[1, H]`` input whose router logits ``x @ weight.T`` are ``logits`` (weight ``[E, H]``,
    E < H: full row rank)."""
    target = torch.tensor([logits], dtype=torch.float64)
    x = torch.linalg.lstsq(weight.double(), target.T).solution.T
    return x.to(weight.dtype)


def test_ernie45_renormalisation_below_moe_norm_min_is_the_documented_difference():
    # a token whose chosen probs sum below moe_norm_min (HF's default, 1e-12): logit 29 on
    # expert 0, the rest near 0 (probs ~2.5e-13 each), and a selection bias that picks experts
    # 6 and 7 anyway. HF divides by moe_norm_min (weights summing to ~0.6), moe-core by the sum
    # (weights summing to 1); the other tokens (sums far above moe_norm_min) agree
    model = tiny_model("ernie4_5_moe")
    hf = model.model.layers[1].mlp
    assert hf.gate.norm_min == 1e-12
    with torch.no_grad():
        hf.gate.moe_statics.e_score_correction_bias.zero_()
        hf.gate.moe_statics.e_score_correction_bias[0, 6:] = 1.5
    ours = _swapped(model).model.layers[1].mlp
    H = model.config.hidden_size
    crafted = _logits_token(hf.gate.weight, [29.0, 0, 0, 0, 0, 0, 0.3, 0.1])
    x = torch.cat([torch.randn(6, H), crafted]).unsqueeze(0)  # [1, 7, H], the last one crafted
    with torch.no_grad():
        want, got = hf(x)[0], ours(x)[0]
        logits, hf_w, hf_idx = hf.gate(x[0])
        _, probs, _ = ours.gate(x[0])
        bias = hf.gate.moe_statics.e_score_correction_bias.reshape(-1)
        rule_w, rule_idx = hf_ernie45(logits, 2, bias, norm_min=0.0)  # divided by the sum itself
        # the routed part computed with either set of weights, through HF's own experts
        shared = hf.shared_experts(x[0])
        with_hf_w = shared + hf.experts(x[0], hf_idx, hf_w)
        with_sum_w = shared + hf.experts(x[0], rule_idx, rule_w)
    chosen = logits.softmax(-1).gather(1, hf_idx).sum(-1)  # the chosen probs' sum
    assert hf_idx[-1].sort().values.tolist() == [6, 7] and 2**-42 < chosen[-1] < 1e-12
    assert (chosen[:-1] > 1e-3).all()  # ordinary tokens: far above moe_norm_min
    # HF's weights sum to 1 on the ordinary tokens and to sum / 1e-12 on the crafted one;
    # moe-core's to 1 on all of them
    total = hf_w.sum(-1)
    assert torch.allclose(total[:-1], torch.ones(6))
    assert torch.allclose(total[-1], chosen[-1] / 1e-12) and total[-1] < 0.9
    assert (probs.sum(-1) - 1).abs().max() < 1e-6
    assert torch.equal(hf_idx, rule_idx)
    # ordinary tokens: the same output; the crafted one: HF's weights vs the renormalised ones
    assert rel_err(got[:-1], want[:-1]) <= FP32_TOL
    assert rel_err(want[-1], with_hf_w[-1]) <= FP32_TOL
    assert rel_err(got[-1], with_sum_w[-1]) <= FP32_TOL
    assert rel_err(got[-1], want[-1]) > 0.1


def test_ernie45_top1_raises():
    model = tiny_model("ernie4_5_moe", num_experts_per_tok=1)
    with pytest.raises(UnsupportedMoEBlockError, match=r"ernie4_5_moe.*top-1"):
        replace_moe_blocks(model)


def test_ernie45_moe_norm_min_above_top_k_over_experts_raises():
    # 2 of 8 experts: the chosen probs sum to at least 0.25 without the bias
    model = tiny_model("ernie4_5_moe", moe_norm_min=0.3)
    with pytest.raises(UnsupportedMoEBlockError, match=r"ernie4_5_moe.*moe_norm_min=0.3.*0.25"):
        replace_moe_blocks(model)
    assert replace_moe_blocks(tiny_model("ernie4_5_moe", moe_norm_min=0.25)) == 1


def _llama4_reference(block, x: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """HF's Llama4TextMoe math with the dense router scores ``scores`` ``[T, E]`` given: every
    expert on every token, its input scaled by the token's score, plus the shared expert."""
    E, H = scores.shape[1], x.shape[-1]
    routed = block.experts(x.repeat(E, 1) * scores.T.reshape(-1, 1))
    return block.shared_expert(x) + routed.reshape(E, -1, H).sum(0)


def test_llama4_block_returns_hf_outputs_on_hf_weights():
    model = tiny_model("llama4")
    hf = model.model.layers[0].feed_forward
    x = torch.randn(2, 5, model.config.hidden_size)
    with torch.no_grad():
        want_out, want_logits = hf(x)
        want_scores, _ = hf.router(x.reshape(-1, x.shape[-1]))
    replace_moe_blocks(model)
    block = model.model.layers[0].feed_forward
    assert isinstance(block, MoECoreSparseMoeBlock) and "gate" not in block._modules
    with torch.no_grad():
        got_out, got_logits = block(x)
        scores, logits, routing_map = block.router(x.reshape(-1, x.shape[-1]))
    assert got_out.shape == want_out.shape == (10, model.config.hidden_size)
    assert rel_err(got_out, want_out) <= FP32_TOL and rel_err(got_logits, want_logits) <= FP32_TOL
    # the router's (dense scores, logits): HF's router output, and the map of the nonzero scores
    assert rel_err(scores, want_scores) <= FP32_TOL and torch.equal(logits, got_logits)
    assert torch.equal(routing_map, want_scores > 0) and routing_map.sum(-1).eq(1).all()
    # HF's [E, H, 2F] / [E, F, H] Parameters, read in place
    assert block.experts.gate_up_proj is hf.experts.gate_up_proj
    assert block.experts.down_proj is hf.experts.down_proj
    assert block.router.weight is hf.router.weight
    assert block.shared_expert is hf.shared_expert
    assert not hasattr(block.experts, "is_transposed")  # as HF's (PEFT's adapter layout)


def test_llama4_ranking_of_saturated_sigmoids_is_the_documented_difference():
    # a token whose two best logits (20 and 21) have the same fp32 sigmoid, 1.0: HF ranks the
    # logits and takes expert 1, moe-core ranks the sigmoid scores and takes the lower index,
    # expert 0, with the same weight; the other tokens agree
    model = tiny_model("llama4")
    hf = model.model.layers[0].feed_forward
    ours = _swapped(model).model.layers[0].feed_forward
    H, E = model.config.hidden_size, model.config.num_local_experts
    crafted = _logits_token(hf.router.weight, [20.0, 21.0, -5.0, -5.0])
    x = torch.cat([torch.randn(6, H), crafted])
    with torch.no_grad():
        want, _ = hf(x)
        got, _ = ours(x)
        scores, logits = hf.router(x)
        assert torch.sigmoid(logits[-1, :2]).tolist() == [1.0, 1.0]
        assert scores[-1].tolist() == [0.0, 1.0, 0.0, 0.0]
        ours_scores = torch.zeros(1, E)
        ours_scores[0, 0] = 1.0
        hf_rule = _llama4_reference(hf, x[-1:], scores[-1:])
        lower_index = _llama4_reference(hf, x[-1:], ours_scores)
    assert rel_err(got[:-1], want[:-1]) <= FP32_TOL
    assert rel_err(want[-1:], hf_rule) <= FP32_TOL
    assert rel_err(got[-1:], lower_index) <= FP32_TOL
    assert rel_err(got[-1:], want[-1:]) > 0.1


def test_llama4_top_k_above_1_raises():
    model = tiny_model("llama4", num_experts_per_tok=2)
    before = [type(m) for m in model.modules()]
    with pytest.raises(UnsupportedMoEBlockError,
                       match=r"llama4.*num_experts_per_tok=2.*top-1 routing only"):
        replace_moe_blocks(model)
    assert [type(m) for m in model.modules()] == before  # nothing replaced


def test_unknown_block_raises_naming_its_class():
    from torch import nn

    model = tiny_model("qwen3_moe")
    block = next(m for m in model.modules() if type(m).__name__ == "Qwen3MoeSparseMoeBlock")
    block.__class__ = type("SomeNewSparseMoeBlock", (nn.Module,), {})
    with pytest.raises(UnsupportedMoEBlockError, match="SomeNewSparseMoeBlock"):
        replace_moe_blocks(model)


def test_model_without_moe_blocks_is_left_alone():
    import transformers
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=1, num_attention_heads=4)
    assert replace_moe_blocks(transformers.LlamaForCausalLM(cfg)) == 0


def _dense_model():
    import transformers
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=1, num_attention_heads=4)
    return transformers.LlamaForCausalLM(cfg)


def test_model_without_moe_blocks_warns_naming_its_type():
    model = _dense_model()
    before = [type(m) for m in model.modules()]
    with pytest.warns(UserWarning, match=r"LlamaForCausalLM \(model_type 'llama'\) has no "
                                         r"sparse-MoE block"):
        assert replace_moe_blocks(model) == 0
    assert [type(m) for m in model.modules()] == before


def test_model_without_moe_blocks_raises_when_strict():
    model = _dense_model()
    before = [type(m) for m in model.modules()]
    with pytest.raises(ValueError, match=r"LlamaForCausalLM \(model_type 'llama'\) has no "
                                         r"sparse-MoE block"):
        replace_moe_blocks(model, strict=True)
    assert [type(m) for m in model.modules()] == before


def test_swapping_a_swapped_model_again_is_silent():
    model = tiny_model("mixtral")
    assert replace_moe_blocks(model) == model.config.num_hidden_layers
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert replace_moe_blocks(model, strict=True) == 0


def test_swapped_classes_have_readable_names_in_repr():
    model = tiny_model("mixtral")
    replace_moe_blocks(model)
    block = next(m for m in model.modules() if isinstance(m, MoECoreSparseMoeBlock))
    text = repr(model)
    assert "__CLS__" not in text and "__DOT__" not in text
    assert "(gate): MoECoreRouter[MixtralTopKRouter](" in text, text
    assert repr(block.gate).startswith("MoECoreRouter[MixtralTopKRouter](")
    # the pickle name stays the encoded one
    assert type(block.gate).__name__.startswith("MoECoreRouter__")


@pytest.mark.parametrize("family,norm", [("qwen2_moe", None), ("qwen2_moe_norm", True)])
def test_qwen2_moe_both_norm_topk_prob_rules(family, norm):
    # both of the family's settings swap to their own rule (each is also run against HF eager by
    # the per-family tests above); the two models route alike and weigh the chosen experts
    # differently
    model = tiny_model(family)
    assert model.config.norm_topk_prob == bool(norm)
    swapped = _swapped(model)
    assert _rule_of(swapped, "moe_router_norm_topk_prob") == {norm}
    block = swapped.model.layers[0].mlp
    x = torch.randn(5, model.config.hidden_size)
    with torch.no_grad():
        _, probs, routing_map = block.gate(x)
    assert routing_map.sum(-1).eq(2).all()
    sums = probs.sum(-1)
    if norm:
        assert torch.allclose(sums, torch.ones(5))
    else:
        assert (sums < 1 - 1e-3).all()


@pytest.mark.parametrize("family", ["mixtral", "gpt_oss"])
def test_swapped_block_output_is_no_view(family, monkeypatch):
    """The swapped block's [B, S, H] output owns its storage as far as autograd knows (FSDP2
    warns about a module returning a view), with the values and input gradient of the plain
    reshape it replaces (which is a view)."""
    import moe_core.hf.blocks as blocks

    model = _swapped(tiny_model(family))
    block = next(m for m in model.modules() if isinstance(m, MoECoreSparseMoeBlock))
    x = torch.randn(2, 5, model.config.hidden_size, requires_grad=True)
    g = torch.randn(2, 5, model.config.hidden_size)

    def run():
        out = block(x)
        out = out[0] if isinstance(out, tuple) else out
        return out, torch.autograd.grad(out, x, g)[0]

    out, gx = run()
    assert out.shape == x.shape and out._base is None
    monkeypatch.setattr(blocks, "unflattened", lambda t, shape: t.reshape(shape))
    view, view_gx = run()
    assert view._base is not None
    assert torch.equal(out, view) and torch.equal(gx, view_gx)
