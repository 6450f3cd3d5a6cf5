"""Model-free n-gram / prompt-lookup drafting (as HF `prompt_lookup_num_tokens`, vLLM `ngram`).

The last n tokens of the sequence are searched for earlier in the same sequence (prompt and output);
the tokens that followed the most recent match are proposed. Longer n-grams are tried first.
"""

from __future__ import annotations

import numpy as np

from ..kv import pad_rows
from .base import Drafter, DraftInput, DraftOutput


def lookup(seq: np.ndarray, num_tokens: int, max_n: int, min_n: int) -> list[int]:
    """Continuation of the latest earlier occurrence of the longest matching suffix n-gram."""
    L = len(seq)
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        suffix = seq[L - n :]
        windows = np.lib.stride_tricks.sliding_window_view(seq[: L - 1], n)  # starts 0..L-1-n
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        hits = hits[hits + n < L]  # must have at least one following token before the suffix itself
        if hits.size:
            start = int(hits[-1]) + n
            return seq[start : start + num_tokens].tolist()
    return []


class NgramDrafter(Drafter):
    method = "ngram"
    default_num_tokens = 5

    def __init__(self, prompt_lookup_max: int = 3, prompt_lookup_min: int = 1):
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ValueError("need 1 <= prompt_lookup_min <= prompt_lookup_max")
        self.max_n, self.min_n = prompt_lookup_max, prompt_lookup_min

    def propose(self, inp: DraftInput) -> DraftOutput:
        if inp.num_tokens <= 0:
            return DraftOutput.empty(len(inp.token_ids), inp.device)
        rows = [
            lookup(np.asarray(ids, dtype=np.int64), inp.num_tokens, self.max_n, self.min_n) for ids in inp.token_ids
        ]
        tokens, lens = pad_rows(rows, max(1, max(len(r) for r in rows)), inp.device)
        return DraftOutput(tokens=tokens, lengths=lens)
