"""torchtitan's own MoE module (``torchtitan.models.common.moe.MoE``) built tiny on the CPU, and
an fp64 reference of its math, for the swap's parity tests.

torchtitan runs its experts' GEMMs in bf16 whatever the parameters' dtype, so its output is
compared with the fp64 reference at bf16's scale, and moe-core's (fp32) at fp32's: the reference
is torchtitan's formulas written out here (router scores, expert bias for the choice, group
limit by top-2 sums, top-k, renormalisation, scale; SwiGLU experts weighted by the scores;
shared FeedForward), so both sides are held to the same independent truth.
"""
import functools
import warnings
from typing import Dict, Optional

import torch
import torch.nn.functional as F
from torch import nn

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from torchtitan.models.common.config_utils import (make_ffn_config, make_moe_config,
                                                       make_routed_experts_config,
                                                       make_router_config)

D, FFN, E, K, SHARED = 16, 8, 8, 2, 6


def _normal(std: float) -> dict:
    return {"weight": functools.partial(nn.init.normal_, std=std)}


def build(score_func: str = "sigmoid", route_norm: bool = True, route_scale: float = 1.0,
          num_expert_groups: Optional[int] = None, num_limited_groups: Optional[int] = None,
          load_balance_coeff: Optional[float] = 1e-3, shared: bool = False, top_k: int = K,
          seed: int = 0) -> nn.Module:
    """A torchtitan MoE (D=16, F=8, E=8) with random weights (and a random expert bias)."""
    torch.manual_seed(seed)
    experts_init = {k: functools.partial(nn.init.normal_, std=0.3)
                    for k in ("w1_EFD", "w2_EDF", "w3_EFD")}
    cfg = make_moe_config(
        num_experts=E,
        router=make_router_config(dim=D, num_experts=E, gate_param_init=_normal(0.5),
                                  top_k=top_k, score_func=score_func, route_norm=route_norm,
                                  route_scale=route_scale, num_expert_groups=num_expert_groups,
                                  num_limited_groups=num_limited_groups),
        routed_experts=make_routed_experts_config(dim=D, hidden_dim=FFN, num_experts=E,
                                                  top_k=top_k, param_init=experts_init,
                                                  comm_backend="standard"),
        shared_experts=(make_ffn_config(dim=D, hidden_dim=SHARED, w1_param_init=_normal(0.3),
                                        w2w3_param_init=_normal(0.3)) if shared else None),
        load_balance_coeff=load_balance_coeff)
    module = cfg.build()
    module.init_states()
    if load_balance_coeff is not None:
        with torch.no_grad():
            module.expert_bias_E.normal_(0.0, 0.05)
    return module


def weights64(module: nn.Module) -> Dict[str, torch.Tensor]:
    """The module's weights as fp64 leaves (requires_grad), by torchtitan's names."""
    return {k: v.detach().double().requires_grad_(k != "expert_bias_E")
            for k, v in module.state_dict().items()}


def reference(module: nn.Module, w: Dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """torchtitan's MoE math on ``x`` ``[B, L, D]`` with the weights ``w`` (any dtype)."""
    r = module.router
    B, L, _ = x.shape
    xt = x.reshape(B * L, -1)
    logits = xt @ w["router.gate.weight"].t()
    scores = torch.sigmoid(logits) if r.score_func == "sigmoid" else torch.softmax(logits, -1)
    choice = scores + w["expert_bias_E"] if "expert_bias_E" in w else scores
    if r.num_expert_groups is not None:
        G = r.num_expert_groups
        grouped = choice.unflatten(-1, (G, -1))
        group_scores = grouped.topk(2, dim=-1).values.sum(-1)
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(
            -1, group_scores.topk(r.num_limited_groups, dim=-1).indices, True)
        choice = grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).flatten(-2)
    ids = choice.topk(r.top_k, dim=-1).indices
    top = scores.gather(-1, ids)
    if r.route_norm:
        top = top / (top.sum(-1, keepdim=True) + 1e-20)
    top = top * r.route_scale
    pre = "routed_experts.inner_experts."
    w1, w2, w3 = w[pre + "w1_EFD"], w[pre + "w2_EDF"], w[pre + "w3_EFD"]
    out = torch.zeros_like(xt)
    for k in range(r.top_k):
        e = ids[:, k]
        h = F.silu(torch.einsum("td,tfd->tf", xt, w1[e])) * torch.einsum("td,tfd->tf", xt, w3[e])
        out = out + torch.einsum("tf,tdf->td", h, w2[e]) * top[:, k:k + 1]
    if module.shared_experts is not None:
        s = F.silu(xt @ w["shared_experts.w1.weight"].t()) * (xt @ w["shared_experts.w3.weight"].t())
        out = out + s @ w["shared_experts.w2.weight"].t()
    return out.reshape(B, L, -1)


def qwen3(n_layers: int = 2, dim: int = 32, vocab: int = 64, seed: int = 0) -> nn.Module:
    """A tiny torchtitan Qwen3 MoE model (its own config builders: 8 experts, top-2, softmax with
    renormalisation, the expert bias), weights initialised by torchtitan."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from torchtitan.models.common import Embedding, Linear
        from torchtitan.models.common.rope import CosSinRoPE
        from torchtitan.models.qwen3 import (_EMBEDDING_INIT, _LINEAR_INIT,
                                             _build_qwen3_moe_layers, _qwen3_norm)
        from torchtitan.models.qwen3.model import Qwen3Model
    head = 8
    cfg = Qwen3Model.Config(
        vocab_size=vocab, dim=dim, norm=_qwen3_norm(dim),
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim,
                                        param_init=_EMBEDDING_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=_LINEAR_INIT),
        layers=_build_qwen3_moe_layers(
            n_layers=n_layers, dim=dim, n_heads=4, n_kv_heads=2, head_dim=head,
            moe_hidden_dim=16, num_experts=8, top_k=2, attn_backend="flex",
            moe_comm_backend="standard",
            rope=CosSinRoPE.Config(dim=head, max_seq_len=64, theta=10000.0)))
    torch.manual_seed(seed)
    model = cfg.build()
    model.init_states()
    return model
