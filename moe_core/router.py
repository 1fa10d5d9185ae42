"""TopKRouter: Megatron's router as a module that holds parameters and composes moe_core.ops.

forward(hidden [S, B, H] or [T, H], padding_mask) -> (probs [T, E], routing_map [T, E] bool):
input jitter -> gating linear (router dtype) -> top-k routing (or Sinkhorn, or the replayed
choice of ``router_replay``: moe_core.replay) -> capacity dropping
-> z-loss and aux losses attached to the probs -> expert-bias counting. The same formulas and
switches as Megatron's TopKRouter (docs/design.md), at a world size of 1 (tensor, context
and data parallel groups of one), plus the routing rules of moe_core.config's fields Megatron
lacks (``moe_router_norm_topk_prob``, ``moe_router_group_score_topk``, a softmax-pre expert
bias, the layer-wide input jitter of ``moe_input_jitter_mode="layer"``). One fused op reads the
logits once for the routing, the aux-loss scores and the z-loss's logsumexp (Megatron makes three
passes; Sinkhorn routing keeps them separate); the losses and gradients are the separate ops'
(tests/router/test_fused_losses.py).

Aux-loss gradients reach the parameters through MoEAuxLossAutoScaler (no extra backward). The
scale they are multiplied by is ``self.aux_loss_scale`` when set (an AuxLossScale holder, e.g.
1 / num_microbatches), else the innermost ``with AuxLossScale(...)`` block, else 1.0: never a
process-wide class attribute. The last values of the losses are kept, detached, in
``self.last_losses`` (divided by their coefficients, as Megatron logs them), and each expert's
share of the routed tokens in ``self.last_routing_load``, with no host sync.

State: everything a run needs to resume exactly is in ``state_dict()``: the weights, the expert
bias and its running token counts, the global aux loss's running counts (``global_aux_buffer.*``)
and, when a holder is bound, the value of ``aux_loss_scale``. Megatron saves neither running
count (non-persistent buffers), so a state dict without them loads and keeps the current counts.
Logging state (``last_losses``, ``last_routing_load``) is not saved.
"""
from typing import Dict, Optional, Tuple

import torch
from torch import nn

from moe_core import ops
from moe_core.config import MoEConfig
from moe_core.ops.aux_loss_autoscaler import AuxLossScale, MoEAuxLossAutoScaler
from moe_core.ops.global_aux_loss import apply_keeping_fp32_buffers
from moe_core.ops.router_topk import router_topk_fused, z_loss_from_lse
from moe_core.groups import default_data_parallel_group, group_size
from moe_core.replay import RouterReplay, RouterReplayAction, routing_at_indices


