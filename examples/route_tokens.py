"""Routes real tokens through moe-core's router and prints what it chose.

The tokens are real text (this file and a few modules of the Python standard library), embedded
with a fixed random table; a router (moe_core.ops.router_gating_linear + topk routing) assigns each
token to its top-k experts with DeepSeek-V3-style sigmoid scores, 8 expert groups, group-limited
top-k and an expert bias. It prints a few tokens with their experts, then nudges the expert bias
the aux-loss-free way (bias += rate * sign(mean load - load)) for a few steps and shows the load
evening out: selection moves, probs stay those of the unbiased scores.
Runs on the CPU by default, on a GPU when one is present.
"""
import argparse
import inspect
import json
import os
import re

import torch

from moe_core import ops


def read_tokens(max_tokens: int) -> list:
    import collections
    import functools

    text = "".join(inspect.getsource(m) for m in (collections, functools, json))
    return re.findall(r"[A-Za-z_]+|[^\sA-Za-z_]", text)[:max_tokens]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    torch.manual_seed(0)

    words = read_tokens(args.tokens)
    vocab = {w: i for i, w in enumerate(sorted(set(words)))}
    ids = torch.tensor([vocab[w] for w in words])
    embed = torch.randn(len(vocab), args.hidden) / args.hidden**0.5
    hidden = embed[ids].to(torch.bfloat16).to(args.device)          # [T, H] bf16
    weight = torch.randn(args.experts, args.hidden).to(torch.bfloat16).to(args.device)
    expert_bias = torch.zeros(args.experts, device=args.device)
    per_group = args.experts // 8

    logits = ops.router_gating_linear(hidden, weight, None, torch.float32)       # [T, E] fp32

    def route():
        return ops.topk_routing_with_score_function(
            logits, args.topk, num_groups=8, group_topk=4, scaling_factor=2.5,
            score_function="sigmoid", expert_bias=expert_bias, dense_output=True,
        )                                                                          # [T, k] each

    def describe(experts, label):
        load = torch.bincount(experts.flatten(), minlength=args.experts).float()
        print(f"{label}: tokens per expert min {int(load.min())}, max {int(load.max())}, "
              f"max/mean {(load.max() / load.mean()).item():.2f}, "
              f"coefficient of variation {(load.std() / load.mean()).item():.3f}")
        return load

    probs, experts = route()
    print(f"routed {len(words)} tokens of real text on {args.device}: hidden {args.hidden}, "
          f"{args.experts} experts in 8 groups, top-{args.topk}, at most 4 groups per token")
    groups_used = max(len(set(e // per_group for e in row)) for row in experts.tolist())
    print(f"most groups any token touched: {groups_used}; probs sum to the scaling factor: "
          f"{probs.float().sum(-1).min().item():.3f}..{probs.float().sum(-1).max().item():.3f}")
    for t in range(0, min(len(words), 30), 5):
        chosen = ", ".join(f"{e}:{p:.2f}" for e, p in zip(experts[t].tolist(), probs[t].float().tolist()))
        print(f"  {words[t]!r:>14} -> {chosen}")
    load = describe(experts, "before balancing")
    for _ in range(300):
        expert_bias += 1e-3 * torch.sign(load.mean() - load)
        probs, experts = route()
        load = torch.bincount(experts.flatten(), minlength=args.experts).float()
    describe(experts, "after 300 expert-bias updates")


if __name__ == "__main__":
    main()
