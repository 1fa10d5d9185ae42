"""MoEConfig: the MoE fields of Megatron-Core's TransformerConfig, same names, same defaults.

A Megatron user can build one from an existing config (``MoEConfig.from_megatron(cfg)``) or
write the same keyword arguments. ``__post_init__`` rejects, with a message naming the field and
its value, every combination Megatron rejects, plus the features moe-core does not implement yet
(so nothing is silently ignored). Defaults that differ from Megatron's: none.

Fields Megatron lacks (routing rules of Hugging Face MoE families; their defaults are Megatron's
behaviour):

* ``moe_router_norm_topk_prob``: None keeps Megatron's normalisation (sigmoid / sqrtsoftplus
  probs renormalised over the top-k when topk > 1, softmax-pre probs not). False: the picked
  sigmoid / sqrtsoftplus scores as they are (DeepSeek-V3 ``norm_topk_prob=False``). True: the
  picked probs divided by their sum (+ 1e-20) for every topk, with sigmoid / sqrtsoftplus or with
  ``moe_router_pre_softmax`` (Qwen-MoE / Mixtral / Ernie-4.5: softmax, top-k, renormalise).
  Not with post-softmax routing (a softmax over the k, normalised by construction).
* ``moe_router_group_score_topk``: with group-limited routing, a group's score is the sum of its
  top this-many selection scores: 1 is its max (DeepSeek-V2 ``group_limited_greedy``), 2 the
  top-2 sum of DeepSeek-V3 / GLM-4.5 for any topk. None: Megatron's ``topk // group_topk``.
* ``moe_router_enable_expert_bias`` also works with softmax when ``moe_router_pre_softmax`` is
  set: the bias is added to the softmax probs for the choice only (Ernie-4.5's
  ``e_score_correction_bias``); Megatron allows it with sigmoid / sqrtsoftplus only.
* ``moe_input_jitter_mode``: "router" (Megatron's): ``moe_input_jitter_eps`` multiplies the
  router's input, in every forward, by ``Uniform(1 - eps, 1 + eps).rsample``. "layer" (Mixtral's
  ``router_jitter_noise``): it multiplies the layer's input (router, experts and shared experts
  see the same jittered tokens), in training mode only, by a ``uniform_(1 - eps, 1 + eps)`` draw
  in the input's dtype.

Fields of moe-core's expert-parallel exchange (Megatron has no equivalent):

* ``moe_alltoall_exchange``: "nccl" (default): the all-to-all dispatcher's dropless exchange
  reads its split sizes on the host once per forward (NCCL ``all_to_all_single``). "symm_mem":
  the exchange runs through torch's symmetric memory (NVSHMEM ``all_to_all_vdev``) with a
  static receive buffer and no host read (``moe_core.symm_exchange``); only with
  ``moe_token_dispatcher_type="alltoall"`` and dropless routing (no capacity factor).
* ``moe_alltoall_recv_factor``: the "symm_mem" receive budget of each rank in units of the
  balanced load ``T·topk`` rows (the buffer holds ``ceil(factor·T·topk)`` rows); rows beyond it
  are dropped by a rule every rank computes alike (``MoELayer.last_dropped_rows`` counts them).

Field of moe-core's single-device expert path (Megatron has no equivalent):

* ``moe_expert_rows_by_index``: True: the experts' GEMMs read each permuted row from the tokens
  by index, and the tokens' gradient is made in row chunks, so no ``[T·topk, H]`` buffer is held
  in either pass (less activation memory, the same bits). False: ``permute`` makes the rows.
  None (default): True on the CPU; False on CUDA, where the Hopper kernels' gathered loads
  still run slower than the copy engine's (benchmarks/RESULTS.md). Only the fused expert path
  (no bias, probs after the activation, a ``glu_probs`` activation) reads by index.
"""
import dataclasses
import math
from typing import Callable, List, Optional, Union

import torch
import torch.nn.functional as F

from moe_core.ops.names import SCORE_FUNCTIONS

# the parameter dtypes the layer builds and computes in
_PARAMS_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)

LOAD_BALANCING_TYPES = ("aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none")


