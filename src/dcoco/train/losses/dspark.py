"""DSpark's training loss: the DFlash batch and backbone pass, then the Markov head with teacher-forced
previous tokens, and the published three-term loss

    L = 0.1 * CE(z, x) + 0.9 * ||softmax(z) - p_target||_1 + 1.0 * BCE(c, 1 - 1/2 ||softmax(z) - p_target||_1)

with z = U + W2 · W1[x_prev] the Markov-adjusted logits, p_target the target's own next-token
distribution (temperature 1) recomputed from the regenerated last-layer feature with the target's
final norm and LM head, and c the confidence logit. Each term is weighted by exp(-j / gamma) for the
j-th predicted token of a block (j = 0 first; the same gamma as DFlash) and normalised by the
weights present. The BCE target is detached (the confidence head learns to predict the acceptance
probability, it does not pull the distributions). Anchors and data order come from the same RNG
stream as DFlash's, so both see the same blocks for the same config.

The regenerated data must hold the target's last layer (tap L, `hidden_states[L]` before the final
norm); `dcoco data regenerate` adds it. Its columns follow the drafter's own taps in the features.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...drafters.dspark import DSparkModel
from ...nn.layers import at_least_float32
from ..acceptance import acceptance_from_predictions
from ..batch import Batch
from .dflash import DrafterLoss
from .target_head import TargetHead


class DSparkLoss(DrafterLoss):
    def __init__(
        self,
        model: DSparkModel,
        embed,
        lm_head,
        gamma: float,
        head: TargetHead,
        split: int,
        ce_weight: float = 0.1,
        l1_weight: float = 0.9,
        confidence_weight: float = 1.0,
    ):
        super().__init__(model, embed, lm_head, gamma)
        self.head, self.split = head, split
        self.ce_weight, self.l1_weight, self.confidence_weight = ce_weight, l1_weight, confidence_weight
        self.weights = torch.exp(-torch.arange(model.max_draft, dtype=torch.float32) / gamma)

    @property
    def label_block(self) -> int:
        """One label per draft slot: labels[s, a, j] = x_{anchor + 1 + j}."""
        return self.model.max_draft + 1

    def __call__(self, b: Batch) -> tuple[torch.Tensor, dict]:
        model: DSparkModel = self.model
        h = self.hidden(Batch(b.ids, b.feats[..., : self.split], b.anchors, b.labels))  # (S, A, B, H)
        labels = b.labels
        S, A, P = labels.shape
        off = model.slot_offset
        hs = h[:, :, off : off + P]
        base = self.lm_head(hs)  # U (S, A, P, V)
        anchor_tok = b.ids.gather(1, b.anchors.clamp(min=0))
        prev = torch.cat([anchor_tok.unsqueeze(2), labels[..., :-1]], dim=2).clamp(min=0)  # teacher forcing
        z, conf = model.step_logits(base, hs, prev)
        valid = labels != -100
        w = self.weights[:P].view(1, 1, P) * valid
        logq = torch.log_softmax(z, dim=-1)
        ce = -logq.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
        pt = self.head.next_token_probs(b, self.split, P, self.shard)
        l1 = (logq.exp() - pt).abs().sum(-1)
        accept = (1.0 - 0.5 * l1).detach().clamp(0.0, 1.0)
        ce_l, l1_l = self.weighted_mean(ce, w), self.weighted_mean(l1, w)
        loss = self.ce_weight * ce_l + self.l1_weight * l1_l
        m = {
            "ce_loss": ce_l.item(),
            "l1_loss": l1_l.item(),
            "accept_est": ((accept * valid).sum() / valid.sum().clamp_min(1)).item(),
        }
        if conf is not None:
            bce = F.binary_cross_entropy_with_logits(at_least_float32(conf), accept, reduction="none")
            bce_l = self.weighted_mean(bce, w)
            loss = loss + self.confidence_weight * bce_l
            m["confidence_loss"] = bce_l.item()
        return loss, {"logits": z, "base_logits": base, "confidence": conf, "accept": accept, "metrics": m}

    def predictions(self, extras: dict) -> dict[str, torch.Tensor]:
        """Teacher-forced argmax of z, which equals the greedy Markov walk up to its first miss (so
        its acceptance is the walk's), and of the backbone alone ("_no_markov")."""
        return {"": self.draft_argmax(extras["logits"]), "_no_markov": self.draft_argmax(extras["base_logits"])}

    def eval_metrics(self, extras: dict, labels: torch.Tensor) -> dict:
        pred = self.predictions(extras)
        tau, pp = acceptance_from_predictions(pred[""], labels)
        tau_base, _ = acceptance_from_predictions(pred["_no_markov"], labels)
        out = {
            "eval_tau": tau,
            "eval_per_position": pp,
            "eval_tau_no_markov": tau_base,
            **{f"eval_{k}": v for k, v in extras["metrics"].items()},
        }
        if extras["confidence"] is not None:
            valid = labels != -100
            err = (torch.sigmoid(extras["confidence"].float()) - extras["accept"]).abs()
            out["eval_confidence_mae"] = ((err * valid).sum() / valid.sum().clamp_min(1)).item()
        return out
