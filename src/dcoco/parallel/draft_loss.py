"""Draft-training loss over context-parallel branch attention.

The real DFlash drafter is written elsewhere; what it needs from scale-out is
:func:`dcoco.parallel.branch_attention` (q/k/v tensors + a
:class:`BranchSpec`).  This module wires that call into a complete loss with a
small attention-only stand-in layer, so that "CP=W with features delivered by
TapChannel from P pipeline stages gives the single-process loss and gradients"
can be tested end to end today.

Normalisation: each rank returns ``local_sum / global_count`` (the count is
all-reduced without gradient), so the global loss is the SUM of the ranks'
returns and the gradient of the global loss is the SUM of the ranks' gradients
(:func:`allreduce_gradients`), exactly as in the single-process run.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .attention import AttentionKernel
from .branch import BranchSpec, branch_attention
from .comm import CommStats, RingGroup
from .errors import ShapeMismatchError
from .zigzag import ZigzagLayout

__all__ = ["StandInDraftLayer", "draft_branch_loss", "allreduce_gradients"]

IGNORE_INDEX = -100


class StandInDraftLayer(nn.Module):
    """Attention-only stand-in for a drafter layer.

    Context K/V come from the fused target features of the main sequence
    (EAGLE-3 style fusion of ``num_taps`` tapped layers); branch Q/K/V come from
    the embeddings of the draft tokens.  Output projection + LM head give logits.
    """

    def __init__(
        self,
        num_taps: int,
        feature_dim: int,
        hidden: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        vocab_size: int,
    ):
        super().__init__()
        if num_heads % num_kv_heads:
            raise ShapeMismatchError("num_heads must be a multiple of num_kv_heads")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.feature_dim = num_taps * feature_dim
        self.fuse = nn.Linear(self.feature_dim, hidden, bias=False)
        self.embed = nn.Embedding(vocab_size, hidden)
        self.q_proj = nn.Linear(hidden, num_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, num_kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, num_kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden, bias=False)
        self.lm_head = nn.Linear(hidden, vocab_size, bias=False)

    def context_kv(self, features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if features.dim() != 2 or features.shape[1] != self.feature_dim:
            raise ShapeMismatchError(f"features must be [T, {self.feature_dim}], got {tuple(features.shape)}")
        h = self.fuse(features)
        shape = (h.shape[0], self.num_kv_heads, self.head_dim)
        return self.k_proj(h).view(shape), self.v_proj(h).view(shape)

    def branch_qkv(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        e = self.embed(tokens)
        n = e.shape[0]
        return (
            self.q_proj(e).view(n, self.num_heads, self.head_dim),
            self.k_proj(e).view(n, self.num_kv_heads, self.head_dim),
            self.v_proj(e).view(n, self.num_kv_heads, self.head_dim),
        )

    def logits(self, attn_out: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.o_proj(attn_out.reshape(attn_out.shape[0], -1)))


def draft_branch_loss(
    layer: StandInDraftLayer,
    features: torch.Tensor,
    branch_tokens: torch.Tensor,
    branch_targets: torch.Tensor,
    spec: BranchSpec,
    layout: ZigzagLayout,
    *,
    group=None,
    kernel: AttentionKernel | None = None,
    stats: CommStats | None = None,
) -> torch.Tensor:
    """Cross-entropy of the draft tokens of this rank, normalised by the global target count.

    Args:
        features: ``[T_r, num_taps * feature_dim]`` this rank's zigzag shard of
            the tapped target features.
        branch_tokens, branch_targets: ``[n]`` draft input ids and targets
            (``-100`` = no loss) of the branches this rank owns.
        spec: their :class:`BranchSpec`.
    """
    if branch_tokens.shape != branch_targets.shape or branch_tokens.shape[0] != len(spec):
        raise ShapeMismatchError("branch_tokens, branch_targets and spec must have the same length")
    k_main, v_main = layer.context_kv(features)
    bq, bk, bv = layer.branch_qkv(branch_tokens)
    out = branch_attention(bq, bk, bv, k_main, v_main, spec, layout, group=group, kernel=kernel, stats=stats)
    logits = layer.logits(out)
    loss_sum = F.cross_entropy(logits, branch_targets, ignore_index=IGNORE_INDEX, reduction="sum")
    count = (branch_targets != IGNORE_INDEX).sum().to(logits.dtype)
    ring = RingGroup(group, layout.world_size)
    if not ring.local and ring.size > 1:
        count = count.detach().clone()
        dist.all_reduce(count, group=group)
    return loss_sum / count.clamp(min=1)


def allreduce_gradients(module: nn.Module, group=None) -> None:
    """Sum parameter gradients over the context-parallel group (see the module docstring)."""
    for p in module.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad, group=group)
