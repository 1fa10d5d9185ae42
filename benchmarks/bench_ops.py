"""Op benchmark: each moe-core CUDA op vs megatron-core's own function, same GPU, same run.

For the reference shapes of docs/design.md (plus dsv3 at T=16384), times every op of the
routing and token-layout path and the experts' glu_probs (against the eager sequence Megatron's
local MLP runs) with CUDA events (warm-up, median of many, inputs rotated through
copies larger than L2 so no run reads a warm cache), after measuring the device-to-device copy
bandwidth. Per op and shape it prints: our time, Megatron-Core's, the speed-up, the bytes the op
must move at least, the achieved TB/s and its % of the copy bandwidth (TFLOP/s for the gating
GEMM). Both sides are called eagerly through their Python API, as a training step calls them.
With --graph each side is captured in one CUDA graph of 8 calls back to back (cycling through the
input copies) and the replay time per call is reported: the GPU time the op adds to a captured
step, without the Python / dispatcher cost of an eager call or the graph's own launch latency
(a Megatron-Core function that syncs with the host cannot be captured: shown as n/a).

    python -m benchmarks.bench_ops [--iters N] [--shapes mixtral,qwen3_30b_a3b,...] [--ops ...]
                                   [--graph]
"""
import argparse
import math
import warnings

import torch

import moe_core
from benchmarks.shapes import OP_SHAPES, SHAPES, routing_options
from benchmarks.timing import copy_bandwidth, median_ms
from moe_core import ops
from moe_core.ops.router_topk import router_topk_fused, z_loss_from_lse

warnings.filterwarnings("ignore")
from megatron.core.transformer.moe import moe_utils as mcore  # noqa: E402

L2_ROTATE_BYTES = 256 << 20


def timer(fn, args_list, iters):
    """Median seconds of fn(*args) over iters runs, cycling through args_list (cold L2)."""
    for a in args_list[:3]:
        fn(*a)
    return median_ms(lambda i: fn(*args_list[i % len(args_list)]), "cuda", iters) / 1e3


GRAPH_CALLS = 8


