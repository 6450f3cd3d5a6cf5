"""All-gather K/V context parallelism (the "llama3" / USP-ring-free baseline).

Every rank all-gathers the full main-sequence K/V, attends its own zigzag
queries to it with the same local kernel as the ring, and in the backward
reduce-scatters dK/dV back to the owners.  It is exact too; it exists to
measure what the ring saves: the all-gather needs equal-sized buffers, so
uneven shards are padded (and the padding is sent), nothing overlaps with
compute, and every rank holds the whole K/V.

Reported communication volume is per rank and follows the ring algorithms of
the collectives: an all-gather or reduce-scatter of ``W`` padded shards of
``S`` bytes sends ``(W-1) * S`` bytes per rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .attention import AttentionKernel, compute_dtype, default_scale, key_ranges, select_kernel
from .comm import CommStats, RingGroup
from .errors import ShapeMismatchError
from .zigzag import ZigzagLayout

__all__ = ["allgather_attention"]


def _all_gather(out, inp, group):
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, inp, group=group)


def _reduce_scatter(out, inp, group):
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    fn(out, inp, group=group)


class _AllGatherAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, layout: ZigzagLayout, ring: RingGroup, q_seq, q_limit, scale, kernel, stats):
        w = ring.size
        lens = layout.local_lens()
        t_max = max(lens)
        kv = torch.stack([k, v])
        if w > 1:
            padded = F.pad(kv, (0, 0, 0, 0, 0, t_max - kv.shape[1]))
            gathered = padded.new_empty((w * padded.shape[0],) + tuple(padded.shape[1:]))
            _all_gather(gathered, padded.contiguous(), group=ring.group)
            gathered = gathered.view((w,) + tuple(padded.shape))
            if stats is not None:
                stats.add("fwd", (w - 1) * padded.numel() * padded.element_size())
            shards = [gathered[j, :, : lens[j]] for j in range(w)]
        else:
            shards = [kv]
        full = layout.unshard(shards, dim=1)  # [2, T, Hkv, D] in packed (sorted) order
        keys = layout.global_sort_keys(q.device)
        lo, hi = key_ranges(q_seq, q_limit, keys, layout.key_stride)
        out, lse = kernel.forward(q, full[0], full[1], lo, hi, scale)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, full, out, lse, lo, hi)
        ctx.cfg = (layout, ring, scale, kernel, stats, k.shape[0])
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, full, out, lse, lo, hi = ctx.saved_tensors
        layout, ring, scale, kernel, stats, t_local = ctx.cfg
        cdt = compute_dtype(q.dtype)
        delta = (dout.to(cdt) * out.to(cdt)).sum(-1)
        dq, dk, dv = kernel.backward(dout, q, full[0], full[1], lse, delta, lo, hi, scale)
        dkv = torch.stack([dk, dv])
        w = ring.size
        if w > 1:
            lens = layout.local_lens()
            t_max = max(lens)
            per_rank = [
                F.pad(dkv.index_select(1, layout.local_indices(j).to(dkv.device)), (0, 0, 0, 0, 0, t_max - lens[j]))
                for j in range(w)
            ]
            send = torch.cat(per_rank).contiguous()  # [W*2, t_max, Hkv, D], rank-major
            mine = send.new_empty((2,) + tuple(send.shape[1:]))
            _reduce_scatter(mine, send, group=ring.group)
            if stats is not None:
                stats.add("bwd", (w - 1) * mine.numel() * mine.element_size())
            mine = mine[:, :t_local]
        else:
            mine = dkv
        return dq.to(q.dtype), mine[0].to(q.dtype), mine[1].to(q.dtype), None, None, None, None, None, None, None


def allgather_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: ZigzagLayout,
    q_seq: torch.Tensor,
    q_limit: torch.Tensor,
    *,
    group=None,
    scale: float | None = None,
    kernel: AttentionKernel | None = None,
    stats: CommStats | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as :func:`dcoco.parallel.ring_attention` (without branch K/V), via all-gather."""
    ring = RingGroup(group, layout.world_size)
    if k.shape != v.shape or k.dim() != 3 or k.shape[0] != layout.local_len(ring.rank):
        raise ShapeMismatchError(f"k/v must be this rank's [{layout.local_len(ring.rank)}, Hkv, D] shard")
    q_seq = torch.as_tensor(q_seq, dtype=torch.long, device=q.device)
    q_limit = torch.as_tensor(q_limit, dtype=torch.long, device=q.device)
    if q_seq.shape != (q.shape[0],) or q_limit.shape != (q.shape[0],):
        raise ShapeMismatchError("q_seq and q_limit need one entry per query")
    return _AllGatherAttention.apply(
        q,
        k,
        v,
        layout,
        ring,
        q_seq,
        q_limit,
        default_scale(q.shape[2]) if scale is None else float(scale),
        kernel if kernel is not None else select_kernel(q.device, q.dtype),
        stats,
    )
