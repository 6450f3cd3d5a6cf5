"""The target's decoder stack as few tensor ops as possible, for Llama-family models.

A decode step of a small model on a CPU costs more in dispatch than in weight streaming: each of
the ~100 tensor ops per decoder layer of Hugging Face's forward costs a few microseconds, against
~8 ms for all of SmolLM2-135M's int4 weights. `LeanDecoder` computes what that forward computes
(the same weights, norms, rotary embedding, attention function and cache) with q/k/v and gate/up
each one product over a fused weight, and the rotary embedding, residuals and taps written out:
7-13% more tokens/s on a 2-core CPU (`scripts/lean_ab.py`, docs/experiments).

Fused weights are built on first use and rebuilt when a source weight changes (an optimizer step
on a policy). Other architectures, and sliding-window attention, take Hugging Face's forward.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from .prepack import PrepackedLinear, _weight_key, prepack_enabled
from .quantize import Int4Linear, Int8Linear, _concat_biases

SUPPORTED = ("llama", "qwen2", "qwen3")  # decoder layers of Llama's structure (Qwen3: q/k norms)


def lean_supported(model: nn.Module) -> bool:
    """A decoder-only model of Llama's structure with SiLU MLPs and no sliding window."""
    cfg = model.config
    return (
        cfg.model_type in SUPPORTED
        and getattr(cfg, "hidden_act", "silu") == "silu"
        and not (getattr(cfg, "use_sliding_window", False) and getattr(cfg, "sliding_window", None))
        and hasattr(model, "model")
        and hasattr(model.model, "rotary_emb")
    )


def _key(mods: Sequence[nn.Module]) -> tuple:
    """Changes when a source weight is replaced or changed in place."""
    return tuple(_weight_key(m.qweight if isinstance(m, (Int4Linear, Int8Linear)) else m.weight) for m in mods)


def fuse_linears(mods: Sequence[nn.Module]) -> nn.Module:
    """One linear layer whose outputs are `mods`' outputs side by side, of the same kind."""
    kinds = {type(m) for m in mods}
    if kinds == {Int4Linear}:
        return Int4Linear.concat(mods)
    if kinds == {Int8Linear}:
        return Int8Linear.concat(mods)
    weight = torch.cat([m.weight.detach() for m in mods])
    bias = _concat_biases(mods)
    bias = None if bias is None else bias.detach()
    fused = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    fused.weight = nn.Parameter(weight, requires_grad=False)
    fused.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
    if weight.dtype == torch.bfloat16 and weight.device.type == "cpu" and prepack_enabled():
        fused.__class__ = PrepackedLinear
    return fused


class LeanDecoder:
    """`model`'s forward over a KV cache, as `Target.forward` calls it (see module docstring)."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.layers = list(model.model.layers)
        self._fused: list[Optional[tuple]] = [None] * len(self.layers)

    def _fused_layer(self, i: int) -> tuple[nn.Module, nn.Module]:
        layer = self.layers[i]
        a, mlp = layer.self_attn, layer.mlp
        sources = (a.q_proj, a.k_proj, a.v_proj, mlp.gate_proj, mlp.up_proj)
        key = _key(sources)
        cached = self._fused[i]
        if cached is None or cached[0] != key:
            cached = self._fused[i] = (key, fuse_linears(sources[:3]), fuse_linears(sources[3:]))
        return cached[1], cached[2]

    def forward(
        self,
        tokens: torch.Tensor,
        position_ids: torch.Tensor,
        mask: Optional[torch.Tensor],
        cache,
        logits_to_keep,
        taps: Sequence[int] = (),
        captured: Optional[dict] = None,
    ) -> torch.Tensor:
        """Logits (B, n, V) in the model's dtype at `logits_to_keep` (as HF's `logits_to_keep`);
        the hidden states at `taps` go into `captured` (the target's tap convention)."""
        from transformers.modeling_utils import slice_logits_to_keep

        base = self.model.model
        cfg = self.model.config
        h = base.embed_tokens(tokens)
        if 0 in taps:
            captured[0] = h
        B, q = tokens.shape
        cos, sin = base.rotary_emb(h, position_ids)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # (B, 1, q, d): every head alike
        attend = ALL_ATTENTION_FUNCTIONS[cfg._attn_implementation]
        for i, layer in enumerate(self.layers):
            a = layer.self_attn
            qkv, gate_up = self._fused_layer(i)
            d = a.head_dim
            Hq, Hkv = a.q_proj.out_features // d, a.k_proj.out_features // d
            x = qkv(layer.input_layernorm(h)).view(B, q, Hq + 2 * Hkv, d)
            qs, ks, vs = x[:, :, :Hq], x[:, :, Hq : Hq + Hkv], x[:, :, Hq + Hkv :]
            if hasattr(a, "q_norm"):
                qs, ks = a.q_norm(qs), a.k_norm(ks)
            qs, ks, vs = qs.transpose(1, 2), ks.transpose(1, 2), vs.transpose(1, 2)
            qs, ks = _rotate(qs, cos, sin), _rotate(ks, cos, sin)
            ks, vs = cache.layers[i].update(ks, vs)
            o, _ = attend(a, qs, ks, vs, mask, dropout=0.0, scaling=a.scaling)
            h = h + a.o_proj(o.reshape(B, q, -1))
            g, u = gate_up(layer.post_attention_layernorm(h)).chunk(2, dim=-1)
            h = h + layer.mlp.down_proj(F.silu(g) * u)
            if i + 1 in taps:
                captured[i + 1] = h
        h = base.norm(slice_logits_to_keep(h, logits_to_keep))
        return self.model.lm_head(h)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Hugging Face's rotary embedding (rotate_half), op for op."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin
