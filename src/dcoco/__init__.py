"""dcoco: lossless speculative decoding for Hugging Face causal LMs."""

from .api import LLM
from .drafters import METHODS, Drafter, DraftInput, DraftOutput, SpeculativeConfig
from .engine import GenerationOutput, SpeculativeEngine
from .errors import (
    ConfigError,
    DcocoError,
    DrafterMismatchError,
    InvalidPromptError,
    InvalidSamplingParamsError,
    ModelNotFoundError,
    PromptTooLongError,
    UnknownMethodError,
)
from .metrics import SpecStats
from .sampling import SamplingParams
from .target import Target
from .verify import verify

__version__ = "0.1.0"

__all__ = [
    "LLM",
    "METHODS",
    "ConfigError",
    "DcocoError",
    "DraftInput",
    "DraftOutput",
    "Drafter",
    "DrafterMismatchError",
    "GenerationOutput",
    "InvalidPromptError",
    "InvalidSamplingParamsError",
    "ModelNotFoundError",
    "PromptTooLongError",
    "SamplingParams",
    "SpecStats",
    "SpeculativeConfig",
    "SpeculativeEngine",
    "Target",
    "UnknownMethodError",
    "verify",
]
