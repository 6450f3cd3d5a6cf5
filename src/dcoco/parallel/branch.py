"""Branch (draft-query) structures and branch attention over a context-parallel main sequence.

Drafters train many short query *branches* hanging off the main sequence.  A
branch token ``i`` attends to

* main-sequence keys of its sequence up to a position limit (inclusive), which
  live on every rank and arrive by the ring, and
* a contiguous range ``[lo, hi)`` of *branch* keys, which live only on the rank
  that owns the branch and are never communicated.

Both parts are exact partial softmaxes that are merged with the LSE rule
``l = log(e^lm + e^lb)``, ``O = e^(lm-l) Om + e^(lb-l) Ob``.

Index conventions of the builders (one branch token = one query and one key):

* DFlash / DSpark / DCOCO block ``b`` of size ``B`` anchored at position ``a``
  of sequence ``s``: tokens ``b*B .. b*B+B-1`` (block-major).  They see main
  positions ``< a`` (``include_anchor=False``, the default: the block itself
  starts with the anchor token) or ``<= a``, and every *valid* token of their
  own block (bidirectional).  Tokens at ``j >= valid_len`` are padding: they
  are neither keys nor queries (their output is 0).
* EAGLE-3 training-time test with ``K`` extra steps at positions ``p_i``:
  token ``i*K + (k-1)`` is the step-``k`` query (``k = 1..K``) at ``p_i``
  (position-major).  It sees main positions ``<= p_i`` (the step-0 keys) and
  the branch keys of steps ``1..k`` at the same position (the diagonal,
  including itself), i.e. ``[i*K, i*K + k)``.

Ownership: a branch lives on the rank that owns its anchor / position token in
the zigzag layout (:func:`branch_owners`), so the features it needs are local.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .attention import AttentionKernel
from .comm import CommStats, RingGroup
from .errors import BranchSpecError, ShapeMismatchError
from .ring import ring_attention
from .zigzag import ZigzagLayout

__all__ = [
    "BranchSpec",
    "dflash_spec",
    "eagle3_ttt_spec",
    "branch_owners",
    "expand_blocks",
    "branch_attention",
]


@dataclass(frozen=True)
class BranchSpec:
    """Per-token structure of the branch queries held by one rank.

    Attributes (all int64 ``[n]``): ``seq_ids`` sequence of each token,
    ``limits`` last visible main position (``-1``: none), ``lo``/``hi`` visible
    range in the local branch K/V buffer.
    """

    seq_ids: torch.Tensor
    limits: torch.Tensor
    lo: torch.Tensor
    hi: torch.Tensor

    def __post_init__(self):
        n = self.seq_ids.shape
        if len(n) != 1 or any(t.shape != n for t in (self.limits, self.lo, self.hi)):
            raise BranchSpecError("seq_ids, limits, lo and hi must be 1-D of equal length")
        if n[0] and ((self.lo < 0).any() or (self.hi < self.lo).any()):
            raise BranchSpecError("branch ranges must satisfy 0 <= lo <= hi")

    def __len__(self) -> int:
        return int(self.seq_ids.numel())

    def to(self, device) -> "BranchSpec":
        return BranchSpec(*(t.to(device) for t in (self.seq_ids, self.limits, self.lo, self.hi)))


def _long(x) -> torch.Tensor:
    return torch.as_tensor(x, dtype=torch.long).reshape(-1)


def dflash_spec(seq_ids, anchors, block_size: int, *, valid_lens=None, include_anchor: bool = False) -> BranchSpec:
    """Structure of DFlash/DSpark/DCOCO blocks (see the module docstring for the layout)."""
    seq_ids, anchors = _long(seq_ids), _long(anchors)
    if seq_ids.shape != anchors.shape:
        raise BranchSpecError("seq_ids and anchors must have the same length")
    if block_size < 1:
        raise BranchSpecError(f"block_size must be >= 1, got {block_size}")
    if anchors.numel() and (anchors < 0).any():
        raise BranchSpecError("anchors must be non-negative")
    nb = anchors.numel()
    valid = torch.full((nb,), block_size, dtype=torch.long) if valid_lens is None else _long(valid_lens)
    if valid.shape != anchors.shape or (nb and ((valid < 0).any() or (valid > block_size).any())):
        raise BranchSpecError("valid_lens must be in [0, block_size] per block")
    j = torch.arange(block_size).repeat(nb)
    blk = torch.arange(nb).repeat_interleave(block_size)
    ok = j < valid[blk]
    start = blk * block_size
    limit = anchors[blk] - (0 if include_anchor else 1)
    return BranchSpec(
        seq_ids=seq_ids[blk],
        limits=torch.where(ok, limit, torch.full_like(limit, -1)),
        lo=start,
        hi=torch.where(ok, start + valid[blk], start),
    )


def eagle3_ttt_spec(seq_ids, positions, num_steps: int) -> BranchSpec:
    """Structure of EAGLE-3 training-time-test steps ``1..num_steps`` (position-major)."""
    seq_ids, positions = _long(seq_ids), _long(positions)
    if seq_ids.shape != positions.shape:
        raise BranchSpecError("seq_ids and positions must have the same length")
    if num_steps < 1:
        raise BranchSpecError(f"num_steps must be >= 1, got {num_steps}")
    n = positions.numel()
    i = torch.arange(n).repeat_interleave(num_steps)
    k = torch.arange(1, num_steps + 1).repeat(n)
    return BranchSpec(seq_ids=seq_ids[i], limits=positions[i], lo=i * num_steps, hi=i * num_steps + k)


def branch_owners(layout: ZigzagLayout, seq_ids, positions) -> torch.Tensor:
    """Rank owning each branch: the owner of its anchor / position token."""
    return layout.owners(_long(seq_ids), _long(positions))[0]


def expand_blocks(block_ids, tokens_per_block: int) -> torch.Tensor:
    """Token indices ``b*n .. b*n+n-1`` of the given blocks (to slice per-token tensors)."""
    b = _long(block_ids)
    return (b[:, None] * tokens_per_block + torch.arange(tokens_per_block)).reshape(-1)


def branch_attention(
    bq: torch.Tensor,
    bk: torch.Tensor,
    bv: torch.Tensor,
    k_main: torch.Tensor,
    v_main: torch.Tensor,
    spec: BranchSpec,
    layout: ZigzagLayout,
    *,
    q_main: torch.Tensor | None = None,
    group=None,
    scale: float | None = None,
    kernel: AttentionKernel | None = None,
    stats: CommStats | None = None,
):
    """Branch queries over the ring-circulated main K/V plus their rank-local branch K/V.

    Args:
        bq: ``[n, H, D]`` branch queries; ``bk``/``bv``: ``[Tb, Hkv, D]`` local branch keys/values.
        k_main, v_main: this rank's zigzag shard of the main K/V.
        spec: :class:`BranchSpec` with ``len(spec) == n``.
        q_main: optional local main-sequence queries; when given, their causal
            self-attention rides the *same* ring pass (one circulation of K/V
            serves both) and ``(main_out, branch_out)`` is returned.

    Returns:
        ``branch_out [n, H, D]``, or ``(main_out, branch_out)`` with ``q_main``.
    """
    if bq.dim() != 3 or bq.shape[0] != len(spec):
        raise ShapeMismatchError(f"bq has {bq.shape[0] if bq.dim() else 0} rows but the spec has {len(spec)}")
    dev = bq.device
    spec = spec.to(dev)
    if len(spec) and int(spec.hi.max()) > bk.shape[0]:
        raise BranchSpecError(f"spec references branch key {int(spec.hi.max()) - 1} but only {bk.shape[0]} exist")
    q, q_seq, q_lim, lo, hi = bq, spec.seq_ids, spec.limits, spec.lo, spec.hi
    n_main = 0
    if q_main is not None:
        rank = RingGroup(group, layout.world_size).rank
        n_main = q_main.shape[0]
        if n_main != layout.local_len(rank):
            raise ShapeMismatchError(f"q_main has {n_main} rows, the rank's shard has {layout.local_len(rank)}")
        z = torch.zeros(n_main, dtype=torch.long, device=dev)
        q = torch.cat([q_main, bq])
        q_seq = torch.cat([layout.local_seq_ids(rank).to(dev), q_seq])
        q_lim = torch.cat([layout.local_positions(rank).to(dev), q_lim])
        lo, hi = torch.cat([z, lo]), torch.cat([z, hi])
    out, _ = ring_attention(
        q,
        k_main,
        v_main,
        layout,
        q_seq,
        q_lim,
        branch_k=bk,
        branch_v=bv,
        branch_lo=lo,
        branch_hi=hi,
        group=group,
        scale=scale,
        kernel=kernel,
        stats=stats,
    )
    if q_main is None:
        return out
    return out[:n_main], out[n_main:]
