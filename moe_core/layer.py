"""MoELayer: route -> layout -> experts -> combine, a drop-in for Megatron-Core's MoELayer.

forward(hidden [S, B, H] or [T, H], padding_mask=None) returns a tensor of the input's shape:

    hidden = hidden * U(1 - eps, 1 + eps)                   (moe_input_jitter_mode="layer",
                                                             training only: Mixtral's jitter)
    shared = shared_experts(hidden)                         (if configured; before routing)
    probs, routing_map = router(hidden, padding_mask)       [T, E] each
    x = fc1_latent_proj(hidden)                             (latent MoE only, H -> L)
    out = routed_experts(x, probs, routing_map):            the one data path (below)
        layout = routing_layout(routing_map, probs, bound)  where the experts read x by index,
        rows, layout = permute_tokens(x, ...)               else the rows in the same pass
        out = experts(x, layout, rows)                      grouped GEMMs, and the combine: a
                                                            per-token gather-sum, fixed order
    out = fc2_latent_proj(out) + shared

No step reads a device value on the host: the layout's buffers are sized by a static bound
(T·topk dropless; E·capacity with pad-to-capacity; T·topk with dropping, the kept count staying in
expert_offsets[-1]), so the layer runs under torch.compile(fullgraph=True) and in CUDA graphs.

Expert parallel (``expert_model_parallel_size = N > 1``, or an ``ep_group`` given): the layer
holds the ``E / N`` local experts of its rank and a dispatcher (``moe_core.dispatcher``) moves the
layout's rows to their experts' ranks and back (``dispatch``, the experts' ``forward_rows``,
``combine``); routing and the combine stay on the token's rank. Only the dropless / dropping
all-to-all reads its split sizes on the host (one wait per forward), unless
``moe_alltoall_exchange="symm_mem"`` (dropless, NVSHMEM, a static receive budget:
``moe_core.symm_exchange``).

Agreement (expert parallel): a rank that raised on its own input while the others entered a
collective would leave them waiting (or, on gloo, abort them), so before its first collective
every expert-parallel forward gathers one small int64 row per rank: an input problem code (shape,
dtype, padding mask), the token count, the tokens' and the router's dtypes, training / grad mode
and a fingerprint of the fields in ``_SAME_ON_EVERY_RANK``. Every rank then raises the same
error when a row names a bad input or the rows differ where the exchanges cannot take it (the
token count only for the equal-block exchanges: allgather, drop-and-pad, symm_mem). Where it
runs:

* dropless / dropping all-to-all: the row rides on the dispatcher's token-count all-gather and
  is read with the split sizes (the host read that exchange makes anyway): no extra collective,
  no extra sync. A rank with a bad input joins that all-gather with no tokens and raises there.
  Where a collective runs before it (the global aux loss's counts, a tp_cp group of several
  ranks, FSDP2-sharded submodules), the row is a collective of its own, as below.
* the equal-block exchanges: an all-gather of its own, read on the host only when this rank's
  row changed since its last agreed forward (first forward, new token count, dtype or mode);
  otherwise, and always inside torch.compile or a CUDA graph, a device-side assert checks the
  gathered rows (no host read: the exchanges stay capturable). On the CPU the assert raises at
  once and the rows are read for the clear error; on CUDA it stops the device on every rank.

Mixed precision (``torch.autocast``): the layer behaves as ``nn.Linear`` does there. The experts'
GEMMs (and the latent projections and the shared expert, which are ``nn.Linear``) run in the
autocast dtype on fp32 master weights; the router computes in ``moe_router_dtype`` (None: its
input's dtype), as outside autocast, and the aux losses in fp32 (or fp64). Outside autocast the
input must have the parameters' dtype.
"""
import zlib
from typing import Callable, List, Optional, Tuple, Union

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

from moe_core import ops
from moe_core.config import MoEConfig
from moe_core.dispatcher import DISPATCHERS, _all_gather, _wait
from moe_core.experts import (GroupedMLP, SharedExpertMLP, autocast_dtype, autocast_to,
                              reads_rows_by_index, uninitialized_linear)
from moe_core.groups import GroupLike, as_group
from moe_core.ops.aux_loss_autoscaler import current_aux_loss_scale
from moe_core.router import TopKRouter

# Fields every rank of an expert-parallel group must agree on: those that change what the ranks
# exchange (shapes, dtypes, which collectives run, in which order) or the replicated router's
# values. Checked at construction (one all-gather, each differing field named) and, as a
# fingerprint, in every forward's agreement (a field changed after construction on one rank).
_SAME_ON_EVERY_RANK = ("hidden_size", "num_moe_experts", "moe_ffn_hidden_size", "moe_router_topk",
                       "expert_model_parallel_size", "moe_token_dispatcher_type",
                       "moe_expert_capacity_factor", "moe_pad_expert_input_to_capacity",
                       "moe_token_drop_policy", "gated_linear_unit", "add_bias_linear",
                       "moe_latent_size", "moe_shared_expert_intermediate_size",
                       "moe_shared_expert_overlap", "params_dtype", "moe_alltoall_exchange",
                       "moe_alltoall_recv_factor", "moe_router_dtype",
                       "moe_router_load_balancing_type", "moe_aux_loss_coeff", "moe_z_loss_coeff",
                       "moe_router_enable_expert_bias", "moe_router_bias_update_rate",
                       "moe_apply_probs_on_input", "moe_router_padding_for_quantization",
                       "tensor_model_parallel_size", "expert_tensor_parallel_size",
                       "sequence_parallel", "calculate_per_token_loss", "moe_layer_recompute")
