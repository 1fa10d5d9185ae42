"""Aux-loss scores, the switch / seq / global aux losses, z-loss and the autoscaler,
against megatron-core's own functions (forward and backward), plus opcheck and fp64 gradcheck."""
import warnings

import pytest
import torch

import moe_core.ops as ops
from helpers.tolerances import assert_close_ulps
from helpers.world_group import world_group  # noqa: F401  (fixture)

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from megatron.core.transformer.moe import moe_utils as mcore

SCORE_FUNCTIONS = ops.SCORE_FUNCTIONS


def _pad(num_tokens, frac=0.3, device="cpu"):
    pad = torch.rand(num_tokens) < frac
    pad[0] = False
    pad[-1] = True
    return pad.to(device)


def assert_maps_equal_up_to_ties(ours, ref, scores, k):
    """Maps equal except in rows whose k-th and (k+1)-th best scores tie (torch.topk picks any
    of the tied experts there; moe_core picks the lowest index)."""
    ref = ref.bool()
    if k < scores.shape[1]:
        top = scores.float().topk(k + 1, dim=1).values
        tied = top[:, k - 1] == top[:, k]
    else:
        tied = torch.zeros(scores.shape[0], dtype=torch.bool, device=scores.device)
    assert torch.equal(ours[~tied], ref[~tied])
    assert torch.equal(ours.sum(1), ref.sum(1))


def _close(ours, ref, n_ulps=8, dtype=torch.float32, rel_to_max=False, msg=""):
    floor = ref.detach().abs().max().item() if rel_to_max else 0.0
    assert_close_ulps(ours, ref, n_ulps=n_ulps, floor=floor, dtype=dtype, msg=msg)


# ---- compute_routing_scores_for_aux_loss ----------------------------------------------------


@pytest.mark.parametrize("score_function", SCORE_FUNCTIONS)
@pytest.mark.parametrize("topk", [1, 3])
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_aux_scores_match_megatron(score_function, topk, padded, dtype, device):
    T, E = 37, 12
    base = (torch.randn(T, E) * 2).to(dtype).to(device)
    pad = _pad(T, device=device) if padded else None
    x_ours = base.clone().requires_grad_()
    x_ref = base.clone().requires_grad_()
    map_ours, s_ours = ops.compute_routing_scores_for_aux_loss(x_ours, topk, score_function,
                                                               padding_mask=pad)
    map_ref, s_ref = mcore.compute_routing_scores_for_aux_loss(x_ref, topk, score_function,
                                                               padding_mask=pad)
    assert map_ours.dtype == torch.bool and s_ours.dtype == torch.float32
    assert_maps_equal_up_to_ties(map_ours, map_ref, s_ref, topk)
    _close(s_ours, s_ref, msg="scores")
    w = torch.randn(T, E, device=device)
    (s_ours * w).sum().backward()
    (s_ref * w).sum().backward()
    assert x_ours.grad.dtype == dtype
    _close(x_ours.grad, x_ref.grad, n_ulps=16, dtype=dtype, rel_to_max=True, msg="grad")
    if padded:
        assert not s_ours[pad].any() and not map_ours[pad].any() and not x_ours.grad[pad].any()


def test_aux_scores_ties_go_to_lowest_index(device):
    logits = torch.zeros(2, 6, device=device)
    logits[1, 4] = logits[1, 2] = 1.0
    routing_map, _ = ops.compute_routing_scores_for_aux_loss(logits, 2, "softmax")
    assert routing_map[0].nonzero().flatten().tolist() == [0, 1]
    assert routing_map[1].nonzero().flatten().tolist() == [2, 4]


def test_aux_scores_accept_megatron_sb_padding_mask():
    S, B, E = 5, 3, 8
    logits = torch.randn(S * B, E)
    pad_sb = torch.rand(S, B) < 0.4
    m1, s1 = ops.compute_routing_scores_for_aux_loss(logits, 2, "sigmoid", padding_mask=pad_sb)
    m2, s2 = ops.compute_routing_scores_for_aux_loss(logits, 2, "sigmoid",
                                                     padding_mask=pad_sb.reshape(-1))
    assert torch.equal(m1, m2) and torch.equal(s1, s2)


