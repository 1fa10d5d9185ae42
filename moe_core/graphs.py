"""A whole training step (forward, loss, backward, optimizer step) replayed from a CUDA graph.

At fine-grained shapes a layer's forward + backward is hundreds of small kernels, and the host
time to issue them can exceed the GPU's: a CUDA graph issues the whole step at once. The dropless
single-GPU layer and the drop-and-pad / allgather / ``symm_mem`` expert-parallel layers read
nothing on the host, so a step that holds them records whole.

:class:`GraphedTrainStep` is PyTorch's whole-network capture, with what an MoE training loop needs
on top of it:

* the first ``warmup`` calls are ordinary eager steps on the caller's batches (on a side stream,
  as capture requires), so no step is spent on warm-up data: training with the graph gives the
  same weights as training without it;
* the parameters' gradients are set to None before the capture, so the captured backward makes
  them in the graph's memory pool and every replay rewrites them (no zeroing inside the graph);
* everything the layer keeps between steps is updated in place, so eager code between replays
  sees and changes what the graph reads and writes: ``finalize_step`` (the expert-bias update and
  the global aux loss's reset), ``AuxLossScale.set``, ``router.last_losses`` and
  ``router.last_routing_load`` (the last replay's values);
* the optimizer must be capturable (``capturable=True`` where it has the option: its step count
  lives on the device), checked at construction.

A step whose inputs change shape, or a layer that reads the device on the host (dropless or
dropping expert parallelism over NCCL: the all-to-all's split sizes), cannot be replayed: build one
step per shape, use drop-and-pad or ``moe_alltoall_exchange="symm_mem"``, or pass
``enabled=False``, which runs every call eagerly with the same interface (also the CPU's path).
"""
from typing import Callable, List, Optional

import torch


class GraphedTrainStep:
    """``step(*batch) -> loss``: one training step of ``loss_fn`` and ``optimizer``.

    Args:
        loss_fn: ``loss_fn(*batch) -> loss``, a 0-d tensor: the model's forward and the loss
            (aux losses reach the gradients through the router, as in eager mode).
        optimizer: steps the parameters after the backward; capturable (see the module).
        warmup: eager steps before the capture (at least 1: lazy initialisation, autotuning and
            the allocator's pools happen there, not in the graph).
        enabled: False runs every call eagerly (no graph): the same steps, for debugging or a
            device without CUDA graphs.

    Call it with tensors of the same shapes, dtypes and devices every time (the graph's static
    inputs are copied from them); the returned loss is the graph's own output tensor from the
    capture on, overwritten by the next call: clone it to keep it.
    """

    def __init__(self, loss_fn: Callable[..., torch.Tensor], optimizer: torch.optim.Optimizer, *,
                 warmup: int = 3, enabled: bool = True):
        if not isinstance(warmup, int) or isinstance(warmup, bool) or warmup < 1:
            raise ValueError(f"warmup must be an int of at least 1, got {warmup!r}")
        if enabled:
            for i, group in enumerate(optimizer.param_groups):
                if group.get("capturable") is False:
                    raise ValueError(
                        f"optimizer param group {i} has capturable=False: a CUDA graph replays "
                        f"the optimizer step, whose step count must live on the device; build "
                        f"{type(optimizer).__name__}(..., capturable=True) (or pass enabled=False)")
        self.loss_fn, self.optimizer = loss_fn, optimizer
        self.warmup, self.enabled = warmup, enabled
        self.calls = 0
        self.graph: Optional[torch.cuda.CUDAGraph] = None
        self._inputs: List[torch.Tensor] = []
        self._loss: Optional[torch.Tensor] = None
        self._stream: Optional[torch.cuda.Stream] = None

    def _eager(self, batch) -> torch.Tensor:
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.loss_fn(*batch)
        loss.backward()
        self.optimizer.step()
        return loss.detach()

    def _check_batch(self, batch) -> None:
        if not all(isinstance(t, torch.Tensor) for t in batch):
            got = [type(t).__name__ for t in batch]
            raise TypeError(f"GraphedTrainStep takes tensors, got {got}")
        if self.graph is None:
            return
        if len(batch) != len(self._inputs):
            raise ValueError(f"the graph was captured with {len(self._inputs)} inputs, "
                             f"got {len(batch)}")
        for i, (t, s) in enumerate(zip(batch, self._inputs)):
            if (t.shape, t.dtype, t.device) != (s.shape, s.dtype, s.device):
                raise ValueError(
                    f"batch[{i}]: {tuple(t.shape)} {t.dtype} on {t.device}, but the graph was "
                    f"captured for {tuple(s.shape)} {s.dtype} on {s.device} (one "
                    f"GraphedTrainStep per input shape)")

    def __call__(self, *batch: torch.Tensor) -> torch.Tensor:
        self._check_batch(batch)
        self.calls += 1
        if not self.enabled:
            return self._eager(batch)
        if self._stream is None:
            if not all(t.is_cuda for t in batch):
                raise ValueError("GraphedTrainStep captures CUDA work: every batch tensor must be "
                                 "on a CUDA device (or pass enabled=False)")
            self._stream = torch.cuda.Stream()
        if self.graph is None and self.calls <= self.warmup:
            # eager steps on a side stream: what the capture will record must have run once
            # off the capturing stream's default (the docs' warm-up rule)
            self._stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self._stream):
                loss = self._eager(batch)
            torch.cuda.current_stream().wait_stream(self._stream)
            return loss
        if self.graph is None:
            self._capture(batch)
        else:
            for s, t in zip(self._inputs, batch):
                s.copy_(t)
        self.graph.replay()
        return self._loss

    def _capture(self, batch) -> None:
        self._inputs = [t.detach().clone() for t in batch]
        torch.cuda.synchronize()
        self.optimizer.zero_grad(set_to_none=True)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            loss = self.loss_fn(*self._inputs)
            loss.backward()
            self.optimizer.step()
        self._loss = loss.detach()
        self.graph = graph
