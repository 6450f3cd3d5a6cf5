"""Drafter checkpoints: HF-style directories (`config.json` + `model.safetensors`), written to a
temporary directory and renamed into place so a killed writer never leaves a torn checkpoint."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ..errors import ModelNotFoundError


def save_checkpoint(
    path: str | Path, config: dict, state: dict[str, torch.Tensor], dtype: torch.dtype | None = None
) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    try:
        tensors = {
            k: (v.detach().to(dtype) if dtype is not None and v.is_floating_point() else v.detach()).contiguous().cpu()
            for k, v in state.items()
        }
        save_file(tensors, str(tmp / "model.safetensors"))
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        os.chmod(tmp, 0o755)
        if path.exists():
            old = path.with_name(f".{path.name}.old-{os.getpid()}")
            os.rename(path, old)
            os.rename(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def load_checkpoint(path: str | Path) -> tuple[dict, dict[str, torch.Tensor]]:
    path = Path(path)
    cfg, weights = path / "config.json", path / "model.safetensors"
    if not cfg.exists() or not weights.exists():
        raise ModelNotFoundError(f"drafter checkpoint not found (need config.json and model.safetensors): {path}")
    try:
        config = json.loads(cfg.read_text())
    except json.JSONDecodeError as e:
        raise ModelNotFoundError(f"{cfg}: invalid JSON ({e.msg})") from None
    if not isinstance(config, dict):
        raise ModelNotFoundError(f"{cfg}: not a model config (a JSON object)")
    try:
        return config, load_file(str(weights))
    except Exception as e:  # safetensors' own error type (a torn or foreign file) is not an OSError
        raise ModelNotFoundError(f"{weights}: not a readable safetensors file ({str(e).splitlines()[0]})") from None


def load_weights(model: torch.nn.Module, state: dict[str, torch.Tensor], path) -> None:
    """Load `state` into `model`, or fail with a clear error if the two do not match exactly."""
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ModelNotFoundError(
            f"{path}: weights do not match the config (missing {missing[:3]}, unexpected {unexpected[:3]})"
        )
