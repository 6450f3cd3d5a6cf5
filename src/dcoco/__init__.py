"""dcoco: lossless speculative decoding for Hugging Face causal LMs.

Names are imported lazily (PEP 562), so `import dcoco.parallel` or a spawned worker does not pay
for transformers and the whole inference stack.
"""

from importlib import import_module

__version__ = "0.1.0"

_EXPORTS = {
    "LLM": "api",
    "METHODS": "speculative",
    "Drafter": "drafters",
    "DraftInput": "drafters",
    "DraftOutput": "drafters",
    "SpeculativeConfig": "speculative",
    "GenerationOutput": "engine",
    "SpeculativeEngine": "engine",
    "ConfigError": "errors",
    "DcocoError": "errors",
    "DrafterMismatchError": "errors",
    "InvalidPromptError": "errors",
    "InvalidSamplingParamsError": "errors",
    "ModelNotFoundError": "errors",
    "PromptTooLongError": "errors",
    "UnknownMethodError": "errors",
    "SpecStats": "metrics",
    "SamplingParams": "sampling",
    "Target": "target",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'dcoco' has no attribute {name!r}")
    value = getattr(import_module(f".{_EXPORTS[name]}", __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return __all__
