"""The target's own next-token distribution, recomputed from its last-layer feature (tap L, before
the final norm) with its frozen final norm and LM head: what distribution-matching losses (DSpark,
EAGLE-3, DCOCO's L1 term) and the T=1 evaluation compare the draft with."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from ...nn.layers import at_least_float32
from ..batch import Batch


class TargetHead:
    """The target's own final norm and LM head, frozen: logits of last-layer features."""

    def __init__(self, target):
        inner = getattr(target.model, "model", None) or target.model.base_model
        self.norm = inner.norm
        self.lm_head = target.model.get_output_embeddings()
        self.dtype = self.lm_head.weight.dtype

    @torch.no_grad()
    def logits(self, h: torch.Tensor, rows: Optional[torch.Tensor] = None) -> torch.Tensor:
        """float32 (float64 for float64 features) logits (..., V) of features h (..., H), or only
        the vocabulary rows `rows`."""
        x = self.norm(h.to(self.dtype))
        w = self.lm_head.weight if rows is None else self.lm_head.weight[rows]
        return at_least_float32(F.linear(x, w))

    def next_token_probs(self, b: Batch, split: int, P: int, shard=None) -> torch.Tensor:
        """p_target (S, A, P, V) at temperature 1 of x_{a+1+j} (j < P) for every anchor a of `b`: from
        the last-layer feature of token a + j (the feature columns from `split` on). Under context
        parallelism (`shard`, a `ContextShard`) those rows come from whichever rank holds them."""
        S, A = b.anchors.shape
        last = b.feats[..., split:]
        idx = slot_rows(b, P, b.feats.shape[1] if shard is None else shard.layout.total)
        if shard is None:
            h = last.gather(1, idx.unsqueeze(2).expand(-1, -1, last.shape[-1]))
        else:  # one packed batch (S = 1), anchors as packed indices
            h = shard.fetch(last[0], idx[0])
        return torch.softmax(self.logits(h.reshape(S, A, P, -1)), dim=-1)

    def slot_probs(self, b: Batch, split: int, P: int, rows: Optional[torch.Tensor] = None) -> torch.Tensor:
        """As `next_token_probs` over the vocabulary `rows` (None: all), renormalised over them, computed
        once per position of the sequence (a position is a slot of several blocks), then gathered."""
        S, A = b.anchors.shape
        p = torch.softmax(self.logits(b.feats[..., split:], rows), dim=-1)  # (S, T, n)
        idx = slot_rows(b, P, p.shape[1])
        return p.gather(1, idx.unsqueeze(2).expand(-1, -1, p.shape[-1])).view(S, A, P, -1)


def slot_rows(b: Batch, P: int, T: int) -> torch.Tensor:
    """(S, A * P) the feature row a + j whose next token is slot j + 1 of the block at anchor a (< T)."""
    S, A = b.anchors.shape
    return (b.anchors.clamp(min=0).unsqueeze(2) + torch.arange(P)).clamp(max=T - 1).view(S, A * P)
