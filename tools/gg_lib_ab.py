"""Compares two versions of the Hopper grouped GEMM's source (the tree's, another .cu) and torch._grouped_mm.

Builds csrc/cuda/grouped_gemm_sm90.cu as it is in the tree (new) and another copy of it (old,
e.g. `git show REV:csrc/cuda/grouped_gemm_sm90.cu > /tmp/old.cu`) into two standalone libraries
(gg_sm90_check.build, no moe_core needed for them), and times fwd / dgrad / wgrad of the
reference layers at bench_grouped_gemm.py's routing (seed 0), bf16, Megatron's weight layout,
with each library's workspace (wgrad's expert maps, the split last wave). The three calls run
in turns, each after a sleep kernel so the host's launch work is hidden; median of ROUNDS.
"bits" says whether old and new wrote the same output. For changes that a run-time option
cannot switch (gg_env_ab.py covers those).

    python3 -m tools.gg_lib_ab /tmp/old.cu [--layers mixtral] [--rounds 12]
"""
import argparse
import ctypes
import os

import torch

from benchmarks.bench_grouped_gemm import LAYERS, expert_offsets, routing_counts
from benchmarks.timing import time_turns
from tools.gg_sm90_check import DT, Params, build

PRODS = ("fwd", "dgrad", "wgrad")


class Lib:
    """One built library's three entry points, called with its own workspace."""

    def __init__(self, path: str):
        self.lib = ctypes.CDLL(path)
        for op in PRODS:
            f = getattr(self.lib, "moe_cuda_gg_sm90_" + op)
            f.restype = ctypes.c_int
            f.argtypes = [ctypes.c_void_p] * 4 + [ctypes.POINTER(Params), ctypes.c_void_p,
                                                  ctypes.c_size_t, ctypes.c_void_p]
        self.lib.moe_cuda_gg_sm90_workspace_size.restype = ctypes.c_size_t
        self.lib.moe_cuda_gg_sm90_workspace_size.argtypes = [ctypes.POINTER(Params)]

    def product(self, op: str, out: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                offsets: torch.Tensor, k: int, n: int):
        """A callable running op (fwd: a = x, b = w; dgrad: a = dy, b = w; wgrad: a = x, b = dy)."""
        p = Params(a.shape[0], offsets.numel() - 1, k, n, 1, DT[a.dtype], DT[out.dtype])
        ws_bytes = self.lib.moe_cuda_gg_sm90_workspace_size(ctypes.byref(p))
        ws = torch.empty(max(ws_bytes, 1), dtype=torch.uint8, device="cuda")
        f = getattr(self.lib, "moe_cuda_gg_sm90_" + op)

        def run() -> torch.Tensor:
            st = f(out.data_ptr(), a.data_ptr(), b.data_ptr(), offsets.data_ptr(), ctypes.byref(p),
                   ws.data_ptr(), ws_bytes, torch.cuda.current_stream().cuda_stream)
            if st != 0:
                raise RuntimeError(f"{op}: status {st}: {self.lib.moe_last_error().decode()}")
            return out
        return run


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("old", help="the other version of grouped_gemm_sm90.cu")
    ap.add_argument("--layers", default=",".join(LAYERS))
    ap.add_argument("--prods", default=",".join(PRODS))
    ap.add_argument("--rounds", type=int, default=12)
    args = ap.parse_args()
    build("/tmp/gg_ab_old.so", os.path.abspath(args.old))
    build("/tmp/gg_ab_new.so")
    libs = {"old": Lib("/tmp/gg_ab_old.so"), "new": Lib("/tmp/gg_ab_new.so")}
    gen = torch.Generator(device="cuda").manual_seed(0)  # bench_grouped_gemm.py's routing
    counts = {n: routing_counts(T, E, k, gen) for n, (T, _, E, k, _) in LAYERS.items()}
    print(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | old = {args.old}, "
          f"new = the tree | turns, {args.rounds} rounds")
    print(f"{'case':26s} {'old ms':>8s} {'new ms':>8s} {'gmm ms':>8s} {'old/new':>7s} "
          f"{'gmm/new':>7s} {'new TF/s':>8s} bits")
    for layer in args.layers.split(","):
        _, H, E, _, F = LAYERS[layer]
        off, offs32 = expert_offsets(counts[layer])
        R = sum(counts[layer])
        for fc, (K, N) in (("fc1", (H, 2 * F)), ("fc2", (F, H))):
            x = torch.randn(R, K, device="cuda", dtype=torch.bfloat16)
            w = torch.randn(E, N, K, device="cuda", dtype=torch.bfloat16) / K**0.5
            dy = torch.randn(R, N, device="cuda", dtype=torch.bfloat16)
            shapes = {"fwd": (R, N), "dgrad": (R, K), "wgrad": (E, N, K)}
            operands = {"fwd": (x, w), "dgrad": (dy, w), "wgrad": (x, dy)}
            gmm = {"fwd": lambda: torch._grouped_mm(x, w.transpose(1, 2), offs=offs32),
                   "dgrad": lambda: torch._grouped_mm(dy, w, offs=offs32),
                   "wgrad": lambda: torch._grouped_mm(dy.t(), x, offs=offs32)}
            for prod in args.prods.split(","):
                outs = {k: torch.empty(shapes[prod], device="cuda", dtype=torch.bfloat16)
                        for k in libs}
                fns = {k: lib.product(prod, outs[k], *operands[prod], off, K, N)
                       for k, lib in libs.items()}
                fns["gmm"] = gmm[prod]
                t = time_turns({k: (False, fn) for k, fn in fns.items()}, args.rounds)
                bits = "EQUAL" if torch.equal(fns["old"](), fns["new"]()) else "differ"
                flops = 2.0 * R * K * N
                print(f"{layer + '.' + fc + ' ' + prod:26s} {t['old']:8.3f} {t['new']:8.3f} "
                      f"{t['gmm']:8.3f} {t['old'] / t['new']:7.3f} {t['gmm'] / t['new']:7.3f} "
                      f"{flops / t['new'] / 1e9:8.0f} {bits}", flush=True)
                del outs, fns
            del x, w, dy
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
