"""Routing replay (moe_enable_routing_replay): the same weights and replayed indices through
megatron-core's real MoELayer with its RouterReplay and through ours, forward and backward.

Both layers run in fp32, so the tolerance is a few fp32 roundings at the tensor's scale (the two
sides sum the same products in different orders); routing maps and expert-bias counts exactly.
"""
import copy
import gc

import pytest
import torch
import torch.nn.functional as F

from helpers import megatron_layer
from megatron.core.transformer.moe.router_replay import RouterReplay as MegatronRouterReplay
from megatron.core.transformer.moe.router_replay import RouterReplayAction as MegatronAction
from moe_core import MoEConfig, MoELayer, RouterReplay, RouterReplayAction, load_megatron_state_dict
from moe_core.ops import AuxLossScale

H, FFN, S, B = 32, 48, 12, 2

BASE = dict(hidden_size=H, moe_ffn_hidden_size=FFN, num_moe_experts=8, moe_router_topk=2,
            add_bias_linear=False, gated_linear_unit=True, activation_func=F.silu,
            moe_aux_loss_coeff=1e-2, moe_enable_routing_replay=True)

CASES = {
    "softmax_post_aux": dict(),
    "softmax_pre_z_loss": dict(moe_router_pre_softmax=True, moe_z_loss_coeff=1e-3),
    "sigmoid_groups_bias_scaling": dict(
        num_moe_experts=16, moe_router_topk=4, moe_router_score_function="sigmoid",
        moe_router_num_groups=4, moe_router_group_topk=2, moe_router_enable_expert_bias=True,
        moe_router_topk_scaling_factor=2.5, moe_router_load_balancing_type="seq_aux_loss"),
    "sqrtsoftplus_top3_global_aux": dict(moe_router_score_function="sqrtsoftplus",
                                         moe_router_topk=3,
                                         moe_router_load_balancing_type="global_aux_loss"),
    "capacity_drop": dict(moe_expert_capacity_factor=0.75),
    "top1_pre_softmax": dict(moe_router_topk=1, moe_router_pre_softmax=True),
}


def build_pair(case):
    kwargs = dict(BASE)
    kwargs.update(CASES[case])
    MegatronRouterReplay.clear_global_router_replay_instances()
    torch.manual_seed(0)
    meg = megatron_layer.build(**kwargs)
    ours = MoELayer(MoEConfig.from_megatron(meg.config))
    assert ours.router.router_replay is not None
    sd = meg.state_dict()
    if kwargs.get("moe_router_enable_expert_bias"):
        sd["router.expert_bias"].copy_(torch.randn(kwargs["num_moe_experts"]) * 0.05)
        meg.router.expert_bias.copy_(sd["router.expert_bias"])
    load_megatron_state_dict(ours, sd)
    meg.train(), ours.train()
    return meg, ours


def routing_of(router):
    seen = {}
    router.register_forward_hook(lambda m, i, o: seen.update(probs=o[0].detach(), map=o[1]))
    return seen


def random_choice(T, E, k, seed=7):
    """[T, k] distinct experts per token, in a random order (not best first)."""
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])


def check_close(ours, meg, name, ulps=64):
    ours, meg = ours.detach().double(), meg.detach().double()
    assert ours.shape == meg.shape, name
    scale = max(meg.abs().max().item(), 1e-30)
    diff = (ours - meg).abs().max().item()
    assert diff <= ulps * 2.0**-24 * scale, f"{name}: max diff {diff:.3e} at scale {scale:.3e}"


def step_both(meg, ours, x, g):
    x_meg, x_ours = x.clone().requires_grad_(), x.clone().requires_grad_()
    megatron_layer.set_loss_scale(1.0)
    out_meg, _ = meg(x_meg)
    with AuxLossScale(1.0):
        out_ours = ours(x_ours)
    out_meg.backward(g)
    out_ours.backward(g)
    return out_meg, out_ours, x_meg.grad, x_ours.grad