# ---- switch_load_balancing_loss_func ----------------------------------------------------------


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("total_as_tensor", [False, True])
def test_switch_loss_matches_megatron(padded, total_as_tensor, device):
    T, E, k, coeff = 50, 16, 4, 0.37
    probs = torch.softmax(torch.randn(T, E), -1).to(device)
    counts = torch.randint(0, 30, (E,)).to(device)
    total = torch.tensor(123.0, device=device) if total_as_tensor else 123
    pad = _pad(T, device=device) if padded else None
    p_ours = probs.clone().requires_grad_()
    p_ref = probs.clone().requires_grad_()
    ours = ops.switch_load_balancing_loss_func(p_ours, counts, total, k, E, coeff,
                                               padding_mask=pad)
    # Megatron's own function takes True = valid; ours True = padding everywhere
    ref = mcore.switch_load_balancing_loss_func(p_ref, counts, total, k, E, coeff,
                                                padding_mask=None if pad is None else ~pad)
    assert ours.dtype == torch.float32 and ours.dim() == 0
    _close(ours, ref, n_ulps=8)
    ours.backward()
    ref.backward()
    _close(p_ours.grad, p_ref.grad, n_ulps=4)


def test_switch_loss_uniform_routing_equals_coeff(device):
    T, E, k = 64, 8, 2
    probs = torch.full((T, E), 1.0 / E, device=device)
    counts = torch.full((E,), T * k // E, device=device)
    loss = ops.switch_load_balancing_loss_func(probs, counts, T, k, E, 0.01)
    assert abs(loss.item() - 0.01) < 1e-8


# ---- micro-batch, sequence and global aux losses, as Megatron's router composes them ---------


def _megatron_scores(logits, k, sf, pad):
    return mcore.compute_routing_scores_for_aux_loss(logits, k, sf, padding_mask=pad)


@pytest.mark.parametrize("score_function", ["softmax", "sigmoid"])
@pytest.mark.parametrize("padded", [False, True])
def test_micro_batch_aux_loss_matches_megatron(world_group, score_function, padded,  # noqa: F811
                                               device):
    T, E, k, coeff = 40, 8, 2, 1e-2
    base = torch.randn(T, E).to(device)
    pad = _pad(T, device=device) if padded else None
    x1, x2 = base.clone().requires_grad_(), base.clone().requires_grad_()
    m, s = ops.compute_routing_scores_for_aux_loss(x1, k, score_function, padding_mask=pad)
    ours = ops.load_balancing_loss(s, m, k, E, coeff, padding_mask=pad, reduce_group=world_group)
    rm, rs = _megatron_scores(x2, k, score_function, pad)
    tpe, _, total = mcore.get_tokens_per_expert_and_token_count(
        rm, world_group, topk=k, with_padding_mask=pad is not None)
    ref = mcore.switch_load_balancing_loss_func(rs, tpe, total, k, E, coeff)
    _close(ours, ref, n_ulps=16)
    ours.backward()
    ref.backward()
    _close(x1.grad, x2.grad, n_ulps=32, rel_to_max=True)


@pytest.mark.parametrize("padded", [False, True])
def test_seq_aux_loss_matches_megatron(world_group, padded):  # noqa: F811
    S, B, E, k, coeff = 9, 3, 8, 2, 0.1
    for micro_batch in range(3):
        base = torch.randn(S * B, E)
        pad = _pad(S * B) if padded else None
        x1, x2 = base.clone().requires_grad_(), base.clone().requires_grad_()
        m, s = ops.compute_routing_scores_for_aux_loss(x1, k, "softmax", padding_mask=pad)
        ours = ops.seq_load_balancing_loss(s, m, S, B, k, E, coeff, padding_mask=pad,
                                           reduce_group=world_group)
        rm, rs = _megatron_scores(x2, k, "softmax", pad)
        rs, rm = rs.reshape(S, -1), rm.reshape(S, -1)
        tpe, _, total = mcore.get_tokens_per_expert_and_token_count(
            rm, world_group, topk=k * B, with_padding_mask=pad is not None)
        ref = mcore.switch_load_balancing_loss_func(rs, tpe, total, k, E, coeff) / B
        _close(ours, ref, n_ulps=16, msg=f"micro-batch {micro_batch}")
        ours.backward()
        ref.backward()
        _close(x1.grad, x2.grad, n_ulps=32, rel_to_max=True, msg=f"micro-batch {micro_batch}")


@pytest.mark.parametrize("padded", [False, True])
def test_global_aux_loss_matches_megatron_over_micro_batches(world_group, padded):  # noqa: F811
    T, E, k, coeff = 24, 8, 2, 0.05
    buffer = ops.GlobalAuxLossBuffer(E)
    ref_buf = torch.zeros(E, dtype=torch.float32)
    ref_steps = torch.tensor(0, dtype=torch.float32)
    for global_batch in range(2):
        for micro_batch in range(3):
            base = torch.randn(T, E) * (1 + micro_batch)
            pad = _pad(T) if padded else None
            x1, x2 = base.clone().requires_grad_(), base.clone().requires_grad_()
            m, s = ops.compute_routing_scores_for_aux_loss(x1, k, "sigmoid", padding_mask=pad)
            ours = ops.global_load_balancing_loss(s, m, k, E, coeff, buffer, padding_mask=pad,
                                                  reduce_group=world_group)
            rm, rs = _megatron_scores(x2, k, "sigmoid", pad)
            tpe, _, total = mcore.get_tokens_per_expert_and_token_count(
                rm, world_group, topk=k, with_padding_mask=pad is not None)
            ref_buf += tpe
            ref_steps += 1
            ref = mcore.switch_load_balancing_loss_func(rs, ref_buf / ref_steps, total, k, E,
                                                        coeff)
            where = f"global batch {global_batch} micro-batch {micro_batch}"
            assert torch.equal(buffer.tokens_per_expert, ref_buf), where
            _close(ours, ref, n_ulps=16, msg=where)
            ours.backward()
            ref.backward()
            _close(x1.grad, x2.grad, n_ulps=32, rel_to_max=True, msg=where)
        buffer.reset()  # once per global batch, where Megatron's finalize_model_grads does it
        ref_buf.zero_()
        ref_steps.zero_()
        assert not buffer.tokens_per_expert.any() and buffer.steps.item() == 0


def test_get_tokens_per_expert_and_token_count_matches_megatron(world_group):  # noqa: F811
    routing_map = torch.rand(20, 6) < 0.3
    for with_mask in (False, True):
        ours = ops.get_tokens_per_expert_and_token_count(routing_map, world_group, 2, with_mask)
        ref = mcore.get_tokens_per_expert_and_token_count(routing_map, world_group, 2, with_mask)
        assert torch.equal(ours[0], ref[0])
        for a, b in zip(ours[1:], ref[1:]):
            assert float(a) == float(b)


# ---- z-loss ---------------------------------------------------------------------------------


@pytest.mark.parametrize("padded", [False, True])
def test_z_loss_matches_megatron(padded, device):
    T, E, coeff = 33, 10, 1e-3
    base = (torch.randn(T, E) * 3).to(device)
    pad = _pad(T, device=device) if padded else None
    x1, x2 = base.clone().requires_grad_(), base.clone().requires_grad_()
    ours = ops.z_loss_func(x1, coeff, padding_mask=pad)
    ref = mcore.z_loss_func(x2, coeff, padding_mask=pad)
    assert ours.dtype == torch.float32 and ours.dim() == 0
    _close(ours, ref, n_ulps=8)
    ours.backward()
    ref.backward()
    _close(x1.grad, x2.grad, n_ulps=8, rel_to_max=True)


def test_z_loss_all_padding_is_zero(device):
    logits = torch.randn(4, 5, device=device, requires_grad=True)
    loss = ops.z_loss_func(logits, 0.1, padding_mask=torch.ones(4, dtype=torch.bool, device=device))
    loss.backward()
    assert loss.item() == 0.0 and not logits.grad.any()


def test_z_loss_zero_tokens_with_a_mask_is_zero(device):
    """An empty padding mask is a mask with no valid token (loss 0 = 0 / max(0, 1)), not "no
    mask" (whose mean over zero tokens is NaN, as torch.mean's)."""
    logits = torch.randn(0, 5, device=device)
    masked = ops.z_loss_func(logits, 0.1, padding_mask=torch.zeros(0, dtype=torch.bool, device=device))
    assert masked.item() == 0.0
    assert ops.z_loss_func(logits, 0.1).isnan().item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize("masked", [False, True])
def test_z_loss_backward_of_zero_tokens(masked, dtype, device):
    """0 tokens: the backward gives an empty [0, E] gradient, as autograd does through Megatron's
    z_loss_func (loss NaN without a mask, 0 with an empty one); no error from the empty tensors'
    missing storage."""
    pad = torch.zeros(0, dtype=torch.bool, device=device) if masked else None
    x1 = torch.zeros(0, 6, dtype=dtype, device=device, requires_grad=True)
    x2 = torch.zeros(0, 6, dtype=dtype, device=device, requires_grad=True)
    ours = ops.z_loss_func(x1, 0.1, padding_mask=pad)
    ref = mcore.z_loss_func(x2, 0.1, padding_mask=pad)
    assert torch.equal(ours.isnan(), ref.isnan()) and ours.isnan().item() != masked
    ours.backward()
    ref.backward()
    assert x1.grad.dtype == x2.grad.dtype == dtype
    assert x1.grad.shape == x2.grad.shape == (0, 6)


def test_z_loss_bf16_is_more_accurate_than_megatron(device):
    logits = (torch.randn(64, 16) * 4).to(torch.bfloat16).to(device)
    truth = torch.logsumexp(logits.double(), -1).square().mean() * 0.01
    ours = ops.z_loss_func(logits, 0.01)
    ref = mcore.z_loss_func(logits, 0.01)
    assert abs(ours.double() - truth).item() <= abs(ref.double() - truth).item()


# ---- MoEAuxLossAutoScaler -------------------------------------------------------------------


def _router_chain(impl, x, weight, k, coeff, z_coeff, pad, scale):
    """A router's forward as Megatron composes it; returns the main loss."""
    logits = x @ weight.t()
    z = impl.z_loss_func(logits, z_coeff, padding_mask=pad)
    logits = impl.MoEAuxLossAutoScaler.apply(logits, z, *scale)
    probs, routing_map = ops.topk_routing_with_score_function(logits, k, score_function="softmax",
                                                              use_pre_softmax=True)
    m, s = impl.compute_routing_scores_for_aux_loss(logits, k, "softmax", padding_mask=pad)
    counts = m.sum(0)
    total = (counts.sum() / k) if pad is not None else x.shape[0]
    aux = impl.switch_load_balancing_loss_func(s, counts, total, k, weight.shape[0], coeff)
    probs = impl.MoEAuxLossAutoScaler.apply(probs, aux, *scale)
    return (probs * torch.arange(1.0, weight.shape[0] + 1)).sum(), aux, z


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("scale", [1.0, 0.25, 3.0])
def test_autoscaler_gradient_is_main_plus_scaled_aux(padded, scale):
    T, H, E, k = 30, 16, 8, 2
    x = torch.randn(T, H)
    w0 = torch.randn(E, H) * 0.3
    pad = _pad(T) if padded else None

    # reference 1: plain autograd of main + scale * (aux + z), no autoscaler
    w_ref = w0.clone().requires_grad_()
    logits = x @ w_ref.t()
    z = mcore.z_loss_func(logits, 1e-2, padding_mask=pad)
    probs, _ = ops.topk_routing_with_score_function(logits, k, use_pre_softmax=True)
    m, s = mcore.compute_routing_scores_for_aux_loss(logits, k, "softmax", padding_mask=pad)
    counts = m.sum(0)
    total = (counts.sum() / k) if pad is not None else T
    aux = mcore.switch_load_balancing_loss_func(s, counts, total, k, E, 0.1)
    main = (probs * torch.arange(1.0, E + 1)).sum()
    (main + scale * (aux + z)).backward()

    # reference 2: Megatron's autoscaler (class attribute set explicitly)
    mcore.MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(scale))
    w_meg = w0.clone().requires_grad_()
    main_meg, _, _ = _router_chain(mcore, x, w_meg, k, 0.1, 1e-2, pad, ())
    main_meg.backward()
    mcore.MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0))

    # ours, with a scoped scale
    w_ours = w0.clone().requires_grad_()
    with ops.AuxLossScale(scale):
        main_ours, aux_ours, z_ours = _router_chain(ops, x, w_ours, k, 0.1, 1e-2, pad, ())
    main_ours.backward()

    _close(w_meg.grad, w_ref.grad, n_ulps=64, rel_to_max=True, msg="megatron vs plain")
    _close(w_ours.grad, w_ref.grad, n_ulps=64, rel_to_max=True, msg="ours vs plain")
    _close(w_ours.grad, w_meg.grad, n_ulps=64, rel_to_max=True, msg="ours vs megatron")
    _close(main_ours, main, n_ulps=4)


