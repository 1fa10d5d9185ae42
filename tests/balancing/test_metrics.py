"""Routing metrics on the device and the per-layer tracker, against direct PyTorch."""
import math

import pytest
import torch

import moe_core.ops as ops
from moe_core.metrics import MoEMetricsTracker


def torch_metrics(routing_map, scores=None, pad=None):
    keep = torch.ones(routing_map.shape[0], dtype=torch.bool) if pad is None else ~pad
    n = routing_map[keep].sum(0).double()
    mean = n.mean()
    f = n / n.sum()
    ent = -(torch.where(f > 0, f * f.log(), torch.zeros_like(f))).sum()
    out = {
        "tokens_per_expert": n.long(),
        "max_over_mean": n.max() / mean,
        "load_cv": n.std(unbiased=False) / mean,
        "load_entropy": ent,
    }
    if scores is not None:
        s = scores[keep].double()
        out["score_entropy"] = -(torch.where(s > 0, s * s.log(), torch.zeros_like(s))).sum(1).mean()
    return out


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("with_scores", [False, True])
def test_routing_metrics_match_torch(padded, with_scores, device):
    T, E, k = 100, 12, 3
    logits = torch.randn(T, E) + torch.linspace(0, 1.5, E)
    routing_map, scores = ops.compute_routing_scores_for_aux_loss(logits, k, "softmax")
    pad = (torch.rand(T) < 0.3) if padded else None
    m = ops.routing_metrics(routing_map.to(device), scores.to(device) if with_scores else None,
                            None if pad is None else pad.to(device))
    ref = torch_metrics(routing_map, scores if with_scores else None, pad)
    assert m.tokens_per_expert.device.type == device
    assert torch.equal(m.tokens_per_expert.cpu(), ref["tokens_per_expert"])
    for name in ("max_over_mean", "load_cv", "load_entropy") + (("score_entropy",) if with_scores
                                                                 else ()):
        ours = getattr(m, name)
        assert ours.dtype == torch.float32 and ours.dim() == 0
        assert ours.item() == pytest.approx(ref[name].item(), rel=1e-6), name
    if not with_scores:
        assert m.score_entropy is None


def test_routing_metrics_balanced_and_empty(device):
    E = 4
    balanced = torch.eye(E, dtype=torch.bool, device=device).repeat(3, 1)
    m = ops.routing_metrics(balanced)
    assert m.max_over_mean.item() == 1.0 and m.load_cv.item() == 0.0
    assert m.load_entropy.item() == pytest.approx(math.log(E))
    empty = ops.routing_metrics(balanced, padding_mask=torch.ones(3 * E, dtype=torch.bool,
                                                                  device=device))
    assert empty.tokens_per_expert.sum().item() == 0
    assert empty.max_over_mean.item() == 0.0 and empty.load_cv.item() == 0.0
    zero_tokens = ops.routing_metrics(torch.zeros(0, E, dtype=torch.bool, device=device),
                                      torch.zeros(0, E, device=device))
    assert zero_tokens.score_entropy.item() == 0.0


@pytest.mark.parametrize("padded", [False, True])
def test_topk_overlap_matches_torch(padded, device):
    T, E, k = 80, 16, 4
    a = torch.rand(T, E).topk(k, dim=1).indices
    b = a.clone()
    b[: T // 2] = torch.rand(T // 2, E).topk(k, dim=1).indices
    pad = (torch.rand(T) < 0.3) if padded else None
    ours = ops.topk_overlap(a.to(device), b.to(device), E, None if pad is None else pad.to(device))
    keep = torch.ones(T, dtype=torch.bool) if pad is None else ~pad
    ma = torch.zeros(T, E, dtype=torch.bool).scatter(1, a, True)
    mb = torch.zeros(T, E, dtype=torch.bool).scatter(1, b, True)
    ref = (ma & mb)[keep].sum(1).double().mean() / k
    assert ours.dtype == torch.float32 and ours.item() == pytest.approx(ref.item(), rel=1e-6)
    assert ops.topk_overlap(a.to(device), a.to(device), E).item() == 1.0


def test_topk_overlap_disjoint_is_zero(device):
    a = torch.tensor([[0, 1], [2, 3]], device=device)
    b = torch.tensor([[2, 3], [0, 1]], device=device)
    assert ops.topk_overlap(a, b, 4).item() == 0.0


def test_metrics_stay_on_device_until_report():
    tracker = MoEMetricsTracker()
    T, E = 50, 8
    for layer in (1, 2):
        for _micro_batch in range(3):
            routing_map, scores = ops.compute_routing_scores_for_aux_loss(torch.randn(T, E), 2,
                                                                          "softmax")
            tracker.record_routing(layer, routing_map, scores)
            tracker.record("load_balancing_loss", torch.tensor(0.5 * layer), layer)
    values = tracker.values()
    assert all(isinstance(v, torch.Tensor) for layers in values.values() for v in layers.values())
    assert values["tokens_per_expert"][1].shape == (E,)
    report = tracker.report()
    assert report["load_balancing_loss"] == {1: 0.5, 2: 1.0}
    assert set(report) == {"tokens_per_expert", "max_over_mean", "load_cv", "load_entropy",
                           "score_entropy", "load_balancing_loss"}
    assert sum(report["tokens_per_expert"][1]) == pytest.approx(T * 2)
    assert "load_cv" in MoEMetricsTracker.format(report)
    assert tracker.values() == {}  # report clears


def test_tracker_averages_micro_batches_and_ignores_layer_none():
    tracker = MoEMetricsTracker()
    tracker.record("z_loss", torch.tensor(1.0), 3)
    tracker.record("z_loss", torch.tensor(3.0), 3)
    tracker.record("z_loss", torch.tensor(100.0), None)
    a = torch.tensor([[0, 1]])
    tracker.record_route_drift(3, a, torch.tensor([[1, 2]]), 4)
    assert tracker.report() == {"z_loss": {3: 2.0}, "topk_overlap": {3: 0.5}}


def test_metrics_are_deterministic(device):
    routing_map, scores = ops.compute_routing_scores_for_aux_loss(
        torch.randn(500, 64, device=device), 8, "softmax")
    a = ops.routing_metrics(routing_map, scores)
    b = ops.routing_metrics(routing_map, scores)
    assert all(torch.equal(x, y) for x, y in zip(a, b) if x is not None)


def test_opcheck_metrics_ops(device):
    routing_map, scores = ops.compute_routing_scores_for_aux_loss(torch.randn(10, 6, device=device),
                                                                  2, "softmax")
    pad = torch.rand(10, device=device) < 0.3
    torch.library.opcheck(torch.ops.moe_core.routing_metrics.default, (routing_map, None, None))
    torch.library.opcheck(torch.ops.moe_core.routing_metrics.default, (routing_map, scores, pad))
    a = torch.rand(10, 6, device=device).topk(2, dim=1).indices
    b = torch.rand(10, 6, device=device).topk(2, dim=1).indices
    torch.library.opcheck(torch.ops.moe_core.topk_overlap.default, (a, b, 6, None))
    torch.library.opcheck(torch.ops.moe_core.topk_overlap.default, (a, b, 6, pad))
