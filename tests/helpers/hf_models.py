"""Tiny random Hugging Face MoE models for the integration tests (tests/hf/), built from each
family's config class (nothing is downloaded), and the comparison helpers.

Weights: HF initialises routers to zero in some families (every logit equal: top-k would be all
ties), so the builders redraw the router weights at a scale that spreads the logits, and the
biases (DeepSeek-V3's and Ernie-4.5's expert bias, GPT-OSS's biases) so that they matter; the
routers' choices are then tie-free for the fixed inputs used here (``assert_tie_free`` checks it).
"""
from typing import Callable, Dict, Optional, Tuple

import torch
import transformers  # pinned in requirements-dev.txt: a missing install fails, not skips

VOCAB = 64
_COMMON = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=4, pad_token_id=0, bos_token_id=1, eos_token_id=2)
_MLA = dict(kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
            v_head_dim=8)


def _configs() -> Dict[str, Tuple[Callable, Callable]]:
    """family -> (config factory, model class)."""
    T = transformers
    return {
        "mixtral": (lambda: T.MixtralConfig(**_COMMON, head_dim=8, intermediate_size=16,
                                            num_local_experts=4, num_experts_per_tok=2),
                    T.MixtralForCausalLM),
        "qwen2_moe": (lambda: T.Qwen2MoeConfig(**_COMMON, intermediate_size=48,
                                               moe_intermediate_size=16,
                                               shared_expert_intermediate_size=24, num_experts=8,
                                               num_experts_per_tok=2),
                      T.Qwen2MoeForCausalLM),
        # the same with the chosen probs renormalised (Qwen2-MoE's default leaves them as they
        # are): the two routing rules of the family
        "qwen2_moe_norm": (lambda: T.Qwen2MoeConfig(**_COMMON, intermediate_size=48,
                                                    moe_intermediate_size=16,
                                                    shared_expert_intermediate_size=24,
                                                    num_experts=8, num_experts_per_tok=2,
                                                    norm_topk_prob=True),
                           T.Qwen2MoeForCausalLM),
        "qwen3_moe": (lambda: T.Qwen3MoeConfig(**_COMMON, head_dim=8, intermediate_size=48,
                                               moe_intermediate_size=16, num_experts=8,
                                               num_experts_per_tok=2, norm_topk_prob=True),
                      T.Qwen3MoeForCausalLM),
        "olmoe": (lambda: T.OlmoeConfig(**_COMMON, intermediate_size=16, num_experts=8,
                                        num_experts_per_tok=2),
                  T.OlmoeForCausalLM),
        "deepseek_v2": (lambda: T.DeepseekV2Config(**_COMMON, **_MLA, intermediate_size=48,
                                                   moe_intermediate_size=16, n_routed_experts=8,
                                                   num_experts_per_tok=2, n_group=4, topk_group=2,
                                                   topk_method="group_limited_greedy",
                                                   n_shared_experts=1, first_k_dense_replace=1),
                        T.DeepseekV2ForCausalLM),
        "deepseek_v3": (lambda: T.DeepseekV3Config(**_COMMON, **_MLA, intermediate_size=48,
                                                   moe_intermediate_size=16, n_routed_experts=8,
                                                   num_experts_per_tok=4, n_group=4, topk_group=2,
                                                   n_shared_experts=1, first_k_dense_replace=1),
                        T.DeepseekV3ForCausalLM),
        "glm4_moe": (lambda: T.Glm4MoeConfig(**_COMMON, head_dim=8, intermediate_size=48,
                                             moe_intermediate_size=16, n_routed_experts=8,
                                             num_experts_per_tok=3, n_group=4, topk_group=2,
                                             n_shared_experts=1, first_k_dense_replace=1),
                     T.Glm4MoeForCausalLM),
        "gpt_oss": (lambda: T.GptOssConfig(**_COMMON, head_dim=8, intermediate_size=16,
                                           num_local_experts=4, num_experts_per_tok=2,
                                           layer_types=["full_attention"] * 2),
                    T.GptOssForCausalLM),
        "ernie4_5_moe": (lambda: T.Ernie4_5_MoeConfig(**_COMMON, intermediate_size=48,
                                                      moe_intermediate_size=16, moe_num_experts=8,
                                                      moe_k=2, moe_num_shared_experts=1,
                                                      moe_layer_start_index=1),
                         T.Ernie4_5_MoeForCausalLM),
        "llama4": (lambda: T.Llama4TextConfig(**_COMMON, head_dim=8, intermediate_size=16,
                                              intermediate_size_mlp=48, num_local_experts=4,
                                              num_experts_per_tok=1),
                   T.Llama4ForCausalLM),
    }


ALL_FAMILIES = list(_configs())
# the families whose experts HF dispatches through its experts interface (the "moe_core" experts
# backend): all but Llama-4, whose experts module has no use_experts_implementation
FAMILIES = [f for f in ALL_FAMILIES if f != "llama4"]
# the families whose whole block moe-core swaps (replace_moe_blocks): all of them
SWAP_FAMILIES = list(ALL_FAMILIES)


