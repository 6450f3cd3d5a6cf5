"""The registry of drafter families: the one place that names them. The engine (through
`dcoco.speculative`), the trainer, the RL loop, the bench and `dcoco eval` look a family up here and
call what it declares (`Family`)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch

from ..drafters.checkpoint import load_checkpoint
from ..errors import DcocoError, ModelNotFoundError, UnknownMethodError
from .base import Family, LossParts, ModelSource
from .dcoco import DCOCO
from .dflash import DFLASH
from .dspark import DSPARK
from .eagle3 import EAGLE3
from .ngram import NGRAM

#: every family, in the order a user would reach for them
FAMILIES: dict[str, Family] = {f.name: f for f in (NGRAM, EAGLE3, DFLASH, DSPARK, DCOCO)}
#: the method names a `SpeculativeConfig` accepts: plain decoding, then every family
METHODS: tuple[str, ...] = ("vanilla", *FAMILIES)
#: trained families, best first: the default method is the first with a shipped checkpoint
PREFERENCE: tuple[Family, ...] = (DCOCO, DFLASH, DSPARK, EAGLE3)
#: what runs when no trained drafter is available, and what `dcoco serve` defaults to
MODEL_FREE: Family = NGRAM
#: what a training or RL config trains when it names no method
DEFAULT_TRAINED: Family = DFLASH

#: checkpoints shipped for the embedded target, one directory per family
SHIPPED_DIR = Path(__file__).resolve().parent.parent / "checkpoints" / "smollm2-135m-instruct"


def get_family(name: str) -> Family:
    """The family called `name`, or an `UnknownMethodError` listing them."""
    if name not in FAMILIES:
        raise UnknownMethodError(f"unknown drafter family {name!r}; choose one of {', '.join(FAMILIES)}")
    return FAMILIES[name]


def trained_families() -> list[str]:
    return [n for n, f in FAMILIES.items() if f.trained]


def shipped_checkpoint(name: str) -> Optional[Path]:
    p = SHIPPED_DIR / name
    return p if (p / "config.json").exists() and (p / "model.safetensors").exists() else None


def resolve_checkpoint(name: str, path: Optional[str | Path]) -> Path:
    """`path`, or the checkpoint shipped for the embedded target, or a clear error."""
    ckpt = path or shipped_checkpoint(name)
    if ckpt is None:
        raise ModelNotFoundError(f"no {name} checkpoint is shipped in this build; pass one with --drafter PATH")
    return Path(ckpt)


def family_of(raw: dict, path) -> Family:
    """The family that wrote a checkpoint's config.json: its `dcoco_method`, else its fields."""
    method = raw.get("dcoco_method")
    if method in FAMILIES and FAMILIES[method].trained:
        return FAMILIES[method]
    for fam in reversed(FAMILIES.values()):  # the extensions (DCOCO, DSpark) before DFlash
        if fam.recognizes(raw):
            return fam
    raise ModelNotFoundError(f"{path}: not a drafter checkpoint of any family ({', '.join(trained_families())})")


def load_trained(path: str | Path, dtype: torch.dtype = torch.float32) -> tuple[Family, torch.nn.Module, dict]:
    """A drafter checkpoint directory of any family: (its family, its model in `dtype`, its config.json)."""
    raw, state = load_checkpoint(path)
    fam = family_of(raw, path)
    try:
        model = fam.read(raw, state, path)
    except DcocoError:
        raise
    except (KeyError, TypeError, AttributeError, ValueError) as e:  # a config.json edited or written by another tool
        raise ModelNotFoundError(f"{path}: config.json does not describe a {fam.name} drafter ({e!r})") from None
    return fam, model.to(dtype), raw


def load_drafter_model(name: str, path: Optional[str | Path], dtype: torch.dtype = torch.float32):
    """The model of family `name` from `path` (None: the checkpoint shipped for the embedded target),
    refused unless the family drafts with it (a DCOCO checkpoint runs as DFlash, not the reverse)."""
    fam = get_family(name)
    return fam.check_model(load_trained(resolve_checkpoint(name, path), dtype)[1])


def build_model(family: Family, d, target, source: ModelSource) -> torch.nn.Module:
    """`family.build_model` continued from the checkpoint `d.init_from` (any family) when it is set."""
    start = load_trained(d.init_from)[1] if d.init_from else None
    return family.build_model(d, target, source, start)


def default_method(available: list[str]) -> str:
    """The best of the `available` methods: the first preferred trained family, else the model-free one."""
    return next((f.name for f in PREFERENCE if f.name in available), MODEL_FREE.name)


__all__ = [
    "DEFAULT_TRAINED",
    "FAMILIES",
    "build_model",
    "load_drafter_model",
    "METHODS",
    "MODEL_FREE",
    "PREFERENCE",
    "Family",
    "LossParts",
    "ModelSource",
    "default_method",
    "family_of",
    "get_family",
    "load_trained",
    "resolve_checkpoint",
    "shipped_checkpoint",
    "trained_families",
]
