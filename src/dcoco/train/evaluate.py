"""Held-out evaluation of a drafter: how much of the target's own answers it would have drafted.

- Random anchors (`random_anchors`): teacher-forced greedy drafts at 32 random response positions
  per sample, the loss and the family's own figures (`eval_tau`, `eval_per_position`, ...).
- As decoded at T=0 (`decoded`): drafts at every response position, walked block by block as
  greedy decoding takes them (each block opens where the last one ended): the τ `dcoco bench`
  measures on those prompts, up to bf16 rounding. Random anchors overstate it: a stretch the
  drafter predicts well counts once per anchor in it, but decoding crosses it in one block.
- At T=1 (`sampled`): per slot, the probability that sampled verification accepts the draft,
  sum_x min(p(x), q(x)) with p the target's distribution (from its last layer, stored or recomputed) and q the
  drafter's, teacher-forced on the data; τ = 1 + the expected accepted prefix over every
  response position. Meant for data the target sampled at T=1.

`dcoco eval CHECKPOINT --data DIR` runs all three on a checkpoint (`evaluate_checkpoint`); the
trainer runs the first two every `run.eval_every` steps."""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch

from ..bench.report import markdown_table
from ..errors import ConfigError
from .acceptance import decode_acceptance_per_slot, expected_acceptance
from .batch import held_out, loss_batch, truncate
from .features import FeatureSource


def _mean_rows(rows: list[dict]) -> dict:
    out = {}
    for key in rows[0]:
        vals = [r[key] for r in rows]
        if isinstance(vals[0], list):
            n = max(len(v) for v in vals)
            out[key] = [round(sum(v[k] for v in vals if len(v) > k) / len(vals), 4) for k in range(n)]
        else:
            out[key] = round(sum(vals) / len(vals), 4)
    return out


class Evaluator:
    """The held-out figures of a drafter loss (`dcoco.train.losses`) on regenerated samples."""

    def __init__(
        self,
        loss,
        features: FeatureSource,
        samples: Sequence[dict],
        max_length: int,
        autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
        progress: bool = False,
    ):
        self.loss, self.features = loss, features
        self.samples = [truncate(s, max_length) for s in samples]
        self.autocast, self.progress = autocast, progress

    @property
    def model(self) -> torch.nn.Module:
        return self.loss.model

    @property
    def draft_slots(self) -> int:
        """The drafter's default draft length: its speculative tokens, at most the drafts' width."""
        return self.model.cfg.num_speculative_tokens or self.model.max_draft

    def _bar(self, items, desc: str):
        from tqdm import tqdm

        return tqdm(items, desc=desc, unit="sample", file=sys.stderr, disable=not self.progress, leave=False)

    @torch.no_grad()
    def random_anchors(self, anchors: int = 32, batch: int = 4, seed: int = 1234) -> dict:
        """Loss and teacher-forced greedy figures over `anchors` random anchors per sample."""
        gen = torch.Generator().manual_seed(seed)
        rows = []
        for i in range(0, len(self.samples), batch):
            samples = self.samples[i : i + batch]
            b = loss_batch(self.loss, samples, self.features(samples), anchors, gen)
            with self.autocast():
                loss, extras = self.loss(b)
            rows.append({"eval_loss": loss.item(), **self.loss.eval_metrics(extras, b.labels)})
        return _mean_rows(rows) if rows else {}

    def _each_sample(self, chunk: int, desc: str):
        """Per sample, lazily, its blocks at every response anchor, `chunk` anchors at a time: (batch,
        the loss's extras). Consumed chunk by chunk, so only one chunk's logits are alive at a time."""
        for smp in self._bar(self.samples, desc):
            anchors = list(range(smp["prompt_len"], len(smp["input_ids"]) - 1))
            if not anchors:
                continue
            feats = self.features([smp])
            yield (self._run(smp, feats, anchors[i : i + chunk]) for i in range(0, len(anchors), chunk))

    def _run(self, smp: dict, feats, anchors: list[int]):
        b = self.loss.batch_at([smp], feats, [anchors])
        with self.autocast():
            _, extras = self.loss(b)
        return b, extras

    @torch.no_grad()
    def decoded(
        self,
        chunk: int = 64,
        k: Optional[int] = None,
        predictions: Optional[Callable[[dict], dict]] = None,
        lengths: Sequence[int] = (),
    ) -> dict:
        """τ and per-slot acceptance as greedy decoding realizes them, per suffix of the loss's
        `predictions` ("" = the method's own drafts), with the drafter's default draft length `k`;
        `lengths`: also at each of these draft lengths, from the same drafts (`decode_lengths`, keyed
        by length), which is what choosing a draft length needs. `predictions` replaces the loss's
        (extras -> {suffix: drafts (S, A, P)}): an ablation's drafts."""
        predictions = predictions or self.loss.predictions
        k = self.draft_slots if k is None else k
        ks = sorted({k, *lengths})
        totals: dict[tuple[int, str], list] = {}
        for parts in self._each_sample(chunk, "eval T=0"):
            preds: dict[str, list[torch.Tensor]] = {}
            labels = []
            for b, extras in parts:
                for key, p in predictions(extras).items():
                    preds.setdefault(key, []).append(p[0])
                labels.append(b.labels[0])
            labels = torch.cat(labels)
            for key, p in preds.items():
                p = torch.cat(p)
                for n in ks:
                    kk = min(n, labels.shape[-1])
                    passes, per_slot = decode_acceptance_per_slot(p, labels, kk)
                    t = totals.setdefault((n, key), [0, [0] * kk])
                    t[0] += passes
                    t[1] = [a + c for a, c in zip(t[1], per_slot)]
        by_length: dict[int, dict] = {}
        for (n, key), (passes, per_slot) in totals.items():
            figures = by_length.setdefault(n, {})
            figures[f"eval_tau_decode{key}"] = round(1 + sum(per_slot) / max(1, passes), 4)
            if key == "":
                figures["eval_per_position_decode"] = [round(c / max(1, passes), 4) for c in per_slot]
        out = dict(by_length.get(k, {}))
        if lengths:
            out["decode_lengths"] = {str(n): by_length.get(n, {}) for n in ks}
        return out

    @torch.no_grad()
    def sampled(self, chunk: int = 16) -> dict:
        """Expected τ and per-slot acceptance at T=1 over every response position."""
        alphas, valids = [], []
        for parts in self._each_sample(chunk, "eval T=1"):
            for b, extras in parts:
                with self.autocast():  # EAGLE-3 runs its draft head here, as in its loss
                    a, v = self.loss.slot_acceptance(b, extras)
                alphas.append(a.reshape(-1, a.shape[-1]).float().cpu())
                valids.append(v.reshape(-1, v.shape[-1]).cpu())
        if not alphas:
            return {}
        tau, per_slot = expected_acceptance(torch.cat(alphas), torch.cat(valids))
        return {"eval_tau_t1": round(tau, 4), "eval_per_position_t1": [round(x, 4) for x in per_slot]}


