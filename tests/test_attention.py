"""The packed grouped-query attention equals reference attention with K/V repeated per query head."""

import pytest
import torch
import torch.nn.functional as F

from dcoco.nn.attention import packed_gqa_attention


def reference(q, k, v, mask):
    n = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(n, 1), v.repeat_interleave(n, 1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2)


@pytest.mark.parametrize(
    "B,q,L,per_head,additive", [(3, 1, 17, False, False), (2, 5, 23, False, True), (2, 4, 9, True, False)]
)
def test_packed_gqa_matches_repeated_kv(B, q, L, per_head, additive):
    torch.manual_seed(0)
    H, Hkv, d = 6, 2, 8
    query, key, value = torch.randn(B, H, q, d), torch.randn(B, Hkv, L, d), torch.randn(B, Hkv, L, d)
    mask = torch.rand(B, H if per_head else 1, q, L) > 0.3
    mask[..., 0] = True  # every row sees something
    if additive:
        mask = torch.zeros(mask.shape).masked_fill(~mask, float("-inf"))
    module = torch.nn.Module().eval()
    out, _ = packed_gqa_attention(module, query, key, value, mask)
    assert out.shape == (B, q, H, d)
    torch.testing.assert_close(out, reference(query, key, value, mask), atol=1e-6, rtol=1e-5)
