"""Token dispatchers: move the permuted rows to the ranks that hold their experts, and back.

Expert parallelism over a ``torch.distributed`` group of ``N`` ranks (NCCL on GPUs, gloo on CPUs);
rank r holds the contiguous local experts ``[r·nle, (r+1)·nle)``, ``nle = E / N``. Routing,
token dropping and the combine stay on the token's own rank. Both dispatchers are Megatron's:

``alltoall`` (``AlltoAllDispatcher``)::

    counts [E] = routing_map.sum(0)            all-gathered -> [N, E]    (dropless / dropping)
    rows [T·K, H], layout = permute_tokens(x, routing_map, probs)   (the layer, as asked:
                                               expert-major = destination-rank-major)
    recv = all_to_all(rows, output_splits, input_splits)     then the fp32 probs, same splits
    recv = sort_chunks_by_idxs(recv)           (source, local expert) -> (local expert, source)
    y = experts(recv)                          grouped GEMMs on nle experts
    ... the inverse: chunk sort back, all_to_all back, combine (per-token fp32 gather-sum over
    the layout: the dispatcher owns the combine)

``allgather`` (``AllGatherDispatcher``): all-gather the tokens, probs and maps of the group,
permute the gathered tokens routed to local experts, run them, sum each token's local rows in
fp32, and reduce-scatter those partial sums (fp32) back to the tokens' ranks.

The one clever idea is the order: every expert receives its rows in (source rank, token) order,
which is the order a single process sees for the concatenated batch. With the all-to-all
dispatcher each row meets the same GEMMs and each token's rows are summed on its own rank in the
same order at every N, so EP = N gives bitwise the single-process output, input gradient and
router gradient on each rank's tokens, and the expert weight gradients of the concatenated
batch (wherever the GEMM's reduction order does not depend on the row count, as on the CPU).
The allgather dispatcher sums a token's expert outputs per rank first (fp32, never rounded in
between), so it agrees within the combine's precision contract, not bit for bit.

Host synchronisation: only the dropless / dropping all-to-all needs its split sizes on the host.
Their device-to-host copy starts on a side stream right after the counts all-gather and is
waited on right before the first all-to-all, so permute runs meanwhile (Megatron's
``cuda_sync_point`` schedule); the backward reuses the host splits. Drop-and-pad exchanges equal
blocks of ``nle·capacity`` rows: no counts, no host read, so it compiles with
``torch.compile(fullgraph=True)`` and records into CUDA graphs. The allgather dispatcher sizes
its buffers from static bounds and never reads the device either. The dropless all-to-all
without a host read (NVSHMEM, a static receive budget) is ``moe_core.symm_exchange``
(``moe_alltoall_exchange="symm_mem"``). The layer's cross-rank agreement (``moe_core.layer``,
"Agreement") rides on the dropless / dropping counts all-gather and its host read
(:meth:`_Dispatcher.folds_agreement`); the other exchanges leave it to the layer.

Collectives are ``torch.distributed._functional_collectives`` (autograd, traced by dynamo); their
backward is the reverse exchange (all-to-all with swapped splits, reduce-scatter for all-gather),
and every sum in it runs in a fixed order (no floating-point atomics).
"""
from typing import Callable, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as fc

from moe_core import ops


# torch >= 2.14 names them *_single*, older releases *_tensor* (the same ops)
_all_gather = getattr(fc, "all_gather_single", None) or fc.all_gather_tensor
_all_gather_autograd = (getattr(fc, "all_gather_single_autograd", None)
                        or fc.all_gather_tensor_autograd)
_reduce_scatter_autograd = (getattr(fc, "reduce_scatter_single_autograd", None)
                            or fc.reduce_scatter_tensor_autograd)


def _wait(t: torch.Tensor, step: str = "collective") -> torch.Tensor:
    """The collective's result as a plain tensor (waits for it on the current stream).

    A collective that fails (the process group's timeout, a peer gone) raises a RuntimeError
    naming the layer's ``step``, so a rank left waiting by another rank's exception says which
    exchange it was in (a traced graph waits without the wrapper: its errors are torch's)."""
    if not isinstance(t, fc.AsyncCollectiveTensor):
        return t
    if torch.compiler.is_compiling():
        return fc.wait_tensor(t)
    try:
        return fc.wait_tensor(t)
    except RuntimeError as e:
        raise RuntimeError(
            f"moe_core expert parallelism: the {step} did not complete ({type(e).__name__}: "
            f"{e}). Another rank of the group failed or is in another collective; a training loop "
            f"must not go on after a step raised on one rank (README: expert parallelism)") from e


