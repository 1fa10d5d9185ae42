"""Where the routing path spends its GPU time: a torch.profiler kernel table of the fused router,
permute and unpermute, at the dsv3 shape with T = 16384 (E = 256, k = 8, groups and bias) or at
mixtral's (T = 8192, H = 4096, E = 8, k = 2, softmax), where permute's planning kernels weigh most.

    python -m benchmarks.profile_routing [--shape dsv3|mixtral] [--tokens N] [--hidden H]
"""
import argparse

import torch
from torch.profiler import ProfilerActivity, profile

import moe_core  # noqa: F401
from benchmarks.shapes import SHAPES, routing_options
from benchmarks.timing import sync
from moe_core import ops

# --shape: the shapes.py shape it profiles
PROFILED = {"dsv3": "dsv3_T16k", "mixtral": "mixtral"}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", choices=["dsv3", "mixtral"], default="dsv3")
    ap.add_argument("--tokens", type=int, default=None)
    ap.add_argument("--hidden", type=int, default=None)
    args = ap.parse_args()
    shape = SHAPES[PROFILED[args.shape]]
    T, H, E, k, _ = shape.dims()
    T, H = args.tokens or T, args.hidden or H
    logits = torch.randn(T, E, device="cuda")
    opts = routing_options(shape)
    if opts.pop("bias", False):
        opts["expert_bias"] = torch.randn(E, device="cuda") * 0.1
    tokens = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)

    def step() -> None:
        probs, routing_map = ops.topk_routing_with_score_function(logits, k, **opts)
        rows, _, sorted_indices, _, _ = ops.permute(tokens, routing_map, probs, num_out_tokens=T * k)
        ops.unpermute(rows, sorted_indices, (T, H))

    for _ in range(3):
        step()
    sync("cuda")
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            step()
        sync("cuda")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14,
                                    max_name_column_width=60))


if __name__ == "__main__":
    main()