def heldout_samples(data, split: str, permille: int, limit: Optional[int]) -> list[dict]:
    """The samples to evaluate: the hash hold-out that training leaves out (`heldout`) or every
    sample (`all`, for a directory of prompts never trained on); those with at least 2 response
    tokens, at most `limit` of them."""
    samples = [s for s in data.samples() if len(s["input_ids"]) - s["prompt_len"] >= 2]
    if split == "heldout":
        samples = held_out(samples, permille)
    return samples[:limit] if limit else samples


def evaluate_checkpoint(
    checkpoint: str,
    data_paths: Sequence[str],
    split: str = "heldout",
    temperatures: Sequence[float] = (0.0, 1.0),
    draft_lengths: Sequence[int] = (),
    **options,
) -> dict:
    """Held-out τ of a drafter checkpoint of any family: random anchors and as decoded at T=0 (also
    at each of `draft_lengths`), and the expected τ at T=1, with per-slot acceptance. `options`:
    those of `checkpoint_evaluator`."""
    if not set(temperatures) <= {0.0, 1.0}:
        raise ConfigError(f"--temperatures: dcoco eval measures T=0 and T=1, got {list(temperatures)}")
    ev, name = checkpoint_evaluator(checkpoint, data_paths, split, sampled=1.0 in temperatures, **options)
    if any(n < 1 or n > ev.model.max_draft for n in draft_lengths):
        raise ConfigError(
            f"--draft-lengths: {name} drafts 1 to {ev.model.max_draft} tokens per pass, got {list(draft_lengths)}"
        )
    out: dict = {"checkpoint": str(checkpoint), "method": name, "samples": len(ev.samples), "split": split}
    with torch.device(ev.features.target.device):
        if 0.0 in temperatures:
            out["t0"] = {**ev.random_anchors(), **ev.decoded(lengths=draft_lengths)}
        if 1.0 in temperatures:
            out["t1"] = ev.sampled()
    return out


