"""Train a tiny model made of torchtitan's MoE blocks, with moe-core's layers swapped in.

    python examples/torchtitan_moe.py                # CPU or one GPU
    python examples/torchtitan_moe.py --no-swap      # the same run on torchtitan's own MoE

The MoE modules are torchtitan's own (``torchtitan.models.common.moe.MoE``, built by its config
builders: softmax top-2 routing with renormalisation, a shared expert, the expert bias of its
auxiliary-loss-free balancing), replaced by ``moe_core.torchtitan.replace_moe``; the bias is
updated by torchtitan's own optimizer pre-step hook (``register_moe_load_balancing_hook``), and
the final weights are written in torchtitan's layout (``torchtitan_state_dict``). Between the MoE
blocks the tokens mix through a causal running mean (torchtitan's attention kernels have no CPU
backward). The task is synthetic next-token prediction (each sequence counts up from a random
start, modulo the vocabulary), so the loss falls within a few dozen steps.
"""
import argparse
import functools
import types
import warnings

import torch
import torch.nn.functional as F
from torch import nn

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from torchtitan.components.optimizer import register_moe_load_balancing_hook
    from torchtitan.models.common.config_utils import (make_ffn_config, make_moe_config,
                                                       make_routed_experts_config,
                                                       make_router_config)

from moe_core.torchtitan import replace_moe, torchtitan_state_dict

VOCAB, SEQ = 64, 16


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-swap", action="store_true", help="keep torchtitan's own MoE modules")
    p.add_argument("--save", default=None, help="write the final state dict (torchtitan's keys)")
    return p.parse_args()


def torchtitan_moe(dim: int, experts: int) -> nn.Module:
    """torchtitan's MoE module from its own config builders, initialised by torchtitan."""
    normal = functools.partial(nn.init.normal_, std=0.02)
    cfg = make_moe_config(
        num_experts=experts,
        router=make_router_config(dim=dim, num_experts=experts, gate_param_init={"weight": normal},
                                  top_k=2, score_func="softmax", route_norm=True),
        routed_experts=make_routed_experts_config(
            dim=dim, hidden_dim=2 * dim, num_experts=experts, top_k=2, comm_backend="standard",
            param_init={k: normal for k in ("w1_EFD", "w2_EDF", "w3_EFD")}),
        shared_experts=make_ffn_config(dim=dim, hidden_dim=dim, w1_param_init={"weight": normal},
                                       w2w3_param_init={"weight": normal}),
        load_balance_coeff=1e-3)
    module = cfg.build()
    module.init_states()
    return module


class Block(nn.Module):
    """Token mixing (a causal running mean, projected), then torchtitan's MoE, each residual."""

    def __init__(self, dim: int, experts: int):
        super().__init__()
        self.mix_norm, self.moe_norm = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.mix = nn.Linear(dim, dim, bias=False)
        self.moe_enabled, self.moe = True, torchtitan_moe(dim, experts)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        x = self.mix_norm(h)
        mean = x.cumsum(1) / torch.arange(1, x.shape[1] + 1, device=x.device)[:, None]
        h = h + self.mix(mean)
        return h + self.moe(self.moe_norm(h))


class TinyMoEModel(nn.Module):
    def __init__(self, dim: int, experts: int, layers: int):
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, dim)
        self.layers = nn.ModuleDict({str(i): Block(dim, experts) for i in range(layers)})
        self.norm = nn.RMSNorm(dim)
        self.lm_head = nn.Linear(dim, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for block in self.layers.values():
            h = block(h)
        return self.lm_head(self.norm(h))


def main() -> None:
    args = parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(args.seed)
    model = TinyMoEModel(args.dim, args.experts, args.layers)
    if not args.no_swap:
        print(f"replaced {replace_moe(model)} torchtitan MoE modules with moe-core's")
    model.to(device).train()
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    # torchtitan's auxiliary-loss-free balancing: its hook updates every MoE's expert bias from
    # the tokens each expert received since the last step (one process: no mesh to reduce over)
    register_moe_load_balancing_hook(
        opt, [model], types.SimpleNamespace(get_optional_mesh=lambda name: None,
                                            ep_enabled=False, tp=1))
    g = torch.Generator().manual_seed(args.seed + 1)
    for step in range(args.steps):
        start = torch.randint(0, VOCAB, (args.batch, 1), generator=g)
        tokens = ((start + torch.arange(SEQ + 1)) % VOCAB).to(device)
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 10 == 0 or step == args.steps - 1:
            bias = model.layers["0"].moe.expert_bias_E
            print(f"step {step:3d}  loss {loss.item():.4f}  layer-0 expert bias spread "
                  f"{(bias.max() - bias.min()).item():.4f}")
    if args.save:
        sd = model.state_dict() if args.no_swap else torchtitan_state_dict(model)
        torch.save(sd, args.save)
        print(f"saved {len(sd)} tensors in torchtitan's keys to {args.save}")


if __name__ == "__main__":
    main()
