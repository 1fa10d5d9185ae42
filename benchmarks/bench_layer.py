"""The whole MoE layer on one device, forward + backward: ours (eager and compiled) vs
Megatron-Core's MoELayer vs a plain-PyTorch layer under torch.compile, same weights and inputs.

Per reference shape (docs/design.md: mixtral, qwen3_30b_a3b, dsv3_like; bf16 parameters and
activations, fp32 router, dropless; dsv3_like: sigmoid scores, 8 groups, group_topk 4, expert bias,
scaling 2.5, one shared expert of 2048, seq_aux_loss; the others: softmax, aux_loss), variants:

* ``ours eager``: ``moe_core.MoELayer``, loaded from Megatron's state dict
  (``load_megatron_state_dict``);
* ``ours compiled``: ``torch.compile(layer, fullgraph=True, dynamic=False)`` (inductor) of that
  same module (one copy of the weights); if dynamo refuses the full graph, ``fullgraph=False``,
  said in the output (a compiled variant that fails either way is dropped, its error printed);
* ``megatron``: Megatron-Core's ``MoELayer``, local spec (``SequentialMLP`` experts, no
  Transformer Engine), alltoall dispatcher at EP = 1, ``moe_permute_fusion=False``: the layer
  ``bench_ep.py`` builds (its builders are imported from there);
* ``plain compiled``: ``PlainMoE`` below, written in plain PyTorch and compiled the same way: fp32
  router linear, Megatron's ``topk_routing_with_score_function`` math (softmax after top-k; or
  sigmoid, expert bias for the choice, group-limited top-k, normalisation, scaling) and its
  switch load-balancing loss (attached like Megatron's autoscaler), a stable sort of the expert
  ids, a row gather, SwiGLU experts as two ``torch._grouped_mm`` (int32 cumulative offsets; the
  weights are ours, ``[E, out, in]``, handed to ``_grouped_mm`` as transposed views, a layout it
  takes), ``silu(gate) * up * prob``, an ``index_add_`` combine into fp32, the shared expert for
  dsv3_like. It shares our layer's parameter tensors (no third copy of the weights). On a CPU
  whose torch lacks ``_grouped_mm`` a per-expert loop stands in (smoke test only; on CUDA the
  variant is skipped rather than looped).

Measured per variant:

* ``fwd+bwd ms``: CUDA events around one forward + backward (``out.backward(g)`` with a random
  ``g``), the variants in interleaved rounds (one call of each per round, every call waited for),
  after ``--warmup`` rounds; median of ``--rounds``. Two random input / gradient sets, rotated.
  Parameter gradients are freed after every call (outside the timed region), so every backward
  allocates them fresh. On the CPU the wall clock stands in for the events.
* ``queued ms``: the same step queued back to back (``timing.time_sustained``: events around each
  call, one wait at the end, median over at least ``--rounds`` calls and ``--sustain-s`` seconds
  after one warm-up call), so the host runs ahead of the GPU as it does in a training loop, where
  the layers before this one keep the GPU busy while the host prepares it, and the card settles at
  the clock its power limit allows under sustained load (``SM MHz`` and ``W``, sampled with
  nvidia-smi meanwhile). ``fwd+bwd ms`` exposes the host's start-up work (the GPU idles until the
  first kernels are queued) and this hides it; the difference is how much of a step the GPU waits
  for the host. On the CPU: n/a. The time goals (``GOAL_MS``) are on this time.
* ``graph ms``: the step captured in a CUDA graph and replayed back to back (variants with no host
  sync; a capture that fails is said in the notes): the step with no host work at all.
* ``host ms``: the host's own time to issue one step (Python, autograd, the binding, the launches),
  each call made while a sleep kernel keeps the GPU busy (``timing.host_issue_ms``); "waits for
  the GPU" where a host sync inside made it longer than the sleep.
* ``GEMM kernels ms``, ``other kernels ms``: the profiler over queued steps
  (``step_kernels.profile_steps``), per step: matrix-multiply kernels (ours and the libraries'),
  every other kernel, copy and fill. ``GPU idle ms``: the queued step less both (the profiler's
  own idle figure is inflated by its cost at every launch where the host is the bottleneck).
  ``overhead`` = queued ms / GEMM kernels ms (1.0: a layer that is nothing but its GEMMs; the
  goals are ``OVERHEAD_GOAL``).
* ``expert TFLOP/s`` (SonicMoE's configurations, ``--shapes sonic``): the routed experts' GEMM
  FLOPs 18·T·k·H·F over the queued step, beside SonicMoE's published fwd + bwd TFLOP/s on an H100
  (``SONIC_PUBLISHED_TFLOPS``; goal ``SONIC_GOAL`` times it).
* ``TFLOP/s``: the useful FLOPs of one forward + backward over the median time, the same count for
  every variant (T tokens, H hidden, E experts, k top-k, F expert ffn, Fs shared ffn or 0):

      FLOPs = 3 * (2*T*H*E  +  2*T*k*H*2F + 2*T*k*F*H  +  2*T*H*2Fs + 2*T*Fs*H)
            = 6 * T * H * (E + 3*k*F + 3*Fs)

  router linear, expert fc1 (gate and up) and fc2, shared expert fc1 and fc2; forward once,
  backward twice (input and weight gradients). Softmax, top-k, permutation and the combine are
  not counted.
* ``% dense``: TFLOP/s over the dense bf16 ceiling measured in the same process (``torch.mm`` of two
  random 8192 x 8192 bf16 matrices, median of CUDA-event timings, measured before and after the
  shapes; the higher of the two is used): a burst. ``% sustained dense``: the queued step's
  TFLOP/s over the same GEMM queued for twice ``--sustain-s`` (``timing.sustained_ceiling``, with
  its clock and power), the ceiling a step in a training loop can get.
* ``peak GiB`` (activation memory): the peak of ``torch.cuda.max_memory_allocated`` during one
  forward + backward above what was allocated right before it (``timing.peak_bytes``, the same
  method for every variant). Backward allocates the parameter gradients inside that window, the
  same bytes for every variant (printed per shape as ``grads``); ``peak - grads`` subtracts them,
  which leaves the activations and the transients. ``held GiB``: allocated right after
  the forward (saved activations and the output) above what was allocated before it.
* ``cudaMalloc / retries`` (printed per variant, not in the table): the caching allocator's new
  segments and its flush-and-retry count (``torch.cuda.memory_stats``) during one more step;
  nonzero means the step also waited on the driver (a device near full: dsv3_like holds two
  copies of its weights and one of their gradients here).
* ``syncs``: host syncs of one forward / one backward (``bench_ep.host_syncs``: host waits on CUDA
  events plus the blocking operations of ``torch.cuda.set_sync_debug_mode``).
* against Megatron's output and input gradient (one step on the first input set, before timing):
  ``max|diff| / max|megatron|`` for the output and dx, the number of tokens routed to a different
  expert set, and the same error over the tokens routed alike. Routing maps come from forward
  hooks on the eager routers; the compiled variants are compared with the map of their eager
  counterpart (the plain layer's eager ``routing_map``). Without Megatron, against ours eager.
  ``ours compiled`` is also compared with ``ours eager`` (bitwise or the relative error).
* ``first call s``: the wall time of each variant's first forward + backward (the compile, for the
  compiled ones; Megatron compiles its expert-bias helper on its first call at dsv3_like).

Memory (dsv3_like: ~22.5 GB of expert weights per copy): two copies of the weights, Megatron's and
ours (shared by ours eager, ours compiled and the plain layer), plus one set of gradients at a time.
Layers are built on the device (``with torch.device(...)``, bench_ep's builders).

    python -m benchmarks.bench_layer [--shapes mixtral,qwen3_30b_a3b,dsv3_like] [--tokens T]
        [--experts E] [--rounds R] [--warmup W] [--skip megatron,compiled,plain]
        [--device cuda|cpu] [--seed S] [--sustain-s S]
    python -m benchmarks.bench_layer --shapes sonic --skip megatron   (SonicMoE's configurations)
    python -m benchmarks.bench_layer --shapes tiny --device cpu --rounds 2 --warmup 1   (smoke)

On the device machine, megatron-core from the carried wheel: ``source benchmarks/device_env.sh``
first. On the CPU (``--shapes tiny`` or ``tiny_dsv3``) Megatron runs with bench_ep's CPU patches,
and memory and syncs read n/a. Each shape prints its lines and table rows when done; a shape that
fails is reported (traceback), the next one runs, and the exit status is 1. The last lines are a
markdown table, one row per shape x variant; on CUDA the "where the step goes" table and the
SonicMoE table; then the goals table: per shape the time goal (``GOAL_MS``, on the queued step)
and the share of the run's dense ceiling it asks of the whole layer, our fastest variant against
it, its overhead against ``OVERHEAD_GOAL``, against both peers, and our leanest variant's
``peak - grads`` against ``MEMORY_GOAL`` times the lower of the peers' (n/a where a peer did not
run).
"""
import os

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # before any CUDA use

