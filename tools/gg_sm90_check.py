"""Checks the Hopper grouped GEMM standalone, and compares its TFLOP/s with torch._grouped_mm and a loop.

The kernel: csrc/cuda/grouped_gemm_sm90.cu.

Needs no moe_core build: compiles the .cu with csrc/common.c into a shared library and calls
moe_cuda_gg_sm90_{fwd,dgrad,wgrad} through ctypes on torch CUDA tensors (current stream).

  python -m tools.gg_sm90_check              # build, check, benchmark
  python -m tools.gg_sm90_check --lib X.so   # use a prebuilt library (rebuilt if it fails)
  python -m tools.gg_sm90_check --no-bench   # correctness only
  GG_WATCHDOG=1 ...                                # build with the mbarrier-wait watchdog

Checks: fwd / dgrad / wgrad, trans_w 0 and 1, bf16 and fp16 operands, bf16 / fp16 / fp32
outputs, against a float64 reference of the same inputs, over uneven counts (zeros, ones, one
expert holding everything, tile tails, rows past expert_offsets[E] holding NaN), outputs
poisoned with NaN; rows past the last offset must be exactly 0, empty experts' dW exactly 0, and
a second run must be bitwise identical. Benchmark: the reference MoE shapes against
torch._grouped_mm (bf16, int32 cumulative offsets) and a per-expert loop, CUDA events, median.

Results, one H200 (bf16 in/out, trans_w=1, TFLOP/s; "fc1" K=hidden N=ffn, "fc2" the reverse;
rows = tokens * topk, random top-k routing, seed 0). All three runs passed the checks above.
  v1  direct 4-byte fragment stores, wgmma wait_group 0 per k block. Timed one variant after the
      other: fwd mixtral 603/693 (torch 702/646, loop 748/661), qwen3 527/432 (552/459),
      dsv3 455/382 (492/482). The fc1/fc2 gap put the per-tile overhead at ~14 k blocks: the
      epilogue's scattered stores.
  v2  epilogue staged through shared memory (16-byte coalesced stores), one wgmma group in
      flight. Timed one after the other, 128x256 first, then 128x128, a ping-pong 128x128
      variant, 128x256 again, torch last; the card's clock drifts down under load, so the first
      number is flattering and the repeat (in brackets) unflattering:
        fwd   mixtral 749 [647] / 775 [685]  torch 671/636  loop 777/680
              qwen3   612 [558] / 507 [478]  torch 507/435  loop 182/182
              dsv3    593 [546] / 557 [509]  torch 528/452  loop 384/413
        dgrad mixtral 698 [679] / 652 [630]  torch 676/633
              qwen3   523 [476] / 593 [558]  torch 464/526
              dsv3    565 [472] / 510 [491]  torch 414/431
        wgrad mixtral 618 [607] / 607 [599]  torch 634/639
              qwen3   554 [518] / 560 [507]  torch 534/536
              dsv3    333 [344] / 315 [340]  torch 347/356
      128x128 tiles (cooperative or ping-pong) were slower than 128x256 everywhere; ping-pong
      was dropped.
  v3  v2 plus "a half tile past the expert's end issues no wgmma", timed round-robin after a
      pre-heat (this script's method, fair between variants):
        fwd   mixtral 634/652 torch 610/611 loop 616/628 | qwen3 604/548 torch 588/494
              dsv3 374/396 torch 461/420 loop 346/368
        dgrad mixtral 652/625 torch 618/601 | qwen3 551/602 torch 522/570 | dsv3 423/428 torch
              420/457
        wgrad mixtral 570/563 torch 606/597 | qwen3 589/574 torch 591/576 | dsv3 320/318 torch
              343/336
      dsv3 fwd/dgrad lost 25-35% against v2 (wgrad, which never skips there, did not), so the
      skip was reverted: the committed kernel is v2's cooperative 128x256 path. Its round-robin
      numbers are still to be taken (run this script).
  v4  (2026-12-03) wgrad with a 16-bit dW stores through the copy engine (TMA stores from a
      swizzled whole-block staging), overlapping the next tile's MMAs: round-robin against v2
      in one run, wgrad mixtral +3.5-4.2%, qwen3 +8.7-9.2%, dsv3 +10.4-10.8%, same bits.
      CTA pairs (clusters of two, one operand block multicast to both) measured 0.96-1.03x of
      v2: L2 bandwidth is not the limit (branch wip/gg-cluster-pairs, docs/perf-history.md).
  v5  (2026-12-03) fwd / dgrad store 16-bit blocks through the copy engine too, when the
      warpgroup's 64 rows lie inside the expert (blocks cut by the expert's end: staged stores);
      3 stages at BN 256 for every plain product. A/B against v4: fwd/dgrad +0.5-6.8%, same
      bits; mixtral fwd/dgrad 1.01-1.05 of the better baseline in two runs.
  v6  (2026-12-03) wgrad loads the reduction in stages of 32 expert rows (6 / 10 stages, the same
      ring bytes) when the experts average <= 256 rows, else 64 (MOE_GG_SM90_WGRAD_BK forces
      one). Round-robin against 64-row stages: +2.2-5.0% at 128 and 256 rows per expert (dsv3,
      qwen3 and mixtral widths), -4 to -10% at 512 to 2048; same bits. 32-row stages for fwd /
      dgrad too (K-major boxes in the 64-byte swizzle) ran 0.87-1.00: not taken.
  v7  (2026-12-03) ping-pong consumers again, with the copy engine's epilogue: each warpgroup a
      128 x 128 tile, ordered by named barriers (branch wip/gg-pingpong). Round-robin against
      the cooperative 128 x 256 kernel: 0.86-0.95 on every shape and product, wgrad 0.89-0.92;
      the 128-wide tiles' operand traffic costs more than the hidden epilogue. Not taken.
  v8  (2026-12-04) the consumers' wgmma descriptors from warp-uniform values (warpgroup index
      and tile count broadcast by __shfl_sync, base descriptor + stage offset): wgrad and the
      fused fc1 keep them in uniform registers (ncu had shown wgrad issuing 71 ALU and 34 FMA-
      pipe instructions per warp per k block, cuBLAS a tenth of that; R2UR before each wgmma).
      A/B in turns against v7 + expert maps, same bits: wgrad mixtral / qwen3 +4.7-6.0%, dsv3
      +17-18%; dense 8192-row wgrad 0.95 -> 0.99-1.01x of cuBLAS. Plain fwd / dgrad: SASS
      unchanged (ptxas still rebuilds their descriptors per thread), 0.98-1.00x of cuBLAS dense.
Limits: the epilogue, even handed to the copy engine, still stops both consumer warpgroups (they
share the tile): replacing wgrad's store by a dependent sum of the accumulators ran mixtral +5-7%,
qwen3 +9%, dsv3 +20-23%, while a 4th stage added nothing; writing the packed block to shared memory
under the next tile's first wgmma group instead was slower (0.87-1.00: register spills, and the
writes hold back the next issue). M tails (experts' rows are no multiple of 128: ~20% of dsv3's MMA
work is padding); dsv3 streams 7.5 GB of weights per product (1.75 ms at 4.3 TB/s against ~2.5 ms
of MMA), so weight-tile sharing through L2 between CTAs matters; wgrad on dsv3 has 4 k blocks per
tile (256 rows), so per-tile fixed costs dominate.
"""
from __future__ import annotations

