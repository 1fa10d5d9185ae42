"""One Hugging Face MoE decoder layer, forward + backward, three ways: HF's default experts
implementation (``grouped_mm``), the moe-core experts backend (``experts_implementation=
"moe_core"``), and the moe-core block swap (``replace_moe_blocks``).

    python -m benchmarks.bench_hf                      # on a GPU: both shapes, bf16
    python -m benchmarks.bench_hf --shape qwen3_30b_a3b --tokens 8192 --rounds 20
    python -m benchmarks.bench_hf --smoke              # tiny shapes on the CPU (a quick check)
    python -m benchmarks.bench_hf --batch 4 --part block  # 4 sequences; the MoE block alone

Each shape is one decoder layer built from the family's config class (random weights, the
model's dtype; the routers' weights are redrawn so that routing spreads over the experts as a
trained router's would, not all-ties at HF's zero init): attention, norms and the sparse-MoE
block, timed whole (``layer``) and the sparse-MoE block alone (``block``: what the two routes
replace; the layer's attention is the same for all and dilutes their difference). Every variant runs the same layer weights on the same input and upstream gradient. Timing:
CUDA events around fwd + bwd, after warm-up, rounds interleaved over the variants (so clock and
thermal drift hit all alike); the median over rounds is reported, with the speedup over HF's
default. On the CPU (``--smoke``) wall-clock time replaces the events. The markdown table is
printed last.
"""
import argparse
import copy
import statistics
import time
from typing import Callable, Dict, List, Tuple

import torch

import moe_core.hf as mh

VARIANTS = ("hf grouped_mm", "moe-core backend", "moe-core block")


def shape_config(name: str, smoke: bool):
    """The HF config of a shape (``smoke``: the same family, tiny)."""
    import transformers

    if name == "qwen3_30b_a3b":
        if smoke:
            return transformers.Qwen3MoeConfig(
                hidden_size=64, moe_intermediate_size=32, intermediate_size=128,
                num_experts=16, num_experts_per_tok=4, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, num_hidden_layers=1, vocab_size=128,
                norm_topk_prob=True)
        # Qwen3-30B-A3B: 128 experts, top-8, expert FFN 768, hidden 2048, GQA 32 / 4 heads of 128
        return transformers.Qwen3MoeConfig(
            hidden_size=2048, moe_intermediate_size=768, intermediate_size=6144,
            num_experts=128, num_experts_per_tok=8, num_attention_heads=32,
            num_key_value_heads=4, head_dim=128, num_hidden_layers=1, vocab_size=1024,
            norm_topk_prob=True)
    if name == "mixtral":
        if smoke:
            return transformers.MixtralConfig(
                hidden_size=64, intermediate_size=64, num_local_experts=8,
                num_experts_per_tok=2, num_attention_heads=4, num_key_value_heads=2,
                head_dim=16, num_hidden_layers=1, vocab_size=128)
        # Mixtral-8x7B: 8 experts, top-2, FFN 14336, hidden 4096, GQA 32 / 8 heads of 128
        return transformers.MixtralConfig(
            hidden_size=4096, intermediate_size=14336, num_local_experts=8,
            num_experts_per_tok=2, num_attention_heads=32, num_key_value_heads=8,
            head_dim=128, num_hidden_layers=1, vocab_size=1024)
    raise ValueError(f"unknown shape {name!r}")


class LayerRunner:
    """One decoder layer of the model built from ``cfg`` (``part="layer"``: attention, norms and
    the sparse-MoE block, rotary embeddings precomputed) or its sparse-MoE block alone
    (``part="block"``): ``fwd_bwd()`` runs it on ``x [batch, tokens / batch, H]`` and its
    backward with a fixed upstream gradient."""

    def __init__(self, model, tokens: int, batch: int, part: str, device: torch.device,
                 dtype: torch.dtype, seed: int):
        layer = model.model.layers[0]
        self.part = part
        self.module = layer if part == "layer" else layer.mlp
        g = torch.Generator(device="cpu").manual_seed(seed)
        H = model.config.hidden_size
        shape = (batch, tokens // batch, H)
        self.x = (torch.randn(shape, generator=g) * 0.5).to(device, dtype)
        self.x.requires_grad_(True)
        self.dy = (torch.randn(shape, generator=g) * 1e-2).to(device, dtype)
        pos = torch.arange(shape[1], device=device)[None].expand(batch, -1)
        with torch.no_grad():
            self.pos_emb = model.model.rotary_emb(self.x, pos)
        self.pos = pos

    def fwd_bwd(self) -> None:
        self.x.grad = None
        for p in self.module.parameters():
            p.grad = None
        if self.part == "layer":
            y = self.module(self.x, position_ids=self.pos, position_embeddings=self.pos_emb)
        else:
            y = self.module(self.x)
        y = y[0] if isinstance(y, tuple) else y
        y.backward(self.dy)


def build_variants(shape: str, tokens: int, batch: int, part: str, device: torch.device,
                   dtype: torch.dtype, smoke: bool, seed: int = 0) -> Dict[str, LayerRunner]:
    import transformers

    cfg = shape_config(shape, smoke)
    cfg._experts_implementation = "grouped_mm"
    torch.manual_seed(seed)
    with torch.device(device):
        base = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    with torch.no_grad():
        for name, p in base.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.02)
    base.train()
    runners = {}
    for variant in VARIANTS:
        model = base if variant == "hf grouped_mm" else copy.deepcopy(base)
        if variant == "moe-core backend":
            model.set_experts_implementation("moe_core")
        elif variant == "moe-core block":
            assert mh.replace_moe_blocks(model) == 1
        runners[variant] = LayerRunner(model, tokens, batch, part, device, dtype, seed + 1)
    return runners


