"""Per-call time of the target's attention on CPU: PyTorch SDPA with `enable_gqa` (K/V shared by
groups of query heads) against `dcoco.nn.attention.packed_gqa_attention` (the query heads of a
group stacked, plain SDPA), at decoding, verification and prefill shapes of SmolLM2 (9 query heads,
3 K/V heads, head size 64), bf16. Then a drafter training pass's block attention, forward and
backward, in the DFlash stage config's shape (4 sequences of up to 1,024 tokens, 128 anchors each,
blocks of 8): one mask over every key (`training_mask`, K/V repeated per query head) against
`AnchorGroupAttention` at several group sizes.

  python scripts/attention_kernels.py [--threads 2]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from dcoco.drafters.dflash import AnchorGroupAttention, training_mask
from dcoco.nn.attention import packed_gqa_attention
from dcoco.train.batch import sample_anchors

SHAPES = [(1, 1, 457), (1, 5, 457), (1, 16, 457), (8, 16, 457), (32, 1, 457), (32, 5, 457), (64, 1, 600), (8, 400, 400)]


def per_call_ms(fn, repeats: int = 20) -> float:
    for _ in range(3):
        fn()
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - t0) / repeats * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    module = torch.nn.Module().eval()
    print("| requests | queries | keys | SDPA enable_gqa (ms) | packed (ms) | ratio |")
    print("|---:|---:|---:|---:|---:|---:|")
    for B, q, L in SHAPES:
        query = torch.randn(B, 9, q, 64, dtype=torch.bfloat16)
        key, value = torch.randn(B, 3, L, 64, dtype=torch.bfloat16), torch.randn(B, 3, L, 64, dtype=torch.bfloat16)
        mask = torch.ones(q, L, dtype=torch.bool).tril(L - q).expand(B, 1, q, L)
        args_ = (query, key, value, mask)
        gqa = per_call_ms(lambda a=args_: F.scaled_dot_product_attention(*a[:3], attn_mask=a[3], enable_gqa=True))
        packed = per_call_ms(lambda a=args_: packed_gqa_attention(module, *a))
        print(f"| {B} | {q} | {L} | {gqa:.3f} | {packed:.3f} | {gqa / packed:.2f}x |")
    training_attention()


def training_attention(lengths=(1024, 700, 450, 900), prompt_len=100, A=128, B=8, repeats=5) -> None:
    """Forward and backward of one drafter layer's block attention over sequences of `lengths`."""
    gen = torch.Generator().manual_seed(0)
    S, T = len(lengths), max(lengths)
    anchors = torch.tensor([sample_anchors(prompt_len, n, A, gen) for n in lengths])
    q = torch.randn(S, 9, A * B, 64, dtype=torch.bfloat16, generator=gen).requires_grad_()
    kb, vb = (torch.randn(S, 3, A * B, 64, dtype=torch.bfloat16, generator=gen).requires_grad_() for _ in range(2))
    ck, cv = (torch.randn(S, 3, T, 64, dtype=torch.bfloat16, generator=gen).requires_grad_() for _ in range(2))
    mask = training_mask(anchors, T, B)

    def one_mask(q, kb, vb, ck, cv):
        k, v = torch.cat([ck, kb], 2).repeat_interleave(3, 1), torch.cat([cv, vb], 2).repeat_interleave(3, 1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    def forward_backward(make) -> None:
        out = make()(q, kb, vb, ck, cv)
        out.backward(torch.ones_like(out))

    sizes = ", ".join(map(str, lengths))
    print(f"\n{S} sequences ({sizes} tokens), {A} anchors each, blocks of {B}, forward + backward:\n")
    print("| attention | ms | vs one mask |")
    print("|---|---:|---:|")
    base = per_call_ms(lambda: forward_backward(lambda: one_mask), repeats)
    print(f"| one mask over every key | {base:.1f} | 1.00x |")
    for g in (64, 128, 256, 512):
        ms = per_call_ms(lambda g=g: forward_backward(lambda: AnchorGroupAttention(anchors, B, g)), repeats)
        print(f"| AnchorGroupAttention, groups of {g} queries | {ms:.1f} | {base / ms:.2f}x |")


if __name__ == "__main__":
    main()
