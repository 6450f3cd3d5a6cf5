"""Zigzag (load-balanced) context-parallel layout of packed sequences.

Why zigzag: under causal attention, token ``t`` attends to ``t + 1`` keys, so
cutting a sequence into ``W`` contiguous pieces gives the last rank ~2W-1 times
the work of the first.  Cutting each sequence into ``2W`` chunks and giving
rank ``r`` chunks ``r`` and ``2W-1-r`` pairs a cheap chunk with an expensive
one, so every rank does the same causal work (up to one token per chunk).

Index conventions (used throughout :mod:`dcoco.parallel`):

* The *packed* (global) tensor concatenates the sequences along dim 0; the
  offsets are ``cu_seqlens`` (length ``n_seq + 1``), exactly as flash-attn's
  varlen API.
* Chunk ``c`` of a sequence of length ``L`` covers positions
  ``[floor(c*L/2W), floor((c+1)*L/2W))``.  Lengths need not be divisible by
  ``2W``; chunks differ by at most one token (no padding is ever inserted).
* The *local shard* of rank ``r`` is, for every sequence in order, the tokens of
  chunk ``r`` followed by the tokens of chunk ``2W-1-r``.  Inside a shard the
  tokens are therefore sorted by ``(sequence, position)``; :meth:`sort_keys`
  exposes that order as one int64 key per token, which the ring uses to turn a
  "same sequence, position <= limit" rule into a contiguous key range.
"""

from __future__ import annotations

from typing import Sequence

import torch

from .errors import LayoutError, ShapeMismatchError

__all__ = ["ZigzagLayout"]


