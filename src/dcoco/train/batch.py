"""Batches of drafter training: the held-out split of regenerated samples, anchors, DFlash blocks
and the draft vocabulary's token counts. Every family's loss reads a `Batch` (EAGLE-3 its own
layout, built by its loss's `make_batch`)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Iterable

import torch


def is_eval_sample(sample_id: str, permille: int = 20) -> bool:
    """Fixed hold-out of regenerated samples for training-time evaluation (by a hash of the id, so
    it does not move as the data grows)."""
    return int(hashlib.sha1(f"{sample_id}:heldout".encode()).hexdigest(), 16) % 1000 < permille


def held_out(samples: Iterable[dict], permille: int, held: bool = True) -> list[dict]:
    """The samples the hash holds out for evaluation, or (held=False) the ones training may use."""
    return [s for s in samples if is_eval_sample(s["id"], permille) == held]


def truncate(sample: dict, max_length: int) -> dict:
    """The sample cut to `max_length` tokens (prompt + response)."""
    if len(sample["input_ids"]) <= max_length:
        return sample
    return dict(sample, input_ids=sample["input_ids"][:max_length])


def token_counts(samples: Iterable[dict], vocab_size: int, max_length: int) -> torch.Tensor:
    """Counts (V,) of response tokens over `samples`."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for s in samples:
        ids = s["input_ids"][s["prompt_len"] : max_length]
        if ids:
            counts += torch.bincount(torch.tensor(ids), minlength=counts.numel())
    return counts


def pair_counts(samples: Iterable[dict], vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The distinct neighbouring pairs (a, b) of the answers in `samples` (from the prompt's last
    token on, which an answer's first block is drafted after) as keys a * V + b, and their counts."""
    keys = [torch.tensor(s["input_ids"][s["prompt_len"] - 1 :], dtype=torch.long) for s in samples]
    keys = torch.cat([k[:-1] * vocab_size + k[1:] for k in keys] or [torch.zeros(0, dtype=torch.long)])
    return torch.unique(keys, return_counts=True)


def top_tokens(counts: torch.Tensor, n: int) -> torch.Tensor:
    """The n most frequent token ids (ties by lower id), sorted by id."""
    order = torch.sort(-counts, stable=True).indices
    return order[:n].sort().values


def position_weights(block_size: int, gamma: float) -> torch.Tensor:
    """w_k = exp(-(k-1)/gamma) for slots k = 1..B-1 (slot 0 is the anchor and has no loss)."""
    k = torch.arange(1, block_size, dtype=torch.float32)
    return torch.exp(-(k - 1) / gamma)


@dataclass
class Batch:
    ids: torch.Tensor  # (S, T) token ids, padded
    feats: torch.Tensor  # (S, T, F) target features (position t holds token t's features)
    anchors: torch.Tensor  # (S, A) anchor positions, -1 = padding block
    labels: torch.Tensor  # (S, A, B-1) token at anchor + k, -100 where not an assistant token


def sample_anchors(prompt_len: int, length: int, n: int, gen: torch.Generator) -> list[int]:
    """Up to n distinct anchors in [prompt_len, length - 2] (each needs a label after it)."""
    lo, hi = prompt_len, length - 2
    if hi < lo:
        return []
    count = hi - lo + 1
    if count <= n:
        return list(range(lo, hi + 1))
    return sorted((torch.randperm(count, generator=gen, device=gen.device)[:n] + lo).tolist())


def make_batch(samples: list[dict], feats: list[torch.Tensor], anchors: list[list[int]], block_size: int) -> Batch:
    S = len(samples)
    T = max(len(s["input_ids"]) for s in samples)
    A = max(1, max(len(a) for a in anchors))
    Fdim = feats[0].shape[-1]
    ids = torch.zeros(S, T, dtype=torch.long)
    fx = torch.zeros(S, T, Fdim, dtype=feats[0].dtype)
    anc = torch.full((S, A), -1, dtype=torch.long)
    labels = torch.full((S, A, block_size - 1), -100, dtype=torch.long)
    for s, (smp, f, a) in enumerate(zip(samples, feats, anchors)):
        x = torch.tensor(smp["input_ids"])
        ids[s, : len(x)] = x
        fx[s, : f.shape[0]] = f
        for j, pos in enumerate(a):
            anc[s, j] = pos
            tgt = x[pos + 1 : pos + block_size]
            labels[s, j, : len(tgt)] = tgt
    return Batch(ids, fx, anc, labels)


def batch_anchors(samples: list[dict], n_anchors: int, gen: torch.Generator) -> list[list[int]]:
    """Each sample's DFlash anchors (`sample_anchors`), drawn from `gen` in sample order."""
    return [sample_anchors(s["prompt_len"], len(s["input_ids"]), n_anchors, gen) for s in samples]


def loss_batch(loss, samples: list[dict], feats: list[torch.Tensor], n_anchors: int, gen: torch.Generator):
    """The batch a drafter loss trains on, from samples (`input_ids`, `prompt_len`) and their target
    features: the loss's own layout when it has a `make_batch` hook (EAGLE-3), else DFlash
    blocks (`batch_at`) at `n_anchors` anchors per sequence sampled from `gen`. Under context
    parallelism (`loss.shard`), this rank's share of the same blocks (the loss's `shard_batch`)."""
    if getattr(loss, "shard", None) is not None:
        return loss.shard_batch(samples, loss.shard.local_rows(samples, feats), n_anchors, gen)
    if hasattr(loss, "make_batch"):
        return loss.make_batch(samples, feats, n_anchors, gen)
    return loss.batch_at(samples, feats, batch_anchors(samples, n_anchors, gen))
