"""Typed errors for the scale-out package.

Every error is a `DcocoError` (the CLI prints it as one line) and subclasses a builtin
(``ValueError``, ``RuntimeError`` or ``TimeoutError``) so callers that do not know this package
can still catch it generically, while tests and training loops can match the precise failure.
"""

from __future__ import annotations

from ..errors import DcocoError

__all__ = [
    "ParallelError",
    "LayoutError",
    "ShapeMismatchError",
    "WorldSizeMismatchError",
    "BranchSpecError",
    "TapChannelError",
    "TapShapeError",
    "TapClosedError",
    "TapSlotsExhaustedError",
    "TapTimeoutError",
]


class ParallelError(DcocoError):
    """Base class of every error raised by :mod:`dcoco.parallel`."""


class LayoutError(ParallelError, ValueError):
    """Bad sequence lengths, world size or rank for a zigzag layout."""


class ShapeMismatchError(ParallelError, ValueError):
    """Tensors whose shapes do not agree with each other or with the layout."""


class WorldSizeMismatchError(ParallelError, ValueError):
    """The process group does not have the size the layout was built for."""


class BranchSpecError(ParallelError, ValueError):
    """An inconsistent branch (draft query) structure."""


class TapChannelError(ParallelError, RuntimeError):
    """A TapChannel protocol violation (wrong role, duplicate stamp, ...)."""


class TapShapeError(TapChannelError, ValueError):
    """A payload that does not fit the channel's slot shape or dtype."""


class TapClosedError(TapChannelError):
    """The channel was closed (locally or by the peer)."""


class TapSlotsExhaustedError(TapChannelError):
    """Every mailbox slot holds an unconsumed stamp other than the one requested.

    Waiting could never succeed (the producer has no free slot to write the
    requested stamp into), so this is raised at once instead of after a timeout.
    """


class TapTimeoutError(ParallelError, TimeoutError):
    """A stamp (or a free slot) did not arrive within the timeout."""
