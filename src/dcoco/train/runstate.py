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


def read_log(path: Path) -> list[dict]:
    """The rows of a JSONL log; none if it does not exist."""
    if not Path(path).exists():
        return []
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def write_log(path: Path, rows: list[dict]) -> None:
    """Replace a JSONL log atomically (a temporary file and a rename)."""
    tmp = Path(str(path) + ".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    os.replace(tmp, path)


def append_log(path: Path, row: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")


def truncate_log(path: Path, step: int) -> None:
    """Drop the lines logged after `step` (a run killed between two checkpoints)."""
    if Path(path).exists():
        write_log(path, [r for r in read_log(path) if r["step"] <= step])