import argparse  # noqa: E402
import copy  # noqa: E402
import dataclasses  # noqa: E402
import gc  # noqa: E402
import math  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
import warnings  # noqa: E402
from typing import Callable, Dict, List, Optional, Tuple  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import moe_core  # noqa: E402
from benchmarks.bench_ep import (add_run_args, build_megatron, build_ours,  # noqa: E402
                                 free_grads, host_syncs, init_distributed, moe_kwargs,
                                 patch_megatron_for_cpu, rel_diff, resolve_run_args,
                                 set_rows_by_index)  # the layers' builders, syncs
from benchmarks.shapes import (GOAL_MS, LAYER_SHAPES, MEMORY_GOAL, OVERHEAD_GOAL,  # noqa: E402
                               REFERENCE, SHAPE_GROUPS, SONIC_GOAL, SONIC_PUBLISHED_TFLOPS,
                               Shape, select)
from benchmarks.step_kernels import profile_steps  # noqa: E402
from benchmarks.timing import (dense_ceiling, held_after_forward, host_issue_ms,  # noqa: E402
                               peak_bytes, sustained_ceiling, sustained_tflops, sync,
                               time_graph_replay, time_interleaved, time_sustained)
from moe_core import MoELayer  # noqa: E402

SHAPES: Dict[str, Shape] = select(LAYER_SHAPES)
SKIPPABLE = ("megatron", "compiled", "plain")


def layer_flops(shape: Shape) -> float:
    """Useful FLOPs of one forward + backward (module docstring): 6·T·H·(E + 3·k·F + 3·Fs)."""
    fs = dict(shape.router).get("moe_shared_expert_intermediate_size") or 0
    return 6.0 * shape.tokens * shape.hidden * (shape.experts + 3 * shape.topk * shape.ffn + 3 * fs)


def expert_flops(shape: Shape) -> float:
    """The routed experts' GEMM FLOPs of one forward + backward, 18·T·k·H·F (fc1 [H -> 2F] and
    fc2 [F -> H] per row, forward once, backward twice): what SonicMoE's TFLOP/s count."""
    return 18.0 * shape.tokens * shape.topk * shape.hidden * shape.ffn


