"""Run-directory persistence shared by `dcoco train` and `dcoco rl`: `state.pt` replaced atomically,
and a JSONL log that a resume cuts back to the checkpoint's step (so no step is logged twice)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch


def save_state(out: Path, state: dict) -> None:
    """Write `out/state.pt` through a temporary file and a rename: a kill never leaves it torn."""
    tmp = Path(out) / "state.pt.tmp"
    torch.save(state, tmp)
    os.replace(tmp, Path(out) / "state.pt")


def append_log(path: Path, row: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")


def truncate_log(path: Path, step: int) -> None:
    """Drop the lines logged after `step` (a run killed between two checkpoints)."""
    if Path(path).exists():
        rows = [l for l in Path(path).read_text().splitlines() if l.strip() and json.loads(l)["step"] <= step]
        Path(path).write_text("".join(l + "\n" for l in rows))
