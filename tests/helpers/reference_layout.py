"""Pure-PyTorch reference of the token layout ops, written from the spec, loop by loop.

Slow and obvious on purpose: every choice the C core makes (tie rules, padding rows, rounding
points) is spelled out here once, in the simplest form, for the tests to compare against.
"""
import math

import torch


def capacity(num_tokens, num_experts, capacity_factor, min_capacity=None):
    cap = math.ceil((num_tokens / num_experts) * capacity_factor)
    return max(cap, min_capacity) if min_capacity is not None else cap


def token_dropping(probs, routing_map, topk, capacity_factor, policy, pad):
    """Per column: stable descending sort of the key (NaN first), keep the first `capacity`."""
    T, E = probs.shape
    cap = capacity(T * topk, E, capacity_factor)
    mask = torch.zeros(T, E, dtype=torch.bool)
    for e in range(E):
        if cap > T:
            mask[:, e] = True
            continue
        if policy == "probs":
            vals = probs[:, e].double().cpu().tolist()
            rank = sorted(range(T), reverse=True,
                          key=lambda t: (math.isnan(vals[t]),
                                         0.0 if math.isnan(vals[t]) else vals[t], -t))
        else:
            rank = [t for t in range(T) if routing_map[t, e]] + \
                   [t for t in range(T) if not routing_map[t, e]]
        mask[rank[:cap], e] = True
    mask = mask.to(routing_map.device)
    final_map = mask if pad else (routing_map & mask)
    return probs * final_map, final_map


def num_rows(E, num_out, drop_and_pad, align):
    if drop_and_pad:
        block = num_out // E
        if align > 1:
            block = -(-block // align) * align
        return E * block
    return num_out + (E * (align - 1) if align > 1 else 0)


def permute(tokens, routing_map, probs, num_out, drop_and_pad=False, align=0):
    """Returns (rows, row_probs or None, sorted_indices, expert_offsets, tokens_per_expert)."""
    T, H = tokens.shape
    E = routing_map.shape[1]
    R = num_rows(E, num_out, drop_and_pad, align)
    a = max(align, 1)
    idx, rowp, counts = [], [], []
    for e in range(E):
        routed = [t for t in range(T) if routing_map[t, e]]
        if drop_and_pad:
            cap = num_out // E
            unrouted = [t for t in range(T) if not routing_map[t, e]]
            block = (routed + unrouted)[:cap] + [-1] * max(cap - T, 0)
        else:
            block = routed
        block = block + [-1] * ((-len(block)) % a)
        block = block[: max(R - len(idx), 0)]
        counts.append(len(block))
        idx += block
        rowp += [(probs[t, e] if t >= 0 else 0.0) for t in block] if probs is not None else []
    used = len(idx)
    idx += [-1] * (R - used)
    idx_t = torch.tensor(idx, dtype=torch.long, device=tokens.device)
    rows = torch.zeros(R, H, dtype=tokens.dtype, device=tokens.device)
    valid = idx_t >= 0
    rows[valid] = tokens[idx_t[valid]]
    pp = None
    if probs is not None:
        pp = torch.zeros(R, dtype=probs.dtype, device=tokens.device)
        if used:
            pp[:used] = torch.stack([torch.as_tensor(v, dtype=probs.dtype) for v in rowp])
    counts_t = torch.tensor(counts, dtype=torch.long, device=tokens.device)
    offsets = torch.cat([counts_t.new_zeros(1), counts_t.cumsum(0)])
    return rows, pp, idx_t, offsets, counts_t


def row_experts(offsets, R):
    """Expert of each row from the block starts (-1 outside every block)."""
    out = torch.full((R,), -1, dtype=torch.long)
    for e in range(offsets.numel() - 1):
        out[int(offsets[e]):int(offsets[e + 1])] = e
    return out


def unpermute(rows, sorted_indices, num_tokens, probs=None, offsets=None):
    """Each token: its rows in ascending order, weighted (rounded to P), summed in fp32/fp64."""
    H = rows.shape[1]
    P = torch.promote_types(rows.dtype, probs.dtype) if probs is not None else rows.dtype
    acc = torch.float64 if P == torch.float64 else torch.float32
    out = torch.zeros(num_tokens, H, dtype=rows.dtype, device=rows.device)
    experts = row_experts(offsets.cpu(), rows.shape[0]) if probs is not None else None
    for t in range(num_tokens):
        s = torch.zeros(H, dtype=acc)
        for r in (sorted_indices == t).nonzero().flatten().tolist():
            v = rows[r].cpu()
            if probs is not None:
                v = (v.to(P) * probs[t, experts[r]].cpu().to(P)).to(P)
            s = s + v.to(acc)
        out[t] = s.to(P).to(rows.dtype)
    return out
