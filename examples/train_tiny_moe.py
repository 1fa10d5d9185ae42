"""Train a tiny decoder-only language model whose MLPs are moe-core MoELayers.

The text is real and on every machine: the Python standard library's own source files, read as
bytes (a 256-symbol vocabulary), so nothing is downloaded. Each block is pre-norm causal
self-attention followed by an MoELayer (top-2 of 8 SwiGLU experts, aux loss and z-loss attached
through the autoscaler). It runs on the CPU by default, and on a GPU when one is present and this
build has CUDA kernels for every op of the layer (moe_core.layer_runs_on_cuda()). It prints a
progress line with the loss, the aux loss and the load imbalance, saves a checkpoint, and writes
a PNG of every layer's per-expert load over the steps.

    python examples/train_tiny_moe.py [--steps 300] [--out examples/out]
"""
import argparse
import glob
import math
import os
import struct
import sys
import sysconfig
import time
import zlib

import torch
import torch.nn.functional as F
from torch import nn

import moe_core
from moe_core import MoEConfig, MoELayer


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
    def __init__(self, cfg: MoEConfig, heads: int, layer_number: int):
        super().__init__()
        d = cfg.hidden_size
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d, bias=False), nn.Linear(d, d, bias=False)
        self.moe = MoELayer(cfg, layer_number=layer_number)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [S, B, d]
        S, B, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(S, B, 3, self.heads, d // self.heads).permute(2, 1, 3, 0, 4)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)        # [B, h, S, d/h]
        x = x + self.proj(attn.permute(2, 0, 1, 3).reshape(S, B, d))
        return x + self.moe(self.norm2(x))


class TinyMoELM(nn.Module):
    def __init__(self, cfg: MoEConfig, layers: int, heads: int, seq_len: int):
        super().__init__()
        self.embed = nn.Embedding(256, cfg.hidden_size)
        nn.init.normal_(self.embed.weight, 0.0, 0.02)  # tied with the output head: keep logits small
        self.pos = nn.Parameter(torch.randn(seq_len, 1, cfg.hidden_size) * 0.02)
        self.blocks = nn.ModuleList(Block(cfg, heads, i + 1) for i in range(layers))
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


def main() -> None:
    ap = argparse.ArgumentParser(description="Train a tiny MoE language model with moe-core.")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--topk", type=int, default=2)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--device", default="cuda" if moe_core.layer_runs_on_cuda() else "cpu")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "out"))
    args = ap.parse_args()
    torch.manual_seed(0)
    os.makedirs(args.out, exist_ok=True)
    dev = torch.device(args.device)

    data = load_corpus(4 << 20)
    split = int(len(data) * 0.95)
    train_data, val_data = data[:split], data[split:]
    cfg = MoEConfig(hidden_size=args.hidden, num_layers=args.layers, num_moe_experts=args.experts,
                    moe_ffn_hidden_size=2 * args.hidden, moe_router_topk=args.topk,
                    add_bias_linear=False, gated_linear_unit=True, activation_func=F.silu,
                    moe_router_dtype="fp32", moe_aux_loss_coeff=1e-2, moe_z_loss_coeff=1e-3)
    model = TinyMoELM(cfg, args.layers, heads=4, seq_len=args.seq_len).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"tiny MoE LM: {args.layers} layers, {args.experts} experts top-{args.topk}, "
          f"{n_params / 1e6:.2f} M parameters, {len(data) / 1e6:.1f} MB of stdlib source, on {dev}")

    def batch(src):
        idx = torch.randint(0, len(src) - args.seq_len - 1, (args.batch,))
        chunk = torch.stack([src[i: i + args.seq_len + 1] for i in idx]).t().to(dev)  # [S+1, B]
        return chunk[:-1], chunk[1:]

    @torch.no_grad()
    def val_loss():
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
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        moe_core.finalize_step(model)
        aux = sum(l.router.last_losses["load_balancing_loss"] for l in layers) / len(layers)
        loads = [l.router.last_routing_load for l in layers]
        history.append([ld.tolist() for ld in loads])
        imbalance = max(max(ld).item() * len(ld) for ld in loads)
        losses.append(loss.item())
        done = step / args.steps
        bar = "#" * int(30 * done) + "." * (30 - int(30 * done))
        sys.stdout.write(f"\r[{bar}] step {step}/{args.steps}  loss {losses[-1]:.3f}  "
                         f"aux {aux.item():.3f}  max load/mean {imbalance:.2f}  {time.time() - t0:5.1f}s")
        sys.stdout.flush()
    print()
    final_val = val_loss()
    ckpt = os.path.join(args.out, "tiny_moe.pt")
    torch.save({"model": model.state_dict(), "args": vars(args)}, ckpt)
    png = os.path.join(args.out, "expert_load.png")
    load_plot(history, len(layers), args.experts, png)
    print(f"validation loss {first_val:.3f} -> {final_val:.3f} (uniform guess: {math.log(256):.3f}); "
          f"train loss first 10 steps {sum(losses[:10]) / 10:.3f}, last 10 {sum(losses[-10:]) / 10:.3f}")
    print(f"checkpoint: {ckpt}\nper-expert load plot: {png} ({time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()
