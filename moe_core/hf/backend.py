"""The ``"moe_core"`` experts implementation for Hugging Face transformers.

transformers routes every experts module decorated with ``@use_experts_implementation`` through
``ExpertsInterface``: the module's forward becomes ``fn(module, hidden_states, top_k_index,
top_k_weights)``, chosen by ``config._experts_implementation``. :func:`moe_core_experts_forward`
is such a function. HF's router still picks the experts; the experts themselves run on moe-core's
ops, on the module's own parameters (read through the module at every call, so a PEFT
parametrization of ``gate_up_proj`` / ``down_proj`` is seen and its LoRA factors get gradients):

    routing map, dense probs  <- top_k_index / top_k_weights (EP sentinels dropped)
    rows   = permute(hidden, routing map)                   expert-major, no probs
    a      = rows @ W1_e (+ b1_e)                           grouped GEMM, fp32 accumulation
    h      = the module's gated activation of a             glu_probs (known activations) or
                                                            the module's own torch code
    y      = h @ W2_e (+ b2_e)                              grouped GEMM
    out[t] = sum_k y[t, k] * p[t, k]                        unpermute with probs, fp32 sum

The probs are applied after fc2, where HF applies them, and summed over a token's experts in
fp32 and rounded once, as HF's ``grouped_mm`` / ``batched_mm`` implementations do. Without biases,
with the concatenated ``[E, 2F, H]`` layout and an activation ``ops.glu_probs`` knows, fc1, the
activation and fc2 are one op (``ops.expert_mlp``) whose backward keeps only fc1's output.

Module flags honoured (set by ``use_experts_implementation``): ``has_gate`` (``gate_up_proj`` or
``up_proj``), ``has_bias`` (``*_proj_bias``), ``is_transposed`` (``[E, in, out]`` weights),
``is_concatenated`` (gate / up halves, or interleaved gate0, up0, gate1, ...: glu_probs reads the
fc1 output's columns where they are, ``glu_interleave_size=1``), ``has_post_expert_norm``, and ``_is_expert_parallel``: an
index outside ``[0, num_experts)`` (HF's sentinel ``>= num_experts``, or a negative one) is an
expert of another rank; such a slot contributes nothing and gets no gradient.

Under ``torch.autocast`` the GEMMs run in the autocast dtype, as HF eager's ``linear`` /
``matmul`` do there: the tokens and the weights are cast before the ops (autocast never casts a
custom op's inputs), the biases are added as they are, and the output keeps ``hidden_states``'
dtype (HF eager sums into a tensor of that dtype).

Activations: HF's SiLU, GELU (erf), GELU-tanh, ReLU, quick-GELU and squared ReLU map onto
``ops.glu_probs``; GPT-OSS's clamped SwiGLU (``gate.clamp(max=l) * sigmoid(alpha * gate)`` times
``up.clamp(-l, l) + 1``) is ``glu_probs``' ``quick_gelu`` with clamp ``l`` and offset 1 when
``alpha == 1.702`` (its released value). Anything else runs the module's own torch code
(``_apply_gate`` / ``act_fn``) on the expert-sorted rows, between the same grouped GEMMs.
"""
from typing import Optional, Tuple

import torch
from torch import nn

from moe_core import ops
from moe_core.experts import autocast_dtype, autocast_to

BACKEND_NAME = "moe_core"

# glu_probs' quick_gelu is x * sigmoid(1.702 x); GPT-OSS's gate is x * sigmoid(alpha x)
_QUICK_GELU_ALPHA = 1.702


