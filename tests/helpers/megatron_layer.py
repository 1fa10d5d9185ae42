"""Build megatron-core's real MoELayer on the CPU at world size 1, for layer-level parity tests.

What it takes (docs/design.md, "Running Megatron-Core as the oracle"): a gloo process group of
one and ``initialize_model_parallel(1, 1)``; ``Router.gating`` patched so it does not move the
weights to CUDA; buffers that Megatron creates with ``device=torch.cuda.current_device()``
(expert bias, global aux loss) created on the CPU instead; the torch.compile'd
``_apply_expert_bias`` run eagerly; without a GPU, the activation checkpoint's RNG save and
restore (``moe_layer_recompute``) keeps the CPU generator's state and the tracker's only. Nothing else of Megatron is changed: routing, dispatch (allgather), experts
(SequentialMLP, the local spec) and combine are its own code.
"""
import contextlib
import os
import socket
import warnings

import torch

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_submodules
    from megatron.core.transformer.moe import moe_utils
    from megatron.core.tensor_parallel import random as mrandom
    from megatron.core.transformer.moe import router as mrouter
    from megatron.core.transformer.moe.moe_layer import MoELayer as MegatronMoELayer
    from megatron.core.transformer.spec_utils import get_submodules
    from megatron.core.transformer.transformer_config import TransformerConfig


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_world_of_one() -> None:
    if not dist.is_initialized():
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(_free_port())
        dist.init_process_group("gloo", rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)


def _gating_on_cpu(self, inp):
    rd = inp.dtype
    if self.config.moe_router_dtype == "fp32":
        rd = torch.float32
    elif self.config.moe_router_dtype == "fp64":
        rd = torch.float64
    return moe_utils.router_gating_linear(inp, self.weight, self.bias, rd)


mrouter.Router.gating = _gating_on_cpu
_compiled = mrouter.TopKRouter._apply_expert_bias
mrouter.TopKRouter._apply_expert_bias = getattr(_compiled, "_torchdynamo_orig_callable", _compiled)


def _cpu_rng_states():
    return torch.get_rng_state(), None, mrandom.get_cuda_rng_tracker().get_states()


def _set_cpu_rng_states(cpu_rng_state, _cuda_rng_state, tracker_states):
    torch.set_rng_state(cpu_rng_state)
    mrandom.get_cuda_rng_tracker().set_states(tracker_states)


if not torch.cuda.is_available():
    mrandom._get_all_rng_states = _cpu_rng_states
    mrandom._set_all_rng_states = _set_cpu_rng_states


@contextlib.contextmanager
def _cuda_buffers_on_cpu():
    saved = torch.cuda.current_device
    torch.cuda.current_device = lambda: "cpu"
    try:
        yield
    finally:
        torch.cuda.current_device = saved


def build(**kwargs) -> MegatronMoELayer:
    """A Megatron MoELayer (local spec, allgather dispatcher) from TransformerConfig kwargs."""
    init_world_of_one()
    base = dict(num_layers=1, num_attention_heads=4, use_cpu_initialization=True,
                moe_token_dispatcher_type="allgather")
    base.update(kwargs)
    cfg = TransformerConfig(**base)
    sub = get_gpt_layer_local_submodules(num_experts=cfg.num_moe_experts, moe_grouped_gemm=False)
    with _cuda_buffers_on_cpu():
        layer = MegatronMoELayer(cfg, get_submodules(sub.mlp))
    layer.router.set_layer_number(1)
    return layer


def set_loss_scale(scale: float) -> None:
    """Megatron's aux-loss scale is a class attribute: set it explicitly in every test."""
    moe_utils.MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(scale))
