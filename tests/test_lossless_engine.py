"""End-to-end losslessness of sampled speculative decoding through the real engine.

A tiny Llama target with a 5-token vocabulary and a different tiny draft LM: the joint distribution
of the first three generated tokens (the first from prefill, the next two from a speculative pass:
accepted/recovered and accepted/bonus) is compared with the target's exact distribution, enumerated
with the target itself, by a chi-square test (fixed seeds; threshold 1e-3, see test_verify.py).
"""

from __future__ import annotations

import pytest
from conftest import ModelDrafter, engine_lossless_pvalue, tiny_model

from dcoco.drafters.ngram import NgramDrafter
from dcoco.sampling import SamplingParams
from dcoco.target import Target

V = 5
N = 5000


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
    pvalue, stats = engine_lossless_pvalue(target, d, sp, n=N, seed=1)
    assert stats.accepted > 0 and stats.accepted < stats.drafted  # both branches exercised
    assert pvalue > 1e-3
