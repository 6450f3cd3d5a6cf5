"""Decoder-layer pieces for drafters (RMSNorm, RoPE, SwiGLU, and attention over an external
context plus a query block). Written for clarity and for CPU speed: plain torch ops and SDPA."""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F


def at_least_float32(x: torch.Tensor) -> torch.Tensor:
    """x in float32, or float64 when it already is: losses upcast bf16 logits, and the float64
    exactness tests (context parallel against one process) must not lose digits there."""
    return x if x.dtype == torch.float64 else x.float()


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = at_least_float32(x)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """cos, sin of shape (*positions.shape, head_dim) for the default (unscaled) rotary embedding."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim))
    ang = positions.float().unsqueeze(-1) * inv_freq
    emb = torch.cat([ang, ang], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (N, heads, n, D); cos/sin: (N, n, D)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rot * sin


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class ContextAttention(nn.Module):
    """Queries attend to [context keys ; query keys]: context K/V come from a separate feature
    stream (the target's fused hidden states), the others from the queries themselves. `mask`
    (N, 1, M, T + M), True = visible, encodes everything else: which context slots a query sees and
    the structure among the M queries (one bidirectional block at inference; many blocks, each
    seeing only itself and the context before its anchor, in training). Instead of a mask, `mask`
    may be a function attend(q, k, v, ctx_k, ctx_v) -> (N, heads, M, head_dim) that replaces the
    attention itself: context parallelism, where the context K/V are one rank's shard
    (`dcoco.parallel.draft_loss.ContextShard`)."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, eps: float, qk_norm: bool = True):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)
        self.q_norm = RMSNorm(head_dim, eps) if qk_norm else nn.Identity()
        self.k_norm = RMSNorm(head_dim, eps) if qk_norm else nn.Identity()

    def kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys (with RoPE) and values of x (N, n, hidden) -> (N, kv_heads, n, head_dim)."""
        N, n, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(N, n, self.kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(N, n, self.kv_heads, self.head_dim).transpose(1, 2)
        return apply_rope(k, cos, sin), v

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        ctx_k: torch.Tensor,
        ctx_v: torch.Tensor,
        mask: Optional[torch.Tensor | Callable[..., torch.Tensor]],
    ) -> torch.Tensor:
        N, B, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(N, B, self.heads, self.head_dim)).transpose(1, 2)
        q = apply_rope(q, cos, sin)
        kb, vb = self.kv(x, cos, sin)
        if not (mask is None or isinstance(mask, torch.Tensor)):
            out = mask(q, kb, vb, ctx_k, ctx_v)
            return self.o_proj(out.transpose(1, 2).reshape(N, B, self.heads * self.head_dim))
        k = torch.cat([ctx_k, kb], dim=2)
        v = torch.cat([ctx_v, vb], dim=2)
        rep = self.heads // self.kv_heads
        if rep > 1:
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.o_proj(out.transpose(1, 2).reshape(N, B, self.heads * self.head_dim))


class DraftDecoderLayer(nn.Module):
    """Pre-norm decoder layer (Llama/Qwen3 shape) whose attention also sees an external context."""

    def __init__(
        self, hidden: int, intermediate: int, heads: int, kv_heads: int, head_dim: int, eps: float, qk_norm: bool = True
    ):
        super().__init__()
        self.input_layernorm = RMSNorm(hidden, eps)
        self.self_attn = ContextAttention(hidden, heads, kv_heads, head_dim, eps, qk_norm)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.mlp = SwiGLU(hidden, intermediate)

    def forward(self, x, cos, sin, ctx_k, ctx_v, mask):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, ctx_k, ctx_v, mask)
        return x + self.mlp(self.post_attention_layernorm(x))