# ---- the plain-PyTorch layer ------------------------------------------------------------------
class _AttachLoss(torch.autograd.Function):
    """Identity on the activation; backward gives the loss the gradient 1 (Megatron's
    MoEAuxLossAutoScaler at loss scale 1, the scale bench_ep sets for both other layers)."""

    @staticmethod
    def forward(ctx, activation: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(loss)
        return activation.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (loss,) = ctx.saved_tensors
        return grad, torch.ones_like(loss)


def grouped_mm_usable(dev: torch.device) -> bool:
    """True when ``torch._grouped_mm`` runs forward and backward on ``dev`` (bf16, [E, N, K]
    weights as transposed views, an empty group)."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    try:
        x = torch.randn(64, 128, device=dev).to(torch.bfloat16).requires_grad_()
        w = torch.randn(4, 256, 128, device=dev).to(torch.bfloat16).requires_grad_()
        offs = torch.tensor([16, 16, 40, 64], dtype=torch.int32, device=dev)
        y = torch._grouped_mm(x, w.transpose(1, 2), offs=offs)
        y.backward(torch.randn_like(y))
        sync(dev)
        return True
    except (RuntimeError, NotImplementedError, TypeError):
        return False


class PlainMoE(nn.Module):
    """A dropless MoE layer in plain PyTorch ops, on our layer's parameter tensors (shared, not
    copied). Megatron's math for the configurations of the reference shapes: no linear bias,
    SwiGLU (silu), softmax-after-top-k or sigmoid routing, optional expert bias / groups /
    scaling, aux_loss or seq_aux_loss (the same formula at one sequence of T tokens, the layout
    this benchmark feeds), an optional shared expert without gate."""

    def __init__(self, ours: MoELayer, use_grouped_mm: bool = True):
        super().__init__()
        cfg = ours.config
        unsupported = [name for name, bad in (
            ("add_bias_linear", cfg.add_bias_linear),
            ("gated_linear_unit=False", not cfg.gated_linear_unit),
            ("activation_func other than silu", cfg.activation_func is not F.silu),
            ("moe_router_pre_softmax", cfg.moe_router_pre_softmax),
            ("moe_expert_capacity_factor", cfg.moe_expert_capacity_factor is not None),
            ("moe_latent_size", bool(cfg.moe_latent_size)),
            ("moe_z_loss_coeff", cfg.moe_z_loss_coeff is not None),
            ("moe_input_jitter_eps", cfg.moe_input_jitter_eps is not None),
            ("moe_shared_expert_gate", bool(cfg.moe_shared_expert_gate)),
            ("score function", cfg.moe_router_score_function not in ("softmax", "sigmoid")),
        ) if bad]
        coeffs = dict(zip(cfg.load_balancing_types, cfg.aux_loss_coeffs))
        other = [t for t, c in coeffs.items()
                 if c and t not in ("aux_loss", "seq_aux_loss", "none")]
        if unsupported or other:
            raise NotImplementedError(f"PlainMoE does not model {unsupported + other}")
        self.E, self.k, self.H = cfg.num_moe_experts, cfg.moe_router_topk, cfg.hidden_size
        self.score_function = cfg.moe_router_score_function
        self.num_groups = cfg.moe_router_num_groups
        self.group_topk = cfg.moe_router_group_topk
        self.scaling = cfg.moe_router_topk_scaling_factor
        self.aux_coeffs = [c for t, c in coeffs.items() if c and t in ("aux_loss", "seq_aux_loss")]
        self.use_grouped_mm = use_grouped_mm
        self.router_weight = ours.router.weight              # [E, H]
        self.expert_bias = ours.router.expert_bias           # [E] fp32 or None
        self.w1 = ours.experts.weight1                       # [E, 2F, H]: gate rows, then up rows
        self.w2 = ours.experts.weight2                       # [E, H, F]
        sh = ours.shared_experts
        self.s1 = sh.linear_fc1.weight if sh is not None else None  # [2Fs, H]
        self.s2 = sh.linear_fc2.weight if sh is not None else None  # [H, Fs]

    def _topk(self, scores: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Megatron's compute_topk: plain, or group-limited (groups ranked by the sum of their
        top k / group_topk scores)."""
        if not self.group_topk:
            return torch.topk(scores, self.k, dim=-1)
        T, G = scores.shape[0], self.num_groups
        group_scores = scores.view(T, G, -1).topk(self.k // self.group_topk, dim=-1)[0].sum(-1)
        group_idx = torch.topk(group_scores, self.group_topk, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter(1, group_idx, 1.0).bool()
        mask = group_mask.unsqueeze(-1).expand(T, G, self.E // G).reshape(T, self.E)
        return torch.topk(scores.masked_fill(~mask, float("-inf")), self.k, dim=-1)

    def route(self, logits: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """(probs [T, k] fp32, expert ids [T, k]) from fp32 logits [T, E]."""
        if self.score_function == "softmax":
            top, idx = self._topk(logits)
            probs = torch.softmax(top, dim=-1, dtype=torch.float32)
        else:
            scores = torch.sigmoid(logits.float())
            if self.expert_bias is not None:
                _, idx = self._topk(scores + self.expert_bias.float())
                top = torch.gather(scores, 1, idx)
            else:
                top, idx = self._topk(scores)
            probs = top / (top.sum(-1, keepdim=True) + 1e-20) if self.k > 1 else top
        if self.scaling:
            probs = probs * self.scaling
        return probs, idx

    def aux_loss(self, logits: torch.Tensor, coeff: float) -> torch.Tensor:
        """Megatron's switch load-balancing loss over the T tokens (scores over all experts,
        an ungrouped top-k for the counts)."""
        if self.score_function == "softmax":
            scores = torch.softmax(logits, dim=-1, dtype=torch.float32)
        else:
            scores = torch.sigmoid(logits.float())
            scores = scores / (scores.sum(-1, keepdim=True) + 1e-20)
        T = logits.shape[0]
        idx = torch.topk(scores, self.k, dim=-1).indices
        tokens_per_expert = torch.zeros_like(scores).scatter(1, idx, 1.0).sum(0)
        return (scores.sum(0) * tokens_per_expert).sum() * (self.E * coeff / (self.k * T * T))

    def routing_map(self, hidden: torch.Tensor) -> torch.Tensor:
        """[T, E] bool map of the routing (eager, for the checks)."""
        with torch.no_grad():
            x = hidden.reshape(-1, self.H)
            _, idx = self.route(F.linear(x.float(), self.router_weight.float()))
            return torch.zeros(x.shape[0], self.E, dtype=torch.bool,
                               device=x.device).scatter_(1, idx, True)

    def _gmm(self, a: torch.Tensor, w: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
        """Per expert e: a[rows of e] @ w[e]ᵀ; w is [E, N, K] (nn.Linear layout)."""
        if self.use_grouped_mm:
            return torch._grouped_mm(a, w.transpose(1, 2), offs=ends)
        bounds = [0] + ends.tolist()  # CPU fallback only (a host read)
        return torch.cat([a[bounds[e]:bounds[e + 1]] @ w[e].t() for e in range(w.shape[0])])

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        x = hidden.reshape(-1, self.H)
        T, E, k = x.shape[0], self.E, self.k
        logits = F.linear(x.float(), self.router_weight.float())          # [T, E] fp32
        probs, idx = self.route(logits)                                   # [T, k]
        for coeff in self.aux_coeffs:
            probs = _AttachLoss.apply(probs, self.aux_loss(logits, coeff))
        expert_of_row, order = torch.sort(idx.reshape(-1), stable=True)   # rows by expert
        token_of_row = order // k
        ends = torch.searchsorted(expert_of_row, torch.arange(1, E + 1, device=x.device))
        ends = ends.to(torch.int32)                                       # cumulative counts
        rows = x[token_of_row]                                            # [T·k, H]
        row_probs = probs.reshape(-1)[order]
        gate, up = self._gmm(rows, self.w1, ends).chunk(2, dim=-1)
        h = (F.silu(gate) * up * row_probs.unsqueeze(-1)).to(x.dtype)
        y = self._gmm(h, self.w2, ends)                                   # [T·k, H]
        out = torch.zeros(T, self.H, dtype=torch.float32, device=x.device)
        out = out.index_add_(0, token_of_row, y.float()).to(x.dtype)
        if self.s1 is not None:
            g, u = F.linear(x, self.s1).chunk(2, dim=-1)
            out = out + F.linear(F.silu(g) * u, self.s2)
        return out.reshape(hidden.shape)


# ---- one shape ----------------------------------------------------------------------------
@dataclasses.dataclass
class Row:
    shape: str
    variant: str
    ms: float = float("nan")
    queued_ms: float = float("nan")
    tflops: float = float("nan")
    pct_dense: float = float("nan")
    vs_megatron: str = ""
    vs_plain: str = ""
    peak_gib: float = float("nan")
    grads_gib: float = 0.0
    held_gib: float = float("nan")
    syncs: str = "n/a"
    allocs: str = "n/a"  # cudaMalloc calls / allocator retries in one step (allocator_calls)
    first_s: float = float("nan")
    err: str = ""     # vs Megatron (or ours eager): "out / dx (tokens routed differently)"
    note: str = ""
    # where the step goes (CUDA): replayed from a CUDA graph; the host's own time to issue it
    # (host_waited: a host sync made it wait for the GPU); from the profiler over queued steps,
    # the GEMM kernels and the other kernels, and the queued step's rest (GPU idle); the SM clock
    # and board power while the queued steps ran
    graph_ms: float = float("nan")
    host_ms: float = float("nan")
    host_waited: bool = False
    gemm_ms: float = float("nan")
    other_ms: float = float("nan")
    idle_ms: float = float("nan")
    mhz: float = float("nan")
    power_w: float = float("nan")
    expert_tflops: float = float("nan")  # expert_flops over the queued step (SonicMoE's count)

    @property
    def overhead(self) -> float:
        """Queued step over its GEMM kernels' time (nan where either is unknown)."""
        return self.queued_ms / self.gemm_ms if self.gemm_ms > 0 else float("nan")

    @property
    def step_ms(self) -> float:
        """The step a training loop sees: queued where measured (CUDA), else timed alone."""
        return self.ms if math.isnan(self.queued_ms) else self.queued_ms


def allocator_calls(step: Callable[[], None]) -> str:
    """"N / M" for one ``step`` after it ran once already: the caching allocator's new segments
    (cudaMalloc calls) and its retries (a cudaMalloc that failed, so the cache was flushed, which
    waits for the device, and the call retried). Nonzero where the device is near full: the
    step's time then includes those waits."""
    step()
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats()
    step()
    torch.cuda.synchronize()
    after = torch.cuda.memory_stats()
    return (f"{after['segment.all.allocated'] - before['segment.all.allocated']} / "
            f"{after['num_alloc_retries'] - before['num_alloc_retries']}")


def compare(got, ref, map_got: Optional[torch.Tensor], map_ref: Optional[torch.Tensor]):
    """(text, out error, dx error, tokens routed differently) of got = (out, dx) against ref."""
    H = ref[0].shape[-1]
    errs = [rel_diff(a, b) for a, b in zip(got, ref)]
    text = f"out {errs[0]:.1e}, dx {errs[1]:.1e}"
    routed = -1
    if map_got is not None and map_ref is not None:
        same = (map_got == map_ref).all(1)
        routed = int((~same).sum().item())
        text += f"; tokens routed differently {routed}"
        if 0 < routed < same.numel():
            other = [rel_diff(a.reshape(-1, H)[same], b.reshape(-1, H)[same])
                     for a, b in zip(got, ref)]
            text += f", over the others: out {other[0]:.1e}, dx {other[1]:.1e}"
    short = f"{errs[0]:.1e} / {errs[1]:.1e}" + (f" ({routed})" if routed >= 0 else "")
    return text, short


def run_shape(args, name: str, shape: Shape, dev: torch.device, ceiling: float,
              gmm_ok: bool) -> List[Row]:
    skip = args.skip
    kw = moe_kwargs(shape, "dropless", 1)
    T, H = shape.tokens, shape.hidden
    meg = None
    if "megatron" not in skip:
        meg = build_megatron(kw, dev, args.seed)
    state = meg.state_dict() if meg is not None else None
    ours = build_ours(kw, dev, args.seed, None, state)
    set_rows_by_index(ours, "off" if args.rows_by_index == "both" else args.rows_by_index)
    # --rows-by-index both: the same layer (a shallow copy: same parameters) with the rows read
    # by index, timed in the same interleaved rounds as the rows-made default
    by_index = None
    if args.rows_by_index == "both":
        by_index = copy.copy(ours)
        set_rows_by_index(by_index, "on")
    del state
    gc.collect()
    weights_bytes = sum(p.numel() * p.element_size() for p in ours.parameters())  # = grads

    # variant -> (what is called, the modules whose parameter gradients to free after a call)
    modules: Dict[str, Tuple[Callable, List[nn.Module]]] = {}
    notes: Dict[str, str] = {}
    if meg is not None:
        modules["megatron"] = (meg, [meg])
    modules["ours eager"] = (ours, [ours])
    plain = None

    def compiled(module: nn.Module, fullgraph: bool):
        return torch.compile(module, fullgraph=fullgraph, dynamic=False)

    targets = {"ours compiled": ours}  # compiled variant -> the module it compiles
    if "compiled" not in skip:
        modules["ours compiled"] = (compiled(ours, True), [ours])
        notes["ours compiled"] = "fullgraph"
    if by_index is not None:
        modules["ours by index"] = (by_index, [ours])
        if "compiled" not in skip:
            modules["ours by index compiled"] = (compiled(by_index, True), [ours])
            notes["ours by index compiled"] = "fullgraph"
            targets["ours by index compiled"] = by_index
    if "plain" not in skip:
        if gmm_ok or dev.type == "cpu":
            plain = PlainMoE(ours, use_grouped_mm=gmm_ok)
            targets["plain compiled"] = plain
            modules["plain compiled"] = (compiled(plain, gmm_ok), [ours])
            notes["plain compiled"] = ("fullgraph, _grouped_mm" if gmm_ok
                                       else "per-expert loop (no _grouped_mm here), graph breaks")
        else:
            print(f"{name}: plain compiled skipped: torch._grouped_mm does not run on {dev}")

    gen = torch.Generator(device=dev).manual_seed(1000)
    xs = [torch.randn(T, 1, H, device=dev, generator=gen).to(torch.bfloat16) for _ in range(2)]
    gs = [torch.randn(T, 1, H, device=dev, generator=gen).to(torch.bfloat16) for _ in range(2)]
    if meg is not None:
        from megatron.core.transformer.moe import moe_utils

        moe_utils.MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0, device=dev))

    def forward(variant: str, i: int):
        module = modules[variant][0]
        x = xs[i % 2].detach().requires_grad_()
        out = module(x)
        return (out[0] if variant == "megatron" else out), x

    def fwd_bwd(variant: str) -> Callable[[int], None]:
        def run(i: int) -> None:
            out, _ = forward(variant, i)
            out.backward(gs[i % 2])
        return run

    def cleanup_of(variant: str) -> Callable[[], None]:
        return lambda: free_grads(*modules[variant][1])

    # ---- one checked step of each (the compiled ones compile here) ----
    results, maps, first_s = {}, {}, {}

    def first_step(variant: str) -> None:
        """One checked forward + backward, timed on the wall clock (the compile, if any)."""
        sync(dev)
        t0 = time.perf_counter()
        out, x = forward(variant, 0)
        out.backward(gs[0])
        sync(dev)
        first_s[variant] = time.perf_counter() - t0
        results[variant] = (out.detach(), x.grad)
        cleanup_of(variant)()

    def short(exc: BaseException) -> str:
        lines = str(exc).strip().splitlines()
        return f"{type(exc).__name__}: {lines[0][:200] if lines else ''}"

    for variant in list(modules):
        if not variant.endswith("compiled"):
            router = modules[variant][0].router
            hook = router.register_forward_hook(  # o = (probs, routing_map)
                lambda m, i, o, v=variant: maps.__setitem__(v, o[1].detach().flatten(0, -2)))
            try:
                first_step(variant)
            finally:
                hook.remove()
            continue
        target = targets[variant]
        try:
            first_step(variant)
            continue
        except Exception as exc:  # dynamo refused the full graph, or the compile failed
            cleanup_of(variant)()
            if "fullgraph" not in notes[variant]:
                print(f"{name}: {variant} dropped: {short(exc)}")
                del modules[variant]
                continue
            print(f"{name}: {variant}: fullgraph=True failed ({short(exc)}); "
                  f"compiling with fullgraph=False")
        modules[variant] = (compiled(target, False), modules[variant][1])
        notes[variant] = notes[variant].replace("fullgraph", "graph breaks")
        try:
            first_step(variant)
        except Exception as exc:
            cleanup_of(variant)()
            print(f"{name}: {variant} dropped: {short(exc)}")
            del modules[variant]
    if "plain compiled" in modules:
        maps["plain compiled"] = plain.routing_map(xs[0])
    for variant, eager in (("ours compiled", "ours eager"),
                           ("ours by index compiled", "ours by index")):
        if variant in modules:
            maps[variant] = maps[eager]
    ref_name = "megatron" if meg is not None else "ours eager"
    checks: Dict[str, Tuple[str, str]] = {}
    for variant in modules:
        if variant == ref_name:
            continue
        checks[variant] = compare(results[variant], results[ref_name], maps.get(variant),
                                  maps.get(ref_name))
    for variant in ("ours compiled", "ours by index", "ours by index compiled"):
        if variant in results:
            same = all(torch.equal(a, b) for a, b in zip(results[variant], results["ours eager"]))
            vs_eager = ("bitwise" if same else "out {:.1e}, dx {:.1e}".format(
                *[rel_diff(a, b) for a, b in zip(results[variant], results["ours eager"])]))
            notes[variant] = "; ".join(s for s in (notes.get(variant, ""),
                                                   f"vs ours eager: {vs_eager}") if s)
    del results, maps

    # ---- timing, memory, syncs ----
    t = time_interleaved({v: (fwd_bwd(v), cleanup_of(v)) for v in modules}, dev, args.warmup,
                         args.rounds)
    flops = layer_flops(shape)
    rows = []
    for variant in modules:
        row = Row(name, variant, t[variant], first_s=first_s[variant],
                  note=notes.get(variant, ""))
        row.tflops = flops / (t[variant] / 1e3) / 1e12
        row.pct_dense = 100.0 * row.tflops / ceiling
        row.peak_gib = peak_bytes(lambda v=variant: fwd_bwd(v)(1), cleanup_of(variant), dev) / 2**30
        row.grads_gib = weights_bytes / 2**30
        row.held_gib = held_after_forward(lambda v=variant: forward(v, 1), gs[1],
                                          cleanup_of(variant), dev) / 2**30
        row.syncs = host_syncs(lambda v=variant: (forward(v, 1)[0], gs[1]), dev)
        cleanup_of(variant)()
        if dev.type == "cuda":
            row.allocs = allocator_calls(lambda v=variant: (fwd_bwd(v)(1), cleanup_of(v)()))
            step_parts(args, row, fwd_bwd(variant), cleanup_of(variant))
            row.expert_tflops = expert_flops(shape) / (row.queued_ms / 1e3) / 1e12
        if "megatron" in t and variant != "megatron":
            row.vs_megatron = f"{t['megatron'] / t[variant]:.2f}x"
        if "plain compiled" in t and variant.startswith("ours"):
            row.vs_plain = f"{t['plain compiled'] / t[variant]:.2f}x"
        if variant in checks:
            row.note = "; ".join(s for s in (row.note, f"vs {ref_name}: {checks[variant][0]}") if s)
            row.err = checks[variant][1]
        rows.append(row)

    fs = dict(shape.router).get("moe_shared_expert_intermediate_size")
    print(f"\n{name}: tokens={T} hidden={H} experts={shape.experts} topk={shape.topk} "
          f"ffn={shape.ffn}" + (f" shared={fs}" if fs else "")
          + f"; {flops / 1e12:.2f} TFLOP a step; weights {weights_bytes / 2**30:.2f} GiB a copy, "
          f"grads {weights_bytes / 2**30:.2f} GiB")
    for r in rows:
        print(f"  {r.variant:<22} {r.ms:9.3f} ms (queued {r.queued_ms:.3f}) "
              f"{r.tflops:7.3g} TFLOP/s {r.pct_dense:5.1f}% dense "
              f"| peak {r.peak_gib:.2f} GiB, held after fwd {r.held_gib:.2f} GiB | syncs {r.syncs} "
              f"| cudaMalloc / retries {r.allocs} "
              f"| first call {r.first_s:.1f} s" + (f" | {r.note}" if r.note else ""))
    print_table(rows)
    sys.stdout.flush()

    modules.clear()
    del ours, by_index, meg, plain, xs, gs
    torch._dynamo.reset()
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def step_parts(args, row: Row, run: Callable[[int], None], cleanup: Callable[[], None]) -> None:
    """Fills ``row``'s queued time, clock and power (steps back to back for ``--sustain-s``), its
    CUDA-graph replay (variants with no host sync), the host's own issue time and the profiler's
    split of the queued steps into GEMMs, other kernels and idle time."""
    step = lambda: run(0)  # noqa: E731
    res = time_sustained(lambda: (step(), cleanup()), args.sustain_s, min_reps=args.rounds)
    row.queued_ms, row.mhz, row.power_w = res.ms, res.mhz, res.power_w
    if row.syncs == "0/0":
        try:
            row.graph_ms = time_graph_replay(step, cleanup, warmup=2, reps=args.rounds)
        except Exception as exc:  # a capture the variant does not survive: said, not fatal
            first = (str(exc).strip().splitlines() or [""])[0][:120]
            row.note = "; ".join(s for s in (row.note, f"graph: {type(exc).__name__}: {first}")
                                 if s)
            torch.cuda.synchronize()
    row.host_ms, row.host_waited = host_issue_ms(step, cleanup, reps=max(3, args.rounds // 2))
    parts = profile_steps(step, cleanup, reps=max(3, args.rounds // 2))
    row.gemm_ms, row.other_ms = parts.gemm_ms, parts.other_ms
    # idle from the unprofiled queued step: the profiler's own cost at every launch slows the
    # host, which shows as idle GPU time where the host is the bottleneck (its own idle figure
    # overstates it there); kernels that overlap (a side stream) can make this negative: 0
    row.idle_ms = max(0.0, row.queued_ms - parts.gemm_ms - parts.other_ms)


def _ms(v: float) -> str:
    return "n/a" if math.isnan(v) else f"{v:.2f}"


def print_parts(rows: List[Row], sustained: float) -> None:
    """Where each step goes: queued, replayed from a CUDA graph, the host's issue time, the
    profiler's split, the overhead ratio, % of the sustained dense ceiling, clock and power."""
    print("| shape | variant | queued ms | graph ms | host ms | GEMM kernels ms | other kernels ms "
          "| GPU idle ms (queued - kernels) | overhead (queued / GEMM) | % sustained dense "
          "| SM MHz | W |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        host = _ms(r.host_ms) + (" (waits for the GPU)" if r.host_waited else "")
        over = "n/a" if math.isnan(r.overhead) else f"{r.overhead:.2f}"
        pct = ("n/a" if math.isnan(r.queued_ms) or not sustained else
               f"{100.0 * r.tflops * r.ms / r.queued_ms / sustained:.1f}%")
        mhz = "n/a" if math.isnan(r.mhz) else f"{r.mhz:.0f}"
        watts = "n/a" if math.isnan(r.power_w) else f"{r.power_w:.0f}"
        print(f"| {r.shape} | {r.variant} | {_ms(r.queued_ms)} | {_ms(r.graph_ms)} | {host} | "
              f"{_ms(r.gemm_ms)} | {_ms(r.other_ms)} | {_ms(r.idle_ms)} | {over} | {pct} | {mhz} "
              f"| {watts} |")


def print_sonic(rows: List[Row]) -> None:
    """Ours at SonicMoE's configurations against its published fwd + bwd TFLOP/s (H100)."""
    mine = [r for r in rows if r.shape in SONIC_PUBLISHED_TFLOPS and r.variant.startswith("ours")]
    if not mine:
        return
    print(f"\nSonicMoE's configurations: expert GEMM TFLOP/s (18·T·k·H·F over the queued step) "
          f"against its published fwd + bwd TFLOP/s (H100 bf16); goal {SONIC_GOAL:.2f}x\n")
    print("| shape | variant | queued ms | expert TFLOP/s | published, H100 | ratio | met |")
    print("|---|---|---|---|---|---|---|")
    for r in mine:
        pub = SONIC_PUBLISHED_TFLOPS[r.shape]
        ratio = r.expert_tflops / pub
        met = "n/a" if math.isnan(ratio) else ("yes" if ratio >= SONIC_GOAL else "no")
        tf = "n/a" if math.isnan(r.expert_tflops) else f"{r.expert_tflops:.0f}"
        rt = "n/a" if math.isnan(ratio) else f"{ratio:.2f}x"
        print(f"| {r.shape} | {r.variant} | {_ms(r.queued_ms)} | {tf} | {pub:.0f} | {rt} | {met} |")


def print_table(rows: List[Row], header: bool = True) -> None:
    if header:
        ref = "Megatron" if any(r.variant == "megatron" for r in rows) else "ours eager"
        print("| shape | variant | fwd+bwd ms | queued ms | TFLOP/s | % dense | vs Megatron "
              f"| vs plain | peak GiB | peak - grads GiB | syncs fwd/bwd | out / dx err vs {ref} "
              f"(tokens routed differently) |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        gib = "n/a" if math.isnan(r.peak_gib) else f"{r.peak_gib:.2f}"
        act = "n/a" if math.isnan(r.peak_gib) else f"{r.peak_gib - r.grads_gib:.2f}"
        queued = "n/a" if math.isnan(r.queued_ms) else f"{r.queued_ms:.2f}"
        print(f"| {r.shape} | {r.variant} | {r.ms:.2f} | {queued} | {r.tflops:.3g} | "
              f"{r.pct_dense:.1f}% | "
              f"{r.vs_megatron} | {r.vs_plain} | {gib} | {act} | {r.syncs} | {r.err} |")


@dataclasses.dataclass
class Goal:
    """One shape's goals against one run's rows (goal_rows)."""
    shape: str
    goal_ms: float          # nan: the shape has no time goal
    needs_pct: float        # the % of the run's dense ceiling the time goal asks of the layer
    best: Row               # ours, fastest variant (by Row.step_ms: queued where measured)
    time_met: bool
    overhead_goal: float    # nan: no overhead goal at this shape
    overhead_met: str       # "yes" / "no" / "n/a" (no goal, or no profile: the CPU): best's
    faster_than_peers: str  # "yes" / "no" / "n/a" (a peer not run)
    mem_goal_gib: float     # MEMORY_GOAL x the lower peer's peak - grads; nan: no peer ran
    leanest: Row            # ours, lowest peak - grads
    mem_met: str            # "yes" / "no" / "n/a"


def goal_rows(rows: List[Row]) -> List[Goal]:
    """Each shape's goals (GOAL_MS, OVERHEAD_GOAL, MEMORY_GOAL) checked against the run's
    ``rows``: ours is its fastest variant (queued step where measured) for time and overhead and
    its leanest for memory; the needed % dense is the fastest row's % dense scaled to the goal's
    time (the same FLOPs, the same ceiling as the table); peers are compared by the same time."""
    goals = []
    for shape in dict.fromkeys(r.shape for r in rows):
        mine = [r for r in rows if r.shape == shape]
        ours = [r for r in mine if r.variant.startswith("ours")]
        if not ours:
            continue
        peers = {r.variant: r for r in mine if r.variant in ("megatron", "plain compiled")}
        best = min(ours, key=lambda r: r.step_ms)
        goal_ms = GOAL_MS.get(shape, float("nan"))
        needs = best.pct_dense * best.ms / goal_ms
        faster = ("n/a" if len(peers) < 2 else
                  "yes" if all(best.step_ms < p.step_ms for p in peers.values()) else "no")
        over_goal = OVERHEAD_GOAL.get(shape, float("nan"))
        over_met = ("n/a" if math.isnan(over_goal) or math.isnan(best.overhead) else
                    "yes" if best.overhead <= over_goal else "no")
        acts = [p.peak_gib - p.grads_gib for p in peers.values() if not math.isnan(p.peak_gib)]
        mem_goal = MEMORY_GOAL * min(acts) if len(acts) == 2 else float("nan")
        leanest = min(ours, key=lambda r: (math.isnan(r.peak_gib), r.peak_gib - r.grads_gib))
        act = leanest.peak_gib - leanest.grads_gib
        mem_met = "n/a" if math.isnan(mem_goal) or math.isnan(act) else (
            "yes" if act <= mem_goal else "no")
        goals.append(Goal(shape, goal_ms, needs, best, best.step_ms <= goal_ms, over_goal,
                          over_met, faster, mem_goal, leanest, mem_met))
    return goals


def print_goals(goals: List[Goal]) -> None:
    print("| shape | goal ms | the goal in % dense | ours fastest ms (variant) | met "
          "| overhead goal | ours | met | faster than Megatron and plain | memory goal GiB "
          "| ours leanest GiB (variant) | met |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for g in goals:
        act = g.leanest.peak_gib - g.leanest.grads_gib
        if math.isnan(g.goal_ms):
            time_cells = "none | | " + f"{g.best.step_ms:.2f} ({g.best.variant}) | n/a"
        else:
            time_cells = (f"{g.goal_ms:.1f} | {g.needs_pct:.1f}% | {g.best.step_ms:.2f} "
                          f"({g.best.variant}) | {'yes' if g.time_met else 'no'}")
        over = "n/a" if math.isnan(g.best.overhead) else f"{g.best.overhead:.2f}"
        time_cells += (" | " + ("none" if math.isnan(g.overhead_goal) else
                                f"{g.overhead_goal:.2f}") + f" | {over} | {g.overhead_met}")
        mem_goal = "n/a" if math.isnan(g.mem_goal_gib) else f"{g.mem_goal_gib:.2f}"
        lean = "n/a" if math.isnan(act) else f"{act:.2f} ({g.leanest.variant})"
        print(f"| {g.shape} | {time_cells} | {g.faster_than_peers} | {mem_goal} | {lean} "
              f"| {g.mem_met} |")


# ---- main ---------------------------------------------------------------------------------
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default=",".join(REFERENCE),
                    help=f"comma-separated, of {sorted(SHAPES)} or the groups "
                         f"{sorted(SHAPE_GROUPS)}")
    ap.add_argument("--tokens", type=int, help="tokens (default: each shape's)")
    ap.add_argument("--experts", type=int, help="number of experts (default: each shape's)")
    ap.add_argument("--skip", default="", help=f"comma-separated, of {','.join(SKIPPABLE)}")
    ap.add_argument("--rows-by-index", choices=("auto", "on", "off", "both"), default="auto",
                    help="ours: MoEConfig.moe_expert_rows_by_index (auto: the default, by device; "
                         "both: rows made as 'ours', rows by index as 'ours by index', same run)")
    ap.add_argument("--sustain-s", type=float, default=1.0,
                    help="CUDA: each variant's queued steps run back to back for about this long "
                         "(the clock settles at what the power limit allows), and the sustained "
                         "dense ceiling twice as long")
    add_run_args(ap)
    args = ap.parse_args()
    cpu = resolve_run_args(args)
    names = [n for s in args.shapes.split(",") if s for n in SHAPE_GROUPS.get(s, (s,))]
    for s in names:
        if s not in SHAPES:
            ap.error(f"--shapes: {s!r} is not one of {sorted(SHAPES)}")
    args.skip = {s for s in args.skip.split(",") if s}
    if args.skip - set(SKIPPABLE):
        ap.error(f"--skip: {sorted(args.skip - set(SKIPPABLE))} not in {SKIPPABLE}")

    t_start = time.perf_counter()
    dev = init_distributed(args.device)  # a world of one (Megatron's parallel state wants it)
    if cpu and "megatron" not in args.skip:
        patch_megatron_for_cpu()
    warnings.filterwarnings("ignore")
    gmm_ok = grouped_mm_usable(dev)
    where = (torch.cuda.get_device_name(dev) if dev.type == "cuda"
             else f"CPU, {torch.get_num_threads()} threads")
    mcore = ""
    if "megatron" not in args.skip:
        import megatron.core

        # (its __version__ appends the git commit of the working directory: cut off)
        version = str(getattr(megatron.core, "__version__", "?")).split("+")[0]
        mcore = f", megatron-core {version}"
    print(f"bench_layer: {where}; torch {torch.__version__}{mcore}, "
          f"moe_core {moe_core.__version__}; warm-up {args.warmup}, rounds {args.rounds}; "
          f"torch._grouped_mm {'usable' if gmm_ok else 'NOT usable'} here", flush=True)
    reps = max(args.rounds, 10)
    ceiling = dense_ceiling(dev, reps)
    print(f"dense bf16 ceiling (torch.mm, square): {ceiling:.1f} TFLOP/s", flush=True)
    sustained = []  # (TFLOP/s, MHz, W) of the dense GEMM queued for 2 x --sustain-s
    if dev.type == "cuda":
        res = sustained_ceiling(2 * args.sustain_s)
        sustained.append((sustained_tflops(res), res.mhz, res.power_w))
        print(f"dense bf16 ceiling, sustained ({res.calls} calls queued): "
              f"{sustained[-1][0]:.1f} TFLOP/s at {res.mhz:.0f} MHz, {res.power_w:.0f} W",
              flush=True)

    rows: List[Row] = []
    failed = []
    for name in names:
        shape = SHAPES[name]
        if args.tokens:
            shape = dataclasses.replace(shape, tokens=args.tokens)
        if args.experts:
            shape = dataclasses.replace(shape, experts=args.experts)
        t0 = time.perf_counter()
        try:
            rows += run_shape(args, name, shape, dev, ceiling, gmm_ok)
        except Exception:  # report, go on with the next shape, exit non-zero at the end
            failed.append(name)
            print(f"\n{name}: FAILED\n{traceback.format_exc()}", flush=True)
            gc.collect()
            torch._dynamo.reset()
            if dev.type == "cuda":
                torch.cuda.empty_cache()
        print(f"{name}: {time.perf_counter() - t0:.1f} s", flush=True)

    ceiling_after = dense_ceiling(dev, reps)
    if dev.type == "cuda":
        res = sustained_ceiling(2 * args.sustain_s)
        sustained.append((sustained_tflops(res), res.mhz, res.power_w))
    best = max(ceiling, ceiling_after)
    if ceiling_after > ceiling:
        for r in rows:
            r.pct_dense = 100.0 * r.tflops / best
    print(f"\ndense bf16 ceiling before / after the shapes: {ceiling:.1f} / {ceiling_after:.1f} "
          f"TFLOP/s; % dense below is of {best:.1f}")
    sustained_best = max((s[0] for s in sustained), default=0.0)
    for when, (tf, mhz, watts) in zip(("before", "after"), sustained):
        print(f"sustained dense ceiling {when} the shapes: {tf:.1f} TFLOP/s at {mhz:.0f} MHz, "
              f"{watts:.0f} W")
    print(f"\nMoE layer, fwd+bwd, one device ({where}; median of {args.rounds} interleaved rounds; "
          f"peak: above the allocation before the step, parameter gradients included)\n")
    print_table(rows)
    if dev.type == "cuda":
        print(f"\nWhere the step goes (queued: steps back to back for {args.sustain_s:g} s, with "
              f"the clock and power meanwhile; graph: replayed from a CUDA graph; host: the "
              f"host's own time to issue one step; kernels and idle: the profiler over queued "
              f"steps; % of the sustained dense ceiling {sustained_best:.1f} TFLOP/s)\n")
        print_parts(rows, sustained_best)
        print_sonic(rows)
    print(f"\nGoals (GOAL_MS on the queued step, OVERHEAD_GOAL, MEMORY_GOAL: activation memory "
          f"as peak - grads; % dense of {best:.1f} TFLOP/s)\n")
    print_goals(goal_rows(rows))
    print(f"\nbench_layer: {time.perf_counter() - t_start:.0f} s in all", flush=True)
    torch.distributed.destroy_process_group()
    if failed:
        raise SystemExit(f"failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
