"""MoEMetricsTracker: per-layer MoE metrics collected on the device, read back only on report.

Megatron's tracker accumulates aux-loss values per layer and reduces them across ranks at the
end of a step. This one keeps the same lifecycle (record during forward, report at step end,
then clear) for the aux losses and for the routing metrics of
:mod:`moe_core.ops.routing_metrics`, without a process-global instance (make one per model) and
without a host sync until :meth:`report` (the only place that calls ``.item()``).

Example::

    tracker = MoEMetricsTracker()
    for micro_batch in batches:
        ...
        tracker.record("load_balancing_loss", aux / coeff, layer_number=3)
        tracker.record_routing(3, routing_map, scores, padding_mask)
    print(tracker.format(tracker.report()))   # one sync; clears the tracker
"""
from collections import defaultdict
from typing import Dict, Optional

import torch

from moe_core.ops.routing_metrics import routing_metrics, topk_overlap


class MoEMetricsTracker:
    """Accumulates named scalar metrics per layer as device tensors; averages on report."""

    def __init__(self):
        # name -> layer -> [sum tensor, number of records]
        self._entries: Dict[str, Dict[int, list]] = defaultdict(dict)

    def record(self, name: str, value: torch.Tensor, layer_number: Optional[int]) -> None:
        """Adds ``value`` (a tensor, detached; scalar or any fixed shape) to ``name`` at a layer.

        A ``layer_number`` of None is a no-op, as in Megatron.
        """
        if layer_number is None:
            return
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"value must be a tensor, got {type(value).__name__}")
        layers = self._entries[name]
        value = value.detach()
        if layer_number in layers:
            layers[layer_number][0] = layers[layer_number][0] + value
            layers[layer_number][1] += 1
        else:
            layers[layer_number] = [value.clone(), 1]

    def record_routing(self, layer_number: Optional[int], routing_map: torch.Tensor,
                       scores: Optional[torch.Tensor] = None,
                       padding_mask: Optional[torch.Tensor] = None) -> None:
        """Records the routing metrics of one routing (``tokens_per_expert``, ``max_over_mean``,
        ``load_cv``, ``load_entropy`` and, with scores, ``score_entropy``)."""
        if layer_number is None:
            return
        m = routing_metrics(routing_map, scores, padding_mask)
        self.record("tokens_per_expert", m.tokens_per_expert, layer_number)
        self.record("max_over_mean", m.max_over_mean, layer_number)
        self.record("load_cv", m.load_cv, layer_number)
        self.record("load_entropy", m.load_entropy, layer_number)
        if scores is not None:
            self.record("score_entropy", m.score_entropy, layer_number)

    def record_route_drift(self, layer_number: Optional[int], indices: torch.Tensor,
                           reference_indices: torch.Tensor, num_experts: int,
                           padding_mask: Optional[torch.Tensor] = None) -> None:
        """Records ``topk_overlap`` between two routings of the same tokens."""
        if layer_number is None:
            return
        self.record("topk_overlap", topk_overlap(indices, reference_indices, num_experts,
                                                 padding_mask), layer_number)

    def values(self) -> Dict[str, Dict[int, torch.Tensor]]:
        """Mean of each metric over its records, per layer, as device tensors (no host sync)."""
        return {
            name: {layer: total / count for layer, (total, count) in sorted(layers.items())}
            for name, layers in self._entries.items()
        }

    def report(self, clear: bool = True) -> Dict[str, Dict[int, object]]:
        """The means as Python numbers (lists for vector metrics): the one host sync."""
        out = {}
        for name, layers in self.values().items():
            out[name] = {layer: (v.item() if v.numel() == 1 else v.tolist())
                         for layer, v in layers.items()}
        if clear:
            self.clear()
        return out

    @staticmethod
    def format(report: Dict[str, Dict[int, object]]) -> str:
        """One line per scalar metric: the mean over layers, then the per-layer values."""
        lines = []
        for name, layers in report.items():
            vals = [v for v in layers.values() if not isinstance(v, list)]
            if not vals:
                continue
            per_layer = " ".join(f"L{layer}={v:.4g}" for layer, v in layers.items())
            lines.append(f"{name}: {sum(vals) / len(vals):.4g} ({per_layer})")
        return "\n".join(lines)

    def clear(self) -> None:
        self._entries.clear()
