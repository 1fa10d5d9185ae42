"""moe_core.ops: the functional API.

Names and argument order follow ``megatron.core.transformer.moe.moe_utils`` wherever Megatron has
the function, so a Megatron user can switch imports. Every op is a ``torch.ops.moe_core`` custom
op with a fake (meta) kernel and a registered autograd formula, so it traces under
``torch.compile(fullgraph=True)`` and passes ``torch.library.opcheck``.
"""
from moe_core.ops.router_gating_linear import router_gating_linear
from moe_core.ops.router_topk import group_limited_topk, router_topk, topk_routing_with_score_function
from moe_core.ops.topk_to_dense import topk_to_dense
from moe_core.ops.grouped_gemm import grouped_gemm, grouped_gemm_dgrad, grouped_gemm_wgrad

__all__ = [
    "router_gating_linear",
    "router_topk",
    "topk_routing_with_score_function",
    "group_limited_topk",
    "topk_to_dense",
    "grouped_gemm",
    "grouped_gemm_dgrad",
    "grouped_gemm_wgrad",
]