class _HostSplits:
    """Split sizes on their way to the host: started now, read by ``get()``.

    CUDA: the copy runs on a side stream (which first waits for the current one) into pinned
    memory, and ``get()`` waits on its event; the compute stream goes on meanwhile. CPU: a read.
    """
    _streams = {}

    def __init__(self, values: torch.Tensor):
        self.event = None
        if values.is_cuda:
            dev = values.device
            stream = _HostSplits._streams.get(dev)
            if stream is None:
                stream = _HostSplits._streams[dev] = torch.cuda.Stream(device=dev)
            stream.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(stream):
                self.host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
                self.host.copy_(values, non_blocking=True)
                values.record_stream(stream)
                self.event = torch.cuda.Event()
                self.event.record(stream)
        else:
            self.host = values

    def get(self) -> List[int]:
        if self.event is not None:
            self.event.synchronize()
        return self.host.tolist()


class _Dispatcher:
    """What every dispatcher knows: the group, this rank's place in it, the local experts.

    The layer makes the tokens' :class:`moe_core.ops.RoutingLayout` as :meth:`layout_request`
    asks (with the rows or without, drop-and-pad or not), then
    ``dispatch(x, layout, rows)`` returns the local experts' rows ``[R_local, H]``, their probs
    ``[R_local]``, the local ``expert_offsets`` ``[nle + 1]`` and a handle, and
    ``combine(y, handle)`` returns ``[T, H]``: the dispatcher owns the combine (each token's
    rows come back to its rank and are summed there, in a fixed order).
    """

    def __init__(self, group: dist.ProcessGroup, num_experts: int, drop_and_pad: bool = False):
        """drop_and_pad: Megatron's ``moe_pad_expert_input_to_capacity`` (every expert block
        padded to the capacity, so the exchanged blocks have static sizes)."""
        self.group = group
        self.ep_size = dist.get_world_size(group)
        self.ep_rank = dist.get_rank(group)
        self.num_experts = num_experts
        self.nle = num_experts // self.ep_size
        self.drop_and_pad = bool(drop_and_pad)
        # A group of one exchanges nothing: the collectives, the chunk sort and the host read
        # are identities and are skipped (as Megatron's all-to-all returns its input at one
        # rank). Tests set it to force the collectives at one rank.
        self.exchange = self.ep_size > 1

    def layout_request(self) -> Tuple[bool, bool]:
        """``(with_rows, drop_and_pad)``: whether :meth:`dispatch` reads the rows (made in the
        layout's pass) and whether the layout is Megatron's drop-and-pad one (only where blocks
        of the capacity are exchanged; a group of one runs the single-device layout)."""
        return True, self.drop_and_pad and self.exchange

    def plan(self, routing_map: torch.Tensor, agreement=None):
        """The exchange's own planning from the routing map, started before the layout is made
        (so a host copy it waits for later runs meanwhile); handed back to :meth:`dispatch`.
        None where there is none. ``agreement``: ``(row, check)``, the layer's agreement row to
        fold into the exchange's own all-gather and the function that checks the gathered table
        (only where :meth:`folds_agreement`)."""
        return None

    def folds_agreement(self) -> bool:
        """True where :meth:`plan` all-gathers the token counts and reads them on the host (the
        dropless / dropping all-to-all), so the layer's agreement rides on that all-gather."""
        return False


