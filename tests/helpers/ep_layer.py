"""The gloo expert-parallel layer tests' shapes, configurations and steps (CPU, small shapes):
the single-process layer with the global weights, the shard of it an EP rank holds, a global
batch of one shard per rank, and one forward + backward step.

Used by tests/ep/test_layer.py (the EP layer against the single-process layer) and
tests/ep/test_symm_mem.py (the emulated symmetric-memory exchange against the NCCL exchange)."""
from typing import Dict, Tuple

import torch
import torch.nn.functional as F

H, FFN, S, B = 16, 24, 6, 2

BASE = dict(hidden_size=H, moe_ffn_hidden_size=FFN, add_bias_linear=False, gated_linear_unit=True,
            activation_func=F.silu, moe_router_dtype="fp32")

CONFIGS = {
    "softmax_top2": dict(num_moe_experts=8, moe_router_topk=2, moe_aux_loss_coeff=1e-2,
                         moe_z_loss_coeff=1e-3),
    "sigmoid_groups_bias_top8_shared": dict(
        num_moe_experts=16, moe_router_topk=8, moe_router_score_function="sigmoid",
        moe_router_num_groups=8, moe_router_group_topk=4, moe_router_enable_expert_bias=True,
        moe_router_topk_scaling_factor=2.5, moe_shared_expert_intermediate_size=20,
        moe_router_load_balancing_type="seq_aux_loss", moe_aux_loss_coeff=1e-3),
    "latent_pre_softmax_top4_fp32": dict(
        num_moe_experts=8, moe_router_topk=4, moe_router_pre_softmax=True, moe_latent_size=12,
        moe_z_loss_coeff=1e-3, moe_aux_loss_coeff=1e-2, params_dtype=torch.float32),
}
MODES = {
    "dropless": dict(),
    "dropping": dict(moe_expert_capacity_factor=0.5),
    "drop_and_pad": dict(moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=True),
}


def config_kwargs(case: str, mode: str, dispatcher: str, dtype=torch.bfloat16) -> dict:
    """MoEConfig keyword arguments: ``BASE``, configuration ``case`` of ``CONFIGS``, ``mode`` of
    ``MODES`` and the dispatcher type; parameters in ``dtype`` unless the case sets its own."""
    kw = dict(BASE, params_dtype=dtype)
    kw.update(CONFIGS[case], **MODES[mode], moe_token_dispatcher_type=dispatcher)
    return kw


def global_layer(kw: dict):
    """The single-process layer with the global weights (seeded; a random expert bias)."""
    from moe_core import MoEConfig, MoELayer

    torch.manual_seed(0)
    layer = MoELayer(MoEConfig(**kw))
    if layer.router.expert_bias is not None:
        with torch.no_grad():
            layer.router.expert_bias.copy_(torch.randn(kw["num_moe_experts"]) * 0.05)
    return layer


def shard_state(layer, rank: int, world: int) -> dict:
    """The global layer's state dict with the experts of EP rank ``rank`` only."""
    sd = {k: v.clone() for k, v in layer.state_dict().items()}
    nle = layer.config.num_moe_experts // world
    for k in list(sd):
        if k.startswith("experts."):
            sd[k] = sd[k][rank * nle:(rank + 1) * nle]
    return sd


def global_batch(world: int, dtype, seed: int = 1) -> Tuple[torch.Tensor, torch.Tensor,
                                                            torch.Tensor]:
    """Inputs ``[world, S, B, H]``, output-gradient weights of the same shape, padding masks
    ``[world, B, S]`` (the last token of the first sequence of every shard is padding)."""
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(world, S, B, H, generator=g).to(dtype)
    G = torch.randn(world, S, B, H, generator=g)
    mask = torch.zeros(world, B, S, dtype=torch.bool)
    mask[:, 0, -1] = True
    return X, G, mask


def run_layer(layer, x, g, mask) -> Tuple[torch.Tensor, torch.Tensor, Dict[str, torch.Tensor]]:
    """Forward + backward of ``sum(out * g)``; returns (out, dx, losses)."""
    x = x.clone().requires_grad_(True)
    out = layer(x, padding_mask=mask)
    (out.float() * g).sum().backward()
    return out.detach(), x.grad, {k: v.clone() for k, v in layer.router.last_losses.items()}