def _grad_of_aux_through_scaler(scale_arg=(), setup=None):
    x = torch.ones(3, requires_grad=True)
    aux = (x * 2.0).sum()
    out = ops.MoEAuxLossAutoScaler.apply(torch.zeros(2, requires_grad=True), aux, *scale_arg)
    if setup is not None:
        setup()
    out.sum().backward()
    return x.grad[0].item() / 2.0  # d(scale * 2x)/dx / 2 = scale


def test_autoscaler_default_scale_is_one():
    ops.MoEAuxLossAutoScaler.reset_loss_scale()
    assert _grad_of_aux_through_scaler() == 1.0


def test_autoscaler_explicit_scale_per_call():
    assert _grad_of_aux_through_scaler((ops.AuxLossScale(0.5),)) == 0.5
    assert _grad_of_aux_through_scaler((4.0,)) == 4.0
    assert _grad_of_aux_through_scaler((torch.tensor(2.5),)) == 2.5


def test_autoscaler_scope_does_not_leak():
    ops.MoEAuxLossAutoScaler.reset_loss_scale()
    with ops.AuxLossScale(8.0) as scale:
        assert _grad_of_aux_through_scaler() == 8.0
        ops.MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(6.0))  # writes the scope's holder
        assert scale.value.item() == 6.0
    assert _grad_of_aux_through_scaler() == 1.0  # the default was never touched


