"""Train a tiny decoder-only language model whose MLPs are moe-core MoELayers.

The text is real and on every machine: the Python standard library's own source files, read as
bytes (a 256-symbol vocabulary), so nothing is downloaded. Each block is pre-norm causal
self-attention followed by an MoELayer (top-2 of 8 SwiGLU experts, aux loss and z-loss attached
through the autoscaler). It runs on the CPU by default, and on a GPU when one is present and this
build has CUDA kernels for every op of the layer (moe_core.layer_runs_on_cuda()). A tqdm bar
shows the loss, the validation loss, the aux loss, the load imbalance and tokens/s; the
validation loss is measured every ``--eval-every`` steps on fixed held-out sequences (the last
5 % of the corpus, other files than the training bytes), without grad. It saves a checkpoint
(the weights, the arguments and every recorded metric; ``load_checkpoint`` rebuilds the model)
and one matplotlib figure (Agg, no screen): the train / validation loss, the aux loss and the
load imbalance over the steps, and one heat map per MoE layer of every expert's share of the
routed tokens at every step.

    python examples/train_tiny_moe.py [--steps 300] [--eval-every 25] [--out examples/out]

Expert parallel: under torchrun, ``--expert-parallel N`` splits every layer's experts over
groups of N ranks (gloo on the CPU, NCCL on GPUs); with more ranks than N the groups are
replicated (EP x DP, Megatron's layout). Every rank draws the same global batch and trains on its
shard, so the global batch, the initial weights and (up to rounding and the per-rank aux loss)
the loss curve are the single process's. Only rank 0 shows the bar, plots and saves; the checkpoint
holds every expert, in the single-process layout.

    torchrun --nproc-per-node 2 examples/train_tiny_moe.py --expert-parallel 2 \
        [--dispatcher alltoall|allgather]
"""
import argparse
import dataclasses
import glob
import math
import os
import sys
import sysconfig
import time
from typing import Dict, List, Optional, Tuple

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

import moe_core
from moe_core import MoEConfig, MoELayer
from moe_core.parallel import (all_reduce_gradients, clip_grad_norm_, expert_parallel_groups,
                               full_state_dict, is_expert_parameter)


def load_corpus(max_bytes: int) -> torch.Tensor:
    """Bytes of the standard library's .py files, in a fixed order."""
    stdlib = sysconfig.get_paths()["stdlib"]
    data = bytearray()
    for path in sorted(glob.glob(os.path.join(stdlib, "*.py"))):
        with open(path, "rb") as f:
            data += f.read()
        if len(data) >= max_bytes:
            break
    return torch.frombuffer(bytearray(data[:max_bytes]), dtype=torch.uint8).long()