def graph_timer(fn, args_list, iters):
    """Median seconds per call of fn(*args) replayed from a CUDA graph of GRAPH_CALLS calls back to
    back, cycling through args_list (cold L2): the time the op adds to a captured training step,
    without the graph's own launch latency (about 8-10 us a replay, which would otherwise be
    charged to one call). None when fn cannot be captured (it waits on the host)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the default stream, as capture requires
        for a in args_list[:3]:
            fn(*a)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(g):
            for i in range(GRAPH_CALLS):
                fn(*args_list[i % len(args_list)])
    except RuntimeError:
        torch.cuda.synchronize()
        return None
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    return median_ms(lambda i: g.replay(), "cuda", iters) / 1e3 / GRAPH_CALLS


def copies(make, nbytes):
    """Enough independent copies of an input tuple to overflow L2 when cycled."""
    n = max(1, min(8, math.ceil(L2_ROTATE_BYTES / max(nbytes, 1))))
    return [make() for _ in range(n)]


def has_cuda_kernel(op):
    return torch._C._dispatch_has_kernel_for_dispatch_key(f"moe_core::{op}", "CUDA")


def routing(T, E, k, o, dev="cuda"):
    logits = torch.randn(T, E, device=dev)
    bias = torch.randn(E, device=dev) * 0.1 if o.get("bias") else None
    kw = {key: v for key, v in o.items() if key != "bias"}
    return logits, dict(topk=k, expert_bias=bias, **kw)


def cases(name, T, H, E, k, o):
    """(op label, moe-core op name, ours(*a), megatron(*a), arg-maker, bytes, flops)."""
    bf = torch.bfloat16
    logits0, rkw = routing(T, E, k, o)
    probs0, map0 = mcore.topk_routing_with_score_function(logits0, **rkw)
    R = T * k

    def mk_logits():
        return (torch.randn(T, E, device="cuda"),)

    yield ("router fwd (fused, dense)", "router_topk_dense",
           lambda x: ops.topk_routing_with_score_function(x, **rkw),
           lambda x: mcore.topk_routing_with_score_function(x, **rkw),
           mk_logits, T * E * (4 + 4 + 1), 0)

    def ours_train(x):
        out = router_topk_fused(x, with_aux=True, with_lse=True, **rkw)
        return out, z_loss_from_lse(out[5], 1e-3)

    def mcore_train(x):
        return (mcore.topk_routing_with_score_function(x, **rkw),
                mcore.compute_routing_scores_for_aux_loss(x, k, o["score_function"]),
                mcore.z_loss_func(x, 1e-3))

    # the layer's training call: routing + the aux-loss scores and map + the z-loss; Megatron's
    # router makes these three calls over the logits, ours one pass (and a [T] z-loss reduction)
    yield ("router fwd + aux + z-loss", "router_topk_fused", ours_train, mcore_train,
           mk_logits, T * E * (4 + 4 + 1 + 4 + 1), 0)

    def mk_tokens():
        return (torch.randn(T, H, device="cuda", dtype=bf), map0, probs0)

    yield ("permute fwd (dropless, probs)", "permute",
           lambda x, m, p: ops.permute(x, m, p, num_out_tokens=R),
           lambda x, m, p: mcore.permute(x, m, p, num_out_tokens=R),
           mk_tokens, (T + R) * H * 2 + T * E * (1 + 4) + R * (4 + 8), 0)

    pt0, _, idx0, off0, _ = ops.permute(torch.randn(T, H, device="cuda", dtype=bf), map0, None,
                                        num_out_tokens=R)
    _, _, midx0, _, _ = mcore.permute(torch.randn(T, H, device="cuda", dtype=bf), map0, None,
                                      num_out_tokens=R)

    def mk_rows():
        return (torch.randn(R, H, device="cuda", dtype=bf),)

    yield ("unpermute fwd (combine)", "unpermute",
           lambda x: ops.unpermute(x, idx0, (T, H)),
           lambda x: mcore.unpermute(x, midx0, torch.Size((T, H)), routing_map=map0),
           mk_rows, (T + R) * H * 2 + R * 8, 0)

    def mk_rows_grad():
        x = torch.randn(R, H, device="cuda", dtype=bf, requires_grad=True)
        return (x, torch.randn(T, H, device="cuda", dtype=bf))

    def ours_unperm_fb(x, g):
        ops.unpermute(x, idx0, (T, H)).backward(g)

    def mcore_unperm_fb(x, g):
        mcore.unpermute(x, midx0, torch.Size((T, H)), routing_map=map0).backward(g)

    yield ("unpermute fwd+bwd", "unpermute_bwd", ours_unperm_fb, mcore_unperm_fb, mk_rows_grad,
           2 * (T + R) * H * 2 + 2 * R * 8, 0)

    sc = o["score_function"]
    yield ("aux-loss scores", "aux_loss_scores",
           lambda x: ops.compute_routing_scores_for_aux_loss(x, k, sc),
           lambda x: mcore.compute_routing_scores_for_aux_loss(x, k, sc),
           mk_logits, T * E * (4 + 4 + 1), 0)

    def mk_probs():
        return (torch.rand(T, E, device="cuda"), map0.sum(0))

    yield ("switch aux loss", "switch_aux_loss",
           lambda p, c: ops.switch_load_balancing_loss_func(p, c, T, k, E, 1e-2),
           lambda p, c: mcore.switch_load_balancing_loss_func(p, c, T, k, E, 1e-2),
           mk_probs, T * E * 4, 0)
    yield ("z-loss", "z_loss", lambda x: ops.z_loss_func(x, 1e-3),
           lambda x: mcore.z_loss_func(x, 1e-3), mk_logits, T * E * 4, 0)

    def mk_map():
        return (map0,)

    yield ("tokens per expert", "tokens_per_expert",
           lambda m: ops.tokens_per_expert(m), lambda m: m.sum(dim=0), mk_map, T * E, 0)

    def mk_drop():
        return (torch.rand(T, E, device="cuda") * map0, map0)

    yield ("token dropping (cf 1.0, probs)", "token_dropping",
           lambda p, m: ops.apply_router_token_dropping(p, m, k, 1.0),
           lambda p, m: mcore.apply_router_token_dropping(p, m, k, 1.0),
           mk_drop, T * E * 2 * (4 + 1), 0)

    split_cpu = torch.full((E,), R // E, dtype=torch.long)
    split_cpu[-1] += R - split_cpu.sum()
    order = torch.randperm(E)
    split_dev, order_dev = split_cpu.cuda(), order.cuda()
    yield ("sort_chunks_by_idxs", "sort_chunks_by_idxs",
           lambda x: ops.sort_chunks_by_idxs(x, split_dev, order_dev),
           lambda x: mcore.sort_chunks_by_idxs(x, split_cpu, order),
           mk_rows, 2 * R * H * 2, 0)

    wg = torch.randn(E, H, device="cuda", dtype=bf)

    def mk_hidden():
        return (torch.randn(T, H, device="cuda", dtype=bf),)

    yield ("gating GEMM (fp32 router)", "router_gating_linear",
           lambda x: ops.router_gating_linear(x, wg, None, torch.float32),
           lambda x: mcore.router_gating_linear(x, wg, None, torch.float32),
           mk_hidden, T * H * 2 + T * E * 4, 2 * T * H * E)

    # the experts' activation (SwiGLU) times the probs: ours one pass; Megatron's local MLP runs
    # the eager sequence (silu of the gate half times the linear half, times the probs in fp32,
    # cast back to bf16)
    F = SHAPES[name].ffn

    def mk_fc1():
        return (torch.randn(R, 2 * F, device="cuda", dtype=bf), torch.rand(R, device="cuda"))

    def mcore_glu(a, p):
        g, lin = torch.chunk(a, 2, dim=-1)
        return (torch.nn.functional.silu(g) * lin * p.unsqueeze(-1)).to(bf)

    yield ("glu_probs fwd (SwiGLU x probs)", "glu_probs",
           lambda a, p: ops.glu_probs(a, p, "silu", True), mcore_glu, mk_fc1,
           R * 3 * F * 2 + R * 4, 0)

    def mk_fc1_grad():
        return (torch.randn(R, 2 * F, device="cuda", dtype=bf, requires_grad=True),
                torch.rand(R, device="cuda", requires_grad=True),
                torch.randn(R, F, device="cuda", dtype=bf))

    # forward, then the backward: h's gradient and a read, a's gradient written (ours
    # recomputes the activation from a; Megatron's autograd keeps its intermediates)
    yield ("glu_probs fwd+bwd", "glu_probs_bwd",
           lambda a, p, g: ops.glu_probs(a, p, "silu", True).backward(g),
           lambda a, p, g: mcore_glu(a, p).backward(g), mk_fc1_grad,
           R * 3 * F * 2 + R * 5 * F * 2 + R * 8, 0)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--shapes", default=",".join(OP_SHAPES))
    ap.add_argument("--ops", default="", help="comma-separated substrings of op labels")
    ap.add_argument("--graph", action="store_true", help="time CUDA-graph replays, not eager calls")
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    bw = copy_bandwidth("cuda", args.iters)
    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"moe_core {moe_core.__version__}, copy bandwidth {bw / 1e12:.3f} TB/s")
    want = set(args.shapes.split(","))
    filters = [f for f in args.ops.split(",") if f]
    rows = []
    for name in OP_SHAPES:
        if name not in want:
            continue
        T, H, E, k, _ = SHAPES[name].dims()
        o = routing_options(SHAPES[name])
        torch.manual_seed(0)
        for label, op, ours, theirs, make, nbytes, flops in cases(name, T, H, E, k, o):
            if filters and not any(f in label for f in filters):
                continue
            if not has_cuda_kernel(op):
                rows.append((name, label, "(no CUDA kernel in this build)", None, nbytes, flops))
                continue
            inputs = copies(make, nbytes)
            time_it = graph_timer if args.graph else timer
            t_ours = time_it(ours, inputs, args.iters)
            t_meg = time_it(theirs, inputs, args.iters)
            if t_ours is None:
                t_ours = "(ours: not capturable in a CUDA graph)"
            rows.append((name, label, t_ours, t_meg, nbytes, flops))
            del inputs
            torch.cuda.empty_cache()
    print(f"\n{'shape':<14} {'op':<31} {'ours ms':>9} {'mcore ms':>9} {'speed-up':>9} "
          f"{'TB/s':>6} {'% copy bw':>9} {'TFLOP/s':>8}")
    for name, label, t_ours, t_meg, nbytes, flops in rows:
        if isinstance(t_ours, str):
            print(f"{name:<14} {label:<31} {t_ours:>40}")
            continue
        tbs = nbytes / t_ours / 1e12
        tfl = f"{flops / t_ours / 1e12:8.1f}" if flops else ""
        meg = f"{t_meg * 1e3:9.3f}" if t_meg is not None else f"{'n/a':>9}"
        ratio = f"{t_meg / t_ours:8.2f}x" if t_meg is not None else f"{'':>9}"
        print(f"{name:<14} {label:<31} {t_ours * 1e3:9.3f} {meg} "
              f"{ratio} {tbs:6.2f} {tbs * 1e12 / bw * 100:8.1f}% {tfl}")


if __name__ == "__main__":
    main()
