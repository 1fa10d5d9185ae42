"""Expert-parallel MoE layer: ours vs Megatron-Core's MoELayer (alltoall dispatcher), same run.

Launched with torchrun (EP = world size, one process a GPU) or as plain python (a world of one).
Per mode (dropless; drop-and-pad at capacity factor 1.0) and reference shape (docs/design.md,
tokens per rank), on every rank:

* the whole layer, forward + backward and forward alone: ours at EP = N (``MoELayer(config,
  ep_group)``) against Megatron-Core 0.19.2's ``MoELayer`` with the alltoall dispatcher and the
  local spec (``get_gpt_layer_local_submodules(num_experts=E, moe_grouped_gemm=False)``: its
  SequentialMLP experts, no Transformer Engine, ``moe_permute_fusion=False``) at the same EP
  size, ours loaded from Megatron's state dict (``load_megatron_state_dict``), the same inputs;
* at a world of one also our plain layer (no ep_group, "ours plain") against our EP path with an
  explicit group of one: the cost of the expert-parallel code path itself (target: at most 3%).
  At one rank our dispatcher skips its identity collectives by default ("ours EP"; Megatron's
  all-to-all likewise returns its input at one rank); "ours EP+a2a" forces them
  (``dispatcher.exchange = True``: the counts all-gather, the host read of the split sizes and
  the NCCL all-to-alls all run), which is what an EP rank pays beyond the exchanged bytes. The
  three share one copy of the weights;
* dispatch + combine alone (forward + backward, the experts replaced by the identity) on the same
  routing, ours vs Megatron's dispatcher, and a bare ``torch.distributed.all_to_all_single`` of
  this rank's dispatch rows with the same split sizes. "a2a GB/s" is the bytes our exchanges move
  per rank in one dispatch + combine forward + backward (tokens out and back, fp32 probs out, the
  two gradients back and out) divided by the measured time; the bare exchange's GB/s is its bytes
  over its time. At EP = 1 ours runs with its collectives forced, Megatron's all-to-all is a
  no-op there.

Method (docs/design.md): random inputs (a different seed per rank, two input sets
rotated), the variants timed in interleaved rounds (one call of each per round: ours, Megatron,
ours, ...) after a warm-up, each call bracketed by CUDA events and waited for before the next,
median over the rounds, then the maximum of the ranks' medians. Gradients are freed after every
call (outside the timed region), so each backward allocates its gradients fresh, on both sides.
Peak memory is the peak allocated during one forward + backward above what was allocated before
it (gradients included). Host syncs per step: host waits on CUDA events (``torch.cuda.Event.
synchronize`` wrapped, which catches our split-size wait and Megatron's ``d2h_event``) plus every
stream-blocking operation that ``torch.cuda.set_sync_debug_mode("warn")`` reports (``.item()``,
``.tolist()``, blocking copies, stream / device synchronisation), counted over one forward and
one backward after the timing.

On the CPU (``--device cpu``, gloo) the same code runs for a smoke test at ``--shape tiny``,
Megatron with the CPU patches of tests/helpers/megatron_layer.py plus two for its alltoall
dispatcher (no side stream; split sizes read with ``.tolist()``); times then come from
``perf_counter``.

    torchrun --nproc-per-node N -m benchmarks.bench_ep
        [--shape qwen3_30b_a3b|dsv3_like|mixtral|tiny] [--tokens T] [--experts E]
        [--modes dropless,drop_pad] [--skip-megatron] [--no-dispatch] [--warmup W] [--rounds R]
        [--device cuda|cpu]
    python -m benchmarks.bench_ep --shape qwen3_30b_a3b          (a world of one)
"""
import argparse
import contextlib
import dataclasses
import datetime
import gc
import os
import socket
import sys
import time
import warnings
from typing import Callable, Dict, List, Optional, Tuple

for _var, _val in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                   ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(_var, _val)  # NVLink multicast stays off (see benchmarks/README.md)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import moe_core  # noqa: E402
from benchmarks.shapes import EP_SHAPES, SHAPES, Shape  # noqa: E402,F401
from benchmarks.timing import Variant, peak_bytes, sync, time_interleaved  # noqa: E402,F401
from moe_core import MoEConfig, MoELayer, load_megatron_state_dict  # noqa: E402
from moe_core.ops import AuxLossScale  # noqa: E402

