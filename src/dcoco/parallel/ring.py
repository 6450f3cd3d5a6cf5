"""Zigzag ring attention with an exact hand-written backward.

Forward (rank ``r`` of ``W``): the main-sequence K/V shard (packed as one
``[2, T, Hkv, D]`` buffer so each step is a single message) travels
``r -> r+1``; at step ``s`` rank ``r`` holds the shard of rank ``r-s`` and has
already posted the transfer of the next one (``batch_isend_irecv``), so the
transfer overlaps the local kernel.  Every step yields a partial
``(O, LSE)`` that is folded in with :func:`merge_partials`.  Optional
rank-local *branch* K/V (draft queries' own keys) is one more partial, computed
while the first transfer is in flight; it never leaves the rank.

Backward: the K/V shards circulate again in the same direction, and next to
them a second ring carries the ``dK/dV`` accumulator of each shard: a rank adds
its contribution for the shard it currently holds and passes the accumulator
on, so after ``W`` hops it is back at its owner with every rank's share.  ``dQ``
only depends on local queries and accumulates in place.  All pieces use the
global ``LSE`` and ``delta = rowsum(dO * O)``, which makes the per-shard
gradients independent (flash-attention's recipe) and the result exact.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .attention import AttentionKernel, compute_dtype, default_scale, key_ranges, merge_partials, select_kernel
from .comm import CommStats, RingGroup, wait_all
from .errors import BranchSpecError, ShapeMismatchError
from .zigzag import ZigzagLayout

__all__ = ["ring_attention", "zigzag_ring_attention"]

# gloo matches point-to-point messages by (peer, tag); NCCL ignores tags and
# relies on the identical posting order, which this schedule also guarantees.
_TAG_FWD_KV, _TAG_BWD_KV, _TAG_BWD_ACC = 11, 12, 13


@dataclass
class _Plan:
    layout: ZigzagLayout
    ring: RingGroup
    q_seq: torch.Tensor
    q_limit: torch.Tensor
    b_lo: torch.Tensor | None
    b_hi: torch.Tensor | None
    scale: float
    kernel: AttentionKernel
    stats: CommStats | None

    def ranges(self, origin: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        keys = self.layout.sort_keys(origin, device)
        return key_ranges(self.q_seq, self.q_limit, keys, self.layout.key_stride)


def _ring_forward(q, k, v, bk, bv, plan: _Plan):
    ring, layout = plan.ring, plan.layout
    w, r = ring.size, ring.rank
    cdt = compute_dtype(q.dtype)
    out = q.new_zeros(q.shape, dtype=cdt)
    lse = q.new_full(q.shape[:2], float("-inf"), dtype=cdt)
    kv = torch.stack([k, v]).contiguous()
    origin = r
    for s in range(w):
        works, recv = [], None
        if s < w - 1:
            nxt = (origin - 1) % w
            recv = kv.new_empty((2, layout.local_len(nxt)) + tuple(kv.shape[2:]))
            works = ring.shift(kv, recv, _TAG_FWD_KV, plan.stats, "fwd")
        if s == 0 and bk is not None:
            ob, lb = plan.kernel.forward(q, bk, bv, plan.b_lo, plan.b_hi, plan.scale)
            out, lse = merge_partials(out, lse, ob, lb)
        lo, hi = plan.ranges(origin, q.device)
        ob, lb = plan.kernel.forward(q, kv[0], kv[1], lo, hi, plan.scale)
        out, lse = merge_partials(out, lse, ob, lb)
        wait_all(works)
        if recv is not None:
            kv, origin = recv, nxt
    return out, lse


def _ring_backward(dout, q, k, v, bk, bv, out, lse, plan: _Plan):
    ring, layout = plan.ring, plan.layout
    w, r = ring.size, ring.rank
    cdt = compute_dtype(q.dtype)
    delta = (dout.to(cdt) * out.to(cdt)).sum(-1)
    dq = q.new_zeros(q.shape, dtype=cdt)
    dbk = dbv = None
    if bk is not None:
        dq_b, dbk, dbv = plan.kernel.backward(dout, q, bk, bv, lse, delta, plan.b_lo, plan.b_hi, plan.scale)
        dq += dq_b
    kv = torch.stack([k, v]).contiguous()
    origin = r
    acc_works, acc_next = [], None
    for s in range(w):
        kv_works, kv_next = [], None
        if s < w - 1:
            nxt = (origin - 1) % w
            kv_next = kv.new_empty((2, layout.local_len(nxt)) + tuple(kv.shape[2:]))
            kv_works = ring.shift(kv, kv_next, _TAG_BWD_KV, plan.stats, "bwd")
        lo, hi = plan.ranges(origin, q.device)
        dq_s, dk_s, dv_s = plan.kernel.backward(dout, q, kv[0], kv[1], lse, delta, lo, hi, plan.scale)
        dq += dq_s
        if s == 0:
            acc = torch.stack([dk_s, dv_s])
        else:
            wait_all(acc_works)  # accumulator of shard `origin`, filled by ranks r-1, r-2, ...
            acc = acc_next
            acc[0] += dk_s
            acc[1] += dv_s
        if w > 1:
            # pass the accumulator on; receive the one of the shard we will hold next
            # (after the last step that is our own shard, back from its round trip)
            acc_next = acc.new_empty((2, layout.local_len((origin - 1) % w)) + tuple(acc.shape[2:]))
            acc_works = ring.shift(acc, acc_next, _TAG_BWD_ACC, plan.stats, "bwd")
        wait_all(kv_works)
        if kv_next is not None:
            kv, origin = kv_next, nxt
    if w > 1:
        wait_all(acc_works)
        acc = acc_next
    return dq, acc[0], acc[1], dbk, dbv


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, bk, bv, plan: _Plan):
        out, lse = _ring_forward(q, k, v, bk, bv, plan)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, bk, bv, out, lse)
        ctx.plan = plan
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, bk, bv, out, lse = ctx.saved_tensors
        grads = _ring_backward(dout, q, k, v, bk, bv, out, lse, ctx.plan)
        return tuple(None if g is None else g.to(ref.dtype) for g, ref in zip(grads, (q, k, v, bk, bv))) + (None,)


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: ZigzagLayout,
    q_seq: torch.Tensor,
    q_limit: torch.Tensor,
    *,
    branch_k: torch.Tensor | None = None,
    branch_v: torch.Tensor | None = None,
    branch_lo: torch.Tensor | None = None,
    branch_hi: torch.Tensor | None = None,
    group=None,
    scale: float | None = None,
    kernel: AttentionKernel | None = None,
    stats: CommStats | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of arbitrary local queries over the zigzag-sharded main sequence (+ local branch keys).

    Query ``i`` sees every main-sequence key (on any rank) of sequence
    ``q_seq[i]`` at position ``<= q_limit[i]`` (``-1``: none), plus, if branch
    K/V is given, the local branch keys ``branch_lo[i] <= j < branch_hi[i]``.

    Args:
        q: ``[Tq, H, D]`` local queries (main tokens, draft tokens, or both).
        k, v: ``[T_r, Hkv, D]`` this rank's zigzag shard of the main K/V.
        layout: the :class:`ZigzagLayout` of the main sequence.
        q_seq, q_limit: ``[Tq]`` int64 sequence id and last visible main position.
        branch_k, branch_v: ``[Tb, Hkv, D]`` rank-local branch K/V (never communicated).
        branch_lo, branch_hi: ``[Tq]`` int64 visible branch-key range per query.
        group: process group of size ``layout.world_size`` (``None``: default
            group, or single-process mode when ``world_size == 1``).
        scale: softmax scale, default ``1/sqrt(D)``.
        kernel: local kernel, default :func:`select_kernel`.
        stats: optional :class:`CommStats` to which sent bytes are added.

    Returns:
        ``(out [Tq, H, D], lse [Tq, H])``; rows that see no key give 0 and -inf.
        ``out`` is differentiable w.r.t. ``q``, ``k``, ``v``, ``branch_k``, ``branch_v``.
    """
    ring = RingGroup(group, layout.world_size)
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ShapeMismatchError("q, k, v must be [tokens, heads, head_dim]")
    if k.shape != v.shape:
        raise ShapeMismatchError(f"k {tuple(k.shape)} and v {tuple(v.shape)} differ")
    if k.shape[0] != layout.local_len(ring.rank):
        raise ShapeMismatchError(
            f"rank {ring.rank} holds {k.shape[0]} main tokens but its zigzag shard has {layout.local_len(ring.rank)}"
        )
    if q.shape[2] != k.shape[2] or q.shape[1] % k.shape[1]:
        raise ShapeMismatchError(f"q {tuple(q.shape)} incompatible with k {tuple(k.shape)}")
    if q.dtype != k.dtype or q.dtype != v.dtype or q.device != k.device or q.device != v.device:
        raise ShapeMismatchError("q, k, v must share dtype and device")
    tq = q.shape[0]
    q_seq = torch.as_tensor(q_seq, dtype=torch.long, device=q.device)
    q_limit = torch.as_tensor(q_limit, dtype=torch.long, device=q.device)
    if q_seq.shape != (tq,) or q_limit.shape != (tq,):
        raise ShapeMismatchError(f"q_seq and q_limit must have shape ({tq},)")
    if tq and (q_seq.min() < 0 or q_seq.max() >= layout.num_seqs):
        raise BranchSpecError("q_seq holds a sequence id outside the layout")
    given = [x is not None for x in (branch_k, branch_v, branch_lo, branch_hi)]
    if any(given) and not all(given):
        raise BranchSpecError("branch_k, branch_v, branch_lo and branch_hi must be given together")
    if all(given):
        if branch_k.shape != branch_v.shape or branch_k.dim() != 3 or branch_k.shape[1:] != k.shape[1:]:
            raise ShapeMismatchError(
                f"branch K/V {tuple(branch_k.shape)}/{tuple(branch_v.shape)} must be [Tb, {k.shape[1]}, {k.shape[2]}]"
            )
        if branch_k.dtype != q.dtype or branch_v.dtype != q.dtype:
            raise ShapeMismatchError("branch K/V must have the dtype of q")
        branch_lo = torch.as_tensor(branch_lo, dtype=torch.long, device=q.device)
        branch_hi = torch.as_tensor(branch_hi, dtype=torch.long, device=q.device)
        if branch_lo.shape != (tq,) or branch_hi.shape != (tq,):
            raise ShapeMismatchError(f"branch_lo and branch_hi must have shape ({tq},)")
        if tq and (branch_lo.min() < 0 or branch_hi.max() > branch_k.shape[0] or (branch_hi < branch_lo).any()):
            raise BranchSpecError("branch ranges must satisfy 0 <= lo <= hi <= Tb")
    plan = _Plan(
        layout=layout,
        ring=ring,
        q_seq=q_seq,
        q_limit=q_limit,
        b_lo=branch_lo,
        b_hi=branch_hi,
        scale=default_scale(q.shape[2]) if scale is None else float(scale),
        kernel=kernel if kernel is not None else select_kernel(q.device, q.dtype),
        stats=stats,
    )
    return _RingAttention.apply(q, k, v, branch_k, branch_v, plan)


def zigzag_ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: ZigzagLayout,
    *,
    group=None,
    scale: float | None = None,
    kernel: AttentionKernel | None = None,
    stats: CommStats | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal self-attention of this rank's zigzag shard of packed sequences.

    ``q``/``k``/``v`` are the local shards (:meth:`ZigzagLayout.shard`);
    returns the local shard of the output and its LSE.
    """
    ring = RingGroup(group, layout.world_size)
    if q.shape[0] != layout.local_len(ring.rank):
        raise ShapeMismatchError(
            f"rank {ring.rank} holds {q.shape[0]} query tokens but its zigzag shard has {layout.local_len(ring.rank)}"
        )
    dev = q.device
    return ring_attention(
        q,
        k,
        v,
        layout,
        layout.local_seq_ids(ring.rank).to(dev),
        layout.local_positions(ring.rank).to(dev),
        group=group,
        scale=scale,
        kernel=kernel,
        stats=stats,
    )
