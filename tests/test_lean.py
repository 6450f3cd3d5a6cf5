"""The lean decoder (`dcoco.nn.lean`) computes what Hugging Face's forward computes: the same logits
and tapped features, bit for bit, through prefill, verification with padding and holes, and
decoding; for Llama and Qwen3 layers, with biases, in float32 and bf16, quantized and exact."""

from __future__ import annotations

import pytest
import torch
from conftest import random_prompts, tiny_model

from dcoco.nn.quantize import quantize_linears
from dcoco.target import Target


def _pair(model, exact=False):
    lean, plain = Target(model, exact=exact), Target(model, exact=exact)
    plain._lean = None
    assert lean._lean is not None
    for t in (lean, plain):
        t.set_taps([0, 2, 3])
    return lean, plain


def _same(a, b):
    assert torch.equal(a.logits, b.logits) and torch.equal(a.features, b.features)


@pytest.mark.parametrize(
    "family,over,dtype,quantization,exact",
    [
        ("llama", {}, torch.float32, "none", False),
        ("qwen3", {}, torch.float32, "none", False),
        ("llama", {"attention_bias": True}, torch.float32, "none", False),
        ("llama", {}, torch.bfloat16, "none", False),
        ("qwen3", {}, torch.bfloat16, "int4", False),
        ("llama", {}, torch.bfloat16, "int8", True),
    ],
)
def test_lean_forward_equals_hugging_faces(family, over, dtype, quantization, exact):
    model = tiny_model(family, seed=1, **over).to(dtype)
    quantize_linears(model, quantization)
    lean, plain = _pair(model, exact)
    prompts = random_prompts(3, lean.vocab_size, seed=3)
    (kv1, a), (kv2, b) = lean.prefill(prompts), plain.prefill(prompts)
    _same(a, b)
    gen = torch.Generator().manual_seed(0)
    for step in range(4):  # verification blocks, partly kept: holes in the cache; then 1-token steps
        q = 4 if step < 2 else 1
        tokens = torch.randint(0, lean.vocab_size, (3, q), generator=gen)
        n = torch.tensor([q, max(1, q - 2), q - 1 if q > 1 else 1])
        _same(lean.forward(kv1, tokens, n), plain.forward(kv2, tokens, n))
        keep = torch.minimum(n, torch.tensor([1, 2, 3]))
        kv1.commit(keep)
        kv2.commit(keep)


def test_lean_fused_weights_follow_their_sources():
    """A policy's optimizer changes the weights in place: the fused copies are rebuilt."""
    model = tiny_model("llama", seed=2)
    lean, plain = _pair(model)
    prompts = random_prompts(2, lean.vocab_size, seed=4)
    before = lean.prefill(prompts)[1]
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.k_proj.weight.mul_(1.5)
            layer.mlp.up_proj.weight.add_(0.01)
    after = lean.prefill(prompts)[1]
    assert not torch.equal(before.logits, after.logits)
    _same(after, plain.prefill(prompts)[1])