# the sync-debug mode's warning for a blocking operation (its first use also warns that the mode
# is a prototype, which is not a sync)
SYNC_WARNING = "called a synchronizing CUDA operation"


MODES: Dict[str, dict] = {
    "dropless": {},
    "drop_pad": dict(moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=True),
}


# ---- process group and device -------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(device_kind: str) -> torch.device:
    """A process group over every rank (torchrun's environment, else a world of one): NCCL on
    CUDA (one GPU a process), gloo on the CPU. Returns this rank's device."""
    if "RANK" not in os.environ:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0",
                          WORLD_SIZE="1", LOCAL_RANK="0")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    timeout = datetime.timedelta(minutes=10)
    if device_kind == "cuda":
        dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(dev)
        dist.init_process_group("nccl", rank=rank, world_size=world, timeout=timeout,
                                device_id=dev)
    else:
        dev = torch.device("cpu")
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timeout)
    return dev


def patch_megatron_for_cpu() -> None:
    """Megatron's MoELayer on the CPU: the patches of the gloo parity tests
    (tests/helpers/megatron_ep.py: gating without .cuda(), eager expert-bias counting,
    ``torch.cuda.current_device`` answering "cpu", and for the alltoall dispatcher no side stream
    and host split sizes)."""
    from tests.helpers import megatron_ep

    megatron_ep.patch_megatron_for_cpu_ep()


# ---- layers -------------------------------------------------------------------------------
def moe_kwargs(shape: Shape, mode: str, world: int) -> dict:
    """The MoE fields both layers share (MoEConfig names = TransformerConfig names)."""
    kw = dict(hidden_size=shape.hidden, moe_ffn_hidden_size=shape.ffn,
              ffn_hidden_size=4 * shape.hidden, num_moe_experts=shape.experts,
              moe_router_topk=shape.topk, add_bias_linear=False, gated_linear_unit=True,
              activation_func=F.silu, params_dtype=torch.bfloat16, moe_router_dtype="fp32",
              moe_token_dispatcher_type="alltoall", moe_permute_fusion=False,
              moe_grouped_gemm=False, expert_model_parallel_size=world, num_layers=1)
    kw.update(dict(shape.router))
    kw.update(MODES[mode])
    return kw


def build_megatron(kw: dict, dev: torch.device, seed: int):
    """Megatron's MoELayer (local spec, alltoall), parameters made on ``dev``."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_submodules
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer.moe.moe_layer import MoELayer as MegatronMoELayer
    from megatron.core.transformer.spec_utils import get_submodules
    from megatron.core.transformer.transformer_config import TransformerConfig

    world = kw["expert_model_parallel_size"]
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(1, 1, expert_model_parallel_size=world)
    torch.manual_seed(seed)
    on_cpu = dev.type == "cpu"
    if not on_cpu:
        model_parallel_cuda_manual_seed(seed)
    cfg = TransformerConfig(**kw, num_attention_heads=4, bf16=True, use_cpu_initialization=on_cpu,
                            perform_initialization=True)
    sub = get_gpt_layer_local_submodules(num_experts=kw["num_moe_experts"], moe_grouped_gemm=False)
    with torch.device(dev):
        layer = MegatronMoELayer(cfg, get_submodules(sub.mlp))
    layer.router.set_layer_number(1)
    layer.to(dev)
    with torch.no_grad():  # the replicated parameters equal on every rank
        for name, p in layer.named_parameters():
            if "local_experts" not in name:
                dist.broadcast(p.data, 0)
    return layer.train()


def build_ours(kw: dict, dev: torch.device, seed: int, ep_group, state: Optional[dict]):
    """Our MoELayer on ``dev`` (an EP layer when ``ep_group`` is given, else the plain layer
    holding every expert), loaded from Megatron's ``state`` when given."""
    torch.manual_seed(seed)
    cfg = MoEConfig(**{k: v for k, v in kw.items() if k in MoEConfig.__dataclass_fields__})
    if ep_group is None:
        cfg = dataclasses.replace(cfg, expert_model_parallel_size=1)
    sync(dev)
    t0 = time.perf_counter()
    layer = MoELayer(cfg, ep_group=ep_group, device=dev)  # built and initialised on dev
    sync(dev)
    print(f"built our MoELayer on {dev} in {time.perf_counter() - t0:.3f} s "
          f"({sum(p.numel() for p in layer.parameters()) / 1e9:.2f} G parameters)", flush=True)
    if state is not None:
        load_megatron_state_dict(layer, state)
    layer.router.aux_loss_scale = AuxLossScale(1.0, device=dev)
    return layer.train()