def activation_of(act: nn.Module) -> Optional[str]:
    """The ``ops.glu_probs`` name of an HF activation module (``ACT2FN[...]``), or None.

    Matched by type and, for the GELU variants, by the function they call, so that only
    activations whose rounding ``glu_probs`` reproduces are mapped."""
    import functools

    import torch.nn.functional as F
    from transformers import activations as A

    if isinstance(act, (A.SiLUActivation, nn.SiLU)):
        return "silu"
    if isinstance(act, nn.ReLU):
        return "relu"
    if isinstance(act, nn.GELU):
        return "gelu" if act.approximate == "none" else "gelu_tanh"
    if isinstance(act, A.GELUActivation) and getattr(act, "act", None) is F.gelu:
        return "gelu"
    if isinstance(act, A.GELUTanh):
        fn = getattr(act, "act", None)
        if isinstance(fn, functools.partial) and fn.func is F.gelu and \
                fn.keywords.get("approximate") == "tanh":
            return "gelu_tanh"
        return None
    if isinstance(act, A.QuickGELUActivation):
        return "quick_gelu"
    if isinstance(act, A.ReLUSquaredActivation):
        return "squared_relu"
    return None


def gate_spec(module: nn.Module) -> Optional[Tuple[str, bool, float, Optional[float]]]:
    """``(activation, gated_linear_unit, linear_offset, clamp_value)`` for ``ops.glu_probs`` when
    the module's activation (gate included) is one the op computes, else None."""
    has_gate = getattr(module, "has_gate", True)
    custom_gate = has_gate and "_apply_gate" in type(module).__dict__
    if custom_gate:
        alpha, limit = getattr(module, "alpha", None), getattr(module, "limit", None)
        if type(module).__name__ == "GptOssExperts" and alpha == _QUICK_GELU_ALPHA and \
                limit is not None:
            return "quick_gelu", True, 1.0, float(limit)
        return None
    act = getattr(module, "act_fn", None)
    name = activation_of(act) if isinstance(act, nn.Module) else None
    if name is None:
        return None
    return name, bool(has_gate), 0.0, None


