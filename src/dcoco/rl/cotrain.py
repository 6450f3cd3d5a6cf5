"""Online draft co-training: the draft phi learns from the RL step's own rollout tokens and the
policy's features at the drafter's taps, captured during the policy forward of that step and
detached, so

    L(theta, phi) = L_RL(theta) + lambda * L_draft(phi; x, stopgrad(H_theta(x))).

The draft loss is the family's offline training loss, unchanged (`DrafterLoss`, `DCOCOLoss`,
`DSparkLoss`, `Eagle3Loss`, batches from `loss_batch`): rollout sequences take the place of
regenerated samples and live policy features the place of stored ones. DSpark and EAGLE-3 also read
the policy's last layer (tap L, before the final norm) to recompute its next-token distribution.

Stop-gradient, both ways: the features are detached, and the draft reads the policy's embedding
and LM head (shared, not copied, so the draft always drafts for the current policy) through
`Detached`, so no draft gradient reaches theta; the draft has its own optimizer and gradient
clipping, so theta's update is exactly the one without the draft term (tested bitwise).
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch
from torch.func import functional_call

from ..families import LossParts, ModelSource, build_model, get_family, shipped_checkpoint
from ..target import Target
from ..train.batch import loss_batch
from ..train.losses import TargetHead
from ..train.trainer import drafter_optimizer
from .config import DraftSection


class Detached:
    """Calls a module with its parameters detached: the draft reads the policy's embedding and LM
    head without sending gradient into them."""

    def __init__(self, module: torch.nn.Module):
        self.module = module

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        params = {n: p.detach() for n, p in self.module.named_parameters()}
        return functional_call(self.module, params, (x,))


def initial_checkpoint(cfg: DraftSection) -> Optional[str]:
    """`draft.init_from`, else the checkpoint shipped for the embedded target, else None (fresh)."""
    if cfg.init_from == "fresh":
        return None
    if cfg.init_from:
        return cfg.init_from
    shipped = shipped_checkpoint(cfg.method)
    return str(shipped) if shipped is not None else None


def build_draft_model(cfg: DraftSection, target: Target) -> torch.nn.Module:
    """The draft to co-train, float32: loaded from `initial_checkpoint`, or fresh from `cfg.arch`."""
    arch = cfg.arch.model_copy(update={"init_from": initial_checkpoint(cfg)})
    with torch.device(target.device):
        return build_model(get_family(cfg.method), arch, target, ModelSource()).to(target.device)


def build_draft_loss(cfg: DraftSection, model: torch.nn.Module, target: Target):
    """The family's training loss, reading the policy's embedding / LM head / final norm detached."""
    family = get_family(cfg.method)
    parts = LossParts(
        Detached(target.model.get_input_embeddings()),
        Detached(target.model.get_output_embeddings()),
        TargetHead(target) if family.reads_last_layer(cfg.arch) else None,
        len(model.cfg.taps) * target.hidden_size,
        cfg.loss_decay_gamma,
    )
    with torch.device(target.device):
        return family.build_loss(model, parts, cfg.arch)


class DraftCoTrainer:
    """The draft of an RL run: model, loss, optimizer. `target` is the policy being trained."""

    def __init__(self, cfg: DraftSection, target: Target):
        self.cfg, self.method = cfg, cfg.method
        self.family = get_family(cfg.method)
        self.model = build_draft_model(cfg, target)
        self.family.drafter(self.model, target).check_target(target)
        self.model.eval()
        self.taps = list(self.model.cfg.taps)
        # policy features the loss reads: the drafter's taps, then the last layer when its family needs it
        self.feature_taps = self.taps + ([target.num_layers] if self.family.reads_last_layer(cfg.arch) else [])
        self.loss = build_draft_loss(cfg, self.model, target)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.opt = drafter_optimizer(self.model, cfg.lr, cfg.weight_decay, self.family.lr_scale(cfg.arch))

    def backward(self, samples: list[dict], feats: list[torch.Tensor], gen: torch.Generator) -> dict:
        """lambda * L_draft on this step's rollouts, backpropagated into the draft only. A frozen draft
        (`cotrain: false`) is scored the same way, without gradients, to show how it goes stale."""
        self.model.train()  # EAGLE-3's batch layout reads the training flag
        try:
            return self.backward_on(loss_batch(self.loss, samples, feats, self.cfg.anchors_per_seq, gen))
        finally:
            self.model.eval()

    def backward_on(self, batch) -> dict:
        """`backward` on a batch already built (under context parallelism: this rank's share).
        Returns the loss, the teacher-forced tau, and the labelled blocks it averages over."""
        self.model.train()
        try:
            with torch.set_grad_enabled(self.cfg.cotrain):
                loss, extras = self.loss(batch)
            if self.cfg.cotrain:
                (self.cfg.weight * loss).backward()
            with torch.no_grad():
                tau = self.loss.eval_metrics(extras, batch.labels)["eval_tau"]
        finally:
            self.model.eval()
        out = {"draft_loss": loss.item(), "draft_tau_teacher_forced": tau}
        out.update({f"draft_{k}": v for k, v in extras.get("metrics", {}).items() if isinstance(v, (int, float))})
        return out

    def update(self) -> dict:
        if not self.cfg.cotrain:
            return {}
        gnorm = torch.nn.utils.clip_grad_norm_(self.params, self.cfg.grad_clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return {"draft_grad_norm": gnorm.item()}

    def export(self, path: Path, extra: Optional[dict] = None) -> None:
        """The draft as a checkpoint directory that `dcoco generate --method M --drafter DIR` loads."""
        self.family.save(path, self.model, {**self.family.checkpoint_extra(self.cfg.arch), **(extra or {})})
