"""router_topk: score function → (group-limited) top-k → probs, Megatron's routing in one op.

Precision contract
------------------
* Score math in fp32 for fp32/fp16/bf16 logits, exactly where Megatron materialises fp32 tensors
  (each intermediate is the correctly rounded fp32 result of the same operation); probs are
  returned in the logits' dtype. For fp64 logits the math stays in fp64 (Megatron downcasts to
  fp32 there: a deliberate, documented difference, so fp64 gradcheck is meaningful).
* CPU and CUDA agree bit for bit for fp32/fp16/bf16 logits (both round each fp64 intermediate to
  fp32 at the same points). For fp64 logits they agree in routing map and indices, and in probs,
  aux scores and gradients within 2E + 4 ulps (CUDA's exp/log1p differ from glibc's in the last
  bit, and the CUDA row sums are warp trees): tests/router/test_fused_losses.py derives the bound.
* Renormalisation (sigmoid/sqrtsoftplus with topk > 1, and softmax over the picked logits): the
  sum of the k picked fp32 scores is accumulated in fp64 in rank order and rounded to fp32 once,
  so it is within 0.5 + (k - 1)·2^-29 fp32 ulps of their exact sum (under 1 ulp for every k below
  2^28; a left-to-right fp32 sum drifts by up to ~k/2 ulps). Each renormalised prob, in fp32
  before the scaling factor and the cast to the logits' dtype, is then within 2 ulps of the exact
  quotient of those scores, whatever k. fp64 logits: the same loop, all in fp64. The loop is one
  sequential definition run by the CPU and CUDA kernels alike, so they stay bitwise equal.
* Selection ranks by descending score (sigmoid/sqrtsoftplus: score + expert_bias, in fp32); equal
  scores go to the lowest expert index, equal group scores to the lowest group index, on CPU and
  CUDA alike (one shared C definition). torch.topk leaves ties unspecified.
* NaN ranks above every number (as in torch.topk): a row with a NaN logit selects that expert
  and gets NaN probs; other rows are unaffected. A -inf logit is never selected while finite
  alternatives remain; with softmax, a +inf logit gives NaN probs (inf - inf), as in torch.
* Outputs are sorted best first whether or not grad is enabled (Megatron leaves the order
  unspecified under no_grad; the set is the same).
* Backward: the exact derivative of the probs w.r.t. the logits through the score function, the
  renormalisation and the scaling factor; the selection is piecewise constant. Deterministic.

Rules beyond Megatron's (Hugging Face families), as keyword arguments of every router op
----------------------------------------------------------------------------------------
* ``normalize``: None is Megatron's rule (sigmoid / sqrtsoftplus renormalised when topk > 1,
  softmax-pre not). False keeps the picked scores as they are (DeepSeek-V3 with
  ``norm_topk_prob=False``); True divides them by ``sum + 1e-20`` for every topk, with
  sigmoid / sqrtsoftplus or softmax-pre (Qwen-MoE / Ernie-4.5: softmax, top-k, renormalise).
  Softmax-post (a softmax over the k picked logits) takes only None.
* ``group_score_topk``: a group's score is the sum of its top ``group_score_topk`` selection
  scores (1: its max, DeepSeek-V2's ``group_limited_greedy``; 2: DeepSeek-V3 / GLM-4.5 in HF,
  whatever topk is); None is Megatron's ``topk // group_topk``.
* ``expert_bias`` with softmax-pre: added to the softmax probs for the selection only; the probs
  are the unbiased softmax values (Ernie-4.5's ``e_score_correction_bias``).
``normalize`` and ``group_score_topk`` are named arguments of the ops' schemas as well
(``bool? normalize=None, int group_score_topk=0``); the binding maps them to the C params.
"""
from typing import Optional, Tuple

import torch

from moe_core.ops._guards import int64_checked, register_autograd, register_fake
from moe_core.ops._padding_mask import flat_padding_mask
from moe_core.ops.names import SCORE_FUNCTIONS


_OP = int64_checked(torch.ops.moe_core.router_topk)
_BWD = int64_checked(torch.ops.moe_core.router_topk_bwd)
_DENSE = int64_checked(torch.ops.moe_core.router_topk_dense)
_DENSE_BWD = int64_checked(torch.ops.moe_core.router_topk_dense_bwd)
_FUSED = int64_checked(torch.ops.moe_core.router_topk_fused)
_LSE_BWD = int64_checked(torch.ops.moe_core.router_lse_bwd)
_AUX_BWD = int64_checked(torch.ops.moe_core.aux_loss_scores_bwd)