def set_rows_by_index(layer: MoELayer, choice: str) -> None:
    """``--rows-by-index``: "on" / "off" set ``moe_expert_rows_by_index`` of our layer; "auto"
    keeps the default (by device)."""
    if choice != "auto":
        layer.config = dataclasses.replace(layer.config, moe_expert_rows_by_index=choice == "on")


@contextlib.contextmanager
def count_host_syncs(counts: Dict[str, int]):
    """Counts, into ``counts``, host waits on CUDA events (``torch.cuda.Event.synchronize``)
    and the stream-blocking operations that the sync-debug mode reports, while inside."""
    original = torch.cuda.Event.synchronize

    def counted(event):
        counts["event"] = counts.get("event", 0) + 1
        return original(event)

    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.Event.synchronize = counted
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                yield counts
            finally:
                torch.cuda.set_sync_debug_mode(previous)
    finally:
        torch.cuda.Event.synchronize = original
    counts["blocking"] = counts.get("blocking", 0) + sum(
        SYNC_WARNING in str(w.message) for w in seen)


def host_syncs(forward: Callable[[], Tuple[torch.Tensor, torch.Tensor]],
               dev: torch.device) -> str:
    """'forward/backward' host syncs of one step (event waits + blocking ops), or 'n/a'."""
    if dev.type != "cuda":
        return "n/a"
    fwd: Dict[str, int] = {}
    bwd: Dict[str, int] = {}
    with count_host_syncs(fwd):
        out, g = forward()
    with count_host_syncs(bwd):
        out.backward(g)
    sync(dev)
    return (f"{fwd.get('event', 0) + fwd.get('blocking', 0)}/"
            f"{bwd.get('event', 0) + bwd.get('blocking', 0)}")


# ---- one mode -----------------------------------------------------------------------------
@dataclasses.dataclass
class Row:
    label: str
    mode: str
    fwd_bwd_ms: float = float("nan")
    fwd_ms: float = float("nan")
    peak_gib: float = float("nan")
    syncs: str = "n/a"
    vs_megatron: str = ""
    vs_plain: str = ""
    check: str = ""


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b| in fp32."""
    a, b = a.float(), b.float()
    return (a - b).abs().max().item() / max(b.abs().max().item(), 1e-30)


def free_grads(*modules) -> None:
    for m in modules:
        for p in m.parameters():
            p.grad = None


def share_parameters(dst: torch.nn.Module, src: torch.nn.Module) -> None:
    """Make ``dst`` use ``src``'s parameter tensors (same names; its own are freed)."""
    for name, p in src.named_parameters():
        owner, _, attr = name.rpartition(".")
        setattr(dst.get_submodule(owner), attr, p)


def can_force_exchange(layer: MoELayer) -> bool:
    """True when the dispatcher has the ``exchange`` switch (collectives at a group of one)."""
    return isinstance(getattr(layer.dispatcher, "exchange", None), bool)