def time_variants(runners: Dict[str, LayerRunner], rounds: int, warmup: int,
                  device: torch.device) -> Dict[str, List[float]]:
    """Milliseconds per fwd + bwd for each variant, ``rounds`` samples, interleaved."""
    cuda = device.type == "cuda"
    for r in runners.values():
        for _ in range(warmup):
            r.fwd_bwd()
    if cuda:
        torch.cuda.synchronize()
    times: Dict[str, List[float]] = {v: [] for v in runners}
    for _ in range(rounds):
        for v, r in runners.items():
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                r.fwd_bwd()
                end.record()
                end.synchronize()
                times[v].append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                r.fwd_bwd()
                times[v].append((time.perf_counter() - t0) * 1e3)
    return times


def check_agreement(runners: Dict[str, LayerRunner]) -> Dict[str, float]:
    """Relative difference of each variant's input gradient from HF's (a sanity check that the
    variants compute the same layer)."""
    grads = {}
    for v, r in runners.items():
        r.fwd_bwd()
        grads[v] = r.x.grad.detach().float().clone()
    ref = grads["hf grouped_mm"]
    return {v: ((g - ref).norm() / ref.norm()).item() for v, g in grads.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", action="append", choices=("qwen3_30b_a3b", "mixtral"),
                    help="repeatable; default: both")
    ap.add_argument("--tokens", type=int, default=None,
                    help="tokens per step (default: 8192 on a GPU, 64 with --smoke)")
    ap.add_argument("--batch", type=int, default=1,
                    help="sequences the tokens are split into (attention is per sequence)")
    ap.add_argument("--part", choices=("layer", "block", "both"), default="both",
                    help="the decoder layer, its sparse-MoE block alone, or both (default)")
    ap.add_argument("--rounds", type=int, default=None, help="default: 20 (3 with --smoke)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU")
    args = ap.parse_args()
    shapes = args.shape or ["qwen3_30b_a3b", "mixtral"]
    if args.smoke:
        device, dtype = torch.device("cpu"), torch.float32
    else:
        if not torch.cuda.is_available():
            ap.error("no GPU: run with --smoke for the CPU check")
        device, dtype = torch.device("cuda"), torch.bfloat16
        torch.backends.cuda.matmul.allow_tf32 = False
    tokens = args.tokens or (64 if args.smoke else 8192)
    rounds = args.rounds or (3 if args.smoke else 20)
    mh.register_experts_backend()
    dev_name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    if tokens % args.batch:
        ap.error(f"--tokens {tokens} is not a multiple of --batch {args.batch}")
    parts = ("layer", "block") if args.part == "both" else (args.part,)
    print(f"{dev_name}, {dtype}, {tokens} tokens in {args.batch} sequence(s), median of {rounds} "
          "interleaved rounds")

    rows: List[Tuple[str, str, str, float, float, float]] = []
    for shape in shapes:
        for part in parts:
            runners = build_variants(shape, tokens, args.batch, part, device, dtype, args.smoke)
            agree = check_agreement(runners)
            times = time_variants(runners, rounds, args.warmup, device)
            base_ms = statistics.median(times["hf grouped_mm"])
            for v in VARIANTS:
                ms = statistics.median(times[v])
                spread = (max(times[v]) - min(times[v])) / ms if ms > 0 else 0.0
                rows.append((shape, part, v, ms, base_ms / ms, agree[v]))
                print(f"{shape:14s} {part:6s} {v:18s} {ms:9.3f} ms  (spread {spread:.0%}), "
                      f"input grad vs HF {agree[v]:.2e}", flush=True)
            del runners
            if device.type == "cuda":
                torch.cuda.empty_cache()

    print("\n| shape | part | variant | fwd + bwd | speedup vs HF grouped_mm | input grad vs HF |")
    print("|---|---|---|---|---|---|")
    for shape, part, v, ms, speedup, err in rows:
        print(f"| {shape} | {part} | {v} | {ms:.3f} ms | {speedup:.2f}x | {err:.1e} |")


if __name__ == "__main__":
    main()
