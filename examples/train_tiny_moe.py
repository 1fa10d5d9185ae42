"""Train a tiny decoder-only language model whose MLPs are moe-core MoELayers.

The text is real and on every machine: the Python standard library's own source files, read as
bytes (a 256-symbol vocabulary), so nothing is downloaded. Each block is pre-norm causal
self-attention followed by an MoELayer (top-2 of 8 SwiGLU experts, aux loss and z-loss attached
through the autoscaler). It runs on the CPU by default, and on a GPU when one is present and this
build has CUDA kernels for every op of the layer (moe_core.layer_runs_on_cuda()). It prints a
progress line with the loss, the aux loss and the load imbalance, saves a checkpoint, and writes
a PNG of every layer's per-expert load over the steps.

    python examples/train_tiny_moe.py [--steps 300] [--out examples/out]

Expert parallel: under torchrun, ``--expert-parallel N`` splits every layer's experts over
groups of N ranks (gloo on the CPU, NCCL on GPUs); with more ranks than N the groups are
replicated (EP x DP, Megatron's layout). Every rank draws the same global batch and trains on its
shard, so the global batch, the initial weights and (up to rounding and the per-rank aux loss)
the loss curve are the single process's. Only rank 0 prints, plots and saves; the checkpoint
holds every expert, in the single-process layout.

    torchrun --nproc-per-node 2 examples/train_tiny_moe.py --expert-parallel 2 \
        [--dispatcher alltoall|allgather]
"""
import argparse
import dataclasses
import glob
import math
import os
import struct
import sys
import sysconfig
import time
import zlib
from typing import Dict, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

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


def write_png(path: str, rows: list, title_rows: int = 0) -> None:
    """A heat map PNG from rows of values in [0, 1] (white = 0, dark blue = 1), no dependencies."""
    h, w = len(rows), len(rows[0])
    raw = b""
    for r in rows:
        line = bytearray([0])
        for v in r:
            v = min(max(v, 0.0), 1.0)
            line += bytes((int(255 - 230 * v), int(255 - 180 * v), int(255 - 60 * v)))
        raw += bytes(line)

    def chunk(tag, data):
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data))

    png = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
    png += chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b"")
    with open(path, "wb") as f:
        f.write(png)


def load_plot(history: list, num_layers: int, num_experts: int, path: str, scale: int = 6) -> None:
    """One band per layer: x = training step, y = expert, shade = that expert's share of tokens
    relative to twice the uniform share (so uniform load is mid-blue)."""
    steps = len(history)
    rows = []
    for layer in range(num_layers):
        for e in range(num_experts):
            row = []
            for step in history:
                share = step[layer][e]
                row += [share * num_experts / 2.0] * scale
            rows += [row] * scale
        rows += [[0.0] * (steps * scale)] * scale  # a white gap between layers
    write_png(path, rows)


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


def main() -> None:
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
    ap.add_argument("--device", default="cuda" if moe_core.layer_runs_on_cuda() else "cpu")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "out"))
    ap.add_argument("--expert-parallel", type=int, default=None, metavar="N",
                    help="split every layer's experts over N ranks (launch with torchrun; the "
                         "world size must be a multiple of N)")
    ap.add_argument("--dispatcher", choices=("alltoall", "allgather"), default="alltoall",
                    help="the expert-parallel token dispatcher (Megatron's names)")
    args = ap.parse_args()
    ep = setup_expert_parallel(ap, args)
    main_rank = ep is None or ep.rank == 0
    torch.manual_seed(0)  # every rank: the same weights and the same global batches
    if main_rank:
        os.makedirs(args.out, exist_ok=True)
    dev = torch.device(args.device)

    data = load_corpus(4 << 20)
    split = int(len(data) * 0.95)
    train_data, val_data = data[:split], data[split:]
    ep_fields = {} if ep is None else dict(expert_model_parallel_size=ep.ep_size,
                                           moe_token_dispatcher_type=args.dispatcher)
    cfg = MoEConfig(hidden_size=args.hidden, num_layers=args.layers, num_moe_experts=args.experts,
                    moe_ffn_hidden_size=2 * args.hidden, moe_router_topk=args.topk,
                    add_bias_linear=False, gated_linear_unit=True, activation_func=F.silu,
                    moe_router_dtype="fp32", moe_aux_loss_coeff=args.aux_loss_coeff,
                    moe_z_loss_coeff=1e-3, **ep_fields)
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
              f"{n_params / 1e6:.2f} M parameters, {len(data) / 1e6:.1f} MB of stdlib source, on {dev}")
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

    @torch.no_grad()
    def val_loss():
        # Under EP every rank evaluates the same 8 sequences: the expert layers need every rank
        # in the forward anyway, and each rank then gets the whole value without a reduction.
        model.eval()
        g = torch.Generator().manual_seed(1)
        idx = torch.randint(0, len(val_data) - args.seq_len - 1, (8,), generator=g)
        chunk = torch.stack([val_data[i: i + args.seq_len + 1] for i in idx]).t().to(dev)
        logits = model(chunk[:-1])
        model.train()
        return F.cross_entropy(logits.reshape(-1, 256), chunk[1:].reshape(-1)).item()

    layers = moe_core.moe_layers(model)
    history, losses = [], []
    first_val = val_loss()
    t0 = time.time()
    for step in range(1, args.steps + 1):
        lr = args.lr * min(1.0, step / 20) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / args.steps)))
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
        aux = sum(l.router.last_losses.get("load_balancing_loss", none) for l in layers) / len(layers)
        # loss, aux loss and per-expert loads of this rank's tokens, averaged over the ranks in one
        # all-reduce: equal shards make the means of the loss and the loads the global batch's;
        # the aux loss stays the mean of the ranks' own (what each rank optimises)
        stats = torch.cat([loss.detach().view(1), aux.view(1),
                           torch.stack([l.router.last_routing_load for l in layers]).view(-1)])
        if ep is not None:
            dist.all_reduce(stats)
            stats /= ep.world
        stats = stats.tolist()
        loads = [stats[2 + i * args.experts: 2 + (i + 1) * args.experts] for i in range(len(layers))]
        history.append(loads)
        imbalance = max(max(ld) * len(ld) for ld in loads)
        losses.append(stats[0])
        if main_rank:
            done = step / args.steps
            bar = "#" * int(30 * done) + "." * (30 - int(30 * done))
            sys.stdout.write(f"\r[{bar}] step {step}/{args.steps}  loss {losses[-1]:.3f}  "
                             f"aux {stats[1]:.3f}  max load/mean {imbalance:.2f}  {time.time() - t0:5.1f}s")
            sys.stdout.flush()
    final_val = val_loss()
    state = full_state_dict(model, ep.ep_group if ep is not None else None)
    if main_rank:
        print()
        ckpt = os.path.join(args.out, "tiny_moe.pt")
        torch.save({"model": state, "args": vars(args)}, ckpt)
        png = os.path.join(args.out, "expert_load.png")
        load_plot(history, len(layers), args.experts, png)
        print(f"validation loss {first_val:.3f} -> {final_val:.3f} (uniform guess: {math.log(256):.3f}); "
              f"train loss first 10 steps {sum(losses[:10]) / 10:.3f}, last 10 {sum(losses[-10:]) / 10:.3f}")
        print(f"checkpoint: {ckpt}\nper-expert load plot: {png} ({time.time() - t0:.0f} s)")
    if ep is not None:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
