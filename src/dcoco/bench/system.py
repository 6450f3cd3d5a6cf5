"""What a benchmark records about where it ran: the machine, the device, torch threads, the git commit."""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path
from typing import Optional


def cpu_model() -> str:
    """The CPU model name from /proc/cpuinfo (Linux), else platform's best guess."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def device_label(device: str) -> str:
    """``"cpu: <CPU model>"`` or ``"cuda:0: <GPU name>"``: the device plus what it is."""
    import torch

    if device.startswith("cuda") and torch.cuda.is_available():
        idx = torch.device(device).index or 0
        return f"{device}: {torch.cuda.get_device_name(idx)}"
    return f"{device}: {cpu_model()}"


def shown_path(path) -> str:
    """`path` resolved, and relative to the working directory when inside it, so that run.json and the
    reports name no machine's directories (the run itself works from either form)."""
    p = Path(path).expanduser().resolve()
    try:
        return str(p.relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(p)


def git_commit(path: Optional[Path] = None) -> str:
    """Short commit of the dcoco checkout (``+dirty`` when tracked files differ), or ``"unknown"``.
    Read-only: uses ``--no-optional-locks`` so git never rewrites the index."""
    root = Path(path) if path is not None else Path(__file__).resolve().parents[3]
    try:
        commit = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True, timeout=10
        )
        if commit.returncode != 0:
            return "unknown"
        dirty = subprocess.run(
            ["git", "--no-optional-locks", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=20,
        )
        return commit.stdout.strip() + ("+dirty" if dirty.returncode == 0 and dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def machine_info(device: str, dtype: str = "bfloat16") -> dict:
    import torch
    import transformers

    from ..nn.prepack import prepack_enabled

    return {
        "cpu": cpu_model(),
        "prepacked_weights": device == "cpu" and prepack_enabled(getattr(torch, dtype, None)),  # dcoco.nn.prepack
        "cpu_count": os.cpu_count(),
        "device": device_label(device),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
    }
