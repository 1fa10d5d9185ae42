"""moe_layer_recompute: the layer under an activation checkpoint. The same gradients, bit for
bit, as without it; the routing statistics (aux / z losses, global aux-loss counts, expert-bias
counts) made once, by the recompute, as Megatron's checkpointed layer makes them; and a forward
that keeps only its input for the backward."""
import copy

import pytest
import torch
import torch.nn.functional as F

from helpers import megatron_layer
from moe_core import MoEConfig, MoELayer, RouterReplayAction, load_megatron_state_dict
from moe_core.ops import AuxLossScale

H, FFN, S, B = 32, 48, 10, 2

CASES = {
    "softmax_aux_z_router_jitter_shared_gate": dict(
        moe_aux_loss_coeff=1e-2, moe_z_loss_coeff=1e-3, moe_input_jitter_eps=0.1,
        moe_shared_expert_intermediate_size=40, moe_shared_expert_gate=True,
        add_bias_linear=False),
    "sigmoid_bias_global_and_seq_aux_capacity": dict(
        moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
        moe_router_load_balancing_type=["global_aux_loss", "seq_aux_loss"],
        moe_aux_loss_coeff=[1e-2, 1e-3], moe_expert_capacity_factor=1.0,
        moe_pad_expert_input_to_capacity=True),
    "layer_jitter_biases_unfused_experts": dict(
        moe_input_jitter_eps=0.05, moe_input_jitter_mode="layer", add_bias_linear=True,
        gated_linear_unit=False, activation_func=F.gelu, moe_aux_loss_coeff=1e-2),
    "latent_per_token_loss": dict(moe_latent_size=24, add_bias_linear=False,
                                  calculate_per_token_loss=True, moe_aux_loss_coeff=1e-2),
}


def config(**kw):
    base = dict(hidden_size=H, num_moe_experts=8, moe_ffn_hidden_size=FFN, moe_router_topk=2,
                gated_linear_unit=True, activation_func=F.silu)
    base.update(kw)
    return MoEConfig(**base)


def pair(**kw):
    torch.manual_seed(0)
    plain = MoELayer(config(**kw))
    recomputed = MoELayer(config(moe_layer_recompute=True, **kw))
    recomputed.load_state_dict(plain.state_dict())
    if plain.router.expert_bias is not None:
        with torch.no_grad():
            plain.router.expert_bias.copy_(torch.randn(8) * 0.05)
            recomputed.router.expert_bias.copy_(plain.router.expert_bias)
    return plain, recomputed


def run(layer, x, pad, g, seed=5):
    x = x.clone().requires_grad_()
    torch.manual_seed(seed)
    with AuxLossScale(3.0):  # the forward's scale holder, also for the recompute
        out = layer(x, padding_mask=pad)
    before = {"counts": None if layer.router.local_tokens_per_expert is None
              else layer.router.local_tokens_per_expert.clone(),
              "losses": dict(layer.router.last_losses)}
    torch.manual_seed(99)  # the recompute must not depend on the RNG state at backward
    out.backward(g)
    return out, x.grad, before


@pytest.mark.parametrize("case", sorted(CASES))
def test_gradients_bitwise_and_statistics_made_once(case):
    plain, recomputed = pair(**CASES[case])
    x, g = torch.randn(S, B, H), torch.randn(S, B, H)
    pad = torch.zeros(B, S, dtype=torch.bool)
    pad[1, -3:] = True
    out_p, gx_p, _ = run(plain, x, pad, g)
    out_r, gx_r, before = run(recomputed, x, pad, g)
    assert torch.equal(out_p, out_r)
    assert torch.equal(gx_p, gx_r)
    grads = 0
    for (name, p), q in zip(plain.named_parameters(), recomputed.parameters()):
        assert p.grad is not None and torch.equal(p.grad, q.grad), name
        grads += 1
    assert grads >= 4
    # the forward without grad left the statistics alone; the recompute made them, once
    assert before["losses"] == {}
    assert plain.router.last_losses.keys() == recomputed.router.last_losses.keys() != set()
    for name, value in plain.router.last_losses.items():
        assert torch.equal(recomputed.router.last_losses[name], value), name
    if plain.router.local_tokens_per_expert is not None:
        assert before["counts"].sum() == 0
        assert plain.router.local_tokens_per_expert.sum() > 0
        assert torch.equal(plain.router.local_tokens_per_expert,
                           recomputed.router.local_tokens_per_expert)
    if plain.router.global_aux_buffer is not None:
        for a, b in zip(plain.router.global_aux_buffer.state_dict().values(),
                        recomputed.router.global_aux_buffer.state_dict().values()):
            assert torch.equal(a, b)
        assert int(recomputed.router.global_aux_buffer.steps) == 1


