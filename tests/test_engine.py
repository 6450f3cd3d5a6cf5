"""The speculative engine: greedy equality with vanilla and HF generate (float32), rollback, batching."""

from __future__ import annotations

import pytest
import torch
from conftest import OracleDrafter, random_prompts, tiny_model, tiny_target

from dcoco.drafters.ngram import NgramDrafter
from dcoco.engine import SpeculativeEngine
from dcoco.kv import KVBatch
from dcoco.sampling import SamplingParams
from dcoco.target import Target

MAX_NEW = 40


def hf_greedy(target, prompt: list[int], n: int) -> list[int]:
    x = torch.tensor([prompt])
    out = target.model.generate(
        x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0
    )
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("batch", [1, 4])
def test_greedy_equals_vanilla_and_hf(target, batch):
    V = target.vocab_size
    prompts = random_prompts(batch, V, seed=batch)
    sp = SamplingParams(max_tokens=MAX_NEW)
    vanilla, vstats = SpeculativeEngine(target).generate(prompts, sp)
    assert vstats.acceptance_length == 1.0
    for p, o in zip(prompts, vanilla):
        assert o.token_ids == hf_greedy(target, p, MAX_NEW)
    refs = {tuple(p): o.token_ids for p, o in zip(prompts, vanilla)}
    for k, err in ((3, 0.0), (4, 0.3), (7, 0.5)):
        outs, stats = SpeculativeEngine(target, OracleDrafter(refs, V, err, seed=k), k).generate(prompts, sp)
        assert [o.token_ids for o in outs] == [o.token_ids for o in vanilla]
        if err == 0.0:
            assert stats.acceptance_length > 3.0  # perfect drafts are (nearly) all accepted
        else:
            assert 1.0 < stats.acceptance_length < k + 1
    outs, _ = SpeculativeEngine(target, NgramDrafter(), 5).generate(prompts, sp)
    assert [o.token_ids for o in outs] == [o.token_ids for o in vanilla]


def test_greedy_with_frequent_compaction(monkeypatch):
    monkeypatch.setattr(KVBatch, "COMPACT_HOLE_FRACTION", 0.0)
    target = tiny_target("llama", seed=3)
    prompts = random_prompts(5, target.vocab_size, lengths=(3, 40, 11, 25, 7), seed=9)
    sp = SamplingParams(max_tokens=MAX_NEW)
    vanilla, _ = SpeculativeEngine(target).generate(prompts, sp)
    refs = {tuple(p): o.token_ids for p, o in zip(prompts, vanilla)}
    outs, _ = SpeculativeEngine(target, OracleDrafter(refs, target.vocab_size, 0.4), 6, max_batch_size=3).generate(
        prompts, sp
    )
    assert [o.token_ids for o in outs] == [o.token_ids for o in vanilla]


def _row_kv(kv: KVBatch, b: int, layer: int):
    v = kv.valid[b]
    lay = kv.cache.layers[layer]
    return lay.keys[b][:, v], lay.values[b][:, v]


def test_rollback_equals_fresh_cache(target):
    """After a partial rejection the cache holds exactly what a prefill of the accepted tokens gives."""
    prompts = random_prompts(3, target.vocab_size, lengths=(6, 13, 9), seed=4)
    kv, _ = target.prefill(prompts)
    block = torch.randint(0, target.vocab_size, (3, 5))
    target.forward(kv, block, torch.tensor([5, 5, 3]))
    keep = torch.tensor([2, 5, 1])
    kv.commit(keep)
    kv.compact()
    assert_rows_are_fresh_prefills(target, kv, [p + block[b, : keep[b]].tolist() for b, p in enumerate(prompts)])


def assert_rows_are_fresh_prefills(target, kv: KVBatch, tokens: list[list[int]]) -> None:
    """Row b of `kv` holds exactly a fresh prefill of `tokens[b]`, and the next forward sees the same
    logits as on that fresh cache."""
    assert kv.lengths.tolist() == [len(t) for t in tokens]
    for b, t in enumerate(tokens):
        ref, _ = target.prefill([t])
        for layer in range(target.num_layers):
            k1, v1 = _row_kv(kv, b, layer)
            k2, v2 = _row_kv(ref, 0, layer)
            assert torch.allclose(k1, k2, atol=1e-5) and torch.allclose(v1, v2, atol=1e-5)
    nxt = torch.randint(0, target.vocab_size, (len(tokens), 1))
    out = target.forward(kv, nxt, torch.ones(len(tokens), dtype=torch.long))
    for b, t in enumerate(tokens):
        ref, _ = target.prefill([t])
        o2 = target.forward(ref, nxt[b : b + 1], torch.ones(1, dtype=torch.long))
        assert torch.allclose(out.logits[b], o2.logits[0], atol=1e-4)


def test_requests_join_and_leave():
    """Staggered arrivals (continuous batching) give the same greedy outputs as solo runs."""
    target = tiny_target("qwen3", seed=5)
    prompts = random_prompts(4, target.vocab_size, lengths=(8, 21, 4, 15), seed=2)
    solo = [
        SpeculativeEngine(target).generate([p], SamplingParams(max_tokens=12 + 7 * i))[0][0].token_ids
        for i, p in enumerate(prompts)
    ]
    eng = SpeculativeEngine(target, NgramDrafter(prompt_lookup_min=1), 4)
    reqs = []
    for i, p in enumerate(prompts):
        reqs.append(eng.add_request(p, SamplingParams(max_tokens=12 + 7 * i)))
        eng.step()
    while eng.has_unfinished:
        eng.step()
    assert [r.output_ids for r in reqs] == solo


