"""Integration on the embedded SmolLM2-135M-Instruct (float32 for exactness)."""

from __future__ import annotations

import json

import pytest
import torch

from dcoco import LLM, SamplingParams
from dcoco.cli import main

pytestmark = pytest.mark.smollm

PROMPTS = [
    "Repeat this list exactly, then sort it: pear, apple, fig, plum, kiwi.",
    "What is the capital of France?",
]


def test_ngram_greedy_equals_vanilla_and_hf(smollm):
    llm = LLM(target=smollm)
    sp = SamplingParams(max_tokens=40)
    vanilla = llm.generate(PROMPTS, sp)
    spec = llm.generate(PROMPTS, sp, speculative_config={"method": "ngram", "num_speculative_tokens": 6})
    assert [o.token_ids for o in spec] == [o.token_ids for o in vanilla]
    for o in vanilla:
        x = torch.tensor([o.prompt_token_ids])
        hf = smollm.model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=40, do_sample=False)
        assert o.token_ids == hf[0, x.shape[1] :].tolist()
    assert llm.last_stats.acceptance_length > 1.0


@pytest.mark.parametrize("method", ["dflash", "dcoco", "dspark", "eagle3"])
def test_shipped_drafters_are_lossless(smollm, method):
    """The checkpoints shipped for SmolLM2 load with no path and reproduce vanilla greedy decoding
    token for token (float32), while actually accepting drafts."""
    llm = LLM(target=smollm)
    sp = SamplingParams(max_tokens=48)
    vanilla = llm.generate(PROMPTS, sp)
    spec = llm.generate(PROMPTS, sp, speculative_config={"method": method})
    assert [o.token_ids for o in spec] == [o.token_ids for o in vanilla]
    assert llm.last_stats.acceptance_length > 1.05 and llm.last_stats.drafted > 0


def test_chat_template_and_eos(smollm):
    out = LLM(target=smollm).generate("What is the capital of France?", SamplingParams(max_tokens=64))[0]
    assert "Paris" in out.text and out.finish_reason == "stop" and out.token_ids[-1] in smollm.eos_token_ids


def test_stop_string(smollm):
    out = LLM(target=smollm).generate("Count from 1 to 20, separated by commas.", SamplingParams(max_tokens=80, stop=["7"]))[0]
    assert "7" not in out.text and out.finish_reason == "stop"


def test_cli_generate_json(capsys):
    code = main(["generate", "--prompt", "Say hello.", "--method", "ngram", "--max-new-tokens", "12", "--json", "--dtype", "float32"])
    out, err = capsys.readouterr()
    assert code == 0
    obj = json.loads(out.strip().splitlines()[-1])
    assert set(obj) >= {"text", "token_ids", "stats"}
    assert set(obj["stats"]) == {"output_tokens", "wall_s", "tokens_per_second", "verify_passes",
                                 "acceptance_length", "acceptance_rate", "per_position_acceptance"}
    assert obj["stats"]["output_tokens"] == len(obj["token_ids"]) <= 12


def test_prompt_too_long(capsys, smollm):
    code = main(["generate", "--prompt", "word " * 9000, "--max-new-tokens", "4"])
    _, err = capsys.readouterr()
    assert code == 2 and "exceeds the model context" in err