# Fields a rank may set on its own: they change only this rank's local arithmetic (routing rules
# of the replicated router, activations, initialisation, logging), never an exchange's shape,
# dtype or order. tests/ep/test_rank_failures.py checks every MoEConfig field is in one list.
_MAY_DIFFER = ("num_layers", "ffn_hidden_size", "activation_func", "glu_linear_offset",
               "activation_func_clamp_value", "init_method_std", "moe_shared_expert_gate",
               "moe_layer_freq", "moe_router_topk_limited_devices", "moe_router_num_groups",
               "moe_router_group_topk", "moe_router_pre_softmax", "moe_router_topk_scaling_factor",
               "moe_router_score_function", "moe_router_force_load_balancing",
               "moe_grouped_gemm", "moe_input_jitter_eps", "moe_token_dropping",
               "moe_per_layer_logging", "moe_permute_fusion", "moe_router_fusion",
               "moe_router_norm_topk_prob", "moe_router_group_score_topk",
               "moe_input_jitter_mode", "moe_expert_rows_by_index", "moe_enable_routing_replay",
               "moe_mlp_glu_interleave_size", "moe_shared_expert_glu_interleave_size",
               "moe_single_grouped_weight", "moe_single_grouped_bias")

# dtype <-> small integer, for the agreement vector (the same table in every process)
_DTYPES = sorted({v for v in vars(torch).values() if isinstance(v, torch.dtype)}, key=str)
_DTYPE_CODE = {d: i + 1 for i, d in enumerate(_DTYPES)}

# the agreement vector: one int64 row per rank (see MoELayer._agreement_row)
_STATUS, _TOKENS, _ROWS_DTYPE, _PROBS_DTYPE, _MODE, _CONFIG, _DETAIL_A, _DETAIL_B = range(8)
_OK, _BAD_SHAPE, _BAD_DTYPE, _BAD_MASK = range(4)


def _dtype_name(code: int) -> str:
    return str(_DTYPES[code - 1]) if 0 < code <= len(_DTYPES) else f"dtype #{code}"


def config_fingerprint(config: MoEConfig) -> int:
    """A CRC-32 of the fields every rank must share (stable across processes, unlike hash())."""
    text = repr(tuple(repr(getattr(config, f)) for f in _SAME_ON_EVERY_RANK))
    return zlib.crc32(text.encode())


