"""Train a tiny Megatron-Core GPT model whose MoE layers are moe-core's.

    torchrun --nproc-per-node 2 examples/megatron_gpt_moe.py --ep 2     # EP 2 over gloo, CPU
    python examples/megatron_gpt_moe.py                                 # one process

The model is Megatron's ``GPTModel`` built from ``moe_core.megatron.gpt_layer_spec`` (Megatron's
local GPT layer spec, the MLP swapped for moe-core's layer); the process groups are Megatron's
``parallel_state`` (expert parallelism over ``--ep`` ranks, every rank a data-parallel replica).
The aux loss reaches the gradients through Megatron's ``MoEAuxLossAutoScaler`` scale and its value
is read from Megatron's MoE metrics tracker, as Megatron's training loop logs it. The data is a
synthetic next-token task (each sequence counts up from a random start, modulo the vocabulary),
so the loss falls within a few dozen steps.
"""
import argparse
import contextlib
import os
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.tensor_parallel import random as megatron_random
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler
    from megatron.core.transformer.transformer_config import TransformerConfig

from moe_core.megatron import gpt_layer_spec
from moe_core.parallel import all_reduce_gradients

VOCAB, SEQ = 64, 16


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ep", type=int, default=1, help="expert-parallel size (divides the world)")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--batch", type=int, default=8, help="sequences per rank and step")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def init_distributed(ep: int) -> torch.device:
    """gloo on the CPU (NCCL with one GPU per rank where there are GPUs), Megatron's groups."""
    cuda = torch.cuda.is_available()
    if "RANK" not in os.environ:  # plain `python`: a world of one
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29533")
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=ep)
    if cuda:
        megatron_random.model_parallel_cuda_manual_seed(0)
    else:
        # Megatron's own attention assumes a GPU in two places: it forks the CUDA RNG tracker
        # around its dropout (there is no CUDA RNG here, and the dropout is 0: the fork does
        # nothing) and takes its score buffer on torch.cuda.current_device() (the CPU here).
        # moe-core's layer needs neither.
        megatron_random.CudaRNGStatesTracker.fork = \
            lambda self, name=None: contextlib.nullcontext()
        torch.cuda.current_device = lambda: "cpu"
    return torch.device("cuda") if cuda else torch.device("cpu")


def batch(g: torch.Generator, size: int, device: torch.device) -> torch.Tensor:
    start = torch.randint(0, VOCAB, (size, 1), generator=g)
    return ((start + torch.arange(SEQ + 1)) % VOCAB).to(device)


def main() -> None:
    args = parse_args()
    device = init_distributed(args.ep)
    rank = dist.get_rank()
    config = TransformerConfig(
        num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128,
        num_moe_experts=4, moe_ffn_hidden_size=64, moe_router_topk=2,
        moe_token_dispatcher_type="alltoall", moe_aux_loss_coeff=1e-2, moe_router_dtype="fp32",
        add_bias_linear=False, gated_linear_unit=True, activation_func=F.silu,
        expert_model_parallel_size=args.ep, hidden_dropout=0.0, attention_dropout=0.0,
        use_cpu_initialization=device.type == "cpu")
    torch.manual_seed(args.seed)  # the same replicated weights on every rank
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = GPTModel(config, gpt_layer_spec(num_experts=config.num_moe_experts),
                         vocab_size=VOCAB, max_sequence_length=SEQ).to(device)
    if rank == 0:
        print(model.decoder.layers[0].mlp)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    g = torch.Generator().manual_seed(args.seed + 1 + rank)  # each rank its own batches
    pos = torch.arange(SEQ, device=device).expand(args.batch, SEQ)
    causal = torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool, device=device).triu(1)
    tracker = get_moe_metrics_tracker()
    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0, device=device))
    for step in range(args.steps):
        tokens = batch(g, args.batch, device)
        opt.zero_grad()
        loss = model(tokens[:, :-1], pos, causal, labels=tokens[:, 1:]).mean()
        loss.backward()
        all_reduce_gradients(model)  # data parallel over the world, experts over expert-DP
        opt.step()
        aux = tracker.metrics["load_balancing_loss"].values.mean()
        tracker.clear()
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)
        if rank == 0 and (step % 10 == 0 or step == args.steps - 1):
            print(f"step {step:3d}  loss {mean_loss.item() / dist.get_world_size():.4f}  "
                  f"load-balancing loss (rank 0) {aux.item():.4f}")
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
