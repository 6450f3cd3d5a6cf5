"""Grouped-query attention as one plain SDPA call per K/V head, for the target on CPU.

With grouped-query attention (SmolLM2: 9 query heads share 3 K/V heads) PyTorch's CPU SDPA either
repeats K/V per query head or takes `enable_gqa`; both are slow when few queries meet a long cache,
which is every decoding and verification pass: one step of 32 requests (1 query over 457 keys)
spent 9.5 ms per layer in SDPA, 77% of the step. Stacking the queries that share a K/V head into
one longer query block, (B, H, q, d) -> (B, H_kv, (H/H_kv)*q, d), is the same math as plain
attention over H_kv heads: 1.9 ms for that step, and 0.31 -> 0.09 ms for one request
(`scripts/attention_kernels.py`). Registered with transformers as `dcoco_gqa`; the target selects
it on CPU. Forwards without an explicit mask (causal training forwards) take transformers' SDPA.

`dcoco_gqa_exact` (`Target(exact=True)`, `--exact`) attends every query row on its own: the keys it
sees, gathered in order, one SDPA call without a mask. A token's attention then does not depend on
how many tokens share its pass nor on the cache's holes and padding, so a k+1-token verification
pass gives each token bitwise the logits of a 1-token decoding step (norms and rotary embedding are
row-invariant already, the linear layers from two rows up, so `Target.forward` runs a lone token with
a padding slot): greedy speculative output equals vanilla's in bf16.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

NAME = "dcoco_gqa"
EXACT_NAME = "dcoco_gqa_exact"


def packed_gqa_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: query (B, H, q, d), key/value (B, H_kv, L, d),
    a boolean or additive mask (B or 1, 1 or H, q, L); returns (B, q, H, d)."""
    B, H, q, d = query.shape
    Hkv = key.shape[1]
    n = H // Hkv
    if attention_mask is None or attention_mask.dim() != 4:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs)
    mask = pack_gqa_mask(attention_mask, n, Hkv)
    if n > 1:
        query = query.reshape(B, Hkv, n * q, d)  # head h = g * n + r reads K/V head g
    out = F.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, dropout_p=dropout if module.training else 0.0, scale=scaling
    )
    return out.reshape(B, H, q, d).transpose(1, 2).contiguous(), None


def pack_gqa_mask(mask: torch.Tensor, n: int, kv_heads: int) -> torch.Tensor:
    """A mask (B or 1, 1 or H, q, L) for the stacked query block of `packed_gqa_attention`, where
    `n` query heads share each of `kv_heads` K/V heads: (B or 1, 1 or H_kv, n*q, L)."""
    if n == 1:
        return mask
    Bm, _, q, L = mask.shape
    if mask.shape[1] == 1:
        return mask.unsqueeze(2).expand(Bm, 1, n, q, L).reshape(Bm, 1, n * q, L)
    return mask.reshape(Bm, kv_heads, n * q, L)


def exact_gqa_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """`packed_gqa_attention`, one query row at a time over exactly the keys it sees (see above)."""
    if attention_mask is None or attention_mask.dim() != 4:
        return packed_gqa_attention(module, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs)
    B, H, q, d = query.shape
    Hkv = key.shape[1]
    out = query.new_empty(B, q, H, d)
    for b in range(B):
        mask = attention_mask[b if attention_mask.shape[0] > 1 else 0, 0]  # (q, L)
        # a row that sees a prefix of the slots (no holes before its last key) reads a view of the
        # cache instead of a gathered copy: SDPA gives the same bits on either, at half the time
        seen_count = mask.sum(-1).tolist()
        prefix = mask.to(torch.uint8).cumprod(-1).sum(-1).tolist()
        for i in range(q):
            if prefix[i] == seen_count[i]:
                k, v = key[b : b + 1, :, : prefix[i]], value[b : b + 1, :, : prefix[i]]
            else:
                seen = mask[i]
                k, v = key[b : b + 1, :, seen].contiguous(), value[b : b + 1, :, seen].contiguous()
            rows = query[b : b + 1, :, i].reshape(1, Hkv, H // Hkv, d).contiguous()  # head h = g * n + r
            out[b, i] = F.scaled_dot_product_attention(rows, k, v, scale=scaling).reshape(H, d)
    return out, None


def register(exact: bool = False) -> str:
    """Make `dcoco_gqa` (or `dcoco_gqa_exact`) a transformers attention implementation (idempotent);
    returns its name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    name = EXACT_NAME if exact else NAME
    AttentionInterface.register(name, exact_gqa_attention if exact else packed_gqa_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(name, sdpa_mask)
    return name
