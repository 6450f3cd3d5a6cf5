"""The DCOCO family: DFlash plus the contextual corrector, trained jointly."""

from __future__ import annotations

import re
from typing import Callable, Optional, Union

import torch
from pydantic import Field, model_validator

from ..drafters.checkpoint import load_checkpoint, load_weights
from ..drafters.dcoco import DCOCOConfig, DCOCODrafter, DCOCOModel
from ..drafters.dflash import DFlashConfig, save_dflash
from ..errors import ConfigError
from ..train.batch import pair_counts
from ..train.losses import DCOCOLoss
from .base import LossParts, ModelSource, narrowed
from .dflash import DFLASH, DFlashFamily


class DCOCOSettings(DCOCOConfig):
    """`drafter.dcoco`: the corrector's shape and inference defaults (`DCOCOConfig`), plus training."""

    train_backbone: bool = True  # False: only the corrector learns, on a frozen (warm-started) DFlash backbone
    # the backbone's learning rate as a fraction of optim.lr, the corrector's: a warm backbone trained
    # with a fresh corrector at the corrector's rate loses more than the corrector gains
    # (docs/experiments/2026-12-04-dcoco-corrector-on-stage-dflash.md)
    backbone_lr_scale: float = Field(1.0, gt=0)
    corrector_weight: float = 1.0  # loss = DFlash's + corrector_weight * corrector's
    # + corrector_l1_weight * ||q - p_target||_1, q the T > 0 walk's distribution given the target's
    # previous token (its T=1 acceptance; needs the target's last layer in the data, as DSpark)
    corrector_l1_weight: float = 0.0
    # a DCOCO checkpoint whose trained corrector goes on the DFlash backbone of `drafter.init_from`:
    # the corrector continues onto the next stage's DFlash instead of starting from zero again
    corrector_from: Optional[str] = None
    # give the pair scores a table of the target's bigrams (`Corrector`), counted over the training
    # answers of bigram_path (None: data.path's, all of them whatever data.train_samples draws; never
    # a held-out one). A corrector that has a table keeps it
    bigram: bool = False
    bigram_path: Union[str, list[str], None] = None

    @model_validator(mode="after")
    def _backbone_rate(self):
        if self.backbone_lr_scale != 1.0 and not self.train_backbone:
            raise ValueError("backbone_lr_scale: the backbone is frozen (train_backbone=false)")
        if "bigram_pairs" in self.model_fields_set:
            raise ValueError("bigram_pairs is set by training (drafter.dcoco.bigram=true)")
        if self.bigram_path is not None and not self.bigram:
            raise ValueError("bigram_path: drafter.dcoco.bigram is off")
        return self

    def corrector(self) -> DCOCOConfig:
        return narrowed(self, DCOCOConfig)


def widened(trained: DCOCOConfig, s: DCOCOSettings) -> dict:
    """`proj_dim` and `hidden` set larger than a trained corrector's widen it (`Corrector.take`);
    left unset, it keeps its own."""
    shape = {}
    for key in ("proj_dim", "hidden"):
        have, want = getattr(trained, key), getattr(s, key)
        if key in s.model_fields_set and want != have:
            if want < have:
                raise ConfigError(
                    f"drafter.dcoco.{key}={want}: the trained corrector has {have} (it can widen, not narrow)"
                )
            shape[key] = want
    return shape


