"""The CUDA expert-parallel tests' shapes, configurations, layers, batches and comparisons.

Small shapes (T = S·B = 256 tokens, H = 256, E = 8, F = 512, bf16 parameters, fp32 router); every
tensor lives on the current CUDA device. Used by the NCCL world of one (tests/ep/
test_nccl_single_gpu.py, tests/ep/test_symm_mem_gpu.py; its process group is the ``group``
fixture of tests/ep/conftest.py) and by the ranks of tests/ep/test_symm_mem_multi_gpu.py (one GPU
each).
"""
import contextlib
from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F

from moe_core import MoEConfig, MoELayer

S, B, H, E, FFN = 128, 2, 256, 8, 512

BASE = dict(hidden_size=H, moe_ffn_hidden_size=FFN, num_moe_experts=E, add_bias_linear=False,
            gated_linear_unit=True, activation_func=F.silu, params_dtype=torch.bfloat16,
            moe_router_dtype="fp32")
CONFIGS = {
    "softmax_top2": dict(moe_router_topk=2, moe_aux_loss_coeff=1e-2, moe_z_loss_coeff=1e-3),
    "sigmoid_groups_bias_top4_shared": dict(
        moe_router_topk=4, moe_router_score_function="sigmoid", moe_router_num_groups=4,
        moe_router_group_topk=2, moe_router_enable_expert_bias=True,
        moe_router_topk_scaling_factor=2.5, moe_shared_expert_intermediate_size=384,
        moe_router_load_balancing_type="seq_aux_loss", moe_aux_loss_coeff=1e-3),
}
MODES = {
    "dropless": dict(),
    "dropping": dict(moe_expert_capacity_factor=0.5),
    "drop_and_pad": dict(moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=True),
}


def config_kwargs(case: str, mode: str, dispatcher: str, **extra) -> dict:
    """MoEConfig keyword arguments: ``BASE``, configuration ``case`` of ``CONFIGS``, ``mode`` of
    ``MODES``, the dispatcher type and ``extra``."""
    return dict(BASE, **CONFIGS[case], **MODES[mode], moe_token_dispatcher_type=dispatcher, **extra)


def make_layer(kw: dict, ep_group=None, state: Optional[dict] = None, build: str = "moved",
               exchange: bool = True) -> MoELayer:
    """A layer on the GPU: built on the CPU then moved (``build="moved"``) or built under
    ``with torch.device("cuda")`` (``"device_context"``); seeded weights, or ``state``. An EP
    layer runs its collectives at one rank too (``exchange``; its dispatcher skips these
    identities at one rank by default) unless ``exchange=False``."""
    torch.manual_seed(0)
    cfg = MoEConfig(**kw)
    extra = dict(tp_dp_cp_group=ep_group) if ep_group is not None else {}
    if build == "device_context":
        with torch.device("cuda"):
            layer = MoELayer(cfg, ep_group=ep_group, **extra)
    else:
        layer = MoELayer(cfg, ep_group=ep_group, **extra).cuda()
    if exchange and layer.dispatcher is not None and hasattr(layer.dispatcher, "exchange"):
        layer.dispatcher.exchange = True
    if state is not None:
        layer.load_state_dict(state)
    elif layer.router.expert_bias is not None:
        with torch.no_grad():
            layer.router.expert_bias.copy_(torch.randn(E, device="cuda") * 0.05)
    return layer.train()


def batch(seed: int = 1) -> Tuple[torch.Tensor, torch.Tensor]:
    """Input ``[S, B, H]`` (bf16) and output-gradient weights ``[S, B, H]`` (fp32), seeded."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(S, B, H, device="cuda", generator=g).to(torch.bfloat16)
    w = torch.randn(S, B, H, device="cuda", generator=g)
    return x, w


def run_step(module, layer: MoELayer, x: torch.Tensor, w: torch.Tensor) -> dict:
    """Forward + backward of ``sum(out * w)`` through ``module`` (the layer or its compiled
    form); returns the output, the input gradient, the parameter gradients and the losses, and
    clears the gradients."""
    x = x.clone().requires_grad_(True)
    out = module(x)
    (out.float() * w).sum().backward()
    torch.cuda.synchronize()
    res = {"out": out.detach(), "dx": x.grad}
    for n, p in layer.named_parameters():
        res[f"grad {n}"] = p.grad.clone() if p.grad is not None else None
    for k, v in layer.router.last_losses.items():
        res[f"loss {k}"] = v.clone()
    layer.zero_grad(set_to_none=True)
    return res


def bitwise_differences(got: dict, want: dict) -> List[str]:
    """What differs between two ``run_step`` results, one line per entry (empty: bitwise
    equal, the same keys, the same gradients missing)."""
    if sorted(got) != sorted(want):
        return [f"keys {sorted(got)} vs {sorted(want)}"]
    bad = []
    for k in want:
        a, b = got[k], want[k]
        if a is None or b is None:
            if a is not b:
                bad.append(f"{k}: gradient missing on one side")
            continue
        if not torch.equal(a, b):
            diff = (a.double() - b.double()).abs().max().item()
            bad.append(f"{k}: max |diff| {diff:.3e} (scale {b.double().abs().max().item():.3e})")
    return bad


def assert_bitwise(got: dict, want: dict, what: str) -> None:
    """``got`` and ``want`` (``run_step`` results) are bitwise equal; the message lists what
    differs."""
    assert sorted(got) == sorted(want), f"{what}: {sorted(got)} vs {sorted(want)}"
    bad = bitwise_differences(got, want)
    assert not bad, f"{what} differ:\n  " + "\n  ".join(bad)


@contextlib.contextmanager
def no_blocking_sync():
    """Any stream-blocking operation inside raises (sync-debug mode "error")."""
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")
