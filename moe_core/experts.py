"""GroupedMLP: all local experts' MLPs as two grouped GEMMs over expert-sorted rows.

Numerics follow Megatron's expert MLP (SequentialMLP / TEGroupedMLP, unfused path), step by step:

    [x <- (p * x).to(x.dtype); p <- 1]          if moe_apply_probs_on_input (topk = 1)
    a = x @ W1_eᵀ (+ b1_e)                       grouped GEMM, fp32 accumulation, x.dtype out
    h = act(a), or act(a_gate) * (a_lin + glu_linear_offset) with gated_linear_unit
        (gate half clamped to max=v, linear half to [-v, v] with activation_func_clamp_value)
    h = (h * p).to(h.dtype)                      the router probs, multiplied in the router dtype
                                                 (the two lines above are one ops.glu_probs pass
                                                 when the activation is one it knows; without
                                                 bias1, fc1 and that pass are one op,
                                                 ops.grouped_gemm_glu_probs, same bits)
    y = h @ W2_eᵀ (+ b2_e * p)                   grouped GEMM

Without biases, with an activation ops.glu_probs knows and the probs applied after the activation
(Megatron's default), the whole MLP is one op, ops.expert_mlp, with the same bits: its backward
keeps only fc1's output (not x, not h; x is gathered again from the unpermuted tokens when the
caller says where it came from) and works in place.

Weights are stored per expert in Megatron's ``nn.Linear`` layout (``[E, out, in]``), so a stack of
Megatron's per-expert ``linear_fc1.weight`` / ``linear_fc2.weight`` loads as is.

Under ``torch.autocast`` the experts run as ``nn.Linear`` does there: the rows and the weights
(biases too) cast to the autocast dtype before the GEMMs, the gradient carried back through the
cast to the parameters in their own dtype. Autocast casts only the inputs of the torch ops it
lists, never a custom op's, so the module casts (:func:`autocast_dtype`, :func:`autocast_to`).
"""
import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from moe_core import ops
from moe_core.config import MoEConfig


def apply_activation(config: MoEConfig, a: torch.Tensor,
                     glu_interleave_size: Optional[int] = None) -> torch.Tensor:
    """Megatron's MLP activation (unfused path), GLU-aware. a: ``[rows, F or 2F]``; with
    ``glu_interleave_size`` s, a GLU's columns come in alternating blocks of s gate and s linear
    ones, gathered into the two halves first (a copy, as Megatron's unfused path makes)."""
    if not config.gated_linear_unit:
        return config.activation_func(a)
    if glu_interleave_size:
        a = deinterleave_glu(a, glu_interleave_size)
    a_glu, a_linear = torch.chunk(a, 2, dim=-1)
    v = config.activation_func_clamp_value
    if v is not None:
        a_glu = a_glu.clamp(min=None, max=v)
        a_linear = a_linear.clamp(min=-v, max=v)
    return config.activation_func(a_glu) * (a_linear + config.glu_linear_offset)


