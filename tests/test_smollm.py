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
    out = LLM(target=smollm).generate(
        "Count from 1 to 20, separated by commas.", SamplingParams(max_tokens=80, stop=["7"])
    )[0]
    assert "7" not in out.text and out.finish_reason == "stop"


def test_cli_generate_json(capsys):
    code = main(
        [
            "generate",
            "--prompt",
            "Say hello.",
            "--method",
            "ngram",
            "--max-new-tokens",
            "12",
            "--json",
            "--dtype",
            "float32",
        ]
    )
    out, err = capsys.readouterr()
    assert code == 0
    obj = json.loads(out.strip().splitlines()[-1])
    assert set(obj) >= {"text", "token_ids", "stats"}
    assert set(obj["stats"]) == {
        "output_tokens",
        "wall_s",
        "tokens_per_second",
        "verify_passes",
        "acceptance_length",
        "acceptance_rate",
        "per_position_acceptance",
    }
    assert obj["stats"]["output_tokens"] == len(obj["token_ids"]) <= 12


def test_demo_with_exact_is_identical_to_vanilla_in_bf16(capsys):
    """`dcoco demo --exact`: DCOCO's greedy answer equals vanilla's token for token in bf16, on the
    real target and shipped drafter (a lone decoding token included, see `Target.forward`)."""
    code = main(["demo", "--exact", "--dtype", "bfloat16", "--max-new-tokens", "48"])
    out, _ = capsys.readouterr()
    assert code == 0 and "output identical to vanilla" in out, out


def test_prompt_too_long(capsys, smollm):
    code = main(["generate", "--prompt", "word " * 9000, "--max-new-tokens", "4"])
    _, err = capsys.readouterr()
    assert code == 2 and "exceeds the model context" in err


@pytest.mark.parametrize("method", ["dflash", "dcoco", "dspark", "eagle3"])
def test_trainer_drafts_are_the_drafts_decoding_makes(smollm, method, tmp_path):
    """What `dcoco train` fits and evaluates is what inference drafts: at every block of a real greedy
    decode (float32) the trainer's teacher-forced prediction at that anchor is the shipped drafter's
    proposal (DSpark's and EAGLE-3's up to the first miss, where their walks and teacher forcing part), and walking the
    trainer's predictions over the answer (`eval_tau_decode`) takes the engine's verification passes."""
    from dcoco.engine import SpeculativeEngine
    from dcoco.families import shipped_checkpoint
    from dcoco.speculative import SpeculativeConfig, load_drafter
    from dcoco.train.acceptance import decode_acceptance
    from dcoco.train.config import load_config
    from dcoco.train.data import Prompt, RegeneratedData, regenerate
    from dcoco.train.evaluate import evaluate_checkpoint
    from dcoco.train.trainer import Trainer

    drafter = load_drafter(SpeculativeConfig(method=method), smollm)
    blocks = []
    propose = drafter.propose

    def recording(inp):
        out = propose(inp)
        blocks.append((len(inp.token_ids[0]) - 1, out.tokens[0, : int(out.lengths[0])].tolist()))
        return out

    drafter.propose = recording
    sp = SamplingParams(max_tokens=40)
    prompt = smollm.encode(PROMPTS[0])
    [out], stats = SpeculativeEngine(smollm, drafter).generate([prompt], sp)
    regenerate(
        smollm,
        [Prompt(id="p", messages=prompt)],
        tmp_path / "data",
        1,
        taps=[smollm.num_layers],
        sampling=sp,
        progress=False,
        features=False,
    )
    cfg = load_config(
        f"configs/{method}_smollm2.yaml",
        [
            f"data.path={tmp_path / 'data'}",
            "data.features=online",
            "data.eval_permille=0",
            "optim.autocast_bf16=false",
            f"run.out={tmp_path / 'run'}",
            f"drafter.init_from={shipped_checkpoint(method)}",
        ],
    )
    tr = Trainer(cfg, smollm, RegeneratedData(tmp_path / "data"))
    [smp] = tr.train_samples
    assert smp["input_ids"] == prompt + out.token_ids
    anchors = list(range(smp["prompt_len"], len(smp["input_ids"]) - 1))
    b = tr.loss.batch_at([smp], tr.features([smp]), [anchors])
    with torch.no_grad():
        pred = tr.loss.predictions(tr.loss(b)[1])[""][0]
    k = drafter.default_num_tokens
    assert blocks and len(blocks) == stats.verify_passes
    for anchor, drafted in blocks:
        mine, labels = (
            pred[anchor - smp["prompt_len"], : len(drafted)].tolist(),
            b.labels[0, anchor - smp["prompt_len"]].tolist(),
        )
        hits = [next((i for i, (d, y) in enumerate(zip(ds, labels)) if d != y), len(ds)) for ds in (mine, drafted)]
        assert hits[0] == hits[1], (anchor, mine, drafted, labels)
        if method not in ("dspark", "eagle3"):  # a chain teacher-forced on the tokens parts from inference after a miss
            assert mine == drafted, (anchor, mine, drafted)
    passes, tokens = decode_acceptance(pred, b.labels[0], k)
    assert passes == stats.verify_passes
    # `dcoco eval` walks the same drafts: its τ as decoded is the engine's on this answer; at T=1 the
    # expected acceptance of every slot is a probability, and a slot is reached no more often than
    # the one before it
    res = evaluate_checkpoint(str(shipped_checkpoint(method)), [str(tmp_path / "data")], split="all", progress=False)
    assert res["method"] == method and res["samples"] == 1
    assert res["t0"]["eval_tau_decode"] == pytest.approx(tokens / passes, abs=1e-4)
    t1 = res["t1"]["eval_per_position_t1"]
    assert 1.0 <= res["t1"]["eval_tau_t1"] <= 1 + len(t1)
    assert all(0.0 <= b <= a + 1e-6 <= 1.0 + 1e-6 for a, b in zip([1.0] + t1, t1))
