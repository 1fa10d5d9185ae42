"""Compares each grouped GEMM of the experts reading its rows by index (A) with the same GEMM on
the materialised rows (B), at the layer's shapes.

The four products of the rows-by-index path (``expert_mlp(rows=None)``) and its tokens'
gradient, at a reference layer's sizes, bf16, rows in ``permute``'s order (experts in turn,
tokens ascending within an expert: the order the layer reads them in), uniform random top-k:

  fc1 fwd      grouped_gemm(tokens, W1, x_index=idx)            vs grouped_gemm(tokens[idx], W1)
  fc2 dgrad    grouped_gemm_dgrad(d_out, W2, grad_y_index=idx)  vs on d_out[idx]
  dW1          grouped_gemm_wgrad(tokens, grad_a, x_index=idx)  vs on tokens[idx]
  dW2          grouped_gemm_wgrad(h, d_out, grad_y_index=idx)   vs on d_out[idx]
  tokens grad  fc1's dgrad in expert_mlp's row chunks, each added into the fp32 accumulator
               (permute_bwd_accumulate_), then rounded  vs one dgrad and permute_bwd

For the four products a third column (C) times the rows gathered first by the row-copy kernel
(``unpermute_bwd``, as expert_mlp makes its transient copies) and then the GEMM on them: what a
transient copy of the operand would cost in place of the gathered load, so "A / C" below 1 means
reading by index beats copying the rows first.

"bits" says whether A and B agree bit for bit (the tokens' gradient may not where the Hopper
kernel splits a partial last wave: see expert_mlp's precision contract). Timing: median of
ROUNDS interleaved rounds (benchmarks/timing.py), CUDA events. The CPU runs a smoke size.

    python3 -m tools.gg_gather_ab
    python3 -m tools.gg_gather_ab --shapes dsv3_like --rounds 20
    python3 -m tools.gg_gather_ab --device cpu --shapes tiny --rounds 2
"""
import argparse

import torch

import moe_core  # noqa: F401  (registers the ops)
from benchmarks.shapes import REFERENCE, SHAPES
from benchmarks.timing import time_interleaved
from moe_core import ops
from moe_core.ops.expert_mlp import _gather_rows  # the row copy expert_mlp runs

OPS = torch.ops.moe_core


def cases(name: str, dev: torch.device, dt: torch.dtype):
    """name -> (gathered call, materialised call, gather-then-materialised call or None)."""
    s = SHAPES[name]
    T, H, E, k, F = s.tokens, s.hidden, s.experts, s.topk, s.ffn
    R = T * k
    g = torch.Generator(device=dev).manual_seed(0)
    top = torch.rand(T, E, device=dev, generator=g).topk(k, dim=1).indices
    routing_map = torch.zeros(T, E, dtype=torch.bool, device=dev).scatter_(1, top, True)
    # the layout alone: permute of a one-column view, as the layer does when it reads by index
    _, _, idx, off, _ = ops.permute(torch.zeros(T, 1, device=dev, dtype=dt), routing_map, None,
                                    num_out_tokens=R)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, device=dev, generator=g) * scale).to(dt)

    x, d_out = randn(T, H), randn(T, H)
    rows, d_rows = x[idx], d_out[idx]
    w1, w2 = randn(E, 2 * F, H, scale=H ** -0.5), randn(E, H, F, scale=F ** -0.5)
    grad_a, h = randn(R, 2 * F), randn(R, F)
    # expert_mlp's chunk count: each chunk's rows' gradient no larger than the fp32 accumulator
    chunks = max(1, -(-(R * grad_a.element_size()) // (4 * T)))

    def tokens_grad_chunked():
        acc = torch.zeros(T, H, device=dev, dtype=torch.float32)
        for c in range(chunks):
            lo, hi = c * R // chunks, (c + 1) * R // chunks
            d = OPS.grouped_gemm_dgrad(grad_a[lo:hi], w1, (off - lo).clamp(0, hi - lo), True, dt)
            OPS.permute_bwd_accumulate_(acc, d, idx[lo:hi], 0)
        return acc.to(dt)

    def tokens_grad_whole():
        d = OPS.grouped_gemm_dgrad(grad_a, w1, off, True, dt)
        return OPS.permute_bwd(d, None, idx, off, T)[0]

    def gather(t):  # expert_mlp's transient copy: t[idx], a zero row where idx is -1
        return _gather_rows(t, idx)

    return {
        "fc1 fwd": (lambda: ops.grouped_gemm(x, w1, off, True, None, idx),
                    lambda: ops.grouped_gemm(rows, w1, off, True),
                    lambda: ops.grouped_gemm(gather(x), w1, off, True)),
        "fc2 dgrad": (lambda: ops.grouped_gemm_dgrad(d_out, w2, off, True, None, idx),
                      lambda: ops.grouped_gemm_dgrad(d_rows, w2, off, True),
                      lambda: ops.grouped_gemm_dgrad(gather(d_out), w2, off, True)),
        "dW1": (lambda: ops.grouped_gemm_wgrad(x, grad_a, off, True, None, x_index=idx),
                lambda: ops.grouped_gemm_wgrad(rows, grad_a, off, True),
                lambda: ops.grouped_gemm_wgrad(gather(x), grad_a, off, True)),
        "dW2": (lambda: ops.grouped_gemm_wgrad(h, d_out, off, True, None, grad_y_index=idx),
                lambda: ops.grouped_gemm_wgrad(h, d_rows, off, True),
                lambda: ops.grouped_gemm_wgrad(h, gather(d_out), off, True)),
        f"tokens grad ({chunks} chunks)": (tokens_grad_chunked, tokens_grad_whole, None),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default=",".join(REFERENCE),
                    help=f"comma-separated, of {sorted(SHAPES)}")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    args = ap.parse_args()
    dev = torch.device(args.device)
    names = [n for n in args.shapes.split(",") if n]
    for n in names:
        if n not in SHAPES:
            ap.error(f"--shapes: {n!r} is not one of {sorted(SHAPES)}")
    where = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "CPU"
    print(f"gg_gather_ab: {where}; torch {torch.__version__}; median of {args.rounds} rounds")
    print("| shape | product | by index ms (A) | rows made ms (B) | A / B | rows copied, then "
          "made ms (C) | A / C | bits |")
    print("|---|---|---|---|---|---|---|---|")
    for name in names:
        for what, (gathered, made, copied) in cases(name, dev, torch.bfloat16).items():
            ref = made()
            same = torch.equal(gathered(), ref) and (copied is None or torch.equal(copied(), ref))
            del ref
            variants = {"a": (lambda _i: gathered(), lambda: None),
                        "b": (lambda _i: made(), lambda: None)}
            if copied is not None:
                variants["c"] = (lambda _i: copied(), lambda: None)
            t = time_interleaved(variants, dev, args.warmup, args.rounds)
            c = (f"{t['c']:.3f} | {t['a'] / t['c']:.2f}x" if copied is not None else " | ")
            print(f"| {name} | {what} | {t['a']:.3f} | {t['b']:.3f} | {t['a'] / t['b']:.2f}x | "
                  f"{c} | {'same' if same else 'differ'} |", flush=True)


if __name__ == "__main__":
    main()
