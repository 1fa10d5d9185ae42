"""Compares the sm90 grouped GEMM with its last wave split and unsplit (and regrouped into whole tiles).

At bench_grouped_gemm.py's routing (seed 0), for fwd/dgrad products of the reference layers: ours by default (the last wave split where it
applies) against MOE_GG_SM90_SPLIT_TAIL=0, and, unsplit, the same rows regrouped so the experts
hold whole 128-row tiles but one (fewer tiles, fewer waves: what the partial wave costs). Each
call is preceded by a sleep kernel so the host's launch work is hidden (the variants differ by an
environment switch); the variants run in turns, median of ROUNDS. "bits" says whether the split
changed the output (EQUAL: no split at that shape, so its ratio is the harness's noise).

    python3 -m tools.gg_split_tail_ab [--rounds R]        (ROUNDS=25 by default)
"""
import argparse
import os

import torch

import moe_core  # noqa: F401  (registers the ops)
from benchmarks.bench_grouped_gemm import LAYERS, expert_offsets, routing_counts
from benchmarks.timing import time_turns
from tools.gg_env_ab import Env

OPS = torch.ops.moe_core
ROUNDS = int(os.environ.get("ROUNDS", "25"))
CASES = [("mixtral", "fc2", "fwd"), ("mixtral", "fc1", "dgrad"), ("mixtral", "fc1", "fwd"),
         ("mixtral", "fc2", "dgrad"), ("dsv3_like", "fc2", "dgrad"), ("dsv3_like", "fc1", "fwd")]


def m_tiles(counts) -> int:
    return sum((c + 127) // 128 for c in counts)


def regrouped(counts) -> list:
    """The same rows, the experts holding whole 128-row tiles but one: the fewest tiles."""
    E = len(counts)
    rows = [sum(counts) // E // 128 * 128] * E
    left, i = sum(counts) - sum(rows), 0
    while left > 0:
        add = min(128, left)
        rows[i % E] += add
        left -= add
        i += 1
    return rows


def product(layer: str, fc: str, prod: str, counts):
    """ours for fwd or dgrad of fc1 / fc2, Megatron's weight layout, bf16."""
    _, H, E, _, F = LAYERS[layer]
    K, N = (H, 2 * F) if fc == "fc1" else (F, H)
    off, _ = expert_offsets(counts)
    w = torch.randn(E, N, K, device="cuda", dtype=torch.bfloat16) / K**0.5
    if prod == "fwd":
        x = torch.randn(sum(counts), K, device="cuda", dtype=torch.bfloat16)
        return lambda: OPS.grouped_gemm(x, w, off, True, None)
    dy = torch.randn(sum(counts), N, device="cuda", dtype=torch.bfloat16)
    return lambda: OPS.grouped_gemm_dgrad(dy, w, off, True, None)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=ROUNDS, help="default: $ROUNDS or 25")
    args = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)  # bench_grouped_gemm.py's routing
    counts = {name: routing_counts(T, E, k, gen) for name, (T, _, E, k, _) in LAYERS.items()}
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    unsplit_env = Env("MOE_GG_SM90_SPLIT_TAIL=0")
    print(f"SMs {sms}; rows / expert: " + "; ".join(
        f"{n} {min(c)}-{max(c)} ({m_tiles(c)} M tiles)" for n, c in counts.items()))
    print(f"{'case':22s} {'tiles':>6s} {'waves':>7s} {'split ms':>9s} {'unsplit':>8s} "
          f"{'regrouped':>9s} {'unsplit/split':>13s} {'regr/unsplit':>12s} bits")
    for layer, fc, prod in CASES:
        c = counts[layer]
        _, H, _, _, F = LAYERS[layer]
        n_out = (2 * F if fc == "fc1" else H) if prod == "fwd" else (H if fc == "fc1" else F)
        tiles = m_tiles(c) * ((n_out + 255) // 256)
        ours, regr = product(layer, fc, prod, c), product(layer, fc, prod, regrouped(c))
        unsplit_env.set(True)
        unsplit = ours()
        unsplit_env.set(False)
        bits = "EQUAL" if torch.equal(unsplit, ours()) else "differ"
        del unsplit
        t = time_turns({"split": (False, ours), "unsplit": (True, ours), "regr": (True, regr)},
                       args.rounds, unsplit_env.set)
        print(f"{layer + '.' + fc + ' ' + prod:22s} {tiles:6d} {tiles / sms:7.2f} "
              f"{t['split']:9.3f} {t['unsplit']:8.3f} {t['regr']:9.3f} "
              f"{t['unsplit'] / t['split']:13.3f} {t['regr'] / t['unsplit']:12.3f} {bits}",
              flush=True)
        del ours, regr
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