@pytest.mark.megatron
@pytest.mark.parametrize("case", sorted(CASES))
def test_replay_forward_matches_megatron(case):
    meg, ours = build_pair(case)
    seen_meg, seen_ours = routing_of(meg.router), routing_of(ours.router)
    E, k = ours.config.num_moe_experts, ours.config.moe_router_topk
    x = torch.randn(S, B, H)
    g = torch.randn(S, B, H)
    # what the routers choose by themselves, so the test sees that the replay changes it
    with torch.no_grad():
        natural = ours.router(x)[1]
    target = random_choice(S * B, E, k)
    meg.router.router_replay.set_target_indices(target)
    meg.router.router_replay.set_router_replay_action(MegatronAction.REPLAY_FORWARD)
    ours.router.router_replay.set_target_indices(target)
    ours.router.router_replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)

    out_meg, out_ours, gx_meg, gx_ours = step_both(meg, ours, x, g)
    want_map = torch.zeros(S * B, E, dtype=torch.bool).scatter(1, target, True)
    if ours.config.moe_expert_capacity_factor is None:
        assert torch.equal(seen_ours["map"], want_map)
        assert not torch.equal(natural, want_map)
    else:
        assert not torch.equal(seen_ours["map"], natural)
    assert torch.equal(seen_ours["map"], seen_meg["map"])
    check_close(seen_ours["probs"], seen_meg["probs"], "probs")
    check_close(out_ours, out_meg, "output")
    check_close(gx_ours, gx_meg, "input grad")
    check_close(ours.router.weight.grad, meg.router.weight.grad, "router weight grad")
    for name, fc in (("weight1", "linear_fc1"), ("weight2", "linear_fc2")):
        want = torch.stack([getattr(e, fc).weight.grad for e in meg.experts.local_experts])
        check_close(getattr(ours.experts, name).grad, want, f"experts.{name} grad")
    if ours.router.local_tokens_per_expert is not None:
        # the replayed choice is what the expert bias counts
        assert torch.equal(ours.router.local_tokens_per_expert, want_map.sum(0).float())
        assert torch.equal(ours.router.local_tokens_per_expert,
                           meg.router.local_tokens_per_expert.float())


@pytest.mark.megatron
@pytest.mark.parametrize("case", ["softmax_post_aux", "sigmoid_groups_bias_scaling"])
def test_record_matches_megatron(case):
    meg, ours = build_pair(case)
    meg.router.router_replay.set_router_replay_action(MegatronAction.RECORD)
    ours.router.router_replay.set_router_replay_action(RouterReplayAction.RECORD)
    seen = routing_of(ours.router)
    x = torch.randn(S, B, H)
    step_both(meg, ours, x, torch.randn(S, B, H))
    got = ours.router.router_replay.get_recorded_indices()
    want = meg.router.router_replay.get_recorded_indices()
    assert got.dtype == torch.int64 and got.shape == want.shape
    # both best first; the same experts per token (ties aside, which these inputs do not have)
    assert torch.equal(got, want)
    E = ours.config.num_moe_experts
    assert torch.equal(torch.zeros(S * B, E, dtype=torch.bool).scatter(1, got, True), seen["map"])


def test_replaying_the_recorded_routing_reproduces_the_forward():
    cfg = MoEConfig(hidden_size=H, num_moe_experts=8, moe_ffn_hidden_size=FFN, moe_router_topk=3,
                    moe_router_score_function="sigmoid", add_bias_linear=False,
                    gated_linear_unit=True, activation_func=F.silu, moe_z_loss_coeff=1e-3,
                    moe_aux_loss_coeff=1e-2, moe_enable_routing_replay=True)
    layer = MoELayer(cfg)
    x = torch.randn(S * B, H)
    replay = layer.router.router_replay
    replay.set_router_replay_action(RouterReplayAction.RECORD)
    seen = routing_of(layer.router)
    out = layer(x)
    recorded, probs, routing_map = replay.get_recorded_indices(), seen["probs"], seen["map"]
    losses = dict(layer.router.last_losses)
    replay.set_target_indices(recorded)
    replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
    replayed = layer(x)
    assert torch.equal(seen["map"], routing_map)
    # the fused router and the replay's torch ops round the renormalising sum differently
    check_close(seen["probs"], probs, "probs", ulps=4)
    check_close(replayed, out, "output", ulps=16)
    for name, value in losses.items():
        assert torch.equal(layer.router.last_losses[name], value), name


def test_replay_backward_takes_the_queue_in_order():
    layer = MoELayer(MoEConfig(hidden_size=16, num_moe_experts=6, moe_ffn_hidden_size=8,
                               moe_router_topk=2, moe_enable_routing_replay=True))
    seen = routing_of(layer.router)
    first, second = random_choice(5, 6, 2, seed=1), random_choice(5, 6, 2, seed=2)
    replay = layer.router.router_replay
    replay.set_target_indices(first)
    replay.set_target_indices(second)
    replay.set_router_replay_action(RouterReplayAction.REPLAY_BACKWARD)
    x = torch.randn(5, 16)
    for want in (first, second):
        layer(x)
        assert torch.equal(seen["map"], torch.zeros(5, 6, dtype=torch.bool).scatter(1, want, True))
    with pytest.raises(ValueError, match="empty replay_backward_list"):
        layer(x)
    replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
    layer(x)  # the target is the last one set
    assert torch.equal(seen["map"], torch.zeros(5, 6, dtype=torch.bool).scatter(1, second, True))


