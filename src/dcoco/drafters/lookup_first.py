"""Prompt lookup first, a trained drafter otherwise (`speculative_config.lookup_first = N`).

Where a request's last N or more tokens occurred earlier in its sequence, its answer is likely
copying (a quoted passage, code, a list that repeats its prompt): the tokens that followed the
earlier occurrence are drafted, as prompt lookup does, and the model's forward is skipped for that
request. The other requests draft with the model. Either way the target verifies the draft, so the
output is unchanged; the model still takes in every request's new features (`Drafter.absorb`), so
its context stays whole when it drafts again.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from .base import Drafter, DraftInput, DraftOutput
from .ngram import lookup


def rows_of(inp: DraftInput, rows: list[int], num_tokens: int | None = None) -> DraftInput:
    """The part of a drafting step that concerns `rows` of its batch (drafting `num_tokens`, if given)."""
    return DraftInput(
        request_ids=[inp.request_ids[b] for b in rows],
        token_ids=[inp.token_ids[b] for b in rows],
        new_features=[inp.new_features[b] for b in rows],
        num_tokens=inp.num_tokens if num_tokens is None else num_tokens,
        params=[inp.params[b] for b in rows],
        generators=[inp.generators[b] for b in rows],
        device=inp.device,
    )


#: a lookup draft's length unless set (or the model's block, if longer): on held-out prompts at T=0
#: 6 beat 4 (the shipped drafters' block), 8 and 12 (docs/experiments/2026-12-05-prompt-lookup-first.md)
LOOKUP_TOKENS = 6


class LookupFirst(Drafter):
    """`model` drafts where prompt lookup finds no earlier occurrence of the last `min_match` tokens.

    A lookup draft is `num_tokens` long (None: `LOOKUP_TOKENS` or the model's block, the longer); a
    pass then verifies up to the longer of the two, and the model still drafts its own length.
    """

    def __init__(self, model: Drafter, min_match: int, num_tokens: int | None = None, max_match: int = 3):
        if not 1 <= min_match:
            raise ValueError(f"lookup_first must be >= 1, got {min_match}")
        if num_tokens is not None and num_tokens < 1:
            raise ValueError(f"lookup_num_tokens must be >= 1, got {num_tokens}")
        self.model, self.min_match, self.max_match = model, min_match, max(min_match, max_match)
        self.method = f"{model.method}+lookup"
        self.tap_layers = model.tap_layers
        self.lookup_tokens = max(LOOKUP_TOKENS, model.default_num_tokens) if num_tokens is None else int(num_tokens)
        self.default_num_tokens = max(model.default_num_tokens, self.lookup_tokens)
        self.looked_up = self.drafted = 0  # requests drafted by lookup and by the model, so far

    @property
    def select_seconds(self) -> float:
        return getattr(self.model, "select_seconds", 0.0)

    def check_target(self, target) -> None:
        self.model.check_target(target)

    def release(self, request_id: int) -> None:
        self.model.release(request_id)

    def absorb(self, inp: DraftInput) -> None:
        self.model.absorb(inp)

    def propose(self, inp: DraftInput) -> DraftOutput:
        k = inp.num_tokens
        k_lookup, k_model = min(k, self.lookup_tokens), min(k, self.model.default_num_tokens)
        found = [
            lookup(np.asarray(ids, dtype=np.int64), k_lookup, self.max_match, self.min_match) if k > 0 else []
            for ids in inp.token_ids
        ]
        hit = [b for b, f in enumerate(found) if f]
        miss = [b for b, f in enumerate(found) if not f]
        self.looked_up += len(hit)
        self.drafted += len(miss)
        if hit:
            self.model.absorb(rows_of(inp, hit))
        if not miss:
            return _stack(found, None, miss, inp.device)
        whole = not hit and k_model == k
        drafted = self.model.propose(inp if whole else rows_of(inp, miss, k_model))
        return _stack(found, drafted, miss, inp.device)


def _stack(found: list[list[int]], drafted: DraftOutput | None, miss: list[int], device) -> DraftOutput:
    """One batch's draft: the lookup rows (deterministic, one-hot where q is needed) and the model's."""
    B = len(found)
    width = max([len(f) for f in found] + [drafted.tokens.shape[1] if drafted is not None else 0] + [1])
    tokens = torch.zeros(B, width, dtype=torch.long, device=device)
    lengths = torch.zeros(B, dtype=torch.long, device=device)
    for b, f in enumerate(found):
        if f:
            tokens[b, : len(f)] = torch.tensor(f, dtype=torch.long, device=device)
            lengths[b] = len(f)
    if drafted is None:
        return DraftOutput(tokens=tokens, lengths=lengths)
    idx = torch.tensor(miss, dtype=torch.long, device=device)
    g = drafted.tokens.shape[1]
    tokens[idx, :g] = drafted.tokens.to(device)
    lengths[idx] = drafted.lengths.to(device)
    if drafted.probs is None:
        return DraftOutput(tokens=tokens, lengths=lengths)
    V = drafted.probs.shape[-1]
    probs = F.one_hot(tokens, V).float()
    probs[idx, :g] = drafted.probs.to(device).float()
    return DraftOutput(tokens=tokens, lengths=lengths, probs=probs)
