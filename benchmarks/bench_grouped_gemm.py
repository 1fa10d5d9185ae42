"""Grouped expert GEMM on one GPU: ours vs torch._grouped_mm vs a per-expert torch.mm loop.

For fc1 ([H -> 2*ffn], SwiGLU) and fc2 ([ffn -> H]) of the three reference layers of docs/design.md,
with rows = tokens * topk spread over the experts by a random top-k routing, in bf16 with the
Megatron weight layout ([E, N, K], trans_w=True): forward, dgrad and wgrad. The dense bf16 matmul
ceiling (torch.mm, 8192^3) is measured in the same run.

Method (docs/design.md): CUDA events around each call, warm-up first, median of REPS, the variants of
a product timed in turns (one call of each per round: the clock drifts under load); random data,
never zeros; every output checked against torch._grouped_mm (or the loop) by relative Frobenius
error before it is timed. Printed per shape and product: ms, TFLOP/s, speed ratio vs grouped_mm
and vs the loop (> 1: ours is faster), % of the dense ceiling; a short table last, then per layer
the six products summed (ours, grouped_mm, the loop, the fastest per product) beside the whole
layer's time goal (shapes.GOAL_MS): what the goal leaves for the rest of the layer.

Extra row set, per layer: fc1 with SwiGLU and the router probs, forward only — ours (the one op
grouped_gemm_glu_probs: the grouped GEMM, then the glu_probs kernel) vs torch (torch._grouped_mm,
then F.silu(g) * l * p in torch ops). The op's output must equal grouped_gemm then glu_probs
called apart, bit for bit (asserted before timing).

    python3 -m benchmarks.bench_grouped_gemm [--layers mixtral,qwen3_30b_a3b] [--reps 15]
                                             [--fused only|no] [--variant VAR=VALUE]

--variant times ours a second time under an environment option, in the same rounds (column
'vs var': > 1 when the default is faster), e.g. MOE_GG_SM90_SPLIT_TAIL=0. The option is set
inside the timed call and the GPU waits for the host there: at sub-millisecond calls the variant
read 2-6% slower where the option changes nothing (qwen3_30b_a3b, H200). For differences that
small, tools/gg_split_tail_ab.py (host work hidden behind a sleep kernel) is the measurement.
"""
import argparse
import contextlib
import math

import torch

import moe_core  # registers the ops
from benchmarks.shapes import GOAL_MS, REFERENCE, SHAPES
from benchmarks.timing import dense_ceiling, time_round_robin  # the variants timed in turns

OPS = torch.ops.moe_core