class AlltoAllDispatcher(_Dispatcher):
    """Megatron's ``alltoall`` dispatcher over ``group`` (``N`` ranks, ``nle`` local experts)."""

    def __init__(self, group: dist.ProcessGroup, num_experts: int, drop_and_pad: bool = False):
        super().__init__(group, num_experts, drop_and_pad)
        N, nle = self.ep_size, self.nle
        chunks = torch.arange(N * nle)
        # (source, local expert) chunks -> (local expert, source), and back
        self._chunk_order = {"sort": chunks.reshape(N, nle).t().reshape(-1),
                             "restore": chunks.reshape(nle, N).t().reshape(-1)}

    def chunk_order(self, which: str, device: torch.device) -> torch.Tensor:
        """The chunk permutation on ``device``, copied there once (no copy per step)."""
        key = (which, device)
        if key not in self._chunk_order:
            self._chunk_order[key] = self._chunk_order[which].to(device)
        return self._chunk_order[key]

    def _all_to_all(self, x: torch.Tensor, output_splits, input_splits) -> torch.Tensor:
        if not self.exchange:
            return x
        return fc.all_to_all_single_autograd(x, output_splits, input_splits, self.group)

    # ---- exchange steps, named as in Megatron ---------------------------------------------
    def preprocess(self, routing_map: torch.Tensor, agreement_row: Optional[torch.Tensor] = None
                   ) -> Tuple[torch.Tensor, _HostSplits]:
        """Token counts of the group: ``[N, nle]`` rows routed from each source rank to each local
        expert (on the device), and this rank's input / output split sizes on their way to the
        host (``[input_splits (N), output_splits (N)]``). ``agreement_row`` (int64 ``[k]``): the
        layer's agreement, all-gathered with the counts (one collective) and appended to the
        host values as the group's table (``[N·k]``)."""
        N, nle, E = self.ep_size, self.nle, self.num_experts
        counts = routing_map.sum(dim=0, dtype=torch.long)                           # [E]
        sent = counts if agreement_row is None else torch.cat([counts, agreement_row])
        gathered = _wait(_all_gather(sent, 0, self.group),
                         "token-count all-gather").view(N, -1)                     # [N, E (+k)]
        lo = self.ep_rank * nle
        per_local = gathered[:, lo:lo + nle]                                        # [N, nle]
        splits = [counts.view(N, nle).sum(1), per_local.sum(1)]                     # [2N]
        if agreement_row is not None:
            splits.append(gathered[:, E:].reshape(-1))                              # [N·k]
        return per_local, _HostSplits(torch.cat(splits))

    def plan(self, routing_map: torch.Tensor, agreement=None):
        """Dropless / dropping across ranks: :meth:`preprocess`, whose split sizes travel to the
        host while the layer makes the layout (Megatron's sync-point schedule), with the layer's
        agreement row folded in."""
        if self.folds_agreement():
            row, check = agreement if agreement is not None else (None, None)
            return self.preprocess(routing_map, row) + (check,)
        return None

    def folds_agreement(self) -> bool:
        return self.exchange and not self.drop_and_pad

    def dispatch(self, x: torch.Tensor, layout: ops.RoutingLayout, rows: torch.Tensor,
                 plan=None, overlap: Optional[Callable[[], None]] = None):
        """x ``[T, H]``, its layout (routing_map / probs ``[T, E]``, probs in the router dtype),
        its rows ``[R, H]`` (expert-major = destination-rank-major) and :meth:`plan`'s result.
        ``overlap`` runs after the rows are sent, before they are needed (the shared
        expert)."""
        N, nle = self.ep_size, self.nle
        if not self.exchange:  # a group of one: the plain layer's steps, every mode
            if overlap is not None:
                overlap()
            return rows, layout.row_probs, layout.expert_offsets, dict(layout=layout,
                                                                       identity=True)
        row_probs = layout.row_probs
        if layout.drop_and_pad:
            recv = self._all_to_all(rows, None, None)
            recv_probs = self._all_to_all(row_probs, None, None)
            if overlap is not None:
                overlap()
            cap = layout.num_rows // self.num_experts
            H = x.shape[1]
            # (source, local expert, slot) -> (local expert, source, slot): a view and a copy
            recv = _wait(recv, "dispatch all-to-all").view(N, nle, cap, H).transpose(0, 1) \
                .reshape(N * nle * cap, H)
            recv_probs = _wait(recv_probs, "dispatch all-to-all").view(N, nle, cap) \
                .transpose(0, 1).reshape(-1)
            offsets = torch.arange(nle + 1, device=x.device, dtype=torch.long) * (N * cap)
            return recv, recv_probs, offsets, dict(layout=layout, cap=cap)

        per_local, host, check = (plan if plan is not None
                                  else self.preprocess(layout.routing_map) + (None,))
        splits = host.get()                                    # the one host wait
        if check is not None:  # the layer's agreement, read with the splits
            check(splits[2 * N:])
        input_splits, output_splits = splits[:N], splits[N:2 * N]
        used = sum(input_splits)
        if used != rows.shape[0]:  # dropping without padding: the bound's tail is unused
            rows, row_probs = rows[:used], row_probs[:used]
        recv = self._all_to_all(rows, output_splits, input_splits)
        recv_probs = self._all_to_all(row_probs, output_splits, input_splits)
        if overlap is not None:
            overlap()
        recv = _wait(recv, "dispatch all-to-all")
        recv_probs = _wait(recv_probs, "dispatch all-to-all")
        if nle > 1:
            recv, recv_probs = ops.sort_chunks_by_idxs(
                recv, per_local.reshape(-1), self.chunk_order("sort", x.device), recv_probs)
        tokens_per_local_expert = per_local.sum(0)                                  # [nle]
        offsets = torch.cat([tokens_per_local_expert.new_zeros(1),
                             tokens_per_local_expert.cumsum(0)])
        handle = dict(layout=layout, per_local=per_local, input_splits=input_splits,
                      output_splits=output_splits)
        return recv, recv_probs, offsets, handle

    def combine(self, y: torch.Tensor, handle: dict,
                overlap: Optional[Callable[[], None]] = None) -> torch.Tensor:
        """y ``[R_local, H]`` (the local experts' outputs) -> ``[T, H]`` on the tokens' rank."""
        N, nle = self.ep_size, self.nle
        H = y.shape[1]
        layout = handle["layout"]
        if handle.get("identity"):
            back = y
        elif layout.drop_and_pad:
            cap = handle["cap"]
            y = y.view(nle, N, cap, H).transpose(0, 1).reshape(N * nle * cap, H)
            back = self._all_to_all(y, None, None)
        else:
            if nle > 1:
                y, _ = ops.sort_chunks_by_idxs(y, handle["per_local"].t().reshape(-1),
                                               self.chunk_order("restore", y.device))
            back = self._all_to_all(y, handle["input_splits"], handle["output_splits"])
        if overlap is not None:
            overlap()
        back = _wait(back, "combine all-to-all")
        pad = layout.num_rows - back.shape[0]
        if pad > 0:  # dropping without padding: the rows past the used count were not sent
            back = torch.cat([back, back.new_zeros(pad, H)])
        return ops.combine(back, layout)