def test_global_api_over_a_model_and_over_every_live_router():
    RouterReplay.clear_global_router_replay_instances()
    cfg = MoEConfig(hidden_size=16, num_moe_experts=4, moe_ffn_hidden_size=8, moe_router_topk=2,
                    moe_enable_routing_replay=True)
    model = torch.nn.Sequential(MoELayer(cfg, layer_number=1), MoELayer(cfg, layer_number=2))
    other = MoELayer(cfg)
    replays = [m.router.router_replay for m in model]
    assert RouterReplay.instances(model) == replays
    assert RouterReplay.instances() == replays + [other.router.router_replay]
    assert [r.layer_number for r in replays] == [1, 2]

    RouterReplay.set_global_router_replay_action(RouterReplayAction.RECORD, model=model)
    assert other.router.router_replay.router_replay_action is None
    x = torch.randn(6, 16)
    model(x)
    recorded = RouterReplay.get_recorded_data(model=model)
    assert [t.shape for t in recorded] == [(6, 2), (6, 2)]
    assert RouterReplay.get_recorded_data() == recorded + [None]

    with pytest.raises(ValueError, match="3 tensors for 2 routers"):
        RouterReplay.set_replay_data(recorded + recorded[:1], model=model)
    targets = [random_choice(6, 4, 2, seed=s) for s in (3, 4)]
    RouterReplay.set_replay_data(targets, model=model)
    RouterReplay.set_global_router_replay_action(RouterReplayAction.REPLAY_FORWARD, model=model)
    seen = [routing_of(m.router) for m in model]
    model(x)
    for s, t in zip(seen, targets):
        assert torch.equal(s["map"], torch.zeros(6, 4, dtype=torch.bool).scatter(1, t, True))

    # a static buffer: the recorded indices are a view of it
    buffer = torch.full((10, 2, 2), -1, dtype=torch.long)
    RouterReplay.set_global_static_buffers(buffer, model=model)
    RouterReplay.set_global_router_replay_action(RouterReplayAction.RECORD, model=model)
    model(x)
    for i, t in enumerate(RouterReplay.get_recorded_data(model=model)):
        assert t.data_ptr() == buffer[:, i, :].data_ptr() and torch.equal(buffer[:6, i], t)
    assert (buffer[6:] == -1).all()
    with pytest.raises(ValueError, match=r"\[max_tokens, 2, topk\]"):
        RouterReplay.set_global_static_buffers(buffer[:, :1], model=model)
    RouterReplay.clear_global_static_buffers(model=model)
    RouterReplay.clear_global_indices(model=model)
    RouterReplay.clear_global_router_replay_action(model=model)
    assert RouterReplay.get_recorded_data(model=model) == [None, None]
    assert all(r.router_replay_action is None and r.replay_backward_list == [] for r in replays)

    # a deep copy's routers join the list; a deleted model's leave it
    twin = copy.deepcopy(model)
    assert len(RouterReplay.instances()) == 5
    del twin, other
    gc.collect()
    assert RouterReplay.instances() == replays
    RouterReplay.clear_global_router_replay_instances()
    assert RouterReplay.instances() == [] and RouterReplay.instances(model) == replays


def test_bad_replay_input_is_named():
    layer = MoELayer(MoEConfig(hidden_size=16, num_moe_experts=4, moe_ffn_hidden_size=8,
                               moe_router_topk=2, moe_enable_routing_replay=True))
    replay = layer.router.router_replay
    x = torch.randn(5, 16)
    replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
    with pytest.raises(ValueError, match="without target indices"):
        layer(x)
    replay.set_target_indices(torch.zeros(4, 2, dtype=torch.long))
    with pytest.raises(ValueError, match=r"\[num_tokens, topk\] = \[5, 2\], got \(4, 2\)"):
        layer(x)
    with pytest.raises(TypeError, match="topk_indices must be an integer tensor"):
        replay.set_target_indices(torch.zeros(5, 2))
    with pytest.raises(ValueError, match="topk_indices must be 2-D"):
        replay.set_target_indices(torch.zeros(10, dtype=torch.long))
    with pytest.raises(TypeError, match="must be a RouterReplayAction"):
        replay.set_router_replay_action("record")
    replay.set_router_replay_action(RouterReplayAction.RECORD)
    replay.set_static_buffer(torch.zeros(3, 2, dtype=torch.long))
    with pytest.raises(ValueError, match=r"cannot hold the indices \[5, 2\]"):
        layer(x)


def test_config_refuses_replay_with_sinkhorn_and_copies_megatrons_flag():
    with pytest.raises(ValueError, match="moe_enable_routing_replay=True: Sinkhorn"):
        MoEConfig(hidden_size=16, num_moe_experts=4, moe_router_topk=1,
                  moe_router_load_balancing_type="sinkhorn", moe_enable_routing_replay=True)
    plain = MoELayer(MoEConfig(hidden_size=16, num_moe_experts=4, moe_ffn_hidden_size=8))
    assert plain.router.router_replay is None
