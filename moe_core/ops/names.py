"""The named options of the ops, in one place for the whole package.

``SCORE_FUNCTIONS`` are the router's score functions (``router_topk*``, ``aux_loss_scores``, the
layer's ``moe_router_score_function``); ``ACTIVATIONS`` the expert activations of ``glu_probs``
and ``grouped_gemm_glu_probs``. Each tuple repeats, in order, the names of the C core's option
table (``MOE_SCORE_FUNCTIONS`` in csrc/moe_types.h, ``MOE_ACTIVATIONS`` in csrc/moe_experts.h),
from which the C enum, the core's check and the binding's name lookup are made;
tests/hardening/test_names.py holds the two lists equal.
"""
from typing import Tuple

SCORE_FUNCTIONS: Tuple[str, ...] = ("softmax", "sigmoid", "sqrtsoftplus")
ACTIVATIONS: Tuple[str, ...] = ("silu", "gelu", "gelu_tanh", "relu", "squared_relu", "quick_gelu")

__all__ = ["SCORE_FUNCTIONS", "ACTIVATIONS"]