class AllGatherDispatcher(_Dispatcher):
    """Megatron's ``allgather`` dispatcher over ``group``: every rank sees the group's tokens and
    keeps the rows routed to its local experts. Needs the same token count on every rank."""

    def layout_request(self) -> Tuple[bool, bool]:
        """The exchange gathers the tokens and plans its own layout over them (below), so it
        reads the layout's routing map and probs, not its rows; a group of one runs the
        single-device steps on the rows."""
        return not self.exchange, False

    def dispatch(self, x: torch.Tensor, layout: ops.RoutingLayout, rows: Optional[torch.Tensor],
                 plan=None, overlap: Optional[Callable[[], None]] = None):
        N, nle, T = self.ep_size, self.nle, x.shape[0]
        if not self.exchange:
            if overlap is not None:
                overlap()
            return rows, layout.row_probs, layout.expert_offsets, dict(layout=layout,
                                                                       identity=True)
        lo = self.ep_rank * nle
        step = "dispatch all-gather"
        x_all = _wait(_all_gather_autograd(x, 0, self.group), step)              # [N·T, H]
        probs_all = _wait(_all_gather_autograd(layout.probs, 0, self.group), step)  # [N·T, E]
        map_all = _wait(_all_gather(layout.routing_map.to(torch.uint8), 0, self.group), step)
        if overlap is not None:
            overlap()
        local_map = map_all[:, lo:lo + nle].bool()
        local_probs = probs_all[:, lo:lo + nle]
        # static bound: each token reaches at most min(K, nle) local experts (with padding to
        # capacity: at most nle·capacity rows per source rank)
        num_rows = layout.num_rows
        bound = N * (num_rows // self.num_experts * nle if self.drop_and_pad
                     else min(num_rows, T * nle))
        rows, gathered = ops.permute_tokens(x_all, local_map, local_probs, bound)
        return rows, gathered.row_probs, gathered.expert_offsets, dict(layout=gathered)

    def combine(self, y: torch.Tensor, handle: dict,
                overlap: Optional[Callable[[], None]] = None) -> torch.Tensor:
        if handle.get("identity"):
            if overlap is not None:
                overlap()
            return ops.combine(y, handle["layout"])
        partial = ops.combine(y.float(), handle["layout"])                       # [N·T, H] fp32
        out = _reduce_scatter_autograd(partial, "sum", 0, self.group)
        if overlap is not None:
            overlap()
        return _wait(out, "combine reduce-scatter").to(y.dtype)


DISPATCHERS = {"alltoall": AlltoAllDispatcher, "allgather": AllGatherDispatcher}
