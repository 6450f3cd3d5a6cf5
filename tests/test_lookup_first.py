"""Prompt lookup before a trained drafter (`lookup_first`): lossless, greedy and sampled, and the
model's context stays whole across the steps prompt lookup drafted."""

from __future__ import annotations

import pytest
import torch
from conftest import ModelDrafter, engine_lossless_pvalue, random_prompts, tiny_model, tiny_target

from dcoco import ConfigError, SamplingParams
from dcoco.drafters.base import DraftInput
from dcoco.drafters.dflash import BlockDrafter, DFlashConfig, DFlashModel
from dcoco.drafters.lookup_first import LOOKUP_TOKENS, LookupFirst
from dcoco.engine import SpeculativeEngine
from dcoco.speculative import SpeculativeConfig, load_drafter, variant_options
from dcoco.target import Target


def tiny_pair():
    target = tiny_target("llama", seed=11, num_hidden_layers=6, initializer_range=0.15)
    torch.manual_seed(5)
    cfg = DFlashConfig.for_target(target, num_layers=1, block_size=6, num_features=2)
    return target, DFlashModel(cfg).float().eval()


def test_greedy_output_equals_vanilla_with_both_drafters_used():
    target, model = tiny_pair()
    # prompts that repeat themselves, so that some steps find an earlier occurrence and some do not
    prompts = [p + p[: len(p) // 2] for p in random_prompts(4, target.vocab_size, seed=3)]
    sp = SamplingParams(max_tokens=30)
    vanilla, _ = SpeculativeEngine(target).generate(prompts, sp)
    drafter = LookupFirst(BlockDrafter(model, target), min_match=2)
    outs, stats = SpeculativeEngine(target, drafter, 5).generate(prompts, sp)
    assert [o.token_ids for o in outs] == [o.token_ids for o in vanilla]
    assert drafter.looked_up > 0 and drafter.drafted > 0 and stats.drafted > 0


def test_the_model_drafts_from_the_whole_context_after_lookup_steps():
    """A step drafted by lookup still hands its features to the model: its next draft equals that of a
    model that drafted every step."""
    target, model = tiny_pair()
    H = target.hidden_size
    seq = [4, 7, 9, 4, 7]  # "4 7" occurred before: lookup drafts [9, 4, 7]
    steps = [(seq, torch.randn(4, 2 * H)), (seq + [9, 4, 3], torch.randn(3, 2 * H))]  # then "4 3": new
    sp, gen = [SamplingParams()], [torch.Generator()]
    plain, first = BlockDrafter(model, target), LookupFirst(BlockDrafter(model, target), min_match=2)
    outs = []
    for ids, f in steps:
        inp = DraftInput([0], [ids], [f], 3, sp, gen)
        outs.append((plain.propose(inp).tokens, first.propose(inp)))
    assert outs[0][1].tokens[0].tolist() == [9, 4, 7] and first.looked_up == 1
    assert torch.equal(outs[1][1].tokens, outs[1][0]) and first.drafted == 1


def test_lookup_drafts_run_longer_than_the_model_block_and_stay_lossless():
    """`lookup_num_tokens` past the model's block: lookup rows draft that many, model rows their block."""
    target, model = tiny_pair()  # block 6: the model drafts at most 5
    H = target.hidden_size
    assert LookupFirst(BlockDrafter(model, target), min_match=2).default_num_tokens == LOOKUP_TOKENS == 6
    first = LookupFirst(BlockDrafter(model, target), min_match=2, num_tokens=8)
    assert first.default_num_tokens == 8
    copy = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 3, 1]  # "3 1" occurred before: lookup drafts the next 8
    fresh = [10, 11, 12, 13, 14, 15]
    sp, gen = [SamplingParams()] * 2, [torch.Generator(), torch.Generator()]
    feats = [torch.randn(len(copy) - 1, 2 * H), torch.randn(len(fresh) - 1, 2 * H)]
    out = first.propose(DraftInput([0, 1], [copy, fresh], feats, 8, sp, gen))
    plain = BlockDrafter(model, target).propose(DraftInput([1], [fresh], feats[1:], 5, sp[:1], gen[:1]))
    assert out.tokens[0].tolist() == [4, 1, 5, 9, 2, 6, 5, 3] and out.lengths.tolist() == [8, 5]
    assert torch.equal(out.tokens[1, :5], plain.tokens[0])

    prompts = [p + p[: len(p) // 2] for p in random_prompts(4, target.vocab_size, seed=3)]
    sp = SamplingParams(max_tokens=30)
    vanilla, _ = SpeculativeEngine(target).generate(prompts, sp)
    engine = SpeculativeEngine(target, LookupFirst(BlockDrafter(model, target), 2, num_tokens=8))
    drafted = []
    engine.on_pass.append(lambda r, d, a: drafted.append(d))
    outs, _ = engine.generate(prompts, sp)
    assert [o.token_ids for o in outs] == [o.token_ids for o in vanilla]
    assert engine.num_speculative_tokens == 8 and max(drafted) > 5


def test_sampling_stays_lossless_with_lookup_and_model_rows_in_one_batch():
    V = 5
    target = Target(tiny_model("llama", seed=21, vocab_size=V, initializer_range=0.08))
    drafter = LookupFirst(ModelDrafter(tiny_model("llama", seed=22, vocab_size=V, initializer_range=0.08), 1.2), 2)
    pvalue, stats = engine_lossless_pvalue(target, drafter, SamplingParams(temperature=1.0), n=4000, seed=2)
    assert drafter.looked_up > 0 and drafter.drafted > 0
    assert 0 < stats.accepted < stats.drafted
    assert pvalue > 1e-3


def test_config_and_bench_label():
    assert variant_options("dcoco/lookup3") == {"lookup_first": 3}
    assert variant_options("dcoco/lookup2k8") == {"lookup_first": 2, "lookup_num_tokens": 8}
    assert variant_options("ngram/lookup3") == {}
    assert variant_options("dflash/draft7") == {"num_speculative_tokens": 7} and variant_options("ngram/draft7") == {}
    with pytest.raises(ConfigError, match="set lookup_first too"):
        SpeculativeConfig.parse({"method": "dflash", "lookup_num_tokens": 8})
    with pytest.raises(ConfigError, match="lookup_first"):
        SpeculativeConfig.parse({"method": "dflash", "lookup_first": 0})
    with pytest.raises(ConfigError, match="trained drafter"):
        load_drafter(SpeculativeConfig(method="ngram", lookup_first=2), tiny_pair()[0])
