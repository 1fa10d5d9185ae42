"""Where our whole layer's forward + backward spends its GPU time and its memory, per reference shape.

Three tables per shape (``bench_ep``'s layer builders, bf16, dropless, the same layer that
``bench_layer.py`` times):

* kernels: a ``torch.profiler`` table of one forward + backward (after a warm-up), the GPU time
  of each kernel summed over the step, largest first, with its share of the step;
* saved for backward: every tensor autograd keeps between forward and backward (a
  ``saved_tensors_hooks`` pack hook), by shape and dtype, each storage counted once, the storages
  the layer's caller owns (its input, the parameters) marked and left out of the total;
* memory: allocated after the forward above what was there before it (saved activations plus
  the output), and the peak during forward + backward above that base, with and without the
  parameter gradients.

    python -m benchmarks.profile_layer [--shapes mixtral,qwen3_30b_a3b,dsv3_like] [--top 15]
        [--device cuda|cpu] [--gaps 20] [--trace /tmp/out/trace]
    python -m benchmarks.profile_layer --shapes tiny --device cpu     (smoke: no kernel table)
    python -m benchmarks.profile_layer --device meta   (what is saved for backward at the reference
                                                        shapes, from shapes alone: no GPU)
"""
import argparse
from collections import defaultdict
from typing import Dict, List, Tuple

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.bench_ep import build_ours, moe_kwargs, set_rows_by_index
from benchmarks.shapes import SHAPES
from benchmarks.step_kernels import busy_us, cuda_kernels, is_gemm
from benchmarks.timing import held_after_forward, peak_bytes, sync

GiB = float(1 << 30)


def saved_breakdown(layer, x: torch.Tensor, g: torch.Tensor) -> Tuple[List[str], float]:
    """The tensors autograd saves in one forward (unique storages), as table lines, and the
    bytes of those the caller does not own already."""
    # a storage by its implementation's address (meta storages all have data_ptr 0), alive
    # throughout: every storage seen is saved, so none is freed and its address reused
    owned = {p.untyped_storage()._cdata for p in layer.parameters()}
    owned.add(x.untyped_storage()._cdata)
    seen: Dict[int, Tuple[str, int, bool]] = {}

    def pack(t: torch.Tensor):
        if t.numel():
            s = t.untyped_storage()
            key = s._cdata
            if key not in seen:
                seen[key] = (f"{list(t.shape)} {str(t.dtype).replace('torch.', '')}", s.nbytes(),
                             key in owned)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = layer(x)
    out.backward(g)
    free_grads(layer, x)
    groups: Dict[Tuple[str, bool], List[int]] = defaultdict(list)
    for desc, nbytes, is_owned in seen.values():
        groups[(desc, is_owned)].append(nbytes)
    lines, total = [], 0.0
    for (desc, is_owned), sizes in sorted(groups.items(), key=lambda kv: -sum(kv[1])):
        b = sum(sizes)
        if not is_owned:
            total += b
        lines.append(f"  {b / GiB:8.3f} GiB  {len(sizes):3d} x {desc}"
                     + ("  (caller's: input or parameter)" if is_owned else ""))
    return lines, total


def free_grads(layer, x: torch.Tensor) -> None:
    """As bench_layer does between calls: every backward allocates its gradients afresh."""
    for t in list(layer.parameters()) + [x]:
        t.grad = None


def kernel_table(layer, x: torch.Tensor, g: torch.Tensor, top: int, gaps: int,
                 trace: str) -> List[str]:
    for _ in range(2):
        layer(x).backward(g)
        free_grads(layer, x)
    sync(x.device)
    activities = [ProfilerActivity.CUDA] + ([ProfilerActivity.CPU] if gaps or trace else [])
    with profile(activities=activities) as prof:
        layer(x).backward(g)
        sync(x.device)
    free_grads(layer, x)
    if trace:
        prof.export_chrome_trace(trace)
    kernels = cuda_kernels(prof)
    per: Dict[str, List[float]] = defaultdict(list)
    for a, b, name in kernels:
        per[name].append(b - a)
    total = sum(sum(v) for v in per.values())
    gemm = sum(sum(v) for name, v in per.items() if is_gemm(name))
    # the step's span on the GPU and the time in it when no kernel ran (launch gaps, host waits)
    wall = (max(b for _, b, _ in kernels) - kernels[0][0]) if kernels else 0.0
    busy = busy_us(kernels)
    lines = [f"  GPU time of the step: {total / 1e3:.2f} ms (kernels, summed: GEMMs "
             f"{gemm / 1e3:.2f}, the rest {(total - gemm) / 1e3:.2f}); span {wall / 1e3:.2f} ms, "
             f"idle {(wall - busy) / 1e3:.2f} ms"]
    for name, ts in sorted(per.items(), key=lambda kv: -sum(kv[1]))[:top]:
        lines.append(f"  {sum(ts) / 1e3:7.3f} ms {100 * sum(ts) / total:5.1f}%  x{len(ts):<3d} "
                     f"{name[:110]}")
    if gaps:
        lines += idle_gaps(prof, kernels, gaps)
    return lines


