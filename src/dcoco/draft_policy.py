"""Load-aware drafting: shorten the draft block as the batch grows.

A verification pass feeds the target `B * (k + 1)` tokens (B requests, k draft tokens each, plus the
anchor). At batch 1 the forward is bound by reading the weights, so a longer block is nearly free
(on the 2-core reference CPU a 16-token pass costs ~1.3x a 1-token step). As B grows the pass becomes
bound by compute and every rejected draft token is paid for by the whole batch, while a plain decode
step already keeps the hardware busy. `LoadAwarePolicy` therefore caps the tokens one pass verifies:

    k(B) = clamp(token_budget // B - 1, min_k, default_k)

With the defaults (token_budget 32, default_k 5) this gives:

    batch size B   1   2   4   5   6   7   8   9-10  11-16  >= 17
    draft block k  5   5   5   5   4   3   3    2      1      0   (0 = plain decoding)

The policy only changes how many tokens are drafted per pass; verification is unchanged, so output
stays lossless (identical tokens at temperature 0, the target's distribution when sampling).
"""

from __future__ import annotations

from typing import Sequence


class LoadAwarePolicy:
    """`policy(batch_size, default_k) -> k` for `SpeculativeEngine(draft_policy=...)`."""

    def __init__(self, token_budget: int = 32, min_k: int = 0):
        if token_budget < 1:
            raise ValueError(f"token_budget must be >= 1, got {token_budget}")
        if min_k < 0:
            raise ValueError(f"min_k must be >= 0, got {min_k}")
        self.token_budget = int(token_budget)
        self.min_k = int(min_k)

    def __call__(self, batch_size: int, default_k: int) -> int:
        k = self.token_budget // max(1, int(batch_size)) - 1
        return max(0, min(int(default_k), max(self.min_k, k)))

    def table(self, default_k: int, sizes: Sequence[int] = (1, 2, 4, 8, 16, 32)) -> list[tuple[int, int]]:
        """(batch size, draft block length) pairs, for logs and docs."""
        return [(b, self(b, default_k)) for b in sizes]

    def __repr__(self) -> str:
        return f"LoadAwarePolicy(token_budget={self.token_budget}, min_k={self.min_k})"