# name: (tokens, hidden, experts, topk, expert ffn)
LAYERS = {name: SHAPES[name].dims() for name in REFERENCE}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in fp32, in slices (a dsv3 weight gradient is 15 GB in bf16)."""
    a, b = a.reshape(-1), b.reshape(-1)
    num = den = 0.0
    step = 1 << 27
    for i in range(0, a.numel(), step):
        x, y = a[i:i + step].float(), b[i:i + step].float()
        num += (x - y).square().sum().item()
        den += y.square().sum().item()
    return (num / max(den, 1e-30)) ** 0.5


def routing_counts(tokens: int, experts: int, topk: int, gen: torch.Generator) -> list:
    scores = torch.randn(tokens, experts, device="cuda", generator=gen)
    idx = scores.topk(topk, dim=1).indices
    return torch.bincount(idx.flatten(), minlength=experts).tolist()


def expert_offsets(rows_per_expert):
    """(ours: [E + 1] int64 offsets, torch._grouped_mm's: [E] int32 group ends), on the GPU."""
    ends = torch.tensor(rows_per_expert, device="cuda").cumsum(0)
    return torch.cat([torch.zeros(1, dtype=torch.long, device="cuda"), ends]), ends.to(torch.int32)


@contextlib.contextmanager
def env_set(assignment):
    """The tuning switch VAR=VALUE set for the duration, the core reading it again on entry and
    on exit (it reads its switches once: csrc/tuning.h)."""
    var, _, val = assignment.partition("=")
    with moe_core.tuning.environment(**{var: val}):
        yield


def with_env(assignment, fn):
    def run():
        with env_set(assignment):
            return fn()
    return run


def bench_problem(name, rows_per_expert, K, N, reps, ceiling, results, variant=None):
    E, R = len(rows_per_expert), sum(rows_per_expert)
    dev, dt = "cuda", torch.bfloat16
    off64, offs32 = expert_offsets(rows_per_expert)
    bounds = off64.tolist()
    x = torch.randn(R, K, device=dev, dtype=dt)
    w = torch.randn(E, N, K, device=dev, dtype=dt) / K**0.5  # [E, N, K]: nn.Linear layout
    dy = torch.randn(R, N, device=dev, dtype=dt)
    flops = 2.0 * R * K * N

    def loop_fwd():
        y = torch.empty(R, N, device=dev, dtype=dt)
        for e in range(E):
            if bounds[e + 1] > bounds[e]:
                torch.mm(x[bounds[e]:bounds[e + 1]], w[e].t(), out=y[bounds[e]:bounds[e + 1]])
        return y

    def loop_dgrad():
        dx = torch.empty(R, K, device=dev, dtype=dt)
        for e in range(E):
            if bounds[e + 1] > bounds[e]:
                torch.mm(dy[bounds[e]:bounds[e + 1]], w[e], out=dx[bounds[e]:bounds[e + 1]])
        return dx

    def loop_wgrad():
        dw = torch.empty(E, N, K, device=dev, dtype=dt)
        for e in range(E):
            s, t = bounds[e], bounds[e + 1]
            if t > s:
                torch.mm(dy[s:t].t(), x[s:t], out=dw[e])
            else:
                dw[e].zero_()
        return dw

    products = {
        "fwd": (lambda: OPS.grouped_gemm(x, w, off64, True, None),
                lambda: torch._grouped_mm(x, w.transpose(1, 2), offs=offs32), loop_fwd),
        "dgrad": (lambda: OPS.grouped_gemm_dgrad(dy, w, off64, True, None),
                  lambda: torch._grouped_mm(dy, w, offs=offs32), loop_dgrad),
        "wgrad": (lambda: OPS.grouped_gemm_wgrad(x, dy, off64, True, None),
                  lambda: torch._grouped_mm(dy.t(), x, offs=offs32), loop_wgrad),
    }
    for prod, (ours, gmm, loop) in products.items():
        ref = loop()
        err = rel_err(ours(), ref)
        fns = {"ours": ours, "gmm": gmm, "loop": loop}
        if variant:  # the same op under another option, in the same rounds
            fns["var"] = with_env(variant, ours)
            verr = rel_err(fns["var"](), ref)
            assert verr < 2e-2, f"{name} {prod} [{variant}]: relative error {verr:.3e}"
        try:
            gerr = rel_err(gmm(), ref)
        except (RuntimeError, NotImplementedError) as exc:  # layout or arch it does not take
            gerr = float("nan")
            del fns["gmm"]
            print(f"  torch._grouped_mm {prod}: {str(exc).splitlines()[0][:100]}")
        del ref
        t = time_round_robin(fns, rounds=reps)
        t_ours, t_loop, t_gmm = t["ours"], t["loop"], t.get("gmm", float("nan"))
        tf = flops / t_ours / 1e9
        row = dict(shape=name, prod=prod, ms=t_ours, tflops=tf, vs_gmm=t_gmm / t_ours,
                   vs_loop=t_loop / t_ours, pct=100 * tf / ceiling, gmm_ms=t_gmm, loop_ms=t_loop,
                   err=err, gerr=gerr, vs_var=t.get("var", float("nan")) / t_ours)
        results.append(row)
        var = f" | [{variant}] {t['var']:8.3f} ms (x{row['vs_var']:.3f})" if variant else ""
        print(f"  {prod:5s} ours {t_ours:8.3f} ms {tf:6.1f} TFLOP/s | grouped_mm {t_gmm:8.3f} ms"
              f" (x{row['vs_gmm']:.2f}) | loop {t_loop:8.3f} ms (x{row['vs_loop']:.2f}) |"
              f" {row['pct']:5.1f}% of dense | rel err ours {err:.1e} gmm {gerr:.1e}{var}",
              flush=True)
        assert err < 2e-2, f"{name} {prod}: our relative error {err:.3e} vs the loop"
    del x, w, dy
    torch.cuda.empty_cache()


def bench_fused_fc1(name, rows_per_expert, H, ffn, reps, ceiling, results):
    """fc1 + SwiGLU + probs: the op vs torch._grouped_mm + torch ops."""
    E, R = len(rows_per_expert), sum(rows_per_expert)
    dev, dt = "cuda", torch.bfloat16
    off64, offs32 = expert_offsets(rows_per_expert)
    x = torch.randn(R, H, device=dev, dtype=dt)
    w1 = torch.randn(E, 2 * ffn, H, device=dev, dtype=dt) / H**0.5  # [E, 2F, H], gate rows first
    probs = torch.rand(R, device=dev)
    flops = 2.0 * R * H * 2 * ffn

    def ours():
        return OPS.grouped_gemm_glu_probs(x, w1, off64, probs, "silu", True, 0.0, None, True)

    def torch_path():
        a = torch._grouped_mm(x, w1.transpose(1, 2), offs=offs32)
        g, lin = a.chunk(2, dim=-1)
        return (torch.nn.functional.silu(g) * lin * probs.unsqueeze(-1)).to(dt), a

    h_o, a_o = ours()
    a_u = OPS.grouped_gemm(x, w1, off64, True, None)
    h_u = OPS.glu_probs(a_u, probs, "silu", True, 0.0, None)
    assert torch.equal(a_o, a_u) and torch.equal(h_o, h_u), f"{name}: op != the two ops' bits"
    del a_o, a_u, h_u

    fns = {"ours": ours, "torch": torch_path}
    try:
        h_t, _ = torch_path()
        terr = rel_err(h_o, h_t)
        del h_t
    except (RuntimeError, NotImplementedError) as exc:
        terr = float("nan")
        del fns["torch"]
        print(f"  torch._grouped_mm fc1+act: {str(exc).splitlines()[0][:100]}")
    del h_o
    t = time_round_robin(fns, rounds=reps)
    t_ours, t_torch = t["ours"], t.get("torch", float("nan"))
    tf = flops / t_ours / 1e9
    row = dict(shape=name, ms=t_ours, tflops=tf, torch_ms=t_torch, vs_torch=t_torch / t_ours,
               pct=100 * tf / ceiling, terr=terr)
    results.append(row)
    print(f"  fc1+act ours {t_ours:8.3f} ms {tf:6.1f} TFLOP/s | grouped_mm+torch {t_torch:8.3f} "
          f"ms (x{row['vs_torch']:.2f}) | {row['pct']:5.1f}% of dense | rel err vs torch "
          f"{terr:.1e}", flush=True)
    assert not terr > 2e-2, f"{name}: relative error {terr:.3e} vs torch"
    del x, w1, probs
    torch.cuda.empty_cache()


def layer_sums(results):
    """Per layer whose six products (fc1 and fc2: fwd, dgrad, wgrad) all ran: their times summed,
    i.e. the expert GEMMs of one forward + backward, in ms: ours, torch._grouped_mm, the loop and
    the fastest of the three product by product (nan where grouped_mm did not run)."""
    sums = {}
    for r in results:
        layer = r["shape"].rsplit(".", 1)[0]
        s = sums.setdefault(layer, dict(n=0, ours=0.0, gmm=0.0, loop=0.0, fastest=0.0))
        s["n"] += 1
        s["ours"] += r["ms"]
        s["gmm"] += r["gmm_ms"]
        s["loop"] += r["loop_ms"]
        s["fastest"] += min(t for t in (r["ms"], r["gmm_ms"], r["loop_ms"]) if not math.isnan(t))
    return {layer: s for layer, s in sums.items() if s["n"] == 6}


def print_layer_sums(results):
    """The six products summed per layer beside the whole layer's time goal (shapes.GOAL_MS):
    what is left of the goal for everything else the layer does (router, permutation, the
    activation, the combine) if its GEMMs ran at these speeds."""
    sums = layer_sums(results)
    if not sums:
        return
    print(f"\nthe six products summed (one forward + backward's expert GEMMs), ms; goal: the "
          f"whole layer's (shapes.GOAL_MS)\n{'layer':14s} {'ours':>8s} {'gmm':>8s} {'loop':>8s} "
          f"{'fastest':>8s} {'goal':>6s} {'goal - fastest':>14s}")
    for layer, s in sums.items():
        goal = GOAL_MS.get(layer, float("nan"))
        print(f"{layer:14s} {s['ours']:8.3f} {s['gmm']:8.3f} {s['loop']:8.3f} "
              f"{s['fastest']:8.3f} {goal:6.1f} {goal - s['fastest']:14.3f}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", default=",".join(LAYERS))
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--fused", choices=("yes", "only", "no"), default="yes",
                    help="the fc1 + SwiGLU + probs rows: with the products, alone, or not")
    ap.add_argument("--variant", default=None, metavar="VAR=VALUE",
                    help="also time ours with this environment option in the same rounds "
                         "(e.g. MOE_GG_SM90_SPLIT_TAIL=0); 'vs var' > 1: the default is faster")
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    print(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | CUDA {torch.version.cuda}")
    ceiling = dense_ceiling("cuda", args.reps, queued=True)
    print(f"dense bf16 ceiling (torch.mm 8192^3): {ceiling:.0f} TFLOP/s")
    gen = torch.Generator(device="cuda").manual_seed(0)
    results, fused_rows = [], []
    for layer in args.layers.split(","):
        T, H, E, k, ffn = LAYERS[layer]
        counts = routing_counts(T, E, k, gen)
        print(f"{layer}: rows {T * k}, experts {E}, rows/expert min {min(counts)} "
              f"max {max(counts)}, tiles of 128 rows {sum((c + 127) // 128 for c in counts)}",
              flush=True)
        if args.fused != "only":
            for fc, (K, N) in (("fc1", (H, 2 * ffn)), ("fc2", (ffn, H))):
                print(f" {layer}.{fc}: K={K} N={N}", flush=True)
                bench_problem(f"{layer}.{fc}", counts, K, N, args.reps, ceiling, results,
                              args.variant)
        if args.fused != "no":
            print(f" {layer}.fc1+swiglu+probs: K={H} N={2 * ffn} -> F={ffn}", flush=True)
            bench_fused_fc1(f"{layer}.fc1+act", counts, H, ffn, args.reps, ceiling, fused_rows)
    if results:
        print(f"\n{'shape':22s} {'prod':5s} {'ms':>8s} {'TFLOP/s':>8s} {'vs gmm':>7s} "
              f"{'vs loop':>7s} {'%dense':>6s}" + (f" {'vs var':>7s}" if args.variant else ""))
    for r in results:
        print(f"{r['shape']:22s} {r['prod']:5s} {r['ms']:8.3f} {r['tflops']:8.1f} "
              f"{r['vs_gmm']:7.2f} {r['vs_loop']:7.2f} {r['pct']:6.1f}" +
              (f" {r['vs_var']:7.3f}" if args.variant else ""))
    print_layer_sums(results)
    if fused_rows:
        print(f"\n{'shape':22s} {'ms':>8s} {'TFLOP/s':>8s} {'torch':>8s} {'vs torch':>8s} "
              f"{'%dense':>6s}")
    for r in fused_rows:
        print(f"{r['shape']:22s} {r['ms']:8.3f} {r['tflops']:8.1f} {r['torch_ms']:8.3f} "
              f"{r['vs_torch']:8.2f} {r['pct']:6.1f}")


if __name__ == "__main__":
    main()