class DCOCOFamily(DFlashFamily):
    loss_options = ()
    name = "dcoco"
    drafter_class = DCOCODrafter
    model_class = DCOCOModel
    settings = DCOCOSettings
    spec_options = ("dcoco_top_k", "dcoco_walk", "dcoco_correct")
    select_baseline = "dflash"

    def recognizes(self, raw: dict) -> bool:
        return "dcoco_config" in raw

    def configure(self, drafter: DCOCODrafter, spec) -> None:
        drafter.configure(correct=spec.dcoco_correct, top_k=spec.dcoco_top_k, walk=spec.dcoco_walk)

    def variant_options(self, tag: str) -> dict:
        """`nocorrect` (the backbone alone), `onehot` / `sampled` / `vocab` (the T > 0 walk), `kN`
        (a shortlist of N)."""
        if tag == "nocorrect":
            return {"dcoco_correct": False}
        if tag in ("onehot", "sampled", "vocab"):
            return {"dcoco_walk": tag}
        m = re.fullmatch(r"k(\d+)", tag)
        return {"dcoco_top_k": int(m[1])} if m else {}

    def read(self, raw: dict, state: dict, path) -> DCOCOModel:
        model = DCOCOModel(DFlashConfig.from_hf(raw), DCOCOConfig(**raw["dcoco_config"]))
        load_weights(model, state, path)
        return model

    def save(self, path, model: DCOCOModel, extra: Optional[dict] = None, dtype: torch.dtype = torch.bfloat16) -> None:
        save_dflash(
            path, model, method=self.name, extra={**(extra or {}), "dcoco_config": model.dcfg.model_dump()}, dtype=dtype
        )

    # -- training ----------------------------------------------------------------------------
    def build_model(self, d, target, source: ModelSource, start=None) -> DCOCOModel:
        """A zero-initialised corrector on the DFlash backbone; from a DCOCO checkpoint, its trained
        corrector (its shape comes with it, widened where `proj_dim` or `hidden` is set larger; the
        inference defaults come from the settings)."""
        s: DCOCOSettings = d.dcoco
        trained = self.corrector_on(d, target, start) if s.corrector_from else start
        if isinstance(trained, DCOCOModel):
            dcfg = trained.dcfg.model_copy(
                update={
                    "sampled_walk": s.sampled_walk,
                    "vocab_walk": s.vocab_walk,
                    "sampled_head": trained.dcfg.sampled_head or s.sampled_head,
                    **widened(trained.dcfg, s),
                }
            )
            model = DCOCOModel(trained.cfg, dcfg)
            backbone = {k: v for k, v in trained.state_dict().items() if not k.startswith("corrector.")}
            missing, unexpected = model.load_state_dict(backbone, strict=False)
            if any(not k.startswith("corrector.") for k in missing) or unexpected:
                raise ConfigError(
                    f"{d.init_from}: its weights do not fit its own config "
                    f"(missing {missing[:3]}, unexpected {unexpected[:3]})"
                )
            model.corrector.take(trained.corrector)
        else:
            backbone = DFLASH.backbone(d, target, start)
            model = DCOCOModel(backbone.cfg, s.corrector())
            model.load_state_dict(backbone.state_dict(), strict=False)
        if s.bigram and not model.dcfg.bigram_pairs:
            if source.answers is None:
                raise ConfigError(
                    "drafter.dcoco.bigram: the table is counted over training data, and this run has none"
                )
            paths = [s.bigram_path] if isinstance(s.bigram_path, str) else s.bigram_path
            model.corrector.set_bigrams(*pair_counts(source.answers(paths), model.cfg.vocab_size))
        if not s.train_backbone:
            for name, p in model.named_parameters():
                p.requires_grad_(name.startswith("corrector."))
        return self.finish(model, d, target, source)

    def lr_scale(self, d) -> Optional[Callable[[str], float]]:
        """`drafter.dcoco.backbone_lr_scale` for every parameter outside the corrector."""
        s: DCOCOSettings = d.dcoco
        if s.backbone_lr_scale == 1.0:
            return None
        return lambda name: 1.0 if name.startswith("corrector.") else s.backbone_lr_scale

    def continued_part(self, d) -> Optional[str]:
        return d.dcoco.corrector_from

    def corrector_on(self, d, target, start) -> DCOCOModel:
        """The corrector of `drafter.dcoco.corrector_from` on the backbone of `drafter.init_from`."""
        path = d.dcoco.corrector_from
        if start is None or isinstance(start, DCOCOModel):
            raise ConfigError(
                "drafter.dcoco.corrector_from: drafter.init_from must be the DFlash checkpoint that gets its corrector"
            )
        raw, state = load_checkpoint(path)
        if not self.recognizes(raw):
            raise ConfigError(f"drafter.dcoco.corrector_from: {path} is not a DCOCO checkpoint")
        donor = self.read(raw, state, path)
        backbone = DFLASH.backbone(d, target, start)
        if donor.cfg.hidden_size != backbone.cfg.hidden_size:
            raise ConfigError(
                f"drafter.dcoco.corrector_from: {path} has hidden size {donor.cfg.hidden_size}, "
                f"the backbone {backbone.cfg.hidden_size}"
            )
        model = DCOCOModel(backbone.cfg, donor.dcfg)
        model.load_state_dict(backbone.state_dict(), strict=False)
        model.corrector.load_state_dict(donor.corrector.state_dict())
        return model

    def reads_last_layer(self, d) -> bool:
        return d.dcoco.corrector_l1_weight > 0

    def build_loss(self, model, parts: LossParts, d) -> DCOCOLoss:
        s = d.dcoco
        return DCOCOLoss(
            *parts.block_loss_args(model), corrector_weight=s.corrector_weight, l1_weight=s.corrector_l1_weight
        )


DCOCO = DCOCOFamily()

__all__ = ["DCOCO", "DCOCOFamily", "DCOCOSettings"]