class MoELayer(nn.Module):
    """Submodules (Megatron's names): router, experts, shared_experts (optional),
    fc1_latent_proj / fc2_latent_proj (with moe_latent_size)."""

    def __init__(self, config: MoEConfig, ep_group: GroupLike = None,
                 layer_number: Optional[int] = None, *, tp_cp_group: GroupLike = None,
                 tp_dp_cp_group: GroupLike = None, device: Optional[torch.device] = None,
                 dtype: Optional[torch.dtype] = None):
        """
        Args:
            config: the MoE fields (``MoEConfig``).
            ep_group: the expert-parallel group (a ProcessGroup, a 1-D DeviceMesh or
                ``(mesh, dim_name)``). None: the default group when
                ``config.expert_model_parallel_size > 1`` (its size must then be that value),
                else no expert parallelism. Given explicitly, even a group of one runs the
                expert-parallel path.
            layer_number: Megatron's layer number (logging only).
            tp_cp_group: the group the aux losses' token counts are summed over (Megatron's
                TP x CP group); None: this rank alone, right without tensor / context parallelism.
            tp_dp_cp_group: the group the global aux loss's counts and the expert-bias counts are
                summed over (Megatron's TP x DP x CP group: every rank that shares the router).
                None: the default group for an expert-parallel layer (pure EP + DP); otherwise the
                data-parallel world once ``torch.distributed`` is initialised (DDP, FSDP2: the
                default group, or the mesh ``fully_shard`` sharded the router over), resolved at
                the first reduction, not here (``TopKRouter.data_parallel_group``), and this rank
                alone without ``torch.distributed``. A group of one rank
                (``torch.distributed.new_subgroups(1)[0]``) keeps each rank's counts its own.
            device: where the parameters and buffers are created and initialised (build on the
                GPU directly: initialising a large layer on the CPU first takes minutes).
                ``"meta"``: shapes only; then ``to_empty(device=...)`` and
                :meth:`reset_parameters`.
            dtype: the parameters' dtype (default ``config.params_dtype``); the router's
                buffers stay fp32.
        """
        super().__init__()
        self.config = config
        self.layer_number = layer_number
        H, L = config.hidden_size, config.moe_latent_size
        self.ep_group = self._resolve_ep_group(config, ep_group)
        self.dispatcher = None
        if self.ep_group is not None:
            if tp_dp_cp_group is None:
                tp_dp_cp_group = dist.group.WORLD
            if config.moe_alltoall_exchange == "symm_mem":
                from moe_core.symm_exchange import SymmMemAlltoAllDispatcher

                self.dispatcher = SymmMemAlltoAllDispatcher(
                    self.ep_group, config.num_moe_experts, config.moe_router_topk,
                    config.moe_alltoall_recv_factor,
                    drop_and_pad=config.moe_pad_expert_input_to_capacity)
            else:
                self.dispatcher = DISPATCHERS[config.moe_token_dispatcher_type](
                    self.ep_group, config.num_moe_experts,
                    drop_and_pad=config.moe_pad_expert_input_to_capacity)
            self._check_same_config_on_every_rank()
        self._config_fingerprint = config_fingerprint(config)
        self._agreed_row = None  # this rank's agreement row of its last agreed forward
        self._row_on_device = None  # (row, its int64 device tensor), reused while unchanged
        self.tp_cp_group = as_group(tp_cp_group, "tp_cp_group")
        self.tp_dp_cp_group = as_group(tp_dp_cp_group, "tp_dp_cp_group")
        kw = dict(device=device, dtype=dtype)
        # each submodule initialises itself as it is built, in the order reset_parameters
        # repeats, so a layer built and a layer reset draw the same numbers
        self.router = TopKRouter(config, tp_cp_group=self.tp_cp_group,
                                 tp_dp_cp_group=self.tp_dp_cp_group, **kw)
        if self.router.router_replay is not None:
            self.router.router_replay.layer_number = layer_number
        if L:
            lin = dict(bias=config.add_bias_linear, device=device,
                       dtype=dtype or config.params_dtype)
            self.fc1_latent_proj = uninitialized_linear(H, L, **lin)
            self.fc2_latent_proj = uninitialized_linear(L, H, **lin)
            self._reset_latent_projections()
        else:
            self.fc1_latent_proj = self.fc2_latent_proj = None
        ep_size = 1 if self.dispatcher is None else self.dispatcher.ep_size
        ep_rank = 0 if self.dispatcher is None else self.dispatcher.ep_rank
        self.experts = GroupedMLP(config, input_size=L or H, ep_size=ep_size, ep_rank=ep_rank,
                                  **kw)
        self.shared_experts = (SharedExpertMLP(config, **kw)
                               if config.moe_shared_expert_intermediate_size is not None else None)
        self._shared_stream = None

    def reset_parameters(self) -> None:
        """Re-initialises everything as Megatron does, in construction order (router, latent
        projections, experts, shared expert): the same numbers as a layer built now with the
        same seed on the same device. Also zeroes the router's buffers (expert bias, running
        counts). Use after ``to_empty`` to materialise a layer built on ``device="meta"``."""
        self.router.reset_parameters()
        if self.fc1_latent_proj is not None:
            self._reset_latent_projections()
        self.experts.reset_parameters()
        if self.shared_experts is not None:
            self.shared_experts.reset_parameters()

    def _reset_latent_projections(self) -> None:
        """Megatron's init of the latent projections: N(0, std) for fc1, N(0, std / sqrt(2
        num_layers)) for fc2, zero bias."""
        cfg = self.config
        with torch.no_grad():
            nn.init.normal_(self.fc1_latent_proj.weight, 0.0, cfg.init_method_std)
            nn.init.normal_(self.fc2_latent_proj.weight, 0.0,
                            cfg.init_method_std / (2.0 * cfg.num_layers) ** 0.5)
            for lin in (self.fc1_latent_proj, self.fc2_latent_proj):
                if lin.bias is not None:
                    lin.bias.zero_()

    # ---- expert parallelism: set-up checks ------------------------------------------------
    @staticmethod
    def _resolve_ep_group(config: MoEConfig, ep_group: GroupLike) -> Optional[dist.ProcessGroup]:
        N = config.expert_model_parallel_size
        group = as_group(ep_group, "ep_group")
        if group is None:
            if N == 1:
                return None
            if not dist.is_initialized():
                raise ValueError(f"expert_model_parallel_size={N} needs torch.distributed "
                                 f"initialised (torchrun) or an ep_group")
            group = dist.group.WORLD
        size = dist.get_world_size(group)
        if size != N:
            which = "the default group" if ep_group is None else "ep_group"
            raise ValueError(f"expert_model_parallel_size={N} but {which} has {size} ranks: "
                             f"pass an ep_group of {N} ranks (moe_core.parallel."
                             f"expert_parallel_groups) or set expert_model_parallel_size={size}")
        if config.moe_token_dispatcher_type not in DISPATCHERS:
            raise ValueError(f"moe_token_dispatcher_type={config.moe_token_dispatcher_type!r}: "
                             f"expert parallelism runs {sorted(DISPATCHERS)}")
        return group

    def _check_same_config_on_every_rank(self) -> None:
        """One all-gather of the fields the ranks must share: a mismatch raises the same
        ValueError on every rank (so none is left waiting in a later collective)."""
        cfg = self.config
        mine = tuple(repr(getattr(cfg, f)) for f in _SAME_ON_EVERY_RANK)
        seen = [None] * self.dispatcher.ep_size
        dist.all_gather_object(seen, mine, group=self.ep_group)
        for i, field in enumerate(_SAME_ON_EVERY_RANK):
            values = [s[i] for s in seen]
            if len(set(values)) > 1:
                raise ValueError(f"{field} differs across the expert-parallel ranks: "
                                 + ", ".join(f"rank {r}: {v}" for r, v in enumerate(values)))

    # ---- expert parallelism: the ranks agree before every forward's first collective -------
    def _exchanges(self) -> bool:
        """True when the forward exchanges with other ranks (an EP group of more than one rank,
        or the collectives forced at one)."""
        return self.dispatcher is not None and self.dispatcher.exchange

    def _needs_equal_tokens(self) -> bool:
        """The allgather dispatcher, drop-and-pad and the symmetric buffers exchange blocks sized
        by the token count: every rank must have the same count."""
        cfg = self.config
        return (cfg.moe_token_dispatcher_type == "allgather" or cfg.moe_alltoall_exchange ==
                "symm_mem" or cfg.moe_pad_expert_input_to_capacity)

    def _agreement_folded(self) -> bool:
        """True where the agreement rides on the dispatcher's token-count all-gather and its
        host read (the dropless / dropping all-to-all): nothing collective may run before it, so
        not with a router that reduces its aux-loss counts over other ranks, nor with submodules
        sharded by FSDP2 (their parameters are all-gathered when they run)."""
        cfg = self.config
        if not self.dispatcher.folds_agreement():
            return False
        coeffs = dict(zip(cfg.load_balancing_types, cfg.aux_loss_coeffs))
        if coeffs.get("global_aux_loss", 0) or (
                self.tp_cp_group is not None and dist.get_world_size(self.tp_cp_group) > 1):
            return False
        return not any(hasattr(p, "device_mesh") for p in self.parameters())

    def _input_problem(self, hidden_states: torch.Tensor, padding_mask: Optional[torch.Tensor]
                       ) -> Optional[Tuple[Exception, List[int]]]:
        """The error this rank's input alone would raise (shape, dtype, padding mask) and its
        code for the agreement row (``[status, detail a, detail b]``), or None; returned, not
        raised, so an expert-parallel rank can tell the others first."""
        H = self.config.hidden_size
        if hidden_states.dim() not in (2, 3) or hidden_states.shape[-1] != H:
            last = hidden_states.shape[-1] if hidden_states.dim() else 0
            return (ValueError(f"hidden_states must be [S, B, {H}] or [T, {H}], got "
                               f"{tuple(hidden_states.shape)}"),
                    [_BAD_SHAPE, hidden_states.dim(), last])
        # autocast casts fp32 / fp16 / bf16 only: another dtype must be the parameters' there too
        low = (torch.float32, torch.float16, torch.bfloat16)
        if autocast_dtype(hidden_states) is None or hidden_states.dtype not in low:
            params_dtype = next(self.experts.parameters()).dtype
            if hidden_states.dtype != params_dtype:
                return (TypeError(
                    f"hidden_states is {hidden_states.dtype} but the layer's parameters are "
                    f"{params_dtype}: build the layer in the activation dtype "
                    f"(MoEConfig(params_dtype=...) or MoELayer(..., dtype=...)), or run it under "
                    f"torch.autocast(device_type, dtype=...) to compute in a lower precision "
                    f"than fp32 parameters"),
                    [_BAD_DTYPE, _DTYPE_CODE.get(hidden_states.dtype, 0),
                     _DTYPE_CODE.get(params_dtype, 0)])
        if padding_mask is not None:
            try:
                self._padding_mask(padding_mask, hidden_states)
            except (TypeError, ValueError) as e:
                return e, [_BAD_MASK, 0, 0]
        return None

    def _agreement_row(self, hidden_states: torch.Tensor,
                       problem: Optional[Tuple[Exception, List[int]]]) -> List[int]:
        """This rank's row of the agreement: what the exchanges' shapes, dtypes and order depend
        on (columns ``_STATUS .. _DETAIL_B``)."""
        cfg = self.config
        status, a, b = problem[1] if problem is not None else (_OK, 0, 0)
        tokens = hidden_states.numel() // max(hidden_states.shape[-1], 1) \
            if hidden_states.dim() else 0
        ac = autocast_dtype(hidden_states)
        low = (torch.float32, torch.float16, torch.bfloat16)
        rows = ac if ac is not None and hidden_states.dtype in low else hidden_states.dtype
        probs = cfg.router_dtype or hidden_states.dtype
        mode = 2 * int(self.training) + int(torch.is_grad_enabled())
        # a traced forward takes the fingerprint of construction (dynamo guards on the fields)
        fingerprint = (self._config_fingerprint if torch.compiler.is_compiling()
                       else config_fingerprint(cfg))
        return [status, tokens, _DTYPE_CODE.get(rows, 0), _DTYPE_CODE.get(probs, 0), mode,
                fingerprint, a, b]

    def _agree(self, hidden_states: torch.Tensor,
               problem: Optional[Tuple[Exception, List[int]]]) -> List[int]:
        """The ranks' agreement on this forward, before its first collective (module docstring,
        "Agreement"): every rank raises the same error when one rank's input is bad or the ranks
        differ in what they would exchange, so none is left in a collective.

        Returns the row to fold into the dispatcher's token-count all-gather (the dropless /
        dropping all-to-all: no collective of its own), or ``[]`` when the agreement is done."""
        row = self._agreement_row(hidden_states, problem)
        error = problem[0] if problem is not None else None
        if self._agreement_folded():
            if problem is None:
                return row
            # this rank stops here: it joins the token-count all-gather the others are about to
            # enter (no tokens of its own), reads the table and raises with them
            device = next(self.experts.parameters()).device
            _, host = self.dispatcher.preprocess(
                torch.zeros(1, self.config.num_moe_experts, dtype=torch.bool, device=device),
                self._row_tensor(row, device))
            self._check_agreement(host.get()[2 * self.dispatcher.ep_size:], error)
            raise error  # not reached: the table holds this rank's problem
        mine = self._row_tensor(row, next(self.experts.parameters()).device)
        table = _wait(_all_gather(mine, 0, self.ep_group), "agreement all-gather")  # [N·8]
        graph = torch.compiler.is_compiling() or (
            mine.is_cuda and torch.cuda.is_current_stream_capturing())
        if not graph and row != self._agreed_row:
            # this rank's row changed since its last agreed forward (the first forward, a new
            # token count, dtype or mode, or a bad input): read the table, a clear error
            self._check_agreement(table.tolist(), error)
            self._agreed_row = row
            return []
        # the steady state reads nothing on the host: a device-side assert on the table (every
        # rank sees the same table, so every rank fails together). On the CPU it raises at once
        # and the table is read for the clear error; on CUDA it stops the device (a rank whose
        # own row changed has read the table and raised the clear error).
        t = table.view(-1, len(row))
        same = (t[:, _STATUS] == _OK).all() & (t[:, _ROWS_DTYPE:_CONFIG + 1] ==
                                                t[0, _ROWS_DTYPE:_CONFIG + 1]).all()
        if self._needs_equal_tokens():
            same = same & (t[:, _TOKENS] == t[0, _TOKENS]).all()
        try:
            torch._assert_async(same, "the expert-parallel ranks disagree on this forward (a "
                                      "bad input on one rank, or token counts, dtypes, "
                                      "training mode or config that differ): run it eagerly "
                                      "for the details")
        except RuntimeError:
            if not graph:
                self._check_agreement(table.tolist(), error)
            raise
        return []

    def _row_tensor(self, row: List[int], device: torch.device) -> torch.Tensor:
        """The agreement row on the device. A host-to-device copy from pageable memory waits for
        the stream, so the row of the last agreed forward is kept on the device and reused while
        it does not change (the steady state copies nothing); a traced forward builds it in the
        graph."""
        if torch.compiler.is_compiling():
            return torch.tensor(row, dtype=torch.long, device=device)
        cached = self._row_on_device
        if cached is not None and cached[0] == row and cached[1].device == device:
            return cached[1]
        t = torch.tensor(row, dtype=torch.long, device=device)
        self._row_on_device = (row, t)
        return t

    def _check_agreement(self, table: List[int], problem: Optional[Exception] = None) -> None:
        """Raise, on every rank alike, when the gathered agreement ``table`` (the ranks' rows,
        flattened) shows a bad input on some rank or a difference the exchanges cannot take.
        ``problem``: this rank's own error, chained as the cause."""
        width = _DETAIL_B + 1
        rows = [table[i:i + width] for i in range(0, len(table), width)]
        H = self.config.hidden_size
        bad = [(r, row) for r, row in enumerate(rows) if row[_STATUS] != _OK]
        if bad:
            def what(row):
                if row[_STATUS] == _BAD_SHAPE:
                    return (f"hidden_states has {row[_DETAIL_A]} dimensions and last size "
                            f"{row[_DETAIL_B]}, the layer takes [S, B, {H}] or [T, {H}]")
                if row[_STATUS] == _BAD_DTYPE:
                    return (f"hidden_states is {_dtype_name(row[_DETAIL_A])} but the layer's "
                            f"parameters are {_dtype_name(row[_DETAIL_B])} (outside autocast "
                            f"the input must have the parameters' dtype)")
                return "padding_mask does not fit hidden_states"
            kind = TypeError if bad[0][1][_STATUS] == _BAD_DTYPE else ValueError
            raise kind("expert-parallel forward stopped on every rank: "
                       + "; ".join(f"rank {r}: {what(row)}" for r, row in bad)) from problem

        def differs(col):
            return len({row[col] for row in rows}) > 1

        def listing(col, fmt=str):
            return ", ".join(f"rank {r}: {fmt(row[col])}" for r, row in enumerate(rows))
        if differs(_CONFIG):
            raise ValueError(f"the configuration differs across the expert-parallel ranks (a "
                             f"field of {_SAME_ON_EVERY_RANK} was changed after the layer was "
                             f"built on some rank); its fingerprints: {listing(_CONFIG)}")
        if differs(_MODE):
            def mode(m):
                return (("training" if m & 2 else "eval") + ", "
                        + ("grad enabled" if m & 1 else "no grad"))
            raise ValueError(f"the training mode or grad mode differs across the expert-parallel "
                             f"ranks ({listing(_MODE, mode)}): their forward and backward "
                             f"exchanges would not match")
        if differs(_ROWS_DTYPE):
            raise TypeError(f"the tokens' dtype (hidden_states', or the autocast dtype) differs "
                            f"across the expert-parallel ranks: "
                            f"{listing(_ROWS_DTYPE, _dtype_name)}")
        if differs(_PROBS_DTYPE):
            raise TypeError(f"the router's dtype (moe_router_dtype, else hidden_states') differs "
                            f"across the expert-parallel ranks: "
                            f"{listing(_PROBS_DTYPE, _dtype_name)}")
        if self._needs_equal_tokens() and differs(_TOKENS):
            cfg = self.config
            why = ("the allgather dispatcher" if cfg.moe_token_dispatcher_type == "allgather"
                   else "moe_pad_expert_input_to_capacity" if cfg.moe_pad_expert_input_to_capacity
                   else "moe_alltoall_exchange='symm_mem' (symmetric buffers)")
            seen = [row[_TOKENS] for row in rows]
            me = self.dispatcher.ep_rank
            raise ValueError(f"hidden_states has {seen[me]} tokens on this rank; {why} needs "
                             f"the same number on every expert-parallel rank, got {seen}")

    def num_out_tokens(self, num_tokens: Union[int, torch.SymInt]) -> Union[int, torch.SymInt]:
        """The row bound of the layout for ``num_tokens`` tokens (permute's ``num_out_tokens``;
        a static size, no host sync).

        Dropless (and dropping without padding): ``num_tokens * topk``, integer arithmetic, so a
        symbolic token count (``torch.compile`` with a dynamic token dimension) stays symbolic.
        Pad-to-capacity rounds through ``get_capacity``'s float ``ceil`` and sizes the graph by
        the capacity, so it specialises on the token count."""
        cfg = self.config
        cf = cfg.moe_expert_capacity_factor
        if cf is not None and cfg.moe_pad_expert_input_to_capacity:
            cap = ops.get_capacity(num_tokens * cfg.moe_router_topk, cfg.num_moe_experts, cf)
            return cfg.num_moe_experts * min(cap, num_tokens)
        return num_tokens * cfg.moe_router_topk

    def forward(self, hidden_states: torch.Tensor,
                padding_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The layer.

        Mixed precision: inside ``torch.autocast(device_type, dtype=...)`` the layer runs as
        ``nn.Linear`` does there: the tokens and the expert weights (fp32 masters) are cast to
        the autocast dtype before the experts' grouped GEMMs, and their gradients flow back
        through the cast to the parameters in the parameters' dtype; the latent projections and
        the shared expert are ``nn.Linear`` and autocast casts them itself. The router is left
        alone: it computes in ``moe_router_dtype`` (None: the dtype of ``hidden_states``), so an
        fp32 input routes as it would outside autocast, and the aux / z losses stay fp32 (fp64
        with an fp64 router). ``hidden_states`` may then be fp32 or the autocast dtype.

        Args:
            hidden_states: ``[S, B, H]`` (Megatron's layout) or ``[T, H]``: the parameters'
                dtype, or under ``torch.autocast`` any of fp32 / fp16 / bf16.
            padding_mask: bool, True = padding: ``[B, S]`` for a ``[S, B, H]`` input (Megatron's
                GPTModel convention) or ``[T]`` for ``[T, H]``; padded tokens are still computed
                but leave the aux/z losses and the expert-bias counts alone.

        Returns:
            The output, of ``hidden_states``' shape and dtype (under autocast: the autocast
            dtype, as ``nn.Linear``'s output there).

        Raises:
            TypeError: outside autocast, ``hidden_states`` of a dtype other than the
                parameters' (checked before the router runs).
        """
        problem = self._input_problem(hidden_states, padding_mask)
        agreement = None
        if self._exchanges():
            agreement = self._agree(hidden_states, problem)
            if problem is not None:  # inside a graph: the assert above fails on every rank
                return hidden_states
        elif problem is not None:
            raise problem[0]
        if padding_mask is not None:
            padding_mask = self._padding_mask(padding_mask, hidden_states)
        if self.config.moe_layer_recompute and self.training and torch.is_grad_enabled():
            return self._recomputed(hidden_states, padding_mask, agreement)
        return self._forward(hidden_states, padding_mask, agreement)

    def _recomputed(self, hidden_states: torch.Tensor, padding_mask: Optional[torch.Tensor],
                    agreement: Optional[List[int]]) -> torch.Tensor:
        """``moe_layer_recompute``: the layer under a reentrant activation checkpoint, as
        Megatron's: the forward runs without grad and keeps only its inputs; the backward runs it
        again (same RNG draws, same autocast) and backpropagates through that run. So the aux and
        z losses, the global aux loss's counts, ``last_losses`` and the expert-bias counts are made
        once, by the recompute (grad disabled, the first run skips them), and the gradients are
        bitwise those without recompute. Backward with ``.backward()``, not ``torch.autograd.grad``
        (reentrant checkpoints need the parameters' ``.grad``). Expert parallel: the recompute
        takes the forward's ``agreement`` (a row still to fold into the token-count all-gather
        that its exchange runs again, or ``[]``, agreed already)."""
        # the aux losses bind the holder current now, not the one current when the backward runs
        scale = self.router.aux_loss_scale or current_aux_loss_scale()

        def run(hidden: torch.Tensor, mask: Optional[torch.Tensor], _anchor: torch.Tensor):
            with scale:
                return self._forward(hidden, mask, agreement)

        # a reentrant checkpoint's output needs an input that requires grad, else the parameters
        # get none when the tokens do not: an empty one that always does
        anchor = hidden_states.new_empty(0, requires_grad=True)
        return checkpoint(run, hidden_states, padding_mask, anchor, use_reentrant=True,
                          preserve_rng_state=True)

    def _forward(self, hidden_states: torch.Tensor, padding_mask: Optional[torch.Tensor],
                 agreement: Optional[List[int]] = None) -> torch.Tensor:
        """:meth:`forward` after its checks (``padding_mask`` in ``[S, B]`` / ``[T]`` order;
        ``agreement``: as :meth:`routed_experts`)."""
        hidden_states = self.router.apply_layer_jitter(hidden_states)
        overlap = self.dispatcher is not None and self.config.moe_shared_expert_overlap
        shared = None
        if self.shared_experts is not None and not overlap:
            shared = self.shared_experts(hidden_states)
        probs, routing_map = self.router(hidden_states, padding_mask)
        x = hidden_states.reshape(-1, hidden_states.shape[-1])
        if self.fc1_latent_proj is not None:
            x = self.fc1_latent_proj(x)
        box = {}
        run_shared = (lambda: box.update(out=self._shared_side(hidden_states))) if overlap else None
        out = self.routed_experts(x, probs, routing_map, overlap=run_shared, agreement=agreement)
        if overlap:
            shared = self._shared_joined(box.get("out"))
        if self.fc2_latent_proj is not None:
            out = self.fc2_latent_proj(out)
        out = unflattened(out, hidden_states.shape)
        if shared is not None:
            out = out + shared
        return out

    def routed_experts(self, x: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor,
                       overlap: Optional[Callable[[], None]] = None,
                       agreement: Optional[List[int]] = None) -> torch.Tensor:
        """layout -> experts -> combine on routed tokens: the one place this sequence is written
        (the forward, expert parallel or not, and the Hugging Face blocks run it).

        The layout is made in the pass the next step needs: with the rows (permute's full mode:
        each token read once, written to all of its rows) where the rows are used as such, the
        layout alone where the experts read each row from ``x`` by index. The combine's owner:
        the experts on one device (they sum each token's rows themselves, so their backward frees
        the rows' gradient early), the dispatcher under expert parallelism (the rows come back
        from other ranks first).

        Args:
            x: ``[T, H]`` the tokens (activation dtype; the latent size with moe_latent_size).
            probs: ``[T, E]`` router probs (router dtype), zero off the map.
            routing_map: ``[T, E]`` bool, the router's choice.
            overlap: expert parallel only: run while the rows are in flight (the shared expert).
            agreement: expert parallel only: the forward's agreement row still to be checked
                (folded into the dispatcher's all-gather), ``[]`` when the ranks have agreed
                already, None when :meth:`dispatch` is to agree itself.

        Returns:
            ``[T, H]`` in ``x``'s dtype: each token's experts' outputs, weighted and summed.
        """
        # under autocast, the rows are made (and, expert parallel, sent) in its dtype
        x = autocast_to(x, autocast_dtype(x))
        if self.dispatcher is None:
            by_index = reads_rows_by_index(self.config) and self._rows_by_index(x)
            rows, layout = self._layout(x, probs, routing_map, with_rows=not by_index)
            return self.experts(x, layout, rows)
        recv, recv_probs, recv_offsets, handle = self.dispatch(x, probs, routing_map, overlap,
                                                               agreement)
        y = self.experts.forward_rows(recv, recv_offsets, recv_probs)
        return self.dispatcher.combine(y, handle)

    def dispatch(self, x: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor,
                 overlap: Optional[Callable[[], None]] = None,
                 agreement: Optional[List[int]] = None):
        """Expert parallel: the tokens' layout, made as the dispatcher asks, and the dispatch of
        their rows to the local experts of every rank (:meth:`routed_experts`' first half).

        Args: as :meth:`routed_experts`. Expert parallel, without ``agreement``: the ranks
            agree on ``x`` first (:meth:`_agree`).

        Returns:
            ``(rows [R_local, H], probs [R_local], expert_offsets [E_local + 1] int64, handle)``:
            the rows this rank's experts run, grouped by local expert, and the handle
            ``self.dispatcher.combine(y, handle)`` takes to bring their outputs back.
        """
        if agreement is None and self._exchanges():  # called on its own, not by forward
            agreement = self._agree(x, None)
        meta = None
        if agreement:  # a row to fold into the token-count all-gather
            meta = (self._row_tensor(agreement, x.device), self._check_agreement)
        plan = self.dispatcher.plan(routing_map, meta)
        rows, layout = self._layout(x, probs, routing_map, *self.dispatcher.layout_request())
        return self.dispatcher.dispatch(x, layout, rows, plan, overlap)

    def _layout(self, x: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor,
                with_rows: bool, drop_and_pad: bool = False):
        """``(rows or None, layout)``: the tokens' layout within the layer's row bound, with the
        rows made in the same pass (permute's full mode) when ``with_rows``, else alone."""
        bound = self.num_out_tokens(x.shape[0])
        if with_rows:
            return ops.permute_tokens(x, routing_map, probs, bound, drop_and_pad)
        return None, ops.routing_layout(routing_map, probs, bound, drop_and_pad)

    def _rows_by_index(self, x: torch.Tensor) -> bool:
        """config.moe_expert_rows_by_index, None resolved by x's device (see MoEConfig)."""
        choice = self.config.moe_expert_rows_by_index
        return x.device.type == "cpu" if choice is None else choice

    def _shared_joined(self, shared: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """The overlapped shared expert's output, made safe to read on the compute stream."""
        if shared is not None and shared.is_cuda:
            torch.cuda.current_stream(shared.device).wait_stream(self._shared_stream)
            shared.record_stream(torch.cuda.current_stream(shared.device))
        return shared

    @property
    def last_dropped_rows(self) -> Optional[torch.Tensor]:
        """With ``moe_alltoall_exchange="symm_mem"``: the number of this rank's permuted rows
        the receive budget dropped in the last forward (int64 scalar on the device, never read
        on the host by the layer); None for the other exchanges or before a forward."""
        return getattr(self.dispatcher, "last_dropped_rows", None)

    def _shared_side(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if not hidden_states.is_cuda:
            return self.shared_experts(hidden_states)
        if self._shared_stream is None:
            self._shared_stream = torch.cuda.Stream(device=hidden_states.device)
        self._shared_stream.wait_stream(torch.cuda.current_stream(hidden_states.device))
        # the side stream reads the input (forward, and the weight gradients in backward): keep
        # its memory from being reused by the compute stream until that work is done
        hidden_states.record_stream(self._shared_stream)
        with torch.cuda.stream(self._shared_stream):
            return self.shared_experts(hidden_states)

    def extra_repr(self) -> str:
        cfg = self.config
        s = (f"hidden_size={cfg.hidden_size}, num_moe_experts={cfg.num_moe_experts}, "
             f"topk={cfg.moe_router_topk}")
        if self.dispatcher is not None:
            s += (f", expert_parallel={self.dispatcher.ep_size} "
                  f"({cfg.moe_token_dispatcher_type}, rank {self.dispatcher.ep_rank})")
        return s

    @staticmethod
    def _padding_mask(padding_mask: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        if padding_mask.dtype != torch.bool:
            raise TypeError(f"padding_mask must be bool (True = padding), got {padding_mask.dtype}")
        if hidden.dim() == 3:
            S, B = hidden.shape[:2]
            if tuple(padding_mask.shape) != (B, S):
                raise ValueError(f"padding_mask must be [B, S] = [{B}, {S}] for hidden_states "
                                 f"[S, B, H], got {tuple(padding_mask.shape)}")
            return padding_mask.t()
        if tuple(padding_mask.shape) != (hidden.shape[0],):
            raise ValueError(f"padding_mask must be [T] = [{hidden.shape[0]}] for hidden_states "
                             f"[T, H], got {tuple(padding_mask.shape)}")
        return padding_mask


def unflattened(out: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """``out`` (``[T, H]``, made by the layer) as ``shape`` (``[S, B, H]``) without a view:
    FSDP2 warns about a module whose output is a view (an in-place op on it would skip FSDP's
    pre-backward hook). ``out`` is the layer's own and nothing saves it for the backward, so the
    unflattened tensor may share its storage without being tracked as its view (what aten's
    matmul does with its own result)."""
    if out.shape == shape:
        return out
    return torch.ops.aten._unsafe_view(out, shape)


def moe_layers(model: nn.Module):
    """Every MoELayer in ``model``."""
    return [m for m in model.modules() if isinstance(m, MoELayer)]


@torch.no_grad()
def update_expert_bias(model: nn.Module, group=None) -> None:
    """After each optimizer step (Megatron: finalize_model_grads): update the expert bias of every
    router in training mode that has one, from the token counts since the last call, all-reduced
    over ``group`` when given, else over each router's ``data_parallel_group()`` (its
    ``tp_dp_cp_group``, or the data-parallel world once ``torch.distributed`` is initialised).
    Every rank of the group calls it, so every rank's bias stays the same."""
    for layer in moe_layers(model):
        if layer.router.training:
            layer.router.update_expert_bias(group)


def reset_global_aux_loss(model: nn.Module) -> None:
    """Once per global batch: zero the running counts of the global aux loss."""
    for layer in moe_layers(model):
        layer.router.reset_global_aux_loss()


def finalize_step(model: nn.Module, group=None) -> None:
    """Both of the above: call once after each optimizer step."""
    update_expert_bias(model, group)
    reset_global_aux_loss(model)


def load_megatron_state_dict(layer: MoELayer, state_dict: dict, strict: bool = True):
    """Load a Megatron MoELayer's weights into ``layer``, the experts' in any of Megatron's
    layouts: local SequentialMLP naming ``experts.local_experts.{i}.linear_fc{1,2}.{weight,bias}``,
    TE grouped naming ``experts.linear_fc{1,2}.{weight,bias}{i}``, or TE's single grouped
    parameters (``moe_single_grouped_weight`` / ``_bias``) ``experts.linear_fc{1,2}.weight``
    ``[E, out, in]`` (or ``[E·out, in]``) and ``.bias`` ``[E, out]`` (or ``[E·out]``). Router,
    shared-expert and latent keys share Megatron's names. The GLU rows are taken as stored (a
    checkpoint of interleaved experts loads into a layer with the same
    ``moe_mlp_glu_interleave_size``). An expert-parallel layer loads its rank's shard of a Megatron
    state dict at the same EP size (local expert numbering ``0 .. E/N - 1``). Megatron does not
    save the routers' running counts (expert-bias and global aux-loss token counts): the layer
    keeps its own, and they are not reported missing. Returns torch's (missing, unexpected) keys
    result.

    Raises:
        ValueError: the experts of a layout are not exactly the local experts, a grouped tensor
            does not split into them, or one parameter comes in two layouts.
    """
    return layer.load_state_dict(
        megatron_state_dict_to_moe_core(state_dict, layer.experts.num_local_experts,
                                        layer.experts),
        strict=strict)


def megatron_state_dict_to_moe_core(state_dict: dict, num_local_experts: int,
                                    experts: Optional[nn.Module] = None) -> dict:
    """A Megatron MoELayer's state dict (keys relative to the layer) in moe-core's names: the
    experts' ``linear_fc{1,2}`` weights and biases in any of the layouts
    :func:`load_megatron_state_dict` takes (per expert, SequentialMLP's
    ``experts.local_experts.{i}.linear_fc1.weight`` or TE's ``experts.linear_fc1.weight{i}``,
    stacked; or TE's single grouped tensor, split) as ``experts.weight{1,2}`` /
    ``experts.bias{1,2}`` (``[E_local, ...]``), the ``_extra_state`` entries (None for Megatron's
    local linears) left out, every other key (router, shared expert, latent projections,
    moe-core's own names) kept as it is. With ``experts`` (the layer's experts module), each
    per-expert tensor's shape is checked against it.

    Raises:
        ValueError: the experts of a layout are not exactly ``0 .. num_local_experts - 1``, a
            local expert number is not an integer, a per-expert tensor has another shape than
            ``experts`` holds (naming its key), a grouped tensor does not split into them, or one
            parameter comes in two layouts.
        TypeError: an expert entry is not a tensor.
    """
    E = num_local_experts
    out, stacks, keys = {}, {}, {}
    for key, value in state_dict.items():
        if key.endswith("_extra_state") or value is None:
            continue
        name = key
        for fc, ours in _EXPERT_LINEARS:
            for kind in ("weight", "bias"):
                i = None
                local = "experts.local_experts."
                if key.startswith(local) and key.endswith(f".{fc}.{kind}"):
                    i = key[len(local):].split(".")[0]
                te = f"experts.{fc}.{kind}"
                if key.startswith(te) and key[len(te):].isdigit():
                    i = key[len(te):]
                if key == te:  # one grouped parameter of every local expert
                    if not isinstance(value, torch.Tensor):
                        raise TypeError(f"{key}: expected a tensor, got {type(value).__name__}")
                    out[f"experts.{kind}{ours}"] = _split_grouped(value, E, key)
                    name = None
                if i is None:
                    continue
                if not i.isdigit():
                    raise ValueError(f"{key}: the local expert number {i!r} is not an integer")
                if not isinstance(value, torch.Tensor):
                    raise TypeError(f"{key}: expected a tensor, got {type(value).__name__}")
                stacks.setdefault(f"experts.{kind}{ours}", {})[int(i)] = value
                keys.setdefault(f"experts.{kind}{ours}", {})[int(i)] = key
                name = None
        if name is not None:
            out[name] = value
    for name, parts in stacks.items():
        if name in out:
            raise ValueError(f"{name}: the state dict holds it both grouped and per expert")
        if sorted(parts) != list(range(E)):
            raise ValueError(f"{name}: expected local experts 0..{E - 1} in the state dict, got "
                             f"{sorted(parts)}")
        ours = None if experts is None else getattr(experts, name[len("experts."):], None)
        want = None if ours is None else tuple(ours.shape[1:])  # None: reported unexpected
        for i in range(E):
            if want is not None and tuple(parts[i].shape) != want:
                raise ValueError(f"{keys[name][i]}: shape {tuple(parts[i].shape)}, but the "
                                 f"layer's {name} holds one expert as {want}")
        out[name] = torch.stack([parts[i] for i in range(E)])
    return out


# Megatron's expert linears and the suffix of ours (weight1 / bias1, weight2 / bias2)
_EXPERT_LINEARS = (("linear_fc1", "1"), ("linear_fc2", "2"))

# the routers' running state moe-core saves and Megatron does not (megatron_state_dict drops it)
_OWN_ROUTER_STATE = ("router.local_tokens_per_expert", "router.aux_loss_scale",
                     "router.global_aux_buffer.")


def _split_grouped(value: torch.Tensor, num_experts: int, key: str) -> torch.Tensor:
    """A single grouped tensor as ``[E, ...]``: stacked (``[E, ...]``) or concatenated along its
    first dim (``[E·n, ...]``), the two forms Megatron's checkpoint loader splits."""
    if value.dim() >= 1 and value.shape[0] == num_experts:
        return value
    if value.dim() >= 1 and value.shape[0] % num_experts == 0:
        return value.reshape(num_experts, value.shape[0] // num_experts, *value.shape[1:])
    raise ValueError(f"{key}: a grouped tensor of shape {tuple(value.shape)} does not split into "
                     f"{num_experts} local experts")


def megatron_state_dict(layer: MoELayer) -> dict:
    """``layer``'s weights in the layout of the Megatron MoELayer its config describes: with
    ``moe_grouped_gemm``, TE's grouped experts (``experts.linear_fc{1,2}.weight{i}`` /
    ``.bias{i}``, or one ``[E, out, in]`` ``.weight`` / ``[E, out]`` ``.bias`` each with
    ``moe_single_grouped_weight`` / ``moe_single_grouped_bias``), else the local experts
    (``experts.local_experts.{i}.linear_fc{1,2}.weight`` / ``.bias``); every other key under its
    own name, which is Megatron's. The routers' running counts and bound aux-loss scale, which
    Megatron does not save, are left out. :func:`load_megatron_state_dict` reads it back.

    Returns:
        A dict of detached tensors sharing ``layer``'s storage (per-expert entries are views).
    """
    cfg = layer.config
    out = {}
    for key, value in layer.state_dict().items():
        if key.startswith(_OWN_ROUTER_STATE):
            continue
        if not key.startswith("experts."):
            out[key] = value
            continue
        kind, ours = key[len("experts."):-1], key[-1]
        fc = dict((o, f) for f, o in _EXPERT_LINEARS)[ours]
        single = cfg.moe_single_grouped_weight if kind == "weight" else cfg.moe_single_grouped_bias
        if cfg.moe_grouped_gemm and single:
            out[f"experts.{fc}.{kind}"] = value
        else:
            for i, part in enumerate(value.unbind(0)):
                out[f"experts.{fc}.{kind}{i}" if cfg.moe_grouped_gemm
                    else f"experts.local_experts.{i}.{fc}.{kind}"] = part
    return out
