"""MoELayer on the CPU: moe-core's layer vs megatron-core's MoELayer (allgather dispatcher, local
SequentialMLP experts), same weights, same inputs, same threads, same run.

Times a training step of the layer (forward + backward) and the forward alone, at a few small
shapes that fit a laptop-class CPU, and prints the medians and the ratio. Megatron runs its
unfused eager path (the only one it has on a CPU), with a host sync for the per-expert split;
ours runs the custom ops with no host sync.

    python -m benchmarks.bench_layer_cpu [--iters N] [--threads N]
"""
import argparse

import torch
import torch.nn.functional as F

from benchmarks.shapes import CPU_LAYER_SHAPES as SHAPES
from benchmarks.timing import median_ms
from moe_core import MoEConfig, MoELayer, load_megatron_state_dict
from moe_core.ops import AuxLossScale
from tests.helpers import megatron_layer  # Megatron's CPU MoELayer, as the parity tests build it


def median_time(fn, iters):
    """Median wall-clock seconds of fn() over iters calls after one warm-up call."""
    return median_ms(lambda i: fn(), "cpu", iters, warmup=1) / 1e3


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, CPU")
    print(f"{'shape':<16} {'phase':<9} {'ours ms':>9} {'mcore ms':>9} {'speed-up':>9}")
    for name, S, B, H, E, k, F_, dt in SHAPES:
        kw = dict(hidden_size=H, moe_ffn_hidden_size=F_, num_moe_experts=E, moe_router_topk=k,
                  add_bias_linear=False, gated_linear_unit=True, activation_func=F.silu,
                  params_dtype=dt, bf16=dt == torch.bfloat16, moe_router_dtype="fp32",
                  moe_aux_loss_coeff=1e-2)
        if E >= 64:
            kw.update(moe_router_score_function="sigmoid", moe_router_num_groups=8,
                      moe_router_group_topk=4, moe_router_topk_scaling_factor=2.5)
        meg = megatron_layer.build(**kw)
        ours = MoELayer(MoEConfig.from_megatron(meg.config))
        load_megatron_state_dict(ours, meg.state_dict())
        x = torch.randn(S, B, H).to(dt)
        g = torch.randn(S, B, H).to(dt)
        megatron_layer.set_loss_scale(1.0)

        def step_meg():
            xr = x.clone().requires_grad_()
            out, _ = meg(xr)
            out.backward(g)

        def step_ours():
            xr = x.clone().requires_grad_()
            with AuxLossScale(1.0):
                out = ours(xr)
            out.backward(g)

        def fwd_meg():
            with torch.no_grad():
                meg(x)

        def fwd_ours():
            with torch.no_grad():
                ours(x)

        for phase, f_ours, f_meg in (("fwd", fwd_ours, fwd_meg), ("fwd+bwd", step_ours, step_meg)):
            t_ours, t_meg = median_time(f_ours, args.iters), median_time(f_meg, args.iters)
            print(f"{name:<16} {phase:<9} {t_ours * 1e3:9.1f} {t_meg * 1e3:9.1f} {t_meg / t_ours:8.2f}x")


if __name__ == "__main__":
    main()