def _rules(normalize: Optional[bool], group_score_topk: Optional[int]) -> dict:
    """The rules beyond Megatron's as the ops' named arguments: ``normalize`` None / False / True
    as it is, ``group_score_topk`` None as 0 (the schema's "``topk // group_topk``").

    Raises:
        ValueError: ``normalize`` not None / bool, or ``group_score_topk`` not None or an int
            >= 0 (0 means None).
    """
    if normalize is not None and not isinstance(normalize, bool):
        raise ValueError(f"normalize must be None, True or False, got {normalize!r}")
    n = group_score_topk
    if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 0):
        raise ValueError(f"group_score_topk must be None or an int >= 1, got {n!r}")
    return dict(normalize=normalize, group_score_topk=int(n or 0))


def _options(topk: int, use_pre_softmax: bool, num_groups: Optional[int],
             group_topk: Optional[int], scaling_factor: Optional[float],
             score_function: str) -> Tuple[int, bool, int, int, float, str]:
    """The routing options as the ops' schema takes them (Megatron's None / 0 conventions
    normalised), after the checks that need Python types."""
    if score_function not in SCORE_FUNCTIONS:
        raise ValueError(f"score_function must be one of {SCORE_FUNCTIONS}, got {score_function!r}")
    if not isinstance(topk, int) or isinstance(topk, bool):
        raise TypeError(f"topk must be an int, got {topk!r}")
    grouped = bool(group_topk)
    return (topk, bool(use_pre_softmax), int(num_groups or 0) if grouped else 0,
            int(group_topk) if grouped else 0, float(scaling_factor or 0.0), score_function)


