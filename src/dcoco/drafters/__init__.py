"""Drafter families and the registry that builds one from a `speculative_config`."""

from __future__ import annotations

import re
import warnings
from pathlib import Path
from typing import Literal, Optional

import torch
from pydantic import BaseModel, ConfigDict, ValidationError, field_validator

from ..errors import ConfigError, ModelNotFoundError, UnknownMethodError
from .base import Drafter, DraftInput, DraftOutput
from .ngram import NgramDrafter

#: every method name dcoco knows, in the order a user would reach for them
METHODS = ("vanilla", "ngram", "eagle3", "dflash", "dspark", "dcoco")


class SpeculativeConfig(BaseModel):
    """Mirrors vLLM's `speculative_config`: `method`, `model` (drafter checkpoint directory; None uses
    the checkpoint shipped for the embedded target), `num_speculative_tokens` (None: the drafter's
    default), and the n-gram window `prompt_lookup_max` / `prompt_lookup_min`."""

    model_config = ConfigDict(extra="forbid")

    method: str = "vanilla"
    model: Optional[str] = None
    num_speculative_tokens: Optional[int] = None
    prompt_lookup_max: int = 3
    prompt_lookup_min: int = 1
    # DCOCO inference options (ablations; None keeps the checkpoint's setting)
    dcoco_top_k: Optional[int] = None  # shortlist size K
    # T > 0: one-hot corrected draft (a), sampled walk over the shortlist (b), or over the draft vocabulary (extension)
    dcoco_walk: Optional[Literal["onehot", "sampled", "vocab"]] = None
    dcoco_correct: bool = True  # False: draft with the DCOCO checkpoint's backbone alone, as plain DFlash

    @field_validator("method")
    @classmethod
    def _method(cls, v: str) -> str:
        if v not in METHODS:
            raise UnknownMethodError(f"unknown method {v!r}; choose one of {', '.join(METHODS)}")
        return v

    @field_validator("num_speculative_tokens")
    @classmethod
    def _k(cls, v: Optional[int]) -> Optional[int]:
        if v is not None and not 0 <= v <= 64:
            raise ValueError(f"num_speculative_tokens must be in [0, 64], got {v}")
        return v

    @field_validator("dcoco_top_k")
    @classmethod
    def _top_k(cls, v: Optional[int]) -> Optional[int]:
        if v is not None and not 1 <= v <= 256:
            raise ValueError(f"dcoco_top_k must be in [1, 256], got {v}")
        return v

    @classmethod
    def parse(cls, cfg: "SpeculativeConfig | dict | None") -> "SpeculativeConfig":
        if cfg is None:
            return cls()
        if isinstance(cfg, SpeculativeConfig):
            return cfg
        if isinstance(cfg, dict) and cfg.get("method") is not None and cfg["method"] not in METHODS:
            raise UnknownMethodError(f"unknown method {cfg['method']!r}; choose one of {', '.join(METHODS)}")
        try:
            return cls(**cfg)
        except ValidationError as e:
            err = e.errors()[0]
            loc = ".".join(str(x) for x in err["loc"]) or "speculative_config"
            raise ConfigError(f"invalid speculative_config.{loc}: {err['msg']}") from None


#: checkpoints shipped for the embedded target, one directory per method
SHIPPED_DIR = Path(__file__).resolve().parent.parent / "checkpoints" / "smollm2-135m-instruct"


def shipped_checkpoint(method: str) -> Optional[Path]:
    p = SHIPPED_DIR / method
    return p if (p / "config.json").exists() and (p / "model.safetensors").exists() else None


def resolve_checkpoint(method: str, path: Optional[str]) -> Path:
    """`path`, or the checkpoint shipped for the embedded target, or a clear error."""
    ckpt = path or shipped_checkpoint(method)
    if ckpt is None:
        raise ModelNotFoundError(f"no {method} checkpoint is shipped in this build; pass one with --drafter PATH")
    return Path(ckpt)