import argparse
import ctypes
import os
import subprocess
import sys

import torch

from benchmarks.shapes import REFERENCE, select
from benchmarks.timing import sync as _sync
from benchmarks.timing import time_round_robin

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

DEV = "cuda"
DT = {torch.float32: 0, torch.float64: 1, torch.float16: 2, torch.bfloat16: 3}


class Params(ctypes.Structure):
    """moe_grouped_gemm_params_t."""

    _fields_ = [
        ("num_rows", ctypes.c_int64),
        ("num_experts", ctypes.c_int64),
        ("in_features", ctypes.c_int64),
        ("out_features", ctypes.c_int64),
        ("trans_w", ctypes.c_int),
        ("dtype", ctypes.c_int),
        ("out_dtype", ctypes.c_int),
        # the gathered operand: left zero (none) by these checks
        ("gather_operand", ctypes.c_int),
        ("gather_index", ctypes.c_void_p),
        ("gather_rows", ctypes.c_int64),
    ]


def build(out: str, src: str | None = None) -> None:
    """Compiles the sm_90a library (common.c and tuning.c as C, the .cu with nvcc): the tree's
    grouped_gemm_sm90.cu, or src (a copy of another version, anywhere: its includes resolve
    against csrc/cuda)."""
    nvcc = os.environ.get("NVCC", "nvcc")
    objs = []
    for name in ("common", "tuning"):
        objs.append(f"{out}.{name}.o")
        subprocess.check_call(["gcc", "-std=c11", "-O2", "-fPIC", "-c",
                               os.path.join(ROOT, f"csrc/{name}.c"), "-o", objs[-1]])
    subprocess.check_call([nvcc, "-shared", "-Xcompiler", "-fPIC", "-std=c++17", "-O3",
                           "-gencode=arch=compute_90a,code=sm_90a", "--expt-relaxed-constexpr",
                           "-I" + os.path.join(ROOT, "csrc"),
                           "-I" + os.path.join(ROOT, "csrc/cuda"),
                           src or os.path.join(ROOT, "csrc/cuda/grouped_gemm_sm90.cu"), *objs,
                           "-o", out]
                          # a hung mbarrier wait traps instead (serialises wgmma: checks only)
                          + (["-DGG_SM90_WATCHDOG"] if os.environ.get("GG_WATCHDOG") else []))


