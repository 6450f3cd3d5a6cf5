"""DSpark training: the DFlash batch and backbone pass, then the Markov head with teacher-forced
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
norm); `dcoco data regenerate` adds it. `attach_target_head` appends its columns to the trainer's
feature selection, after the drafter's own taps.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from ..drafters.checkpoint import load_checkpoint
from ..drafters.dflash import DFlashModel
from ..drafters.dspark import DSparkConfig, DSparkModel, load_dspark, save_dspark
from ..errors import ConfigError
from .trainer import Batch, DrafterLoss, acceptance_from_predictions, make_batch


class TargetHead:
    """The target's own final norm and LM head, frozen: logits of last-layer features."""

    def __init__(self, target):
        inner = getattr(target.model, "model", None) or target.model.base_model
        self.norm = inner.norm
        self.lm_head = target.model.get_output_embeddings()
        self.dtype = self.lm_head.weight.dtype

    @torch.no_grad()
    def logits(self, h: torch.Tensor, rows: Optional[torch.Tensor] = None) -> torch.Tensor:
        """float32 logits (..., V) of features h (..., H), or only the vocabulary rows `rows`."""
        x = self.norm(h.to(self.dtype))
        w = self.lm_head.weight if rows is None else self.lm_head.weight[rows]
        return F.linear(x, w).float()

    def next_token_probs(self, b: Batch, split: int, P: int) -> torch.Tensor:
        """p_target (S, A, P, V) at temperature 1 of x_{a+1+j} (j < P) for every anchor a of `b`: from
        the last-layer feature of token a + j (the feature columns from `split` on)."""
        S, A = b.anchors.shape
        T = b.feats.shape[1]
        last = b.feats[..., split:]
        idx = (b.anchors.clamp(min=0).unsqueeze(2) + torch.arange(P)).clamp(max=T - 1).view(S, A * P, 1)
        h = last.gather(1, idx.expand(-1, -1, last.shape[-1])).view(S, A, P, -1)
        return torch.softmax(self.logits(h), dim=-1)


def attach_target_head(trainer) -> int:
    """Select the last layer's feature columns after the drafter's taps; returns the number of
    drafter feature columns (the split point)."""
    taps, L, H = trainer.data_taps, trainer.target.num_layers, trainer.target.hidden_size
    if L not in taps:
        raise ConfigError(
            f"method {trainer.cfg.method} recomputes the target distribution from the last layer (tap {L}), but "
            f"{trainer.data.root} has taps {taps}: regenerate the data with `dcoco data regenerate`"
        )
    split = len(trainer.tap_index) * H
    trainer.tap_index = list(trainer.tap_index) + [taps.index(L) * H]
    return split


# -- model ---------------------------------------------------------------------------------------
def dspark_config(d) -> DSparkConfig:
    """`DSparkConfig` from the `drafter` section of a training config."""
    return DSparkConfig(
        markov_rank=d.markov_rank,
        anchor_slot=d.anchor_slot,
        confidence_head=d.confidence_head,
        confidence_threshold=d.confidence_threshold,
    )


def load_dspark_init(path: Optional[str]) -> Optional[DSparkModel]:
    """A DSpark checkpoint to continue from (None when `path` is unset or a plain DFlash/DCOCO one)."""
    if not path:
        return None
    raw, _ = load_checkpoint(path)
    if "dspark_config" not in raw:
        return None
    model, _ = load_dspark(path)
    return model


def dspark_from_backbone(backbone: DFlashModel, d) -> DSparkModel:
    """Fresh Markov / confidence heads on a (fresh or warm-started) DFlash backbone."""
    model = DSparkModel(backbone.cfg, dspark_config(d))
    own = model.state_dict()
    model.load_state_dict(
        {
            k: v
            for k, v in backbone.state_dict().items()
            if k in own and not k.startswith(("markov_head.", "confidence_head."))
        },
        strict=False,
    )
    return model


# -- loss ----------------------------------------------------------------------------------------
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

    def batch_at(self, samples: list[dict], feats: list[torch.Tensor], anchors: list[list[int]]) -> Batch:
        """The DFlash batch with one label per draft slot: labels[s, a, j] = x_{anchor + 1 + j}."""
        return make_batch(samples, feats, anchors, self.model.max_draft + 1)

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
        wsum = w.sum().clamp_min(1e-6)
        logq = torch.log_softmax(z, dim=-1)
        ce = -logq.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
        pt = self.head.next_token_probs(b, self.split, P)
        l1 = (logq.exp() - pt).abs().sum(-1)
        accept = (1.0 - 0.5 * l1).detach().clamp(0.0, 1.0)
        ce_l, l1_l = (ce * w).sum() / wsum, (l1 * w).sum() / wsum
        loss = self.ce_weight * ce_l + self.l1_weight * l1_l
        m = {
            "ce_loss": ce_l.item(),
            "l1_loss": l1_l.item(),
            "accept_est": ((accept * valid).sum() / valid.sum().clamp_min(1)).item(),
        }
        if conf is not None:
            bce = F.binary_cross_entropy_with_logits(conf.float(), accept, reduction="none")
            bce_l = (bce * w).sum() / wsum
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


# -- trainer hooks ---------------------------------------------------------------------------------
def build_dspark_loss(trainer) -> DSparkLoss:
    d, o = trainer.cfg.drafter, trainer.cfg.optim
    split = attach_target_head(trainer)
    return DSparkLoss(
        trainer.model,
        trainer.embed,
        trainer.lm_head,
        o.loss_decay_gamma,
        TargetHead(trainer.target),
        split,
        d.dspark_ce_weight,
        d.dspark_l1_weight,
        d.dspark_confidence_weight,
    )


def export_dspark(trainer, path) -> None:
    save_dspark(path, trainer.model, extra=trainer.provenance())
