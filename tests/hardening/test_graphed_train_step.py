"""moe_core.graphs.GraphedTrainStep: a whole training step (forward, aux losses, backward,
optimizer step) of a model holding MoE layers, replayed from a CUDA graph, with the expert-bias
update and the aux-loss logging between replays. On the GPU the graphed run trains bit for bit
like the eager one (the same kernels, the same order); on the CPU the eager mode (enabled=False)
and the argument checks."""
import copy

import pytest
import torch
import torch.nn.functional as F

from moe_core import MoEConfig, MoELayer, finalize_step
from moe_core.graphs import GraphedTrainStep

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
H, T, STEPS = 32, 64, 7


def _model(device: str) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = MoEConfig(hidden_size=H, moe_ffn_hidden_size=48, num_moe_experts=8, moe_router_topk=2,
                    moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                    moe_router_bias_update_rate=1e-2, moe_aux_loss_coeff=1e-2,
                    moe_router_load_balancing_type="seq_aux_loss", moe_z_loss_coeff=1e-3,
                    add_bias_linear=False, gated_linear_unit=True, activation_func=F.silu,
                    moe_router_dtype="fp32")
    layer = MoELayer(cfg, device=device, dtype=torch.bfloat16 if device == "cuda" else None)
    head = torch.nn.Linear(H, 4, device=device, dtype=layer.router.weight.dtype)
    return torch.nn.Sequential(layer, head)


def _batches(device: str):
    g = torch.Generator().manual_seed(5)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    return [(torch.randn(T, 1, H, generator=g).to(device, dtype),
             torch.randint(0, 4, (T, 1), generator=g).to(device)) for _ in range(STEPS)]


def _train(model, step, batches, log):
    losses = []
    for x, y in batches:
        losses.append(step(x, y).clone())
        finalize_step(model)  # eager, between replays: in place on what the graph reads
        log.append({k: v.detach().clone() for k, v in model[0].router.last_losses.items()})
    return losses


def _loss_fn(model):
    def loss_fn(x, y):
        return F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())
    return loss_fn


@needs_gpu
def test_graphed_steps_train_bitwise_like_eager_steps():
    ref = _model("cuda")
    graphed = copy.deepcopy(ref)
    batches = _batches("cuda")
    opts = dict(lr=1e-2, capturable=True)
    eager_step = GraphedTrainStep(_loss_fn(ref), torch.optim.AdamW(ref.parameters(), **opts),
                                  enabled=False)
    graph_step = GraphedTrainStep(_loss_fn(graphed),
                                  torch.optim.AdamW(graphed.parameters(), **opts), warmup=2)
    ref_log, log = [], []
    want = _train(ref, eager_step, batches, ref_log)
    got = _train(graphed, graph_step, batches, log)
    assert graph_step.graph is not None  # steps 3.. replayed
    for i, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), f"step {i}: loss {a.item()} != {b.item()}"
    for i, (a, b) in enumerate(zip(log, ref_log)):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), f"step {i}"
    for (name, p), q in zip(graphed.named_parameters(), ref.parameters()):
        assert torch.equal(p, q), name
    bias, ref_bias = graphed[0].router.expert_bias, ref[0].router.expert_bias
    assert torch.equal(bias, ref_bias) and bias.abs().sum() > 0  # the bias moved, as in eager
    assert torch.equal(graphed[0].router.last_routing_load, ref[0].router.last_routing_load)


@needs_gpu
def test_another_shape_after_the_capture_is_refused():
    model = _model("cuda")
    step = GraphedTrainStep(_loss_fn(model),
                            torch.optim.AdamW(model.parameters(), capturable=True), warmup=1)
    x, y = _batches("cuda")[0]
    step(x, y)
    step(x, y)  # captured
    with pytest.raises(ValueError, match=r"batch\[0\]: \(32, 1, 32\).*captured for \(64, 1, 32\)"):
        step(x[:32], y[:32])


def test_eager_mode_is_a_plain_training_step():
    model = _model("cpu")
    ref = copy.deepcopy(model)
    batches = _batches("cpu")[:3]
    step = GraphedTrainStep(_loss_fn(model), torch.optim.SGD(model.parameters(), lr=0.1),
                            enabled=False)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for x, y in batches:
        loss = step(x, y)
        opt.zero_grad(set_to_none=True)
        want = _loss_fn(ref)(x, y)
        want.backward()
        opt.step()
        assert torch.equal(loss, want.detach())
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p, q)


def test_an_optimizer_that_is_not_capturable_is_refused():
    model = _model("cpu")
    with pytest.raises(ValueError, match=r"param group 0 has capturable=False.*AdamW\(\.\.\., "
                                         r"capturable=True\)"):
        GraphedTrainStep(_loss_fn(model), torch.optim.AdamW(model.parameters()))


@pytest.mark.parametrize("warmup", [0, -1, 1.5, True])
def test_warmup_must_be_a_positive_int(warmup):
    model = _model("cpu")
    with pytest.raises(ValueError, match=rf"warmup must be an int of at least 1, got {warmup!r}"):
        GraphedTrainStep(_loss_fn(model), torch.optim.SGD(model.parameters(), lr=0.1),
                         warmup=warmup)


def test_a_cpu_batch_is_refused_when_graphs_are_on():
    model = _model("cpu")
    step = GraphedTrainStep(_loss_fn(model), torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = _batches("cpu")[0]
    with pytest.raises(ValueError, match="every batch tensor must be on a CUDA device"):
        step(x, y)


def test_a_batch_of_non_tensors_is_refused():
    model = _model("cpu")
    step = GraphedTrainStep(_loss_fn(model), torch.optim.SGD(model.parameters(), lr=0.1),
                            enabled=False)
    with pytest.raises(TypeError, match=r"takes tensors, got \['list'\]"):
        step([1.0])
