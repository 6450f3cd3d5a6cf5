"""What a drafter receives and returns. The engine owns the target and its cache; a drafter only
sees accepted tokens and the target features it asked for, and proposes a block of tokens."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Optional

import torch

from ..sampling import SamplingParams


@dataclass
class DraftInput:
    """One drafting step for a batch of requests (row b is request `request_ids[b]`).

    `token_ids[b]` is the request's whole sequence (prompt + generated); its last token is the one
    the target has not processed yet (the anchor of the next block). `new_features[b]` holds the
    target features (n, F) of the tokens that entered the target's cache since the previous call
    for that request (at the first call: the whole prompt), in order, or None when the drafter taps
    no layers.
    """

    request_ids: list[int]
    token_ids: list[list[int]]
    new_features: list[Optional[torch.Tensor]]
    num_tokens: int
    params: list[SamplingParams]
    generators: list[torch.Generator]
    device: Optional[torch.device] = None  # where the output goes: the target's device (None: torch's default)


@dataclass
class DraftOutput:
    """Row b proposes `tokens[b, :lengths[b]]`; `probs` (B, G, V) are the distributions the tokens were
    sampled from, or None for deterministic drafts (verified as one-hot)."""

    tokens: torch.Tensor
    lengths: torch.Tensor
    probs: Optional[torch.Tensor] = None

    @staticmethod
    def empty(batch: int, device: Optional[torch.device] = None) -> "DraftOutput":
        return DraftOutput(
            torch.zeros(batch, 0, dtype=torch.long, device=device), torch.zeros(batch, dtype=torch.long, device=device)
        )


class Drafter(ABC):
    """Base class of every drafter.

    `tap_layers` lists the target `hidden_states` indices the drafter needs (see `dcoco.target`);
    an empty tuple means the drafter is model-free.
    """

    method: str = ""
    tap_layers: tuple[int, ...] = ()
    default_num_tokens: int = 5

    @abstractmethod
    def propose(self, inp: DraftInput) -> DraftOutput:
        """Propose up to `inp.num_tokens` tokens per request."""

    def absorb(self, inp: DraftInput) -> None:  # noqa: B027 (optional hook: stateless drafters keep nothing)
        """Take in `inp`'s new features without drafting: another drafter drafts this step for these
        requests (`LookupFirst`), and this one must still see the whole context when it drafts next."""

    def release(self, request_id: int) -> None:  # noqa: B027 (optional hook: stateless drafters keep nothing)
        """The request finished or was cancelled: drop any state kept for it."""

    def check_target(self, target) -> None:  # noqa: B027 (optional hook: model-free drafters fit any target)
        """Raise `DrafterMismatchError` if this drafter was not made for `target`."""


def check_feature_drafter(target, vocab_size: int, hidden_size: int, num_target_layers: int, layer_ids) -> None:
    """The compatibility check of drafters fed by target features: same vocabulary, same hidden
    size, same depth (0-based decoder-layer ids must exist)."""
    from ..errors import DrafterMismatchError

    if vocab_size != target.vocab_size:
        raise DrafterMismatchError(f"drafter vocabulary {vocab_size} != target vocabulary {target.vocab_size}")
    if hidden_size != target.hidden_size:
        raise DrafterMismatchError(f"drafter hidden size {hidden_size} != target hidden size {target.hidden_size}")
    if num_target_layers != target.num_layers or max(layer_ids) >= target.num_layers:
        raise DrafterMismatchError(
            f"drafter was made for a {num_target_layers}-layer target, this target has {target.num_layers} layers"
        )
