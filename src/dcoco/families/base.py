"""What a drafter family declares, once, for the engine, the trainer, the RL loop, the bench and
`dcoco eval`: how to build, load and save its model, its inference `Drafter`, its training loss and
its settings. The registry (`dcoco.families`) lists the families; nothing outside a family's own
module special-cases one."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
from pydantic import BaseModel

from ..drafters.base import Drafter
from ..errors import ModelNotFoundError
from ..nn.prepack import prepack_linears


def narrowed(settings: BaseModel, cls: type[BaseModel]) -> BaseModel:
    """The `cls` part of a family's settings (which extend the model's own config with training keys)."""
    return cls(**settings.model_dump(include=set(cls.model_fields)))


@dataclass
class LossParts:
    """The frozen pieces of the target a loss reads: embedding, LM head, its own next-token
    distribution from the last layer (`TargetHead`, None when the features lack the last layer),
    and `split`, the number of feature columns that are the drafter's taps (the last layer's follow)."""

    embed: Callable
    lm_head: Callable
    target_head: Optional[object]
    split: int
    gamma: float

    def block_loss_args(self, model) -> tuple:
        """The leading arguments of the DFlash-family block losses (`DrafterLoss` and its subclasses)."""
        return model, self.embed, self.lm_head, self.gamma, self.split, self.target_head


@dataclass
class ModelSource:
    """What a fresh drafter is shaped from besides its settings: the response-token counts of the
    training data for the draft vocabulary (None: no data, e.g. an RL run), the target taps the
    data holds (None: any), and the training answers (hold-out left out) of the given directories,
    data.path's by default (DCOCO's bigram table; None: no data)."""

    counts: Optional[Callable[[], torch.Tensor]] = None
    taps: Optional[list[int]] = None
    answers: Optional[Callable[[Optional[list[str]]], list[dict]]] = None


class Family:
    """A drafter family. Model-free families override `make_drafter` only."""

    name: str = ""
    trained: bool = True
    #: the family's own subsection of the training config's `drafter` section (None: it has none)
    settings: Optional[type[BaseModel]] = None
    #: `SpeculativeConfig` fields that configure its drafter (an error with another method)
    spec_options: tuple[str, ...] = ()
    #: the bench reports this family's token-selection time net of that family's (None: not at all)
    select_baseline: Optional[str] = None
    #: shared `drafter` keys that only some losses read: a run setting one its family's loss ignores is refused
    loss_options: tuple[str, ...] = ()
    #: the class of its models (a checkpoint of another family is refused) and of its `Drafter`
    model_class: Optional[type] = None
    drafter_class: Optional[type] = None

    # -- inference ---------------------------------------------------------------------------
    def make_drafter(self, spec, target) -> Drafter:
        """A model-free family's drafter for a `SpeculativeConfig` (a trained family's is `drafter`
        around the model of `dcoco.families.load_drafter_model`)."""
        raise NotImplementedError

    def drafter(self, model: torch.nn.Module, target) -> Drafter:
        """The inference wrapper around a model of this family (fresh per-request state); a bf16 or
        float32 model's linears on the CPU are packed once for oneDNN, as the target's (`dcoco.nn.prepack`)."""
        model = self.check_model(model)
        prepack_linears(model)
        return self.drafter_class(model, target)

    def configure(self, drafter: Drafter, spec) -> None:
        """Apply the spec's inference options (`spec_options`) to the drafter."""

    def variant_options(self, tag: str) -> dict:
        """`SpeculativeConfig` options that a bench label `METHOD/TAG` stands for ({}: none)."""
        return {}

    def check_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """`model`, if this family can draft with it (a subclass's model counts: DCOCO's runs as DFlash)."""
        if self.model_class is None or not isinstance(model, self.model_class):
            raise ModelNotFoundError(
                f"a {type(model).__name__} is not a {self.name} model; train one with method: {self.name}"
            )
        return model

    # -- checkpoints -------------------------------------------------------------------------
    def recognizes(self, raw: dict) -> bool:
        """Whether a checkpoint's config.json without a `dcoco_method` field is one of this family."""
        return False

    def read(self, raw: dict, state: dict, path) -> torch.nn.Module:
        """The model of a checkpoint of this family, from its config.json and weights."""
        raise NotImplementedError

    def save(
        self, path, model: torch.nn.Module, extra: Optional[dict] = None, dtype: torch.dtype = torch.bfloat16
    ) -> None:
        raise NotImplementedError

    def checkpoint_extra(self, d) -> dict:
        """Training settings a checkpoint keeps in its config.json for evaluation (`settings_from_checkpoint`)."""
        return {}

    def settings_from_checkpoint(self, raw: dict, d):
        """The training `drafter` section that evaluates a checkpoint with config.json `raw` (the
        settings a loss needs that the model does not carry)."""
        return d

    # -- training ----------------------------------------------------------------------------
    def build_model(self, d, target, source: ModelSource, start: Optional[torch.nn.Module]) -> torch.nn.Module:
        """A model to train from the `drafter` section `d`: continued from `start` (the model of the
        checkpoint `d.init_from`, of any family) or fresh for `target`; float32, in training mode."""
        raise NotImplementedError

    def lr_scale(self, d) -> Optional[Callable[[str], float]]:
        """Each trainable parameter's learning rate, by name, as a fraction of `optim.lr` (None: one rate)."""
        return None

    def continued_part(self, d) -> Optional[str]:
        """A checkpoint (other than `drafter.init_from`) a part of whose model this run continues on
        the backbone of `init_from`: its corrected evaluations carry onto this run's curve."""
        return None

    def reads_last_layer(self, d) -> bool:
        """Whether its loss needs the target's last layer in the features (its own distribution)."""
        return False

    def build_loss(self, model: torch.nn.Module, parts: LossParts, d):
        raise NotImplementedError
