"""The DSpark family: the DFlash block pass, a Markov head on the previous token and a confidence
head, trained to match the target's distribution."""

from __future__ import annotations

from typing import Optional

import torch

from ..drafters.checkpoint import load_weights
from ..drafters.dflash import DFlashConfig
from ..drafters.dspark import DSparkConfig, DSparkDrafter, DSparkModel, save_dspark
from ..train.losses import DSparkLoss
from .base import LossParts, ModelSource, narrowed
from .dflash import DFLASH, DFlashFamily


class DSparkSettings(DSparkConfig):
    """`drafter.dspark`: the heads (`DSparkConfig`) and the loss weights,
    loss = ce * CE + l1 * ||p_draft - p_target||_1 + confidence * BCE."""

    ce_weight: float = 0.1
    l1_weight: float = 0.9
    confidence_weight: float = 1.0

    def heads(self) -> DSparkConfig:
        return narrowed(self, DSparkConfig)


class DSparkFamily(DFlashFamily):
    loss_options = ()
    name = "dspark"
    drafter_class = DSparkDrafter
    model_class = DSparkModel
    settings = DSparkSettings

    def recognizes(self, raw: dict) -> bool:
        return "dspark_config" in raw

    def read(self, raw: dict, state: dict, path) -> DSparkModel:
        model = DSparkModel(DFlashConfig.from_hf(raw), DSparkConfig(**raw["dspark_config"]))
        load_weights(model, state, path)
        return model

    def save(self, path, model: DSparkModel, extra: Optional[dict] = None, dtype: torch.dtype = torch.bfloat16) -> None:
        save_dspark(path, model, extra=extra, dtype=dtype)

    def build_model(self, d, target, source: ModelSource, start=None) -> DSparkModel:
        """A DSpark checkpoint continues as it is; any other start gets fresh heads on the DFlash backbone."""
        if isinstance(start, DSparkModel):
            return self.finish(start, d, target, source)
        backbone = DFLASH.backbone(d, target, start)
        model = DSparkModel(backbone.cfg, d.dspark.heads())
        own = model.state_dict()
        model.load_state_dict(
            {
                k: v
                for k, v in backbone.state_dict().items()
                if k in own and not k.startswith(("markov_head.", "confidence_head."))
            },
            strict=False,
        )
        return self.finish(model, d, target, source)

    def reads_last_layer(self, d) -> bool:
        return True

    def build_loss(self, model, parts: LossParts, d) -> DSparkLoss:
        s = d.dspark
        return DSparkLoss(
            model,
            parts.embed,
            parts.lm_head,
            parts.gamma,
            parts.target_head,
            parts.split,
            s.ce_weight,
            s.l1_weight,
            s.confidence_weight,
        )


DSPARK = DSparkFamily()