def tiny_model(family: str, dtype: torch.dtype = torch.float32, seed: int = 0,
               experts_implementation: str = "eager", **overrides):
    """A tiny random ``*ForCausalLM`` of ``family`` in ``dtype`` (eval mode: no dropout);
    ``overrides`` replace fields of the family's tiny config (e.g. ``num_experts_per_tok``)."""
    make_config, cls = _configs()[family]
    cfg = make_config()
    for name, value in overrides.items():
        if not hasattr(cfg, name):
            raise AttributeError(f"{type(cfg).__name__} has no field {name!r}")
        setattr(cfg, name, value)
    cfg._experts_implementation = experts_implementation
    torch.manual_seed(seed)
    model = cls(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            router = name.endswith("gate.weight") or (family == "llama4"
                                                      and name.endswith("router.weight"))
            if router and p.dim() == 2:
                p.normal_(0.0, 0.5)  # spread the router logits (some families init them to 0)
            elif "bias" in name:
                p.normal_(0.0, 0.1)  # GPT-OSS's biases, Ernie's expert bias: so that they matter
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.1)
    model = model.to(dtype).eval()
    if dtype in (torch.bfloat16, torch.float16):
        # as from_pretrained(dtype=...) does: the family's fp32 modules stay fp32 (DeepSeek's
        # router weight and expert bias)
        keep = getattr(model, "_keep_in_fp32_modules_strict", None) or []
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            if any(k in name for k in keep):
                t.data = t.data.float()
    return model


def inputs(batch: int = 2, seq: int = 7, seed: int = 1) -> torch.Tensor:
    """``[batch, seq]`` int64 token ids (no special tokens)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (batch, seq), generator=g)


def run_step(model, ids: torch.Tensor, autocast: Optional[torch.dtype] = None,
             **kwargs) -> Tuple[torch.Tensor, Dict[str, torch.Tensor], object]:
    """Forward with labels and backward: ``(logits, {name: grad}, output)``; with ``autocast``
    the forward runs in ``torch.autocast("cpu", dtype=autocast)`` (the backward outside it)."""
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
        out = model(ids, labels=ids, **kwargs)
    loss = out.loss
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()
             if p.grad is not None}
    return out.logits.detach().float(), grads, out


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """``||a - b|| / ||b||`` in fp64 (0 when both are zero)."""
    a, b = a.double(), b.double()
    den = b.norm().item()
    return (a - b).norm().item() / den if den > 0 else (a - b).norm().item()


def assert_close_grads(got: Dict[str, torch.Tensor], want: Dict[str, torch.Tensor],
                       tol: float) -> None:
    assert sorted(got) == sorted(want)
    bad = {n: rel_err(got[n], want[n]) for n in want if rel_err(got[n], want[n]) > tol}
    assert not bad, f"gradients off by more than {tol} relative: {bad}"


def assert_fp32_grads_close(got: Dict[str, torch.Tensor], want: Dict[str, torch.Tensor],
                            want64: Dict[str, torch.Tensor], tol: float = 1e-6) -> None:
    """fp32 gradients: within ``tol`` relative of HF's fp32 ones, or, for a tensor that HF's fp32
    model itself gets only to ``e`` relative of its fp64 value (a sum with cancellation, such as
    a router bias's gradient), within ``2 e``."""
    assert sorted(got) == sorted(want)
    bad = {}
    for n in want:
        limit = max(tol, 2 * rel_err(want[n], want64[n]))
        if rel_err(got[n], want[n]) > limit:
            bad[n] = (rel_err(got[n], want[n]), limit)
    assert not bad, f"gradients off (error, limit): {bad}"


def assert_mixed_grads_close(got: Dict[str, torch.Tensor], hf: Dict[str, torch.Tensor],
                             want: Dict[str, torch.Tensor]) -> None:
    """fp32 parameters trained under bf16 autocast: every gradient fp32, and no further from
    the fp32 model's (``want``) than twice HF eager's own distance under the same autocast
    (``hf``) plus 1e-2 (bf16's tolerance of the bf16 tests)."""
    assert sorted(got) == sorted(want)
    for name, ref in want.items():
        assert got[name].dtype == torch.float32, name
        assert rel_err(got[name], ref) <= 2 * rel_err(hf[name], ref) + 1e-2, name


def assert_tie_free(router_logits, top_k: int, margin: float = 0.0) -> None:
    """Every token's k-th and (k+1)-th router logits differ (so top-k is unambiguous)."""
    for logits in router_logits:
        v = logits.float().topk(top_k + 1, dim=-1).values
        gaps = (v[:, :-1] - v[:, 1:]).abs()
        assert (gaps > margin).all(), "router logits with ties: pick another seed"