def run_mode(args, shape: Shape, mode: str, dev: torch.device, rank: int, world: int,
             group) -> Tuple[List[Row], List[str]]:
    """The layer variants of one mode: checked, timed, measured; plus dispatch + combine."""
    kw = moe_kwargs(shape, mode, world)
    T, H = shape.tokens, shape.hidden
    # variant -> (module, the dispatcher's exchange switch during its calls, or None)
    variants: Dict[str, Tuple[torch.nn.Module, Optional[bool]]] = {}
    meg = None
    if not args.skip_megatron:
        meg = build_megatron(kw, dev, args.seed)
        variants["megatron"] = (meg, None)
    state = meg.state_dict() if meg is not None else None
    ep = build_ours(kw, dev, args.seed, group, state)
    if world == 1:
        # at one rank the EP dispatcher skips its identity collectives; "+a2a" forces them
        plain = build_ours(kw, dev, args.seed, None,
                           state if state is not None else ep.state_dict())
        share_parameters(plain, ep)  # one copy of the weights for both
        if can_force_exchange(ep):
            variants["ours EP"] = (ep, False)
            variants["ours EP+a2a"] = (ep, True)
        else:
            variants["ours EP"] = (ep, None)
        variants["ours plain"] = (plain, None)
    else:
        variants["ours EP"] = (ep, None)
    del state
    gen = torch.Generator(device=dev).manual_seed(1000 + rank)
    xs = [torch.randn(T, 1, H, device=dev, generator=gen).to(torch.bfloat16) for _ in range(2)]
    gs = [torch.randn(T, 1, H, device=dev, generator=gen).to(torch.bfloat16) for _ in range(2)]
    if meg is not None:
        from megatron.core.transformer.moe import moe_utils

        moe_utils.MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0, device=dev))

    def forward(name: str, i: int):
        module, exchange = variants[name]
        if exchange is not None:
            module.dispatcher.exchange = exchange
        x = xs[i % 2].detach().requires_grad_()
        out = module(x)
        return (out[0] if name == "megatron" else out), x

    def fwd_bwd(name: str) -> Callable[[int], None]:
        def run(i: int) -> None:
            out, _ = forward(name, i)
            out.backward(gs[i % 2])
        return run

    def fwd_only(name: str) -> Callable[[int], None]:
        def run(i: int) -> None:
            forward(name, i)
        return run

    def cleanup_of(name: str) -> Callable[[], None]:
        return lambda: free_grads(variants[name][0])

    # correctness first: one step of each, outputs and input gradients compared
    results, maps = {}, {}
    for name in variants:
        router = variants[name][0].router
        hook = router.register_forward_hook(
            lambda m, i, o, name=name: maps.__setitem__(name, o[1].detach().reshape(-1, o[1].shape[-1])))
        out, x = forward(name, 0)
        hook.remove()
        out.backward(gs[0])
        results[name] = (out.detach(), x.grad)
        cleanup_of(name)()
    checks = {}
    if meg is not None:
        # tokens routed differently (near-ties: Megatron's CUDA sigmoid / softmax may differ from
        # ours by an ulp) change whole rows; the error is also given over the other tokens
        same_rows = (maps["ours EP"] == maps["megatron"]).all(1)
        H = results["megatron"][0].shape[-1]
        diffs = torch.tensor(
            [rel_diff(a, b) for a, b in zip(results["ours EP"], results["megatron"])]
            + [rel_diff(a.reshape(-1, H)[same_rows], b.reshape(-1, H)[same_rows])
               for a, b in zip(results["ours EP"], results["megatron"])]
            + [float((~same_rows).sum().item())], dtype=torch.float64, device=dev)
        dist.all_reduce(diffs, op=dist.ReduceOp.MAX)
        checks["ours EP"] = (f"vs megatron, max over ranks of max|diff| / max|megatron|: "
                             f"out {diffs[0].item():.1e}, dx {diffs[1].item():.1e}; tokens routed "
                             f"differently {int(diffs[4].item())}, over the others: out "
                             f"{diffs[2].item():.1e}, dx {diffs[3].item():.1e}")
    for name in ("ours EP", "ours EP+a2a"):
        if "ours plain" in variants and name in variants:
            same = all(torch.equal(a, b) for a, b in zip(results[name], results["ours plain"]))
            checks[name] = (checks.get(name, "") + ("; " if name in checks else "")
                            + "== plain layer, out and dx: " + ("bitwise" if same else "DIFFER"))
    del results

    t_fb = time_interleaved({n: (fwd_bwd(n), cleanup_of(n)) for n in variants}, dev,
                            args.warmup, args.rounds)
    t_f = time_interleaved({n: (fwd_only(n), cleanup_of(n)) for n in variants}, dev,
                           args.warmup, args.rounds)
    rows = []
    for name in variants:
        row = Row(name, mode, t_fb[name], t_f[name], check=checks.get(name, ""))
        row.peak_gib = peak_bytes(lambda: fwd_bwd(name)(0), cleanup_of(name), dev) / 2**30

        def one_forward(name=name):
            out, _ = forward(name, 1)
            return out, gs[1]
        row.syncs = host_syncs(one_forward, dev)
        cleanup_of(name)()
        if meg is not None and name != "megatron":
            row.vs_megatron = f"{t_fb['megatron'] / t_fb[name]:.2f}x"
        if "ours plain" in variants and name.startswith("ours EP"):
            row.vs_plain = f"{(t_fb[name] / t_fb['ours plain'] - 1) * 100:+.1f}%"
        rows.append(row)

    lines = []
    if not args.no_dispatch:
        forced = world == 1 and can_force_exchange(ep)
        if forced:
            ep.dispatcher.exchange = True
        lines = dispatch_bench(args, ep, meg, xs, gs, dev, rank, world, group, mode)
        if forced:
            lines[0] += " (ours with its collectives forced at EP = 1)"
    variants.clear()
    del ep, meg
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return rows, lines


