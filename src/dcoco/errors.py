"""Typed errors. The CLI turns every `DcocoError` into a one-line message and a non-zero exit."""


class DcocoError(Exception):
    """Base class of every error dcoco raises on purpose (bad input, bad files)."""


class InvalidPromptError(DcocoError, ValueError):
    """The prompt is empty or not text / token ids."""


class PromptTooLongError(DcocoError, ValueError):
    """The prompt (plus room to generate) does not fit in the model's context."""


class InvalidSamplingParamsError(DcocoError, ValueError):
    """A sampling value is out of range (negative temperature, top_p outside (0, 1], ...)."""


class UnknownMethodError(DcocoError, ValueError):
    """The speculative method name is not one dcoco knows."""


class ModelNotFoundError(DcocoError, FileNotFoundError):
    """A model or drafter directory does not exist or holds no loadable model."""


class DrafterMismatchError(DcocoError, ValueError):
    """A drafter checkpoint was made for a different target (vocabulary or hidden size)."""


class ConfigError(DcocoError, ValueError):
    """A configuration file or override is invalid (unknown key, wrong type)."""
