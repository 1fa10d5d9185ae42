"""Megatron-Core integration: moe-core's MoELayer as the MLP of Megatron's TransformerLayer.

``gpt_layer_spec(num_experts=E, ...)`` is Megatron's ``get_gpt_layer_local_spec`` with the MLP
replaced by :func:`moe_module_spec`, whose module (:class:`MoECoreMegatronLayer`) is built the way
Megatron builds its own ``MoELayer`` (``config``, ``submodules``, ``layer_number``,
``pg_collection``) and returns what Megatron's MLP returns, ``(output, bias)`` with a None bias:

    from megatron.core.models.gpt import GPTModel
    from moe_core.megatron import gpt_layer_spec

    model = GPTModel(config, gpt_layer_spec(num_experts=config.num_moe_experts), vocab, seq)

What it shares with Megatron's training loop:

* groups: ``pg_collection`` (default: Megatron's ``parallel_state``): EP from ``pg_collection.ep``,
  the aux losses' token counts over ``tp_cp``, the global aux loss and the expert bias over
  ``tp_dp_cp``. Tensor parallelism (TP / ETP > 1) is refused with a ValueError.
* the aux losses: their backward scale is Megatron's (``MoEAuxLossAutoScaler.set_loss_scale``,
  read when the backward runs), and their values go to Megatron's MoE metrics tracker under
  Megatron's names, so its ``track_moe_metrics`` logs them.
* ``finalize_model_grads``: the expert params carry Megatron's ``allreduce`` flag (False under
  EP), the router exposes ``expert_bias`` / ``local_tokens_per_expert`` (Megatron updates the
  bias itself), and ``reset_global_aux_loss_tracker`` resets the global aux loss's counts.
* checkpoints: ``sharded_state_dict`` gives Megatron's SequentialMLP layout (the same sharded
  keys, shapes, offsets and replica ids), so a distributed checkpoint saved with Megatron's MoE
  layer loads into this one and back; ``load_state_dict`` takes Megatron's per-expert keys as
  well as moe-core's stacked ones (``state_dict`` gives moe-core's).

Not supported (ValueError naming it): TP / ETP > 1, multi-token-prediction layers, fp8 / fp4,
the latent projections (Megatron builds them from TransformerEngine), Megatron's
``intermediate_tensors`` (partial CUDA-graph capture of the layer), and the MoE fields of
``_UNSUPPORTED_FIELDS`` (forced biased routing, per-rank capacity, fp8 padding, paged stash, and
TransformerEngine's interleaved GLU and single grouped layouts, which Megatron's local spec
ignores). Routing replay (``moe_enable_routing_replay``, ``moe_core.replay``) and the layer's
recompute (``moe_layer_recompute``, or "moe" in the selective ``recompute_modules``) carry over
through ``MoEConfig.from_megatron``.
"""
import functools
from typing import Optional

import torch
import torch.distributed as dist

from moe_core.config import MoEConfig
from moe_core.layer import MoELayer, megatron_state_dict_to_moe_core
from moe_core.ops.aux_loss_autoscaler import AuxLossScale


