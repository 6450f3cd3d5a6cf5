"""The n-gram (prompt lookup) family: model-free, nothing to train or load."""

from __future__ import annotations

from ..drafters.ngram import NgramDrafter
from ..errors import ConfigError
from .base import Family


class NgramFamily(Family):
    name = "ngram"
    trained = False

    def make_drafter(self, spec, target) -> NgramDrafter:
        try:
            return NgramDrafter(spec.prompt_lookup_max, spec.prompt_lookup_min)
        except ValueError as e:
            raise ConfigError(str(e)) from None


NGRAM = NgramFamily()
