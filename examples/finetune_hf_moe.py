"""Fine-tune a Hugging Face MoE model four ways and compare: HF eager experts, HF grouped_mm
experts, the moe-core experts backend, and moe-core blocks swapped in.

    python examples/finetune_hf_moe.py                       # a small Qwen3-MoE-shaped model
    python examples/finetune_hf_moe.py --checkpoint DIR      # a local HF checkpoint (+ tokenizer)
    python examples/finetune_hf_moe.py --steps 50 --dtype bf16 --routes moe_core,moe_core_block

Without ``--checkpoint`` the model is built from ``Qwen3MoeConfig`` with random weights and a
byte vocabulary (256 tokens), and trained on the bytes of the Python standard library's source
files (nothing is downloaded). Every route starts from the same weights and sees the same
batches, so their losses agree step by step up to rounding (printed as the largest difference
from the first route's). Tokens/s is a batch's tokens over the median step time (forward,
backward, optimizer step) of all steps but the first, which pays one-time costs. Runs on a GPU when one is present, else on the CPU, where the
default sizes take a few seconds per route.
"""
import argparse
import copy
import glob
import os
import sysconfig
import time
from typing import Callable, Dict, List

import torch

import moe_core.hf as mh

ROUTES = ("eager", "grouped_mm", "moe_core", "moe_core_block")


def stdlib_bytes(max_bytes: int) -> torch.Tensor:
    """The first ``max_bytes`` bytes of the stdlib's ``*.py`` files, ``[N]`` int64."""
    out, n = [], 0
    for path in sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py"))):
        with open(path, "rb") as f:
            data = f.read()
        out.append(data)
        n += len(data)
        if n >= max_bytes:
            break
    return torch.frombuffer(bytearray(b"".join(out)[:max_bytes]), dtype=torch.uint8).long()


def build_model(args: argparse.Namespace, dtype: torch.dtype):
    """``(model, token stream [N] int64)``: the checkpoint and its tokenizer's ids of the stdlib
    text, or a random Qwen3-MoE-shaped model over bytes."""
    import transformers

    if args.checkpoint:
        model = transformers.AutoModelForCausalLM.from_pretrained(args.checkpoint, dtype=dtype)
        tok = transformers.AutoTokenizer.from_pretrained(args.checkpoint)
        text = stdlib_bytes(args.corpus_bytes).to(torch.uint8).numpy().tobytes()
        ids = tok(text.decode("utf-8", "replace"), return_tensors="pt").input_ids[0]
        return model, ids
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=256, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
        moe_intermediate_size=args.ffn, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, num_key_value_heads=args.heads,
        head_dim=args.hidden // args.heads, num_experts=args.experts,
        num_experts_per_tok=args.topk, norm_topk_prob=True, max_position_embeddings=4096,
        output_router_logits=True, router_aux_loss_coef=0.01, pad_token_id=0)
    torch.manual_seed(args.seed)
    model = transformers.Qwen3MoeForCausalLM(cfg)
    with torch.no_grad():  # HF starts Qwen3's routers at zero (all ties); spread them
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.02)
    return model.to(dtype), stdlib_bytes(args.corpus_bytes)


def prepare(route: str, model) -> None:
    """Put ``model`` on ``route`` (in place)."""
    if route == "moe_core_block":
        model.set_experts_implementation("eager")  # only non-swapped blocks would use it
        n = mh.replace_moe_blocks(model)
        print(f"  replaced {n} sparse-MoE blocks")
    else:
        model.set_experts_implementation(route)


def train(route: str, base, batches: List[torch.Tensor], lr: float, device: torch.device
          ) -> Dict[str, object]:
    model = copy.deepcopy(base)
    prepare(route, model)
    model.to(device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    sync: Callable[[], None] = (torch.cuda.synchronize if device.type == "cuda" else lambda: None)
    losses, times = [], []
    for ids in batches:
        ids = ids.to(device)
        sync()
        t0 = time.perf_counter()
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        times.append(time.perf_counter() - t0)
        losses.append(float(out.loss.detach()))
    # the median step of all but the first (one-time costs): robust to a busy shared machine
    timed = sorted(times[1:]) or times
    step_s = timed[len(timed) // 2]
    return {"losses": losses, "tokens_per_s": batches[0].numel() / step_s}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", default=None, help="a local HF MoE checkpoint directory")
    ap.add_argument("--routes", default=",".join(ROUTES), help=f"comma list of {ROUTES}")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default=None,
                    help="default: bf16 on a GPU, fp32 on the CPU")
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--ffn", type=int, default=64, help="each expert's intermediate size")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--topk", type=int, default=4)
    ap.add_argument("--corpus-bytes", type=int, default=2_000_000)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    routes = [r.strip() for r in args.routes.split(",") if r.strip()]
    for r in routes:
        if r not in ROUTES:
            ap.error(f"unknown route {r!r}; choose from {ROUTES}")

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[
        args.dtype or ("bf16" if device.type == "cuda" else "fp32")]
    mh.register_experts_backend()
    base, stream = build_model(args, dtype)
    n_params = sum(p.numel() for p in base.parameters())
    print(f"{type(base).__name__}: {n_params / 1e6:.2f} M parameters, {dtype}, on {device}; "
          f"{args.steps} steps of {args.batch} x {args.seq} tokens")
    g = torch.Generator().manual_seed(args.seed)
    starts = torch.randint(0, len(stream) - args.seq - 1, (args.steps, args.batch), generator=g)
    batches = [torch.stack([stream[s:s + args.seq] for s in row.tolist()]) for row in starts]

    results = {}
    for route in routes:
        print(f"{route}:")
        try:
            results[route] = train(route, base, batches, args.lr, device)
        except (ValueError, RuntimeError, NotImplementedError) as e:  # e.g. no grouped_mm here
            print(f"  skipped: {e}")
            continue
        losses = results[route]["losses"]
        print("  loss " + " ".join(f"{x:.4f}" for x in losses))
    if not results:
        return
    first = next(iter(results.values()))["losses"]
    print("\n| route | first loss | last loss | max |loss - first route's| | tokens/s |")
    print("|---|---|---|---|---|")
    for route, r in results.items():
        diff = max(abs(a - b) for a, b in zip(r["losses"], first))
        print(f"| {route} | {r['losses'][0]:.4f} | {r['losses'][-1]:.4f} | {diff:.2e} | "
              f"{r['tokens_per_s']:,.0f} |")


if __name__ == "__main__":
    main()