# ---- dispatch + combine alone -------------------------------------------------------------
def dispatch_bench(args, ep: MoELayer, meg, xs, gs, dev, rank: int, world: int, group,
                   mode: str) -> List[str]:
    """Dispatch + combine forward + backward (identity experts) on one routing; a bare
    all_to_all_single of this rank's dispatch rows beside them."""
    T, H = xs[0].shape[0], xs[0].shape[-1]
    E = ep.config.num_moe_experts
    nle = E // world
    pad = ep.config.moe_pad_expert_input_to_capacity
    num_rows = ep.num_out_tokens(T)
    with torch.no_grad():
        probs, rmap = ep.router(xs[0])
    probs, rmap = probs.detach(), rmap.detach()
    x2d = [x.reshape(T, H) for x in xs]
    g2d = [g.reshape(T, H) for g in gs]
    if pad:
        in_splits = out_splits = [num_rows // world] * world
    else:
        counts = rmap.sum(0, dtype=torch.long)
        gathered = torch.empty(world * E, dtype=torch.long, device=dev)
        dist.all_gather_into_tensor(gathered, counts, group=group)
        gathered = gathered.view(world, E)
        in_splits = counts.view(world, nle).sum(1).tolist()
        out_splits = gathered[:, rank * nle:(rank + 1) * nle].sum(1).tolist()
    s_in, s_out = sum(in_splits), sum(out_splits)
    elt = xs[0].element_size()
    a2a_bytes = (2 * s_in + 2 * s_out) * H * elt + s_in * 4  # fwd: x, probs, y; bwd: dy, dx
    send = torch.randn(s_in, H, device=dev).to(xs[0].dtype)
    recv = torch.empty(s_out, H, device=dev, dtype=xs[0].dtype)

    def ours(i: int) -> None:
        x = x2d[i % 2].detach().requires_grad_()
        rows, _, _, handle = ep.dispatch(x, probs, rmap)
        ep.dispatcher.combine(rows, handle).backward(g2d[i % 2])

    def bare(i: int) -> None:
        dist.all_to_all_single(recv, send, out_splits, in_splits, group=group)

    variants: Dict[str, Variant] = {"ours dispatch+combine": (ours, lambda: None)}
    if meg is not None:
        td = meg.token_dispatcher

        def megatron(i: int) -> None:
            x = xs[i % 2].detach().requires_grad_()
            h, p = td.dispatch_preprocess(x, rmap, probs)
            h, p = td.token_dispatch(h, p)
            h, _, p = td.dispatch_postprocess(h, p)
            h = td.token_combine(td.combine_preprocess(h))
            td.combine_postprocess(h).backward(gs[i % 2])
        variants["megatron dispatch+combine"] = (megatron, lambda: None)
    variants["bare all_to_all_single"] = (bare, lambda: None)
    t = time_interleaved(variants, dev, args.warmup, args.rounds)
    bare_gbps = s_in * H * elt / t["bare all_to_all_single"] / 1e6
    lines = [f"{mode}: rows sent / received per rank {s_in} / {s_out}, a2a bytes per step "
             f"{a2a_bytes / 2**20:.1f} MiB; bare all_to_all_single of the dispatch rows "
             f"{t['bare all_to_all_single']:.3f} ms = {bare_gbps:.1f} GB/s"]
    for name in variants:
        if name.startswith("bare"):
            continue
        gbps = a2a_bytes / t[name] / 1e6
        ideal = a2a_bytes / (bare_gbps * 1e6)
        lines.append(f"  {name:<27} {t[name]:8.3f} ms  a2a {gbps:7.1f} GB/s  "
                     f"(exchange at the bare rate would take {ideal:.3f} ms, "
                     f"{ideal / t[name] * 100:.0f}% of this)")
    if meg is not None:
        speedup = t["megatron dispatch+combine"] / t["ours dispatch+combine"]
        lines.append(f"  ours vs megatron: {speedup:.2f}x"
                     + (" (Megatron's all-to-all is a no-op at EP = 1)" if world == 1 else ""))
    return lines


# ---- main ---------------------------------------------------------------------------------
def add_run_args(ap: argparse.ArgumentParser) -> None:
    """The options every layer benchmark shares: rounds, warm-up, seed, device."""
    ap.add_argument("--warmup", type=int)
    ap.add_argument("--rounds", type=int)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--device", choices=("cuda", "cpu"),
                    default="cuda" if torch.cuda.is_available() else "cpu")