def router_topk(
    logits: torch.Tensor,
    topk: int,
    use_pre_softmax: bool = False,
    num_groups: Optional[int] = None,
    group_topk: Optional[int] = None,
    scaling_factor: Optional[float] = None,
    score_function: str = "softmax",
    expert_bias: Optional[torch.Tensor] = None,
    normalize: Optional[bool] = None,
    group_score_topk: Optional[int] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Compact routing: the top-k experts of each token and their probs.

    Args:
        logits: ``[num_tokens, num_experts]``, float dtype (the router dtype).
        topk: experts per token, ``1 <= topk <= num_experts``.
        use_pre_softmax: softmax only: softmax over all experts before the top-k, no renormalising.
        num_groups: expert groups for group-limited routing (used when ``group_topk`` is set).
        group_topk: groups kept per token; None or 0 disables group-limited routing.
        scaling_factor: multiplies the probs; None or 0 means off (Megatron's truthiness test).
        score_function: one of :data:`~moe_core.ops.names.SCORE_FUNCTIONS`.
        expert_bias: ``[num_experts]`` fp32, added to the scores for selection only
            (sigmoid/sqrtsoftplus, or softmax with ``use_pre_softmax``).
        normalize: None (Megatron's rule), False (the picked scores as they are) or True
            (renormalised for every topk); see the module docstring.
        group_score_topk: experts summed for a group's score (1: the group's max); None:
            ``topk // group_topk``.

    Returns:
        ``(probs [num_tokens, topk] in logits.dtype, indices [num_tokens, topk] int64)``, best first.
    """
    opts = _options(topk, use_pre_softmax, num_groups, group_topk, scaling_factor, score_function)
    return _OP(logits, *opts, expert_bias, **_rules(normalize, group_score_topk))


def topk_routing_with_score_function(
    logits: torch.Tensor,
    topk: int,
    use_pre_softmax: bool = False,
    num_groups: Optional[int] = None,
    group_topk: Optional[int] = None,
    scaling_factor: Optional[float] = None,
    score_function: str = "softmax",
    expert_bias: Optional[torch.Tensor] = None,
    fused: bool = False,
    dense_output: bool = False,
    normalize: Optional[bool] = None,
    group_score_topk: Optional[int] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Megatron's ``topk_routing_with_score_function`` (same arguments, same results).

    Args: as :func:`router_topk`; ``fused`` is accepted for signature compatibility and ignored
        (this op is always the fused kernel); ``normalize`` and ``group_score_topk`` are
        moe-core's (Megatron has neither).

    Returns:
        ``dense_output=False`` (Megatron's default): ``(routing_probs [num_tokens, num_experts] in
        logits.dtype, routing_map [num_tokens, num_experts] bool)``.
        ``dense_output=True``: ``(probs [num_tokens, topk], indices [num_tokens, topk] int64)``.
    """
    del fused
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2:
        shape = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
        raise ValueError(f"logits must be 2-D [num_tokens, num_experts], got {shape}")
    if dense_output:
        return router_topk(
            logits, topk, use_pre_softmax, num_groups, group_topk, scaling_factor, score_function,
            expert_bias, normalize, group_score_topk,
        )
    probs, routing_map, _indices = router_topk_dense(
        logits, topk, use_pre_softmax, num_groups, group_topk, scaling_factor, score_function,
        expert_bias, normalize, group_score_topk,
    )
    return probs, routing_map


def router_topk_dense(
    logits: torch.Tensor,
    topk: int,
    use_pre_softmax: bool = False,
    num_groups: Optional[int] = None,
    group_topk: Optional[int] = None,
    scaling_factor: Optional[float] = None,
    score_function: str = "softmax",
    expert_bias: Optional[torch.Tensor] = None,
    normalize: Optional[bool] = None,
    group_score_topk: Optional[int] = None,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The fused router in Megatron's dense layout: one kernel from logits to the outputs.

    Same routing, probs and gradients as :func:`router_topk` followed by ``topk_to_dense``, but
    the [T, E] probs and map are written by the routing kernel itself (every element, zeros off
    the top-k), and the backward reads the dense gradient at the picked experts only.

    Args: as :func:`router_topk`.

    Returns:
        ``(probs [num_tokens, num_experts] in logits.dtype, routing_map [num_tokens, num_experts]
        bool, indices [num_tokens, topk] int64 best first)``; only ``probs`` is differentiable.
    """
    opts = _options(topk, use_pre_softmax, num_groups, group_topk, scaling_factor, score_function)
    return _DENSE(logits, *opts, expert_bias, **_rules(normalize, group_score_topk))


def router_topk_fused(
    logits: torch.Tensor,
    topk: int,
    use_pre_softmax: bool = False,
    num_groups: Optional[int] = None,
    group_topk: Optional[int] = None,
    scaling_factor: Optional[float] = None,
    score_function: str = "softmax",
    expert_bias: Optional[torch.Tensor] = None,
    padding_mask: Optional[torch.Tensor] = None,
    with_aux: bool = False,
    with_lse: bool = False,
    normalize: Optional[bool] = None,
    group_score_topk: Optional[int] = None,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor],
           Optional[torch.Tensor], Optional[torch.Tensor]]:
    """:func:`router_topk_dense` plus what the load-balancing losses need, from the same pass.

    The router reads the logits once; the aux losses' scores and map
    (:func:`compute_routing_scores_for_aux_loss`) and the per-token logsumexp the z-loss squares
    come out of that pass instead of two more over the logits. On the CPU they are bit for bit
    ``compute_routing_scores_for_aux_loss(logits, topk, score_function, padding_mask)`` and the
    ``lse`` of ``z_loss_func``; on CUDA the row sums are warp reductions, equal up to the last bit
    of fp64 before rounding (see ``moe_router_topk_extras_t`` in csrc/moe_router.h). The fp32 / bf16
    / fp16 warp kernel (up to 1024 experts) computes them from registers; fp64 and wider rows
    run a second kernel over the logits for them.

    Args: as :func:`router_topk`, and
        padding_mask: bool, ``num_tokens`` elements, True = padding (extras only: the routing
            itself ignores it): padded rows get zero aux scores, an empty aux map and lse 0.
        with_aux: return the aux scores and map.
        with_lse: return the logsumexp.
        normalize, group_score_topk: as :func:`router_topk` (the routing only: the aux scores
            are Megatron's whatever they are).

    Returns:
        ``(probs [T, E] logits.dtype, routing_map [T, E] bool, indices [T, topk] int64,
        aux_scores [T, E] fp32 (fp64 for fp64 logits) or None, aux_map [T, E] bool or None,
        lse [T] fp64 or None)``. probs, aux_scores and lse are differentiable; their gradients
        are summed into one gradient of the logits (dense router backward + aux-score backward
        + softmax rows scaled by the lse gradient, in that order, in the logits' dtype).
    """
    opts = _options(topk, use_pre_softmax, num_groups, group_topk, scaling_factor, score_function)
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2:
        shape = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
        raise ValueError(f"logits must be 2-D [num_tokens, num_experts], got {shape}")
    mask = flat_padding_mask(padding_mask, logits.shape[0])
    probs, routing_map, indices, aux_scores, aux_map, lse = _FUSED(
        logits, *opts, expert_bias, mask, bool(with_aux), bool(with_lse),
        **_rules(normalize, group_score_topk))
    return (probs, routing_map, indices, aux_scores if with_aux else None,
            aux_map if with_aux else None, lse if with_lse else None)


def z_loss_from_lse(lse: torch.Tensor, z_loss_coeff: float,
                    padding_mask: Optional[torch.Tensor] = None,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The router z-loss from the fused router's logsumexp, with ``z_loss_func``'s contract.

    ``coeff * sum_t lse_t**2 / n`` in fp64, rounded once to ``dtype``: n is the number of tokens
    without a mask (0 tokens give NaN, as torch.mean of nothing), ``max(n_unpadded, 1)`` with one
    (padded tokens have lse 0). The gradient is ``z_loss_func``'s: autograd gives
    ``grad_lse = 2 * (g * coeff / n) * lse``, the same fp64 value as z_loss.c's
    ``(g * coeff * 2 / n) * lse`` (scaling by 2 is exact).
    The sum over tokens is torch's fp64 sum, not z_loss.c's ascending loop: the two agree to the
    last bit or two of fp64, which rounding to fp32 hides; fp64 losses may differ there.

    Args:
        lse: ``[num_tokens]`` fp64 (from :func:`router_topk_fused` ``with_lse=True``).
        z_loss_coeff: the coefficient.
        padding_mask: bool, ``num_tokens`` elements, True = padding, or None.
        dtype: the loss dtype: fp32, or fp64 for fp64 logits (``z_loss_func``'s).

    Returns:
        A 0-d loss in ``dtype`` with a gradient to ``lse``.
    """
    total = (lse * lse).sum()
    if padding_mask is None:
        # sym_float: float() of a plain count, and stays symbolic for a traced dynamic one
        loss = total / torch.sym_float(lse.shape[0])
    else:
        loss = total / (~padding_mask.reshape(-1)).sum().clamp_min(1).to(torch.float64)
    return (loss * float(z_loss_coeff)).to(dtype)


def group_limited_topk(
    scores: torch.Tensor,
    topk: int,
    num_tokens: int,
    num_experts: int,
    num_groups: int,
    group_topk: int,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Megatron's ``group_limited_topk``: top-k of ``scores`` restricted to the best groups.

    A group's score is the sum of its top ``topk // group_topk`` scores (computed and rounded in
    ``scores.dtype``); the ``group_topk`` best groups are kept.

    Args:
        scores: ``[num_tokens, num_experts]`` float.
        topk, num_tokens, num_experts, num_groups, group_topk: as Megatron's.

    Returns:
        ``(values [num_tokens, topk] in scores.dtype, indices [num_tokens, topk] int64)``, best
        first; values carry gradients to ``scores``.
    """
    if tuple(scores.shape) != (num_tokens, num_experts):
        raise ValueError(
            f"scores must have shape (num_tokens={num_tokens}, num_experts={num_experts}), "
            f"got {tuple(scores.shape)}"
        )
    if not group_topk:
        raise ValueError(f"group_topk must be >= 1, got {group_topk!r}")
    # Post-softmax selection ranks by the raw values: exactly this function's selection rule.
    _, indices = router_topk(scores.detach(), topk, False, num_groups, group_topk)
    return scores.gather(1, indices), indices


def _rules_of(inputs: tuple, at: int) -> Tuple[Optional[bool], int]:
    """``(normalize, group_score_topk)`` from an op's inputs, the first at ``at`` (the dispatcher
    leaves out trailing arguments equal to their schema defaults, None and 0)."""
    return (inputs[at] if len(inputs) > at else None,
            inputs[at + 1] if len(inputs) > at + 1 else 0)


@register_fake("moe_core::router_topk")
def _(logits, topk, use_pre_softmax, num_groups, group_topk, scaling_factor, score_function,
      expert_bias, normalize=None, group_score_topk=0):
    shape = (logits.shape[0], topk)
    return logits.new_empty(shape), logits.new_empty(shape, dtype=torch.long)


@register_fake("moe_core::router_topk_bwd")
def _(grad_probs, logits, topk_indices, topk, use_pre_softmax, num_groups, group_topk,
      scaling_factor, score_function, normalize=None, group_score_topk=0):
    return torch.empty_like(logits)


def _setup_context(ctx, inputs, output):
    logits, topk, pre, num_groups, group_topk, scaling, score_function, _bias = inputs[:8]
    _probs, indices = output
    ctx.options = (topk, pre, num_groups, group_topk, scaling, score_function,
                   *_rules_of(inputs, 8))
    ctx.num_inputs = len(inputs)
    ctx.save_for_backward(logits, indices)


def _backward(ctx, grad_probs, _grad_indices):
    logits, indices = ctx.saved_tensors
    grad_logits = _BWD(grad_probs.contiguous(), logits, indices, *ctx.options)
    return (grad_logits,) + (None,) * (ctx.num_inputs - 1)


register_autograd("moe_core::router_topk", _backward, setup_context=_setup_context)


@register_fake("moe_core::router_topk_dense")
def _(logits, topk, use_pre_softmax, num_groups, group_topk, scaling_factor, score_function,
      expert_bias, normalize=None, group_score_topk=0):
    T, E = logits.shape
    return (logits.new_empty((T, E)), logits.new_empty((T, E), dtype=torch.bool),
            logits.new_empty((T, topk), dtype=torch.long))


@register_fake("moe_core::router_topk_dense_bwd")
def _(grad_probs, logits, topk_indices, topk, use_pre_softmax, num_groups, group_topk,
      scaling_factor, score_function, normalize=None, group_score_topk=0):
    return torch.empty_like(logits)


def _dense_setup_context(ctx, inputs, output):
    logits, topk, pre, num_groups, group_topk, scaling, score_function, _bias = inputs[:8]
    _probs, _map, indices = output
    ctx.options = (topk, pre, num_groups, group_topk, scaling, score_function,
                   *_rules_of(inputs, 8))
    ctx.num_inputs = len(inputs)
    ctx.save_for_backward(logits, indices)


def _dense_backward(ctx, grad_probs, _grad_map, _grad_indices):
    logits, indices = ctx.saved_tensors
    grad_logits = _DENSE_BWD(grad_probs.contiguous(), logits, indices, *ctx.options)
    return (grad_logits,) + (None,) * (ctx.num_inputs - 1)


register_autograd("moe_core::router_topk_dense", _dense_backward,
                  setup_context=_dense_setup_context)


@register_fake("moe_core::router_topk_fused")
def _(logits, topk, use_pre_softmax, num_groups, group_topk, scaling_factor, score_function,
      expert_bias, padding_mask, with_aux, with_lse, normalize=None, group_score_topk=0):
    T, E = logits.shape
    st = torch.float64 if logits.dtype == torch.float64 else torch.float32
    ta = T if with_aux else 0
    return (logits.new_empty((T, E)), logits.new_empty((T, E), dtype=torch.bool),
            logits.new_empty((T, topk), dtype=torch.long), logits.new_empty((ta, E), dtype=st),
            logits.new_empty((ta, E), dtype=torch.bool),
            logits.new_empty((T if with_lse else 0,), dtype=torch.float64))


@register_fake("moe_core::router_lse_bwd")
def _(grad_lse, logits, lse, padding_mask):
    return torch.empty_like(logits)


def _fused_setup_context(ctx, inputs, output):
    (logits, topk, pre, num_groups, group_topk, scaling, score_function, _bias, padding_mask,
     with_aux, with_lse) = inputs[:11]
    _probs, _map, indices, _aux, _aux_map, lse = output
    ctx.options = (topk, pre, num_groups, group_topk, scaling, score_function,
                   *_rules_of(inputs, 11))
    ctx.num_inputs = len(inputs)
    ctx.with_aux, ctx.with_lse = with_aux, with_lse
    ctx.save_for_backward(logits, indices, lse, padding_mask)


def _fused_backward(ctx, grad_probs, _grad_map, _grad_indices, grad_aux, _grad_aux_map, grad_lse):
    # The same pieces, summed in the same order, as autograd does for the unfused router
    # ((router + aux scores) + z-loss, each in the logits' dtype), so the gradients match it.
    logits, indices, lse, padding_mask = ctx.saved_tensors
    grad = None
    if grad_probs is not None:
        grad = _DENSE_BWD(grad_probs.contiguous(), logits, indices, *ctx.options)
    if ctx.with_aux and grad_aux is not None:
        g = _AUX_BWD(grad_aux.contiguous(), logits, ctx.options[5], padding_mask)
        grad = g if grad is None else grad + g
    if ctx.with_lse and grad_lse is not None:
        g = _LSE_BWD(grad_lse.contiguous(), logits, lse, padding_mask)
        grad = g if grad is None else grad + g
    return (grad,) + (None,) * (ctx.num_inputs - 1)


register_autograd("moe_core::router_topk_fused", _fused_backward,
                  setup_context=_fused_setup_context)