def test_autoscaler_scale_set_after_forward_is_used():
    # Megatron's schedule sets the scale after the forward and before the backward
    holder = ops.AuxLossScale()
    with holder:
        assert _grad_of_aux_through_scaler(setup=lambda: holder.set(torch.tensor(7.0))) == 7.0


def test_autoscaler_two_layers_keep_their_own_scales():
    a, b = ops.AuxLossScale(2.0), ops.AuxLossScale(5.0)
    x = torch.ones(1, requires_grad=True)
    y = torch.ones(1, requires_grad=True)
    h = torch.zeros(1, requires_grad=True)
    h1 = ops.MoEAuxLossAutoScaler.apply(h, x.sum() * 1.0, a)
    h2 = ops.MoEAuxLossAutoScaler.apply(h1, y.sum() * 1.0, b)
    h2.sum().backward()
    assert x.grad.item() == 2.0 and y.grad.item() == 5.0


def test_autoscaler_megatron_compatible_unscoped_set():
    try:
        ops.MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(3.0))
        assert _grad_of_aux_through_scaler() == 3.0
    finally:
        ops.MoEAuxLossAutoScaler.reset_loss_scale()
    assert _grad_of_aux_through_scaler() == 1.0


def test_autoscaler_forward_is_identity_and_passes_the_gradient():
    out = torch.randn(4, 3, requires_grad=True)
    aux = torch.tensor(1.0, requires_grad=True)
    y = ops.MoEAuxLossAutoScaler.apply(out, aux, 2.0)
    assert torch.equal(y, out)
    g = torch.randn(4, 3)
    y.backward(g)
    assert torch.equal(out.grad, g) and aux.grad.item() == 2.0