def saved_bytes(layer, x):
    """Bytes of the tensors autograd keeps for the backward of one forward (storage counted once)."""
    seen = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = layer(x)
    return sum(seen.values()), out


def test_forward_keeps_only_its_input():
    plain, recomputed = pair(moe_aux_loss_coeff=1e-2, moe_z_loss_coeff=1e-3,
                             moe_shared_expert_intermediate_size=64, add_bias_linear=False)
    x = torch.randn(64, H, requires_grad=True)
    plain_bytes, _ = saved_bytes(plain, x)
    recomputed_bytes, out = saved_bytes(recomputed, x)
    assert recomputed_bytes <= x.numel() * x.element_size()
    assert plain_bytes > 10 * recomputed_bytes
    out.sum().backward()  # and the backward runs from that alone
    assert recomputed.experts.weight1.grad.abs().sum() > 0


def test_input_without_grad_still_trains_the_layer():
    plain, recomputed = pair(moe_aux_loss_coeff=1e-2)
    x = torch.randn(16, H)
    for layer in (plain, recomputed):
        layer(x).square().sum().backward()
    for (name, p), q in zip(plain.named_parameters(), recomputed.parameters()):
        assert q.grad is not None and torch.equal(p.grad, q.grad), name


def test_no_checkpoint_in_eval_or_without_grad():
    _, recomputed = pair(moe_aux_loss_coeff=1e-2)
    x = torch.randn(16, H, requires_grad=True)
    with torch.no_grad():
        assert saved_bytes(recomputed, x)[0] == 0
    recomputed.eval()
    eval_bytes, _ = saved_bytes(recomputed, x)
    recomputed.train()
    assert eval_bytes > saved_bytes(recomputed, x)[0]


def test_replayed_routing_through_the_recompute():
    """RL's schedule: forward by REPLAY_FORWARD, then REPLAY_BACKWARD for the recompute, which
    takes the queued indices: the gradients of a plain replayed step, bit for bit."""
    plain, recomputed = pair(moe_enable_routing_replay=True, moe_aux_loss_coeff=1e-2)
    g = torch.Generator().manual_seed(3)
    target = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(16)])
    x = torch.randn(16, H)
    for layer in (plain, recomputed):
        replay = layer.router.router_replay
        replay.set_target_indices(target)
        replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
        out = layer(x)
        replay.set_router_replay_action(RouterReplayAction.REPLAY_BACKWARD)
        out.square().sum().backward()
    assert plain.router.router_replay.replay_backward_list == [target]  # no recompute took it
    assert recomputed.router.router_replay.replay_backward_list == []
    for (name, p), q in zip(plain.named_parameters(), recomputed.parameters()):
        assert torch.equal(p.grad, q.grad), name


