"""The training run of tests/hardening/test_resume.py, shared by the test and the fresh process it
starts: a tiny CPU layer with every piece of router state (expert bias and its running token
counts, the global aux loss's running counts, a bound aux-loss scale), its batches, steps and
checkpoint contents.

``python -m helpers.resume CKPT OUT`` (tests/ on the path) is the second process: it loads the
checkpoint CKPT into a layer built from another seed, trains the remaining steps and saves the
result to OUT.
"""
import sys
from typing import List, Tuple

import torch
import torch.nn.functional as F

from moe_core import MoEConfig, MoELayer, reset_global_aux_loss, update_expert_bias
from moe_core.ops import AuxLossScale

H, T, E = 16, 24, 8
TOTAL_STEPS, SAVE_AFTER = 5, 3
GLOBAL_BATCH_STEPS = 2  # optimizer steps per expert-bias update / global aux-loss reset
AUX_SCALE = 0.5  # the router's bound aux-loss scale (not the default 1.0, so it must be restored)


def config() -> MoEConfig:
    """Sigmoid router with expert bias, the global aux loss and the z-loss; fp32 on the CPU."""
    return MoEConfig(hidden_size=H, moe_ffn_hidden_size=24, num_moe_experts=E, moe_router_topk=2,
                     add_bias_linear=False, gated_linear_unit=True, activation_func=F.silu,
                     moe_router_dtype="fp32", moe_router_score_function="sigmoid",
                     moe_router_enable_expert_bias=True, moe_router_bias_update_rate=1e-3,
                     moe_router_load_balancing_type="global_aux_loss", moe_aux_loss_coeff=1e-1,
                     moe_z_loss_coeff=1e-3)


def build(seed: int, bind_scale: bool = True) -> Tuple[MoELayer, torch.optim.Adam]:
    torch.manual_seed(seed)
    layer = MoELayer(config())
    if bind_scale:
        layer.router.aux_loss_scale = AuxLossScale(AUX_SCALE)
    return layer, torch.optim.Adam(layer.parameters(), lr=1e-2)


def batch(step: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s input and target ``[T, H]`` fp32, the same in every process."""
    gen = torch.Generator().manual_seed(1000 + step)
    return torch.randn(T, H, generator=gen), torch.randn(T, H, generator=gen)


def train(layer: MoELayer, opt: torch.optim.Adam, steps: range) -> List[torch.Tensor]:
    """Training steps ``steps`` (global step numbers); returns each step's main loss and aux
    losses stacked ``[3]`` fp32 (mse, global aux loss, z-loss)."""
    losses = []
    for step in steps:
        x, target = batch(step)
        loss = F.mse_loss(layer(x), target)
        opt.zero_grad()
        loss.backward()
        opt.step()
        last = layer.router.last_losses
        losses.append(torch.stack([loss.detach(), last["global_load_balancing_loss"],
                                   last["z_loss"]]))
        if (step + 1) % GLOBAL_BATCH_STEPS == 0:
            update_expert_bias(layer)
            reset_global_aux_loss(layer)
    return losses


def snapshot(layer: MoELayer, opt: torch.optim.Adam, losses: List[torch.Tensor]) -> dict:
    return {"model": layer.state_dict(), "optim": opt.state_dict(), "losses": losses}


def resume(ckpt: str, out: str) -> None:
    """The second process: a layer built from another seed, without a bound scale, loads the
    checkpoint and trains the remaining steps; its state goes to ``out``."""
    layer, opt = build(seed=99, bind_scale=False)
    saved = torch.load(ckpt)
    assert not torch.equal(layer.router.weight, saved["model"]["router.weight"])
    result = layer.load_state_dict(saved["model"])
    assert not result.missing_keys and not result.unexpected_keys, result
    opt.load_state_dict(saved["optim"])
    losses = train(layer, opt, range(SAVE_AFTER, TOTAL_STEPS))
    torch.save(snapshot(layer, opt, losses), out)


if __name__ == "__main__":
    resume(sys.argv[1], sys.argv[2])
