"""moe_core.ops: the functional API.

Names and argument order follow ``megatron.core.transformer.moe.moe_utils`` wherever Megatron has
the function, so a Megatron user can switch imports. Every op is a ``torch.ops.moe_core`` custom
op with a fake (meta) kernel and a registered autograd formula, so it traces under
``torch.compile(fullgraph=True)`` and passes ``torch.library.opcheck``. Every op refuses tensors on
different devices (a meta tensor among real ones included) with a ValueError, and a backward with
``create_graph=True`` whose result would carry a graph raises a RuntimeError: the backward kernels
have no derivatives of their own (``moe_core.ops._guards``).
"""
from moe_core.ops.names import ACTIVATIONS, SCORE_FUNCTIONS
from moe_core.ops.router_gating_linear import router_gating_linear
from moe_core.ops.router_topk import (
    group_limited_topk,
    router_topk,
    router_topk_dense,
    topk_routing_with_score_function,
)
from moe_core.ops.topk_to_dense import topk_to_dense
from moe_core.ops.token_dropping import apply_router_token_dropping, get_capacity
from moe_core.ops.permute import permute, permute_layout
from moe_core.ops.permute_bwd_accumulate import (
    permute_bwd_accumulate_,
    permute_bwd_accumulator,
)
from moe_core.ops.unpermute import unpermute
from moe_core.ops.routing_layout import (
    RoutingLayout,
    combine,
    permute_tokens,
    routing_layout,
)
from moe_core.ops.sort_chunks_by_idxs import sort_chunks_by_idxs
# load balancing
from moe_core.ops.aux_loss_autoscaler import AuxLossScale, MoEAuxLossAutoScaler
from moe_core.ops.aux_loss_scores import compute_routing_scores_for_aux_loss
from moe_core.ops.expert_bias import accumulate_tokens_per_expert, get_updated_expert_bias
from moe_core.ops.global_aux_loss import GlobalAuxLossBuffer, global_load_balancing_loss
from moe_core.ops.routing_metrics import RoutingMetrics, routing_metrics, topk_overlap
from moe_core.ops.sinkhorn import sinkhorn, sinkhorn_load_balancing, sinkhorn_routing
from moe_core.ops.switch_aux_loss import (
    get_tokens_per_expert_and_token_count,
    load_balancing_loss,
    seq_load_balancing_loss,
    switch_load_balancing_loss_func,
)
from moe_core.ops.tokens_per_expert import tokens_per_expert
from moe_core.ops.z_loss import z_loss_func
from moe_core.ops.grouped_gemm import grouped_gemm, grouped_gemm_dgrad, grouped_gemm_wgrad
# the experts: activation x probs, fc1 fused with it, the whole MLP
from moe_core.ops.glu_probs import activation_name, glu_probs
from moe_core.ops.grouped_gemm_glu_probs import grouped_gemm_glu_probs
from moe_core.ops.expert_mlp import expert_mlp
from moe_core.ops._guards import register_no_derivative

# The backward kernels (the functional ones; glu_probs_bwd_ writes its inputs in place): their
# outputs are gradients, which have no derivative here.
BACKWARD_KERNELS = (
    "aux_loss_scores_bwd", "glu_probs_bwd", "grouped_gemm_dgrad", "grouped_gemm_wgrad",
    "permute_bwd", "permute_layout_bwd", "router_gating_linear_bwd", "router_lse_bwd",
    "router_topk_bwd", "router_topk_dense_bwd", "sinkhorn_routing_bwd", "sort_chunks_by_idxs_bwd",
    "switch_aux_loss_bwd", "token_dropping_bwd", "topk_to_dense_bwd", "unpermute_bwd",
    "z_loss_bwd")
for _name in BACKWARD_KERNELS:
    register_no_derivative(f"moe_core::{_name}")
del _name

__all__ = [
    "SCORE_FUNCTIONS",
    "ACTIVATIONS",
    "router_gating_linear",
    "router_topk",
    "router_topk_dense",
    "topk_routing_with_score_function",
    "group_limited_topk",
    "topk_to_dense",
    "get_capacity",
    "apply_router_token_dropping",
    "permute",
    "permute_layout",
    "permute_bwd_accumulate_",
    "permute_bwd_accumulator",
    "unpermute",
    "RoutingLayout",
    "routing_layout",
    "permute_tokens",
    "combine",
    "sort_chunks_by_idxs",
    # load balancing
    "compute_routing_scores_for_aux_loss",
    "switch_load_balancing_loss_func",
    "get_tokens_per_expert_and_token_count",
    "load_balancing_loss",
    "seq_load_balancing_loss",
    "global_load_balancing_loss",
    "GlobalAuxLossBuffer",
    "z_loss_func",
    "MoEAuxLossAutoScaler",
    "AuxLossScale",
    "tokens_per_expert",
    "accumulate_tokens_per_expert",
    "get_updated_expert_bias",
    "sinkhorn",
    "sinkhorn_load_balancing",
    "sinkhorn_routing",
    "routing_metrics",
    "RoutingMetrics",
    "topk_overlap",
    "grouped_gemm",
    "grouped_gemm_dgrad",
    "grouped_gemm_wgrad",
    "glu_probs",
    "activation_name",
    "grouped_gemm_glu_probs",
    "expert_mlp",
]