class TopKRouter(nn.Module):
    """Parameters (Megatron's names, ``config.params_dtype``): weight ``[E, H]``, bias ``[E]``
    when ``add_bias_linear``. Buffers, all persistent and kept fp32 when the model is cast:
    expert_bias ``[E]`` with ``moe_router_enable_expert_bias``;
    global_aux_buffer.tokens_per_expert ``[E]`` and global_aux_buffer.steps ``[]`` with the
    global aux loss. Running state that is not a buffer (each rank's own, so out of DDP's buffer
    broadcast), fp32, saved in the state dict: local_tokens_per_expert ``[E]``, this rank's
    counts since the last bias update, with the expert bias. State-dict key ``aux_loss_scale``
    (0-d fp32): the bound holder's value, present only while one is bound.
    """

    _SCALE_KEY = "aux_loss_scale"

    def __init__(self, config: MoEConfig, tp_cp_group=None, tp_dp_cp_group=None, *,
                 device: Optional[torch.device] = None, dtype: Optional[torch.dtype] = None):
        """tp_cp_group: the aux losses' token counts are summed over it (Megatron's TP x CP
        group; None: this rank alone); tp_dp_cp_group: the global aux loss's and the expert
        bias's counts (TP x DP x CP; None: the data-parallel world, :meth:`data_parallel_group`).
        dtype: the weight's and bias's dtype (default
        ``config.params_dtype``; the buffers are fp32 whatever it is); device: where everything is
        created and initialised."""
        super().__init__()
        self.config = config
        self.tp_cp_group = tp_cp_group
        self.tp_dp_cp_group = tp_dp_cp_group
        # the default group, once resolved (at the first reduction: see data_parallel_group)
        self._default_dp_group = None
        E, H = config.num_moe_experts, config.hidden_size
        self.topk = config.moe_router_topk
        dtype = dtype or config.params_dtype
        self.weight = nn.Parameter(torch.empty(E, H, device=device, dtype=dtype))
        if config.add_bias_linear:
            self.bias = nn.Parameter(torch.empty(E, device=device, dtype=dtype))
        else:
            self.register_parameter("bias", None)
        if config.moe_router_enable_expert_bias:
            self.register_buffer("expert_bias",
                                 torch.zeros(E, device=device, dtype=torch.float32))
            # this rank's own counts, so deliberately not a buffer: DDP (broadcast_buffers, its
            # default) copies rank 0's buffers over every rank's before each forward, which would
            # replace the counts of a step's earlier micro-batches with rank 0's. Saved in the
            # state dict all the same (unlike Megatron's): a checkpoint taken between two bias
            # updates resumes with the counts gathered so far. Moved and kept fp32 by _apply.
            self.local_tokens_per_expert = torch.zeros(E, device=device, dtype=torch.float32)
        else:
            self.expert_bias = None
            self.local_tokens_per_expert = None
        # routing replay (moe_core.replay): a plain attribute, no state of the model's
        self.router_replay = RouterReplay() if config.moe_enable_routing_replay else None
        self.global_aux_buffer = None
        if "global_aux_loss" in config.load_balancing_types:
            self.global_aux_buffer = ops.GlobalAuxLossBuffer(E, device=device)
        self.aux_loss_scale: Optional[AuxLossScale] = None
        self.last_losses: Dict[str, torch.Tensor] = {}
        # the last forward's routing map, which last_routing_load reads
        self._last_routing_map: Optional[torch.Tensor] = None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Megatron's init: weight and bias ~ N(0, init_method_std), drawn in fp32 on the
        weight's device; the expert bias, its token counts and the global aux loss's counts
        zeroed."""
        std = self.config.init_method_std
        with torch.no_grad():
            w = torch.empty(self.weight.shape, device=self.weight.device, dtype=torch.float32)
            nn.init.normal_(w, 0.0, std)
            self.weight.copy_(w)
            if self.bias is not None:
                b = torch.empty(self.bias.shape, device=self.bias.device, dtype=torch.float32)
                nn.init.normal_(b, 0.0, std)
                self.bias.copy_(b)
            if self.expert_bias is not None:
                self.expert_bias.zero_()
                self.local_tokens_per_expert.zero_()
        if self.global_aux_buffer is not None:
            self.global_aux_buffer.reset()

    def extra_repr(self) -> str:
        cfg = self.config
        s = (f"num_experts={cfg.num_moe_experts}, hidden_size={cfg.hidden_size}, "
             f"topk={self.topk}, score_function={cfg.moe_router_score_function}")
        if cfg.moe_router_num_groups:
            s += f", groups={cfg.moe_router_num_groups} (top {cfg.moe_router_group_topk})"
            if cfg.moe_router_group_score_topk:
                s += f", group_score_topk={cfg.moe_router_group_score_topk}"
        if cfg.moe_router_norm_topk_prob is not None:
            s += f", norm_topk_prob={cfg.moe_router_norm_topk_prob}"
        if self.expert_bias is not None:
            s += ", expert_bias"
        if cfg.moe_router_dtype:
            s += f", router_dtype={cfg.moe_router_dtype}"
        return s

    def _apply(self, fn, recurse: bool = True):
        # a model cast to a half dtype keeps the expert bias and its counts fp32 (Megatron
        # re-casts its bias to fp32 for the same reason)
        apply_keeping_fp32_buffers(self, super()._apply, fn, recurse)
        counts = self.local_tokens_per_expert
        if counts is not None:
            moved = fn(counts)
            self.local_tokens_per_expert = (moved if moved.dtype == torch.float32
                                            else counts.to(device=moved.device))
        return self

    # ---- state dict: the expert-bias counts and the bound aux-loss scale --------------------------
    _COUNTS_KEY = "local_tokens_per_expert"

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        counts = self.local_tokens_per_expert
        if counts is not None:
            destination[prefix + self._COUNTS_KEY] = counts if keep_vars else counts.detach()
        if self.aux_loss_scale is not None:
            value = self.aux_loss_scale.value
            destination[prefix + self._SCALE_KEY] = value if keep_vars else value.detach()

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)
        self._load_counts(state_dict, prefix + self._COUNTS_KEY, unexpected_keys, error_msgs)
        key = prefix + self._SCALE_KEY
        if key not in state_dict:
            return  # saved without a bound holder: the current binding stays
        if key in unexpected_keys:
            unexpected_keys.remove(key)
        value = state_dict[key]
        if not isinstance(value, torch.Tensor) or value.numel() != 1:
            got = tuple(value.shape) if isinstance(value, torch.Tensor) else repr(value)
            error_msgs.append(f"{key}: expected a one-element tensor, got {got}")
            return
        if self.aux_loss_scale is None:
            self.aux_loss_scale = AuxLossScale(value, device=self.weight.device)
        else:  # in place, so a holder shared by several routers stays shared
            holder = self.aux_loss_scale
            holder.set(value.detach().to(device=holder.value.device))

    def _load_counts(self, state_dict, key, unexpected_keys, error_msgs) -> None:
        """The expert-bias counts, copied in place; optional (Megatron does not save them: a
        state dict without them keeps the current counts instead of failing a strict load)."""
        counts = self.local_tokens_per_expert
        if key not in state_dict or counts is None:
            return  # without the expert bias, the key is as unexpected as any other (strict)
        if key in unexpected_keys:
            unexpected_keys.remove(key)
        value = state_dict[key]
        if not isinstance(value, torch.Tensor) or value.shape != counts.shape:
            got = tuple(value.shape) if isinstance(value, torch.Tensor) else repr(value)
            error_msgs.append(f"{key}: expected a tensor of shape {tuple(counts.shape)}, "
                              f"got {got}")
            return
        with torch.no_grad():
            counts.copy_(value)

    # ---- pieces -----------------------------------------------------------------------------
    def router_dtype(self, inp: torch.Tensor) -> torch.dtype:
        return self.config.router_dtype or inp.dtype

    def gating(self, inp: torch.Tensor) -> torch.Tensor:
        """Logits ``[..., E]`` in the router dtype."""
        return ops.router_gating_linear(inp, self.weight, self.bias, self.router_dtype(inp))

    def apply_input_jitter(self, inp: torch.Tensor) -> torch.Tensor:
        """Megatron's router-input jitter (``moe_input_jitter_mode="router"``): ``inp`` times
        ``Uniform(1 - eps, 1 + eps).rsample`` in every forward; the input unchanged in "layer"
        mode (the layer jittered it already: :meth:`apply_layer_jitter`)."""
        eps = self.config.moe_input_jitter_eps
        if eps is None or self.config.moe_input_jitter_mode != "router":
            return inp
        # fills, not host-to-device copies (CUDA-graph capture)
        low = torch.full((), 1.0 - eps, dtype=inp.dtype, device=inp.device)
        high = torch.full((), 1.0 + eps, dtype=inp.dtype, device=inp.device)
        return inp * torch.distributions.uniform.Uniform(low, high).rsample(inp.shape)

    def apply_layer_jitter(self, inp: torch.Tensor) -> torch.Tensor:
        """Mixtral's jitter (``moe_input_jitter_mode="layer"``), applied by the layer to its input
        before routing, so the router and the experts see the same jittered tokens: in training
        mode, ``inp`` times ``uniform_(1 - eps, 1 + eps)`` drawn in ``inp``'s dtype and shape
        (HF's draw, same generator use); else the input unchanged.

        Args:
            inp: the layer's input, any shape, float.

        Returns:
            A tensor of ``inp``'s shape and dtype (``inp`` itself when there is no jitter).
        """
        eps = self.config.moe_input_jitter_eps
        if eps is None or self.config.moe_input_jitter_mode != "layer" or not self.training:
            return inp
        return inp * torch.empty_like(inp).uniform_(1.0 - eps, 1.0 + eps)

    def _attach(self, activation: torch.Tensor, loss: torch.Tensor, name: str, coeff: float,
                num_valid: Optional[torch.Tensor]) -> torch.Tensor:
        self.last_losses[name] = (loss / coeff).detach()
        if self.config.calculate_per_token_loss:
            loss = loss * (num_valid if num_valid is not None else activation.shape[0])
        return MoEAuxLossAutoScaler.apply(activation, loss, self.aux_loss_scale)

    # ---- forward ----------------------------------------------------------------------------
    def forward(self, hidden: torch.Tensor,
                padding_mask: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
        """Route the tokens.

        Args:
            hidden: ``[S, B, H]`` or ``[T, H]`` activations.
            padding_mask: bool, True = padding, shaped like hidden's leading dims (``[S, B]`` or
                ``[T]``), or None.

        Returns:
            ``(probs [T, E] in the router dtype, routing_map [T, E] bool)``, T = S·B.
        """
        cfg = self.config
        E, k = cfg.num_moe_experts, self.topk
        seq_length = hidden.shape[0]
        bsz = hidden.shape[1] if hidden.dim() == 3 else 1
        self.last_losses = {}
        logits = self.gating(self.apply_input_jitter(hidden)).reshape(-1, E)
        mask = padding_mask.reshape(-1) if padding_mask is not None else None
        num_valid = (~mask).sum() if mask is not None else None
        train = self.training and torch.is_grad_enabled()

        coeffs = dict(zip(cfg.load_balancing_types, cfg.aux_loss_coeffs))
        aux_types = [t for t in ("aux_loss", "seq_aux_loss", "global_aux_loss") if coeffs.get(t, 0)]
        want_z = cfg.moe_z_loss_coeff is not None and train
        # Megatron divides the z-loss coefficient by the TP x CP size (the loss is summed there)
        z_coeff = (cfg.moe_z_loss_coeff / group_size(self.tp_cp_group)) if want_z else None
        want_aux = train and bool(aux_types)
        sinkhorn = "sinkhorn" in cfg.load_balancing_types
        scores = aux_map = None
        replay = self.router_replay
        replayed = None if replay is None else replay.replay_indices(logits.shape[0], k,
                                                                      logits.device)

        if sinkhorn or replayed is not None:
            # the z-loss on the logits, the aux-loss scores in a separate pass (below)
            if want_z:
                z = ops.z_loss_func(logits, z_coeff, padding_mask=mask)
                logits = self._attach(logits, z, "z_loss", z_coeff, num_valid)
            if sinkhorn:
                probs, routing_map = ops.sinkhorn_load_balancing(logits, k,
                                                                 training=self.training)
            else:
                probs, routing_map = routing_at_indices(
                    logits, replayed, use_pre_softmax=cfg.moe_router_pre_softmax,
                    scaling_factor=cfg.moe_router_topk_scaling_factor,
                    score_function=cfg.moe_router_score_function,
                    normalize=cfg.moe_router_norm_topk_prob)
        else:
            # One pass over the logits: the routing, and (training) the aux-loss scores and map
            # and the logsumexp the z-loss squares. The z-loss rides on the probs instead of the
            # logits; its gradient reaches the logits through the router's backward, the same
            # value in the same summation order as the separate z_loss_func.
            probs, routing_map, indices, scores, aux_map, lse = router_topk_fused(
                logits, k,
                use_pre_softmax=cfg.moe_router_pre_softmax,
                num_groups=cfg.moe_router_num_groups,
                group_topk=cfg.moe_router_group_topk,
                scaling_factor=cfg.moe_router_topk_scaling_factor,
                score_function=cfg.moe_router_score_function,
                expert_bias=self.expert_bias,
                padding_mask=mask,
                with_aux=want_aux,
                with_lse=want_z,
                normalize=cfg.moe_router_norm_topk_prob,
                group_score_topk=cfg.moe_router_group_score_topk,
            )
            if replay is not None and replay.router_replay_action is RouterReplayAction.RECORD:
                replay.record_indices(indices)
            if want_z:
                z_dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
                z = z_loss_from_lse(lse, z_coeff, mask, z_dtype)
                probs = self._attach(probs, z, "z_loss", z_coeff, num_valid)
        if cfg.moe_expert_capacity_factor is not None:
            probs, routing_map = ops.apply_router_token_dropping(
                probs, routing_map, router_topk=k,
                capacity_factor=cfg.moe_expert_capacity_factor,
                drop_policy=cfg.moe_token_drop_policy,
                pad_to_capacity=cfg.moe_pad_expert_input_to_capacity,
            )

        if want_aux:
            if scores is None:  # Sinkhorn or replayed routing: a separate pass
                aux_map, scores = ops.compute_routing_scores_for_aux_loss(
                    logits, k, cfg.moe_router_score_function, padding_mask=mask)
            if "aux_loss" in aux_types:
                c = coeffs["aux_loss"]
                loss = ops.load_balancing_loss(scores, aux_map, k, E, c, padding_mask=mask,
                                               reduce_group=self.tp_cp_group)
                probs = self._attach(probs, loss, "load_balancing_loss", c, num_valid)
            if "seq_aux_loss" in aux_types:
                c = coeffs["seq_aux_loss"]
                loss = ops.seq_load_balancing_loss(scores, aux_map, seq_length, bsz, k, E, c,
                                                   padding_mask=mask,
                                                   reduce_group=self.tp_cp_group)
                probs = self._attach(probs, loss, "seq_load_balancing_loss", c, num_valid)
            if "global_aux_loss" in aux_types:
                c = coeffs["global_aux_loss"]
                loss = ops.global_load_balancing_loss(scores, aux_map, k, E, c,
                                                      self.global_aux_buffer, padding_mask=mask,
                                                      reduce_group=self.data_parallel_group())
                probs = self._attach(probs, loss, "global_load_balancing_loss", c, num_valid)

        if self.local_tokens_per_expert is not None and self.training:
            # Megatron also counts in eval mode when grad is on; evaluation should not move
            # the training statistics, so we count only in training mode (a documented choice).
            ops.accumulate_tokens_per_expert(self.local_tokens_per_expert, routing_map, mask)
        # for logging, made when read (last_routing_load) rather than by four more ops in
        # every forward, ahead of the experts' first kernel, for a value most steps never read
        self._last_routing_map = routing_map
        return probs, routing_map

    @property
    def last_routing_load(self) -> Optional[torch.Tensor]:
        """Each expert's share of the tokens the last forward routed: ``[E]`` fp32 on the
        router's device, summing to 1 (all zeros when nothing was routed), or None before the
        first forward. Computed on the device at every read (no host sync) from the last
        forward's routing map, so a read after a CUDA-graph replay sees that replay's routing."""
        if self._last_routing_map is None:
            return None
        with torch.no_grad():
            counts = self._last_routing_map.sum(0, dtype=torch.float32)
            return counts / counts.sum().clamp_min(1.0)

    def data_parallel_group(self):
        """The group the global aux loss's counts and the expert-bias counts are summed over:
        ``tp_dp_cp_group`` when given; else, once ``torch.distributed`` is initialised, the
        data-parallel world (``moe_core.groups.default_data_parallel_group``: the default group,
        or the mesh ``fully_shard`` sharded this router over), resolved at the first reduction
        rather than at construction (a model is often built before ``init_process_group``);
        None (this rank alone) without ``torch.distributed``.

        FSDP2 swaps the sharded weight for a plain unsharded one during the forward, so a
        forward's reduction sees the default group where a later one sees the mesh: the two must
        have the same ranks (a mesh over the whole world), else ValueError on every rank, before
        any collective."""
        if self.tp_dp_cp_group is not None:
            return self.tp_dp_cp_group
        group = default_data_parallel_group(self.weight)
        if group is None or torch.compiler.is_compiling():
            # a traced forward neither reads nor sets the cache: setting it in the first call
            # would change what dynamo guards on and recompile the second; the eager reductions
            # between steps (update_expert_bias) still hold the group to the check below
            return group
        if self._default_dp_group is None:
            self._default_dp_group = group
        elif group_size(group) != group_size(self._default_dp_group):
            before = group_size(self._default_dp_group)
            raise ValueError(
                f"this router's default data-parallel group had {before} ranks and now has "
                f"{group_size(group)} (FSDP2 over part of the world: the "
                f"forward sees the default group, a reduction between steps the mesh): pass "
                f"tp_dp_cp_group (the ranks that share the router) explicitly")
        return self._default_dp_group

    # ---- between steps ----------------------------------------------------------------------
    @torch.no_grad()
    def update_expert_bias(self, group=None) -> None:
        """Aux-loss-free balancing step (after the optimizer step): bias += rate·sign(mean - count)
        from the counts since the last call, all-reduced over ``group`` (default:
        :meth:`data_parallel_group`, the data-parallel world when ``torch.distributed`` is
        initialised), then zero them. Every rank of that group must call it.
        """
        if self.expert_bias is None:
            return
        if group is None:
            group = self.data_parallel_group()
        new_bias = ops.get_updated_expert_bias(self.local_tokens_per_expert, self.expert_bias,
                                               self.config.moe_router_bias_update_rate, group)
        self.expert_bias.copy_(new_bias)
        self.local_tokens_per_expert.zero_()

    def reset_global_aux_loss(self) -> None:
        """Zero the global aux-loss counts: once per global batch."""
        if self.global_aux_buffer is not None:
            self.global_aux_buffer.reset()
