"""DCOCO's training loss: DFlash's plus the corrector's, trained jointly."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from ...drafters.dcoco import walk_greedy
from ...nn.layers import at_least_float32
from ..acceptance import acceptance_from_predictions
from ..batch import Batch, position_weights
from .dflash import DrafterLoss


class DCOCOLoss(DrafterLoss):
    """DFlash loss plus the corrector's: cross-entropy over the K candidates of S_p(a*, .) towards
    the target's next token b*, with the target's own previous token a* as predecessor (teacher
    forcing). Pairs whose target token is missing from either shortlist are excluded; pair p is
    weighted exp(-p/gamma), since an early rejection wastes more of the block.

    With `l1_weight` > 0 (and `head`, the target's final norm and LM head on the last-layer feature
    columns from `split` on) the corrector also matches the target's T=1 distribution:
    l1_weight * ||q - p_target||_1 over the pairs that reach the first `num_speculative_tokens`
    slots, q the distribution the T > 0 walk draws the slot from given a* (`distribution_loss`).
    The walk's acceptance there is sum min(q, p_target) = 1 - ||q - p_target||_1 / 2 (over the
    vocabulary; over the shortlist the target's mass off it is lost either way), so the term
    trains exactly what T > 0 verification accepts; cross-entropy alone sharpens q on the greedy
    token. It needs a predecessor in the shortlist, not the target token."""

    def __init__(
        self,
        model,
        embed,
        lm_head,
        gamma: float,
        split: Optional[int] = None,
        head=None,
        corrector_weight: float = 1.0,
        l1_weight: float = 0.0,
    ):
        super().__init__(model, embed, lm_head, gamma, split, head)
        self.corrector_weight, self.l1_weight = corrector_weight, l1_weight
        if l1_weight > 0 and head is None:
            raise ValueError("the corrector's L1 term needs the target head and the last-layer features")

    def __call__(self, b: Batch) -> tuple[torch.Tensor, dict]:
        full, b = b, self.drafter_features(b)
        h = self.hidden(b)
        logits = self.lm_head(h[:, :, 1:])
        base = self.loss_from_logits(logits, b.labels)
        S, A, P, V = logits.shape
        labels = b.labels.reshape(S * A, P)
        anchor = anchor_hidden = None
        if self.model.lead:  # anchor_pair: the anchor is the walk's position 0, its own (always present) label
            anchor = b.ids.gather(1, b.anchors.clamp(min=0)).reshape(-1)
            anchor_hidden = h[:, :, 0].reshape(S * A, -1)
            labels = torch.cat([torch.where(labels[:, :1] != -100, anchor.view(-1, 1), -100), labels], dim=1)
        ids, vals, scores, hot = self.model.pair_scores(
            h[:, :, 1:].reshape(S * A, P, -1),
            logits.reshape(S * A, P, V),
            self.embed,
            anchor=anchor,
            anchor_hidden=anchor_hidden,
        )
        corr, pred, valid_from, m = self.corrector_loss(ids, scores, labels)
        if self.l1_weight > 0:  # on the T > 0 walks' scores (the same as the greedy ones without a sampled head)
            n = min(P, self.model.cfg.num_speculative_tokens or P)
            pt = self.head.next_token_probs(full, self.split, n, self.shard).reshape(S * A, n, -1)
            l1, m["t1_accept_est"] = self.distribution_loss(
                ids, rows_at(hot, pred), labels, valid_from, pt, logits.reshape(S * A, P, V)
            )
            m["corrector_l1"] = l1.item()
            corr = corr + self.l1_weight * l1
        m["dflash_loss"] = base.item()
        return base + self.corrector_weight * corr, {
            "hidden": h,
            "logits": logits,
            "ids": ids,
            "scores": scores,
            "sampled_scores": hot,
            "vals": vals,
            "anchor": anchor,  # the walk's position 0 and its hidden state with `anchor_pair`, else None
            "anchor_hidden": anchor_hidden,
            "walk_labels": labels,
            "metrics": m,
        }

    def acceptance_given(self, p: torch.Tensor, extras: dict) -> torch.Tensor:
        """T=1 acceptance per slot (as `DrafterLoss.slot_acceptance`) of the configured T > 0 walk,
        each slot conditioned on the data's previous token: the one-hot corrected pick, the sampled
        walk over the shortlist, or the draft vocabulary with the shortlist rescored. Where that
        token is off the previous shortlist the walk has no row for it, and the slot keeps the
        backbone's own distribution (the vocabulary walk's rule; an approximation for the others)."""
        alpha = super().acceptance_given(p, extras)  # the backbone's own distributions
        logits = extras["logits"]
        S, A, P, V = logits.shape
        n, lead = S * A, self.model.lead
        p = p.reshape(n, P, V)
        ids, labels = extras["ids"], extras["walk_labels"]  # over the walk's positions (lead + P)
        hit = ids == labels.unsqueeze(-1)
        listed = hit.any(-1)[:, :-1]  # the data's token at walk position w is on w's shortlist
        prev = hit.float().argmax(-1)[:, :-1]
        dest = ids[:, 1:]  # pair w ends at walk position w + 1, i.e. slot w + 1 - lead: its candidates
        dcfg = self.model.dcfg
        if dcfg.vocab_walk:
            rows = rows_at(extras["sampled_scores"], prev).float()
            full = self.model.restrict_to_draft_vocab(logits.reshape(n, P, V)[:, 1 - lead :].float())
            q = torch.softmax(full.scatter(2, dest, rows), -1)
            pair = torch.minimum(p[:, 1 - lead :], q).sum(-1)
        elif dcfg.sampled_walk:
            rows = rows_at(extras["sampled_scores"], prev).float()
            pair = torch.minimum(p[:, 1 - lead :].gather(2, dest), torch.softmax(rows, -1)).sum(-1)
        else:
            pick = rows_at(extras["scores"], prev).argmax(-1, keepdim=True)
            pair = p[:, 1 - lead :].gather(2, dest.gather(2, pick)).squeeze(-1)
        out = alpha.reshape(n, P).clone()
        out[:, 1 - lead :] = torch.where(listed, pair, out[:, 1 - lead :])
        if not lead:  # slot 1 has no predecessor: the walk's first draw
            if dcfg.sampled_walk and not dcfg.vocab_walk:
                first = torch.softmax(extras["vals"][:, 0].float(), -1)
                out[:, 0] = torch.minimum(p[:, 0].gather(1, ids[:, 0]), first).sum(-1)
            elif not dcfg.vocab_walk:
                out[:, 0] = p[:, 0].gather(1, ids[:, 0, :1]).squeeze(-1)
        return out.reshape(S, A, P)

    def corrector_loss(self, ids: torch.Tensor, scores: torch.Tensor, labels: torch.Tensor):
        """Cross-entropy of S_p(a*, .) towards b*; also returns a*'s shortlist index (n, P-1) and
        whether it is shortlisted (n, P-1), for the distribution term."""
        hit = ids == labels.unsqueeze(-1)  # (n, P, K)
        present = hit.any(-1) & (labels != -100)
        where = hit.float().argmax(-1)  # shortlist index of the target token (0 if absent)
        a, b = where[:, :-1], where[:, 1:]
        valid = present[:, :-1] & present[:, 1:]
        rows = rows_at(scores, a)  # S_p(a*, .)
        ce = F.cross_entropy(at_least_float32(rows.reshape(-1, rows.shape[-1])), b.reshape(-1), reduction="none").view(
            b.shape
        )
        loss = self.weighted_mean(ce, self.pair_weights(b.shape[1]) * valid)
        lead = self.model.lead  # the anchor row of anchor_pair is always present: not a recall
        labelled = labels[:, lead:] != -100
        m = {
            "recall_at_k": (present[:, lead:].sum() / labelled.sum().clamp_min(1)).item(),
            "selector_acc": ((rows.argmax(-1) == b) & valid).sum().item() / max(1, int(valid.sum())),
            "corrector_loss": loss.item(),
        }
        return loss, a, present[:, :-1], m

    def pair_weights(self, pairs: int) -> torch.Tensor:
        """exp(-p / gamma) for pairs p = 0..pairs-1, as (1, pairs)."""
        return position_weights(pairs + 1, self.gamma).view(1, -1)

    def distribution_loss(
        self,
        ids: torch.Tensor,
        rows: torch.Tensor,
        labels: torch.Tensor,
        pred_present: torch.Tensor,
        pt: torch.Tensor,
        logits: torch.Tensor,
    ) -> tuple[torch.Tensor, float]:
        """Weighted ||q - p_target||_1 over the pairs whose destination slot has p_target (pt (n, m, V)
        for slots 1..m), and the mean expected T=1 acceptance sum min(q, p). q is what the configured
        T > 0 walk draws from: softmax(S_p(a*, .)) over the K candidates, or with `vocab_walk` the
        drafter's softmax over the draft vocabulary (`logits` (n, P, V)) with those K rescored."""
        first = 1 - self.model.lead  # pair p ends at slot p + 1 + first, i.e. pt index p + first
        pairs = pt.shape[1] - first
        dest = ids[:, 1 : 1 + pairs]  # candidates of each pair's destination
        rows = at_least_float32(rows[:, :pairs])
        if self.model.dcfg.vocab_walk:
            full = self.model.restrict_to_draft_vocab(at_least_float32(logits[:, first : first + pairs]))
            q, p = torch.softmax(full.scatter(2, dest, rows), -1), pt[:, first:]
        else:
            q, p = torch.softmax(rows, -1), pt[:, first:].gather(2, dest)  # (n, pairs, K)
        valid = pred_present[:, :pairs] & (labels[:, 1 : 1 + pairs] != -100)
        l1 = (q - p).abs().sum(-1)
        accept = (torch.minimum(q, p).sum(-1) * valid).sum() / valid.sum().clamp_min(1)
        return self.weighted_mean(l1, self.pair_weights(pairs) * valid), accept.item()

    def predictions(self, extras: dict) -> dict[str, torch.Tensor]:
        """The corrected walk's drafts, and the same drafts uncorrected ("_dflash")."""
        lead, (S, A, P) = self.model.lead, extras["logits"].shape[:3]
        ids = extras["ids"]
        corrected = ids.gather(2, walk_greedy(extras["scores"]).unsqueeze(2)).squeeze(2)[:, lead:].reshape(S, A, P)
        return {"": corrected, "_dflash": self.draft_argmax(extras["logits"])}

    def eval_metrics(self, extras: dict, labels: torch.Tensor) -> dict:
        S, A, P = labels.shape
        pred = self.predictions(extras)
        tau_c, pp = acceptance_from_predictions(pred[""], labels)
        tau_d, _ = acceptance_from_predictions(pred["_dflash"], labels)
        ids = extras["ids"][:, self.model.lead :]
        oracle = torch.where((ids == labels.view(S * A, P, 1)).any(-1).view(S, A, P), labels, -1)
        tau_o, _ = acceptance_from_predictions(oracle, labels)
        return {
            "eval_tau": tau_c,
            "eval_per_position": pp,
            "eval_tau_dflash": tau_d,
            "eval_tau_oracle": tau_o,
            **{f"eval_{k}": v for k, v in extras["metrics"].items()},
        }


def rows_at(scores: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """S_p(a_p, .) (n, P-1, K) of transition scores (n, P-1, K, K) at predecessor indices a (n, P-1)."""
    return scores.gather(2, a.view(*a.shape, 1, 1).expand(-1, -1, 1, scores.shape[-1])).squeeze(2)