@dataclasses.dataclass
class MoEConfig:
    """The MoE fields of Megatron-Core's ``TransformerConfig`` (same names, same defaults) and the
    few fields of moe-core's own; ``MoELayer(config)`` builds the layer. ``__post_init__`` checks
    every value (``ValueError`` naming the field); ``from_megatron`` copies a Megatron config.

    Each field in a line: Megatron's meaning (``megatron/core/transformer/transformer_config.py``
    documents each at length), or moe-core's for its own fields (the module docstring has more).
    "Not implemented" fields are accepted at their defaults only, so nothing is silently ignored.

    Attributes:
        hidden_size: the model width H of the layer's input and output ``[S, B, H]`` / ``[T, H]``.
        num_layers: transformer layers in the model; only scales the output projections' init
            (std / sqrt(2 num_layers)).
        ffn_hidden_size: the dense MLP's width; the experts' width when ``moe_ffn_hidden_size``
            is None (default 4 x hidden_size).
        num_moe_experts: number of routed experts E (required).
        add_bias_linear: biases on the experts' fc1 / fc2 (and on other linears in Megatron).
        gated_linear_unit: a GLU MLP: fc1 makes gate and up halves, ``act(gate) * up`` (SwiGLU
            with ``F.silu``).
        activation_func: the MLP's activation (default ``F.gelu``).
        glu_linear_offset: added to the up half before the GLU product (GPT-OSS's ``+ 1``).
        activation_func_clamp_value: clamps fc1's output inside the activation (Megatron: with
            quick_gelu, GPT-OSS's clamped SwiGLU); None: no clamp.
        params_dtype: dtype of the layer's parameters: fp32, bf16, fp16 or fp64.
        init_method_std: std of the normal init of the weights.
        calculate_per_token_loss: the model's loss is over the non-padded tokens of the global
            batch (the aux losses are scaled to match).
        tensor_model_parallel_size: tensor parallelism; not implemented (1 only).
        expert_model_parallel_size: EP size: ranks the experts are split over (E divisible).
        expert_tensor_parallel_size: tensor parallelism inside experts; not implemented (None / 1).
        sequence_parallel: Megatron's sequence parallelism inside tensor parallelism (TP is 1
            here).
        moe_ffn_hidden_size: each expert's width F (default ``ffn_hidden_size``).
        moe_shared_expert_intermediate_size: the shared expert's total width; None: no shared
            expert.
        moe_shared_expert_gate: a sigmoid gate on the shared expert's output.
        moe_shared_expert_overlap: runs the shared expert under the all-to-all exchanges.
        moe_shared_expert_glu_interleave_size: the shared expert's fc1 rows (GLU) in blocks of
            this many gate rows and as many linear rows, alternating; None: gate half, linear half.
        moe_layer_freq: which transformer layers are MoE (every n-th, or a 0 / 1 pattern); read by
            model builders, not by the layer.
        moe_router_load_balancing_type: "aux_loss", "seq_aux_loss", "global_aux_loss",
            "sinkhorn" or "none", or a list of them (each with its coefficient).
        moe_router_topk: experts per token k.
        moe_enable_routing_replay: each router gets a ``RouterReplay`` (``router.router_replay``,
            ``moe_core.replay``) that records its top-k choice or routes by given indices
            (RL rollout replay, recompute); not with Sinkhorn routing.
        moe_router_topk_limited_devices: deprecated form of group-limited routing (groups =
            EP ranks); use ``moe_router_group_topk``.
        moe_router_num_groups: expert groups for group-limited routing (DeepSeek-V3's node
            groups).
        moe_router_group_topk: groups each token may pick its experts from.
        moe_router_pre_softmax: softmax over all experts before the top-k (else over the k
            picked logits).
        moe_router_topk_scaling_factor: multiplies the routing probs; None: 1.
        moe_router_score_function: "softmax", "sigmoid" or "sqrtsoftplus".
        moe_router_dtype: the router's logits and scores in "fp32" or "fp64"; None: the input's
            dtype.
        moe_router_enable_expert_bias: aux-loss-free balancing: a per-expert bias added to the
            scores for the choice only, updated from the expert loads (``finalize_step``).
        moe_router_bias_update_rate: the step of that bias update.
        moe_router_force_load_balancing: Megatron's benchmarking mode (random routing); not
            implemented.
        moe_router_padding_for_quantization: pads the routing map for fp8 / fp4; not
            implemented.
        moe_grouped_gemm: Megatron's grouped-GEMM experts; moe-core's experts are always grouped.
        moe_single_grouped_weight: the experts' weights in Megatron's single grouped parameter
            layout (``experts.linear_fc{1,2}.weight`` ``[E, out, in]``) in
            ``megatron_state_dict``; needs moe_grouped_gemm. Loading reads every layout.
        moe_single_grouped_bias: the same for the biases (``experts.linear_fc{1,2}.bias``
            ``[E, out]``); needs moe_grouped_gemm and add_bias_linear.
        moe_aux_loss_coeff: the load-balancing loss's coefficient (a list: one per balancing
            type).
        moe_z_loss_coeff: the router z-loss's coefficient; None: no z-loss.
        moe_input_jitter_eps: multiplicative input noise ``Uniform(1 - eps, 1 + eps)``; None: none
            (see ``moe_input_jitter_mode``).
        moe_token_dropping: Megatron's legacy token dropping; not supported (use
            ``moe_expert_capacity_factor``).
        moe_token_dispatcher_type: "allgather", "alltoall" (the two EP exchanges) or "flex" (one
            device only).
        moe_per_layer_logging: per-layer aux-loss logging.
        moe_expert_capacity_factor: each expert's capacity in units of its balanced share
            (T·k / E); tokens over it are dropped; None: dropless.
        moe_pad_expert_input_to_capacity: pads every expert's rows to its capacity (drop-and-pad).
        moe_token_drop_policy: which tokens an over-capacity expert keeps: "probs" (the highest)
            or "position" (the first).
        moe_layer_recompute: the whole layer under an activation checkpoint (Megatron's
            ``recompute_modules`` "moe"): in training, the forward keeps only its input and the
            backward recomputes it; losses and counts are made once, gradients bitwise the same.
        moe_permute_fusion: Megatron's fused permute (TE); moe-core's permute is always fused.
        moe_router_fusion: Megatron's fused router (TE); moe-core's router is always fused.
        moe_apply_probs_on_input: multiplies the probs into the expert input, not its output
            (topk 1 only).
        moe_latent_size: latent MoE: the experts run at this width, between a projection down
            from H and one back up; None: no latent projections.
        moe_mlp_glu_interleave_size: the experts' fc1 rows (GLU) in blocks of this many gate rows
            and as many linear rows, alternating (Megatron's grouped experts; GPT-OSS stores 1);
            None: gate half, linear half.
        moe_router_norm_topk_prob: HF families' renormalisation of the top-k probs (True /
            False); None: Megatron's rule (module docstring).
        moe_router_group_score_topk: a group's score is the sum of its top this-many scores;
            None: Megatron's ``topk // group_topk`` (module docstring).
        moe_input_jitter_mode: "router" (Megatron's: jitter the router's input) or "layer"
            (Mixtral's: jitter the layer's input, in training only).
        moe_alltoall_exchange: the all-to-all dispatcher's dropless exchange: "nccl" (split sizes
            read on the host) or "symm_mem" (NVSHMEM, no host read).
        moe_alltoall_recv_factor: "symm_mem"'s receive budget per rank, in units of T·k rows.
        moe_expert_rows_by_index: the experts' GEMMs read each permuted row from the tokens by
            index (less activation memory, the same bits); None: True on the CPU, False on CUDA.
    """
    # ---- the model around the layer (TransformerConfig fields the MoE layer reads) ----
    hidden_size: int = 0
    num_layers: int = 1  # only for the init of output projections: std / sqrt(2 num_layers)
    ffn_hidden_size: Optional[int] = None
    num_moe_experts: Optional[int] = None
    add_bias_linear: bool = True
    gated_linear_unit: bool = False
    activation_func: Callable = F.gelu
    glu_linear_offset: float = 0.0
    activation_func_clamp_value: Optional[float] = None
    params_dtype: torch.dtype = torch.float32
    init_method_std: float = 0.02
    calculate_per_token_loss: bool = False
    tensor_model_parallel_size: int = 1
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: Optional[int] = None
    sequence_parallel: bool = False

    # ---- MoE fields ----
    moe_ffn_hidden_size: Optional[int] = None
    moe_shared_expert_intermediate_size: Optional[int] = None
    moe_shared_expert_gate: bool = False
    moe_shared_expert_overlap: bool = False
    moe_shared_expert_glu_interleave_size: Optional[int] = None
    moe_layer_freq: Union[int, List[int]] = 1
    moe_router_load_balancing_type: Union[str, List[str]] = "aux_loss"
    moe_router_topk: int = 2
    moe_enable_routing_replay: bool = False
    moe_router_topk_limited_devices: Optional[int] = None
    moe_router_num_groups: Optional[int] = None
    moe_router_group_topk: Optional[int] = None
    moe_router_pre_softmax: bool = False
    moe_router_topk_scaling_factor: Optional[float] = None
    moe_router_score_function: str = "softmax"
    moe_router_dtype: Optional[str] = None
    moe_router_enable_expert_bias: bool = False
    moe_router_bias_update_rate: float = 1e-3
    moe_router_force_load_balancing: bool = False
    moe_router_padding_for_quantization: Optional[bool] = False
    moe_grouped_gemm: bool = False
    moe_single_grouped_weight: bool = False
    moe_single_grouped_bias: bool = False
    moe_aux_loss_coeff: Union[float, List[float]] = 0.0
    moe_z_loss_coeff: Optional[float] = None
    moe_input_jitter_eps: Optional[float] = None
    moe_token_dropping: bool = False
    moe_token_dispatcher_type: str = "allgather"
    moe_per_layer_logging: bool = False
    moe_expert_capacity_factor: Optional[float] = None
    moe_pad_expert_input_to_capacity: bool = False
    moe_token_drop_policy: str = "probs"
    moe_layer_recompute: bool = False
    moe_permute_fusion: bool = False
    moe_router_fusion: bool = False
    moe_apply_probs_on_input: bool = False
    moe_latent_size: Optional[int] = None
    moe_mlp_glu_interleave_size: Optional[int] = None

    # ---- moe-core's routing rules beyond Megatron's (see the module docstring) ----
    moe_router_norm_topk_prob: Optional[bool] = None
    moe_router_group_score_topk: Optional[int] = None
    moe_input_jitter_mode: str = "router"

    # ---- moe-core's expert-parallel exchange (see the module docstring) ----
    moe_alltoall_exchange: str = "nccl"
    moe_alltoall_recv_factor: float = 2.0

    # ---- moe-core's single-device expert path (see the module docstring) ----
    moe_expert_rows_by_index: Optional[bool] = None

    def __post_init__(self) -> None:
        def bad(field: str, why: str) -> None:
            raise ValueError(f"{field}={getattr(self, field)!r}: {why}")

        self._check_types(bad)

        if self.num_moe_experts is None or self.num_moe_experts <= 0:
            bad("num_moe_experts", "must be a positive number of experts")
        if self.hidden_size <= 0:
            bad("hidden_size", "must be > 0")
        if self.num_layers <= 0:
            bad("num_layers", "must be > 0")
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = 4 * self.hidden_size
        if self.moe_ffn_hidden_size is None:
            self.moe_ffn_hidden_size = self.ffn_hidden_size
        if self.moe_ffn_hidden_size <= 0:
            bad("moe_ffn_hidden_size", "must be > 0")
        E, k = self.num_moe_experts, self.moe_router_topk
        if not 1 <= k <= E:
            bad("moe_router_topk", f"must be in [1, num_moe_experts={E}]")
        if self.moe_router_score_function not in SCORE_FUNCTIONS:
            bad("moe_router_score_function", f"must be one of {SCORE_FUNCTIONS}")
        if self.moe_router_dtype not in (None, "fp32", "fp64"):
            bad("moe_router_dtype", "must be None, 'fp32' or 'fp64'")
        types = self.load_balancing_types
        for t in types:
            if t == "quantile_balancing":
                bad("moe_router_load_balancing_type", "quantile balancing is not implemented in moe-core yet")
            if t not in LOAD_BALANCING_TYPES:
                bad("moe_router_load_balancing_type", f"each entry must be one of {LOAD_BALANCING_TYPES}")
        if isinstance(self.moe_router_load_balancing_type, list):
            if not isinstance(self.moe_aux_loss_coeff, list) or len(self.moe_aux_loss_coeff) != len(types):
                bad("moe_aux_loss_coeff", "must be a list of the same length as moe_router_load_balancing_type")
        elif isinstance(self.moe_aux_loss_coeff, list):
            bad("moe_aux_loss_coeff", "a list needs moe_router_load_balancing_type to be a list too")
        if "sinkhorn" in types and any(c != 0 for c in self.aux_loss_coeffs):
            bad("moe_aux_loss_coeff", "sinkhorn balancing requires the aux-loss coefficient to be 0")
        if k == 1 and self.moe_router_score_function == "softmax" and not self.moe_router_pre_softmax \
                and "sinkhorn" not in types:
            bad("moe_router_topk", "top-1 softmax routing needs moe_router_pre_softmax=True "
                "(a softmax over one expert is always 1, so the router would get no gradient)")
        softmax_post = self.moe_router_score_function == "softmax" and not self.moe_router_pre_softmax
        if self.moe_router_enable_expert_bias and softmax_post:
            bad("moe_router_enable_expert_bias", "expert bias needs moe_router_score_function "
                "'sigmoid' or 'sqrtsoftplus', or softmax with moe_router_pre_softmax=True")
        norm = self.moe_router_norm_topk_prob
        if norm is not None and not isinstance(norm, bool):
            bad("moe_router_norm_topk_prob", "must be None, True or False")
        if norm is not None and softmax_post:
            bad("moe_router_norm_topk_prob", "post-softmax routing (moe_router_score_function="
                "'softmax', moe_router_pre_softmax=False) is a softmax over the k picked logits, "
                "normalised by construction; leave it None")
        if norm is not None and "sinkhorn" in types:
            bad("moe_router_norm_topk_prob", "sinkhorn routing has its own probs; leave it None")
        if norm is True and k == 1:
            bad("moe_router_norm_topk_prob", "top-1 renormalised probs are always 1.0 (the router "
                "would get no gradient)")
        if self.moe_input_jitter_mode not in ("router", "layer"):
            bad("moe_input_jitter_mode", "must be 'router' (Megatron's) or 'layer' (Mixtral's)")
        if self.moe_router_topk_limited_devices:
            if self.moe_router_group_topk:
                bad("moe_router_topk_limited_devices", "is deprecated and replaced by "
                    "moe_router_group_topk; set only one")
            self.moe_router_group_topk = self.moe_router_topk_limited_devices
            self.moe_router_num_groups = self.expert_model_parallel_size
        if self.moe_router_group_topk:
            G, gk = self.moe_router_num_groups, self.moe_router_group_topk
            if not G:
                bad("moe_router_num_groups", "must be set when moe_router_group_topk is")
            if E % G != 0:
                bad("moe_router_num_groups", f"must divide num_moe_experts={E}")
            if not 1 <= gk <= G:
                bad("moe_router_group_topk", f"must be in [1, moe_router_num_groups={G}]")
            n = self.moe_router_group_score_topk
            if n is not None and not 1 <= n <= E // G:
                bad("moe_router_group_score_topk", f"must be in [1, {E // G}] (the experts of a "
                    f"group), or None")
            if n is None and gk > k:
                bad("moe_router_group_topk", f"must be <= moe_router_topk={k}: a group's score "
                    f"sums its top topk // group_topk experts (or set moe_router_group_score_topk)")
            if gk * (E // G) < k:
                bad("moe_router_group_topk", f"must keep enough experts for moe_router_topk={k} "
                    f"(group_topk x {E // G} experts per group >= topk)")
        elif self.moe_router_group_score_topk is not None:
            bad("moe_router_group_score_topk", "needs group-limited routing "
                "(moe_router_num_groups and moe_router_group_topk)")
        cf = self.moe_expert_capacity_factor
        if cf is not None and cf < 0:
            self.moe_expert_capacity_factor = cf = None
        if cf is not None and any(t not in ("aux_loss", "seq_aux_loss", "global_aux_loss", "none")
                                  for t in types):
            bad("moe_expert_capacity_factor", "token dropping works only with aux_loss, "
                "seq_aux_loss, global_aux_loss or none balancing")
        if self.moe_pad_expert_input_to_capacity and cf is None:
            bad("moe_pad_expert_input_to_capacity", "needs moe_expert_capacity_factor")
        if self.moe_token_drop_policy not in ("probs", "position"):
            bad("moe_token_drop_policy", "must be 'probs' or 'position'")
        if self.moe_enable_routing_replay and "sinkhorn" in types:
            bad("moe_enable_routing_replay", "Sinkhorn routing has no top-k choice to record or "
                "replay (Megatron's replay wraps the top-k)")
        if self.moe_token_dropping:
            bad("moe_token_dropping", "is not supported (as in Megatron); use moe_expert_capacity_factor")
        if self.moe_apply_probs_on_input and k != 1:
            bad("moe_apply_probs_on_input", f"needs moe_router_topk=1, got {k}")
        if self.moe_shared_expert_intermediate_size is not None:
            if self.moe_shared_expert_intermediate_size <= 0:
                bad("moe_shared_expert_intermediate_size", "must be > 0")
            if self.add_bias_linear:
                bad("add_bias_linear", "the shared expert does not support biases (as in Megatron)")
        if self.moe_shared_expert_overlap:
            if self.moe_token_dispatcher_type != "alltoall":
                bad("moe_shared_expert_overlap", "needs moe_token_dispatcher_type='alltoall' (the "
                    f"shared expert runs under its exchanges), got "
                    f"{self.moe_token_dispatcher_type!r}")
            if self.moe_shared_expert_intermediate_size is None:
                bad("moe_shared_expert_overlap", "needs a shared expert to overlap "
                    "(moe_shared_expert_intermediate_size is None)")
        if self.moe_latent_size is not None and self.moe_latent_size <= 0:
            bad("moe_latent_size", "must be > 0")
        for f, width, width_name in (
                ("moe_mlp_glu_interleave_size", self.moe_ffn_hidden_size, "moe_ffn_hidden_size"),
                ("moe_shared_expert_glu_interleave_size", self.moe_shared_expert_intermediate_size,
                 "moe_shared_expert_intermediate_size")):
            s = getattr(self, f)
            if s is None:
                continue
            if s < 1:
                bad(f, "must be >= 1 or None")
            if not self.gated_linear_unit:
                bad(f, "interleaves the GLU's gate and linear rows: needs gated_linear_unit=True")
            if width is None:
                bad(f, "is for the shared expert: needs moe_shared_expert_intermediate_size")
            if width % s != 0:
                bad(f, f"must divide {width_name}={width} (whole blocks of gate and linear rows)")
        for f in ("moe_single_grouped_weight", "moe_single_grouped_bias"):
            if getattr(self, f) and not self.moe_grouped_gemm:
                bad(f, "is a layout of Megatron's grouped-GEMM experts: needs "
                    "moe_grouped_gemm=True (as in Megatron)")
        if self.moe_single_grouped_bias and not self.add_bias_linear:
            bad("moe_single_grouped_bias", "needs add_bias_linear=True (biases to group)")
        if self.moe_router_padding_for_quantization:
            bad("moe_router_padding_for_quantization", "needs fp8/fp4 training, not supported yet")
        if self.moe_router_force_load_balancing:
            bad("moe_router_force_load_balancing", "is a benchmarking mode moe-core does not implement")
        if self.moe_token_dispatcher_type not in ("allgather", "alltoall", "flex"):
            bad("moe_token_dispatcher_type", "must be 'allgather', 'alltoall' or 'flex'")
        if self.tensor_model_parallel_size != 1:
            bad("tensor_model_parallel_size", "tensor parallelism is not implemented in moe-core "
                "(expert parallelism is: expert_model_parallel_size)")
        N = self.expert_model_parallel_size
        if isinstance(N, bool) or not isinstance(N, int) or N < 1:
            bad("expert_model_parallel_size", "must be an int >= 1")
        if E % N != 0:
            bad("expert_model_parallel_size", f"must divide num_moe_experts={E} (each rank holds "
                f"the same number of experts)")
        if N > 1 and self.moe_token_dispatcher_type not in ("allgather", "alltoall"):
            bad("moe_token_dispatcher_type", f"expert parallelism (expert_model_parallel_size="
                f"{N}) runs the 'allgather' and 'alltoall' dispatchers; 'flex' needs DeepEP / "
                f"HybridEP, which moe-core does not use")
        if self.expert_tensor_parallel_size not in (None, 1):
            bad("expert_tensor_parallel_size", "expert tensor parallelism is not implemented "
                "(experts are split whole over expert_model_parallel_size ranks)")
        if self.moe_input_jitter_eps is not None and not 0 <= self.moe_input_jitter_eps < 1:
            bad("moe_input_jitter_eps", "must be in [0, 1)")
        if self.moe_alltoall_exchange not in ("nccl", "symm_mem"):
            bad("moe_alltoall_exchange", "must be 'nccl' or 'symm_mem'")
        if self.moe_alltoall_exchange == "symm_mem":
            if self.moe_token_dispatcher_type != "alltoall":
                bad("moe_alltoall_exchange", "'symm_mem' is an exchange of the all-to-all "
                    f"dispatcher: needs moe_token_dispatcher_type='alltoall', got "
                    f"{self.moe_token_dispatcher_type!r}")
            if self.moe_expert_capacity_factor is not None:
                bad("moe_alltoall_exchange", "'symm_mem' is the dropless exchange: needs "
                    f"moe_expert_capacity_factor=None, got {self.moe_expert_capacity_factor!r}")
        f = self.moe_alltoall_recv_factor
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not math.isfinite(f) \
                or f <= 0:
            bad("moe_alltoall_recv_factor", "must be a finite number > 0 (the receive budget "
                "in units of the balanced load T·topk rows)")
        if not math.isfinite(self.moe_router_bias_update_rate):
            bad("moe_router_bias_update_rate", "must be finite")

    # Field types, checked before any value is used: ints must be ints (not floats, strings or
    # bools), floats finite numbers, so a wrong value fails here, naming its field, not at forward.
    _INTS = ("hidden_size", "num_layers", "num_moe_experts", "moe_router_topk",
             "tensor_model_parallel_size", "expert_model_parallel_size")
    _OPTIONAL_INTS = ("ffn_hidden_size", "moe_ffn_hidden_size", "expert_tensor_parallel_size",
                      "moe_shared_expert_intermediate_size", "moe_router_topk_limited_devices",
                      "moe_router_num_groups", "moe_router_group_topk", "moe_latent_size",
                      "moe_router_group_score_topk", "moe_mlp_glu_interleave_size",
                      "moe_shared_expert_glu_interleave_size")
    _FLOATS = ("glu_linear_offset", "init_method_std", "moe_router_bias_update_rate")
    _OPTIONAL_FLOATS = ("activation_func_clamp_value", "moe_router_topk_scaling_factor",
                        "moe_z_loss_coeff", "moe_input_jitter_eps", "moe_expert_capacity_factor")
    _BOOLS = ("add_bias_linear", "gated_linear_unit", "calculate_per_token_loss",
              "sequence_parallel", "moe_shared_expert_gate", "moe_shared_expert_overlap",
              "moe_router_pre_softmax", "moe_router_enable_expert_bias",
              "moe_router_force_load_balancing", "moe_grouped_gemm", "moe_token_dropping",
              "moe_per_layer_logging", "moe_pad_expert_input_to_capacity", "moe_permute_fusion",
              "moe_router_fusion", "moe_apply_probs_on_input", "moe_enable_routing_replay",
              "moe_layer_recompute", "moe_single_grouped_weight", "moe_single_grouped_bias")

    def _check_types(self, bad) -> None:
        def is_int(v) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        def is_number(v) -> bool:
            return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)

        for f in self._INTS:
            if not is_int(getattr(self, f)):
                bad(f, "must be an int")
        for f in self._OPTIONAL_INTS:
            v = getattr(self, f)
            if v is not None and not is_int(v):
                bad(f, "must be an int or None")
        for f in self._FLOATS:
            if not is_number(getattr(self, f)):
                bad(f, "must be a finite number")
        for f in self._OPTIONAL_FLOATS:
            v = getattr(self, f)
            if v is not None and not is_number(v):
                bad(f, "must be a finite number or None")
        for f in self._BOOLS:
            if not isinstance(getattr(self, f), bool):
                bad(f, "must be a bool")
        if self.moe_expert_rows_by_index is not None and \
                not isinstance(self.moe_expert_rows_by_index, bool):
            bad("moe_expert_rows_by_index", "must be a bool or None")
        coeffs = self.moe_aux_loss_coeff
        for c in (coeffs if isinstance(coeffs, (list, tuple)) else [coeffs]):
            if not is_number(c):
                bad("moe_aux_loss_coeff", "must be a finite number or a list of them")
        if self.init_method_std < 0:
            bad("init_method_std", "must be >= 0")
        # a negative coefficient or rate would reward imbalance; a non-positive scale or clamp
        # bound zeroes or flips the outputs instead of scaling or bounding them
        if isinstance(coeffs, (list, tuple)) and not coeffs:
            bad("moe_aux_loss_coeff", "must not be an empty list")
        if any(c < 0 for c in (coeffs if isinstance(coeffs, (list, tuple)) else [coeffs])):
            bad("moe_aux_loss_coeff", "must be >= 0 (each entry)")
        if self.moe_router_bias_update_rate < 0:
            bad("moe_router_bias_update_rate", "must be >= 0")
        for f in ("moe_router_topk_scaling_factor", "activation_func_clamp_value"):
            v = getattr(self, f)
            if v is not None and v <= 0:
                bad(f, "must be > 0 or None")
        for f in ("ffn_hidden_size", "moe_router_topk_limited_devices", "moe_router_num_groups",
                  "moe_router_group_topk"):
            v = getattr(self, f)
            if v is not None and v < 1:
                bad(f, "must be >= 1 or None")
        freq = self.moe_layer_freq
        if isinstance(freq, (list, tuple)):
            if not freq or any(isinstance(v, bool) or v not in (0, 1) for v in freq):
                bad("moe_layer_freq", "a list must be a non-empty pattern of 0 / 1 ints (1 = MoE "
                    "layer)")
        elif not is_int(freq) or freq < 1:
            bad("moe_layer_freq", "must be an int >= 1 (every n-th layer is MoE) or a list of "
                "0 / 1 ints")
        pad = self.moe_router_padding_for_quantization
        if pad is not None and not isinstance(pad, bool):
            bad("moe_router_padding_for_quantization", "must be a bool or None")
        if self.moe_z_loss_coeff is not None and self.moe_z_loss_coeff < 0:
            bad("moe_z_loss_coeff", "must be >= 0")
        if self.params_dtype not in _PARAMS_DTYPES:
            # float8 and other storage-only dtypes have no init kernels nor GEMMs here
            bad("params_dtype", "must be a floating-point torch.dtype the layer computes in: "
                                "torch.float32, torch.bfloat16, torch.float16 or torch.float64")
        if not callable(self.activation_func):
            bad("activation_func", "must be a callable (e.g. torch.nn.functional.silu)")

    # ---- derived values ----
    @property
    def load_balancing_types(self) -> List[str]:
        t = self.moe_router_load_balancing_type
        return list(t) if isinstance(t, (list, tuple)) else [t]

    @property
    def aux_loss_coeffs(self) -> List[float]:
        c = self.moe_aux_loss_coeff
        return list(c) if isinstance(c, (list, tuple)) else [c] * len(self.load_balancing_types)

    @property
    def router_dtype(self) -> Optional[torch.dtype]:
        """torch dtype of the logits: None means the input's dtype (Megatron's default)."""
        return {None: None, "fp32": torch.float32, "fp64": torch.float64}[self.moe_router_dtype]

    @classmethod
    def from_megatron(cls, transformer_config) -> "MoEConfig":
        """The MoEConfig equal to a Megatron ``TransformerConfig`` (fields it has, by name)."""
        names = {f.name for f in dataclasses.fields(cls)}
        kwargs = {n: getattr(transformer_config, n) for n in names if hasattr(transformer_config, n)}
        if getattr(transformer_config, "recompute_granularity", None) == "selective" and \
                "moe" in (getattr(transformer_config, "recompute_modules", None) or []):
            # Megatron's current spelling of moe_layer_recompute
            kwargs["moe_layer_recompute"] = True
        if not getattr(transformer_config, "use_grouped_gemm_for_shared_expert", False):
            # Megatron reads the shared expert's interleave only on that path
            kwargs["moe_shared_expert_glu_interleave_size"] = None
        if not kwargs.get("gated_linear_unit"):
            kwargs.pop("moe_mlp_glu_interleave_size", None)  # Megatron ignores it without GLU
        if kwargs.get("moe_router_topk_limited_devices"):
            # Megatron's __post_init__ already translated it into group settings
            kwargs["moe_router_topk_limited_devices"] = None
        return cls(**kwargs)