def idle_gaps(prof, kernels: List[Tuple[float, float, str]], n: int) -> List[str]:
    """The n longest stretches with no kernel running, each with the kernels around it and the
    host ops that ran during it (what the GPU was waiting for: launches, allocations, Python)."""
    kernels.sort()
    holes, end, prev = [], None, ""
    for a, b, name in kernels:
        if end is not None and a > end:
            holes.append((a - end, end, a, prev, name))
        if end is None or b > end:
            end, prev = b, name
    host = [(ev.time_range.start, ev.time_range.end, ev.name) for ev in prof.events()
            if ev.device_type == torch.autograd.DeviceType.CPU]
    lines = [f"  idle stretches: {len(holes)}, {sum(h[0] for h in holes) / 1e3:.2f} ms; "
             f"the {n} longest (us, kernel before -> after; host ops running in it, outermost):"]
    for dt, a, b, before, after in sorted(holes, reverse=True)[:n]:
        inside = [h for h in host if h[0] < b and h[1] > a]
        outer = [h for h in inside if not any(o is not h and o[0] <= h[0] and o[1] >= h[1]
                                              and (o[1] - o[0]) > (h[1] - h[0]) for o in inside)]
        names = ", ".join(sorted({h[2][:40] for h in outer}))[:150]
        lines.append(f"  {dt:8.1f}  {before[:40]} -> {after[:40]} | {names}")
    return lines


def memory(layer, x: torch.Tensor, g: torch.Tensor) -> str:
    dev = x.device
    if dev.type != "cuda":
        return f"  memory: n/a on the {dev.type}"
    free_grads(layer, x)
    held = held_after_forward(lambda: (layer(x), x), g, lambda: free_grads(layer, x), dev)
    grads = []

    def count_and_free() -> None:
        grads.append(sum(p.grad.numel() * p.grad.element_size() for p in layer.parameters()
                         if p.grad is not None))
        free_grads(layer, x)
    peak = peak_bytes(lambda: layer(x).backward(g), count_and_free, dev)
    return (f"  memory: held after forward {held / GiB:.3f} GiB, peak fwd+bwd {peak / GiB:.3f} "
            f"GiB, parameter gradients {grads[0] / GiB:.3f} GiB, peak - grads "
            f"{(peak - grads[0]) / GiB:.3f} GiB")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="mixtral,qwen3_30b_a3b,dsv3_like")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--rows-by-index", choices=("auto", "on", "off"), default="auto",
                    help="ours: MoEConfig.moe_expert_rows_by_index (auto: the default, by device)")
    ap.add_argument("--gaps", type=int, default=0,
                    help="also list the N longest stretches the GPU sat idle (with host ops)")
    ap.add_argument("--trace", default="",
                    help="write each shape's chrome trace to TRACE_<shape>.json")
    args = ap.parse_args()
    dev = torch.device(args.device)
    for name in args.shapes.split(","):
        shape = SHAPES[name]
        layer = build_ours(moe_kwargs(shape, "dropless", 1), dev, 0, None, None)
        set_rows_by_index(layer, args.rows_by_index)
        if dev.type == "meta":  # shapes only: what is saved, at any size, with no GPU
            x = torch.empty(shape.tokens, shape.hidden, device=dev, dtype=torch.bfloat16,
                            requires_grad=True)
            g = torch.empty_like(x, requires_grad=False)
        else:
            gen = torch.Generator(device=dev).manual_seed(1)
            x = torch.randn(shape.tokens, shape.hidden, device=dev, dtype=torch.bfloat16,
                            generator=gen, requires_grad=True)
            g = torch.randn(shape.tokens, shape.hidden, device=dev, dtype=torch.bfloat16,
                            generator=gen)
        print(f"== {name}: T={shape.tokens} H={shape.hidden} E={shape.experts} k={shape.topk} "
              f"F={shape.ffn}", flush=True)
        lines, total = saved_breakdown(layer, x, g)
        print(f"  saved for backward: {total / GiB:.3f} GiB besides the caller's tensors")
        print("\n".join(lines))
        print(memory(layer, x, g))
        if dev.type == "cuda":
            trace = f"{args.trace}_{name}.json" if args.trace else ""
            print("\n".join(kernel_table(layer, x, g, args.top, args.gaps, trace)), flush=True)
        del layer, x, g
        if dev.type == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
