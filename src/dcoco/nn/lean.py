"""The target's decoder stack as few tensor ops and as little Python as possible, for Llama-family
models.

A decode step of a small model on a CPU costs more in dispatch than in weight streaming: each of
the ~100 tensor ops per decoder layer of Hugging Face's forward costs a few microseconds, and each
module call and attribute lookup around them a microsecond more, against ~8 ms for all of
SmolLM2-135M's int4 weights. `LeanDecoder` computes what that forward computes (the same weights,
norms, rotary embedding, attention function and cache, bit for bit) with:
- q/k/v and gate/up each one product over a fused weight;
- the layers' modules and weights looked up once into a plan, their forwards called directly;
- RMSNorm as one `rms_norm` op, the rotary embedding of q and k as one, the packed attention mask
  built once per forward instead of once per layer (`scripts/lean_ab.py`, docs/experiments).

The plan (with its fused weights) is built on first use and rebuilt when a fused source weight
changes in place (an optimizer step or a `load_state_dict` on a policy). Modules or weights replaced
after the `Target` is built are not seen: quantize first, as `Target.from_pretrained` does. Other
architectures, and sliding-window attention, take Hugging Face's forward.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from .attention import NAME as PACKED_ATTENTION
from .attention import pack_gqa_mask
from .prepack import PrepackedLinear, prepack_enabled
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
    if weight.device.type == "cpu" and prepack_enabled(weight.dtype):
        fused.__class__ = PrepackedLinear
    return fused


class _Layer(NamedTuple):
    """One decoder layer as the lean forward reads it."""

    input_norm: torch.Tensor  # RMSNorm weights
    post_norm: torch.Tensor
    qkv: Callable[[torch.Tensor], torch.Tensor]  # forwards, called without nn.Module's hook machinery
    o_proj: Callable[[torch.Tensor], torch.Tensor]
    gate_up: Callable[[torch.Tensor], torch.Tensor]
    down_proj: Callable[[torch.Tensor], torch.Tensor]
    attn: nn.Module  # for transformers' attention functions
    q_norm: Optional[nn.Module]  # Qwen3's per-head q/k norms, else None
    k_norm: Optional[nn.Module]
    heads: int
    kv_heads: int
    head_dim: int


class LeanDecoder:
    """`model`'s forward over a KV cache, as `Target.forward` calls it (see module docstring)."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.layers = list(model.model.layers)
        self.eps = model.config.rms_norm_eps
        self._sources = [
            (
                layer.self_attn.q_proj,
                layer.self_attn.k_proj,
                layer.self_attn.v_proj,
                layer.mlp.gate_proj,
                layer.mlp.up_proj,
            )
            for layer in self.layers
        ]
        # the fused copies' sources that can change in place: not quantized layers (frozen), nor
        # inference-mode tensors
        weights = (m.weight for s in self._sources for m in s if not isinstance(m, (Int4Linear, Int8Linear)))
        self._tracked = [w for w in weights if not w.is_inference()]
        self._plan: list[_Layer] = []
        self._plan_key: Optional[int] = None

    def _layers(self) -> list[_Layer]:
        key = sum(w._version for w in self._tracked)  # versions only grow: any in-place change shows
        if key != self._plan_key or not self._plan:
            dtype = self.model.model.embed_tokens.weight.dtype
            self._plan = [self._build(layer, mods, dtype) for layer, mods in zip(self.layers, self._sources)]
            self._plan_key = key
        return self._plan

    @staticmethod
    def _build(layer: nn.Module, sources: tuple, dtype: torch.dtype) -> _Layer:
        a, d = layer.self_attn, layer.self_attn.head_dim
        return _Layer(
            input_norm=layer.input_layernorm.weight,
            post_norm=layer.post_attention_layernorm.weight,
            qkv=_forward(fuse_linears(sources[:3]), dtype),
            o_proj=_forward(a.o_proj, dtype),
            gate_up=_forward(fuse_linears(sources[3:]), dtype),
            down_proj=_forward(layer.mlp.down_proj, dtype),
            attn=a,
            q_norm=getattr(a, "q_norm", None),
            k_norm=getattr(a, "k_norm", None),
            heads=a.q_proj.out_features // d,
            kv_heads=a.k_proj.out_features // d,
            head_dim=d,
        )

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

        base, cfg, eps = self.model.model, self.model.config, self.eps
        h = base.embed_tokens(tokens)
        if 0 in taps:
            captured[0] = h
        B, q = tokens.shape
        cos, sin = base.rotary_emb(h, position_ids)  # (B, q, d)
        half = cos.shape[-1] // 2
        # rotate_half(x) * sin == flip_halves(x) * (sin with its first half negated), bit for bit
        cos, sin = cos.unsqueeze(2), torch.cat((-sin[..., :half], sin[..., half:]), dim=-1).unsqueeze(2)
        packed = cfg._attn_implementation == PACKED_ATTENTION and mask is not None and mask.dim() == 4
        attend = None if packed else ALL_ATTENTION_FUNCTIONS[cfg._attn_implementation]
        packed_mask = None
        for i, L in enumerate(self._layers()):
            Hq, Hkv, d = L.heads, L.kv_heads, L.head_dim
            x = L.qkv(_rms_norm(h, L.input_norm, eps)).view(B, q, Hq + 2 * Hkv, d)
            if L.q_norm is not None:
                qk = torch.cat((L.q_norm(x[:, :, :Hq]), L.k_norm(x[:, :, Hq : Hq + Hkv])), dim=2)
            else:
                qk = x[:, :, : Hq + Hkv]
            qk = _rotate(qk, cos, sin)
            qs, ks, vs = (
                qk[:, :, :Hq].transpose(1, 2),
                qk[:, :, Hq:].transpose(1, 2),
                x[:, :, Hq + Hkv :].transpose(1, 2),
            )
            ks, vs = cache.layers[i].update(ks, vs)
            if packed:
                if packed_mask is None:  # once per forward, additive as SDPA would make it in every layer
                    packed_mask = pack_gqa_mask(_additive(mask, h.dtype), Hq // Hkv, Hkv)
                o = F.scaled_dot_product_attention(
                    qs.reshape(B, Hkv, q * Hq // Hkv, d), ks, vs, attn_mask=packed_mask, scale=L.attn.scaling
                )
                o = o.view(B, Hq, q, d).transpose(1, 2)
            else:
                o, _ = attend(L.attn, qs, ks, vs, mask, dropout=0.0, scaling=L.attn.scaling)
            h = h + L.o_proj(o.reshape(B, q, -1))
            g, u = L.gate_up(_rms_norm(h, L.post_norm, eps)).chunk(2, dim=-1)
            h = h + L.down_proj(F.silu(g) * u)
            if i + 1 in taps:
                captured[i + 1] = h
        h = base.norm(slice_logits_to_keep(h, logits_to_keep))
        return self.model.lm_head(h)


def _forward(linear: nn.Module, dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor]:
    """A linear layer's forward for inputs of `dtype`, without nn.Module's call machinery."""
    return linear.bound_forward(dtype) if isinstance(linear, (Int4Linear, Int8Linear)) else linear.forward


def _additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask (True = visible) as SDPA converts it: 0 where visible, -inf elsewhere."""
    if mask.dtype != torch.bool:
        return mask
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


def _rms_norm(h: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Hugging Face's Llama RMSNorm (in float32, then weight times the result in the input's dtype)
    as one `rms_norm` op, which computes in float32 too: the same bits (tests/test_lean.py)."""
    return weight * F.rms_norm(h, h.shape[-1:], eps=eps)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Hugging Face's rotary embedding, x * cos + rotate_half(x) * sin, on x (B, q, heads, d) with the
    halves of x swapped by one flip and `sin`'s first half negated (see `LeanDecoder.forward`)."""
    d = x.shape[-1]
    return x * cos + x.unflatten(-1, (2, d // 2)).flip(-2).flatten(-2) * sin