class ZigzagLayout:
    """The zigzag assignment of packed variable-length sequences to ``world_size`` ranks.

    The layout is pure metadata computed identically on every rank, so no
    communication is needed to know the size or the token positions of another
    rank's shard (the ring relies on this to size its receive buffers).
    """

    def __init__(self, seqlens: Sequence[int], world_size: int):
        if isinstance(seqlens, torch.Tensor):
            seqlens = seqlens.tolist()
        seqlens = tuple(int(s) for s in seqlens)
        if len(seqlens) == 0:
            raise LayoutError("at least one sequence is required")
        if any(s <= 0 for s in seqlens):
            raise LayoutError(f"sequence lengths must be positive, got {seqlens}")
        if int(world_size) != world_size or world_size < 1:
            raise LayoutError(f"world_size must be a positive integer, got {world_size!r}")
        self.seqlens = seqlens
        self.world_size = int(world_size)
        self.num_seqs = len(seqlens)
        self.total = sum(seqlens)
        self.max_len = max(seqlens)
        #: multiplier of the sequence id in :meth:`sort_keys`; positions are < key_stride
        self.key_stride = self.max_len + 1
        cu = [0]
        for s in seqlens:
            cu.append(cu[-1] + s)
        self.cu_seqlens = torch.tensor(cu, dtype=torch.long)
        n_chunks = 2 * self.world_size
        # bounds[i][c] = first position of chunk c of sequence i (c = 0..2W)
        self._bounds = [[(c * s) // n_chunks for c in range(n_chunks + 1)] for s in seqlens]
        self._cache: dict = {}

    @classmethod
    def from_cu_seqlens(cls, cu_seqlens: Sequence[int] | torch.Tensor, world_size: int) -> "ZigzagLayout":
        cu = [int(x) for x in (cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor) else cu_seqlens)]
        if len(cu) < 2 or cu[0] != 0 or any(b <= a for a, b in zip(cu, cu[1:])):
            raise LayoutError(f"cu_seqlens must start at 0 and strictly increase, got {cu}")
        return cls([b - a for a, b in zip(cu, cu[1:])], world_size)

    def __repr__(self) -> str:
        return f"ZigzagLayout(seqlens={list(self.seqlens)}, world_size={self.world_size})"

    # ------------------------------------------------------------------ ranks
    def check_rank(self, rank: int) -> int:
        if not 0 <= rank < self.world_size:
            raise LayoutError(f"rank {rank} out of range for world_size {self.world_size}")
        return rank

    def chunks_of(self, rank: int) -> tuple[int, int]:
        """The two chunk ids held by ``rank``: ``(rank, 2W-1-rank)``."""
        self.check_rank(rank)
        return rank, 2 * self.world_size - 1 - rank

    def _build(self, rank: int) -> dict:
        key = ("rank", rank)
        if key in self._cache:
            return self._cache[key]
        c_front, c_back = self.chunks_of(rank)
        idx, seq, pos, cu_local = [], [], [], [0]
        for i, b in enumerate(self._bounds):
            start = int(self.cu_seqlens[i])
            p = torch.cat([torch.arange(b[c_front], b[c_front + 1]), torch.arange(b[c_back], b[c_back + 1])])
            idx.append(p + start)
            pos.append(p)
            seq.append(torch.full((p.numel(),), i, dtype=torch.long))
            cu_local.append(cu_local[-1] + p.numel())
        info = {
            "indices": torch.cat(idx).long(),
            "positions": torch.cat(pos).long(),
            "seq_ids": torch.cat(seq),
            "cu": torch.tensor(cu_local, dtype=torch.long),
        }
        info["keys"] = info["seq_ids"] * self.key_stride + info["positions"]
        self._cache[key] = info
        return info

    def local_indices(self, rank: int) -> torch.Tensor:
        """Global packed indices of ``rank``'s tokens, in local order."""
        return self._build(rank)["indices"]

    def local_len(self, rank: int) -> int:
        return int(self._build(rank)["indices"].numel())

    def local_lens(self) -> list[int]:
        return [self.local_len(r) for r in range(self.world_size)]

    def local_positions(self, rank: int) -> torch.Tensor:
        """Position of each local token inside its own sequence."""
        return self._build(rank)["positions"]

    def local_seq_ids(self, rank: int) -> torch.Tensor:
        """Sequence index of each local token."""
        return self._build(rank)["seq_ids"]

    def local_cu_seqlens(self, rank: int) -> torch.Tensor:
        """Offsets of each sequence's (two-chunk) segment inside ``rank``'s shard."""
        return self._build(rank)["cu"]

    def sort_keys(self, rank: int, device: torch.device | str | None = None) -> torch.Tensor:
        """``seq_id * key_stride + position`` per local token; strictly increasing."""
        keys = self._build(rank)["keys"]
        if device is None or torch.device(device) == keys.device:
            return keys
        ck = ("keys", rank, str(device))
        if ck not in self._cache:
            self._cache[ck] = keys.to(device)
        return self._cache[ck]

    def global_sort_keys(self, device: torch.device | str | None = None) -> torch.Tensor:
        """:meth:`sort_keys` of the whole packed tensor (strictly increasing as well)."""
        ck = ("global_keys", str(device))
        if ck not in self._cache:
            seq = torch.repeat_interleave(torch.arange(self.num_seqs), torch.tensor(self.seqlens))
            pos = torch.arange(self.total) - self.cu_seqlens[seq]
            self._cache[ck] = (seq * self.key_stride + pos).to(device)
        return self._cache[ck]

    def causal_work(self, rank: int) -> int:
        """Number of visible (query, key) pairs of ``rank``'s tokens under causal attention."""
        return int((self.local_positions(rank) + 1).sum())

    # ---------------------------------------------------------------- owners
    def _owner_tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        if "owners" not in self._cache:
            rank_of = torch.empty(self.total, dtype=torch.long)
            local_of = torch.empty(self.total, dtype=torch.long)
            for r in range(self.world_size):
                ix = self.local_indices(r)
                rank_of[ix] = r
                local_of[ix] = torch.arange(ix.numel())
            self._cache["owners"] = (rank_of, local_of)
        return self._cache["owners"]

    def global_index(self, seq_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Packed index of (sequence, position) pairs."""
        seq_ids = torch.as_tensor(seq_ids, dtype=torch.long)
        positions = torch.as_tensor(positions, dtype=torch.long)
        if seq_ids.numel() and (seq_ids.min() < 0 or seq_ids.max() >= self.num_seqs):
            raise LayoutError("sequence id out of range")
        lens = torch.tensor(self.seqlens, dtype=torch.long)[seq_ids]
        if positions.numel() and ((positions < 0).any() or (positions >= lens).any()):
            raise LayoutError("position out of range for its sequence")
        return self.cu_seqlens[seq_ids] + positions

    def owners(self, seq_ids: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(owning rank, index inside that rank's shard) of each (sequence, position)."""
        rank_of, local_of = self._owner_tables()
        g = self.global_index(seq_ids, positions)
        return rank_of[g], local_of[g]

    # --------------------------------------------------------- shard/unshard
    def shard(self, x: torch.Tensor, rank: int, dim: int = 0) -> torch.Tensor:
        """``rank``'s zigzag shard of a packed tensor (tokens along ``dim``)."""
        if x.shape[dim] != self.total:
            raise ShapeMismatchError(
                f"packed tensor has {x.shape[dim]} tokens along dim {dim}, layout expects {self.total}"
            )
        return x.index_select(dim, self.local_indices(rank).to(x.device))

    def unshard(self, shards: Sequence[torch.Tensor], dim: int = 0) -> torch.Tensor:
        """Inverse of :meth:`shard`: reassemble the packed tensor from all ranks' shards."""
        if len(shards) != self.world_size:
            raise ShapeMismatchError(f"expected {self.world_size} shards, got {len(shards)}")
        for r, s in enumerate(shards):
            if s.shape[dim] != self.local_len(r):
                raise ShapeMismatchError(
                    f"shard of rank {r} has {s.shape[dim]} tokens along dim {dim}, layout expects {self.local_len(r)}"
                )
        cat = torch.cat(list(shards), dim=dim)
        perm = torch.cat([self.local_indices(r) for r in range(self.world_size)])
        inv = torch.empty_like(perm)
        inv[perm] = torch.arange(perm.numel())
        return cat.index_select(dim, inv.to(cat.device))
