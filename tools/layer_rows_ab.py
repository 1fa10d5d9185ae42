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
* on CUDA, ``--queued`` steps per variant profiled back to back: the kernels' GPU time summed
  per step (what the step would take with no host waits), and the kernels whose time differs
  most between the variants. (One profiled step alone can read milliseconds away from the same
  step queued: at dsv3_like it put the by-index step's kernels below the rows made's, which the
  queued profile and the events below do not.)
* ``--ops``: the queued step's GPU time op by op, from CUDA events recorded around each of
  ``expert_mlp``'s kernel calls (its module's op handles wrapped for the run) and around
  the layout and the router; no profiler (on the CPU, the wall clock at the same points). What
  lies between two wrapped calls is listed as ``a..b`` (unwrapped ops, or the GPU waiting), so
  the rows add up to the step.

    python3 -m tools.layer_rows_ab
    python3 -m tools.layer_rows_ab --shapes qwen3_30b_a3b --rounds 20
    python3 -m tools.layer_rows_ab --ops
    python3 -m tools.layer_rows_ab --device cpu --shapes tiny --rounds 2
"""
import argparse
import collections
import contextlib
import dataclasses
import statistics
import sys
import time
from typing import Dict, List, Tuple

import torch
from torch.profiler import ProfilerActivity, profile

import moe_core.ops
from benchmarks.bench_ep import build_ours, moe_kwargs  # the layer builders
from benchmarks.shapes import REFERENCE, SHAPES
from benchmarks.timing import sync, time_call
from moe_core import tuning

# name -> (moe_expert_rows_by_index, MOE_CORE_EXPERT_COPY_ROWS; None: the default)
VARIANTS: Dict[str, Tuple[bool, object]] = {
    "rows made": (False, None),
    "by index": (True, None),
    "by index, no copies": (True, "0"),
}


def kernel_times(step, dev, steps: int) -> Dict[str, float]:
    """ms of GPU time per kernel name per step, over ``steps`` steps profiled back to back."""
    step()
    sync(dev)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        sync(dev)
    per: Dict[str, float] = collections.defaultdict(float)
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            per[ev.name] += ev.device_time / 1e3 / steps
    return per


# expert_mlp's op handles (module globals it calls through), timed by --ops
_EXPERT_OPS = ("_FC1", "_FC2", "_DGRAD", "_WGRAD", "_GLU_BWD_", "_GLU_BWD", "_UNPERMUTE",
               "_UNPERMUTE_BWD", "_ACCUMULATE_", "gathered_rows_grad", "_rounded")
# the layer's layout step, either mode (with the rows, or alone for the rows read by index),
# timed as one op: "layout"
_LAYOUT_OPS = ("permute_tokens", "routing_layout")
_LABELS = {n: "layout" for n in _LAYOUT_OPS}


class WallStamp:
    """A CPU stand-in for ``torch.cuda.Event``: the wall clock when recorded."""

    def record(self) -> None:
        self.t = time.perf_counter()

    def elapsed_time(self, end: "WallStamp") -> float:
        return (end.t - self.t) * 1e3


@contextlib.contextmanager
def op_events(layer, marks: List[Tuple[str, object]], dev: torch.device):
    """Records an event (a CUDA event; a :class:`WallStamp` off CUDA) before (``<name``) and after
    (``name``) each of expert_mlp's op calls, the layout (``layout``: ``permute_tokens`` or
    ``routing_layout``) and the router's forward, into
    ``marks``; yields the function that records one; restores every handle on exit."""
    mlp = sys.modules["moe_core.ops.expert_mlp"]  # the module (the package exports the function)

    def mark(label):
        e = torch.cuda.Event(enable_timing=True) if dev.type == "cuda" else WallStamp()
        e.record()
        marks.append((label, e))

    def wrapped(name, fn):
        label = _LABELS.get(name, name)

        def call(*args, **kwargs):
            mark("<" + label)
            out = fn(*args, **kwargs)
            mark(label)
            return out
        return call

    patched = [(mlp, n) for n in _EXPERT_OPS] + [(moe_core.ops, n) for n in _LAYOUT_OPS]
    saved = [(mod, n, getattr(mod, n)) for mod, n in patched]
    hooks = [layer.router.register_forward_pre_hook(lambda *_: mark("<router")),
             layer.router.register_forward_hook(lambda *_: mark("router"))]
    try:
        for mod, n, fn in saved:
            setattr(mod, n, wrapped(n, fn))
        yield mark
    finally:
        for mod, n, fn in saved:
            setattr(mod, n, fn)
        for h in hooks:
            h.remove()


def op_times(layer, x, g, clear, dev, steps: int) -> Dict[str, float]:
    """ms per step of each wrapped op and of each stretch between two (``a..b``), ``steps``
    steps queued back to back (:func:`op_events`)."""
    marks: List[Tuple[str, object]] = []
    with op_events(layer, marks, dev) as mark:
        def step():
            mark("<step")
            out = layer(x)
            mark("forward end")
            out.backward(g)
            mark("backward end")
            clear()
        step()
        sync(dev)
        marks.clear()
        for _ in range(steps):
            step()
        sync(dev)
    per: Dict[str, float] = collections.defaultdict(float)
    for (l0, e0), (l1, e1) in zip(marks, marks[1:]):
        if l1 == "<step":
            continue  # between steps
        name0, name1 = l0.lstrip("<"), l1.lstrip("<")
        key = name1 if l0 == "<" + l1 else f"{name0}..{name1}"
        per[key] += e0.elapsed_time(e1) / steps
    return per


def run_shape(name: str, dev: torch.device, rounds: int, queued: int, top: int,
              ops: bool) -> List[str]:
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
                per[v] = kernel_times(step, dev, queued)
            lines.append(f"  {v:20s} kernels summed {sum(per[v].values()):8.2f} ms (queued)")
        names = set().union(*per.values())
        spread = sorted(names, key=lambda k: -(max(p.get(k, 0.0) for p in per.values())
                                               - min(p.get(k, 0.0) for p in per.values())))
        lines.append("  kernels differing most (ms: " + " / ".join(VARIANTS) + "):")
        for k in spread[:top]:
            lines.append("    " + " / ".join(f"{per[v].get(k, 0.0):7.3f}" for v in VARIANTS)
                         + f"  {k[:100]}")
    if ops:
        runs = {v: collections.defaultdict(list) for v in VARIANTS}
        for r in range(rounds):
            for v in (order if r % 2 == 0 else order[::-1]):
                with variant(v):
                    for k, t in op_times(layer, x, g, clear, dev, queued).items():
                        runs[v][k].append(t)
        med = {v: {k: statistics.median(ts) for k, ts in runs[v].items()} for v in VARIANTS}
        clock = "CUDA events" if dev.type == "cuda" else "wall clock"
        lines.append(f"  queued step op by op, {clock} (ms: " + " / ".join(VARIANTS) + "):")
        lines.append("    " + " / ".join(f"{sum(med[v].values()):7.3f}" for v in VARIANTS)
                     + "  the step")
        keys = set().union(*med.values())
        for k in sorted(keys, key=lambda k: -max(m.get(k, 0.0) for m in med.values())):
            if max(m.get(k, 0.0) for m in med.values()) >= 0.01:
                lines.append("    " + " / ".join(f"{med[v].get(k, 0.0):7.3f}" for v in VARIANTS)
                             + f"  {k}")
    layer.config = base
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default=",".join(REFERENCE))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--queued", type=int, default=4, help="steps back to back per round")
    ap.add_argument("--top", type=int, default=8, help="kernels listed (CUDA)")
    ap.add_argument("--ops", action="store_true",
                    help="also time the queued step op by op (CUDA events; the CPU's wall clock)")
    args = ap.parse_args()
    dev = torch.device(args.device)
    for name in args.shapes.split(","):
        lines = run_shape(name, dev, args.rounds, args.queued, args.top, args.ops)
        print("\n".join(lines), flush=True)
        if dev.type == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