def checkpoint_evaluator(
    checkpoint: str,
    data_paths: Sequence[str],
    split: str = "heldout",
    sampled: bool = True,
    num_samples: Optional[int] = 48,
    max_length: int = 1024,
    eval_permille: int = 20,
    model: Optional[str] = None,
    dtype: str = "float32",
    device: str = "cpu",
    progress: bool = True,
) -> tuple[Evaluator, str]:
    """An `Evaluator` of a drafter checkpoint of any family on the held-out samples of `data_paths`
    (`sampled`: with the target's last layer, for T=1), and the family's name."""
    from ..families import LossParts, load_trained
    from ..target import Target
    from .config import DrafterSection
    from .data import RegeneratedUnion

    if split not in ("heldout", "all"):
        raise ConfigError(f"--split must be heldout or all, got {split!r}")
    family, drafter, raw = load_trained(checkpoint)
    data = RegeneratedUnion(list(data_paths))
    _ = data.manifest  # a missing or mismatched directory fails before the target loads
    target = Target.from_pretrained(model, dtype=dtype, device=device)
    drafter = drafter.to(target.device).eval()
    d = family.settings_from_checkpoint(raw, DrafterSection())
    last = sampled or family.reads_last_layer(d)
    features = FeatureSource(target, data, drafter.cfg.taps, last, online=not data.has_features)
    for p in target.model.parameters():
        p.requires_grad_(False)
    head = None
    if last:
        from .losses import TargetHead

        head = TargetHead(target)
    parts = LossParts(
        target.model.get_input_embeddings(), target.model.get_output_embeddings(), head, features.split, 7.0
    )
    with torch.device(target.device):
        loss = family.build_loss(drafter, parts, d)
    samples = heldout_samples(data, split, eval_permille, num_samples)
    if not samples:
        raise ConfigError(f"no {split} samples with a response in {', '.join(map(str, data_paths))}")
    bf16 = target.dtype == torch.bfloat16

    def autocast():
        return torch.autocast(target.device.type, dtype=torch.bfloat16, enabled=bf16)

    return Evaluator(loss, features, samples, max_length, autocast, progress=progress), family.name


def eval_markdown(result: dict) -> str:
    """A short table of `evaluate_checkpoint`'s result."""
    L = [
        f"# τ of `{result['checkpoint']}` ({result['method']})",
        "",
        f"{result['samples']} samples ({'the hold-out' if result['split'] == 'heldout' else 'all'} of the data).",
        "",
        "| T | τ | per-slot acceptance |",
        "|---|---:|---|",
    ]
    t0, t1 = result.get("t0"), result.get("t1")
    if t0:
        pp = " ".join(f"{x:.2f}" for x in t0.get("eval_per_position_decode", []))
        L.append(f"| 0, as decoded | {t0['eval_tau_decode']:.3f} | {pp} |")
        pp = " ".join(f"{x:.2f}" for x in t0.get("eval_per_position", []))
        L.append(f"| 0, random anchors | {t0['eval_tau']:.3f} | {pp} |")
    if t1:
        pp = " ".join(f"{x:.2f}" for x in t1.get("eval_per_position_t1", []))
        L.append(f"| 1, expected | {t1['eval_tau_t1']:.3f} | {pp} |")
    extra = {k: v for k, v in (t0 or {}).items() if k.startswith("eval_tau_") and k != "eval_tau_decode"}
    if extra:
        L += ["", "Other figures: " + ", ".join(f"`{k}` {v}" for k, v in extra.items() if not isinstance(v, list))]
    lengths = (t0 or {}).get("decode_lengths")
    if lengths:
        others = sorted({k for r in lengths.values() for k in r if k.startswith("eval_tau_decode_")})
        body = [
            [n, f"{r['eval_tau_decode']:.3f}", *(f"{r[k]:.3f}" for k in others)]
            + [" ".join(f"{x:.2f}" for x in r.get("eval_per_position_decode", []))]
            for n, r in lengths.items()
        ]
        head = ["draft length", "τ", *(f"`{k}`" for k in others), "per-slot acceptance"]
        L += ["", "T=0 as decoded, by draft length (tokens drafted per pass):", ""]
        L += markdown_table(head, body)[:-1]
    return "\n".join(L) + "\n"


def write_eval(result: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "eval.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / "eval.md").write_text(eval_markdown(result))
