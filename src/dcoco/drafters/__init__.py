"""The inference side of every drafter family: what a drafter receives and returns (`base`), and
each family's model and `Drafter`. Which family a method names is the registry's business
(`dcoco.families`); building one from a `speculative_config` is `dcoco.speculative`'s."""

from .base import Drafter, DraftInput, DraftOutput

__all__ = ["Drafter", "DraftInput", "DraftOutput"]
