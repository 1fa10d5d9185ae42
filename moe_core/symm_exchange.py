"""Dropless expert parallelism without a host read: the all-to-all through symmetric memory.

``moe_alltoall_exchange="symm_mem"`` replaces the dropless all-to-all dispatcher's NCCL
exchange (whose split sizes must reach the host) by NVSHMEM's ``all_to_all_vdev``, which reads
the split sizes on the device. Its buffers are symmetric (the same shape on every rank), so the
receive side is a static budget of ``B = ceil(moe_alltoall_recv_factor · T · topk)`` rows, and
the kernel does not check it: overflow is prevented before the exchange by a rule every rank
computes alike from the all-gathered token counts.

Steps (``W`` ranks, ``nle`` local experts, ``R = T·topk`` permuted rows, all on the device)::

    counts [E] = routing_map.sum(0)  all-gathered -> [W(source), E]       (static shape)
    acceptance: receiver r fills its budget B in its chunk order (local expert e, then source s):
        accepted[r, e, s] = min(count[s, r·nle + e], max(B - rows before (e, s), 0))
    rows = permute_tokens(x)          [R, H], (destination rank, local expert) chunks (the layer)
    send = the accepted prefix of each chunk, compacted; probs bit-cast into pad columns
    recv = all_to_all_vdev(send)      [B, C], (source, local expert) chunks, tail zeroed
    recv = sort_chunks_by_idxs(recv)  (local expert, source), as the NCCL path
    y = experts(recv, offsets)        offsets from accepted[me] (rows past offsets[-1] ignored)
    combine: sort back, all_to_all_vdev back, un-compact (dropped rows zero), unpermute

The one clever idea: the acceptance rule is a pure function of the all-gathered ``[W, E]``
counts, so each sender knows, without any further exchange, how many rows of each of its
chunks the receiver keeps (a prefix of the chunk), and each receiver knows its chunk sizes and
expert offsets; nothing leaves the device. When nothing overflows every expert gets the same
rows in the same order as the NCCL path, so the results are bitwise equal. A dropped row
contributes zero to its token's output (as a token dropped by capacity); the layer keeps the
number of this rank's rows dropped as ``MoELayer.last_dropped_rows`` (a device tensor).

Packing: rows and their probs travel in one buffer ``[rows, C]`` of the activation dtype, the
prob's bytes bit-cast into pad columns after the ``H`` columns; ``C`` makes each row a multiple
of 64 bytes, because the kernel splits each peer's bytes evenly among its CUDA blocks.

Autograd: the exchange has none, so ``_Exchange`` is a Function whose backward is the reverse
exchange (its routes swapped); the gathers that compact and un-compact rows are masked index
selects with their inverse as the backward (no scatter-add, no atomics).

The exchange primitive is pluggable: ``NvshmemExchange`` (CUDA, ``all_to_all_vdev``),
``LocalExchange`` (an NCCL group of one rank, where NVSHMEM cannot rendezvous: a masked copy) and
``EmulatedExchange`` (any process group, reads the split sizes on the host: a test double for
gloo). The emulation runs only when asked for explicitly: ``MOE_SYMM_MEM_EMULATE=1`` in the
environment when the dispatcher is built, or ``emulate=True``; otherwise a group that is not
NCCL or a torch without NVSHMEM raises at construction.

Limits: the same token count on every rank (the budget and the buffers must agree); the
NVSHMEM heap (``NVSHMEM_SYMMETRIC_SIZE``) must hold, per distinct (T, H, dtype), up to eight
buffers (send / receive, rows with and without the probs' pad columns, in both directions):
``2 · (R + B) · (C_probs + C)`` elements, plus small split tensors, allocated once and reused.
The NVSHMEM exchange relies on ``all_to_all_vdev``'s own synchronisation: a peer writes into a
rank's receive buffer only once that rank has entered the same exchange, which it does after it
copied the previous result out (same stream).
"""
import math
import os
from typing import NamedTuple, Optional, Tuple

import torch
import torch.distributed as dist

from moe_core import ops
from moe_core.dispatcher import AlltoAllDispatcher, _all_gather, _wait

EMULATE_ENV = "MOE_SYMM_MEM_EMULATE"

_ROW_ALIGN_BYTES = 64


