"""Router benchmark: moe-core's routing vs megatron-core's unfused routing, same device, same run.

For each reference shape (docs/design.md), times the forward and forward+backward of
topk_routing_with_score_function (dense [T, E] output, as Megatron's router uses it), reports the
time, the bytes it must move at least (read the fp32 logits, write the [T, E] probs and map), the
achieved bandwidth against the device-to-device copy bandwidth measured first, and the speed-up
over Megatron-Core. CUDA events, warm-up, median of many; on the CPU, wall-clock medians.

    python -m benchmarks.bench_router [--device cuda|cpu] [--iters N]
"""
import argparse
import warnings

import torch

import moe_core  # noqa: F401
from benchmarks.shapes import OP_SHAPES, SHAPES, routing_options
from benchmarks.timing import copy_bandwidth, median_ms
from moe_core import ops

warnings.filterwarnings("ignore")
from megatron.core.transformer.moe import moe_utils as mcore  # noqa: E402


def timer(device, fn, iters):
    """Median seconds of fn() over iters calls after 3 warm-up calls (timing.median_ms)."""
    return median_ms(lambda i: fn(), device, iters, warmup=3) / 1e3


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()
    dev = args.device
    torch.backends.cuda.matmul.allow_tf32 = False
    bw = copy_bandwidth(dev, args.iters)
    name_dev = torch.cuda.get_device_name() if dev == "cuda" else "cpu"
    print(f"device {name_dev}, torch {torch.__version__}, copy bandwidth {bw / 1e12:.3f} TB/s")
    rows = []
    for name in OP_SHAPES:
        T, _, E, k, _ = SHAPES[name].dims()
        o = routing_options(SHAPES[name])
        bias = torch.randn(E, device=dev) * 0.1 if o.pop("bias", False) else None
        kw = dict(topk=k, expert_bias=bias, **o)
        logits = torch.randn(T, E, device=dev, requires_grad=True)
        w = torch.randn(T, E, device=dev)
        bytes_fwd = T * E * (4 + 4 + 1)

        def fwd(f):
            with torch.no_grad():
                return f(logits, **kw)

        def fwd_bwd(f):
            p, _ = f(logits, **kw)
            (p * w).sum().backward()

        res = {}
        for label, f in (("ours", ops.topk_routing_with_score_function),
                         ("megatron", mcore.topk_routing_with_score_function)):
            res[label, "fwd"] = timer(dev, lambda: fwd(f), args.iters)
            res[label, "fwd+bwd"] = timer(dev, lambda: fwd_bwd(f), args.iters)
        for phase in ("fwd", "fwd+bwd"):
            t_ours, t_meg = res["ours", phase], res["megatron", phase]
            rows.append((name, phase, t_ours, t_meg, bytes_fwd / t_ours / bw * 100 if phase == "fwd" else None))
    print(f"{'shape':<14} {'phase':<8} {'ours ms':>9} {'mcore ms':>9} {'speed-up':>9} {'% copy bw':>10}")
    for name, phase, t_ours, t_meg, pct in rows:
        pct_s = f"{pct:9.1f}%" if pct is not None else " " * 10
        print(f"{name:<14} {phase:<8} {t_ours * 1e3:9.3f} {t_meg * 1e3:9.3f} {t_meg / t_ours:8.2f}x {pct_s}")


if __name__ == "__main__":
    main()