# ---- opcheck and fp64 gradcheck -------------------------------------------------------------


def _opcheck(op, args):
    torch.library.opcheck(op, args)


@pytest.mark.parametrize("score_function", SCORE_FUNCTIONS)
@pytest.mark.parametrize("padded", [False, True])
def test_opcheck_aux_loss_scores(score_function, padded, device):
    T, E = 7, 5
    logits = torch.randn(T, E, device=device, requires_grad=True)
    pad = _pad(T, device=device) if padded else None
    _opcheck(torch.ops.moe_core.aux_loss_scores.default, (logits, 2, score_function, pad))
    _opcheck(torch.ops.moe_core.aux_loss_scores_bwd.default,
             (torch.randn(T, E, device=device), logits.detach(), score_function, pad))


@pytest.mark.parametrize("padded", [False, True])
def test_opcheck_switch_and_z_loss(padded, device):
    T, E = 9, 6
    pad = _pad(T, device=device) if padded else None
    probs = torch.rand(T, E, device=device, requires_grad=True)
    counts = torch.randint(0, 9, (E,), device=device).float()
    total = torch.tensor(17.0, dtype=torch.float64, device=device)
    _opcheck(torch.ops.moe_core.switch_aux_loss.default, (probs, counts, total, 2, E, 0.1, pad))
    _opcheck(torch.ops.moe_core.switch_aux_loss_bwd.default,
             (torch.tensor(1.5, device=device), probs.detach(), counts, total, 2, E, 0.1, pad))
    logits = torch.randn(T, E, device=device, requires_grad=True)
    _opcheck(torch.ops.moe_core.z_loss.default, (logits, 0.01, pad))
    _opcheck(torch.ops.moe_core.z_loss_bwd.default,
             (torch.tensor(2.0, device=device), logits.detach(), 0.01, pad))


