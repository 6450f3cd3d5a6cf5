"""Draft-training losses over context-parallel branch attention.

:class:`ContextShard` runs the real DFlash-family losses (DFlash, DCOCO) with the
packed sequences split zigzag over a process group: each drafter layer's block
queries attend to the target-feature context through
:func:`dcoco.parallel.branch_attention` and the ring.

Normalisation: each rank returns its weighted sum over the global weight (the
weights are all-reduced without gradient, `DrafterLoss.weighted_mean`), so the
global loss is the SUM of the ranks' returns and its gradient the SUM of the
ranks' gradients (:func:`allreduce_gradients`), exactly as in one process.
"""

from __future__ import annotations

from functools import partial
from typing import Sequence

import torch
import torch.distributed as dist
from torch import nn

from .attention import AttentionKernel
from .branch import BranchSpec, branch_attention, branch_owners, dflash_spec
from .comm import CommStats, RingGroup
from .errors import ParallelError, ShapeMismatchError
from .ring import zigzag_ring_attention
from .zigzag import ZigzagLayout

__all__ = ["ContextShard", "allreduce_gradients"]


class ContextShard:
    """One rank's share of a context-parallel DFlash-family loss.

    The packed sequences are split zigzag over the group (`layout`): the rank holds the target
    features of its shard only, and trains the blocks whose anchor it owns (`batch`), so a block
    needs no feature from elsewhere but the context before its anchor. `attach` sets the loss's
    `shard`: each drafter layer then attends through the ring (a block's queries see the context
    before its anchor, on whichever rank it lives, and the block's own slots, which never leave the
    rank), and the loss's normalisers are summed over the group. The ranks' losses add up to the
    single-process loss, and their gradients, summed by `allreduce_gradients`, to its gradients.

    `attention="allgather"` (DFlash-family blocks; EAGLE-3's chains always ride the ring) is the
    baseline the ring is measured against: every rank gathers the
    whole context's features once, projects them to K/V for every layer, and attends its blocks
    with one masked SDPA call: as exact, one collective instead of a ring pass per layer, but every
    rank holds the whole context (`scripts/drafter_context_parallel.py` measures both)."""

    def __init__(
        self,
        layout: ZigzagLayout,
        group=None,
        *,
        attention: str = "ring",
        kernel: AttentionKernel | None = None,
        stats: CommStats | None = None,
    ):
        if attention not in ("ring", "allgather"):
            raise ParallelError(f"attention must be 'ring' or 'allgather', got {attention!r}")
        self.layout, self.group, self.attention, self.kernel, self.stats = layout, group, attention, kernel, stats
        self.ring = RingGroup(group, layout.world_size)
        self.rank = self.ring.rank

    def attach(self, loss) -> None:
        """Make `loss` (any drafter family's training loss) compute this rank's share."""
        loss.shard = self

    def global_sum(self, x: torch.Tensor) -> torch.Tensor:
        """x summed over the group, without gradient (a normaliser)."""
        if self.ring.local or self.ring.size == 1:
            return x
        x = x.detach().clone()
        dist.all_reduce(x, group=self.group)
        return x

    def batch(
        self, samples: Sequence[dict], local_feats: torch.Tensor, anchors: Sequence[Sequence[int]], block_size: int
    ):
        """This rank's `Batch`: the token ids of every sequence, packed (1, total) (every rank has
        them, they are cheap); the features of its shard (1, T_r, F); its blocks' anchors as packed
        indices (1, A), -1 for a placeholder block when it owns none; their labels (1, A, B-1)."""
        from ..train.batch import Batch  # the training side: loaded only by ranks that train a drafter

        lens = [len(s["input_ids"]) for s in samples]
        if tuple(lens) != self.layout.seqlens:
            raise ShapeMismatchError(f"sequence lengths {lens} are not the layout's {list(self.layout.seqlens)}")
        if local_feats.dim() != 2 or local_feats.shape[0] != self.layout.local_len(self.rank):
            raise ShapeMismatchError(
                f"rank {self.rank} holds {self.layout.local_len(self.rank)} tokens, features have shape "
                f"{tuple(local_feats.shape)}"
            )
        ids = torch.cat([torch.as_tensor(s["input_ids"], dtype=torch.long) for s in samples])
        seq = torch.tensor([i for i, a in enumerate(anchors) for _ in a], dtype=torch.long)
        pos = torch.tensor([p for a in anchors for p in a], dtype=torch.long)
        mine = branch_owners(self.layout, seq, pos) == self.rank if seq.numel() else seq.bool()
        seq, pos = seq[mine], pos[mine]
        labels = torch.full((max(1, len(seq)), block_size - 1), -100, dtype=torch.long)
        for j, (s, p) in enumerate(zip(seq.tolist(), pos.tolist())):
            tgt = torch.as_tensor(samples[s]["input_ids"][p + 1 : p + block_size])
            labels[j, : len(tgt)] = tgt
        packed = self.layout.cu_seqlens[seq] + pos if len(seq) else torch.tensor([-1])
        return Batch(ids.unsqueeze(0), local_feats.unsqueeze(0), packed.unsqueeze(0), labels.unsqueeze(0))

    def local_rows(self, samples: Sequence[dict], feats: Sequence[torch.Tensor]) -> torch.Tensor:
        """This rank's rows (T_r, F) of every sequence's features (n_i <= len_i, F): a sequence's
        missing last rows are never context (no block or chain reads them) and stay zero."""
        full = torch.cat(
            [torch.nn.functional.pad(f, (0, 0, 0, len(s["input_ids"]) - f.shape[0])) for s, f in zip(samples, feats)]
        )
        return self.layout.shard(full, self.rank)

    def hidden(self, loss, b) -> torch.Tensor:
        """Block hidden states (1, A, B, H) of this rank's blocks (`DrafterLoss.hidden` under CP)."""
        model, B = loss.model, loss.model.cfg.block_size
        anchors = b.anchors[0]
        packed = anchors.clamp(min=0)
        seq = torch.searchsorted(self.layout.cu_seqlens[1:], packed, right=True)
        pos = torch.where(anchors >= 0, packed - self.layout.cu_seqlens[seq], 0)  # placeholder: no context
        emb, positions = loss.block_inputs(b.ids[:, packed], pos.unsqueeze(0))
        if self.attention == "ring":
            kv = model.context_kv(b.feats.to(emb.dtype), self.layout.local_positions(self.rank).view(1, -1))
            h = model(emb, positions, kv, partial(self._attend, dflash_spec(seq, pos, B)))
        else:
            ctx_seq = torch.repeat_interleave(torch.arange(self.layout.num_seqs), torch.tensor(self.layout.seqlens))
            ctx_pos = torch.arange(self.layout.total) - self.layout.cu_seqlens[ctx_seq]
            kv = model.context_kv(self.gather(b.feats[0]).unsqueeze(0).to(emb.dtype), ctx_pos.unsqueeze(0))
            q_seq, q_lim = seq.repeat_interleave(B), pos.repeat_interleave(B)  # a slot sees positions < anchor
            ctx = (ctx_seq.unsqueeze(0) == q_seq.unsqueeze(1)) & (ctx_pos.unsqueeze(0) < q_lim.unsqueeze(1))
            own = torch.block_diag(*[torch.ones(B, B, dtype=torch.bool)] * len(anchors))
            h = model(emb, positions, kv, torch.cat([ctx, own], dim=1).view(1, 1, len(q_seq), -1))
        return h.view(1, len(anchors), B, -1)

    def fetch(self, local: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """Rows `index` (n,) of the packed tensor whose shard this rank holds (`local` (T_r, D)),
        wherever they live: the ranks gather each other's requests, each fills the rows it holds,
        and one all-reduce of zeros and those rows delivers them (no gradient: features are inputs)."""
        if self.ring.local or self.ring.size == 1:
            return local[index]
        counts = [torch.zeros(1, dtype=torch.long) for _ in range(self.ring.size)]
        dist.all_gather(counts, torch.tensor([len(index)]), group=self.group)
        width = max(1, max(int(c) for c in counts))
        asked = [torch.empty(width, dtype=torch.long) for _ in counts]
        mine = torch.zeros(width, dtype=torch.long)
        mine[: len(index)] = index
        dist.all_gather(asked, mine, group=self.group)
        wanted = torch.cat([a[: int(c)] for a, c in zip(asked, counts)])
        seq = torch.searchsorted(self.layout.cu_seqlens[1:], wanted, right=True)
        owner, at = self.layout.owners(seq, wanted - self.layout.cu_seqlens[seq])
        rows = torch.zeros(len(wanted), local.shape[1], dtype=local.dtype)
        held = owner == self.rank
        rows[held] = local.detach()[at[held]]
        dist.all_reduce(rows, group=self.group)
        start = sum(int(c) for c in counts[: self.rank])
        return rows[start : start + len(index)]

    def gather(self, local: torch.Tensor) -> torch.Tensor:
        """The whole packed tensor from every rank's shard (no gradient: features are inputs)."""
        if self.ring.local or self.ring.size == 1:
            return local
        lens = self.layout.local_lens()
        padded = torch.zeros((max(lens),) + tuple(local.shape[1:]), dtype=local.dtype)
        padded[: local.shape[0]] = local.detach()
        parts = [torch.empty_like(padded) for _ in lens]
        dist.all_gather(parts, padded, group=self.group)
        return self.layout.unshard([p[:n] for p, n in zip(parts, lens)])

    def _attend(self, spec: BranchSpec, q, k, v, ctx_k, ctx_v) -> torch.Tensor:
        """`ContextAttention`'s attention for one rank: (1, heads, n, d) queries and block K/V, the
        shard's context K/V (1, kv_heads, T_r, d); branch attention takes them token-major."""
        dt = _attention_dtype(q)
        out = branch_attention(
            _rows(q, dt), _rows(k, dt), _rows(v, dt), _rows(ctx_k, dt), _rows(ctx_v, dt), spec, self.layout,
            group=self.group, kernel=self.kernel, stats=self.stats,
        )  # fmt: skip
        return out.transpose(0, 1).unsqueeze(0)

    def self_attend(self, q, k, v) -> torch.Tensor:
        """Causal self-attention of the shard's rows over their sequences, (1, heads, T_r, d) in and
        out (EAGLE-3's step 0)."""
        dt = _attention_dtype(q)
        out, _ = zigzag_ring_attention(
            _rows(q, dt),
            _rows(k, dt),
            _rows(v, dt),
            self.layout,
            group=self.group,
            kernel=self.kernel,
            stats=self.stats,
        )
        return out.transpose(0, 1).unsqueeze(0)

    def chain_attend(self, q, seq, limits, k0, v0, chain_k: list, chain_v: list) -> torch.Tensor:
        """EAGLE-3 step j = len(chain_k) >= 1 of this rank's chains: the query (1, heads, A, d) of the
        chain of sequence `seq` sees the step-0 entries at positions <= `limits` (-1: none) of its
        sequence, on whichever rank (k0/v0 (1, kv, T_r, d): the shard's), and its own entries of
        steps 1..j (each (1, kv, A, d), never leaving the rank)."""
        dt = _attention_dtype(q)
        A, j = q.shape[2], len(chain_k)
        bk = torch.stack([_rows(k, dt) for k in chain_k], 1).flatten(0, 1)  # chain-major (A * j, kv, d)
        bv = torch.stack([_rows(v, dt) for v in chain_v], 1).flatten(0, 1)
        a = torch.arange(A)
        spec = BranchSpec(seq, limits, a * j, a * j + j)
        out = branch_attention(
            _rows(q, dt), bk, bv, _rows(k0, dt), _rows(v0, dt), spec, self.layout,
            group=self.group, kernel=self.kernel, stats=self.stats,
        )  # fmt: skip
        return out.transpose(0, 1).unsqueeze(0)


def _attention_dtype(q: torch.Tensor) -> torch.dtype:
    """The dtype one SDPA call would attend in: autocast's (bf16 in training), else the queries'."""
    kind = q.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else q.dtype


def _rows(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(1, heads, n, d) -> token-major (n, heads, d) in `dtype`, as the ring kernels take them
    (under autocast the projections and the rotary embedding may leave q, k, v in different ones)."""
    return x[0].transpose(0, 1).to(dtype).contiguous()


def allreduce_gradients(module: nn.Module, group=None) -> None:
    """Sum parameter gradients over the context-parallel group (see the module docstring)."""
    for p in module.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad, group=group)
