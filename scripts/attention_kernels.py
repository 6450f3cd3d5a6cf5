"""Per-call time of the target's attention on CPU: PyTorch SDPA with `enable_gqa` (K/V shared by
groups of query heads) against `dcoco.nn.attention.packed_gqa_attention` (the query heads of a
group stacked, plain SDPA), at decoding, verification and prefill shapes of SmolLM2 (9 query heads,
3 K/V heads, head size 64), bf16.

  python scripts/attention_kernels.py [--threads 2]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from dcoco.nn.attention import packed_gqa_attention

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


if __name__ == "__main__":
    main()
