"""DFlash's training loss: every anchor a opens a block [x_a, MASK, ..., MASK] whose slot k predicts
x_{a+k}, seeing the target features of positions < a only; all blocks of a sequence run in one pass
(`training_mask`, computed as `AnchorGroupAttention`). Cross-entropy on assistant tokens, weighted by
w_k = exp(-(k-1)/gamma) and normalised by the weights present. DSpark and DCOCO build on it."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from ...drafters.dflash import AnchorGroupAttention, DFlashModel, shortlist
from ...errors import ConfigError
from ...nn.layers import at_least_float32
from ..acceptance import acceptance_from_predictions
from ..batch import Batch, batch_anchors, make_batch, position_weights


class DrafterLoss:
    """Forward a batch through a DFlash backbone and compute the decayed cross-entropy."""

    # under context parallelism (`dcoco.parallel.ContextShard.attach`) a block's queries read the
    # context before its anchor over the ring, the target's distribution at its slots (`TargetHead`)
    # from whichever rank holds those rows

    def __init__(
        self,
        model: DFlashModel,
        embed,
        lm_head,
        gamma: float,
        split: Optional[int] = None,
        head=None,
        draft_vocab_loss: bool = False,
        distill_weight: float = 0.0,
    ) -> None:
        """`split`: the drafter's feature columns (None: all); `head` (`TargetHead`) reads the last
        layer's columns after them, for the T=1 figures (`slot_acceptance`). `draft_vocab_loss`:
        while training, score only the draft vocabulary (see `__call__`). `distill_weight`: add that
        times the cross-entropy against the target's own T=1 distribution (`distill_loss`)."""
        self.model, self.embed, self.lm_head = model, embed, lm_head
        self.gamma = gamma
        self.split, self.head = split, head
        self.draft_vocab_loss = draft_vocab_loss
        if distill_weight and head is None:
            raise ConfigError(
                "drafter.distill_weight needs the target's last layer in the data (`dcoco data regenerate`)"
            )
        self.distill_weight = distill_weight
        self.weights = position_weights(model.cfg.block_size, gamma)
        # context parallelism: this rank's `dcoco.parallel.ContextShard`, None in a single process
        self.shard = None

    def drafter_features(self, b: Batch) -> Batch:
        """`b` with only the drafter's feature columns (the last layer's feed p_target, not the drafter)."""
        if self.split is None or b.feats.shape[-1] == self.split:
            return b
        return Batch(b.ids, b.feats[..., : self.split], b.anchors, b.labels)

    def hidden(self, b: Batch) -> torch.Tensor:
        """Block hidden states (S, A, B, H)."""
        if self.shard is not None:
            return self.shard.hidden(self, b)
        S, A = b.anchors.shape
        B, T = self.model.cfg.block_size, b.ids.shape[1]
        anc = b.anchors.clamp(min=0)
        emb, positions = self.block_inputs(b.ids.gather(1, anc), anc)
        ctx_pos = torch.arange(T).unsqueeze(0).expand(S, T)
        kv = self.model.context_kv(b.feats.to(emb.dtype), ctx_pos)
        h = self.model(emb, positions, kv, AnchorGroupAttention(b.anchors, B))
        return h.view(S, A, B, -1)

    def block_inputs(self, anchor_tokens: torch.Tensor, anchor_positions: torch.Tensor):
        """Embeddings (S, A*B, H) and positions (S, A*B) of blocks [anchor, MASK, ...] for anchors
        (S, A) of the given tokens at the given positions."""
        S, A = anchor_tokens.shape
        B = self.model.cfg.block_size
        block = torch.full((S, A, B), self.model.cfg.mask_token_id, dtype=torch.long)
        block[:, :, 0] = anchor_tokens
        with torch.no_grad():
            emb = self.embed(block.view(S, A * B))
        return emb, (anchor_positions.unsqueeze(2) + torch.arange(B)).view(S, A * B)

    def __call__(self, b: Batch) -> tuple[torch.Tensor, dict]:
        h = self.hidden(self.drafter_features(b))
        ids = self.model.draft_ids
        if self.draft_vocab_loss and self.model.training and ids is not None:
            # inference drafts only from the draft vocabulary: training scores only those rows of the
            # LM head (a sixth of its work and of the cross-entropy's on SmolLM2) and the loss is over
            # that vocabulary; a label outside it cannot be drafted and carries no loss
            w = self.lm_head.weight[ids]
            bias = None if self.lm_head.bias is None else self.lm_head.bias[ids]
            logits = F.linear(h[:, :, 1:], w, bias)  # (S, A, B-1, n)
            index = torch.full((self.lm_head.weight.shape[0] + 1,), -100, dtype=torch.long, device=ids.device)
            index[ids] = torch.arange(len(ids), device=ids.device)
            labels = index[b.labels.masked_fill(b.labels < 0, len(index) - 1).to(ids.device)]
            return self.loss_from_logits(logits, labels) + self.distill_loss(b, logits, ids), {"hidden": h}
        logits = self.lm_head(h[:, :, 1:])  # (S, A, B-1, V)
        loss = self.loss_from_logits(logits, b.labels) + self.distill_loss(b, logits)
        return loss, {"hidden": h, "logits": logits}

    def distill_loss(self, b: Batch, logits: torch.Tensor, rows: Optional[torch.Tensor] = None) -> torch.Tensor:
        """`distill_weight` x the cross-entropy of the slots' logits (S, A, P, n) against the target's T=1
        distribution (`TargetHead.slot_probs`), weighted as the labelled loss. Greedy answers teach only each
        position's argmax; what T > 0 verification accepts is sum_x min(p(x), q(x)), so q should
        carry p's other mass too (0 when the weight is 0)."""
        if not self.distill_weight:
            return logits.new_zeros(())
        if self.shard is not None:
            raise ConfigError("drafter.distill_weight does not run under context parallelism yet")
        P = logits.shape[2]
        p = self.head.slot_probs(b, self.split, P, rows)
        soft = -(p * torch.log_softmax(at_least_float32(logits), dim=-1)).sum(-1)
        w = self.weights[:P].view(1, 1, -1) * (b.labels[..., :P] != -100)
        return self.distill_weight * self.weighted_mean(soft, w)

    @property
    def label_block(self) -> int:
        """A block's labels are its tokens after the anchor: this many minus one."""
        return self.model.cfg.block_size

    def batch_at(self, samples: list[dict], feats: list[torch.Tensor], anchors: list[list[int]]) -> Batch:
        """Blocks at the given anchor positions of each sample."""
        return make_batch(samples, feats, anchors, self.label_block)

    def shard_batch(self, samples: list[dict], local: torch.Tensor, n_anchors: int, gen: torch.Generator) -> Batch:
        """Under context parallelism: this rank's blocks, of the anchors `loss_batch` draws, from the
        shard's feature rows `local` (T_r, F) (`ContextShard.batch`)."""
        return self.shard.batch(samples, local, batch_anchors(samples, n_anchors, gen), self.label_block)

    def predictions(self, extras: dict) -> dict[str, torch.Tensor]:
        """Greedy drafts (S, A, P) as inference makes them, by eval-metric suffix ("" = the method's own)."""
        return {"": self.draft_argmax(extras["logits"])}

    def eval_metrics(self, extras: dict, labels: torch.Tensor) -> dict:
        tau, pp = acceptance_from_predictions(self.predictions(extras)[""], labels)
        return {"eval_tau": tau, "eval_per_position": pp}

    def target_probs(self, b: Batch, P: int) -> torch.Tensor:
        """The target's own T=1 distribution (S, A, P, V) of each slot's token, from the last layer."""
        if self.head is None or self.split is None or b.feats.shape[-1] == self.split:
            raise ConfigError("T=1 acceptance needs the target's last layer in the data (`dcoco data regenerate`)")
        return self.head.next_token_probs(b, self.split, P, self.shard)

    def slot_acceptance(self, b: Batch, extras: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """Per slot, the probability that T=1 verification accepts the draft, teacher-forced on the
        data: sum_x min(p(x), q(x)) with q what drafting samples the slot from (the draft logits'
        softmax over the draft vocabulary). Returns it (S, A, P) and which slots have a label."""
        P = extras["logits"].shape[2]
        return self.acceptance_given(self.target_probs(b, P), extras), b.labels[..., :P] != -100

    def acceptance_given(self, p: torch.Tensor, extras: dict) -> torch.Tensor:
        """`slot_acceptance` given the target's distributions p (S, A, P, V) of the slots."""
        q = torch.softmax(self.model.restrict_to_draft_vocab(extras["logits"].float()), -1)
        return torch.minimum(p, q).sum(-1)

    def draft_argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """Greedy drafts as inference makes them: within the draft vocabulary when there is one."""
        return shortlist(logits, 1, self.model.draft_ids)[1].squeeze(-1)

    def loss_from_logits(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        V = logits.shape[-1]
        ce = F.cross_entropy(
            at_least_float32(logits.reshape(-1, V)), labels.reshape(-1), ignore_index=-100, reduction="none"
        )
        ce = ce.view(labels.shape)
        return self.weighted_mean(ce, self.weights.view(1, 1, -1) * (labels != -100))

    def weighted_mean(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """sum(x w) / sum(w). Under context parallelism the denominator is all ranks' sum, so the
        ranks' losses, and their gradients, add up to the single-process ones."""
        w = w.to(x.dtype)  # the ranks' partial sums must round as the whole sum does
        den = w.sum() if self.shard is None else self.shard.global_sum(w.sum())
        return (x * w).sum() / den.clamp_min(1e-6)