def resolve_run_args(args: argparse.Namespace) -> bool:
    """Fills the device-dependent defaults of :func:`add_run_args`; True on the CPU."""
    cpu = args.device == "cpu"
    args.warmup = args.warmup if args.warmup is not None else (1 if cpu else 3)
    args.rounds = args.rounds if args.rounds is not None else (3 if cpu else 20)
    return cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="qwen3_30b_a3b", choices=sorted(EP_SHAPES))
    ap.add_argument("--tokens", type=int, help="tokens per rank (default: the shape's)")
    ap.add_argument("--experts", type=int, help="number of experts (default: the shape's)")
    ap.add_argument("--modes", default="dropless,drop_pad")
    ap.add_argument("--skip-megatron", action="store_true")
    ap.add_argument("--no-dispatch", action="store_true", help="skip dispatch + combine alone")
    add_run_args(ap)
    args = ap.parse_args()
    cpu = resolve_run_args(args)
    modes = [m for m in args.modes.split(",") if m]
    for m in modes:
        if m not in MODES:
            ap.error(f"--modes: {m!r} is not one of {sorted(MODES)}")
    shape = SHAPES[args.shape]
    if args.tokens:
        shape = dataclasses.replace(shape, tokens=args.tokens)
    if args.experts:
        shape = dataclasses.replace(shape, experts=args.experts)

    dev = init_distributed(args.device)
    rank, world = dist.get_rank(), dist.get_world_size()
    if cpu:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
        if not args.skip_megatron:
            patch_megatron_for_cpu()
    warnings.filterwarnings("ignore")
    group = dist.new_group(list(range(world)))  # our EP group: every rank, explicitly
    if shape.experts % world:
        raise SystemExit(f"{shape.experts} experts do not split over {world} ranks")
    if rank == 0:
        where = (torch.cuda.get_device_name(dev) if dev.type == "cuda"
                 else f"CPU, {torch.get_num_threads()} threads a rank")
        print(f"bench_ep: {args.shape} tokens/rank={shape.tokens} hidden={shape.hidden} "
              f"experts={shape.experts} topk={shape.topk} ffn={shape.ffn} EP={world}; {where}; "
              f"torch {torch.__version__}, moe_core {moe_core.__version__}; "
              f"warm-up {args.warmup}, rounds {args.rounds}", flush=True)
    rows: List[Row] = []
    for mode in modes:
        mode_rows, lines = run_mode(args, shape, mode, dev, rank, world, group)
        rows += mode_rows
        if rank == 0:
            for r in mode_rows:
                if r.check:
                    print(f"{mode}: {r.label}: {r.check}")
            for line in lines:
                print(line)
            sys.stdout.flush()
    if rank == 0:
        tok = shape.tokens * world
        print(f"\nMoE layer, {args.shape}, EP={world}, {tok} tokens a step over all ranks "
              f"(ms: max over ranks of the median; syncs: host syncs fwd/bwd)")
        print(f"{'layer':<12} {'mode':<9} {'fwd+bwd ms':>10} {'fwd ms':>8} {'tok/s':>10} "
              f"{'vs mcore':>8} {'vs plain':>8} {'peak GiB':>8} {'syncs':>6}")
        for r in rows:
            print(f"{r.label:<12} {r.mode:<9} {r.fwd_bwd_ms:10.3f} {r.fwd_ms:8.3f} "
                  f"{tok / (r.fwd_bwd_ms / 1e3):10.3g} {r.vs_megatron:>8} {r.vs_plain:>8} "
                  f"{r.peak_gib:8.2f} {r.syncs:>6}")
        sys.stdout.flush()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
