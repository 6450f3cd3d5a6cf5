"""End-to-end losslessness of sampled speculative decoding through the real engine.

A tiny Llama target with a 5-token vocabulary and a different tiny draft LM: the joint distribution
of the first three generated tokens (the first from prefill, the next two from a speculative pass:
accepted/recovered and accepted/bonus) is compared with the target's exact distribution, enumerated
with the target itself, by a chi-square test (fixed seeds; threshold 1e-3, see test_verify.py).
"""

from __future__ import annotations

import itertools

import pytest
import torch

from conftest import ModelDrafter, chi_square_pvalue, tiny_model
from dcoco.drafters import NgramDrafter
from dcoco.engine import SpeculativeEngine
from dcoco.sampling import SamplingParams, probabilities
from dcoco.target import Target

V = 5
N = 5000
PROMPT = [1, 3, 0, 2, 4, 1]


def exact_joint(model, sp: SamplingParams) -> dict[tuple, float]:
    out = {}
    with torch.no_grad():
        for seq in itertools.product(range(V), repeat=3):
            pr = 1.0
            for i in range(3):
                logits = model(torch.tensor([PROMPT + list(seq[:i])])).logits[0, -1]
                pr *= float(probabilities(logits.view(1, -1), sp.temperature, sp.top_k, sp.top_p)[0, seq[i]])
            out[seq] = pr
    return out


@pytest.mark.parametrize(
    "sp,drafter",
    [
        (SamplingParams(temperature=1.0, max_tokens=3), "model"),
        (SamplingParams(temperature=0.8, top_k=3, top_p=0.9, max_tokens=3), "model"),
        (SamplingParams(temperature=1.0, max_tokens=3), "ngram"),
    ],
)
def test_engine_sampling_matches_target(sp, drafter):
    target_model = tiny_model("llama", seed=21, vocab_size=V, initializer_range=0.08)
    draft_model = tiny_model("llama", seed=22, vocab_size=V, initializer_range=0.08)
    target = Target(target_model)
    d = ModelDrafter(draft_model, temperature=1.2) if drafter == "model" else NgramDrafter(prompt_lookup_min=1)
    samples = []
    for start in range(0, N, 1000):
        params = [sp.model_copy(update={"seed": 7919 * i + 1}) for i in range(start, start + 1000)]
        outs, stats_ = SpeculativeEngine(target, d, 2, max_batch_size=1000).generate([PROMPT] * 1000, params)
        samples += [tuple(o.token_ids) for o in outs]
    assert stats_.accepted > 0 and stats_.accepted < stats_.drafted  # both branches exercised
    assert chi_square_pvalue(samples, exact_joint(target_model, sp)) > 1e-3
