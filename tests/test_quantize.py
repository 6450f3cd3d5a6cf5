"""Weight-only int8 and int4 targets (`--quantization`) and exact attention (`--exact`). A quantized
layer computes with its dequantized weight, and speculative decoding stays lossless with respect to the
quantized model (greedy equality with its own vanilla decoding and HF generate in float32, sampling
by a chi-square test). With exact attention, greedy speculative output equals vanilla's in bf16."""

from __future__ import annotations

import pytest
import torch
from conftest import ModelDrafter, OracleDrafter, engine_lossless_pvalue, random_prompts, tiny_model

from dcoco import ConfigError, SamplingParams
from dcoco.engine import SpeculativeEngine
from dcoco.nn.quantize import Int4Linear, Int8Linear, dequantized_products, quantize_linears
from dcoco.target import Target


def test_int8_linear_is_its_dequantized_weight():
    torch.manual_seed(0)
    lin = torch.nn.Linear(96, 40)
    q = Int8Linear(lin.weight, lin.bias)
    assert q.qweight.dtype == torch.int8 and q.qweight.abs().max() == 127
    assert (q.weight - lin.weight).abs().max() <= q.scale.max() / 2 + 1e-7  # rounding: half a step per channel
    x = torch.randn(3, 5, 96)
    want = x @ q.weight.T + lin.bias
    assert torch.allclose(q(x), want, atol=1e-5)
    xb = x.bfloat16()  # the decoding dtype
    assert torch.allclose(q(xb).float(), (xb.float() @ q.weight.T + lin.bias), atol=0.1)


@pytest.mark.parametrize("out_features", [64, 40])  # torch's kernel; the dequantized fallback (not a multiple of 16)
def test_int4_linear_is_its_dequantized_weight(out_features):
    torch.manual_seed(0)
    lin = torch.nn.Linear(96, out_features)
    q = Int4Linear(lin.weight, lin.bias)
    assert (q.packed is not None) == (out_features % 16 == 0) and q.group == 32
    steps = q.step.repeat_interleave(32, dim=1)  # (out, in): each weight's own group step
    assert ((q.weight - lin.weight).abs() <= steps / 2 + 1e-6).all()  # rounding: half a step per group
    groups = q.weight.view(out_features, 3, 32)  # a group's weights lie on its own 16-value grid
    assert torch.allclose(groups.amin(-1), q.low) and torch.allclose(groups.amax(-1), q.low + 15 * q.step, atol=1e-6)
    x = torch.randn(3, 5, 96)
    assert torch.allclose(q(x), x @ q.weight.T + lin.bias, atol=1e-5)
    xb = x.bfloat16()  # the decoding dtype
    assert torch.allclose(q(xb).float(), (xb.float() @ q.weight.T + lin.bias), atol=0.1)


