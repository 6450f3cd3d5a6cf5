"""Regenerated token data packed compactly, to be committed and shared: `dcoco data pack`.

A regenerated-data directory (`dcoco.train.data`) is a working format: JSON lines with the text, and
optionally ~7 KB of target features per token. What training needs from it for online features is
the token ids, the prompt length and the sample id, which pack into 2 bytes per token (the vocabulary
fits uint16). A packed directory holds:

  manifest.json              the regeneration's settings and command (so `dcoco data regenerate`
                             rebuilds the same samples), the target, counts and each chunk's sha256
  chunk-NNNNN.safetensors    input_ids (uint16, samples concatenated), offsets (int64, n + 1),
                             prompt_lens (int32), stopped (uint8: 1 = the answer ended with EOS);
                             sample ids in the file's metadata

Packing again appends the samples not yet packed as a new chunk, so committed chunks never change.
Training reads a packed directory wherever it reads regenerated data (`data.path`), with
`data.features: online`.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Sequence

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ..errors import ConfigError

FORMAT = "dcoco-packed-tokens/1"
#: settings a chunk must share with the chunks already packed (one sampling setup per directory)
SAME_SETTINGS = (
    "target_vocab_size",
    "target_hidden_size",
    "target_num_layers",
    "taps",
    "tap_convention",
    "temperature",
    "top_p",
    "max_new_tokens",
    "max_prompt_tokens",
    "dtype",
)


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def read_manifest(path: Path) -> dict:
    """A data directory's manifest.json, or one line saying what is wrong with it."""
    try:
        manifest = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: invalid JSON ({e})") from None
    if not isinstance(manifest, dict):
        raise ConfigError(f"{path}: not a data manifest (a JSON object)")
    return manifest


def is_packed(root: str | Path) -> bool:
    p = Path(root) / "manifest.json"
    return p.exists() and read_manifest(p).get("format") == FORMAT


class PackedData:
    """Reader of a packed directory, with `RegeneratedData`'s interface (tokens only, no features)."""

    def __init__(self, root: str | Path):
        self.root = Path(root)
        self.manifest_path = self.root / "manifest.json"

    @property
    def manifest(self) -> dict:
        if not self.manifest_path.exists():
            raise ConfigError(f"not a packed data directory (no manifest.json): {self.root}")
        return read_manifest(self.manifest_path)

    has_features = False

    def samples(self) -> list[dict]:
        out = []
        for chunk in self.manifest["chunks"]:
            path = self.root / chunk["file"]
            if not path.exists():
                raise ConfigError(f"{path} is missing (listed in {self.manifest_path})")
            with safe_open(str(path), "pt") as f:
                ids = json.loads(f.metadata()["ids"])
                tokens = f.get_tensor("input_ids").to(torch.int64).tolist()
                offsets = f.get_tensor("offsets").tolist()
                prompt_lens = f.get_tensor("prompt_lens").tolist()
                stopped = f.get_tensor("stopped").tolist()
            for i, sid in enumerate(ids):
                out.append(
                    {
                        "id": sid,
                        "input_ids": tokens[offsets[i] : offsets[i + 1]],
                        "prompt_len": prompt_lens[i],
                        "finish_reason": "stop" if stopped[i] else "length",
                    }
                )
        return out

    def features(self, sample: dict) -> torch.Tensor:
        raise ConfigError(f"{self.root} holds token ids only: train with data.features=online")

    def verify(self) -> None:
        """Every chunk is present and matches its recorded sha256."""
        for chunk in self.manifest["chunks"]:
            path = self.root / chunk["file"]
            if not path.exists() or sha256(path) != chunk["sha256"]:
                raise ConfigError(f"{path} is missing or does not match its sha256 in the manifest")


def pack(parts: Sequence, out: str | Path) -> dict:
    """Append the samples of the regenerated directories `parts` (`dcoco.train.data.RegeneratedData`)
    that `out` does not hold yet as one new chunk; returns the manifest. All sources and chunks must
    share `SAME_SETTINGS`."""
    out = Path(out)
    for p in parts:
        if is_packed(p.root):
            raise ConfigError(f"{p.root} is packed already: pack the regenerated directories it came from")
    if not parts:
        raise ConfigError("pack needs at least one regenerated data directory")
    first = parts[0].manifest
    for p in parts[1:]:
        diff = [k for k in SAME_SETTINGS if p.manifest.get(k) != first.get(k)]
        if diff:
            raise ConfigError(f"{p.root} and {parts[0].root} differ in {diff}: pack them into separate directories")
    packed = PackedData(out)
    if packed.manifest_path.exists():
        if not is_packed(out):
            raise ConfigError(f"{out} holds data that is not packed: pack into a new directory")
        manifest = packed.manifest
        diff = [k for k in SAME_SETTINGS if manifest.get(k) != first.get(k)]
        if diff:
            raise ConfigError(f"{out} was packed from data with other settings {diff}")
        have = {s["id"] for s in packed.samples()}
    else:
        manifest = {"format": FORMAT, **{k: first.get(k) for k in SAME_SETTINGS}, "features": False}
        manifest.update(sources=[], chunks=[])
        have = set()
    rows = []
    for p in parts:
        for s in p.samples():
            if s["id"] not in have:
                have.add(s["id"])
                rows.append(s)
    if not rows:
        return manifest
    vocab = int(first["target_vocab_size"])
    if vocab > 1 << 16:
        raise ConfigError(f"a vocabulary of {vocab} tokens does not fit uint16")
    out.mkdir(parents=True, exist_ok=True)
    lengths = [len(s["input_ids"]) for s in rows]
    offsets = torch.tensor([0] + lengths, dtype=torch.int64).cumsum(0)
    tensors = {
        "input_ids": torch.tensor([t for s in rows for t in s["input_ids"]], dtype=torch.int32).to(torch.uint16),
        "offsets": offsets,
        "prompt_lens": torch.tensor([s["prompt_len"] for s in rows], dtype=torch.int32),
        "stopped": torch.tensor([s.get("finish_reason") == "stop" for s in rows], dtype=torch.uint8),
    }
    name = f"chunk-{len(manifest['chunks']):05d}.safetensors"
    tmp = out / f".tmp-{name}"
    save_file(tensors, str(tmp), metadata={"ids": json.dumps([s["id"] for s in rows])})
    os.replace(tmp, out / name)
    prompt_tokens = sum(s["prompt_len"] for s in rows)
    manifest["chunks"].append(
        {
            "file": name,
            "samples": len(rows),
            "prompt_tokens": prompt_tokens,
            "response_tokens": sum(lengths) - prompt_tokens,
            "stopped": int(tensors["stopped"].sum()),
            "sha256": sha256(out / name),
        }
    )
    for p in parts:
        src = {k: p.manifest.get(k) for k in ("source", "command")}
        if src not in manifest["sources"]:
            manifest["sources"].append(src)
    manifest["totals"] = {
        k: sum(c[k] for c in manifest["chunks"]) for k in ("samples", "prompt_tokens", "response_tokens", "stopped")
    }
    tmp = out / ".tmp-manifest.json"
    tmp.write_text(json.dumps(manifest, indent=2) + "\n")
    os.replace(tmp, packed.manifest_path)
    return manifest