def load(path: str | None) -> ctypes.CDLL:
    """Loads the library, building it when missing or not loadable."""
    if path and os.path.exists(path):
        try:
            return ctypes.CDLL(path)
        except OSError as exc:
            print("prebuilt library failed to load:", exc)
    path = path or "/tmp/gg_sm90.so"
    build(path)
    return ctypes.CDLL(path)


class GG:
    """ctypes front end of the three entry points."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib
        for name in ("moe_cuda_gg_sm90_fwd", "moe_cuda_gg_sm90_dgrad", "moe_cuda_gg_sm90_wgrad"):
            f = getattr(lib, name)
            f.restype = ctypes.c_int
            f.argtypes = [ctypes.c_void_p] * 4 + [ctypes.POINTER(Params), ctypes.c_void_p,
                                                  ctypes.c_size_t, ctypes.c_void_p]
        lib.moe_last_error.restype = ctypes.c_char_p
        lib.moe_cuda_gg_sm90_compiled.restype = ctypes.c_int
        lib.moe_tuning_reload.restype = None

    def setenv(self, name: str, value: str | None) -> None:
        """Sets (None: unsets) a tuning switch, MOE_GG_SM90_*, and has the library read it: the
        core reads its switches once (csrc/tuning.h)."""
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
        self.lib.moe_tuning_reload()

    def call(self, op: str, out: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
             offs: torch.Tensor, e: int, k: int, n: int, trans_w: int) -> int:
        """op in fwd (a=x, b=w), dgrad (a=dy, b=w), wgrad (a=x, b=dy). Returns the status."""
        p = Params(a.shape[0], e, k, n, trans_w, DT[a.dtype], DT[out.dtype])
        f = getattr(self.lib, "moe_cuda_gg_sm90_" + op)
        return f(out.data_ptr(), a.data_ptr(), b.data_ptr(), offs.data_ptr(), ctypes.byref(p),
                 None, 0, torch.cuda.current_stream().cuda_stream)

    def run(self, *args, **kw) -> None:
        st = self.call(*args, **kw)
        if st != 0:
            raise RuntimeError(f"status {st}: {self.lib.moe_last_error().decode()}")


def sync() -> None:
    _sync(DEV)


def reference(op: str, a: torch.Tensor, b: torch.Tensor, offs: list[int], e: int, k: int, n: int,
              trans_w: int) -> torch.Tensor:
    """float64 reference; rows past offs[-1] are 0 (fwd/dgrad)."""
    a64, b64 = a.double(), b.double()
    if op == "wgrad":
        out = torch.zeros((e, n, k) if trans_w else (e, k, n), dtype=torch.float64,
                          device=a.device)
        for i in range(e):
            x, dy = a64[offs[i]:offs[i + 1]], b64[offs[i]:offs[i + 1]]
            out[i] = dy.T @ x if trans_w else x.T @ dy
        return out
    cols = n if op == "fwd" else k
    out = torch.zeros((a.shape[0], cols), dtype=torch.float64, device=a.device)
    for i in range(e):
        w = b64[i]
        rows = a64[offs[i]:offs[i + 1]]
        if op == "fwd":
            out[offs[i]:offs[i + 1]] = rows @ (w.T if trans_w else w)
        else:
            out[offs[i]:offs[i + 1]] = rows @ (w if trans_w else w.T)
    return out


def check_case(gg: GG, counts: list[int], extra: int, k: int, n: int, dtype: torch.dtype,
               out_dtype: torch.dtype, gen: torch.Generator) -> list[str]:
    """All three products, both layouts, one count pattern. Returns failure lines."""
    dev = DEV
    e = len(counts)
    offs = [0]
    for c in counts:
        offs.append(offs[-1] + c)
    rows = offs[-1] + extra
    if rows == 0:
        return []
    offs_t = torch.tensor(offs, dtype=torch.int64, device=dev)
    x = torch.randn(rows, k, generator=gen, device=dev).to(dtype)
    dy = torch.randn(rows, n, generator=gen, device=dev).to(dtype)
    # rows past the last offset belong to no expert: NaN there must never reach an output
    x[offs[-1]:] = float("nan")
    dy[offs[-1]:] = float("nan")
    fails = []
    tol = {torch.bfloat16: (8e-3, 2e-2), torch.float16: (2e-3, 6e-3), torch.float32: (1e-5, 1e-4)}
    for trans_w in (1, 0):
        w = torch.randn(*((e, n, k) if trans_w else (e, k, n)), generator=gen, device=dev)
        w = w.to(dtype)
        for op in ("fwd", "dgrad", "wgrad"):
            a, b = {"fwd": (x, w), "dgrad": (dy, w), "wgrad": (x, dy)}[op]
            if op == "wgrad":
                shape = (e, n, k) if trans_w else (e, k, n)
            else:
                shape = (rows, n if op == "fwd" else k)
            out = torch.full(shape, float("nan"), dtype=out_dtype, device=dev)
            tag = (f"{op} tw={trans_w} {str(dtype)[6:]}->{str(out_dtype)[6:]} E={e} K={k} "
                   f"N={n} rows={rows} counts={counts if len(counts) <= 8 else '...'}")
            st = gg.call(op, out, a, b, offs_t, e, k, n, trans_w)
            if st != 0:
                fails.append(f"{tag}: status {st} {gg.lib.moe_last_error().decode()}")
                continue
            sync()
            ref = reference(op, a, b, offs, e, k, n, trans_w)
            o = out.double()
            if not torch.isfinite(o).all():
                bad = (~torch.isfinite(o)).nonzero()
                fails.append(f"{tag}: {bad.shape[0]} non-finite, first at {bad[0].tolist()}")
                continue
            if op != "wgrad" and extra and (o[offs[-1]:] != 0).any():
                fails.append(f"{tag}: rows past offsets[E] not zero")
            if op == "wgrad":
                for i, c in enumerate(counts):
                    if c == 0 and (o[i] != 0).any():
                        fails.append(f"{tag}: empty expert {i} dW not zero")
            scale = ref.abs().max().item() or 1.0
            rel = ((o - ref).norm() / (ref.norm() + 1e-30)).item()
            mx = ((o - ref).abs().max() / scale).item()
            t_rel, t_max = tol[out_dtype]
            if ref.norm() > 0 and (rel > t_rel or mx > t_max):
                bad = ((o - ref).abs() > t_max * scale).nonzero()
                where = bad[:4].tolist() if bad.numel() else []
                fails.append(f"{tag}: rel {rel:.2e} max {mx:.2e} bad {bad.shape[0]} at {where}")
            out2 = torch.full_like(out, float("nan"))
            gg.run(op, out2, a, b, offs_t, e, k, n, trans_w)
            sync()
            if not torch.equal(out, out2):
                fails.append(f"{tag}: second run differs")
    return fails


def correctness(gg: GG) -> int:
    gen = torch.Generator(device=DEV).manual_seed(1234)
    cases = [
        # counts, extra rows past offsets[E], K, N
        ([130, 0, 1, 257, 64], 7, 192, 320),
        ([0, 0, 0], 5, 64, 64),
        ([0, 300, 0, 0], 0, 72, 40),
        ([127, 128, 129, 63, 65, 1], 3, 136, 264),
        ([1000], 0, 256, 512),
        ([17, 0, 511, 2, 640, 129, 0, 33], 100, 512, 384),
        # more tiles than SMs: each CTA walks several work items through the ring
        ([(i * 397) % 900 for i in range(24)], 50, 256, 1024),
    ]
    fails = []
    n_run = 0
    for counts, extra, k, n in cases:
        for dtype, odt in ((torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32),
                           (torch.float16, torch.float16)):
            for bn in TILES:
                # wgrad's stage depth (32 or 64 expert rows) forced both ways; fwd / dgrad
                # ignore it, so the second pass checks their reruns too
                for bk in WGRAD_BKS:
                    gg.setenv("MOE_GG_SM90_TILE", bn)
                    gg.setenv("MOE_GG_SM90_WGRAD_BK", bk)
                    f = check_case(gg, counts, extra, k, n, dtype, odt, gen)
                    for line in f[:6]:  # as found: a trap later in the run loses nothing
                        print(f"FAIL [tile={bn} bk={bk}] {line}", flush=True)
                    fails += [f"[tile={bn} bk={bk}] " + s for s in f]
                    n_run += 6
    gg.setenv("MOE_GG_SM90_TILE", None)
    gg.setenv("MOE_GG_SM90_WGRAD_BK", None)
    # a problem the kernels do not take must be refused without touching the output
    x = torch.randn(16, 12, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(2, 8, 12, device="cuda", dtype=torch.bfloat16)
    y = torch.full((16, 8), 7.0, device="cuda", dtype=torch.bfloat16)
    offs = torch.tensor([0, 8, 16], device="cuda", dtype=torch.int64)
    st = gg.call("fwd", y, x, w, offs, 2, 12, 8, 1)
    torch.cuda.synchronize()
    if st != 2 or not (y == 7).all():
        fails.append(f"K=12 should be MOE_ERR_UNSUPPORTED (2) untouched, got {st}")
        print("FAIL", fails[-1])
    print(f"correctness: {n_run} products checked, {len(fails)} failures")
    return len(fails)


TILES = ("256", "128")  # MOE_GG_SM90_TILE: cooperative 128x256, 128x128
WGRAD_BKS = ("64", "32")  # MOE_GG_SM90_WGRAD_BK: wgrad's expert rows per stage

SHAPES = {  # name: hidden, ffn, experts, topk, tokens
    name: (s.hidden, s.ffn, s.experts, s.topk, s.tokens) for name, s in select(REFERENCE).items()}


def bench(gg: GG, only: list[str] | None) -> list[str]:
    """TFLOP/s of ours (default tile and 128-wide), torch._grouped_mm and a per-expert loop."""
    torch.manual_seed(0)
    lines = []
    for name, (h, ffn, e, topk, tokens) in SHAPES.items():
        if only and name not in only:
            continue
        ids = torch.rand(tokens, e, device="cuda").topk(topk, dim=1).indices
        counts = torch.bincount(ids.flatten(), minlength=e)
        offs64 = torch.zeros(e + 1, dtype=torch.int64, device="cuda")
        offs64[1:] = counts.cumsum(0)
        offs32 = counts.cumsum(0).to(torch.int32)
        offs_list = offs64.tolist()
        rows = tokens * topk
        for fc, (k, n) in (("fc1", (h, ffn)), ("fc2", (ffn, h))):
            flop = 2.0 * rows * k * n
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            w = torch.randn(e, n, k, device="cuda", dtype=torch.bfloat16) * 0.02
            dy = torch.randn(rows, n, device="cuda", dtype=torch.bfloat16)
            y = torch.empty(rows, n, device="cuda", dtype=torch.bfloat16)
            dx = torch.empty(rows, k, device="cuda", dtype=torch.bfloat16)
            dw = torch.empty(e, n, k, device="cuda", dtype=torch.bfloat16)
            wt = w.transpose(1, 2)

            def ours(op: str, out, a, b, tile: str | None = None):
                def fn() -> None:
                    gg.setenv("MOE_GG_SM90_TILE", tile)
                    gg.run(op, out, a, b, offs64, e, k, n, 1)
                return fn

            def loop() -> None:
                for i in range(e):
                    a, b = offs_list[i], offs_list[i + 1]
                    if b > a:
                        torch.mm(x[a:b], w[i].t(), out=y[a:b])

            fns = {
                "fwd": ours("fwd", y, x, w), "fwd128": ours("fwd", y, x, w, "128"),
                "t_fwd": lambda: torch._grouped_mm(x, wt, offs=offs32), "loop": loop,
                "dgrad": ours("dgrad", dx, dy, w),
                "t_dgrad": lambda: torch._grouped_mm(dy, w, offs=offs32),
                "wgrad": ours("wgrad", dw, x, dy),
                "t_wgrad": lambda: torch._grouped_mm(dy.t(), x, offs=offs32),
            }
            res = time_round_robin(fns)
            gg.setenv("MOE_GG_SM90_TILE", None)
            # sanity: ours vs torch on this shape
            gg.run("fwd", y, x, w, offs64, e, k, n, 1)
            yt = torch._grouped_mm(x, wt, offs=offs32)
            rel = ((y.float() - yt.float()).norm() / yt.float().norm()).item()
            tf = {kk: flop / v / 1e9 for kk, v in res.items()}
            line = (f"{name[:6]} {fc} K={k:5d} N={n:5d} | fwd {tf['fwd']:4.0f} ({tf['fwd128']:3.0f})"
                    f" torch {tf['t_fwd']:4.0f} loop {tf['loop']:4.0f} | dgrad {tf['dgrad']:4.0f} "
                    f"torch {tf['t_dgrad']:4.0f} | wgrad {tf['wgrad']:4.0f} torch "
                    f"{tf['t_wgrad']:4.0f} | ms {res['fwd']:.3f} rel {rel:.0e}")
            print(line, flush=True)
            lines.append(line)
            del x, w, dy, y, dx, dw, wt
            torch.cuda.empty_cache()
    return lines


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lib", default=None)
    ap.add_argument("--no-bench", action="store_true")
    ap.add_argument("--no-check", action="store_true")
    ap.add_argument("--shapes", nargs="*", default=None)
    args = ap.parse_args()
    gg = GG(load(args.lib))
    print("device:", torch.cuda.get_device_name(), "sm90 compiled:",
          gg.lib.moe_cuda_gg_sm90_compiled())
    nfail = 0 if args.no_check else correctness(gg)
    lines = [] if args.no_bench else bench(gg, args.shapes)
    print("\n==== summary: TFLOP/s (bf16, trans_w=1; fwd: ours default tile (128-wide)) ====")
    for line in lines:
        print(line)
    print("correctness failures:", nfail)
    return 1 if nfail else 0


if __name__ == "__main__":
    sys.exit(main())