def deinterleave_glu(a: torch.Tensor, size: int) -> torch.Tensor:
    """``a`` ``[..., 2F]`` with blocks of ``size`` gate and ``size`` linear columns alternating
    (Megatron's interleaved GLU layout) as ``[gate F | linear F]``: a copy."""
    shape = a.shape
    return a.reshape(-1, shape[-1] // (2 * size), 2, size).transpose(1, 2).reshape(shape)


def activation_times_probs(config: MoEConfig, a: torch.Tensor,
                           probs: Optional[torch.Tensor]) -> torch.Tensor:
    """``(apply_activation(config, a) * probs[:, None]).to(a.dtype)`` (no multiply when probs is
    None) for the routed experts (``moe_mlp_glu_interleave_size``'s layout). a: ``[rows, F or
    2F]``, probs: ``[rows]``; returns ``[rows, F]`` in a's dtype.

    When the activation is one ``ops.glu_probs`` knows (``ops.activation_name``), the fused op does
    it in one pass with the same rounding (reading interleaved columns where they are); otherwise
    (a user's callable) the unfused torch ops run.
    """
    name = ops.activation_name(config.activation_func)
    interleave = config.moe_mlp_glu_interleave_size
    if name is None:
        h = apply_activation(config, a, interleave)
        return h if probs is None else (h * probs.unsqueeze(-1)).to(h.dtype)
    gated = config.gated_linear_unit
    return ops.glu_probs(a, probs, name, gated, config.glu_linear_offset if gated else 0.0,
                         config.activation_func_clamp_value if gated else None, interleave)


def autocast_dtype(t: torch.Tensor) -> Optional[torch.dtype]:
    """The dtype ``nn.Linear`` runs in on ``t``'s device inside a ``torch.autocast`` region
    (``torch.get_autocast_dtype``), or None outside one."""
    device_type = t.device.type
    if not torch.is_autocast_enabled(device_type):
        return None
    return torch.get_autocast_dtype(device_type)


def autocast_to(t: Optional[torch.Tensor], dtype: Optional[torch.dtype]) -> Optional[torch.Tensor]:
    """``t`` cast to ``dtype`` as autocast casts ``nn.Linear``'s input and weight: fp32 / fp16 /
    bf16 tensors only (fp64 stays fp64); ``t`` itself when ``dtype`` is None (no autocast) or
    ``t`` already has it. Differentiable: the gradient reaches ``t`` in ``t``'s dtype."""
    if dtype is None or t is None or t.dtype == dtype or \
            t.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return t
    return t.to(dtype)


def uninitialized_linear(in_features: int, out_features: int, bias: bool,
                         device: Optional[torch.device], dtype: torch.dtype) -> nn.Linear:
    """An ``nn.Linear`` with uninitialised storage on ``device`` (None: torch's default device,
    which honours ``with torch.device(...)``): nn.Linear's own init would draw random numbers
    that the owner's ``reset_parameters`` then overwrites, so a layer built and a layer reset
    would consume the generator differently."""
    lin = nn.Linear(in_features, out_features, bias=bias, device="meta", dtype=dtype)
    return lin.to_empty(device=device if device is not None else torch.get_default_device())


def reads_rows_by_index(config: MoEConfig) -> bool:
    """True when the experts of ``config`` can run without the rows: the whole MLP is then
    ``ops.expert_mlp``, whose GEMMs read each row from the tokens by index, so the caller need
    not make the ``[rows, H]`` rows at all. (The unfused path, for a bias, probs on the input or
    an activation outside glu_probs, needs the rows.) Read from the config alone, so a wrapper
    around the experts module (PEFT's parameter LoRA) does not hide it."""
    return (not config.add_bias_linear and ops.activation_name(config.activation_func) is not None
            and not config.moe_apply_probs_on_input)


class GroupedMLP(nn.Module):
    """The routed experts of this rank.

    Parameters (``E`` local experts: ``num_moe_experts / ep_size``, the global experts
    ``[ep_rank·E, (ep_rank+1)·E)``; ``H`` = hidden or latent size, ``F`` = moe_ffn_hidden_size,
    ``F1`` = 2F with GLU else F), in ``config.params_dtype``, each marked with its
    ``expert_parallel_size``:
        weight1 ``[E, F1, H]``, weight2 ``[E, H, F]``; bias1 ``[E, F1]``, bias2 ``[E, H]`` when
        ``add_bias_linear``. With GLU, weight1's (and bias1's) F1 = 2F rows are the gate rows
        then the linear rows, or with ``moe_mlp_glu_interleave_size`` s alternating blocks of s
        gate and s linear rows (the kernels read that layout as it is).
    """

    def __init__(self, config: MoEConfig, input_size: Optional[int] = None, ep_size: int = 1,
                 ep_rank: int = 0, *, device: Optional[torch.device] = None,
                 dtype: Optional[torch.dtype] = None):
        """dtype: the parameters' dtype (default ``config.params_dtype``); device: where they are
        created and initialised (``"meta"``: shapes only, then ``to_empty`` and
        :meth:`reset_parameters`)."""
        super().__init__()
        self.config = config
        self.ep_size, self.ep_rank = ep_size, ep_rank
        self.num_local_experts = config.num_moe_experts // ep_size
        E, F_ = self.num_local_experts, config.moe_ffn_hidden_size
        H = input_size or config.hidden_size
        F1 = 2 * F_ if config.gated_linear_unit else F_
        self.input_size, self.ffn_size = H, F_
        kw = dict(device=device, dtype=dtype or config.params_dtype)
        self.weight1 = nn.Parameter(torch.empty(E, F1, H, **kw))
        self.weight2 = nn.Parameter(torch.empty(E, H, F_, **kw))
        if config.add_bias_linear:
            self.bias1 = nn.Parameter(torch.empty(E, F1, **kw))
            self.bias2 = nn.Parameter(torch.empty(E, H, **kw))
        else:
            self.register_parameter("bias1", None)
            self.register_parameter("bias2", None)
        for p in self.parameters():
            # split over the EP group of this size: reduced over expert-DP only (parallel.py)
            p.expert_parallel_size = ep_size
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Megatron's init: N(0, std) for fc1, N(0, std / sqrt(2 num_layers)) for fc2, zero bias.

        Drawn expert by expert over all ``num_moe_experts`` experts, keeping this rank's: with
        the same seed, every EP size initialises the same global weights."""
        std = self.config.init_method_std
        std2 = std / math.sqrt(2.0 * self.config.num_layers)
        lo = self.ep_rank * self.num_local_experts
        with torch.no_grad():
            for w, s in ((self.weight1, std), (self.weight2, std2)):
                one = torch.empty_like(w[0])
                for e in range(self.config.num_moe_experts):
                    nn.init.normal_(one, 0.0, s)
                    if lo <= e < lo + self.num_local_experts:
                        w[e - lo].copy_(one)
            if self.bias1 is not None:
                self.bias1.zero_()
                self.bias2.zero_()

    def extra_repr(self) -> str:
        s = (f"num_local_experts={self.num_local_experts}, input_size={self.input_size}, "
             f"ffn_hidden_size={self.ffn_size}, gated_linear_unit={self.config.gated_linear_unit}, "
             f"bias={self.bias1 is not None}, dtype={self.weight1.dtype}")
        if self.ep_size > 1:
            s += f", experts {self.ep_rank * self.num_local_experts}.." \
                 f"{(self.ep_rank + 1) * self.num_local_experts - 1} of {self.config.num_moe_experts}"
        return s

    @property
    def reads_rows_by_index(self) -> bool:
        """:func:`reads_rows_by_index` of this module's config."""
        return reads_rows_by_index(self.config)

    def forward(self, x: torch.Tensor, layout: "ops.RoutingLayout",
                rows: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The experts on routed tokens, combined: each token's sum of its rows' outputs (the
        experts own the combine on one device: their backward then makes the rows' gradient
        itself and frees it as soon as fc2's backward is done with it).

        Args:
            x: ``[T, H]`` the tokens (activation dtype).
            layout: their :class:`moe_core.ops.RoutingLayout` (local experts).
            rows: ``[R, H]`` ``x``'s rows in the layout's order, made with the layout
                (``ops.permute_tokens``; they carry the gradient to ``x``), or None where
                :attr:`reads_rows_by_index`: the GEMMs then read each row from ``x`` by index.

        Returns:
            ``[T, H]`` in x's dtype (under autocast: the autocast dtype, as ``nn.Linear``).
        """
        dtype = autocast_dtype(x)
        x, rows = autocast_to(x, dtype), autocast_to(rows, dtype)
        if self.reads_rows_by_index:
            # fc1, the activation, the probs, fc2 and the combine as one op that keeps only fc1's
            # output for the backward (ops/expert_mlp.py); the same bits as the ops below
            return self._expert_mlp(rows, layout.expert_offsets, layout.row_probs, x,
                                    layout.sorted_indices)
        if rows is None:
            raise ValueError("GroupedMLP: these experts (a bias, probs on the input or an "
                             "activation outside glu_probs) run on the rows: pass rows=, made "
                             "with the layout by ops.permute_tokens")
        return ops.combine(self.forward_rows(rows, layout.expert_offsets, layout.row_probs),
                           layout)

    def forward_rows(self, rows: torch.Tensor, expert_offsets: torch.Tensor,
                     probs: torch.Tensor) -> torch.Tensor:
        """The experts on rows already grouped by expert (what an expert-parallel dispatcher
        receives): each row's output, not combined.

        Args:
            rows: ``[R, H]`` expert-sorted rows (activation dtype); expert ``e`` owns
                ``rows[expert_offsets[e]:expert_offsets[e + 1]]``.
            expert_offsets: ``[E + 1]`` int64 row offsets on rows' device (local experts).
            probs: ``[R]`` router probs of each row (router dtype).

        Returns:
            ``[R, H]`` in rows' dtype (under autocast: the autocast dtype, as ``nn.Linear``).
        """
        dtype = autocast_dtype(rows)
        rows = autocast_to(rows, dtype)
        if self.reads_rows_by_index:
            return self._expert_mlp(rows, expert_offsets, probs)
        cfg = self.config
        name = ops.activation_name(cfg.activation_func)
        w1, w2 = autocast_to(self.weight1, dtype), autocast_to(self.weight2, dtype)
        b1, b2 = autocast_to(self.bias1, dtype), autocast_to(self.bias2, dtype)
        x = rows
        if cfg.moe_apply_probs_on_input:
            x = (probs.unsqueeze(-1) * x).to(x.dtype)
            probs = torch.ones_like(probs)
        row_expert = None
        if b1 is None and name is not None:
            # fc1, the activation and the probs multiply as one op (the bias would have to be
            # added between the two, so with a bias the unfused path below runs)
            gated = cfg.gated_linear_unit
            h, _ = ops.grouped_gemm_glu_probs(
                x, w1, expert_offsets, probs, name, gated,
                cfg.glu_linear_offset if gated else 0.0,
                cfg.activation_func_clamp_value if gated else None, trans_w=True,
                glu_interleave_size=cfg.moe_mlp_glu_interleave_size)
        else:
            a = ops.grouped_gemm(x, w1, expert_offsets, trans_w=True)
            if b1 is not None:
                row_expert = self._row_expert(expert_offsets, x.shape[0])
                a = a + b1[row_expert]
            h = activation_times_probs(cfg, a, probs)
        y = ops.grouped_gemm(h, w2, expert_offsets, trans_w=True)
        if b2 is not None:
            y = y + (b2[row_expert] * probs.unsqueeze(-1)).to(y.dtype)
        return y

    def _expert_mlp(self, rows: Optional[torch.Tensor], expert_offsets: torch.Tensor,
                    probs: torch.Tensor, tokens: Optional[torch.Tensor] = None,
                    sorted_indices: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``ops.expert_mlp`` with this module's weights and activation; with ``tokens`` and
        ``sorted_indices`` it also combines (``[T, H]``), else it returns the rows' outputs."""
        cfg = self.config
        gated = cfg.gated_linear_unit
        dtype = autocast_dtype(rows if rows is not None else tokens)
        return ops.expert_mlp(
            rows, autocast_to(self.weight1, dtype), autocast_to(self.weight2, dtype),
            expert_offsets, probs,
            ops.activation_name(cfg.activation_func), gated,
            cfg.glu_linear_offset if gated else 0.0,
            cfg.activation_func_clamp_value if gated else None, tokens, sorted_indices,
            combine=tokens is not None, glu_interleave_size=cfg.moe_mlp_glu_interleave_size)

    @staticmethod
    def _row_expert(expert_offsets: torch.Tensor, rows: int) -> torch.Tensor:
        """Expert id of every row, on the device (rows past the last offset get the last id)."""
        ids = torch.searchsorted(expert_offsets[1:], torch.arange(rows, device=expert_offsets.device),
                                 right=True)
        return ids.clamp_max(expert_offsets.numel() - 2)


class SharedExpertMLP(nn.Module):
    """Megatron's shared expert: a dense MLP on every token, with an optional sigmoid gate.

    Parameters (Megatron's names): linear_fc1.weight ``[F1, H]`` (with GLU: gate rows then linear
    rows, or blocks of ``moe_shared_expert_glu_interleave_size``), linear_fc2.weight ``[H, F]``
    with ``F`` = moe_shared_expert_intermediate_size (no biases, as Megatron requires);
    gate_weight ``[1, H]`` when ``moe_shared_expert_gate``.
    """

    def __init__(self, config: MoEConfig, *, device: Optional[torch.device] = None,
                 dtype: Optional[torch.dtype] = None):
        """dtype: the parameters' dtype (default ``config.params_dtype``); device: where they are
        created and initialised."""
        super().__init__()
        self.config = config
        H, F_ = config.hidden_size, config.moe_shared_expert_intermediate_size
        F1 = 2 * F_ if config.gated_linear_unit else F_
        kw = dict(device=device, dtype=dtype or config.params_dtype)
        self.linear_fc1 = uninitialized_linear(H, F1, bias=False, **kw)
        self.linear_fc2 = uninitialized_linear(F_, H, bias=False, **kw)
        if config.moe_shared_expert_gate:
            self.gate_weight = nn.Parameter(torch.empty(1, H, **kw))
        else:
            self.register_parameter("gate_weight", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        std = self.config.init_method_std
        with torch.no_grad():
            nn.init.normal_(self.linear_fc1.weight, 0.0, std)
            nn.init.normal_(self.linear_fc2.weight, 0.0, std / math.sqrt(2.0 * self.config.num_layers))
            if self.gate_weight is not None:
                nn.init.normal_(self.gate_weight, 0.0, std)

    def extra_repr(self) -> str:
        return f"gate={self.gate_weight is not None}"

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden ``[..., H]`` → ``[..., H]`` in hidden's dtype."""
        out = self.linear_fc2(apply_activation(self.config, self.linear_fc1(hidden),
                                               self.config.moe_shared_expert_glu_interleave_size))
        if self.gate_weight is not None:
            out = out * torch.sigmoid(F.linear(hidden, self.gate_weight))
        return out