def _load_block_drafter(method: str):
    def load(path: Optional[str], target) -> Drafter:
        from .dcoco import DCOCODrafter, DCOCOModel
        from .dflash import BlockDrafter, load_dflash

        ckpt = resolve_checkpoint(method, path)
        model, _ = load_dflash(ckpt, dtype=target.dtype)
        model = model.to(target.device)
        if method == "dcoco":
            if not isinstance(model, DCOCOModel):
                raise ModelNotFoundError(
                    f"{ckpt} is a plain DFlash checkpoint; dcoco needs one trained with method: dcoco"
                )
            return DCOCODrafter(model, target)
        return BlockDrafter(model, target)  # a DCOCO checkpoint runs as DFlash without correction

    return load


def _load_dspark(path: Optional[str], target) -> Drafter:
    from .dspark import load_dspark_drafter

    return load_dspark_drafter(path, target)


def _load_eagle3(path: Optional[str], target) -> Drafter:
    from .eagle3 import load_eagle3_drafter

    return load_eagle3_drafter(path, target)


# trained drafter families: method -> loader(path | None, target) -> Drafter
_TRAINED: dict = {
    "dflash": _load_block_drafter("dflash"),
    "dcoco": _load_block_drafter("dcoco"),
    "dspark": _load_dspark,
    "eagle3": _load_eagle3,
}


def split_label(label: str) -> tuple[str, str]:
    """`METHOD/TAG` -> (METHOD, TAG): a labelled variant of a method (bench ablations); TAG may be ''."""
    base, _, tag = label.partition("/")
    return base, tag


def variant_options(label: str) -> dict:
    """SpeculativeConfig options a variant label stands for. DCOCO tags: `kN` (shortlist of N),
    `nocorrect` (its backbone alone), `onehot` / `sampled` / `vocab` (the T > 0 draft variant). Any other tag
    only names a checkpoint given explicitly (e.g. `dcoco/noemb=runs/dcoco-noemb/drafter`)."""
    base, tag = split_label(label)
    if base != "dcoco" or not tag:
        return {}
    if tag == "nocorrect":
        return {"dcoco_correct": False}
    if tag in ("onehot", "sampled", "vocab"):
        return {"dcoco_walk": tag}
    m = re.fullmatch(r"k(\d+)", tag)
    return {"dcoco_top_k": int(m[1])} if m else {}


def available_methods() -> list[str]:
    """Methods that run out of the box on the embedded target (trained ones need a shipped checkpoint)."""
    return [m for m in METHODS if m in ("vanilla", "ngram") or (m in _TRAINED and shipped_checkpoint(m))]


def slow_bf16_verification(target) -> bool:
    """Whether the target runs bf16 on a CPU without bf16 matrix instructions (AVX-512 BF16 or AMX).
    There a pass over n new tokens costs about n decode steps (README: "On a CPU without bf16 matrix
    units"), so verifying a drafted block rarely pays off."""
    if target.device.type != "cpu" or target.dtype != torch.bfloat16:
        return False
    return not (torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


def load_drafter(cfg: SpeculativeConfig, target) -> Optional[Drafter]:
    """Build the drafter a config names (None for vanilla)."""
    if cfg.method == "vanilla":
        return None
    if slow_bf16_verification(target):
        warnings.warn(
            f"this CPU has no bf16 matrix instructions (AVX-512 BF16 or AMX): verifying a block of n tokens "
            f"costs about n decode steps, so {cfg.method} is likely slower than vanilla here",
            stacklevel=2,
        )
    if cfg.method == "ngram":
        try:
            return NgramDrafter(cfg.prompt_lookup_max, cfg.prompt_lookup_min)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    if cfg.method not in _TRAINED:
        raise UnknownMethodError(
            f"method {cfg.method!r} is not implemented yet; available: {', '.join(available_methods())}"
        )
    dcoco_opts = cfg.dcoco_top_k is not None or cfg.dcoco_walk is not None or not cfg.dcoco_correct
    if dcoco_opts and cfg.method != "dcoco":
        raise ConfigError(f"dcoco_* options apply to method dcoco, not {cfg.method}")
    drafter = _TRAINED[cfg.method](cfg.model, target)
    drafter.check_target(target)
    if cfg.method == "dcoco":
        drafter.configure(correct=cfg.dcoco_correct, top_k=cfg.dcoco_top_k, walk=cfg.dcoco_walk)
    return drafter


__all__ = [
    "METHODS",
    "Drafter",
    "DraftInput",
    "DraftOutput",
    "NgramDrafter",
    "SpeculativeConfig",
    "available_methods",
    "load_drafter",
]
