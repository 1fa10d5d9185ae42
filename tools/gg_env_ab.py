"""Compares the Hopper grouped GEMM by default (A) with itself under one environment option (B), and torch._grouped_mm.

The products of the reference layers at bench_grouped_gemm.py's routing (seed 0), bf16,
Megatron's weight layout: ours by default (A), ours under VAR=VALUE (B), and torch._grouped_mm.
"bits" says whether the option changed the output.

Two timings:
  turns (default)  each call is preceded by a sleep kernel so the host's launch work is hidden
                   (setting the option and the core's reload of it too), the three run in turns,
                   median of ROUNDS. What one call costs on a card that is not yet power-capped.
  --sustained      each of the three back to back for about 0.8 s, twice in turns, with the SM
                   clock and board power sampled meanwhile (nvidia-smi, the last two thirds of
                   the samples): what a training step sees once the card sits at its power cap,
                   where less energy per flop turns into clock.

    python3 -m tools.gg_env_ab MOE_GG_SM90_EXPERT_MAPS=0
    python3 -m tools.gg_env_ab MOE_GG_SM90_EXPERT_MAPS=0 --layers mixtral --prods wgrad --sustained
"""
import argparse
import os
import statistics
import subprocess
import threading
import time

import torch

import moe_core  # registers the ops
from benchmarks.bench_grouped_gemm import LAYERS, expert_offsets, routing_counts
from benchmarks.timing import time_call, time_turns

OPS = torch.ops.moe_core
PRODS = ("fwd", "dgrad", "wgrad")


class Env:
    """Sets the tuning switch VAR to VALUE (on) or to what it was before (off), and has the core
    read it again (it reads its switches once: csrc/tuning.h)."""

    def __init__(self, assignment: str):
        self.var, _, self.val = assignment.partition("=")
        if self.var not in moe_core.tuning.SWITCHES.values():
            raise SystemExit(f"{self.var} is not a tuning switch: "
                             f"{', '.join(moe_core.tuning.SWITCHES.values())}")
        self.old = os.environ.get(self.var)

    def set(self, on: bool):
        val = self.val if on else self.old
        if val is None:
            os.environ.pop(self.var, None)
        else:
            os.environ[self.var] = val
        moe_core.tuning.reload()


def smi_sample():
    """(SM clock MHz, board power W) of GPU 0."""
    out = subprocess.run(["nvidia-smi", "-i", "0", "--query-gpu=clocks.sm,power.draw",
                          "--format=csv,noheader,nounits"], capture_output=True, text=True).stdout
    mhz, watts = out.strip().split(",")
    return float(mhz), float(watts)


def sustained(fn, seconds: float = 0.8):
    """(ms per call, median SM MHz, median W) over about `seconds` of back-to-back calls."""
    fn()
    torch.cuda.synchronize()
    n = max(10, int(seconds * 1e3 / max(time_call(fn, "cuda"), 1e-3)))
    samples, stop = [], threading.Event()

    def monitor():
        while not stop.is_set():
            samples.append(smi_sample())
            time.sleep(0.01)

    def calls():
        for _ in range(n):
            fn()

    th = threading.Thread(target=monitor)
    th.start()
    ms = time_call(calls, "cuda")
    stop.set()
    th.join()
    tail = samples[len(samples) // 3:] or samples or [(float("nan"), float("nan"))]
    return (ms / n, statistics.median(x[0] for x in tail),
            statistics.median(x[1] for x in tail))


def products(layer: str, fc: str, counts):
    """name -> (ours, torch._grouped_mm) for fwd / dgrad / wgrad of fc1 or fc2; flops."""
    _, H, E, _, F = LAYERS[layer]
    K, N = (H, 2 * F) if fc == "fc1" else (F, H)
    off, offs32 = expert_offsets(counts)
    R = sum(counts)
    x = torch.randn(R, K, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(E, N, K, device="cuda", dtype=torch.bfloat16) / K**0.5
    dy = torch.randn(R, N, device="cuda", dtype=torch.bfloat16)
    return {
        "fwd": (lambda: OPS.grouped_gemm(x, w, off, True, None),
                lambda: torch._grouped_mm(x, w.transpose(1, 2), offs=offs32)),
        "dgrad": (lambda: OPS.grouped_gemm_dgrad(dy, w, off, True, None),
                  lambda: torch._grouped_mm(dy, w, offs=offs32)),
        "wgrad": (lambda: OPS.grouped_gemm_wgrad(x, dy, off, True, None),
                  lambda: torch._grouped_mm(dy.t(), x, offs=offs32)),
    }, 2.0 * R * K * N


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("option", metavar="VAR=VALUE")
    ap.add_argument("--layers", default=",".join(LAYERS))
    ap.add_argument("--prods", default=",".join(PRODS))
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--sustained", action="store_true")
    args = ap.parse_args()
    env = Env(args.option)
    gen = torch.Generator(device="cuda").manual_seed(0)  # bench_grouped_gemm.py's routing
    counts = {n: routing_counts(T, E, k, gen) for n, (T, _, E, k, _) in LAYERS.items()}
    print(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | B = {args.option}, "
          f"A = default | {'sustained' if args.sustained else f'turns, {args.rounds} rounds'}")
    if args.sustained:
        print(f"{'case':24s} {'run':4s} {'A ms':>7s} {'B ms':>7s} {'gmm ms':>7s} {'B/A':>6s} "
              f"{'gmm/A':>6s} {'A MHz':>6s} {'gmm MHz':>7s} {'A W':>5s}")
    else:
        print(f"{'case':24s} {'A ms':>8s} {'B ms':>8s} {'gmm ms':>8s} {'B/A':>6s} {'gmm/A':>6s} "
              f"{'A TF/s':>7s} bits")
    for layer in args.layers.split(","):
        for fc in ("fc1", "fc2"):
            fns, flops = products(layer, fc, counts[layer])
            for prod in args.prods.split(","):
                ours, gmm = fns[prod]
                a = ours()
                env.set(True)
                b = ours()
                env.set(False)
                bits = "EQUAL" if torch.equal(a, b) else "differ"
                del a, b
                name = f"{layer}.{fc} {prod}"
                if args.sustained:
                    for run in (1, 2):
                        r = {}
                        for k, on, fn in (("A", False, ours), ("B", True, ours),
                                          ("gmm", False, gmm)):
                            env.set(on)
                            r[k] = sustained(fn)
                        env.set(False)
                        print(f"{name:24s} {run:<4d} {r['A'][0]:7.3f} {r['B'][0]:7.3f} "
                              f"{r['gmm'][0]:7.3f} {r['B'][0] / r['A'][0]:6.3f} "
                              f"{r['gmm'][0] / r['A'][0]:6.3f} {r['A'][1]:6.0f} "
                              f"{r['gmm'][1]:7.0f} {r['A'][2]:5.0f}", flush=True)
                else:
                    t = time_turns({"A": (False, ours), "B": (True, ours), "gmm": (False, gmm)},
                                   args.rounds, env.set)
                    print(f"{name:24s} {t['A']:8.3f} {t['B']:8.3f} {t['gmm']:8.3f} "
                          f"{t['B'] / t['A']:6.3f} {t['gmm'] / t['A']:6.3f} "
                          f"{flops / t['A'] / 1e9:7.0f} {bits}", flush=True)
            del fns
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
