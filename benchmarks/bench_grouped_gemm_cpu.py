"""Grouped expert GEMM on the CPU: moe-core's C kernel vs a per-expert torch.mm loop, same dtype,
same threads, same run.

For each shape (tokens spread over the experts by a random top-k routing), times forward, dgrad
and wgrad for fc1 (K=hidden, N=ffn) and fc2 (K=ffn, N=hidden) in the Megatron weight layout
([E, N, K], trans_w=True), and prints GFLOP/s (2·rows·K·N per product) and the ratio to torch.
The torch loop writes into preallocated outputs with torch.mm(out=...) so neither side pays for
a concatenation. Wall-clock after warm-up, the two sides called alternately; the table gives the
best time of each (the machine this was written on is shared) and the ratio of the medians.

    python -m benchmarks.bench_grouped_gemm_cpu [--threads N] [--iters N] [--dtypes fp32,bf16]
"""
import argparse

import torch

import moe_core  # noqa: F401
from benchmarks.shapes import CPU_GEMM_SHAPES as SHAPES
from benchmarks.timing import paired_times
from moe_core import ops

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def routed_offsets(tokens, experts, topk):
    idx = torch.rand(tokens, experts).argsort(dim=1)[:, :topk]
    counts = torch.bincount(idx.flatten(), minlength=experts)
    return torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)])


def torch_loop(kind, a, b, off, out):
    o = off.tolist()
    for e in range(len(o) - 1):
        r0, r1 = o[e], o[e + 1]
        if kind == "fwd":  # y = x · Wᵀ, W [N, K]
            torch.mm(a[r0:r1], b[e].t(), out=out[r0:r1])
        elif kind == "dgrad":  # dx = dy · W
            torch.mm(a[r0:r1], b[e], out=out[r0:r1])
        else:  # dW = dyᵀ · x
            torch.mm(b[r0:r1].t(), a[r0:r1], out=out[e])


def bench(name, tokens, hidden, experts, topk, ffn, dtype, iters):
    off = routed_offsets(tokens, experts, topk)
    rows = int(off[-1])
    rows_line = f"rows {rows}, per expert min {int(off.diff().min())} max {int(off.diff().max())}"
    print(f"\n{name}: tokens {tokens} hidden {hidden} experts {experts} topk {topk} ffn {ffn} "
          f"{dtype} ({rows_line})")
    print(f"{'gemm':>5} {'product':>7} {'ours ms':>9} {'torch ms':>9} {'ours GF/s':>10} "
          f"{'torch GF/s':>10} {'ratio':>6} {'(median ratio)':>15}")
    for gemm, K, N in (("fc1", hidden, ffn), ("fc2", ffn, hidden)):
        x = torch.randn(rows, K).to(dtype)
        w = (torch.randn(experts, N, K) / K**0.5).to(dtype)
        dy = torch.randn(rows, N).to(dtype)
        flops = 2.0 * rows * K * N
        cases = {
            "fwd": (lambda: ops.grouped_gemm(x, w, off, True),
                    lambda o=torch.empty(rows, N, dtype=dtype): torch_loop("fwd", x, w, off, o)),
            "dgrad": (lambda: ops.grouped_gemm_dgrad(dy, w, off, True),
                      lambda o=torch.empty(rows, K, dtype=dtype): torch_loop("dgrad", dy, w, off, o)),
            "wgrad": (lambda: ops.grouped_gemm_wgrad(x, dy, off, True),
                      lambda o=torch.empty(experts, N, K, dtype=dtype): torch_loop("wgrad", x, dy, off, o)),
        }
        for prod, (ours, ref) in cases.items():
            (t_ours, m_ours), (t_ref, m_ref) = paired_times(ours, ref, iters)
            print(f"{gemm:>5} {prod:>7} {t_ours * 1e3:9.2f} {t_ref * 1e3:9.2f} "
                  f"{flops / t_ours / 1e9:10.1f} {flops / t_ref / 1e9:10.1f} {t_ref / t_ours:6.2f} "
                  f"{m_ref / m_ours:15.2f}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--iters", type=int, default=7)
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--shapes", default=",".join(s[0] for s in SHAPES))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {args.threads} threads, CPU")
    for d in args.dtypes.split(","):
        for shape in SHAPES:
            if shape[0] in args.shapes.split(","):
                bench(*shape, DTYPES[d], args.iters)


if __name__ == "__main__":
    main()
