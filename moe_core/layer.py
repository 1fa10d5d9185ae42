"""MoELayer: route -> dispatch -> experts -> combine, a drop-in for Megatron-Core's MoELayer.

forward(hidden [S, B, H] or [T, H], padding_mask=None) returns a tensor of the input's shape:

    shared = shared_experts(hidden)                         (if configured; before routing)
    probs, routing_map = router(hidden, padding_mask)       [T, E] each
    x = fc1_latent_proj(hidden)                             (latent MoE only, H -> L)
    rows, row_probs, sorted_indices, expert_offsets, _ = permute(x, routing_map, probs, bound)
    y = experts(rows, expert_offsets, row_probs)            grouped GEMMs
    out = unpermute(y, sorted_indices, x.shape)             per-token gather-sum, fixed order
    out = fc2_latent_proj(out) + shared

No step reads a device value on the host: the permuted buffer is sized by a static bound
(T·topk dropless; E·capacity with pad-to-capacity; T·topk with dropping, the kept count staying in
expert_offsets[-1]), so the layer runs under torch.compile(fullgraph=True) and in CUDA graphs.
"""
from typing import Optional

import torch
from torch import nn

from moe_core import ops
from moe_core.config import MoEConfig
from moe_core.experts import GroupedMLP, SharedExpertMLP
from moe_core.router import TopKRouter


class MoELayer(nn.Module):
    """Submodules (Megatron's names): router, experts, shared_experts (optional),
    fc1_latent_proj / fc2_latent_proj (with moe_latent_size)."""

    def __init__(self, config: MoEConfig, layer_number: Optional[int] = None):
        super().__init__()
        self.config = config
        self.layer_number = layer_number
        H, L = config.hidden_size, config.moe_latent_size
        self.router = TopKRouter(config)
        if L:
            dt = config.params_dtype
            self.fc1_latent_proj = nn.Linear(H, L, bias=config.add_bias_linear, dtype=dt)
            self.fc2_latent_proj = nn.Linear(L, H, bias=config.add_bias_linear, dtype=dt)
            with torch.no_grad():
                std = config.init_method_std
                nn.init.normal_(self.fc1_latent_proj.weight, 0.0, std)
                nn.init.normal_(self.fc2_latent_proj.weight, 0.0, std / (2.0 * config.num_layers) ** 0.5)
                for lin in (self.fc1_latent_proj, self.fc2_latent_proj):
                    if lin.bias is not None:
                        lin.bias.zero_()
        else:
            self.fc1_latent_proj = self.fc2_latent_proj = None
        self.experts = GroupedMLP(config, input_size=L or H)
        self.shared_experts = (SharedExpertMLP(config)
                               if config.moe_shared_expert_intermediate_size is not None else None)

    def num_permuted_rows(self, num_tokens: int) -> int:
        """Static size of the permuted buffer for ``num_tokens`` tokens (no host sync needed)."""
        cfg = self.config
        cf = cfg.moe_expert_capacity_factor
        if cf is not None and cfg.moe_pad_expert_input_to_capacity:
            cap = ops.get_capacity(num_tokens * cfg.moe_router_topk, cfg.num_moe_experts, cf)
            return cfg.num_moe_experts * min(cap, num_tokens)
        return num_tokens * cfg.moe_router_topk

    def forward(self, hidden_states: torch.Tensor,
                padding_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The layer.

        Args:
            hidden_states: ``[S, B, H]`` (Megatron's layout) or ``[T, H]``, the activation dtype.
            padding_mask: bool, True = padding: ``[B, S]`` for a ``[S, B, H]`` input (Megatron's
                GPTModel convention) or ``[T]`` for ``[T, H]``; padded tokens are still computed
                but leave the aux/z losses and the expert-bias counts alone.

        Returns:
            The output, of ``hidden_states``' shape and dtype.
        """
        if hidden_states.dim() not in (2, 3) or hidden_states.shape[-1] != self.config.hidden_size:
            raise ValueError(f"hidden_states must be [S, B, {self.config.hidden_size}] or "
                             f"[T, {self.config.hidden_size}], got {tuple(hidden_states.shape)}")
        if padding_mask is not None:
            padding_mask = self._padding_mask(padding_mask, hidden_states)
        shared = self.shared_experts(hidden_states) if self.shared_experts is not None else None
        probs, routing_map = self.router(hidden_states, padding_mask)
        x = hidden_states.reshape(-1, hidden_states.shape[-1])
        if self.fc1_latent_proj is not None:
            x = self.fc1_latent_proj(x)
        rows, row_probs, sorted_indices, expert_offsets, _ = ops.permute(
            x, routing_map, probs, num_out_tokens=self.num_permuted_rows(x.shape[0]))
        y = self.experts(rows, expert_offsets, row_probs)
        out = ops.unpermute(y, sorted_indices, restore_shape=x.shape)
        if self.fc2_latent_proj is not None:
            out = self.fc2_latent_proj(out)
        out = out.reshape(hidden_states.shape)
        if shared is not None:
            out = out + shared
        return out

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


def moe_layers(model: nn.Module):
    """Every MoELayer in ``model``."""
    return [m for m in model.modules() if isinstance(m, MoELayer)]


@torch.no_grad()
def update_expert_bias(model: nn.Module, group=None) -> None:
    """After each optimizer step (Megatron: finalize_model_grads): update the expert bias of every
    router in training mode that has one, from the token counts since the last call, all-reduced
    over ``group`` (the data-parallel group) when given."""
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
    """Load a Megatron MoELayer's weights (local SequentialMLP naming
    ``experts.local_experts.{i}.linear_fc{1,2}.{weight,bias}`` or TE grouped naming
    ``experts.linear_fc{1,2}.{weight,bias}{i}``) into ``layer``. Router, shared-expert and latent
    keys share Megatron's names. Returns torch's (missing, unexpected) keys result."""
    E = layer.config.num_moe_experts
    out, stacks = {}, {}
    for key, value in state_dict.items():
        if key.endswith("_extra_state") or value is None:
            continue
        name = key
        for fc, ours in (("linear_fc1", "1"), ("linear_fc2", "2")):
            for kind in ("weight", "bias"):
                local = f"experts.local_experts."
                if key.startswith(local) and key.endswith(f".{fc}.{kind}"):
                    i = int(key[len(local):].split(".")[0])
                    stacks.setdefault(f"experts.{kind}{ours}", {})[i] = value
                    name = None
                te = f"experts.{fc}.{kind}"
                if key.startswith(te) and key[len(te):].isdigit():
                    stacks.setdefault(f"experts.{kind}{ours}", {})[int(key[len(te):])] = value
                    name = None
        if name is not None:
            out[name] = value
    for name, parts in stacks.items():
        if sorted(parts) != list(range(E)):
            raise ValueError(f"{name}: expected experts 0..{E - 1} in the state dict, got "
                             f"{sorted(parts)}")
        out[name] = torch.stack([parts[i] for i in range(E)])
    return layer.load_state_dict(out, strict=strict)
