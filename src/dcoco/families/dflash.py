"""The DFlash family: a parallel block drafter on the target's hidden states. DCOCO and DSpark
extend it (`DFlashFamily.backbone` is the DFlash model they start from)."""

from __future__ import annotations

from typing import Optional

import torch

from ..drafters.checkpoint import load_weights
from ..drafters.dflash import BlockDrafter, DFlashConfig, DFlashModel, init_from_target, save_dflash
from ..errors import ConfigError
from ..train.batch import top_tokens
from ..train.losses import DrafterLoss
from .base import Family, LossParts, ModelSource


class DFlashFamily(Family):
    loss_options = ("distill_weight",)
    name = "dflash"
    drafter_class = BlockDrafter
    model_class = DFlashModel

    def recognizes(self, raw: dict) -> bool:
        return "dflash_config" in raw

    def read(self, raw: dict, state: dict, path) -> DFlashModel:
        model = DFlashModel(DFlashConfig.from_hf(raw))
        load_weights(model, state, path)
        return model

    def save(self, path, model, extra: Optional[dict] = None, dtype: torch.dtype = torch.bfloat16) -> None:
        save_dflash(path, model, method=self.name, extra=extra, dtype=dtype)

    # -- training ----------------------------------------------------------------------------
    def backbone(self, d, target, start=None) -> DFlashModel:
        """The DFlash backbone: that of `start` (a DFlash-family model), or a fresh one (its layers
        from the target's last ones when `d.init_from_target`). A warm start keeps its shape but
        takes `d.block_size` when set: the block shapes no weight."""
        if start is not None:
            if not isinstance(start, DFlashModel):
                raise ConfigError(f"drafter.init_from: {d.init_from} is not a DFlash-family checkpoint")
            model = DFlashModel(start.cfg.model_copy(update={"block_size": d.block_size or start.cfg.block_size}))
            own = model.state_dict()
            model.load_state_dict({k: v for k, v in start.state_dict().items() if k in own})
            return model
        cfg = DFlashConfig.for_target(
            target,
            num_layers=d.num_layers,
            block_size=d.block_size,
            num_features=d.num_features,
            intermediate_size=d.intermediate_size,
        )
        model = DFlashModel(cfg)
        if d.init_from_target:
            init_from_target(model, target)
        return model

    def finish(self, model: DFlashModel, d, target, source: ModelSource, start=None) -> DFlashModel:
        """Inference defaults stored in the checkpoint and the draft vocabulary (from the data's
        response-token counts, unless the model has one); float32, training mode."""
        if d.num_speculative_tokens is not None:
            model.cfg.num_speculative_tokens = d.num_speculative_tokens
        size = min(d.draft_vocab_size, target.vocab_size)
        if model.draft_ids is None and size < target.vocab_size and source.counts is not None:
            model.set_draft_vocab(top_tokens(source.counts(), size))
        return model.float().train()

    def build_model(self, d, target, source: ModelSource, start=None) -> DFlashModel:
        return self.finish(self.backbone(d, target, start), d, target, source)

    def reads_last_layer(self, d) -> bool:
        return d.distill_weight > 0  # its soft labels are the target's distribution

    def build_loss(self, model, parts: LossParts, d) -> DrafterLoss:
        return DrafterLoss(*parts.block_loss_args(model), d.draft_vocab_loss, d.distill_weight)


DFLASH = DFlashFamily()