def packed_columns(hidden: int, dtype: torch.dtype, probs_dtype: Optional[torch.dtype]) -> int:
    """Columns ``C`` of the packed buffer: ``H`` values plus room for one prob's bytes, rounded
    up so that a row is a multiple of 64 bytes."""
    elt = torch.empty((), dtype=dtype).element_size()
    extra = 0 if probs_dtype is None else torch.empty((), dtype=probs_dtype).element_size()
    row_bytes = hidden * elt + extra
    row_bytes = -(-row_bytes // _ROW_ALIGN_BYTES) * _ROW_ALIGN_BYTES
    if row_bytes % elt:
        raise ValueError(f"activation dtype {dtype} does not tile a {_ROW_ALIGN_BYTES}-byte row")
    return row_bytes // elt


# ---- exchange primitives: packed rows + per-destination splits -> received rows + splits ----
class EmulatedExchange:
    """The exchange over any process group with ``all_to_all_single`` (a test double for the
    NVSHMEM exchange on gloo: it reads the split sizes on the host)."""

    def __init__(self, group: dist.ProcessGroup):
        self.group = group

    def buffer(self, rows: int, cols: int, dtype: torch.dtype, device) -> torch.Tensor:
        """Where the caller packs the rows to send, ``[rows, cols]``."""
        return torch.empty(rows, cols, dtype=dtype, device=device)

    def exchange(self, packed: torch.Tensor, splits: torch.Tensor,
                 out_rows: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """packed ``[R, C]``, splits ``[W]`` int64 (rows to each rank, in rank order, from row 0)
        -> ``([out_rows, C]`` with each source's rows concatenated in source order, zeros
        after them; received splits ``[W]`` int64)."""
        recv_splits = torch.empty_like(splits)
        dist.all_to_all_single(recv_splits, splits.contiguous(), group=self.group)
        send, recv = splits.tolist(), recv_splits.tolist()
        if sum(recv) > out_rows:
            raise RuntimeError(f"symm_mem exchange overflow: {sum(recv)} rows for a receive "
                               f"buffer of {out_rows}")
        got = packed.new_empty(sum(recv), packed.shape[1])
        dist.all_to_all_single(got, packed[:sum(send)].contiguous(), recv, send, group=self.group)
        out = packed.new_zeros(out_rows, packed.shape[1])
        out[:got.shape[0]] = got
        return out, recv_splits


class NvshmemExchange:
    """``torch.ops.symm_mem.all_to_all_vdev`` on symmetric buffers (NVSHMEM, CUDA only).

    Each buffer is allocated once per (role, shape, dtype, device) with ``symm_mem.empty`` (the
    same shape on every rank) and rendezvoused with the group; the results are copied out, so
    the buffers are free for the next exchange (the next layer, the backward)."""

    def __init__(self, group: dist.ProcessGroup):
        from torch.distributed import _symmetric_memory as symm_mem

        self.symm_mem = symm_mem
        self.group = group
        self.group_name = group.group_name
        self._buffers = {}
        schema = torch.ops.symm_mem.all_to_all_vdev.default._schema
        # torch releases before the split of in_out_splits take one [3, W] tensor
        self._split_args = sum(1 for a in schema.arguments if a.name != "group_name") - 2
        enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
        if enable is not None:
            try:
                enable(self.group_name)
            except Exception:  # noqa: BLE001 (newer releases need no enabling)
                pass

    def _symmetric(self, key, shape, dtype, device) -> torch.Tensor:
        key = (key, tuple(shape), dtype, torch.device(device))
        t = self._buffers.get(key)
        if t is None:
            sm = self.symm_mem
            get_backend = getattr(sm, "get_backend", None)
            if get_backend is None or get_backend(device) != "NVSHMEM":
                sm.set_backend("NVSHMEM")
            t = sm.empty(*shape, dtype=dtype, device=device)
            sm.rendezvous(t, self.group_name)
            self._buffers[key] = t
        return t

    def buffer(self, rows: int, cols: int, dtype: torch.dtype, device) -> torch.Tensor:
        return self._symmetric("in", (rows, cols), dtype, device)

    def exchange(self, packed: torch.Tensor, splits: torch.Tensor,
                 out_rows: int) -> Tuple[torch.Tensor, torch.Tensor]:
        W, dev = splits.shape[0], packed.device
        out = self._symmetric("out", (out_rows, packed.shape[1]), packed.dtype, dev)
        op = torch.ops.symm_mem.all_to_all_vdev
        if self._split_args == 2:
            in_splits = self._symmetric("in_splits", (W,), torch.int64, dev)
            out_splits = self._symmetric("out_splits_offsets", (2, W), torch.int64, dev)
            in_splits.copy_(splits)
            op(packed, out, in_splits, out_splits, self.group_name)
            recv = out_splits[0].clone()
        else:
            in_out = self._symmetric("in_out_splits", (3, W), torch.int64, dev)
            in_out[0].copy_(splits)
            op(packed, out, in_out, self.group_name)
            recv = in_out[1].clone()
        return out.clone(), recv


class LocalExchange:
    """The exchange in a group of one rank: the rows stay here (NVSHMEM's rendezvous needs two
    ranks). Same result as the exchange, with no host read: the first ``splits[0]`` rows, zeros
    after them."""

    def buffer(self, rows: int, cols: int, dtype: torch.dtype, device) -> torch.Tensor:
        return torch.empty(rows, cols, dtype=dtype, device=device)

    def exchange(self, packed: torch.Tensor, splits: torch.Tensor,
                 out_rows: int) -> Tuple[torch.Tensor, torch.Tensor]:
        n = min(packed.shape[0], out_rows)
        keep = torch.arange(n, device=packed.device) < splits[0]
        out = packed.new_zeros(out_rows, packed.shape[1])
        out[:n] = torch.where(keep.view(-1, 1), packed[:n], packed.new_zeros(()))
        return out, splits.clone()


def emulation_requested() -> bool:
    return os.environ.get(EMULATE_ENV, "0") not in ("", "0")


def make_exchange(group: dist.ProcessGroup, emulate: bool):
    """The exchange primitive for ``group``; raises ValueError naming what is missing."""
    if emulate:
        return EmulatedExchange(group)
    backend = dist.get_backend(group)
    if backend != "nccl":
        raise ValueError(
            f"moe_alltoall_exchange='symm_mem' needs NVSHMEM symmetric memory on CUDA over an "
            f"NCCL expert-parallel group; this group's backend is {backend!r}. Use "
            f"moe_alltoall_exchange='nccl' (tests on CPUs may set {EMULATE_ENV}=1 for the "
            f"emulated exchange)")
    try:
        from torch.distributed import _symmetric_memory as symm_mem
        available = bool(symm_mem.is_nvshmem_available())
        has_op = hasattr(torch.ops.symm_mem, "all_to_all_vdev")
    except (ImportError, AttributeError, RuntimeError):
        available = has_op = False
    if not (available and has_op):
        raise ValueError("moe_alltoall_exchange='symm_mem' needs NVSHMEM (torch."
                         "distributed._symmetric_memory.is_nvshmem_available() is False or "
                         "torch.ops.symm_mem.all_to_all_vdev is missing in this torch); use "
                         "moe_alltoall_exchange='nccl'")
    if dist.get_world_size(group) == 1:
        return LocalExchange()
    return NvshmemExchange(group)


# ---- routes: how rows reach the exchange and where they land ------------------------------
class _Route(NamedTuple):
    """One direction of an exchange. ``pre``: rows gathered before the exchange (``idx [n]``
    into the input, ``valid [n]``: False rows are zero), or None (the input as is). ``splits
    [W]``: rows to each rank. ``out_rows``: the receive buffer. ``post``: gather after it, or
    None (then rows at and past ``received`` (a device scalar) are zeroed)."""
    pre: Optional[Tuple[torch.Tensor, torch.Tensor]]
    splits: torch.Tensor
    out_rows: int
    post: Optional[Tuple[torch.Tensor, torch.Tensor]]
    received: Optional[torch.Tensor]


def _masked_gather(t: torch.Tensor, idx: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``t[idx]`` with the rows where ``valid`` is False zero; idx [n] in range, valid [n]."""
    got = t.index_select(0, idx)
    return torch.where(valid.view((-1,) + (1,) * (t.dim() - 1)), got, got.new_zeros(()))


def _run_route(exchange, route: _Route, x: torch.Tensor,
               probs: Optional[torch.Tensor]) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """x ``[n, H]``, probs ``[n]`` or None -> ``([route's rows, H]``, probs or None)."""
    if route.pre is not None:
        x = _masked_gather(x, *route.pre)
        probs = _masked_gather(probs, *route.pre) if probs is not None else None
    n, H = x.shape
    pdt = probs.dtype if probs is not None else None
    cols = packed_columns(H, x.dtype, pdt)
    buf = exchange.buffer(n, cols, x.dtype, x.device)
    buf[:, :H].copy_(x)
    if probs is not None:
        elt = x.element_size()
        pb = probs.element_size()
        buf.view(torch.uint8)[:, H * elt:H * elt + pb].copy_(
            probs.contiguous().view(torch.uint8).view(n, pb))
    out, _ = exchange.exchange(buf, route.splits, route.out_rows)
    y = out[:, :H]
    p = None
    if probs is not None:
        p = out.view(torch.uint8)[:, H * elt:H * elt + pb].contiguous().view(pdt).view(-1)
    if route.post is not None:
        y = _masked_gather(y, *route.post)
        p = _masked_gather(p, *route.post) if p is not None else None
    else:
        keep = torch.arange(route.out_rows, device=y.device) < route.received
        y = torch.where(keep.view(-1, 1), y, y.new_zeros(()))
        p = torch.where(keep, p, p.new_zeros(())) if p is not None else None
    return y.contiguous(), p


class _Exchange(torch.autograd.Function):
    """Rows (and probs) through ``forward_route``; the backward sends their gradients through
    ``backward_route`` (the reverse exchange)."""

    @staticmethod
    def forward(ctx, x, probs, exchange, forward_route, backward_route):
        ctx.exchange, ctx.route = exchange, backward_route
        ctx.has_probs = probs is not None
        ctx.probs_dtype = probs.dtype if probs is not None else None
        y, p = _run_route(exchange, forward_route, x, probs)
        if p is None:
            return y
        return y, p

    @staticmethod
    def backward(ctx, *grads):
        gy = grads[0].contiguous()
        gp = None
        if ctx.has_probs:
            gp = grads[1]
            if gp is None:
                gp = gy.new_zeros(gy.shape[0], dtype=ctx.probs_dtype)
            gp = gp.contiguous()
        dx, dp = _run_route(ctx.exchange, ctx.route, gy, gp)
        return dx, dp, None, None, None


# ---- the dispatcher ----------------------------------------------------------------------
def acceptance(gathered: torch.Tensor, ep_size: int, nle: int, budget: int) -> torch.Tensor:
    """Rows each receiver keeps: ``gathered [W(source), E]`` int64 -> ``accepted [W(receiver),
    nle, W(source)]``. Receiver r fills ``budget`` rows in its chunk order (local expert, then
    source): chunk (e, s) keeps ``min(count, max(budget - rows before it, 0))``."""
    W = ep_size
    a = gathered.view(W, W, nle).permute(1, 2, 0).reshape(W, nle * W)     # [r, (e, s)]
    before = a.cumsum(1) - a
    room = (budget - before).clamp_min(0)
    return torch.minimum(a, room).view(W, nle, W)


def _prefix_maps(counts: torch.Tensor, kept: torch.Tensor, rows: int):
    """Compaction of chunked rows to the kept prefix of each chunk.

    counts, kept ``[n]`` int64 (kept <= counts); the rows ``[rows]`` hold the chunks in order
    (sum(counts) <= rows, the tail unused). Returns ``(src [rows], src_valid [rows])``: compact
    position -> row, and ``(dest [rows], keep [rows])``: row -> compact position."""
    dev = counts.device
    i = torch.arange(rows, device=dev)
    ends, kends = counts.cumsum(0), kept.cumsum(0)
    starts, kstarts = ends - counts, kends - kept
    last = counts.shape[0] - 1
    g = torch.searchsorted(ends, i, right=True).clamp_max(last)
    j = i - starts[g]
    keep = (j < kept[g]) & (i < ends[last])
    dest = torch.where(keep, kstarts[g] + j, 0)
    gk = torch.searchsorted(kends, i, right=True).clamp_max(last)
    src_valid = i < kends[last]
    src = torch.where(src_valid, starts[gk] + (i - kstarts[gk]), 0)
    return (src, src_valid), (dest, keep)


class SymmMemAlltoAllDispatcher(AlltoAllDispatcher):
    """The dropless all-to-all dispatcher with the symmetric-memory exchange (module docstring).

    ``recv_factor``: the receive budget in units of ``T·topk`` rows. ``emulate``: use the
    emulated exchange (tests on gloo); None reads ``MOE_SYMM_MEM_EMULATE``.
    ``last_dropped_rows``: int64 device scalar, this rank's rows dropped by the budget in the
    last forward (None before one)."""

    def __init__(self, group: dist.ProcessGroup, num_experts: int, topk: int,
                 recv_factor: float, emulate: Optional[bool] = None, drop_and_pad: bool = False):
        super().__init__(group, num_experts, drop_and_pad)
        self.topk = topk
        self.recv_factor = recv_factor
        self.emulate = emulation_requested() if emulate is None else emulate
        self.exchanger = make_exchange(group, self.emulate)
        self.last_dropped_rows: Optional[torch.Tensor] = None

    def budget(self, num_tokens: int) -> int:
        """Receive rows per rank: ``ceil(recv_factor · T · topk)``."""
        return int(math.ceil(self.recv_factor * num_tokens * self.topk))

    def _chunk_order_with_tail(self, which: str, device) -> torch.Tensor:
        key = (which + "+tail", device)
        if key not in self._chunk_order:
            order = self.chunk_order(which, device)
            self._chunk_order[key] = torch.cat([order, order.new_tensor([order.shape[0]])])
        return self._chunk_order[key]

    def plan(self, routing_map: torch.Tensor, agreement=None):
        """Nothing to start early: the budgeted exchange reads no split size on the host."""
        return None

    def folds_agreement(self) -> bool:
        return False

    def dispatch(self, x, layout, rows, plan=None, overlap=None):
        if not self.exchange or layout.drop_and_pad:
            return super().dispatch(x, layout, rows, plan, overlap)
        routing_map, row_probs = layout.routing_map, layout.row_probs
        W, nle, E, me = self.ep_size, self.nle, self.num_experts, self.ep_rank
        dev = x.device
        B = self.budget(x.shape[0])
        counts = routing_map.sum(dim=0, dtype=torch.long)                          # [E]
        gathered = _wait(_all_gather(counts, 0, self.group),
                         "token-count all-gather").view(W, E)                      # [W, E]
        acc = acceptance(gathered, W, nle, B)                                      # [r, e, s]
        send_acc = acc[:, :, me].reshape(E)              # kept rows of my (dest, expert) chunks
        recv_acc = acc[me]                               # [nle, W] rows I receive, (e, s)
        self.last_dropped_rows = counts.sum() - send_acc.sum()
        R = rows.shape[0]
        compact, expand = _prefix_maps(counts, send_acc, R)
        send_splits = send_acc.view(W, nle).sum(1)                                 # [W]
        recv_splits = recv_acc.sum(0)                                              # [W]
        received = recv_splits.sum()
        forward_route = _Route(compact, send_splits, B, None, received)
        backward_route = _Route(None, recv_splits, R, expand, None)
        recv, recv_probs = _Exchange.apply(rows, row_probs, self.exchanger, forward_route,
                                           backward_route)
        if overlap is not None:
            overlap()
        # (source, local expert) chunks -> (local expert, source); the unused tail stays last
        by_source = torch.cat([recv_acc.t().reshape(-1), (B - received).view(1)])
        by_expert = torch.cat([recv_acc.reshape(-1), (B - received).view(1)])
        if nle > 1:
            recv, recv_probs = ops.sort_chunks_by_idxs(
                recv, by_source, self._chunk_order_with_tail("sort", dev), recv_probs)
        per_expert = recv_acc.sum(1)                                               # [nle]
        offsets = torch.cat([per_expert.new_zeros(1), per_expert.cumsum(0)])
        handle = dict(layout=layout, symm=True, by_expert=by_expert,
                      routes=(backward_route, forward_route))
        return recv, recv_probs, offsets, handle

    def combine(self, y, handle, overlap=None):
        if not handle.get("symm"):
            return super().combine(y, handle, overlap)
        if self.nle > 1:
            y, _ = ops.sort_chunks_by_idxs(y, handle["by_expert"],
                                           self._chunk_order_with_tail("restore", y.device))
        forward_route, backward_route = handle["routes"]
        back = _Exchange.apply(y, None, self.exchanger, forward_route, backward_route)
        if overlap is not None:
            overlap()
        return ops.combine(back, handle["layout"])