def test_rows_leave_and_join_in_place(target):
    """A finished request's row takes the last row; an admitted one fills the spare row, without
    re-allocating the cache; every row then holds exactly a fresh prefill of its tokens."""
    prompts = random_prompts(4, target.vocab_size, lengths=(9, 14, 6, 11), seed=6)
    kv, _ = target.prefill(prompts)
    block = torch.randint(0, target.vocab_size, (4, 3))
    target.forward(kv, block, torch.full((4,), 3))
    kv.commit(torch.tensor([3, 1, 2, 3]))
    tokens = [p + block[b, : [3, 1, 2, 3][b]].tolist() for b, p in enumerate(prompts)]
    buffer = kv.cache.layers[0]._kbuf.data_ptr()
    order = kv.drop([0, 2])
    assert order == [3, 1]
    tokens = [tokens[b] for b in order]
    new = random_prompts(2, target.vocab_size, lengths=(5, 8), seed=7)
    kv.extend(target.prefill(new)[0])
    tokens += new
    assert kv.cache.layers[0]._kbuf.data_ptr() == buffer  # written in place
    assert_rows_are_fresh_prefills(target, kv, tokens)


def test_taps_capture_hidden_states(target):
    prompts = random_prompts(2, target.vocab_size, lengths=(7, 4))
    target.set_taps((0, 1, target.num_layers))
    try:
        kv, out = target.prefill(prompts)
        # HF's last hidden state has the final norm applied: the last layer's own output is hooked
        cap = {}
        hook = target.model.model.layers[-1].register_forward_hook(
            lambda m, i, o: cap.setdefault("last", o[0] if isinstance(o, tuple) else o)
        )
        with torch.no_grad():
            ref = target.model(torch.tensor([prompts[0]]), output_hidden_states=True).hidden_states
        hook.remove()
        H = target.hidden_size
        f = out.features[0, : len(prompts[0])]
        assert f.shape[-1] == 3 * H
        assert torch.allclose(f[:, :H], ref[0][0], atol=1e-5)
        assert torch.allclose(f[:, H : 2 * H], ref[1][0], atol=1e-5)
        # the last layer's values reach ~1e2 here: the batched prefill's rounding is relative to them
        assert torch.allclose(f[:, 2 * H :], cap["last"][0], rtol=1e-4, atol=1e-4)
    finally:
        target.set_taps(())


def test_stop_conditions():
    target = tiny_target("llama", seed=7)
    prompt = random_prompts(1, target.vocab_size, seed=1)[0]
    ref = SpeculativeEngine(target).generate([prompt], SamplingParams(max_tokens=30))[0][0].token_ids
    stop_tok = ref[10]
    first = ref.index(stop_tok)
    out = SpeculativeEngine(target, NgramDrafter(), 5).generate(
        [prompt], SamplingParams(max_tokens=30, stop_token_ids=[stop_tok])
    )[0][0]
    assert out.token_ids == ref[: first + 1] and out.finish_reason == "stop"
    target.eos_token_ids = {stop_tok}
    out = SpeculativeEngine(target).generate([prompt], SamplingParams(max_tokens=30))[0][0]
    assert out.token_ids == ref[: first + 1] and out.finish_reason == "stop"
    out = SpeculativeEngine(target).generate([prompt], SamplingParams(max_tokens=30, ignore_eos=True))[0][0]
    assert out.token_ids == ref and out.finish_reason == "length"


def test_context_limit_ends_generation():
    target = tiny_target("llama", seed=8, max_position_embeddings=40)
    prompt = random_prompts(1, target.vocab_size, lengths=(30,))[0]
    out = SpeculativeEngine(target, NgramDrafter(), 5).generate([prompt], SamplingParams(max_tokens=100))[0][0]
    assert len(prompt) + len(out.token_ids) == 40 and out.finish_reason == "length"


def test_seeded_sampling_is_reproducible():
    target = tiny_target("llama", seed=2)
    prompts = random_prompts(3, target.vocab_size)
    sp = SamplingParams(temperature=1.0, seed=123, max_tokens=20)
    a = [o.token_ids for o in SpeculativeEngine(target, NgramDrafter(), 4).generate(prompts, sp)[0]]
    b = [o.token_ids for o in SpeculativeEngine(target, NgramDrafter(), 4).generate(prompts[::-1], sp)[0]][::-1]
    assert a == b  # a request's randomness is its own, whatever batch it runs in


@pytest.mark.parametrize("bf16_units", [True, False])
def test_warns_where_bf16_verification_is_slow(monkeypatch, recwarn, bf16_units):
    """A bf16 target on a CPU without bf16 matrix instructions gets a warning when a drafter loads
    (verifying n tokens costs ~n decode steps there); float32, or a CPU with them, gets none."""
    from dcoco.speculative import SpeculativeConfig, load_drafter

    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: bf16_units)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    ngram = SpeculativeConfig(method="ngram")
    load_drafter(ngram, Target(tiny_model().to(torch.bfloat16)))
    assert any("bf16 matrix" in str(w.message) for w in recwarn) != bf16_units
    recwarn.clear()
    load_drafter(ngram, tiny_target())  # float32
    assert load_drafter(SpeculativeConfig(method="vanilla"), Target(tiny_model().to(torch.bfloat16))) is None
    assert not any("bf16 matrix" in str(w.message) for w in recwarn)