@functools.lru_cache(maxsize=None)
def _megatron():
    """Megatron-Core's modules this integration uses (imported on first use, quietly: it warns
    about TransformerEngine and apex)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core import utils
        from megatron.core.dist_checkpointing.utils import replace_prefix_for_sharding
        from megatron.core.transformer import mlp
        from megatron.core.transformer.moe import moe_logging, moe_utils
        from megatron.core.transformer.utils import (ensure_metadata_has_dp_cp_group,
                                                     make_sharded_tensors_for_checkpoint)
        from megatron.core.utils import make_sharded_tensor_for_checkpoint
    return dict(utils=utils, replace_prefix=replace_prefix_for_sharding, mlp=mlp,
                moe_logging=moe_logging, moe_utils=moe_utils,
                ensure_metadata=ensure_metadata_has_dp_cp_group,
                make_sharded=make_sharded_tensors_for_checkpoint,
                make_sharded_tensor=make_sharded_tensor_for_checkpoint)


class _MegatronLossScale(AuxLossScale):
    """The aux losses' backward scale as Megatron's schedule sets it: Megatron's class-wide
    ``MoEAuxLossAutoScaler.main_loss_backward_scale`` (None: 1), read when the backward runs."""

    def __init__(self) -> None:
        super().__init__(1.0)
        self._scaler = _megatron()["moe_utils"].MoEAuxLossAutoScaler

    @property
    def value(self) -> torch.Tensor:
        scale = self._scaler.main_loss_backward_scale
        return self._value if scale is None else scale.detach().reshape(()).float()


# Megatron's MoE fields that change what its layer computes or stores and that this layer does
# not implement: refused unless unset / False (performance knobs of its kernels are not here). The
# GLU interleaves and the single grouped layouts are options of Megatron's TransformerEngine
# experts, which its local spec (the layout this layer follows, sharded_state_dict included)
# ignores; moe_core.MoELayer takes them directly.
_UNSUPPORTED_FIELDS = ("moe_mlp_glu_interleave_size", "moe_shared_expert_glu_interleave_size",
                       "moe_router_force_biased", "moe_expert_rank_capacity_factor",
                       "moe_router_padding_for_fp8", "moe_grad_scale_func",
                       "moe_single_grouped_weight", "moe_single_grouped_bias", "moe_paged_stash")

# Megatron's tracker arguments per loss (router.py: attach_and_log_load_balancing_loss and
# apply_z_loss): the group the value is summed over, averaged over, and whether it is then
# averaged over the data-parallel ranks.
_TRACKED = {"load_balancing_loss": ("tp_cp", None, True),
            "seq_load_balancing_loss": ("tp_cp", None, True),
            "global_load_balancing_loss": ("tp_dp_cp", None, False),
            "z_loss": (None, "tp_dp_cp", True)}


class MoECoreMegatronLayer(MoELayer):
    """moe-core's MoELayer with the interface of Megatron-Core's ``MoELayer`` (module docstring).

    Submodules and parameters are moe-core's (router, experts, shared_experts); the Megatron
    ``TransformerConfig`` is kept as ``megatron_config``, the process groups as
    ``pg_collection``."""

    def __init__(self, config, submodules=None, layer_number: Optional[int] = None,
                 pg_collection=None, is_mtp_layer: bool = False, name: Optional[str] = None):
        """
        Args:
            config: Megatron's ``TransformerConfig`` (its MoE fields: ``MoEConfig.from_megatron``).
            submodules: must be None: moe-core builds its own router and experts (a Megatron
                ``MoESubmodules`` here would be ignored, so it is refused).
            layer_number: Megatron's 1-based layer number (the tracker's row); also set by
                ``set_layer_number``.
            pg_collection: Megatron's ``ProcessGroupCollection`` (ep, tp, tp_cp, tp_dp_cp,
                expt_tp, expt_dp); None: built from ``parallel_state``.
            is_mtp_layer: must be False (multi-token prediction layers are not supported).
            name: Megatron's module name (unused).
        """
        meg = _megatron()
        for field in ("tensor_model_parallel_size", "expert_tensor_parallel_size"):
            value = getattr(config, field, 1)
            if value not in (None, 1):
                raise ValueError(f"{field}={value}: moe-core's Megatron layer runs without tensor "
                                 f"parallelism (TP = ETP = 1); expert parallelism is supported")
        if submodules is not None:
            raise ValueError(f"submodules={type(submodules).__name__}: moe-core's layer builds "
                             f"its own router and experts; use moe_core.megatron.moe_module_spec()")
        if is_mtp_layer:
            raise ValueError("is_mtp_layer=True: multi-token prediction layers are not supported "
                             "by moe-core's Megatron layer")
        for field in ("fp8", "fp4"):
            if getattr(config, field, None):
                raise ValueError(f"{field}={getattr(config, field)!r}: moe-core's Megatron layer "
                                 f"does not run fp8 / fp4")
        for field in _UNSUPPORTED_FIELDS:
            if getattr(config, field, None):
                raise ValueError(f"{field}={getattr(config, field)!r}: not supported by "
                                 f"moe-core's Megatron layer (leave it unset)")
        if getattr(config, "moe_latent_size", None):
            raise ValueError(f"moe_latent_size={config.moe_latent_size}: Megatron builds the "
                             f"latent projections from TransformerEngine; moe-core's Megatron "
                             f"layer does not match that layout (use moe_core.MoELayer directly)")
        if pg_collection is None:
            pg_collection = meg["moe_utils"].get_default_pg_collection()
        for group in ("tp", "expt_tp"):
            size = meg["utils"].get_pg_size(getattr(pg_collection, group, None))
            if size > 1:
                raise ValueError(f"pg_collection.{group} has {size} ranks: moe-core's Megatron "
                                 f"layer runs without tensor parallelism (TP = ETP = 1)")
        ep_size = meg["utils"].get_pg_size(pg_collection.ep)
        device = None
        if not getattr(config, "use_cpu_initialization", False) and torch.cuda.is_available():
            device = torch.device("cuda", torch.cuda.current_device())
        super().__init__(MoEConfig.from_megatron(config),
                         ep_group=pg_collection.ep if ep_size > 1 else None,
                         layer_number=layer_number, tp_cp_group=pg_collection.tp_cp,
                         tp_dp_cp_group=getattr(pg_collection, "tp_dp_cp", None)
                         or dist.group.WORLD, device=device)
        self.megatron_config = config
        self.pg_collection = pg_collection
        self._loss_scale = _MegatronLossScale()
        for p in self.experts.parameters():
            # Megatron's DDP and finalize_model_grads reduce these over expert-DP under EP
            p.allreduce = ep_size == 1
        self._register_load_state_dict_pre_hook(self._megatron_keys_hook)

    def set_layer_number(self, layer_number: int) -> None:
        """Megatron's TransformerLayer calls it with its 1-based layer number."""
        self.layer_number = layer_number

    def reset_global_aux_loss_tracker(self) -> None:
        """Megatron's name (``finalize_model_grads`` calls it once per global batch): zero the
        global aux loss's running counts."""
        self.router.reset_global_aux_loss()

    def forward(self, hidden_states: torch.Tensor, intermediate_tensors=None,
                padding_mask: Optional[torch.Tensor] = None):
        """Megatron's MoELayer call.

        Args:
            hidden_states: ``[S, B, H]`` in the parameters' dtype.
            intermediate_tensors: must be None (Megatron's partial CUDA-graph capture).
            padding_mask: bool ``[B, S]``, True = padding (Megatron's GPTModel convention), or
                None.

        Returns:
            ``(output [S, B, H], None)``: Megatron's MLP output and (no) bias.
        """
        if intermediate_tensors is not None:
            raise ValueError("intermediate_tensors: Megatron's partial CUDA-graph capture of the "
                             "MoE layer is not supported by moe-core's layer")
        with self._loss_scale:
            out = super().forward(hidden_states, padding_mask)
        self._track_losses()
        return out, None

    def _track_losses(self) -> None:
        """The last forward's aux / z losses (divided by their coefficients) into Megatron's MoE
        metrics tracker, with Megatron's names, rows and groups."""
        if self.layer_number is None or not self.router.last_losses:
            return
        tracker = _megatron()["moe_logging"].get_moe_metrics_tracker()
        groups = dict(tp_cp=self.tp_cp_group, tp_dp_cp=self.router.data_parallel_group())
        num_layers = self.megatron_config.num_layers
        if getattr(self.megatron_config, "mtp_num_layers", None):
            num_layers += self.megatron_config.mtp_num_layers
        for loss_name, value in self.router.last_losses.items():
            reduce, avg, dp_avg = _TRACKED[loss_name]
            tracker.record(loss_name, value, self.layer_number, num_layers,
                           reduce_group=groups.get(reduce), avg_group=groups.get(avg),
                           needs_dp_avg=dp_avg)

    # ---- checkpoints ----------------------------------------------------------------------
    def _megatron_keys_hook(self, state_dict, prefix, local_metadata, strict,
                            missing_keys, unexpected_keys, error_msgs) -> None:
        """Before loading: Megatron's per-expert keys under ``prefix`` become moe-core's stacked
        ones (``moe_core.layer.megatron_state_dict_to_moe_core``); other keys pass."""
        mine = {k[len(prefix):]: v for k, v in state_dict.items() if k.startswith(prefix)}
        if not any(k.startswith("experts.local_experts.") or k.endswith("_extra_state")
                   or k.startswith("experts.linear_fc") for k in mine):
            return
        for k in mine:
            del state_dict[prefix + k]
        for k, v in megatron_state_dict_to_moe_core(mine, self.experts.num_local_experts).items():
            state_dict[prefix + k] = v

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (),
                           metadata: Optional[dict] = None) -> dict:
        """Megatron's distributed-checkpoint view of the layer, in the layout of Megatron's own
        MoELayer with SequentialMLP experts (the local spec): the router's weight (bias, expert
        bias), each local expert's ``linear_fc1`` / ``linear_fc2`` under the global expert axis
        (GLU fc1 split into its two halves, as Megatron's swiglu factory does), the shared
        expert's linears and gate. The tensors are views of this layer's parameters, so
        ``dist_checkpointing.load`` returns them under the dict keys ``load_state_dict`` takes.
        ``metadata['singleton_local_shards']`` is honoured as Megatron does.
        """
        meg = _megatron()
        metadata = meg["ensure_metadata"](metadata)
        dp_cp = metadata["dp_cp_group"]
        pg = self.pg_collection
        singleton = metadata.get("singleton_local_shards", False)
        glu = self.config.gated_linear_unit
        make = meg["make_sharded"]
        swiglu = meg["mlp"].apply_swiglu_sharded_factory
        out = {}

        router = {"weight": self.router.weight}
        if self.router.bias is not None:
            router["bias"] = self.router.bias
        if self.router.expert_bias is not None:
            router["expert_bias"] = self.router.expert_bias
        out.update(make(router, f"{prefix}router.", {}, sharded_offsets, tp_group=pg.tp,
                        dp_cp_group=dp_cp))

        def linears(fc1: dict, fc2: dict, state_prefix: str, offsets: tuple, tp_group) -> dict:
            sd = {}
            for name, params, axes in (("linear_fc1", fc1, {"weight": 0, "bias": 0}),
                                       ("linear_fc2", fc2, {"weight": 1})):
                sub = make(dict(params, _extra_state=None), f"{state_prefix}{name}.", axes,
                           offsets, tp_group=tp_group, dp_cp_group=dp_cp)
                if glu and name == "linear_fc1":
                    for kind in ("weight", "bias"):
                        key = f"{state_prefix}{name}.{kind}"
                        if key in sub:
                            sub[key] = swiglu(sub[key], offsets, singleton, tp_group=tp_group,
                                              dp_group=dp_cp)
                sd.update(sub)
            return sd

        ex = self.experts
        E_local = ex.num_local_experts
        ep_size = meg["utils"].get_pg_size(pg.ep)
        ep_rank = meg["utils"].get_pg_rank(pg.ep)
        edp_rank = meg["utils"].get_pg_rank(pg.expt_dp)
        for i in range(E_local):
            g = ep_rank * E_local + i
            fc1 = {"weight": ex.weight1[i]}
            fc2 = {"weight": ex.weight2[i]}
            if ex.bias1 is not None:
                fc1["bias"], fc2["bias"] = ex.bias1[i], ex.bias2[i]
            state_prefix = f"{prefix}experts.local_experts.{i}."
            if singleton:
                sharded_prefix, offsets = f"{prefix}experts.experts.{g}.", sharded_offsets
            else:
                sharded_prefix = f"{prefix}experts.experts."
                offsets = (*sharded_offsets, (len(sharded_offsets), g, ep_size * E_local))
            sd = linears(fc1, fc2, state_prefix, offsets, pg.expt_tp)
            meg["replace_prefix"](sd, state_prefix, sharded_prefix)
            for sh in sd.values():  # replicated over expert-DP, as Megatron's SequentialMLP
                sh.replica_id = (*sh.replica_id[:2], edp_rank)
            out.update(sd)

        se = self.shared_experts
        if se is not None:
            out.update(linears({"weight": se.linear_fc1.weight}, {"weight": se.linear_fc2.weight},
                               f"{prefix}shared_experts.", sharded_offsets, pg.tp))
            if se.gate_weight is not None:
                key = f"{prefix}shared_experts.gate_weight"
                out[key] = meg["make_sharded_tensor"](se.gate_weight, key,
                                                      prepend_offsets=sharded_offsets,
                                                      tp_group=pg.tp, dp_cp_group=dp_cp)
        return out


def moe_module_spec():
    """A Megatron ``ModuleSpec`` for the MLP of a MoE ``TransformerLayer``: moe-core's layer
    (:class:`MoECoreMegatronLayer`), built with Megatron's arguments."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    return ModuleSpec(module=MoECoreMegatronLayer)


def gpt_layer_spec(*args, **kwargs):
    """Megatron's ``get_gpt_layer_local_spec(*args, **kwargs)`` (same arguments) with its MLP
    replaced by :func:`moe_module_spec`.

    Raises:
        ValueError: ``num_experts`` is None (a dense layer: nothing to replace).
    """
    import inspect
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.models.gpt.gpt_layer_specs import (get_gpt_layer_local_spec,
                                                              get_gpt_layer_local_submodules)
    bound = inspect.signature(get_gpt_layer_local_submodules).bind(*args, **kwargs)
    if bound.arguments.get("num_experts") is None:
        raise ValueError("num_experts=None: a dense GPT layer has no MoE MLP for moe-core to "
                         "replace; pass num_experts")
    spec = get_gpt_layer_local_spec(*args, **kwargs)
    spec.submodules.mlp = moe_module_spec()
    return spec
