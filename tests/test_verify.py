"""Verification: greedy unit cases and statistical losslessness of the rejection sampler.

The statistical tests simulate speculative decoding with a toy target and a toy draft whose
distributions depend on the whole prefix (a fresh random table entry per prefix), and compare the
joint distribution of the first three emitted tokens with the target's exact one using a chi-square
test. Seeds are fixed, so each test is deterministic; with fresh seeds a correct sampler would fail
a test with probability 1e-3 (the p-value threshold), a wrong one fails by orders of magnitude.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from conftest import chi_square_pvalue

from dcoco.sampling import SamplingParams, make_generator, probabilities
from dcoco.verify import verify

V = 4
N = 24000
ALPHA = 1e-3


def test_greedy_accepts_matching_prefix():
    logits = torch.full((3, 4, 10), -5.0)
    best = torch.tensor([[1, 2, 3, 4], [1, 2, 3, 4], [7, 7, 7, 7]])
    logits.scatter_(2, best.unsqueeze(2), 5.0)
    drafts = torch.tensor([[1, 2, 9], [1, 2, 3], [7, 0, 0]])
    lens = torch.tensor([3, 3, 1])
    sp = [SamplingParams()] * 3
    res = verify(logits, drafts, lens, sp, [make_generator(0)] * 3)
    assert res.num_accepted.tolist() == [2, 3, 1]
    assert res.next_token.tolist() == [3, 4, 7]  # correction, bonus, bonus after a short draft
    assert res.emitted(drafts) == [[1, 2, 3], [1, 2, 3, 4], [7, 7]]


MAXLEN = 6  # prefixes up to this length get a table entry


class Toy:
    """Prefix-dependent logits: every prefix (a tuple of tokens) gets its own random logits, stored
    in one table indexed by offset[len(prefix)] + base-V code of the prefix."""

    def __init__(self, seed: int, scale: float = 1.5):
        rng = np.random.default_rng(seed)
        self.offset = np.cumsum([0] + [V**l for l in range(MAXLEN)])
        self.table = torch.tensor(rng.normal(size=(int(self.offset[-1]), V)) * scale, dtype=torch.float32)

    def index(self, prefix: tuple) -> int:
        code = 0
        for t in prefix:
            code = code * V + t
        return int(self.offset[len(prefix)]) + code

    def logits(self, prefix: tuple) -> torch.Tensor:
        return self.table[self.index(prefix)]


def exact_joint(target: Toy, sp: SamplingParams, depth: int) -> dict[tuple, float]:
    p_all = probabilities(target.table, sp.temperature, sp.top_k, sp.top_p)
    out = {}
    for seq in itertools.product(range(V), repeat=depth):
        pr = 1.0
        for i in range(depth):
            pr *= float(p_all[target.index(seq[:i]), seq[i]])
        out[seq] = pr
    return out


def simulate(
    target: Toy,
    q_table: torch.Tensor,
    sp: SamplingParams,
    depth: int = 3,
    gamma: int = 2,
    one_hot: bool = False,
    seed: int = 0,
):
    """Speculative decoding of `depth` tokens for N independent rows; returns the emitted prefixes.

    `q_table` holds the draft distribution for every prefix, indexed like `target.table`."""
    rng = torch.Generator().manual_seed(seed)
    gens = [make_generator(seed * 1_000_003 + i) for i in range(N)]
    seqs = torch.zeros(N, depth + gamma + 1, dtype=torch.long)
    lens = torch.zeros(N, dtype=torch.long)
    offset = torch.tensor(target.offset)
    while True:
        rows = (lens < depth).nonzero().squeeze(1)
        if rows.numel() == 0:
            break
        n = rows.numel()
        L = lens[rows]
        code = torch.zeros(n, dtype=torch.long)
        for j in range(depth):  # base-V code of each row's current prefix
            code = torch.where(j < L, code * V + seqs[rows, j], code)
        drafts = torch.zeros(n, gamma, dtype=torch.long)
        qs = torch.zeros(n, gamma, V)
        tl = torch.zeros(n, gamma + 1, V)
        for k in range(gamma + 1):
            idx = offset[L + k] + code
            tl[:, k] = target.table[idx]
            if k == gamma:
                break
            q = q_table[idx]
            qs[:, k] = q
            tok = q.argmax(-1) if one_hot else torch.multinomial(q, 1, generator=rng).squeeze(1)
            drafts[:, k] = tok
            code = code * V + tok
        res = verify(
            tl, drafts, torch.full((n,), gamma), [sp] * n, [gens[i] for i in rows.tolist()], None if one_hot else qs
        )
        for i, em in zip(rows.tolist(), res.emitted(drafts)):
            em = em[: depth - int(lens[i])]
            seqs[i, lens[i] : lens[i] + len(em)] = torch.tensor(em)
            lens[i] += len(em)
    return [tuple(s) for s in seqs[:, :depth].tolist()]


def _normalise(x: torch.Tensor) -> torch.Tensor:
    return x / x.sum(-1, keepdim=True)


def _outside_top2(t: Toy, d: Toy) -> torch.Tensor:
    return _normalise(torch.ones_like(t.table).scatter(1, torch.topk(t.table, 2, dim=1).indices, 0.0))


CASES = {
    # name: (seed, q table from (target, draft), sampling params, one-hot draft)
    "general": (1, lambda t, d: torch.softmax(d.table, -1), SamplingParams(temperature=1.0), False),
    "p_equals_q": (2, lambda t, d: torch.softmax(t.table, -1), SamplingParams(temperature=1.0), False),
    "q_zero_somewhere": (
        3,
        lambda t, d: _normalise(torch.softmax(d.table, -1) * torch.tensor([0.0, 1, 1, 1])),
        SamplingParams(temperature=1.0),
        False,
    ),
    # the target keeps its top-2 tokens; the draft puts all its mass on the other two
    "disjoint_supports": (4, _outside_top2, SamplingParams(temperature=1.0, top_k=2), False),
    "top_k_top_p_temperature": (
        5,
        lambda t, d: torch.softmax(d.table, -1),
        SamplingParams(temperature=0.7, top_k=3, top_p=0.8),
        False,
    ),
    "one_hot_draft": (6, lambda t, d: torch.softmax(d.table, -1), SamplingParams(temperature=1.0), True),
    "one_hot_top_p": (7, lambda t, d: torch.softmax(t.table, -1), SamplingParams(temperature=1.3, top_p=0.9), True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_rejection_sampling_is_lossless(case):
    seed, make_q, sp, one_hot = CASES[case]
    target, draft = Toy(seed), Toy(seed + 100)
    samples = simulate(target, make_q(target, draft), sp, one_hot=one_hot, seed=seed)
    pval = chi_square_pvalue(samples, exact_joint(target, sp, 3))
    assert pval > ALPHA, f"{case}: chi-square p-value {pval:.2e}"


def test_a_biased_sampler_is_caught():
    """Guard on the test itself: accepting every draft (no rejection) must be detected."""
    target, draft = Toy(11), Toy(111)
    rng = torch.Generator().manual_seed(0)
    samples = []
    for _ in range(N // 8):
        pre = ()
        for _ in range(3):
            pre = pre + (int(torch.multinomial(torch.softmax(draft.logits(pre), -1), 1, generator=rng)),)
        samples.append(pre)
    assert chi_square_pvalue(samples, exact_joint(target, SamplingParams(temperature=1.0), 3)) < ALPHA


def test_all_accepted_gives_bonus():
    sp = SamplingParams(temperature=1.0)
    logits = torch.zeros(2, 3, 5)
    logits[..., 0] = 50.0  # p puts (almost) all mass on token 0
    drafts = torch.zeros(2, 2, dtype=torch.long)
    q = torch.zeros(2, 2, 5)
    q[..., 0] = 1.0
    res = verify(logits, drafts, torch.tensor([2, 2]), [sp, sp], [make_generator(1), make_generator(2)], q)
    assert res.num_accepted.tolist() == [2, 2] and res.next_token.tolist() == [0, 0]
