"""`speculative_config`: which drafter an engine runs and how, resolved through the family registry."""

from __future__ import annotations

import argparse
import re
import warnings
from typing import Literal, Optional

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from .drafters.base import Drafter
from .drafters.lookup_first import LookupFirst
from .errors import ConfigError, UnknownMethodError
from .families import FAMILIES, METHODS, get_family, load_drafter_model, shipped_checkpoint
from .target import cpu_bf16_matrix_units


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
    # trained drafters: where the sequence's last N+ tokens occurred earlier in it, draft what followed
    # them (prompt lookup) instead of running the model for that request (None: the model always drafts)
    lookup_first: Optional[int] = Field(None, ge=1, le=16)
    # tokens a lookup draft proposes (None: 6, or the trained drafter's block if longer)
    lookup_num_tokens: Optional[int] = Field(None, ge=1, le=64)
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

    @model_validator(mode="after")
    def _lookup(self) -> "SpeculativeConfig":
        if self.lookup_num_tokens is not None and self.lookup_first is None:
            raise ValueError("lookup_num_tokens is the length of prompt lookup first's drafts: set lookup_first too")
        return self

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
            where = "".join(f".{x}" for x in err["loc"])
            msg = err["msg"].removeprefix("Value error, ")
            raise ConfigError(f"invalid speculative_config{where}: {msg}") from None

    def foreign_options(self) -> dict[str, str]:
        """Options set here that belong to another family than `method`: {option: its family}."""
        return {
            f: name
            for name, fam in FAMILIES.items()
            if name != self.method
            for f in fam.spec_options
            if getattr(self, f) != type(self).model_fields[f].default
        }


def add_spec_args(p: argparse.ArgumentParser, default_method: str) -> None:
    """The drafting flags of `generate`, `demo`, `serve` and the load generator; `config_of_args` reads them."""
    p.add_argument("--method", default=default_method, help=f"one of: {', '.join(METHODS)}")
    p.add_argument("--drafter", default=None, help="drafter checkpoint directory (default: the shipped one)")
    p.add_argument("--num-speculative-tokens", type=int, default=None, help="draft tokens per pass")
    p.add_argument(
        "--lookup-first",
        type=int,
        default=None,
        metavar="N",
        help="trained drafters: where the last N+ tokens occurred earlier, draft by prompt lookup instead",
    )
    p.add_argument(
        "--lookup-tokens",
        type=int,
        default=None,
        metavar="M",
        help="with --lookup-first: tokens a lookup draft proposes (default: 6, or the drafter's block if longer)",
    )


def config_of_args(args) -> dict:
    """The speculative_config the flags of `add_spec_args` name."""
    return {
        "method": args.method,
        "model": args.drafter,
        "num_speculative_tokens": args.num_speculative_tokens,
        "lookup_first": args.lookup_first,
        "lookup_num_tokens": args.lookup_tokens,
    }


def split_label(label: str) -> tuple[str, str]:
    """`METHOD/TAG` -> (METHOD, TAG): a labelled variant of a method (bench ablations); TAG may be ''."""
    base, _, tag = label.partition("/")
    return base, tag


def variant_options(label: str) -> dict:
    """SpeculativeConfig options a variant label stands for: `draftN` (`num_speculative_tokens=N`,
    a draft length beside the drafter's default in one run), `lookupN` (`lookup_first=N`) and
    `lookupNkM` (and `lookup_num_tokens=M`) for any trained family, else its family's
    `variant_options`. Any other tag only names a checkpoint given explicitly (e.g.
    `dcoco/noemb=runs/dcoco-noemb/drafter`)."""
    base, tag = split_label(label)
    if base not in FAMILIES or not tag:
        return {}
    m = re.fullmatch(r"draft(\d+)", tag)
    if m and FAMILIES[base].trained:
        return {"num_speculative_tokens": int(m[1])}
    m = re.fullmatch(r"lookup(\d+)(?:k(\d+))?", tag)
    if m and FAMILIES[base].trained:
        return {"lookup_first": int(m[1])} | ({"lookup_num_tokens": int(m[2])} if m[2] else {})
    return FAMILIES[base].variant_options(tag)


def available_methods() -> list[str]:
    """Methods that run out of the box on the embedded target (trained ones need a shipped checkpoint)."""
    return [m for m in METHODS if m not in FAMILIES or not FAMILIES[m].trained or shipped_checkpoint(m)]


def slow_bf16_verification(target) -> bool:
    """Whether the target runs bf16 on a CPU without bf16 matrix instructions (AVX-512 BF16 or AMX).
    There a pass over n new tokens costs about n decode steps (README: "On a CPU without bf16 matrix
    units"), so verifying a drafted block rarely pays off."""
    if target.device.type != "cpu" or target.dtype != torch.bfloat16:
        return False
    return not cpu_bf16_matrix_units()


def load_drafter(cfg: SpeculativeConfig, target) -> Optional[Drafter]:
    """Build the drafter a config names (None for vanilla)."""
    if cfg.method == "vanilla":
        return None
    if slow_bf16_verification(target):
        warnings.warn(
            f"this CPU has no bf16 matrix instructions (AVX-512 BF16 or AMX): verifying a block of n tokens "
            f"costs about n decode steps, so {cfg.method} is likely slower than vanilla here; in float32 "
            f"(--dtype float32) a 5-token block cost 1.2 decode steps on a 2-core AVX2 CPU",
            stacklevel=2,
        )
    foreign = cfg.foreign_options()
    if foreign:
        owner = next(iter(foreign.values()))
        raise ConfigError(f"option(s) {', '.join(foreign)} apply to method {owner}, not {cfg.method}")
    family = get_family(cfg.method)
    if not family.trained:
        if cfg.lookup_first is not None:
            raise ConfigError(f"lookup_first puts prompt lookup before a trained drafter, not before {cfg.method}")
        return family.make_drafter(cfg, target)
    model = load_drafter_model(cfg.method, cfg.model, dtype=target.dtype).to(target.device)
    drafter = family.drafter(model, target)
    drafter.check_target(target)
    family.configure(drafter, cfg)
    return drafter if cfg.lookup_first is None else LookupFirst(drafter, cfg.lookup_first, cfg.lookup_num_tokens)


__all__ = [
    "METHODS",
    "SpeculativeConfig",
    "add_spec_args",
    "available_methods",
    "config_of_args",
    "load_drafter",
    "slow_bf16_verification",
    "split_label",
    "variant_options",
]