def test_opcheck_tokens_per_expert():
    routing_map = torch.rand(11, 4) < 0.5
    _opcheck(torch.ops.moe_core.tokens_per_expert.default, (routing_map, None))
    _opcheck(torch.ops.moe_core.tokens_per_expert.default, (routing_map, _pad(11)))


@pytest.mark.parametrize("score_function", SCORE_FUNCTIONS)
@pytest.mark.parametrize("padded", [False, True])
def test_gradcheck_aux_loss_scores_fp64(score_function, padded, device):
    T, E = 6, 5
    logits = torch.randn(T, E, dtype=torch.float64, device=device, requires_grad=True)
    pad = _pad(T, device=device) if padded else None
    fn = lambda x: ops.compute_routing_scores_for_aux_loss(x, 2, score_function,  # noqa: E731
                                                           padding_mask=pad)[1]
    assert torch.autograd.gradcheck(fn, (logits,))


@pytest.mark.parametrize("padded", [False, True])
def test_gradcheck_switch_and_z_loss_fp64(padded, device):
    T, E = 6, 5
    pad = _pad(T, device=device) if padded else None
    probs = torch.rand(T, E, dtype=torch.float64, device=device, requires_grad=True)
    counts = torch.randint(0, 9, (E,), device=device)
    assert torch.autograd.gradcheck(
        lambda p: ops.switch_load_balancing_loss_func(p, counts, 13, 2, E, 0.3, padding_mask=pad),
        (probs,))
    logits = torch.randn(T, E, dtype=torch.float64, device=device, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x: ops.z_loss_func(x, 0.2, padding_mask=pad),
                                    (logits,))


def test_gradcheck_seq_aux_loss_fp64():
    S, B, E = 4, 2, 5
    logits = torch.randn(S * B, E, dtype=torch.float64, requires_grad=True)

    def fn(x):
        m, s = ops.compute_routing_scores_for_aux_loss(x, 2, "sigmoid")
        return ops.seq_load_balancing_loss(s, m, S, B, 2, E, 0.1)

    assert torch.autograd.gradcheck(fn, (logits,))


def test_losses_are_deterministic(device):
    logits = torch.randn(300, 32, device=device, requires_grad=True)
    outs = []
    for _ in range(2):
        m, s = ops.compute_routing_scores_for_aux_loss(logits, 4, "softmax")
        loss = ops.load_balancing_loss(s, m, 4, 32, 0.01) + ops.z_loss_func(logits, 0.001)
        (g,) = torch.autograd.grad(loss, logits)
        outs.append((loss.detach(), g))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


def test_losses_compile_fullgraph():
    """The loss ops trace under torch.compile(fullgraph=True) (fake kernels, no graph breaks)."""
    def fn(logits, pad):
        m, s = ops.compute_routing_scores_for_aux_loss(logits, 2, "sigmoid", padding_mask=pad)
        counts = ops.tokens_per_expert(m)
        total = counts.sum() / 2
        aux = ops.switch_load_balancing_loss_func(s, counts, total, 2, 8, 0.01)
        return aux + ops.z_loss_func(logits, 1e-3, padding_mask=pad)

    logits = torch.randn(16, 8, requires_grad=True)
    pad = _pad(16)
    eager = fn(logits, pad)
    (g_eager,) = torch.autograd.grad(eager, logits)
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")(logits, pad)
    (g_comp,) = torch.autograd.grad(compiled, logits)
    assert torch.equal(eager, compiled) and torch.equal(g_eager, g_comp)


def test_autoscaler_compiles_fullgraph_with_a_scale_holder():
    def fn(x, w, scale):
        logits = x @ w.t()
        z = ops.z_loss_func(logits, 1e-2)
        return ops.MoEAuxLossAutoScaler.apply(logits, z, scale).sum()

    x = torch.randn(8, 4)
    scale = ops.AuxLossScale()
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    for value in (2.0, 5.0):  # the holder's current value is used, not a traced constant
        scale.set(value)
        w = torch.randn(6, 4, requires_grad=True)
        compiled(x, w, scale).backward()
        g_compiled = w.grad
        w.grad = None
        fn(x, w, scale).backward()
        assert torch.equal(g_compiled, w.grad)