def routing_tensors(top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                    num_experts: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """HF's top-k routing as moe-core's dense form.

    Args:
        top_k_index: ``[T, k]`` int64 expert ids; ids outside ``[0, num_experts)`` mark a slot
            routed to another expert-parallel rank.
        top_k_weights: ``[T, k]`` float routing weights.
        num_experts: the module's (local) expert count E.

    Returns:
        ``(routing_map [T, E] bool, probs [T, E] top_k_weights.dtype)``; an expert named in
        several of a token's slots gets the sum of their weights. The probs are differentiable
        in ``top_k_weights`` (a sentinel slot's weight gets a zero gradient).
    """
    T = top_k_index.shape[0]
    valid = (top_k_index >= 0) & (top_k_index < num_experts)
    # sentinels go to an extra column E that is cut off: duplicate writes there are harmless
    idx = torch.where(valid, top_k_index, torch.full_like(top_k_index, num_experts))
    routing_map = torch.zeros(T, num_experts + 1, dtype=torch.bool, device=idx.device)
    routing_map.scatter_(1, idx, True)
    # a token whose top-k names an expert twice gets the sum of both weights on it (HF's eager
    # loop runs that expert once per slot and adds both weighted outputs), not the last one
    probs = top_k_weights.new_zeros(T, num_experts + 1).scatter_add(1, idx, top_k_weights)
    return routing_map[:, :num_experts].contiguous(), probs[:, :num_experts].contiguous()


def _row_bias(bias: torch.Tensor, expert_offsets: torch.Tensor, rows: int) -> torch.Tensor:
    """``bias[expert of each row]``: ``[rows, N]`` from ``bias [E, N]`` (rows past the used count
    take the last expert's bias; they belong to no token and are dropped by the combine)."""
    ids = torch.searchsorted(expert_offsets[1:], torch.arange(rows, device=bias.device),
                             right=True).clamp_max(bias.shape[0] - 1)
    return bias[ids]


def moe_core_experts_forward(module: nn.Module, hidden_states: torch.Tensor,
                             top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
    """An HF experts module's forward on moe-core's ops (registered as ``"moe_core"``).

    Args:
        module: the HF experts module (``num_experts``, ``gate_up_proj`` or ``up_proj``,
            ``down_proj``, optional ``*_bias``, ``act_fn`` / ``_apply_gate``, and the flags set by
            ``use_experts_implementation``).
        hidden_states: ``[T, H]`` tokens (the model's dtype).
        top_k_index: ``[T, k]`` int64 experts chosen by HF's router.
        top_k_weights: ``[T, k]`` routing weights (fp32 or the model's dtype).

    Returns:
        ``[T, H]`` in ``hidden_states.dtype``.
    """
    E = module.num_experts
    has_gate = getattr(module, "has_gate", True)
    has_bias = getattr(module, "has_bias", False)
    transposed = getattr(module, "is_transposed", False)
    concatenated = getattr(module, "is_concatenated", True)
    w1 = module.gate_up_proj if has_gate else module.up_proj
    w2 = module.down_proj
    b1 = b2 = None
    if has_bias:
        b1 = module.gate_up_proj_bias if has_gate else module.up_proj_bias
        b2 = module.down_proj_bias
    T, H = hidden_states.shape
    k = top_k_index.shape[-1]
    routing_map, probs = routing_tensors(top_k_index.reshape(T, k).long(),
                                         top_k_weights.reshape(T, k), E)
    dtype = autocast_dtype(hidden_states)
    if dtype is not None:
        # under torch.autocast the GEMMs run in its dtype, as HF eager's linear / matmul do: the
        # weights and the GEMMs' inputs cast, the gradient back to the parameters' dtype; the
        # biases are added as they are (GPT-OSS's eager adds its fp32 biases after the matmul)
        w1, w2 = autocast_to(w1, dtype), autocast_to(w2, dtype)
        x = autocast_to(hidden_states, dtype)
    else:
        # else in the weights' dtype
        x = hidden_states if hidden_states.dtype == w1.dtype else hidden_states.to(w1.dtype)
    x = x.contiguous()
    w1, w2 = w1.contiguous(), w2.contiguous()  # no-ops for HF's (and PEFT's W + BA) weights
    # the probs stay out of the layout: HF applies them after fc2, in the combine below
    rows, layout = ops.permute_tokens(x, routing_map, None, T * k)
    offsets = layout.expert_offsets
    spec = gate_spec(module)
    post_norm = getattr(module, "has_post_expert_norm", False)

    if spec is not None and b1 is None and not transposed and (concatenated or not has_gate):
        # fc1, activation, fc2 in one op; its backward gathers the rows again from x
        y = ops.expert_mlp(rows, w1, w2, offsets, None, *spec, tokens=x,
                           sorted_indices=layout.sorted_indices)
    else:
        # transposed HF weights are [E, in, out]: grouped_gemm's trans_w=False layout
        a = ops.grouped_gemm(rows, w1, offsets, trans_w=not transposed)
        if b1 is not None:
            a = a + _row_bias(b1, offsets, a.shape[0])
        if spec is not None:
            # interleaved gate / up columns (gate0, up0, gate1, ...) are read where they are
            h = ops.glu_probs(a, None, *spec,
                              glu_interleave_size=1 if has_gate and not concatenated else 0)
        elif has_gate:
            h = module._apply_gate(a)
        else:
            h = module.act_fn(a)
        y = ops.grouped_gemm(h.to(w2.dtype), w2, offsets, trans_w=not transposed)
        if b2 is not None:
            y = y + _row_bias(b2, offsets, y.shape[0])
    if post_norm:
        y = module.post_expert_norm(y)
    # the backend owns the combine: the probs after fc2, products rounded to promote(y, probs),
    # summed in fp32 (HF's order)
    out = ops.combine(y, layout, probs)
    return out.to(hidden_states.dtype)


def register_experts_backend(name: str = BACKEND_NAME) -> str:
    """Register :func:`moe_core_experts_forward` with transformers' ``ExpertsInterface``.

    Afterwards ``from_pretrained(..., experts_implementation="moe_core")`` or
    ``model.set_experts_implementation("moe_core")`` selects it. Idempotent.

    Returns:
        The registered name.
    """
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(name, moe_core_experts_forward)
    return name