@pytest.mark.megatron
def test_matches_megatrons_checkpointed_layer():
    kw = dict(hidden_size=H, moe_ffn_hidden_size=FFN, num_moe_experts=8, moe_router_topk=2,
              add_bias_linear=False, gated_linear_unit=True, activation_func=F.silu,
              moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
              moe_aux_loss_coeff=1e-2, moe_z_loss_coeff=1e-3, moe_layer_recompute=True)
    torch.manual_seed(0)
    meg = megatron_layer.build(**kw)
    cfg = MoEConfig.from_megatron(meg.config)
    assert cfg.moe_layer_recompute
    ours = MoELayer(cfg)
    load_megatron_state_dict(ours, meg.state_dict())
    meg.train(), ours.train()
    x, g = torch.randn(S, B, H), torch.randn(S, B, H)
    x_meg, x_ours = x.clone().requires_grad_(), x.clone().requires_grad_()
    megatron_layer.set_loss_scale(1.0)
    out_meg, _ = meg(x_meg)
    out_ours = ours(x_ours)
    # neither counted in the forward: the recompute counts
    assert meg.router.local_tokens_per_expert.sum() == 0
    assert ours.router.local_tokens_per_expert.sum() == 0
    out_meg.backward(g)
    out_ours.backward(g)
    assert torch.equal(ours.router.local_tokens_per_expert,
                       meg.router.local_tokens_per_expert.float())
    assert ours.router.local_tokens_per_expert.sum() == S * B * 2

    def close(a, b, name):
        scale = b.abs().max().item()
        assert (a - b).abs().max().item() <= 64 * 2.0**-24 * scale, name

    close(out_ours, out_meg, "output")
    close(x_ours.grad, x_meg.grad, "input grad")
    close(ours.router.weight.grad, meg.router.weight.grad, "router weight grad")
    for name, fc in (("weight1", "linear_fc1"), ("weight2", "linear_fc2")):
        want = torch.stack([getattr(e, fc).weight.grad for e in meg.experts.local_experts])
        close(getattr(ours.experts, name).grad, want, f"experts.{name} grad")


def test_from_megatron_reads_recompute_modules():
    class Megatronish:
        hidden_size, num_moe_experts, moe_ffn_hidden_size = 16, 4, 8
        recompute_granularity, recompute_modules = "selective", ["core_attn", "moe"]

    assert MoEConfig.from_megatron(Megatronish()).moe_layer_recompute
    Megatronish.recompute_modules = ["core_attn"]
    assert not MoEConfig.from_megatron(Megatronish()).moe_layer_recompute
    with pytest.raises(ValueError, match="moe_layer_recompute=1: must be a bool"):
        config(moe_layer_recompute=1)
    assert copy.deepcopy(config(moe_layer_recompute=True)).moe_layer_recompute


def _expert_parallel_worker(rank: int, world: int) -> dict:
    """Each dispatcher at EP = world: the recomputed layer (its exchanges run again in the
    backward, on every rank alike) against the plain one, and a mismatch refused on every rank."""
    from helpers.ep_layer import config_kwargs, global_batch, global_layer, run_layer, shard_state

    res = {}
    for dispatcher in ("alltoall", "allgather"):
        kw = config_kwargs("sigmoid_groups_bias_top8_shared", "dropless", dispatcher)
        ref = global_layer(kw)
        X, G, masks = global_batch(world, torch.bfloat16)
        outs = []
        for recompute in (False, True):
            layer = MoELayer(MoEConfig(**kw, expert_model_parallel_size=world,
                                       moe_layer_recompute=recompute))
            layer.load_state_dict(shard_state(ref, rank, world))
            out, dx, losses = run_layer(layer, X[rank], G[rank], masks[rank])
            grads = {n: p.grad for n, p in layer.named_parameters()}
            outs.append((out, dx, losses, grads, layer.router.local_tokens_per_expert))
        (a, b) = outs
        res[dispatcher] = (torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
                           and a[2].keys() == b[2].keys()
                           and all(torch.equal(a[2][k], b[2][k]) for k in a[2])
                           and all(torch.equal(a[3][n], b[3][n]) for n in a[3])
                           and torch.equal(a[4], b[4]))
    kw = config_kwargs("softmax_top2", "dropless", "alltoall")
    try:
        MoELayer(MoEConfig(**kw, expert_model_parallel_size=world,
                           moe_layer_recompute=rank == 0))
        res["mismatch"] = "no error"
    except ValueError as e:
        res["mismatch"] = str(e)
    return res


def test_expert_parallel_recompute_equals_plain_bitwise():
    from helpers.dist import run_ranks

    for rank, res in enumerate(run_ranks(_expert_parallel_worker, 2, timeout=300)):
        assert res["alltoall"] and res["allgather"], f"rank {rank}: {res}"
        assert "moe_layer_recompute differs across the expert-parallel ranks: rank 0: True, " \
               "rank 1: False" in res["mismatch"], f"rank {rank}: {res['mismatch']!r}"