@pytest.mark.parametrize("kind", [Int8Linear, Int4Linear])
def test_dequantized_products_from_a_number_of_rows(kind):
    """Within `dequantized_products(n)`, passes of n rows or more multiply by the dequantized weight
    (a bf16 prefill), shorter ones and every pass outside it by the quantized kernel."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(96, 64).bfloat16()
    q = kind(lin.weight, lin.bias)
    short, long = torch.randn(1, 7, 96).bfloat16(), torch.randn(2, 20, 96).bfloat16()
    by_weight = torch.nn.functional.linear(long, q.weight, q.bias)
    kernel_short, kernel_long = q(short), q(long)
    assert not torch.equal(kernel_long, by_weight)  # the kernel rounds otherwise: the switch is visible
    with dequantized_products(min_rows=8):
        assert torch.equal(q(long), by_weight) and torch.equal(q(short), kernel_short)
    assert torch.equal(q(long), kernel_long)


def test_quantized_targets_draft_at_most_three_tokens_by_default():
    """Torch's int kernels take rows in blocks of 4: a drafter's default block is capped to 3 draft
    tokens on a quantized CPU target; an explicit block length is kept."""
    from dcoco.drafters.ngram import NgramDrafter

    model = tiny_model("llama", seed=3)
    plain = Target(model)
    quantize_linears(model, "int8")
    quantized = Target(model)
    assert plain.cheap_pass_tokens is None and quantized.cheap_pass_tokens == 4
    assert SpeculativeEngine(plain, NgramDrafter()).num_speculative_tokens == NgramDrafter.default_num_tokens == 5
    assert SpeculativeEngine(quantized, NgramDrafter()).num_speculative_tokens == 3
    assert SpeculativeEngine(quantized, NgramDrafter(), 5).num_speculative_tokens == 5


def test_quantize_replaces_every_linear_and_keeps_the_embedding():
    for quantization, decoder_kind in (("int8", Int8Linear), ("int4", Int4Linear)):
        model = tiny_model("llama", seed=3, tie_word_embeddings=True)
        embed = model.get_input_embeddings().weight.detach().clone()
        n = sum(isinstance(m, torch.nn.Linear) for m in model.modules())
        assert quantize_linears(model, quantization) == n
        assert not any(isinstance(m, torch.nn.Linear) for m in model.modules())
        assert isinstance(model.get_output_embeddings(), Int8Linear)  # the head stays int8 under int4
        assert isinstance(model.model.layers[0].mlp.down_proj, decoder_kind)
        assert torch.equal(model.get_input_embeddings().weight, embed)
    assert quantize_linears(tiny_model("llama"), "none") == 0
    with pytest.raises(ConfigError, match="int2"):
        quantize_linears(tiny_model("llama"), "int2")


@pytest.mark.parametrize("family,quantization", [("llama", "int8"), ("qwen3", "int8"), ("llama", "int4")])
def test_speculative_greedy_equals_the_quantized_targets_own(family, quantization):
    model = tiny_model(family, seed=1)
    quantize_linears(model, quantization)
    target = Target(model)
    prompts = random_prompts(4, target.vocab_size, seed=2)
    sp = SamplingParams(max_tokens=30)
    vanilla, _ = SpeculativeEngine(target).generate(prompts, sp)
    refs = {tuple(p): o.token_ids for p, o in zip(prompts, vanilla)}
    outs, stats = SpeculativeEngine(target, OracleDrafter(refs, target.vocab_size, 0.3), 5).generate(prompts, sp)
    assert [o.token_ids for o in outs] == [o.token_ids for o in vanilla] and 0 < stats.accepted < stats.drafted
    x = torch.tensor([prompts[0]])
    hf = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=30, min_new_tokens=30, do_sample=False,
                        pad_token_id=0)  # fmt: skip
    assert hf[0, x.shape[1] :].tolist() == vanilla[0].token_ids


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_sampling_from_the_quantized_target_is_lossless(quantization):
    model = tiny_model("llama", seed=21, vocab_size=5, initializer_range=0.08)
    quantize_linears(model, quantization)
    drafter = ModelDrafter(tiny_model("llama", seed=22, vocab_size=5, initializer_range=0.08), temperature=1.2)
    pvalue, stats = engine_lossless_pvalue(Target(model), drafter, SamplingParams(temperature=1.0, max_tokens=3), 3000)
    assert stats.accepted > 0 and pvalue > 1e-3


@pytest.mark.parametrize("quantization", ["none", "int4"])  # torch's int4 kernel is row-invariant too
def test_exact_attention_makes_bf16_speculative_greedy_equal_vanilla(quantization):
    """bf16, a batch with padding and holes: every token's logits as a 1-token step gives them."""
    # flat logits with near-ties: without `exact`, one of these answers differs at k = 5 (measured)
    model = tiny_model("llama", seed=7, initializer_range=0.01).bfloat16()
    quantize_linears(model, quantization)
    target = Target(model, exact=True)
    prompts = random_prompts(4, target.vocab_size, seed=5)
    sp = SamplingParams(max_tokens=40)
    vanilla, _ = SpeculativeEngine(target).generate(prompts, sp)
    refs = {tuple(p): o.token_ids for p, o in zip(prompts, vanilla)}
    for k in (2, 5):
        drafter = OracleDrafter(refs, target.vocab_size, 0.4, seed=k)
        outs, stats = SpeculativeEngine(target, drafter, k, max_batch_size=3).generate(prompts, sp)
        assert [o.token_ids for o in outs] == [o.token_ids for o in vanilla] and 0 < stats.accepted < stats.drafted


def test_exact_lone_token_step_equals_its_row_in_a_verification_pass():
    """A single request's 1-token steps against the same tokens as one 8-token pass, logits bitwise:
    a one-row bf16 product takes another kernel (and summation order) than a matrix one on CPUs
    without AMX, at SmolLM2-135M's widths (without `Target.forward`'s padding slot, some of these
    rows differ on a 2-core AMD EPYC with AVX-512 BF16)."""
    model = tiny_model("llama", seed=1, hidden_size=576, intermediate_size=1536, initializer_range=0.02).bfloat16()
    target = Target(model, exact=True)
    prompt, new = random_prompts(1, target.vocab_size, lengths=(21,), seed=2)[0], torch.randint(0, 96, (1, 8))
    kv, _ = target.prefill([prompt])
    steps = []
    for j in range(8):
        steps.append(target.forward(kv, new[:, j : j + 1], torch.tensor([1])).logits[0, 0])
        kv.commit(torch.tensor([1]))
    kv, _ = target.prefill([prompt])
    block = target.forward(kv, new, torch.tensor([8])).logits[0]
    assert [j for j in range(8) if not torch.equal(steps[j], block[j])] == []
