"""moe-core: a Mixture-of-Experts layer for PyTorch on an ATen-free C/CUDA core.

``moe_core.ops`` is the functional API (names and argument order of Megatron-Core's moe_utils);
``moe_core.MoELayer(MoEConfig(...))`` is the layer.
"""
import torch  # noqa: F401  (loads libc10 and friends, which _C links against)

from moe_core import _C  # noqa: F401,E402  (loads the library; registers torch.ops.moe_core.*)
from moe_core import ops  # noqa: E402
from moe_core import tuning  # noqa: E402
from moe_core.config import MoEConfig  # noqa: E402
from moe_core.layer import (  # noqa: E402
    MoELayer,
    finalize_step,
    load_megatron_state_dict,
    megatron_state_dict,
    moe_layers,
    reset_global_aux_loss,
    update_expert_bias,
)
from moe_core.replay import RouterReplay, RouterReplayAction  # noqa: E402

__all__ = ["ops", "has_cuda", "layer_runs_on_cuda", "MoEConfig", "MoELayer", "load_megatron_state_dict",
           "megatron_state_dict",
           "update_expert_bias", "reset_global_aux_loss", "finalize_step", "moe_layers", "tuning",
           "RouterReplay", "RouterReplayAction"]
__version__ = "0.1.0"


def has_cuda() -> bool:
    """True when this build has CUDA kernels registered (at least the router's)."""
    return torch._C._dispatch_has_kernel_for_dispatch_key("moe_core::router_topk", "CUDA")


# The C++ ops a training step of MoELayer can call, forward and backward, over its paths (the
# fused and unfused experts, rows made or read by index, every router and balancing option);
# tests/layer/test_features.py records a step of each path and holds the list to it.
LAYER_OPS = ("router_gating_linear", "router_gating_linear_bwd", "router_topk_fused",
             "router_topk_dense_bwd", "router_lse_bwd", "aux_loss_scores_bwd",
             "switch_aux_loss", "switch_aux_loss_bwd", "tokens_per_expert", "token_dropping",
             "token_dropping_bwd", "permute", "permute_bwd", "permute_layout",
             "permute_layout_bwd", "unpermute", "unpermute_bwd", "permute_bwd_accumulate_",
             "grouped_gemm", "grouped_gemm_dgrad", "grouped_gemm_wgrad", "glu_probs",
             "glu_probs_bwd", "glu_probs_bwd_", "grouped_gemm_glu_probs")


def layer_runs_on_cuda() -> bool:
    """True when a GPU is present and every op of MoELayer's training step has a CUDA kernel in
    this build (a CPU-only build registers none)."""
    return torch.cuda.is_available() and all(
        torch._C._dispatch_has_kernel_for_dispatch_key(f"moe_core::{op}", "CUDA") for op in LAYER_OPS)
