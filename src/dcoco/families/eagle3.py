"""The EAGLE-3 family: one decoder layer over fused low / middle / high target features, drafting
autoregressively, trained with the training-time test."""

from __future__ import annotations

from typing import Optional

import torch
from pydantic import BaseModel, ConfigDict

from ..drafters.checkpoint import load_weights
from ..drafters.eagle3 import (
    Eagle3Config,
    Eagle3Drafter,
    Eagle3Model,
    default_eagle_layer_ids,
    eagle3_state,
    save_eagle3,
)
from ..errors import ConfigError
from ..train.batch import top_tokens
from ..train.losses import Eagle3Loss
from .base import Family, LossParts, ModelSource


class Eagle3Settings(BaseModel):
    """`drafter.eagle3` (one decoder layer as published: num_layers / block_size / num_features unused)."""

    model_config = ConfigDict(extra="forbid")

    # 0-based decoder-layer ids (tap = id + 1); None: low / middle / high from the data's taps
    layer_ids: Optional[list[int]] = None
    ttt_steps: int = 7  # unrolled training-time-test steps
    ttt_decay: float = 0.8  # step j of the unroll is weighted ttt_decay ** j
    # start slots per sequence whose chains are unrolled (sampled like anchors); None: all
    ttt_slots: Optional[int] = None


class Eagle3Family(Family):
    name = "eagle3"
    settings = Eagle3Settings
    drafter_class = Eagle3Drafter
    model_class = Eagle3Model

    def recognizes(self, raw: dict) -> bool:
        return "LlamaForCausalLMEagle3" in (raw.get("architectures") or [])

    def read(self, raw: dict, state: dict, path) -> Eagle3Model:
        model = Eagle3Model(Eagle3Config.from_hf(raw))
        load_weights(model, eagle3_state(model, state, path), path)
        return model

    def save(self, path, model: Eagle3Model, extra: Optional[dict] = None, dtype: torch.dtype = torch.bfloat16) -> None:
        save_eagle3(path, model, extra=extra, dtype=dtype)

    def settings_from_checkpoint(self, raw: dict, d):
        steps = raw.get("dcoco_ttt_steps")
        if steps is None:
            return d
        return d.model_copy(update={"eagle3": d.eagle3.model_copy(update={"ttt_steps": steps})})

    def checkpoint_extra(self, d) -> dict:
        return {"dcoco_ttt_steps": d.eagle3.ttt_steps}

    # -- training ----------------------------------------------------------------------------
    def build_model(self, d, target, source: ModelSource, start=None) -> Eagle3Model:
        """`start` (the checkpoint `d.init_from`), or a fresh drafter on the settings' layers (default:
        low / middle / high of the data's taps) whose draft vocabulary is the data's most frequent
        response tokens (no data: the whole vocabulary) and whose LM head starts from the target's
        rows of it."""
        s: Eagle3Settings = d.eagle3
        if start is not None:
            return self.check_model(start).float().train()
        try:
            ids = list(s.layer_ids) if s.layer_ids else default_eagle_layer_ids(target.num_layers, source.taps)
        except ValueError as e:
            raise ConfigError(f"drafter.eagle3.layer_ids: {e}") from None
        size = min(d.draft_vocab_size, target.vocab_size)
        draft_ids = top_tokens(source.counts(), size) if source.counts is not None else None
        cfg = Eagle3Config.for_target(
            target,
            ids,
            target.vocab_size if draft_ids is None else len(draft_ids),
            d.intermediate_size,
            d.num_speculative_tokens or s.ttt_steps,
        )
        model = Eagle3Model(cfg)
        if draft_ids is not None:
            model.set_vocab(draft_ids)
        model.init_lm_head_from(target.model.get_output_embeddings())
        return model.float().train()

    def reads_last_layer(self, d) -> bool:
        return True

    def build_loss(self, model, parts: LossParts, d) -> Eagle3Loss:
        s = d.eagle3
        return Eagle3Loss(model, parts.embed, parts.target_head, parts.split, s.ttt_steps, s.ttt_decay, s.ttt_slots)


EAGLE3 = Eagle3Family()
