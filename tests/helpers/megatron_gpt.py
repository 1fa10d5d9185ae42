"""A tiny Megatron-Core GPTModel on the CPU, with Megatron's MoE layer or moe-core's (through
``moe_core.megatron.gpt_layer_spec``), from the same weights, trained a few steps.

CPU patches, beside ``megatron_layer``'s (router gating without ``.cuda()``, the eager expert-bias
step; applied on import): ``torch.cuda.current_device`` returns ``"cpu"`` (Megatron allocates the
MoE buffers and the checkpoint saver's status tensors there), the CUDA RNG tracker's ``fork`` is a
no-op (attention dropout forks it; dropout is 0 here) and ``torch.cuda.synchronize`` too (the
checkpoint saver calls it); the checkpoint writer's results queue is a thread queue instead of a
multiprocessing Manager's (its writes run in threads; the ranks of ``helpers.dist.run_ranks`` are
daemon processes, which may not start the Manager's server process). Nothing else of Megatron is changed: the GPT model, its layers and its
own MoE layer are its code.
"""
import contextlib
import queue
import warnings

import torch
import torch.nn.functional as F

from . import megatron_layer  # noqa: F401  (its CPU patches of Megatron's router)

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from megatron.core.dist_checkpointing.strategies import filesystem_async
    from megatron.core.distributed.finalize_model_grads import (_update_router_expert_bias,
                                                                reset_model_temporary_tensors)
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel import random as mrandom
    from megatron.core.transformer.moe import moe_logging, moe_utils
    from megatron.core.transformer.transformer_config import TransformerConfig

from moe_core.megatron import gpt_layer_spec

VOCAB, SEQ, BATCH = 64, 8, 2


def patch_megatron_for_cpu() -> None:
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *args, **kwargs: None
    mrandom.CudaRNGStatesTracker.fork = lambda self, name=None: contextlib.nullcontext()
    filesystem_async.get_write_results_queue = lambda mp_mode="spawn": queue.Queue()


def config(**kw) -> TransformerConfig:
    """A two-layer GPT config, every MLP a MoE (SwiGLU experts, softmax top-2, aux loss)."""
    base = dict(num_layers=2, hidden_size=16, num_attention_heads=2, use_cpu_initialization=True,
                num_moe_experts=4, moe_ffn_hidden_size=12, moe_router_topk=2,
                add_bias_linear=False, gated_linear_unit=True, activation_func=F.silu,
                moe_aux_loss_coeff=1e-2, moe_router_dtype="fp32",
                moe_token_dispatcher_type="allgather", hidden_dropout=0.0,
                attention_dropout=0.0)
    base.update(kw)
    return TransformerConfig(**base)


def models(cfg: TransformerConfig, seed: int = 0):
    """``(megatron, ours)``: GPTModels with Megatron's MoE layers and moe-core's, ours loaded from
    Megatron's state dict (Megatron's per-expert keys)."""
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        meg = GPTModel(cfg, get_gpt_layer_local_spec(num_experts=cfg.num_moe_experts), VOCAB, SEQ)
        ours = GPTModel(cfg, gpt_layer_spec(num_experts=cfg.num_moe_experts), VOCAB, SEQ)
    ours.load_state_dict(meg.state_dict(), strict=True)
    return meg, ours


def batches(steps: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g) for _ in range(steps)]


def train(model: torch.nn.Module, data, lr: float = 0.5):
    """Plain SGD on the mean token loss; per step the loss and Megatron's tracked aux losses
    (its tracker cleared after each step). After each backward, what Megatron's
    ``finalize_model_grads`` does to the MoE layers besides reducing gradients: the expert-bias
    update (``moe_router_enable_expert_bias``) and the reset of the running counts."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    pos = torch.arange(SEQ).expand(BATCH, SEQ)
    causal = torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool).triu(1)
    tracker = moe_logging.get_moe_metrics_tracker()
    tracker.clear()
    moe_utils.MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0))
    losses, tracked = [], []
    for tokens in data:
        opt.zero_grad()
        loss = model(tokens[:, :-1], pos, causal, labels=tokens[:, 1:]).mean()
        loss.backward()
        cfg = model.config
        if cfg.moe_router_enable_expert_bias:
            _update_router_expert_bias([model], cfg)
        reset_model_temporary_tensors(cfg, [model])
        opt.step()
        losses.append(loss.detach())
        tracked.append({name: entry.values.clone() for name, entry in tracker.metrics.items()})
        tracker.clear()
    biases = [m.expert_bias.clone() for m in model.modules()
              if getattr(m, "expert_bias", None) is not None]
    return torch.stack(losses), tracked, biases

