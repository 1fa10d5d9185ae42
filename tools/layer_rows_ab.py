"""Times our whole layer's forward + backward three ways in one process, in turns: the rows made
by ``permute`` (the CUDA default), the rows read by index (``moe_expert_rows_by_index=True``),
and by index without the transient row copies (``MOE_CORE_EXPERT_COPY_ROWS=0``).

bench_layer.py times the first two among the peers, each variant in its own rounds; the copies
are a tuning switch the core reads once, so comparing them there takes two processes, whose
clocks differ by more than the copies save. Here the switch is flipped between steps
(``moe_core.tuning.environment``) on the same layer, the same input and the same clock:

* per round and variant: one step timed alone (after a wait, so it includes the GPU waiting for
  the host), then ``--queued`` steps back to back (the host running ahead), and the host's own
  time in the alone step's forward and backward;
* the variants' order alternates from one round to the next; medians are printed;
* on CUDA, one profiled step per variant: the kernels' GPU time summed (what the step would take
  with no host waits), and the kernels whose time differs most between the variants.

    python3 tools/layer_rows_ab.py
    python3 tools/layer_rows_ab.py --shapes qwen3_30b_a3b --rounds 20
    PYTHONPATH=. python3 tools/layer_rows_ab.py --device cpu --shapes tiny --rounds 2
"""
import argparse
import collections
import dataclasses
import os
import statistics
import sys
import time
from typing import Dict, List, Tuple

import torch
from torch.profiler import ProfilerActivity, profile

from moe_core import tuning

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "benchmarks"))  # the layer builders, shapes, timing
from bench_ep import build_ours, moe_kwargs  # noqa: E402
from shapes import REFERENCE, SHAPES  # noqa: E402
from timing import sync, time_call  # noqa: E402

# name -> (moe_expert_rows_by_index, MOE_CORE_EXPERT_COPY_ROWS; None: the default)
VARIANTS: Dict[str, Tuple[bool, object]] = {
    "rows made": (False, None),
    "by index": (True, None),
    "by index, no copies": (True, "0"),
}


def kernel_times(step, dev) -> Dict[str, float]:
    """ms of GPU time per kernel name in one step."""
    step()
    sync(dev)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        sync(dev)
    per: Dict[str, float] = collections.defaultdict(float)
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            per[ev.name] += ev.device_time / 1e3
    return per


def run_shape(name: str, dev: torch.device, rounds: int, queued: int, top: int) -> List[str]:
    s = SHAPES[name]
    layer = build_ours(moe_kwargs(s, "dropless", 1), dev, 0, None, None)
    base = layer.config
    gen = torch.Generator(device=dev).manual_seed(1)
    x = torch.randn(s.tokens, s.hidden, device=dev, dtype=torch.bfloat16, generator=gen,
                    requires_grad=True)
    g = torch.randn(s.tokens, s.hidden, device=dev, dtype=torch.bfloat16, generator=gen)
    params = list(layer.parameters()) + [x]

    def clear():
        for p in params:
            p.grad = None

    def step():
        layer(x).backward(g)
        clear()

    def variant(v: str):
        by_index, copies = VARIANTS[v]
        layer.config = dataclasses.replace(base, moe_expert_rows_by_index=by_index)
        return tuning.environment(MOE_CORE_EXPERT_COPY_ROWS=copies)

    alone, ahead, host_f, host_b = (collections.defaultdict(list) for _ in range(4))
    for v in VARIANTS:  # warm-up
        with variant(v):
            for _ in range(2):
                step()
    sync(dev)
    order = list(VARIANTS)
    for r in range(rounds):
        for v in (order if r % 2 == 0 else order[::-1]):
            with variant(v):
                step()
                sync(dev)
                marks = []

                def timed():
                    t0 = time.perf_counter()
                    out = layer(x)
                    t1 = time.perf_counter()
                    out.backward(g)
                    marks.append((t1 - t0, time.perf_counter() - t1))

                alone[v].append(time_call(timed, dev))
                clear()
                host_f[v].append(marks[0][0] * 1e3)
                host_b[v].append(marks[0][1] * 1e3)

                def back_to_back():
                    for _ in range(queued):
                        step()

                ahead[v].append(time_call(back_to_back, dev) / queued)
    lines = [f"{name}: T={s.tokens} H={s.hidden} E={s.experts} k={s.topk} F={s.ffn}; "
             f"median of {rounds} rounds"]
    made = statistics.median(alone["rows made"])
    for v in VARIANTS:
        a, q = statistics.median(alone[v]), statistics.median(ahead[v])
        lines.append(f"  {v:20s} alone {a:8.2f} ms ({a / made:.3f}x rows made)  queued {q:8.2f} "
                     f"ms  | host: forward {statistics.median(host_f[v]):.2f} ms, backward "
                     f"{statistics.median(host_b[v]):.2f} ms")
    if dev.type == "cuda":
        per = {}
        for v in VARIANTS:
            with variant(v):
                per[v] = kernel_times(step, dev)
            lines.append(f"  {v:20s} kernels summed {sum(per[v].values()):8.2f} ms")
        names = set().union(*per.values())
        spread = sorted(names, key=lambda k: -(max(p.get(k, 0.0) for p in per.values())
                                               - min(p.get(k, 0.0) for p in per.values())))
        lines.append("  kernels differing most (ms: " + " / ".join(VARIANTS) + "):")
        for k in spread[:top]:
            lines.append("    " + " / ".join(f"{per[v].get(k, 0.0):7.3f}" for v in VARIANTS)
                         + f"  {k[:100]}")
    layer.config = base
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default=",".join(REFERENCE))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--queued", type=int, default=4, help="steps back to back per round")
    ap.add_argument("--top", type=int, default=8, help="kernels listed (CUDA)")
    args = ap.parse_args()
    dev = torch.device(args.device)
    for name in args.shapes.split(","):
        print("\n".join(run_shape(name, dev, args.rounds, args.queued, args.top)), flush=True)
        if dev.type == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