class Block(nn.Module):
    def __init__(self, cfg: MoEConfig, heads: int, layer_number: int,
                 moe_kwargs: Optional[Dict] = None):
        super().__init__()
        d = cfg.hidden_size
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d, bias=False), nn.Linear(d, d, bias=False)
        self.moe = MoELayer(cfg, layer_number=layer_number, **(moe_kwargs or {}))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [S, B, d]
        S, B, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(S, B, 3, self.heads, d // self.heads).permute(2, 1, 3, 0, 4)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)        # [B, h, S, d/h]
        x = x + self.proj(attn.permute(2, 0, 1, 3).reshape(S, B, d))
        return x + self.moe(self.norm2(x))


class TinyMoELM(nn.Module):
    def __init__(self, cfg: MoEConfig, layers: int, heads: int, seq_len: int,
                 moe_kwargs: Optional[Dict] = None):
        """moe_kwargs: MoELayer's group arguments (expert parallel); None: one process."""
        super().__init__()
        self.embed = nn.Embedding(256, cfg.hidden_size)
        nn.init.normal_(self.embed.weight, 0.0, 0.02)  # tied with the output head: keep logits small
        self.pos = nn.Parameter(torch.randn(seq_len, 1, cfg.hidden_size) * 0.02)
        self.blocks = nn.ModuleList(Block(cfg, heads, i + 1, moe_kwargs) for i in range(layers))
        self.norm = nn.LayerNorm(cfg.hidden_size)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # tokens [S, B] -> logits [S, B, 256]
        x = self.embed(tokens) + self.pos[: tokens.shape[0]]
        for block in self.blocks:
            x = block(x)
        return self.norm(x) @ self.embed.weight.t()


def _trailing_mean(values: np.ndarray, window: int) -> np.ndarray:
    """The mean of the last ``window`` values at every step (fewer at the start)."""
    c = np.cumsum(np.insert(np.asarray(values, dtype=np.float64), 0, 0.0))
    n = np.arange(1, len(values) + 1)
    lo = np.maximum(n - window, 0)
    return (c[n] - c[lo]) / (n - lo)


def plot_training(metrics: Dict, path: str) -> None:
    """One PNG: the train / validation loss, the aux loss, the load imbalance and, one heat map per
    MoE layer, each expert's share of the routed tokens at every step. Drawn with matplotlib's
    Agg canvas (no screen, no pyplot state)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.colors import TwoSlopeNorm
    from matplotlib.figure import Figure

    steps = np.asarray(metrics["step"])
    loads = np.asarray(metrics["load"])                    # [steps, layers, experts]
    L, E = loads.shape[1], loads.shape[2]
    window = max(1, len(steps) // 25)
    smooth = f"mean of the last {window} steps" if window > 1 else "per step"

    fig = Figure(figsize=(13, 3.9 + 1.9 * L), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    grid = fig.add_gridspec(1 + L, 3, height_ratios=[1.6] + [1.0] * L)
    fig.suptitle(metrics.get("title", "tiny MoE language model"), fontsize=13)

    ax = fig.add_subplot(grid[0, 0])
    ax.plot(steps, metrics["train_loss"], color="tab:blue", alpha=0.25, lw=0.8)
    ax.plot(steps, _trailing_mean(metrics["train_loss"], window), color="tab:blue",
            lw=1.8, label=f"train ({smooth})")
    ax.plot(metrics["val_step"], metrics["val_loss"], "o-", color="tab:orange", ms=4, lw=1.8,
            label="validation (held out)")
    ax.axhline(math.log(256), color="grey", ls=":", lw=1, label="uniform guess (ln 256)")
    ax.set(title="loss", xlabel="step", ylabel="cross-entropy (nats / byte)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)

    ax = fig.add_subplot(grid[0, 1])
    aux = np.asarray(metrics["aux_loss"])                  # [steps, layers]
    if metrics.get("aux_loss_coeff", 1.0) > 0:
        for layer in range(L):
            ax.plot(steps, _trailing_mean(aux[:, layer], window), lw=1.5,
                    color=f"C{layer}", label=f"layer {layer + 1}")
        ax.axhline(1.0, color="grey", ls=":", lw=1, label="uniform routing (1)")
        ax.legend(fontsize=8)
        ax.set_title(f"load-balancing aux loss / coefficient ({smooth})", fontsize=10)
    else:
        ax.text(0.5, 0.5, "aux loss off (--aux-loss-coeff 0)", ha="center", va="center",
                transform=ax.transAxes, color="grey")
        ax.set_title("load-balancing aux loss", fontsize=10)
    ax.set(xlabel="step", ylabel="aux loss")
    ax.grid(alpha=0.3)

    ax = fig.add_subplot(grid[0, 2])
    imbalance = loads.max(axis=2) * E                      # [steps, layers]
    for layer in range(L):
        ax.plot(steps, imbalance[:, layer], color=f"C{layer}", alpha=0.2, lw=0.8)
        ax.plot(steps, _trailing_mean(imbalance[:, layer], window), color=f"C{layer}", lw=1.5,
                label=f"layer {layer + 1}")
    ax.axhline(1.0, color="grey", ls=":", lw=1, label="perfect balance (1)")
    ax.set_ylim(bottom=0)
    ax.set(xlabel="step", ylabel="busiest expert's load / mean load")
    ax.set_title(f"load imbalance ({smooth})", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)

    # White is the uniform share 1/E; red, an expert taking more than its share; blue, less.
    norm = TwoSlopeNorm(vmin=0.0, vcenter=1.0 / E, vmax=max(2.0 / E, float(loads.max())))
    heat_axes, image = [], None
    for layer in range(L):
        ax = fig.add_subplot(grid[1 + layer, :])
        image = ax.imshow(loads[:, layer, :].T, aspect="auto", origin="lower", cmap="RdBu_r",
                          norm=norm, interpolation="nearest",
                          extent=(steps[0] - 0.5, steps[-1] + 0.5, -0.5, E - 0.5))
        ax.set_yticks(range(E) if E <= 16 else np.linspace(0, E - 1, 9).round())
        ax.set_ylabel("expert")
        ax.set_title(f"layer {layer + 1}: each expert's share of the routed tokens", fontsize=10)
        heat_axes.append(ax)
    heat_axes[-1].set_xlabel("step")
    bar = fig.colorbar(image, ax=heat_axes, shrink=0.9, pad=0.01)
    bar.set_label(f"share of routed tokens\n(white: uniform 1/{E} = {1 / E:.3f})")
    fig.savefig(path)


@dataclasses.dataclass
class ExpertParallel:
    """This rank's place in an expert-parallel run (torchrun, ``--expert-parallel N``)."""
    rank: int
    world: int
    ep_size: int
    ep_group: dist.ProcessGroup                  # the N ranks that split the experts
    expert_dp_group: Optional[dist.ProcessGroup]  # ranks holding the same experts (None: no other)
    moe_kwargs: Dict                             # MoELayer's group arguments


def setup_expert_parallel(ap: argparse.ArgumentParser, args: argparse.Namespace
                          ) -> Optional[ExpertParallel]:
    """None for the plain single-process run; else initialise torch.distributed and the groups.
    Every check reads the launcher's environment only, so a bad launch fails on every rank
    before any rank waits in a collective."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    launched = "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ
    N = args.expert_parallel
    if N is None:
        if world > 1:  # otherwise every rank would train its own copy and write the same files
            ap.error(f"launched as {world} processes: pass --expert-parallel N with N dividing "
                     f"{world} (N = 1: data parallel only), or run without torchrun")
        return None
    if N < 1:
        ap.error(f"--expert-parallel {N}: must be >= 1")
    if not launched:
        ap.error(f"--expert-parallel {N} needs torch.distributed, which is not initialised: "
                 f"launch with torchrun --nproc-per-node {N} {sys.argv[0]} --expert-parallel {N}")
    if world % N:
        ap.error(f"--expert-parallel {N}: the world size {world} is not a multiple of {N}")
    if args.experts % N:
        ap.error(f"--expert-parallel {N} must divide --experts {args.experts} (each rank holds "
                 f"the same number of experts)")
    if args.batch % world:
        # equal shards: the mean of the ranks' mean losses is then the global batch's mean
        ap.error(f"--batch {args.batch} must split evenly over the {world} ranks")
    if args.device.startswith("cuda"):
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        args.device = f"cuda:{local_rank}"
    dist.init_process_group("nccl" if args.device.startswith("cuda") else "gloo")
    rank = dist.get_rank()
    if world == N:
        # the default group is the EP group (MoELayer takes it by itself) and no other rank holds
        # the same experts, so the experts' gradients need no reduction
        return ExpertParallel(rank, world, N, dist.group.WORLD, None, {})
    groups = expert_parallel_groups(N)  # EP x DP in Megatron's rank order
    return ExpertParallel(rank, world, N, groups.ep_group, groups.expert_dp_group,
                          groups.layer_kwargs())


def parse_args(argv: Optional[List[str]] = None) -> Tuple[argparse.ArgumentParser, argparse.Namespace]:
    ap = argparse.ArgumentParser(description="Train a tiny MoE language model with moe-core.")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=16, help="global batch, in sequences")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--topk", type=int, default=2)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--aux-loss-coeff", type=float, default=1e-2,
                    help="the load-balancing aux loss's coefficient (0: off)")
    ap.add_argument("--eval-every", type=int, default=25, metavar="N",
                    help="the validation loss every N steps (and before the first and after the "
                         "last), on the same held-out sequences every time")
    ap.add_argument("--val-seqs", type=int, default=16,
                    help="held-out sequences in every validation")
    ap.add_argument("--device", default="cuda" if moe_core.layer_runs_on_cuda() else "cpu")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "out"))
    ap.add_argument("--expert-parallel", type=int, default=None, metavar="N",
                    help="split every layer's experts over N ranks (launch with torchrun; the "
                         "world size must be a multiple of N)")
    ap.add_argument("--dispatcher", choices=("alltoall", "allgather"), default="alltoall",
                    help="the expert-parallel token dispatcher (Megatron's names)")
    args = ap.parse_args(argv)
    if args.eval_every < 1:
        ap.error(f"--eval-every {args.eval_every}: must be >= 1")
    return ap, args


def build_config(args: argparse.Namespace, ep_size: int = 1, dispatcher: str = "alltoall") -> MoEConfig:
    ep_fields = {} if ep_size == 1 else dict(expert_model_parallel_size=ep_size,
                                             moe_token_dispatcher_type=dispatcher)
    return MoEConfig(hidden_size=args.hidden, num_layers=args.layers, num_moe_experts=args.experts,
                     moe_ffn_hidden_size=2 * args.hidden, moe_router_topk=args.topk,
                     add_bias_linear=False, gated_linear_unit=True, activation_func=F.silu,
                     moe_router_dtype="fp32", moe_aux_loss_coeff=args.aux_loss_coeff,
                     moe_z_loss_coeff=1e-3, **ep_fields)


def load_checkpoint(path: str, device: str = "cpu") -> Tuple[TinyMoELM, Dict]:
    """A fresh single-process model with a checkpoint's weights (any EP size saved it), and the
    checkpoint (its ``args`` and the run's ``metrics``)."""
    ckpt = torch.load(path, map_location=device, weights_only=False)
    args = argparse.Namespace(**ckpt["args"])
    model = TinyMoELM(build_config(args), args.layers, heads=4, seq_len=args.seq_len).to(device)
    model.load_state_dict(ckpt["model"])
    return model, ckpt


def corpus_split(max_bytes: int = 4 << 20) -> Tuple[torch.Tensor, torch.Tensor]:
    """(train, validation): the corpus's first 95 % and the held-out last 5 % (other files)."""
    data = load_corpus(max_bytes)
    split = int(len(data) * 0.95)
    return data[:split], data[split:]


def validation_batch(val_data: torch.Tensor, seq_len: int, n: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """``n`` windows spread evenly over the held-out bytes: (inputs, targets), each [S, n]."""
    starts = torch.linspace(0, len(val_data) - seq_len - 1, n).long()
    chunk = torch.stack([val_data[i: i + seq_len + 1] for i in starts]).t()
    return chunk[:-1], chunk[1:]


@torch.no_grad()
def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """The mean cross-entropy in eval mode, without grad. The routers skip their aux losses and
    their expert-bias counting there, so evaluation leaves the training statistics alone."""
    was_training = model.training
    model.eval()
    try:
        logits = model(x)
    finally:
        model.train(was_training)
    return F.cross_entropy(logits.reshape(-1, 256), y.reshape(-1)).item()


def main(argv: Optional[List[str]] = None) -> Dict:
    """Train, save the checkpoint and the figure; returns the recorded metrics (every rank)."""
    ap, args = parse_args(argv)
    ep = setup_expert_parallel(ap, args)
    main_rank = ep is None or ep.rank == 0
    torch.manual_seed(0)  # every rank: the same weights and the same global batches
    if main_rank:
        os.makedirs(args.out, exist_ok=True)
    dev = torch.device(args.device)

    train_data, val_data = corpus_split()
    cfg = build_config(args, 1 if ep is None else ep.ep_size, args.dispatcher)
    # Under EP, GroupedMLP draws every global expert in order and keeps its own, so the same
    # seed gives every rank the single process's weights (and leaves the generator in the same
    # state, so the batches below are the same too).
    model = TinyMoELM(cfg, args.layers, heads=4, seq_len=args.seq_len,
                      moe_kwargs=None if ep is None else ep.moe_kwargs).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    n_params = sum(p.numel() * (ep.ep_size if ep is not None and is_expert_parameter(p) else 1)
                   for p in model.parameters())
    if main_rank:
        print(f"tiny MoE LM: {args.layers} layers, {args.experts} experts top-{args.topk}, "
              f"{n_params / 1e6:.2f} M parameters, {(len(train_data) + len(val_data)) / 1e6:.1f} MB "
              f"of stdlib source ({len(val_data) / 1e3:.0f} kB held out), on {dev}")
        if ep is not None:
            print(f"expert parallel: {ep.world} ranks, EP {ep.ep_size} x DP {ep.world // ep.ep_size}, "
                  f"{args.experts // ep.ep_size} experts per rank per layer, {args.dispatcher} "
                  f"dispatcher over {dist.get_backend()}; each rank trains on "
                  f"{args.batch // ep.world} of the {args.batch} sequences of every batch")

    # Every rank draws the whole global batch (the generators agree) and keeps its shard.
    per_rank = args.batch if ep is None else args.batch // ep.world
    shard = slice(0, args.batch) if ep is None else slice(ep.rank * per_rank, (ep.rank + 1) * per_rank)

    def batch(src):
        idx = torch.randint(0, len(src) - args.seq_len - 1, (args.batch,))[shard]
        chunk = torch.stack([src[i: i + args.seq_len + 1] for i in idx]).t().to(dev)  # [S+1, B]
        return chunk[:-1], chunk[1:]

    # Under EP every rank evaluates the same held-out sequences: the expert layers need every rank
    # in the forward anyway, and each rank then gets the whole value without a reduction.
    val_x, val_y = (t.to(dev) for t in validation_batch(val_data, args.seq_len, args.val_seqs))

    layers = moe_core.moe_layers(model)
    L, E = len(layers), args.experts
    metrics = {"step": [], "train_loss": [], "aux_loss": [], "load": [], "val_step": [0],
               "val_loss": [evaluate(model, val_x, val_y)], "aux_loss_coeff": args.aux_loss_coeff}
    tokens_per_step = args.batch * args.seq_len
    warmup = min(20, max(1, args.steps // 5))
    bar = tqdm(total=args.steps, disable=not main_rank, unit="step", dynamic_ncols=True,
               desc="training")
    train_time, t0 = 0.0, time.perf_counter()
    for step in range(1, args.steps + 1):
        t_step = time.perf_counter()
        lr = args.lr * min(1.0, step / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / args.steps)))
        for group in opt.param_groups:
            group["lr"] = lr
        x, y = batch(train_data)
        loss = F.cross_entropy(model(x).reshape(-1, 256), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()  # the aux and z losses reach the router through the autoscaler
        if ep is None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        else:
            # the gradient of the mean of the ranks' mean losses, which over equal shards is the
            # global batch's mean loss: replicated gradients averaged, expert gradients (already
            # summed over every rank's tokens by the exchange's backward) divided by the world
            all_reduce_gradients(model, expert_dp_group=ep.expert_dp_group)
            clip_grad_norm_(model, 1.0, ep.ep_group)
        opt.step()
        moe_core.finalize_step(model)
        none = torch.zeros((), device=dev)  # at coefficient 0 the router computes no aux loss
        # loss, per-layer aux loss and per-expert loads of this rank's tokens, averaged over the
        # ranks in one all-reduce: equal shards make the means of the loss and the loads the
        # global batch's; the aux loss stays the mean of the ranks' own (what each rank optimises)
        stats = torch.cat([loss.detach().view(1),
                           torch.stack([l.router.last_losses.get("load_balancing_loss", none)
                                        for l in layers]).float(),
                           torch.stack([l.router.last_routing_load for l in layers]).view(-1)])
        if ep is not None:
            dist.all_reduce(stats)
            stats /= ep.world
        stats = stats.tolist()  # (waits for the device: the step's time below is the whole step)
        train_time += time.perf_counter() - t_step
        aux = stats[1: 1 + L]
        loads = [stats[1 + L + i * E: 1 + L + (i + 1) * E] for i in range(L)]
        imbalance = max(max(ld) * E for ld in loads)
        metrics["step"].append(step)
        metrics["train_loss"].append(stats[0])
        metrics["aux_loss"].append(aux)
        metrics["load"].append(loads)
        if step % args.eval_every == 0 or step == args.steps:
            metrics["val_step"].append(step)
            metrics["val_loss"].append(evaluate(model, val_x, val_y))
        postfix = {"loss": f"{stats[0]:.3f}", "val": f"{metrics['val_loss'][-1]:.3f}"}
        if args.aux_loss_coeff > 0:
            postfix["aux"] = f"{sum(aux) / L:.3f}"
        postfix["max/mean load"] = f"{imbalance:.2f}"
        postfix["tok/s"] = f"{step * tokens_per_step / train_time:,.0f}"
        bar.set_postfix(postfix, refresh=False)
        bar.update()
    bar.close()
    elapsed = time.perf_counter() - t0
    metrics["tokens_per_s"] = args.steps * tokens_per_step / train_time
    metrics["title"] = (f"tiny MoE LM: {L} layers, {E} experts top-{args.topk}, "
                        f"batch {args.batch} x {args.seq_len} bytes, {args.steps} steps on {dev}"
                        + ("" if ep is None else f", EP {ep.ep_size} x DP {ep.world // ep.ep_size}"))
    state = full_state_dict(model, ep.ep_group if ep is not None else None)
    if main_rank:
        ckpt = os.path.join(args.out, "tiny_moe.pt")
        torch.save({"model": state, "args": vars(args), "metrics": metrics}, ckpt)
        png = os.path.join(args.out, "training.png")
        plot_training(metrics, png)
        n = min(10, args.steps)
        print(f"validation loss {metrics['val_loss'][0]:.3f} -> {metrics['val_loss'][-1]:.3f} "
              f"(uniform guess: {math.log(256):.3f}); train loss first {n} steps "
              f"{sum(metrics['train_loss'][:n]) / n:.3f}, last {n} "
              f"{sum(metrics['train_loss'][-n:]) / n:.3f}; {metrics['tokens_per_s']:,.0f} tokens/s")
        print(f"checkpoint: {ckpt}\nfigure (loss, aux loss, imbalance, per-expert load): {png} "
              f"({elapsed:.0f} s)")
        metrics["checkpoint"], metrics["figure"] = ckpt, png
    if ep is not None:
        dist.destroy_process_group()
    return metrics


if __name__ == "__main__":
    main()
